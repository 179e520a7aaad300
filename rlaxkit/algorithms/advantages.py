"""Advantage estimators: pure functions from rewards (and values) to per-token advantages.

Conventions shared by every function here:

* A batch has ``B`` rows (sequences) and ``T`` token positions. Row-level inputs are
  ``[B]``; token-level inputs are ``[B, T]`` and aligned like ``token_logprobs``: entry
  ``t`` describes the action ``tokens[t]`` taken after ``tokens[:t]``.
* ``sequence_mask [B]`` marks real rows (padding rows added by bucketing are 0) and
  ``loss_mask [B, T]`` marks the completion tokens the policy sampled (a tool's
  observation inside a multi-turn completion is 0). Results are zero where masked.
* ``group_ids [B]`` are dense integers in ``[0, B)``: rows with the same id answer the
  same prompt (``rlaxkit.data.batch.collate`` builds them).

The registered estimators (``ADVANTAGE_ESTIMATORS``) all take ``(AdvantageInputs,
AdvantageConfig)`` and return ``(advantages [B, T], returns [B, T] | None)``; they are thin
adapters over the math functions below, which are usable on their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from rlaxkit.algorithms.registry import Registry

if TYPE_CHECKING:
    from rlaxkit.algorithms.config import AdvantageConfig

AdvantageFn = Callable[["AdvantageInputs", "AdvantageConfig"], tuple[jax.Array, jax.Array | None]]
ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")


@jax.tree_util.register_dataclass
@dataclass
class AdvantageInputs:
    """What an advantage estimator may read.

    Attributes:
        rewards: ``[B]`` scalar reward per sequence.
        group_ids: ``[B]`` int32 prompt group of each row, dense in ``[0, B)``.
        sequence_mask: ``[B]`` 1 for real rows.
        loss_mask: ``[B, T]`` 1 for completion tokens the policy sampled.
        values: ``[B, T]`` critic values ``V(tokens[:t])`` (GAE only).
        token_kl: ``[B, T]`` per-token ``log π_old - log π_ref`` for a KL penalty folded
            into the reward (REINFORCE++, PPO); ``None`` when there is no reference.
    """

    rewards: jax.Array
    group_ids: jax.Array
    sequence_mask: jax.Array
    loss_mask: jax.Array
    values: jax.Array | None = None
    token_kl: jax.Array | None = None


def group_statistics(
    rewards: jax.Array, group_ids: jax.Array, sequence_mask: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-row mean, sample standard deviation and size of the row's group.

    ``std`` is Bessel-corrected, ``sqrt(Σ (r - mean)² / (n - 1))``, and 0 for a group of
    one. Padding rows count in no group.

    Returns:
        ``(mean, std, count)``, each ``[B]`` and indexed by row.
    """
    num = rewards.shape[0]
    valid = sequence_mask.astype(jnp.float32)
    ids = jnp.clip(group_ids, 0, num - 1)
    count = jax.ops.segment_sum(valid, ids, num)
    total = jax.ops.segment_sum(valid * rewards, ids, num)
    mean = (total / jnp.maximum(count, 1.0))[ids]
    squares = jax.ops.segment_sum(valid * (rewards - mean) ** 2, ids, num)
    std = jnp.sqrt(squares / jnp.maximum(count - 1.0, 1.0))[ids]
    return mean, std, count[ids]


def grpo_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    sequence_mask: jax.Array,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    group_of_one: str = "zero",
    convention: str = "rlaxkit",
) -> jax.Array:
    """GRPO group-normalised advantage per sequence, ``[B]``.

    ``A_i = (R_i - mean_g(R)) / (std_g(R) + eps)`` over the rows of ``i``'s group g
    (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300). With ``scale_by_std=False`` it is
    ``R_i - mean_g(R)``: Dr.GRPO (Liu et al. 2025, arXiv 2503.20783), which drops the std
    because it up-weights prompts that are nearly always or never solved. A group whose
    std is at most ``eps`` (all rewards equal) gets 0: its centred rewards are float
    rounding noise, which dividing by ``std + eps`` would blow up ``1/eps``-fold.

    ``convention='verl'`` divides by ``std + eps`` whatever the spread (verl's GRPO).
    ``group_of_one='reward'`` gives a prompt sampled once the baseline 0 and the std 1,
    i.e. ``A = R / (1 + eps)`` (verl's choice); the default ``'zero'`` gives it 0.
    """
    mean, std, count = group_statistics(rewards, group_ids, sequence_mask)
    if group_of_one == "reward":
        mean = jnp.where(count == 1, 0.0, mean)
        std = jnp.where(count == 1, 1.0, std)
    centred = rewards - mean
    advantages = centred
    if scale_by_std:
        verl = convention == "verl"
        advantages = centred / (std + eps) if verl else _scale_by_std(centred, std, eps)
    return advantages * sequence_mask


def rloo_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    sequence_mask: jax.Array,
    *,
    group_of_one: str = "zero",
) -> jax.Array:
    """REINFORCE leave-one-out advantage per sequence, ``[B]``.

    ``A_i = R_i - (1 / (n - 1)) Σ_{j ≠ i} R_j = n / (n - 1) · (R_i - mean_g(R))`` over the
    ``n`` rows of the group (Ahmadian et al. 2024, arXiv 2402.14740); 0 for a group of
    one, which has no baseline (``group_of_one='reward'``: the baseline is 0 and the
    advantage is the reward, as verl does).
    """
    mean, _, count = group_statistics(rewards, group_ids, sequence_mask)
    scale = jnp.where(count > 1, count / jnp.maximum(count - 1.0, 1.0), 0.0)
    advantages = scale * (rewards - mean)
    if group_of_one == "reward":
        advantages = jnp.where(count == 1, rewards, advantages)
    return advantages * sequence_mask


def terminal_rewards(rewards: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """Places each sequence's reward on its last completion token, ``[B, T]``."""
    t = loss_mask.shape[1]
    last = t - 1 - jnp.argmax(jnp.flip(loss_mask, axis=1) > 0, axis=1)
    has_tokens = jnp.any(loss_mask > 0, axis=1)
    return jax.nn.one_hot(last, t) * (rewards * has_tokens)[:, None]


def _scale_by_std(centred: jax.Array, std: jax.Array, eps: float) -> jax.Array:
    """``centred / (std + eps)``, and 0 where ``std <= eps`` (no spread, only rounding)."""
    return jnp.where(std > eps, centred / (std + eps), 0.0)


def masked_whiten(
    values: jax.Array, mask: jax.Array, eps: float = 1e-6, convention: str = "rlaxkit"
) -> jax.Array:
    """``(x - mean) / (std + eps)`` with mean and (population) std over masked entries.

    All zeros when ``std <= eps`` (see ``grpo_advantages``). ``convention='verl'``:
    ``(x - mean) / sqrt(var + 1e-8)`` with the Bessel-corrected variance
    ``Σ (x - mean)² / (n - 1)`` (verl's ``masked_whiten``; ``eps`` unused), which is
    ``sqrt((n - 1) / n)`` times the default's where the spread is large.
    """
    weights = mask.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(weights), 1.0)
    mean = jnp.sum(weights * values) / n
    squares = jnp.sum(weights * (values - mean) ** 2)
    if convention == "verl":
        variance = squares / jnp.maximum(n - 1.0, 1.0)
        return (values - mean) * jax.lax.rsqrt(variance + 1e-8) * weights
    std = jnp.sqrt(squares / n)
    return _scale_by_std(values - mean, std, eps) * weights


def reinforce_pp_advantages(
    rewards: jax.Array,
    loss_mask: jax.Array,
    *,
    token_kl: jax.Array | None = None,
    kl_coef: float = 0.0,
    eps: float = 1e-6,
    gamma: float = 1.0,
    convention: str = "rlaxkit",
) -> jax.Array:
    """REINFORCE++ advantage per token, ``[B, T]`` (Hu 2025, arXiv 2501.03262).

    Token rewards are the sequence reward on the last token minus a KL penalty
    ``β · (log π_old - log π_ref)`` on every token; the return is their discounted sum
    from ``t`` on, ``G_t = Σ_{s ≥ t} γ^{k(s) - k(t)} r_s`` with ``k`` counting policy
    tokens (a tool's observation inside the completion is stepped over, as in
    ``gae_advantages``; ``γ = 1`` is the paper's undiscounted return), and the advantage is
    ``G_t`` whitened over all completion tokens of the batch (global batch normalisation
    instead of a critic or a per-prompt baseline; ``convention`` as ``masked_whiten``).
    """
    mask = loss_mask.astype(jnp.float32)
    token_rewards = terminal_rewards(rewards, loss_mask)
    if token_kl is not None and kl_coef:
        token_rewards = token_rewards - kl_coef * token_kl * mask

    def step(following, column):
        reward, m = column
        here = reward + gamma * following
        return jnp.where(m > 0, here, following), here * m

    zeros = jnp.zeros(mask.shape[0], token_rewards.dtype)
    _, returns = jax.lax.scan(step, zeros, (token_rewards.T, mask.T), reverse=True)
    return masked_whiten(returns.T, loss_mask, eps, convention)


def gae_advantages(
    token_rewards: jax.Array,
    values: jax.Array,
    loss_mask: jax.Array,
    *,
    gamma: float,
    lam: float,
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over completion tokens (Schulman et al. 2016).

    ``δ_t = r_t + γ V_{n(t)} - V_t`` and ``A_t = δ_t + γ λ A_{n(t)}``, where ``n(t)`` is the
    next position after ``t`` inside ``loss_mask`` (``V`` and ``A`` are 0 past the last),
    computed right to left with ``lax.scan``. The return target of the critic is
    ``A_t + V_t``.

    Positions outside the mask are not actions: they get no advantage and the recursion
    steps over them. In a multi-turn episode a tool's observation sits between two policy
    turns with ``loss_mask`` 0, so the last policy token before it bootstraps from the
    value at the first policy token after it, and each policy token's advantage is the
    one it would have with the observation removed from the row (the observation is part
    of the state the next value sees, not a step of the policy). For a row whose
    completion is contiguous this is the textbook recursion, ``n(t) = t + 1``.

    Returns:
        ``(advantages, returns)``, each ``[B, T]``, zero outside ``loss_mask``.
    """
    mask = loss_mask.astype(jnp.float32)

    def step(following, column):
        # ``following``: (V, A) at the next policy position to the right, or zeros.
        next_value, next_advantage = following
        reward, value, m = column
        delta = reward + gamma * next_value - value
        advantage = (delta + gamma * lam * next_advantage) * m
        policy = m > 0
        carried = (
            jnp.where(policy, value, next_value),
            jnp.where(policy, advantage, next_advantage),
        )
        return carried, advantage

    zeros = jnp.zeros(values.shape[0], values.dtype)
    _, advantages = jax.lax.scan(
        step, (zeros, zeros), (token_rewards.T, values.T, mask.T), reverse=True
    )
    advantages = advantages.T
    return advantages, (advantages + values) * mask


def _per_token(row_advantages: jax.Array, loss_mask: jax.Array) -> jax.Array:
    return row_advantages[:, None] * loss_mask


@ADVANTAGE_ESTIMATORS.register("grpo")
def _grpo(inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[jax.Array, None]:
    rows = grpo_advantages(
        inputs.rewards,
        inputs.group_ids,
        inputs.sequence_mask,
        scale_by_std=cfg.scale_by_std,
        eps=cfg.eps,
        group_of_one=cfg.group_of_one,
        convention=cfg.convention,
    )
    return _per_token(rows, inputs.loss_mask), None


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def _dr_grpo(inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[jax.Array, None]:
    rows = grpo_advantages(
        inputs.rewards,
        inputs.group_ids,
        inputs.sequence_mask,
        scale_by_std=False,
        group_of_one=cfg.group_of_one,
    )
    return _per_token(rows, inputs.loss_mask), None


@ADVANTAGE_ESTIMATORS.register("rloo")
def _rloo(inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[jax.Array, None]:
    rows = rloo_advantages(
        inputs.rewards, inputs.group_ids, inputs.sequence_mask, group_of_one=cfg.group_of_one
    )
    return _per_token(rows, inputs.loss_mask), None


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def _reinforce_pp(inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[jax.Array, None]:
    advantages = reinforce_pp_advantages(
        inputs.rewards,
        inputs.loss_mask,
        token_kl=inputs.token_kl,
        kl_coef=cfg.kl_in_reward_coef,
        eps=cfg.eps,
        gamma=cfg.gamma,
        convention=cfg.convention,
    )
    return advantages, None


@ADVANTAGE_ESTIMATORS.register("gae")
def _gae(inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[jax.Array, jax.Array]:
    if inputs.values is None:
        raise ValueError("advantage estimator 'gae' needs values: train with a value model")
    token_rewards = terminal_rewards(inputs.rewards, inputs.loss_mask)
    if inputs.token_kl is not None and cfg.kl_in_reward_coef:
        token_rewards = token_rewards - cfg.kl_in_reward_coef * inputs.token_kl
    return gae_advantages(
        token_rewards, inputs.values, inputs.loss_mask, gamma=cfg.gamma, lam=cfg.lam
    )


def compute_advantages(
    inputs: AdvantageInputs, cfg: AdvantageConfig
) -> tuple[jax.Array, jax.Array | None]:
    """Runs the estimator named by ``cfg.estimator``, then optional batch whitening.

    Returns:
        ``(advantages [B, T], returns [B, T] or None)``; ``returns`` are the critic
        targets of estimators that use one (GAE).
    """
    advantages, returns = ADVANTAGE_ESTIMATORS.get(cfg.estimator)(inputs, cfg)
    if cfg.whiten:
        advantages = masked_whiten(advantages, inputs.loss_mask, cfg.eps, cfg.convention)
    return advantages, returns
