"""On-policy distillation: a teacher's per-token log-probs on the student's own samples
as a dense reward.

The student samples ``y ~ π_student``; the teacher scores the same tokens, and every
completion token gets the reward

    r_t = log π_teacher(y_t | y_<t) - log π_student(y_t | y_<t),

a one-sample estimate of the negative per-token reverse KL ``-KL(π_student ‖ π_teacher)``
at that position. Used as the token's advantage (no discount, no baseline), the policy
gradient ``E[Σ_t r_t ∇ log π_student(y_t)]`` is the gradient of ``-KL`` taken token by
token, the "discount 0" on-policy distillation of Agarwal et al. 2024 (GKD, reverse KL,
λ = 1: only student samples) and of the Qwen3 report (arXiv 2505.09388, §4.5), which
trains small models on a larger one's log-probs over their own rollouts. The student's
log-probs are the sampler's (``behaviour_logprobs``), the distribution the tokens were
drawn from, at the same temperature as the teacher's.

With ``task_reward`` the distillation advantage is added to the task's advantage from
the run's estimator (GRPO's group-relative one, say); without it, it replaces it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from rlaxkit.models import ModelConfig


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """How the teacher's reward enters the advantage (``A_t = A_task + weight · r_t``).

    Attributes:
        weight: scale of the per-token distillation reward ``r_t``.
        task_reward: add the task's advantage (``True``) or train on ``weight · r_t``
            alone (``False``).
        teacher_model: the teacher's architecture when it is not the student's (another
            size, the same vocabulary); its weights are ``TrainState.teacher_params``.
    """

    weight: float = 1.0
    task_reward: bool = True
    teacher_model: ModelConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.weight, bool) or not isinstance(self.weight, int | float):
            raise ValueError(f"weight: must be a number > 0, got {self.weight!r}")
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"weight: must be a finite number > 0, got {self.weight!r}")
        if not isinstance(self.task_reward, bool):
            raise ValueError(f"task_reward: must be true or false, got {self.task_reward!r}")
        if self.teacher_model is not None and not isinstance(self.teacher_model, ModelConfig):
            raise ValueError(
                f"teacher_model: must be a ModelConfig or None, got {self.teacher_model!r}"
            )


def distillation_rewards(
    teacher_logprobs: jax.Array, student_logprobs: jax.Array, loss_mask: jax.Array
) -> jax.Array:
    """Per-token reverse-KL reward ``(log π_teacher - log π_student) · mask``, ``[B, T]``.

    Positions outside ``loss_mask`` (prompt, padding, a tool's output) get 0, also where
    a log-prob there is ``-inf``.

    >>> import jax.numpy as jnp
    >>> distillation_rewards(
    ...     jnp.log(jnp.array([[0.5, 0.25]])), jnp.log(jnp.array([[0.25, 0.25]])),
    ...     jnp.array([[1.0, 1.0]]),
    ... ).round(4).tolist()
    [[0.6930999755859375, 0.0]]
    """
    mask = loss_mask.astype(jnp.float32) > 0
    return jnp.where(mask, teacher_logprobs - student_logprobs, 0.0)


def distillation_advantages(
    task_advantages: jax.Array,
    teacher_logprobs: jax.Array,
    student_logprobs: jax.Array,
    loss_mask: jax.Array,
    cfg: DistillConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``A_t = [A_task,t] + weight · r_t`` (``r_t``: ``distillation_rewards``), and the
    batch's ``distill_reward_mean`` (mean ``r_t`` over completion tokens, minus the
    reverse-KL estimate) and ``distill_reverse_kl`` (its negation).

    >>> import jax.numpy as jnp
    >>> advantages, stats = distillation_advantages(
    ...     jnp.array([[1.0, 1.0]]), jnp.array([[-1.0, -2.0]]), jnp.array([[-2.0, -2.0]]),
    ...     jnp.array([[1.0, 1.0]]), DistillConfig(weight=0.5, task_reward=True),
    ... )
    >>> advantages.tolist(), float(stats["distill_reverse_kl"])
    ([[1.5, 1.0]], -0.5)
    """
    rewards = distillation_rewards(teacher_logprobs, student_logprobs, loss_mask)
    advantages = cfg.weight * rewards
    if cfg.task_reward:
        advantages = advantages + task_advantages
    mean = jnp.sum(rewards) / jnp.maximum(jnp.sum(loss_mask.astype(jnp.float32)), 1.0)
    return advantages, {"distill_reward_mean": mean, "distill_reverse_kl": -mean}
