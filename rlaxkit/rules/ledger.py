"""The books of prompt groups, kept once for the runtime and the simulator.

``GroupLedger`` is plain Python on group ids and weight versions; what a group carries
(a ``RolloutGroup`` in the runtime's ``RolloutBuffer``, a simulated group in
``sim.entities.buffer``) rides along as an opaque payload. Every decision that shapes staleness
or lost work is made here, by the policies of ``rlaxkit.rules.policies``:

- **admission**: ``StalenessPolicy.capacity(accepted, in_flight, published)``;
- **a finished group**: ``StalenessPolicy.drop_reason(first_version, trainer_version)``,
  then ``BatchPolicy.filtered`` (equal rewards);
- **the next batch**: groups too stale for the trainer's version are dropped first,
  then ``BatchPolicy.order`` picks ``batch_size`` of the rest;
- **a lost worker**: ``RecoveryPolicy.worker_lost`` re-issues its prompts or drops them;
- **a trainer restore**: ``RecoveryPolicy.trainer_lost`` requeues or drops the groups of
  the steps it went back over; ready groups sampled from the discarded branch are
  dropped as ``rolled_back``.

Accounting invariant (``check``): every issued prompt is in exactly one of four states:
``in_flight``, ``ready`` (admitted, waiting for the trainer), ``trained`` or ``dropped``
with a reason; and no admitted group is ever lost.

>>> from rlaxkit.rules.policies import StalenessPolicy
>>> ledger = GroupLedger(StalenessPolicy(max_staleness=1, batch_size=2))
>>> ledger.room(published=0)
4
>>> for group_id in range(3):
...     ledger.issue(group_id)
>>> ledger.complete(0, 0, 0, equal_rewards=True, trainer_version=0)
'filtered'
>>> [ledger.complete(g, 0, 0, equal_rewards=False, trainer_version=0, payload=f"group {g}")
...  for g in (1, 2)]
[None, None]
>>> ledger.take_batch(trainer_version=0)
['group 1', 'group 2']
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlaxkit.rules.policies import BatchPolicy, RecoveryPolicy, StalenessPolicy

__all__ = ["GroupLedger", "Ready"]


def _ignore(group_id: int, reason: str, version: int | None) -> None:
    """The default ``on_drop``: nothing to do."""


@dataclass
class Ready:
    """A finished, admitted group: its id, the oldest and newest version of its tokens
    and the caller's payload."""

    group_id: int
    first_version: int
    last_version: int
    payload: Any


class GroupLedger:
    """Admission, completion, batches, lost work and restores over prompt groups.

    Args:
        staleness: η, the batch size (in groups) and admission.
        batching: the order of batches and the equal-rewards filter.
        recovery: what a lost worker or a trainer restore does to work.
        restorable: whether a trainer restore may go back over steps (a fault plan can
            preempt the trainer). Only then are the groups of each step kept until a
            checkpoint covers it, for ``roll_back`` to requeue; a run without one would
            otherwise hold every trained group until its end.

    ``on_drop(group_id, reason, first_version)`` is called for every drop (the version
    is ``None`` for a group that never finished): the runtime traces it, the simulator
    counts and traces it.

    Attributes:
        in_flight: ids issued and not finished (re-issued ones stay here).
        ready: finished, admitted groups in the order they finished.
        trained: ids handed to the trainer (by steps still kept).
        dropped: id -> the reason.
        admitted: every id ever admitted (``accepted_lost`` checks none vanished).
    """

    def __init__(
        self,
        staleness: StalenessPolicy,
        batching: BatchPolicy | None = None,
        recovery: RecoveryPolicy | None = None,
        *,
        restorable: bool = True,
    ):
        self.staleness = staleness
        self.batching = batching or BatchPolicy()
        self.recovery = recovery or RecoveryPolicy()
        self.in_flight: set[int] = set()
        self.ready: dict[int, Ready] = {}
        self.trained: set[int] = set()
        self.dropped: dict[int, str] = {}
        self.admitted: set[int] = set()
        self.restorable = restorable
        self._since_save: dict[int, list[Ready]] = {}  # step -> its batch, until a save
        self.on_drop: Callable[[int, str, int | None], None] = _ignore

    # -- the controller's side ---------------------------------------------------------
    @property
    def accepted(self) -> int:
        """Groups admitted and not dropped since the start (AReaL's ``accepted``)."""
        return len(self.ready) + len(self.trained)

    def room(self, published: int) -> int:
        """How many new prompts admission lets start now, with ``published`` the newest
        version workers can sample with (re-issued prompts need no room)."""
        return self.staleness.capacity(self.accepted, len(self.in_flight), published)

    def issue(self, group_id: int) -> None:
        """Prompt ``group_id`` was handed to a worker for the first time."""
        if group_id in self.in_flight or self.known(group_id):
            raise ValueError(f"group {group_id} was issued twice")
        self.in_flight.add(group_id)

    def known(self, group_id: int) -> bool:
        """True once ``group_id`` finished (ready, trained or dropped)."""
        return group_id in self.ready or group_id in self.trained or group_id in self.dropped

    # -- the workers' side -------------------------------------------------------------
    def complete(
        self,
        group_id: int,
        first_version: int,
        last_version: int,
        *,
        equal_rewards: bool,
        trainer_version: int,
        payload: object = None,
    ) -> str | None:
        """Group ``group_id`` finished, its tokens sampled with versions ``first..last``;
        returns why it was dropped, or ``None`` when it was admitted."""
        self.in_flight.remove(group_id)
        reason: str | None = self.staleness.drop_reason(first_version, trainer_version)
        if reason is None and self.batching.filtered(equal_rewards):
            reason = "filtered"
        if reason is not None:
            self._drop(group_id, reason, first_version)
            return reason
        self.ready[group_id] = Ready(group_id, first_version, last_version, payload)
        self.admitted.add(group_id)
        return None

    def abandon(self, group_id: int, reason: str) -> None:
        """Drops an in-flight prompt (e.g. its reward timed out)."""
        self.in_flight.remove(group_id)
        self._drop(group_id, reason, None)

    def _drop(self, group_id: int, reason: str, version: int | None) -> None:
        self.dropped[group_id] = reason
        self.on_drop(group_id, reason, version)

    def lose(self, group_ids: list[int], reason: str = "preempted") -> list[int]:
        """The worker holding ``group_ids`` lost them; returns the ids to issue again
        (same ids; they stay in flight), per ``RecoveryPolicy.worker_lost``."""
        if self.recovery.worker_lost == "reissue":
            return list(group_ids)
        for group_id in group_ids:
            self.abandon(group_id, reason)
        return []

    # -- the trainer's side ------------------------------------------------------------
    def batch_ready(self, trainer_version: int) -> bool:
        """Whether ``take_batch(trainer_version)`` would yield a batch now (nothing is
        dropped or taken): the loop that runs rounds while the trainer steps asks it for
        the version the step will make."""
        admits = self.staleness.admits
        ready = sum(1 for g in self.ready.values() if admits(g.first_version, trainer_version))
        return ready >= self.staleness.batch_size

    def take_batch(self, trainer_version: int) -> list[Any] | None:
        """The payloads of ``batch_size`` admitted groups for step ``trainer_version +
        1``, or ``None`` while too few wait. Groups too stale by now are dropped first."""
        for group_id, group in list(self.ready.items()):
            reason = self.staleness.drop_reason(group.first_version, trainer_version)
            if reason is not None:
                del self.ready[group_id]
                self._drop(group_id, reason, group.first_version)
        size = self.staleness.batch_size
        if len(self.ready) < size:
            return None
        if self.batching.order == "oldest":
            ordered = sorted(self.ready.values(), key=lambda g: (g.first_version, g.group_id))
        else:
            ordered = list(self.ready.values())
        batch, step = ordered[:size], trainer_version + 1
        for group in batch:
            del self.ready[group.group_id]
            self.trained.add(group.group_id)
        if self.restorable:
            self._since_save[step] = batch
        return [group.payload for group in batch]

    def saved(self, step: int) -> None:
        """A checkpoint of ``step`` was written: a restore never goes back past it."""
        for taken in [s for s in self._since_save if s <= step]:
            del self._since_save[taken]

    def roll_back(self, step: int) -> list[int]:
        """The trainer restored checkpoint ``step``; returns the ids dropped.

        The groups of the steps after it are requeued (ahead of nothing: they join the
        ready queue at its end) or dropped, per ``RecoveryPolicy.trainer_lost``; then
        every ready group with a token sampled from weights newer than ``step`` came from
        the discarded branch and is dropped as ``rolled_back``.

        Raises:
            RuntimeError: the ledger was built with ``restorable=False``: it kept no
                trained groups to requeue.
        """
        if not self.restorable:
            raise RuntimeError(
                f"roll_back({step}): this ledger keeps no trained groups "
                "(restorable=False); build it restorable where the trainer can be restored"
            )
        dropped = []
        for taken in sorted(s for s in self._since_save if s > step):
            for group in self._since_save.pop(taken):
                self.trained.remove(group.group_id)
                if self.recovery.trainer_lost == "requeue":
                    self.ready[group.group_id] = group
                else:
                    self._drop(group.group_id, "trainer_preempted", group.first_version)
                    dropped.append(group.group_id)
        for group_id, group in list(self.ready.items()):
            if group.last_version > step:
                del self.ready[group_id]
                self._drop(group_id, "rolled_back", group.first_version)
                dropped.append(group_id)
        return dropped

    # -- the books ---------------------------------------------------------------------
    def counts(self) -> dict[str, object]:
        """``in_flight``, ``buffered``, ``trained``, ``dropped`` and drops by reason."""
        return {
            "in_flight": len(self.in_flight),
            "buffered": len(self.ready),
            "trained": len(self.trained),
            "dropped": len(self.dropped),
            "dropped_by_reason": dict(Counter(self.dropped.values())),
        }

    def accepted_lost(self) -> list[int]:
        """Admitted groups now neither ready, trained nor dropped (must stay empty)."""
        return sorted(self.admitted - set(self.ready) - self.trained - set(self.dropped))

    def check(self, issued: int) -> None:
        """Asserts the accounting invariant for ``issued`` prompts (ids ``0..issued-1``).

        Raises:
            AssertionError: naming the prompts that are missing or double-counted.
        """
        everything: Counter[int] = Counter()
        for ids in (self.in_flight, self.ready, self.trained, self.dropped):
            everything.update(iter(ids))
        doubled = sorted(g for g, c in everything.items() if c > 1)
        missing = sorted(set(range(issued)) - set(everything))
        extra = sorted(set(everything) - set(range(issued)))
        lost = self.accepted_lost()
        if doubled or missing or extra or lost:
            raise AssertionError(
                f"accounting broken: in two states {doubled[:10]}, lost {missing[:10]}, "
                f"never issued {extra[:10]}, accepted then lost {lost[:10]}"
            )

    def load(
        self,
        ready: list[Ready],
        in_flight: set[int],
        trained: set[int],
        dropped: dict[int, str],
        admitted: set[int],
    ) -> None:
        """Takes the books of a checkpoint (nothing since it to roll back)."""
        self.ready = {group.group_id: group for group in ready}
        self.in_flight, self.trained = set(in_flight), set(trained)
        self.dropped, self.admitted = dict(dropped), set(admitted)
        self._since_save = {}
