"""RolloutBuffer: staleness admission, grouping per prompt, dynamic filtering, batches.

Accounting invariant (checked by ``check``): every prompt the controller issued is, at
any moment, in exactly one of four states — ``in_flight`` (some of its samples are still
being generated or scored), ``buffered`` (complete, admitted, waiting for the trainer),
``trained`` (handed to the trainer in a batch), or ``dropped`` with a reason. Nothing
leaves the books without a reason that is counted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlaxkit.policies import StalenessPolicy
from rlaxkit.rollout import Rollout, RolloutGroup


@dataclass
class _Pending:
    problem_id: str
    samples: dict[int, Rollout] = field(default_factory=dict)


class RolloutBuffer:
    """Collects rollouts per issued prompt and releases admitted groups oldest first.

    Args:
        policy: the staleness policy (η, batch size counted in groups).
        group_size: completions per prompt; a group is complete when all have arrived.
        dynamic_filter: drop groups whose rewards are all equal (no GRPO signal), as
            DAPO's dynamic sampling and AReaL's filtering do; counted as ``filtered``.
    """

    def __init__(self, policy: StalenessPolicy, group_size: int, dynamic_filter: bool = True):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.policy = policy
        self.group_size = group_size
        self.dynamic_filter = dynamic_filter
        self._pending: dict[int, _Pending] = {}
        self._ready: dict[int, RolloutGroup] = {}  # insertion order = completion order
        self.trained: set[int] = set()
        self.dropped: dict[int, str] = {}
        self.admitted: set[int] = set()  # every group ever admitted (for ``accepted_lost``)

    # -- the controller's side -------------------------------------------------------
    def issue(self, group_id: int, problem_id: str) -> None:
        """Records that prompt ``group_id`` was handed to a worker."""
        if group_id in self._pending or self._known(group_id):
            raise ValueError(f"group {group_id} was issued twice")
        self._pending[group_id] = _Pending(problem_id)

    def abandon(self, group_id: int, reason: str) -> None:
        """Drops an in-flight prompt (e.g. its worker died and it is not re-issued)."""
        self._pending.pop(group_id)
        self.dropped[group_id] = reason

    def reset_group(self, group_id: int) -> None:
        """Forgets the partial samples of an in-flight prompt that will be regenerated."""
        self._pending[group_id].samples.clear()

    def is_in_flight(self, group_id: int) -> bool:
        """True while ``group_id`` was issued and is not complete (e.g. being re-issued)."""
        return group_id in self._pending

    # -- the workers' side -----------------------------------------------------------
    def add(self, rollout: Rollout, trainer_version: int) -> str | None:
        """Adds one completed, scored sample; returns the drop reason if its group was
        completed and dropped, else ``None``."""
        pending = self._pending.get(rollout.group_id)
        if pending is None:
            raise ValueError(f"sample {rollout.sample_id} belongs to no in-flight prompt")
        if rollout.sample_index in pending.samples:
            raise ValueError(f"sample {rollout.sample_id} arrived twice")
        pending.samples[rollout.sample_index] = rollout
        if len(pending.samples) < self.group_size:
            return None
        del self._pending[rollout.group_id]
        group = RolloutGroup(
            rollout.group_id,
            pending.problem_id,
            tuple(pending.samples[i] for i in sorted(pending.samples)),
        )
        reason = self._reject_reason(group, trainer_version)
        if reason is not None:
            self.dropped[group.group_id] = reason
            return reason
        self._ready[group.group_id] = group
        self.admitted.add(group.group_id)
        return None

    def _reject_reason(self, group: RolloutGroup, trainer_version: int) -> str | None:
        reason = self.policy.drop_reason(group.first_version, trainer_version)
        if reason is not None:
            return reason
        rewards = group.rewards
        if self.dynamic_filter and self.group_size > 1 and np.all(rewards == rewards[0]):
            return "filtered"
        return None

    # -- the trainer's side ----------------------------------------------------------
    def take_batch(self, trainer_version: int) -> list[RolloutGroup] | None:
        """The ``batch_size`` oldest admitted groups, or ``None`` if not enough yet.

        Groups that became too stale while waiting are dropped first (``stale``).
        """
        for group_id, group in list(self._ready.items()):
            reason = self.policy.drop_reason(group.first_version, trainer_version)
            if reason is not None:
                del self._ready[group_id]
                self.dropped[group_id] = reason
        size = self.policy.batch_size
        if len(self._ready) < size:
            return None
        oldest = sorted(self._ready.values(), key=lambda g: (g.first_version, g.group_id))[:size]
        for group in oldest:
            del self._ready[group.group_id]
            self.trained.add(group.group_id)
        return oldest

    def rollback(self, version: int, lost: list[RolloutGroup]) -> list[int]:
        """The trainer restored its checkpoint of ``version``; returns the dropped ids.

        ``lost`` are the groups trained by the steps after ``version`` (their updates
        are gone): they go back to the ready queue, so nothing accepted is lost. Every
        ready group with a token sampled from weights newer than ``version`` came from
        the discarded branch and is dropped as ``rolled_back``.
        """
        for group in lost:
            self.trained.discard(group.group_id)
            self._ready[group.group_id] = group
        dropped = []
        for group_id, group in list(self._ready.items()):
            if max(r.last_version for r in group.rollouts) > version:
                del self._ready[group_id]
                self.dropped[group_id] = "rolled_back"
                dropped.append(group_id)
        return dropped

    # -- books -----------------------------------------------------------------------
    def _known(self, group_id: int) -> bool:
        return group_id in self._ready or group_id in self.trained or group_id in self.dropped

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    @property
    def buffered(self) -> int:
        return len(self._ready)

    @property
    def accepted(self) -> int:
        """Groups admitted and not dropped since the start (AReaL's ``accepted``)."""
        return len(self._ready) + len(self.trained)

    def counts(self) -> dict[str, Any]:
        """``in_flight``, ``buffered``, ``trained``, ``dropped`` and drops by reason."""
        return {
            "in_flight": self.in_flight,
            "buffered": self.buffered,
            "trained": len(self.trained),
            "dropped": len(self.dropped),
            "dropped_by_reason": dict(Counter(self.dropped.values())),
        }

    def accepted_lost(self) -> list[int]:
        """Admitted groups that are now neither buffered, trained nor dropped with a
        reason (must stay empty)."""
        return sorted(self.admitted - set(self._ready) - self.trained - set(self.dropped))

    def check(self, issued: int) -> None:
        """Asserts the accounting invariant for ``issued`` prompts (ids ``0..issued-1``).

        Raises:
            AssertionError: naming the prompts that are missing or double-counted.
        """
        states = [set(self._pending), set(self._ready), self.trained, set(self.dropped)]
        everything: Counter[int] = Counter()
        for s in states:
            everything.update(s)
        doubled = sorted(g for g, c in everything.items() if c > 1)
        missing = sorted(set(range(issued)) - set(everything))
        extra = sorted(set(everything) - set(range(issued)))
        lost = self.accepted_lost()
        if doubled or missing or extra or lost:
            raise AssertionError(
                f"accounting broken: in two states {doubled[:10]}, lost {missing[:10]}, "
                f"never issued {extra[:10]}, accepted then lost {lost[:10]}"
            )

    # -- checkpointing ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild the books (rollouts as plain arrays)."""
        return {
            "ready": [_group_to_dict(g) for g in self._ready.values()],
            "pending": {g: p.problem_id for g, p in self._pending.items()},
            "trained": sorted(self.trained),
            "dropped": {str(g): r for g, r in self.dropped.items()},
            "admitted": sorted(self.admitted),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores books saved by ``state_dict``; pending prompts come back empty
        (their partial samples are regenerated)."""
        self._ready = {}
        for data in state["ready"]:
            group = _group_from_dict(data)
            self._ready[group.group_id] = group
        self._pending = {int(g): _Pending(p) for g, p in state["pending"].items()}
        self.trained = set(state["trained"])
        self.dropped = {int(g): r for g, r in state["dropped"].items()}
        self.admitted = set(state.get("admitted", [*self._ready, *self.trained]))


def _group_to_dict(group: RolloutGroup) -> dict[str, Any]:
    return {
        "group_id": group.group_id,
        "problem_id": group.problem_id,
        "rollouts": [
            {
                "sample_index": r.sample_index,
                "prompt_tokens": r.prompt_tokens.tolist(),
                "completion_tokens": r.completion_tokens.tolist(),
                "behaviour_logprobs": r.behaviour_logprobs.tolist(),
                "versions": r.versions.tolist(),
                "reward": r.reward,
                "finish_reason": r.finish_reason,
                "worker_id": r.worker_id,
                "reward_info": r.reward_info,
                "timings": r.timings,
            }
            for r in group.rollouts
        ],
    }


def _group_from_dict(data: dict[str, Any]) -> RolloutGroup:
    rollouts = tuple(
        Rollout(
            group_id=data["group_id"],
            sample_index=r["sample_index"],
            problem_id=data["problem_id"],
            prompt_tokens=np.asarray(r["prompt_tokens"], np.int32),
            completion_tokens=np.asarray(r["completion_tokens"], np.int32),
            behaviour_logprobs=np.asarray(r["behaviour_logprobs"], np.float32),
            versions=np.asarray(r["versions"], np.int32),
            reward=r["reward"],
            finish_reason=r["finish_reason"],
            worker_id=r["worker_id"],
            reward_info=r["reward_info"],
            timings=r["timings"],
        )
        for r in data["rollouts"]
    )
    return RolloutGroup(data["group_id"], data["problem_id"], rollouts)
