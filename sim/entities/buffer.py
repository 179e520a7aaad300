"""The buffer that admits, holds and batches rollout groups (``sim.entities.groups``).

The buffer is the simulated twin of the runtime's RolloutBuffer plus AReaL's rollout
controller, and keeps its books in the same ``rlaxkit.rules.ledger.GroupLedger``: admission
(``accepted + running < (η + version + 1) · batch_size``), drops with their reasons,
batch order, and what lost work and trainer restores do are the runtime's decisions,
made by the same code under the same policies.

Counting unit: one prompt group (``group_size`` samples), as AReaL counts episodes.
``accepted`` is the groups consumed by surviving steps plus those waiting here.
Admission uses the newest *published* version: AReaL bumps its version only once the
new weights reached the rollout engines, so a generation admitted for version ``v``
can be sampled with ``v``. A lost group is generated again with the same id (and the
same lengths: the same prompt, the same sampling seed), as the runtime re-issues it.
"""

from __future__ import annotations

import zlib
from collections import deque
from typing import TYPE_CHECKING, cast

import numpy as np
import simpy

from rlaxkit.rules.audit import AuditRecord
from rlaxkit.rules.ledger import GroupLedger
from sim.entities.groups import Group, StartRequest

if TYPE_CHECKING:
    from sim.entities.context import SimContext

__all__ = ["SimBuffer"]


class SimBuffer:
    """Admission, the queue of finished groups and batching, on the runtime's books.

    Every decision is the ``GroupLedger``'s (``rlaxkit.rules.ledger``), the very code the
    runtime's buffer uses, under the scenario's policies; this class adds what the
    simulation needs around it: SimPy events for workers waiting to start and for the
    trainer waiting for a batch, re-issued prompts handed to the next worker that asks,
    and the counters and trace of every drop.
    """

    name = "buffer"

    def __init__(self, sim: SimContext) -> None:
        self.sim = sim
        self.env = sim.env
        scenario = sim.scenario
        self.policy = scenario.staleness
        self.batch_size = self.policy.batch_size
        self.ledger = GroupLedger(self.policy, scenario.batching, scenario.recovery)
        self.ledger.on_drop = self._on_drop
        self.published_version = 0
        self.trainer_version = 0
        self.reissue: deque[Group] = deque()  # lost groups to generate again, oldest first
        self.in_flight: dict[int, Group] = {}  # the current generation of each id
        self._waiting: deque[StartRequest] = deque()
        self._batch_event: simpy.Event | None = None
        # Its own stream, drawn only when filtering is on, so runs without it keep
        # every other random draw (and their exact event logs) unchanged.
        self._filtered_fraction = scenario.workload.filtered_fraction
        self._filter = (
            np.random.default_rng([scenario.seed, zlib.crc32(b"filter")])
            if self._filtered_fraction > 0
            else None
        )

    @property
    def ready(self) -> list[Group]:
        """Finished, admitted groups waiting for the trainer (oldest arrival first)."""
        return [entry.payload for entry in self.ledger.ready.values()]

    @property
    def running(self) -> int:
        """Prompt groups issued and not finished (re-issued ones included)."""
        return len(self.ledger.in_flight)

    @property
    def accepted(self) -> int:
        """Groups consumed by surviving steps plus groups waiting to be trained."""
        return self.ledger.accepted

    # --- admission -------------------------------------------------------------------

    def try_start(self, worker: str) -> Group | None:
        """The group ``worker`` generates now (a re-issued one first, else a new one if
        the policy admits it), or ``None`` when it must wait (or others wait first)."""
        if self._waiting:
            return None
        return self._next_group(worker)

    def _next_group(self, worker: str) -> Group | None:
        if self.reissue:
            group = self.reissue.popleft()
        elif self.ledger.room(self.published_version) > 0:
            group = self.sim.new_group()
            self.ledger.issue(group.group_id)
        else:
            return None
        group.worker = worker
        self.in_flight[group.group_id] = group
        return group

    def wait_start(self, worker: str) -> StartRequest:
        """Event granted (FIFO) with the group to generate when one may start."""
        event = StartRequest(self.env, worker)
        self._waiting.append(event)
        return event

    def cancel(self, event: StartRequest) -> None:
        """Withdraw a request from :meth:`wait_start` (its worker was preempted)."""
        if event.triggered:
            self.lose([cast(Group, event.value)], "preempted")  # granted, never started
        else:
            event.cancelled = True

    def _dispatch(self) -> None:
        waiting = self._waiting
        while waiting:
            if waiting[0].cancelled:
                waiting.popleft()
                continue
            group = self._next_group(waiting[0].worker)
            if group is None:
                return
            waiting.popleft().succeed(group)

    # --- groups coming back ----------------------------------------------------------

    def deliver(self, group: Group) -> None:
        """A fully generated and scored group is booked: admitted, or dropped (too stale
        for the trainer now; all rewards equal, ``workload.filtered_fraction``). A
        generation that was re-issued meanwhile (``void``) is ignored."""
        if group.void:
            return
        del self.in_flight[group.group_id]
        for sample in group.samples:  # sampled, whatever happens to it next
            self.sim.audit.finished(AuditRecord(group.group_id, sample.tokens, sample.correct))
        equal = self._filter is not None and self._filter.random() < self._filtered_fraction
        first, last = group.versions
        self.ledger.complete(
            group.group_id,
            first,
            last,
            equal_rewards=equal,
            trainer_version=self.trainer_version,
            payload=group,
        )
        if self._batch_event is not None and len(self.ledger.ready) >= self.batch_size:
            event, self._batch_event = self._batch_event, None
            event.succeed()
        self._dispatch()

    def release(self, group: Group, reason: str) -> None:
        """A running group is abandoned (its reward hung) and dropped."""
        if group.void:
            return
        del self.in_flight[group.group_id]
        self.ledger.abandon(group.group_id, reason)
        self._dispatch()

    def lose(self, groups: list[Group], reason: str) -> None:
        """A worker lost ``groups`` (preempted; or its weights were voided by a restore):
        each is generated again from scratch by the next worker that asks, or dropped,
        as ``RecoveryPolicy.worker_lost`` says."""
        live = [group for group in groups if not group.void]
        for group in live:
            group.void = True
            del self.in_flight[group.group_id]
        again = set(self.ledger.lose([group.group_id for group in live], reason))
        self.reissue.extend(group.regenerate() for group in live if group.group_id in again)
        self._dispatch()

    def _on_drop(self, group_id: int, reason: str, version: int | None) -> None:
        self.sim.counters.drops[reason] += 1
        self.sim.record(self.name, "drop", version, reason=reason, rollout=str(group_id))

    # --- trainer side ----------------------------------------------------------------

    def take_batch(self) -> list[Group] | None:
        """``batch_size`` admitted groups for the trainer's next step, or ``None`` while
        too few wait; groups too stale by now are dropped first."""
        batch = self.ledger.take_batch(self.trainer_version)
        if batch is None:
            self._dispatch()
        else:
            self.sim.audit.trained(group.group_id for group in batch)
        return batch

    def wait_batch(self) -> simpy.Event:
        """Event fired when at least ``batch_size`` groups are waiting."""
        self._batch_event = self.env.event()
        return self._batch_event

    def on_step(self, version: int) -> None:
        """The trainer finished a step and is now at ``version``."""
        self.trainer_version = version

    def on_save(self, step: int) -> None:
        """A checkpoint of ``step`` was written."""
        self.ledger.saved(step)

    def on_publish(self, version: int) -> None:
        """``version`` reached the store: more generations may be admitted."""
        self.published_version = version
        self._dispatch()

    def on_restore(self, step: int) -> None:
        """The trainer restored the checkpoint of ``step``: the groups of the steps after
        it are requeued or dropped and ready ones from the discarded branch dropped
        (``GroupLedger.roll_back``); generations sampled from void weights are lost
        (their workers drop the weights) and, per the policy, generated again."""
        self.trainer_version = step
        self.published_version = min(self.published_version, step)
        self.ledger.roll_back(step)
        for worker in self.sim.workers:
            worker.on_rollback(step)
        void = [
            group
            for group in self.in_flight.values()
            if group.first_version is not None and group.versions[1] > step
        ]
        self.lose(sorted(void, key=lambda group: group.group_id), "rolled_back")
        self._dispatch()
