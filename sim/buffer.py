"""Rollout groups and the buffer that admits, holds and batches them.

The buffer is the simulated twin of the runtime's RolloutBuffer plus AReaL's rollout
controller: it asks the shared :class:`~rlaxkit.policies.StalenessPolicy` whether a new
generation may start (``accepted + running < (η + version + 1) · batch_size``), holds
finished groups in arrival order, and hands the trainer full batches, dropping what the
policy rejects with its reason.

Counting unit: one prompt group (``group_size`` samples), as AReaL counts episodes.
``accepted`` is the groups consumed by surviving steps plus those waiting here.
Admission uses the newest *published* version: AReaL bumps its version only once the
new weights reached the rollout engines, so a generation admitted for version ``v``
can be sampled with ``v``.
"""

from __future__ import annotations

import zlib
from collections import deque
from typing import TYPE_CHECKING

import numpy as np
import simpy

if TYPE_CHECKING:
    from .engine import Simulation

__all__ = ["Group", "RolloutBuffer", "Sample"]


class Sample:
    """One generated sequence of a group."""

    __slots__ = ("group", "index", "prompt_tokens", "tokens", "truncated")

    def __init__(
        self, group: Group, index: int, prompt_tokens: int, tokens: int, truncated: bool
    ) -> None:
        self.group = group
        self.index = index
        self.prompt_tokens = prompt_tokens
        self.tokens = tokens
        self.truncated = truncated

    @property
    def sample_id(self) -> str:
        return f"{self.group.group_id}/{self.index}"


class Group:
    """One prompt and its samples, generated on one worker.

    ``first_version``/``last_version`` are the oldest and newest weight versions any
    of its tokens were sampled with; ``lineage`` is the store's lineage of those weights.
    """

    __slots__ = (
        "group_id",
        "worker",
        "samples",
        "unfinished",
        "unscored",
        "started",
        "failed",
        "first_version",
        "last_version",
        "lineage",
        "tokens",
        "scored_at",
    )

    def __init__(self, group_id: int, worker: str) -> None:
        self.group_id = group_id
        self.worker = worker
        self.samples: list[Sample] = []
        self.unfinished = 0
        self.unscored = 0
        self.started = False
        self.failed = False
        self.first_version: int | None = None
        self.last_version: int | None = None
        self.lineage = 0
        self.tokens = 0
        self.scored_at = 0.0

    def note_version(self, version: int, lineage: int) -> None:
        """Record that some of its tokens were sampled with ``version``."""
        first, last = self.first_version, self.last_version
        if first is None or last is None:
            self.first_version = self.last_version = version
            self.lineage = lineage
            return
        self.first_version = min(first, version)
        self.last_version = max(last, version)
        self.lineage = min(self.lineage, lineage)

    @property
    def versions(self) -> tuple[int, int]:
        """``(first_version, last_version)``; a group has them from its first token on."""
        first, last = self.first_version, self.last_version
        if first is None or last is None:
            raise ValueError(f"group {self.group_id}: no token sampled yet, so no versions")
        return first, last


class _StartRequest(simpy.Event):
    """A request to start a generation (:meth:`RolloutBuffer.wait_start`), granted in
    FIFO order; a preempted worker withdraws it (``cancelled``)."""

    def __init__(self, env: simpy.Environment) -> None:
        super().__init__(env)
        self.cancelled = False


class RolloutBuffer:
    """Admission control, the queue of finished groups, and batching for the trainer."""

    name = "buffer"

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.env = sim.env
        self.policy = sim.scenario.staleness
        self.batch_size = self.policy.batch_size
        self.ready: deque[Group] = deque()
        self.running = 0
        self.consumed = 0
        self.published_version = 0
        self.trainer_version = 0
        self._waiting: deque[_StartRequest] = deque()
        self._batch_event: simpy.Event | None = None
        self._restores: list[int] = []
        # Its own stream, drawn only when filtering is on, so runs without it keep
        # every other random draw (and their exact event logs) unchanged.
        self._filtered_fraction = sim.scenario.workload.filtered_fraction
        self._filter = (
            np.random.default_rng([sim.scenario.seed, zlib.crc32(b"filter")])
            if self._filtered_fraction > 0
            else None
        )

    @property
    def accepted(self) -> int:
        """Groups consumed by surviving steps plus groups waiting to be trained."""
        return self.consumed + len(self.ready)

    # --- admission -------------------------------------------------------------------

    def try_start(self) -> bool:
        """Start one generation now if the policy allows and nobody queues before us."""
        if self._waiting or not self.policy.can_start_generation(
            self.accepted, self.running, self.published_version
        ):
            return False
        self.running += 1
        return True

    def wait_start(self) -> _StartRequest:
        """Event granted (FIFO) when the policy lets one more generation start."""
        event = _StartRequest(self.env)
        self._waiting.append(event)
        return event

    def cancel(self, event: _StartRequest) -> None:
        """Withdraw a request from :meth:`wait_start` (its worker was preempted)."""
        if event.triggered:
            self.running -= 1
            self._dispatch()
        else:
            event.cancelled = True

    def _dispatch(self) -> None:
        waiting = self._waiting
        while waiting:
            if waiting[0].cancelled:
                waiting.popleft()
                continue
            if not self.policy.can_start_generation(
                self.accepted, self.running, self.published_version
            ):
                return
            self.running += 1
            waiting.popleft().succeed()

    # --- groups coming back ----------------------------------------------------------

    def deliver(self, group: Group) -> None:
        """A fully generated and scored group joins the queue, unless dynamic filtering
        drops it (``workload.filtered_fraction``: all its rewards were equal)."""
        self.running -= 1
        if self._filter is not None and self._filter.random() < self._filtered_fraction:
            self._drop(group, "filtered")
            self._dispatch()
            return
        self.ready.append(group)
        if self._batch_event is not None and len(self.ready) >= self.batch_size:
            event, self._batch_event = self._batch_event, None
            event.succeed()
        self._dispatch()

    def release(self, group: Group, reason: str) -> None:
        """A running group is abandoned (worker preempted, reward hung) and dropped."""
        self.running -= 1
        self._drop(group, reason)
        self._dispatch()

    def drop(self, group: Group, reason: str) -> None:
        """Count and trace a group that will never be trained (not a running one)."""
        self._drop(group, reason)

    def _drop(self, group: Group, reason: str) -> None:
        self.sim.counters.drops[reason] += 1
        self.sim.record(
            self.name, "drop", group.first_version, reason=reason, rollout=str(group.group_id)
        )

    # --- trainer side ----------------------------------------------------------------

    def take_batch(self) -> list[Group] | None:
        """``batch_size`` admissible groups in arrival order, or ``None`` if too few.

        Groups the policy rejects at the trainer's version, or that come from a branch
        discarded by a restore, are dropped on the way.
        """
        policy = self.policy
        version = self.trainer_version
        kept: list[Group] = []
        ready = self.ready
        while ready and len(kept) < self.batch_size:
            group = ready.popleft()
            reason = (
                "rolled_back"
                if self._discarded(group)
                else policy.drop_reason(group.versions, version)
            )
            if reason is None:
                kept.append(group)
            else:
                self._drop(group, reason)
        if len(kept) < self.batch_size:
            ready.extendleft(reversed(kept))
            self._dispatch()
            return None
        self.consumed += self.batch_size
        return kept

    def wait_batch(self) -> simpy.Event:
        """Event fired when at least ``batch_size`` groups are waiting."""
        self._batch_event = self.env.event()
        return self._batch_event

    def on_step(self, version: int) -> None:
        """The trainer finished a step and is now at ``version``."""
        self.trainer_version = version

    def on_publish(self, version: int) -> None:
        """``version`` reached the store: more generations may be admitted."""
        self.published_version = version
        self._dispatch()

    def on_restore(self, step: int) -> None:
        """The trainer restored the checkpoint of ``step``: forget later consumption."""
        self._restores.append(step)
        self.trainer_version = step
        self.published_version = min(self.published_version, step)
        self.consumed = step * self.batch_size
        kept: deque[Group] = deque()
        for group in self.ready:
            if self._discarded(group):
                self._drop(group, "rolled_back")
            else:
                kept.append(group)
        self.ready = kept
        self._dispatch()

    def _discarded(self, group: Group) -> bool:
        """True when a restore after this group's weights were pulled cut its branch."""
        restores = self._restores
        if group.lineage >= len(restores):
            return False
        return group.versions[1] > min(restores[group.lineage :])
