"""Decisions shared by the runtime and the simulator: staleness, weight sync, checkpoints,
which groups train, and what a preemption does to work in flight.

Plain Python on purpose: this module imports neither JAX nor SimPy, so the SimPy fleet
simulator (``sim/``) and the real runtime call the very same objects with the same
arguments; only the clock differs (simulated seconds there, wall seconds here).

Versions are trainer step counts: the initial weights are version 0 and the weights
after ``n`` optimizer steps are version ``n``. Staleness of a rollout is
``trainer_version - rollout_version``, counted from the oldest version any of its tokens
was sampled with (a generation interrupted by an in-flight weight update spans versions).

>>> policy = StalenessPolicy(max_staleness=1, batch_size=4)
>>> policy.capacity(accepted=4, running=3, trainer_version=0)
1
>>> policy.admits(rollout_version=2, trainer_version=3)
True
>>> policy.drop_reason(rollout_version=1, trainer_version=3)
'stale'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, get_args, overload

from rlaxkit.rules.validation import check_int, is_number

__all__ = [
    "BatchPolicy",
    "CheckpointPolicy",
    "RecoveryPolicy",
    "DropReason",
    "PullMode",
    "StalenessPolicy",
    "WeightSyncPolicy",
    "SyncAction",
    "check_admission",
    "policy_from_dict",
    "policy_to_dict",
]

PullMode = Literal["between_requests", "in_flight"]
SyncAction = Literal["keep", "drain", "pull"]
DropReason = Literal["stale", "future_version"]


@dataclass(frozen=True, kw_only=True)
class StalenessPolicy:
    """How far behind the trainer a rollout may be, and when generation may start.

    Combines AReaL's admission control (arXiv 2505.24298; ``areal/infra/
    staleness_manager.py``) with the two staleness knobs reported for RLAX (arXiv
    2512.06392): an inference reload bound and a trainer acceptance bound.

    Counting unit: one *rollout* is whatever the trainer counts in ``batch_size`` (AReaL
    counts one prompt with its group of samples; a runtime that counts single samples
    passes sample counts). ``accepted`` is the number of rollouts accepted since the run
    (or the restored checkpoint) started and not dropped since, consumed ones included;
    ``running`` is the number being generated now.

    Attributes:
        max_staleness: η, the largest ``trainer_version - rollout_version`` the trainer
            accepts. η = 0 is synchronous on-policy RL; AReaL's typical range is 2-8.
        batch_size: Rollouts consumed per trainer step (AReaL ``consumer_batch_size``).
        max_concurrent: Cap on rollouts generating at once (AReaL
            ``max_concurrent_rollouts``); ``None`` means no cap beyond the fleet's slots.
        max_worker_lag: RLAX's inference reload bound: how many versions a worker may lag
            the newest published version before it must pull before its next request.
            0 means "always generate with the newest published weights".
    """

    max_staleness: int = 0
    batch_size: int
    max_concurrent: int | None = None
    max_worker_lag: int = 0

    def __post_init__(self) -> None:
        check_int("max_staleness", self.max_staleness, minimum=0)
        check_int("batch_size", self.batch_size, minimum=1)
        if self.max_concurrent is not None:
            check_int("max_concurrent", self.max_concurrent, minimum=1)
        check_int("max_worker_lag", self.max_worker_lag, minimum=0)

    def capacity(self, accepted: int, running: int, trainer_version: int) -> int:
        """Number of new generations that may start now (AReaL's formula, verbatim).

        ``min(max_concurrent - running, (η + trainer_version + 1) * batch_size -
        (accepted + running))``, floored at 0. Without ``max_concurrent`` only the
        staleness term applies.
        """
        staleness_room = (self.max_staleness + trainer_version + 1) * self.batch_size - (
            accepted + running
        )
        if self.max_concurrent is not None:
            staleness_room = min(staleness_room, self.max_concurrent - running)
        return max(0, staleness_room)

    def can_start_generation(self, accepted: int, running: int, trainer_version: int) -> bool:
        """True when ``accepted + running < (η + trainer_version + 1) * batch_size`` and
        ``running < max_concurrent``: starting one more keeps both bounds.

        Pass as ``trainer_version`` the newest version the workers can sample with, i.e.
        the newest *published* version: AReaL bumps its version only once new weights
        reached the rollout engines, so a generation admitted for version ``v`` is
        sampled with ``v``. (With pushes every ``k`` steps this needs η ≥ k - 1, or the
        trainer waits for rollouts that admission never lets start.)
        """
        return self.capacity(accepted, running, trainer_version) > 0

    def staleness(self, rollout_version: int | tuple[int, ...], trainer_version: int) -> int:
        """``trainer_version - oldest`` where ``oldest`` is the rollout's oldest version.

        ``rollout_version`` is one version or the versions a rollout's tokens were
        sampled with (interrupted generation); staleness counts from the oldest.
        """
        oldest = rollout_version if isinstance(rollout_version, int) else min(rollout_version)
        return trainer_version - oldest

    def drop_reason(
        self, rollout_version: int | tuple[int, ...], trainer_version: int
    ) -> DropReason | None:
        """Why the trainer at ``trainer_version`` must drop this rollout, or ``None``.

        ``"stale"`` when staleness exceeds η; ``"future_version"`` when the rollout is
        newer than the trainer (possible only after the trainer was restored from an
        older checkpoint: its weights came from a discarded branch).
        """
        age = self.staleness(rollout_version, trainer_version)
        newest = rollout_version if isinstance(rollout_version, int) else max(rollout_version)
        if newest > trainer_version:
            return "future_version"
        if age > self.max_staleness:
            return "stale"
        return None

    def admits(self, rollout_version: int | tuple[int, ...], trainer_version: int) -> bool:
        """True when ``0 <= trainer_version - rollout_version <= max_staleness``."""
        return self.drop_reason(rollout_version, trainer_version) is None

    def must_pull(self, worker_version: int | None, latest_version: int) -> bool:
        """True when a worker must pull before its next request.

        It must when it holds no weights (``None``, e.g. just restarted), when it lags
        the newest published version by more than ``max_worker_lag``, or when it is
        *ahead* of the store (its weights belong to a branch discarded by a restore).
        """
        if worker_version is None or worker_version > latest_version:
            return True
        return latest_version - worker_version > self.max_worker_lag


@dataclass(frozen=True, kw_only=True)
class WeightSyncPolicy:
    """When the trainer pushes weights and how workers take them.

    Attributes:
        push_every_steps: The trainer pushes after every ``k``-th step (RLAX pushes
            "periodically"; TRL's ``weight_sync_steps``). Version ``0`` is published at
            start.
        pull_mode: ``"between_requests"``: a worker that must pull stops taking new
            prompts, finishes what it has started, then reloads (RLAX: every rollout
            comes from one version). ``"in_flight"``: a worker pauses its running
            generations, reloads, recomputes their KV caches and continues, so one
            rollout may span versions (AReaL interruptible rollout).
    """

    push_every_steps: int = 1
    pull_mode: PullMode = "between_requests"

    def __post_init__(self) -> None:
        check_int("push_every_steps", self.push_every_steps, minimum=1)
        if self.pull_mode not in get_args(PullMode):
            raise ValueError(
                f"pull_mode: must be one of {get_args(PullMode)}, got {self.pull_mode!r}"
            )

    def should_push(self, step: int) -> bool:
        """True when the trainer, having just finished step ``step`` (1-based), pushes."""
        return step > 0 and step % self.push_every_steps == 0

    @property
    def interrupts_generation(self) -> bool:
        """True when a pull pauses generations already running (in-flight mode)."""
        return self.pull_mode == "in_flight"

    def sync_action(
        self,
        staleness: StalenessPolicy,
        version: int | None,
        latest: int | None,
        *,
        busy: bool,
    ) -> SyncAction:
        """What a worker holding weights ``version`` (``None``: none) does about them
        when the store's newest is ``latest`` (``None``: nothing published) and it has
        generations running (``busy``): ``"keep"`` its weights, ``"drain"`` (take no new
        prompts, pull once the running ones are done: ``between_requests`` mode) or
        ``"pull"`` now (``in_flight`` mode pauses the running ones). The runtime's
        workers and both of the simulator's worker models decide by it.

        >>> policy, eta = WeightSyncPolicy(), StalenessPolicy(batch_size=4, max_worker_lag=0)
        >>> policy.sync_action(eta, 3, 3, busy=True), policy.sync_action(eta, 2, 3, busy=False)
        ('keep', 'pull')
        >>> policy.sync_action(eta, 2, 3, busy=True)
        'drain'
        >>> WeightSyncPolicy(pull_mode="in_flight").sync_action(eta, 2, 3, busy=True)
        'pull'
        """
        if latest is None or not staleness.must_pull(version, latest):
            return "keep"
        if busy and not self.interrupts_generation:
            return "drain"
        return "pull"


def check_admission(staleness: StalenessPolicy, weight_sync: WeightSyncPolicy) -> None:
    """Refuses a staleness bound that admission and pulls can never meet.

    Admission counts *published* versions (``StalenessPolicy.capacity``); with pushes
    every ``k`` steps the trainer runs up to ``k - 1`` versions ahead of them, and a
    worker keeps its weights until it lags the newest published version by more than
    ``max_worker_lag`` (``L``). Its rollouts are then up to ``L + k - 1`` versions old,
    so with ``η < L + k - 1`` a fleet that lags together makes only rollouts the
    trainer drops as stale, and the trainer waits for ever. The runtime and the
    simulator both call this when a run or scenario is built.

    Raises:
        ValueError: naming ``staleness.max_staleness`` and what it must be.
    """
    ahead = weight_sync.push_every_steps - 1
    if staleness.max_worker_lag:
        bound = staleness.max_worker_lag + ahead
        if staleness.max_staleness < bound:
            raise ValueError(
                "staleness.max_staleness: must be >= staleness.max_worker_lag + "
                f"weight_sync.push_every_steps - 1 ({bound}), got "
                f"{staleness.max_staleness}: a worker holding weights that old makes "
                "only rollouts the trainer drops as stale; raise max_staleness or lower "
                "max_worker_lag"
            )
    if staleness.max_staleness < ahead:
        raise ValueError(
            f"staleness.max_staleness: must be >= weight_sync.push_every_steps - 1 "
            f"({ahead}) or admission deadlocks, got {staleness.max_staleness}; raise "
            "max_staleness or push more often"
        )


@dataclass(frozen=True, kw_only=True)
class CheckpointPolicy:
    """When the trainer saves a checkpoint, and how many it keeps.

    A save is due when either trigger fires: ``every_steps`` steps or ``every_s``
    seconds since the last save. With neither set, the trainer never saves (every
    preemption then restarts from step 0).

    Attributes:
        every_steps: Save when ``step - last_save_step >= every_steps``.
        every_s: Save when ``now_s - last_save_s >= every_s`` (Tunix's continuous
            checkpointing uses a 180 s minimum interval).
        keep: Number of checkpoints kept on storage (Tunix ``LatestN(n=3)``).
    """

    every_steps: int | None = None
    every_s: float | None = None
    keep: int = 3

    def __post_init__(self) -> None:
        if self.every_steps is not None:
            check_int("every_steps", self.every_steps, minimum=1)
        if self.every_s is not None and not (is_number(self.every_s) and self.every_s > 0):
            raise ValueError(f"every_s: must be a number > 0 or None, got {self.every_s!r}")
        check_int("keep", self.keep, minimum=1)

    def should_save(self, step: int, now_s: float, last_save_step: int, last_save_s: float) -> bool:
        """True when a save is due after step ``step`` at time ``now_s``.

        Args:
            step: Steps completed so far.
            now_s: Seconds since run start.
            last_save_step: Step of the newest checkpoint (0 at start).
            last_save_s: Time of the newest checkpoint (0.0 at start).
        """
        if step <= last_save_step:
            return False
        if self.every_steps is not None and step - last_save_step >= self.every_steps:
            return True
        return self.every_s is not None and now_s - last_save_s >= self.every_s

    def to_delete(self, saved_steps: list[int]) -> list[int]:
        """Steps of the checkpoints to delete so that only the newest ``keep`` remain."""
        ordered = sorted(saved_steps)
        return ordered[: max(0, len(ordered) - self.keep)]


@dataclass(frozen=True, kw_only=True)
class BatchPolicy:
    """Which finished groups the trainer gets, and in what order.

    >>> BatchPolicy().filtered(equal_rewards=True)
    True
    >>> BatchPolicy(equal_rewards="keep").filtered(equal_rewards=True)
    False

    Attributes:
        order: ``oldest``: each batch takes the admitted groups with the oldest first
            version, ties by issue order (a group waits at most until older ones are
            trained); ``arrival``: in the order they finished.
        equal_rewards: ``drop``: a group whose rewards are all equal is dropped as
            ``filtered`` (DAPO's dynamic sampling, arXiv 2503.14476; AReaL filters the
            same way): under group-relative advantages it carries no signal, and only
            dilutes the batch. ``keep``: every group trains, as GRPO was published
            (arXiv 2402.03300) and as peers train by default; its advantages are zero.
    """

    order: Literal["oldest", "arrival"] = "oldest"
    equal_rewards: Literal["drop", "keep"] = "drop"

    def __post_init__(self) -> None:
        _check_choice("order", self.order, ("oldest", "arrival"))
        _check_choice("equal_rewards", self.equal_rewards, ("drop", "keep"))

    def filtered(self, equal_rewards: bool) -> bool:
        """True when a finished group of equal rewards (``equal_rewards``) is dropped."""
        return equal_rewards and self.equal_rewards == "drop"


@dataclass(frozen=True, kw_only=True)
class RecoveryPolicy:
    """What a preemption does to the work it cuts short.

    Attributes:
        worker_lost: prompts in flight on a worker that is preempted, removed, or holds
            weights a trainer restore voided: ``reissue`` hands them out again with the
            same ids and seeds (nothing is dropped; RLAX's controller does this), ``drop``
            drops them (reason ``preempted``, or ``rolled_back`` for void weights).
        trainer_lost: the groups trained by the steps a trainer restore went back over:
            ``requeue`` puts them back in the ready queue (nothing accepted is lost; ones
            sampled from the discarded branch are then dropped as ``rolled_back``),
            ``drop`` drops them (reason ``trainer_preempted``).
    """

    worker_lost: Literal["reissue", "drop"] = "reissue"
    trainer_lost: Literal["requeue", "drop"] = "requeue"

    def __post_init__(self) -> None:
        _check_choice("worker_lost", self.worker_lost, ("reissue", "drop"))
        _check_choice("trainer_lost", self.trainer_lost, ("requeue", "drop"))


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    """Raises ``ValueError`` naming ``name`` and the allowed values."""
    if value not in allowed:
        raise ValueError(f"{name}: must be one of {list(allowed)}, got {value!r}")


# Any one of the policies, as ``policy_from_dict`` builds them by kind.
Policy: TypeAlias = (
    StalenessPolicy | WeightSyncPolicy | CheckpointPolicy | BatchPolicy | RecoveryPolicy
)

_POLICIES: dict[str, type[Policy]] = {
    "staleness": StalenessPolicy,
    "weight_sync": WeightSyncPolicy,
    "checkpoint": CheckpointPolicy,
    "batching": BatchPolicy,
    "recovery": RecoveryPolicy,
}


def policy_to_dict(policy: Policy) -> dict:
    """Plain dict of a policy's fields (for YAML configs and trace headers)."""
    return dataclasses.asdict(policy)


@overload
def policy_from_dict(kind: Literal["staleness"], fields: Mapping[str, Any]) -> StalenessPolicy: ...


@overload
def policy_from_dict(
    kind: Literal["weight_sync"], fields: Mapping[str, Any]
) -> WeightSyncPolicy: ...


@overload
def policy_from_dict(
    kind: Literal["checkpoint"], fields: Mapping[str, Any]
) -> CheckpointPolicy: ...


@overload
def policy_from_dict(kind: str, fields: Mapping[str, Any]) -> Policy: ...


def policy_from_dict(kind: str, fields: Mapping[str, Any]) -> Policy:
    """Build the policy named ``kind`` (``staleness``, ``weight_sync``, ``checkpoint``,
    ``batching``, ``recovery``).

    Unknown field names raise ``ValueError`` naming the field and the allowed ones.
    """
    if kind not in _POLICIES:
        raise ValueError(f"kind: must be one of {sorted(_POLICIES)}, got {kind!r}")
    cls = _POLICIES[kind]
    allowed = {f.name for f in dataclasses.fields(cls)}
    for name in fields:
        if name not in allowed:
            raise ValueError(f"{kind}.{name}: unknown field; allowed: {sorted(allowed)}")
    return cls(**dict(fields))
