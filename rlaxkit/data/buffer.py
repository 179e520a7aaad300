"""RolloutBuffer: a prompt's rollouts grouped, and the books of groups (``rlaxkit.rules.ledger``).

Accounting invariant (checked by ``check``): every prompt the controller issued is, at
any moment, in exactly one of four states — ``in_flight`` (some of its samples are still
being generated or scored), ``buffered`` (complete, admitted, waiting for the trainer),
``trained`` (handed to the trainer in a batch), or ``dropped`` with a reason. Nothing
leaves the books without a reason that is counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlaxkit.data.rollout import Rollout, RolloutGroup
from rlaxkit.rules.ledger import GroupLedger, Ready
from rlaxkit.rules.policies import BatchPolicy, RecoveryPolicy, StalenessPolicy


@dataclass
class _Pending:
    problem_id: str
    samples: dict[int, Rollout] = field(default_factory=dict)


class RolloutBuffer:
    """Assembles each issued prompt's rollouts into a group and keeps the books of groups
    in a ``GroupLedger`` (the simulator's buffer keeps its books in one too): admission,
    drops, batches (oldest first by default), lost work and restores are its decisions.

    Args:
        policy: the staleness policy (η, batch size counted in groups).
        group_size: completions per prompt; a group is complete when all have arrived.
        batching: batch order and whether a group of equal rewards (no GRPO signal) is
            dropped as ``filtered`` (the default, as DAPO's dynamic sampling and AReaL's
            filtering do).
        recovery: what a lost worker or a trainer restore does to work.
        restorable: whether a trainer restore may go back over steps
            (``GroupLedger``): only then are trained groups kept until a checkpoint.
    """

    def __init__(
        self,
        policy: StalenessPolicy,
        group_size: int,
        batching: BatchPolicy | None = None,
        recovery: RecoveryPolicy | None = None,
        *,
        restorable: bool = True,
    ):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.policy = policy
        self.group_size = group_size
        self.ledger = GroupLedger(policy, batching, recovery, restorable=restorable)
        self._pending: dict[int, _Pending] = {}

    # -- the controller's side -------------------------------------------------------
    def issue(self, group_id: int, problem_id: str) -> None:
        """Records that prompt ``group_id`` was handed to a worker."""
        self.ledger.issue(group_id)
        self._pending[group_id] = _Pending(problem_id)

    def abandon(self, group_id: int, reason: str) -> None:
        """Drops an in-flight prompt (e.g. its reward timed out)."""
        self.ledger.abandon(group_id, reason)
        del self._pending[group_id]

    def lose(self, group_ids: list[int], reason: str = "preempted") -> list[int]:
        """A worker lost these in-flight prompts; returns the ids to issue again (their
        partial samples are forgotten), the others are dropped with ``reason``
        (``RecoveryPolicy.worker_lost``)."""
        again = self.ledger.lose(group_ids, reason)
        kept = set(again)
        for group_id in group_ids:
            if group_id in kept:
                self._pending[group_id].samples.clear()
            else:
                del self._pending[group_id]
        return again

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
        return self.ledger.complete(
            group.group_id,
            group.first_version,
            group.last_version,
            equal_rewards=self.group_size > 1 and group.equal_rewards,
            trainer_version=trainer_version,
            payload=group,
        )

    # -- the trainer's side ----------------------------------------------------------
    def take_batch(self, trainer_version: int) -> list[RolloutGroup] | None:
        """``batch_size`` admitted groups, or ``None`` if not enough yet; groups that
        became too stale while waiting are dropped first (``stale``)."""
        return self.ledger.take_batch(trainer_version)

    def batch_ready(self, trainer_version: int) -> bool:
        """Whether :meth:`take_batch` would yield a batch now (``GroupLedger.batch_ready``)."""
        return self.ledger.batch_ready(trainer_version)

    def saved(self, step: int) -> None:
        """A checkpoint of ``step`` was written."""
        self.ledger.saved(step)

    def rollback(self, version: int) -> list[int]:
        """The trainer restored its checkpoint of ``version``; returns the dropped ids
        (``GroupLedger.roll_back``)."""
        return self.ledger.roll_back(version)

    # -- books -----------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self._pending)

    @property
    def buffered(self) -> int:
        return len(self.ledger.ready)

    @property
    def accepted(self) -> int:
        """Groups admitted and not dropped since the start (AReaL's ``accepted``)."""
        return self.ledger.accepted

    @property
    def dropped(self) -> dict[int, str]:
        return self.ledger.dropped

    @property
    def trained(self) -> set[int]:
        return self.ledger.trained

    def counts(self) -> dict[str, Any]:
        """``in_flight``, ``buffered``, ``trained``, ``dropped`` and drops by reason."""
        return self.ledger.counts()

    def accepted_lost(self) -> list[int]:
        """Admitted groups that are now neither buffered, trained nor dropped with a
        reason (must stay empty)."""
        return self.ledger.accepted_lost()

    def check(self, issued: int) -> None:
        """Asserts the accounting invariant for ``issued`` prompts (ids ``0..issued-1``).

        Raises:
            AssertionError: naming the prompts that are missing or double-counted.
        """
        if set(self._pending) != self.ledger.in_flight:
            raise AssertionError("accounting broken: pending samples and books disagree")
        self.ledger.check(issued)

    # -- checkpointing ---------------------------------------------------------------
    def state_dict(self) -> dict[str, object]:
        """Everything needed to rebuild the books (rollouts as plain arrays)."""
        ledger = self.ledger
        return {
            "ready": [_group_to_dict(g.payload) for g in ledger.ready.values()],
            "pending": {g: p.problem_id for g, p in self._pending.items()},
            "trained": sorted(ledger.trained),
            "dropped": {str(g): r for g, r in ledger.dropped.items()},
            "admitted": sorted(ledger.admitted),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores books saved by ``state_dict``; pending prompts come back empty
        (their partial samples are regenerated)."""
        groups = [_group_from_dict(data) for data in state["ready"]]
        ready = [Ready(g.group_id, g.first_version, g.last_version, payload=g) for g in groups]
        self._pending = {int(g): _Pending(p) for g, p in state["pending"].items()}
        self.ledger.load(
            ready,
            set(self._pending),
            set(state["trained"]),
            {int(g): r for g, r in state["dropped"].items()},
            set(state["admitted"]),
        )


def _group_to_dict(group: RolloutGroup) -> dict[str, object]:
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
                # Only multi-turn rollouts have environment tokens; a missing mask
                # (single-turn, and checkpoints written before masks) reads as all policy.
                **({} if r.policy_mask.all() else {"policy_mask": r.policy_mask.tolist()}),
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
            policy_mask=np.asarray(r.get("policy_mask", [True] * len(r["versions"])), bool),
        )
        for r in data["rollouts"]
    )
    return RolloutGroup(data["group_id"], data["problem_id"], rollouts)
