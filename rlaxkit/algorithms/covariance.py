"""Clip-Cov and KL-Cov: surrogates that keep the policy's entropy from collapsing.

Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models" (arXiv 2505.22617): under a softmax policy, a policy-gradient step lowers the
entropy by about the covariance between a token's log-probability and its advantage, and
a small share of tokens with a high covariance drives the collapse. Both methods score
every token of the (micro-)batch with the centred product

    cov_t = (log π_θ(t) - mean(log π_θ)) · (A_t - mean(A))

(means over the tokens in the loss, both factors stop-gradient) and treat
``n = max(1, ⌊r · N⌋)`` of the ``N`` tokens differently (``r = cov_fraction``):

* **Clip-Cov**: PPO's clipped objective, and ``n`` tokens drawn at random among those the
  clip left active with ``ω_low < cov_t < ω_high`` lose their gradient.
* **KL-Cov**: the plain ``r A`` objective, and the ``n`` tokens of largest ``cov_t`` are
  penalised by ``β |log r_t|`` (a KL to the old policy on those tokens only).

Defaults (``LossConfig``) are verl's: ``r = 2e-4`` for both, ``[ω_low, ω_high] = [1, 5]``,
``β = 1``; the paper tunes ``r`` per model size. As in verl, the tokens are picked within
each micro-batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlaxkit.algorithms.objective import SURROGATES, SurrogateContext, ppo_clip_surrogate

sg = jax.lax.stop_gradient


def token_covariance(logprobs: jax.Array, advantages: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """``cov_t = (log π(t) - mean log π) · (A_t - mean A)`` over the masked tokens, 0 off
    the mask, ``[B, T]`` (stop-gradient).

    >>> token_covariance(jnp.array([[-1.0, -3.0]]), jnp.array([[2.0, 0.0]]),
    ...                  jnp.ones((1, 2))).tolist()
    [[1.0, 1.0]]
    """
    mask = loss_mask.astype(jnp.float32)
    on = mask > 0
    count = jnp.maximum(jnp.sum(mask), 1.0)
    logprobs = sg(jnp.where(on, logprobs, 0.0))
    advantages = sg(jnp.where(on, advantages, 0.0))
    centred_logp = logprobs - jnp.sum(logprobs) / count
    centred_adv = advantages - jnp.sum(advantages) / count
    return jnp.where(on, centred_logp * centred_adv, 0.0)


def picked_count(fraction: float, loss_mask: jax.Array) -> jax.Array:
    """``max(1, ⌊fraction · N⌋)`` with ``N`` the tokens in the loss (a traced int32)."""
    tokens = jnp.sum(loss_mask.astype(jnp.float32))
    return jnp.maximum(jnp.floor(fraction * tokens), 1.0).astype(jnp.int32)


def top_tokens(scores: jax.Array, eligible: jax.Array, count: jax.Array) -> jax.Array:
    """The ``count`` eligible tokens of highest score (all of them if fewer), ``[B, T]``
    bool. Static shapes: a token is picked when its rank among the eligible ones is below
    ``count``, so ``count`` may be traced."""
    flat = jnp.where(eligible, scores, -jnp.inf).reshape(-1)
    order = jnp.argsort(-flat, stable=True)
    ranks = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    return eligible & (ranks.reshape(scores.shape) < count)


def _context(name: str, context: SurrogateContext | None) -> SurrogateContext:
    if context is None:
        raise ValueError(
            f"surrogate {name!r} reads the batch's log-probs and mask: call it with a "
            "SurrogateContext (rl_loss passes one)"
        )
    return context


@SURROGATES.register("clip_cov")
def clip_cov_surrogate(ratio, log_ratio, advantages, cfg, context=None):
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617): PPO's ``min(r A, clip(r) A)``, and
    ``sg`` of it on ``n = max(1, ⌊r N⌋)`` tokens drawn uniformly among the unclipped ones
    with ``clip_cov_low < cov_t < clip_cov_high``.

    A picked token keeps its value in the loss and loses its gradient (verl multiplies
    its term by 0: the same gradient, a smaller reported loss). The draw uses
    ``context.key``. Returns the objective and ``clipped | picked``.
    """
    context = _context("clip_cov", context)
    objective, clipped = ppo_clip_surrogate(ratio, log_ratio, advantages, cfg)
    cov = token_covariance(context.logprobs, advantages, context.loss_mask)
    eligible = (
        (context.loss_mask > 0) & ~clipped & (cov > cfg.clip_cov_low) & (cov < cfg.clip_cov_high)
    )
    priority = jax.random.uniform(context.key, cov.shape)
    picked = top_tokens(priority, eligible, picked_count(cfg.cov_fraction, context.loss_mask))
    return jnp.where(picked, sg(objective), objective), clipped | picked


@SURROGATES.register("kl_cov")
def kl_cov_surrogate(ratio, log_ratio, advantages, cfg, context=None):
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617): ``r A`` (no clip), minus
    ``kl_cov_coef · |log r_t|`` on the ``n = max(1, ⌊r N⌋)`` tokens of largest ``cov_t``.

    Returns the objective and the penalised tokens (counted as ``clip_fraction``).
    """
    context = _context("kl_cov", context)
    cov = token_covariance(context.logprobs, advantages, context.loss_mask)
    picked = top_tokens(
        cov, context.loss_mask > 0, picked_count(cfg.cov_fraction, context.loss_mask)
    )
    penalty = jnp.where(picked, cfg.kl_cov_coef * jnp.abs(log_ratio), 0.0)
    return ratio * advantages - penalty, picked
