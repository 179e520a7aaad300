"""The one ``Rollout`` type: everything downstream of a worker reads it.

A rollout is one sampled completion of one issued prompt. The ``n`` completions of the
same issued prompt share a ``group_id`` (GRPO's group); a ``RolloutGroup`` is the unit
the buffer admits, filters and hands to the trainer.

A multi-turn episode (``rlaxkit.tasks.episodes``) is one rollout too: its completion holds the
policy's tokens and the environment's (tool output) in the order they were written, and
``policy_mask`` says which is which. Environment tokens are context, never trained on:
their behaviour log-prob is 0 and their version ``ENVIRONMENT_VERSION``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

ENVIRONMENT_VERSION = -1  # the ``versions`` entry of a token the environment wrote
# The default ``policy_mask`` (compared by identity): every token is the policy's.
_ALL_POLICY = np.ones(0, bool)
_ALL_POLICY_BY_LENGTH: dict[int, np.ndarray] = {}


def _all_policy(n: int) -> np.ndarray:
    """A read-only all-True mask of ``n`` tokens, one array per length for every rollout."""
    mask = _ALL_POLICY_BY_LENGTH.get(n)
    if mask is None:
        mask = np.ones(n, bool)
        mask.flags.writeable = False
        mask = _ALL_POLICY_BY_LENGTH.setdefault(n, mask)
    return mask


def _bounds(versions: np.ndarray) -> tuple[int, int]:
    """``(min, max)`` of ``versions``, ``(-1, -1)`` when empty. A short array's as a list:
    0.8 us against 4 us for NumPy's two reductions (a run builds one per sample)."""
    if not len(versions):
        return -1, -1
    if len(versions) <= 256:
        values = versions.tolist()
        return min(values), max(values)
    return int(versions.min()), int(versions.max())


@dataclass(frozen=True, init=False)
class Rollout:
    """One completion with what the trainer needs to learn from it off-policy.

    Attributes:
        group_id: the issued prompt this completion answers (unique per issue).
        sample_index: which of the group's ``n`` samples this is.
        problem_id: the task problem's stable id.
        prompt_tokens: ``[P]`` int32.
        completion_tokens: ``[C]`` int32, up to and including a stop token.
        behaviour_logprobs: ``[C]`` float32, log-prob of each completion token under the
            distribution the sampler actually drew it from; 0 for environment tokens.
        versions: ``[C]`` int32, the weight version that produced each token;
            ``ENVIRONMENT_VERSION`` (-1) for environment tokens.
        reward: the verifiable reward.
        finish_reason: ``stop``, ``length`` or ``interrupted``; an episode's ``stop``,
            ``max_turns`` or ``length``.
        worker_id: the worker that generated it.
        reward_info: parsed answer and failure reason from the reward.
        timings: seconds since run start (``issued_s``, ``started_s``, ``finished_s``).
        policy_mask: ``[C]`` bool, True where the policy sampled the token, False where
            the environment wrote it. By default every token is the policy's (all True).
        first_version: the oldest weight version among the policy's tokens, from which
            staleness counts (``-1`` without policy tokens); derived from ``versions``.
        last_version: the newest weight version among the policy's tokens (``-1``
            without policy tokens).
    """

    group_id: int
    sample_index: int
    problem_id: str
    prompt_tokens: np.ndarray
    completion_tokens: np.ndarray
    behaviour_logprobs: np.ndarray
    versions: np.ndarray
    reward: float
    finish_reason: str
    worker_id: str = ""
    reward_info: dict[str, object] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    policy_mask: np.ndarray = field(default_factory=lambda: _ALL_POLICY)
    first_version: int = field(init=False, repr=False, compare=False)
    last_version: int = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        group_id: int,
        sample_index: int,
        problem_id: str,
        prompt_tokens: np.ndarray,
        completion_tokens: np.ndarray,
        behaviour_logprobs: np.ndarray,
        versions: np.ndarray,
        reward: float,
        finish_reason: str,
        worker_id: str = "",
        reward_info: Mapping[str, object] | None = None,
        timings: dict[str, float] | None = None,
        policy_mask: np.ndarray = _ALL_POLICY,
    ) -> None:
        # The fields go into the instance's dict at once, where a frozen dataclass's own
        # __init__ sets them one object.__setattr__ at a time (a run builds one a
        # sample; about 2.5 us against 4 us).
        self.__dict__.update(
            group_id=group_id,
            sample_index=sample_index,
            problem_id=problem_id,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            behaviour_logprobs=behaviour_logprobs,
            versions=versions,
            reward=reward,
            finish_reason=finish_reason,
            worker_id=worker_id,
            reward_info={} if reward_info is None else reward_info,
            timings={} if timings is None else timings,
        )
        n = len(completion_tokens)
        if len(behaviour_logprobs) != n or len(versions) != n:
            raise ValueError(
                f"rollout {self.sample_id}: completion_tokens ({n}), behaviour_logprobs "
                f"({len(behaviour_logprobs)}) and versions ({len(versions)}) "
                "must have one entry per completion token"
            )
        if policy_mask is _ALL_POLICY:
            mask = _all_policy(n)
        else:
            mask = np.asarray(policy_mask, bool)
            if mask.shape != (n,):
                raise ValueError(
                    f"rollout {self.sample_id}: policy_mask has shape {mask.shape}, expected "
                    f"({n},): one entry per completion token"
                )
            environment = ~mask
            if np.any(behaviour_logprobs[environment] != 0) or np.any(
                versions[environment] != ENVIRONMENT_VERSION
            ):
                raise ValueError(
                    f"rollout {self.sample_id}: environment tokens must have behaviour "
                    f"log-prob 0 and version {ENVIRONMENT_VERSION}"
                )
            versions = versions[mask]
        # The buffer, the trace and the metrics ask for these several times per rollout.
        # Computed once here: Python 3.11's cached_property takes a lock on every first
        # access, which cost more than the reduction.
        first, last = _bounds(versions)
        self.__dict__.update(policy_mask=mask, first_version=first, last_version=last)

    @property
    def sample_id(self) -> str:
        """``"<group_id>:<sample_index>"``, unique within a run."""
        return f"{self.group_id}:{self.sample_index}"

    @property
    def num_tokens(self) -> int:
        return len(self.completion_tokens)

    @property
    def num_policy_tokens(self) -> int:
        """Completion tokens the policy sampled (the ones trained on)."""
        return int(self.policy_mask.sum())


@dataclass(frozen=True)
class RolloutGroup:
    """The ``n`` completions of one issued prompt."""

    group_id: int
    problem_id: str
    rollouts: tuple[Rollout, ...]

    @property
    def rewards(self) -> np.ndarray:
        return np.array([r.reward for r in self.rollouts], np.float32)

    @property
    def equal_rewards(self) -> bool:
        """Whether every reward is the same as float32 (``rewards``, what the
        advantages are computed in). Rounding is monotonic, so the extremes decide."""
        values = [r.reward for r in self.rollouts]
        return not values or bool(np.float32(min(values)) == np.float32(max(values)))

    @functools.cached_property
    def first_version(self) -> int:
        return min(r.first_version for r in self.rollouts)

    @functools.cached_property
    def last_version(self) -> int:
        """The newest weight version any of its tokens was sampled with."""
        return max(r.last_version for r in self.rollouts)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rollouts)
