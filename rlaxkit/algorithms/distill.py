"""On-policy distillation: a teacher scores the student's own samples, the sampled
tokens' log-probs as a dense reward (``sampled``) or its whole next-token distribution
in an exact KL term of the loss (``full``).

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

That is the ``sampled`` estimator. It is right in expectation but noisy where a
completion has few tokens: it moves only the sampled token's probability, by how much
more or less the teacher likes it, and never names the token the teacher prefers. The
``full`` estimator instead adds the exact divergence over the whole vocabulary to the
loss (GKD's full-distribution divergence, Agarwal et al. 2024, arXiv 2306.13649,
reverse KL with λ = 1):

    L_distill = weight · Σ_t w_t · KL(π_student(·|ctx_t) ‖ π_teacher(·|ctx_t)),

over the completion positions of the student's own samples (on-policy contexts), with
the run's token-aggregation weights ``w_t``; the student's log-softmax carries the
gradient, the teacher's is a constant (``full_distillation_loss``). The task advantage
still enters the policy gradient with ``task_reward``; no per-token distillation
advantage is added. The cost: the teacher's forward pass runs in every micro-batch's
loss and its ``[rows, T, vocab]`` log-softmax is held for the backward pass, as large as
the student's own logits; at a vocabulary of 150k tokens that doubles the loss's largest
activation. Keeping the teacher's top-k tokens is the usual remedy (not built here).
Both estimators report ``distill_reverse_kl``, the exact mean KL per completion token
(``reverse_kl``; with ``sampled`` it costs the train step one more forward pass of the
student, before the updates).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from rlaxkit.models import ModelConfig

Estimator = Literal["sampled", "full"]


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """How the teacher trains the student: its per-token reward in the advantage
    (``sampled``: ``A_t = A_task + weight · r_t``) or the exact reverse KL in the loss
    (``full``: ``loss + weight · Σ_t w_t KL_t``).

    Attributes:
        weight: scale of the per-token distillation reward ``r_t`` or of the KL term.
        task_reward: add the task's advantage (``True``) or train on ``weight · r_t``
            alone (``False``).
        teacher_model: the teacher's architecture when it is not the student's (another
            size, the same vocabulary); its weights are ``TrainState.teacher_params``.
        estimator: ``sampled`` (the sampled token's ``r_t`` as its advantage) or ``full``
            (the exact KL over the vocabulary in the loss); see the module docstring.
    """

    weight: float = 1.0
    task_reward: bool = True
    teacher_model: ModelConfig | None = None
    estimator: Estimator = "sampled"

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
        if self.estimator not in get_args(Estimator):
            raise ValueError(
                f"estimator: must be one of {get_args(Estimator)}, got {self.estimator!r}"
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
    token_kl: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``A_t = [A_task,t] + weight · r_t`` (``r_t``: ``distillation_rewards``), and the
    batch's ``distill_reward_mean`` (mean ``r_t`` over completion tokens: minus a
    one-sample reverse-KL estimate) and, given the exact per-position ``token_kl``
    (``reverse_kl``), ``distill_reverse_kl``, its mean over completion tokens.

    >>> import jax.numpy as jnp
    >>> advantages, stats = distillation_advantages(
    ...     jnp.array([[1.0, 1.0]]), jnp.array([[-1.0, -2.0]]), jnp.array([[-2.0, -2.0]]),
    ...     jnp.array([[1.0, 1.0]]), DistillConfig(weight=0.5, task_reward=True),
    ...     token_kl=jnp.array([[0.25, 0.75]]),
    ... )
    >>> advantages.tolist(), float(stats["distill_reward_mean"]), float(stats["distill_reverse_kl"])
    ([[1.5, 1.0]], 0.5, 0.5)
    """
    rewards = distillation_rewards(teacher_logprobs, student_logprobs, loss_mask)
    advantages = cfg.weight * rewards
    if cfg.task_reward:
        advantages = advantages + task_advantages
    tokens = jnp.maximum(jnp.sum(loss_mask.astype(jnp.float32)), 1.0)
    stats = {"distill_reward_mean": jnp.sum(rewards) / tokens}
    if token_kl is not None:
        on = loss_mask.astype(jnp.float32) > 0
        stats["distill_reverse_kl"] = jnp.sum(jnp.where(on, token_kl, 0.0)) / tokens
    return advantages, stats


def reverse_kl(
    student_logits: jax.Array, teacher_logits: jax.Array, temperature: float | jax.Array = 1.0
) -> jax.Array:
    """The exact ``KL(π_student ‖ π_teacher) = Σ_v p_S(v) (log p_S(v) - log p_T(v))`` per
    position over the whole vocabulary, of the softmaxes of ``logits / temperature``
    (``[..., vocab] -> [...]``, float32). Gradients flow through both arguments; stop the
    teacher's.

    >>> import jax.numpy as jnp
    >>> float(reverse_kl(jnp.log(jnp.array([0.5, 0.5])), jnp.log(jnp.array([0.25, 0.75]))))
    0.143841...
    """
    student = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    teacher = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
    return jnp.sum(jnp.exp(student) * (student - teacher), axis=-1)


def full_distillation_loss(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    token_weights: jax.Array,
    metric_weights: jax.Array,
    cfg: DistillConfig,
    temperature: float | jax.Array = 1.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The ``full`` estimator's loss term ``weight · Σ_t w_t · KL_t`` and its metric.

    ``KL_t = reverse_kl(student_logits, stop_gradient(teacher_logits))`` at each position
    of the student's own samples. ``token_weights`` ``w_t`` are the run's aggregation
    weights (zero off the loss mask) and ``metric_weights`` the loss mask over its token
    count, both ``[rows, T]`` and constants. The logits ``[rows, T', vocab]`` are those of
    the last ``T'`` tokens (the trainer's, ``T' = T - 1``: the distribution of token
    ``t`` is computed at position ``t - 1``, and the first token has none). Returns the
    term (its gradient flows into ``student_logits`` only) and ``{"distill_reverse_kl":
    Σ_t metric_weights_t · KL_t}``, the mean KL per completion token. Positions of weight
    0 add nothing, whatever their logits.

    >>> import jax.numpy as jnp
    >>> loss, stats = full_distillation_loss(
    ...     jnp.log(jnp.array([[[0.5, 0.5], [0.9, 0.1]]])),
    ...     jnp.log(jnp.array([[[0.25, 0.75], [0.5, 0.5]]])),
    ...     jnp.array([[0.5, 0.0]]), jnp.array([[1.0, 0.0]]), DistillConfig(weight=2.0),
    ... )
    >>> round(float(loss), 6), round(float(stats["distill_reverse_kl"]), 6)
    (0.143841, 0.143841)
    """
    kl = reverse_kl(student_logits, jax.lax.stop_gradient(teacher_logits), temperature)
    kl = jnp.pad(kl, ((0, 0), (token_weights.shape[1] - kl.shape[1], 0)))
    token_weights, metric_weights = (
        jax.lax.stop_gradient(w.astype(jnp.float32)) for w in (token_weights, metric_weights)
    )
    term = cfg.weight * jnp.sum(jnp.where(token_weights != 0, token_weights * kl, 0.0))
    mean = jnp.sum(jnp.where(metric_weights != 0, metric_weights * kl, 0.0))
    return term, {"distill_reverse_kl": jax.lax.stop_gradient(mean)}
