"""Off-policy corrections: AReaL's decoupled PPO and sampler/trainer mismatch weights.

Three policies meet in asynchronous RL (Fu et al. 2025, AReaL, arXiv 2505.24298):

* ``π_behaviour`` sampled the tokens (possibly several versions behind, possibly a
  numerically different inference graph),
* ``π_prox`` (the proximal policy) is the trust-region centre: the trainer's weights
  just before this update,
* ``π_θ`` is the policy being optimised.

The decoupled PPO objective clips ``π_θ / π_prox`` and corrects the remaining
off-policyness with a stop-gradient weight ``π_prox / π_behaviour``:
``J = E_{π_behaviour}[ sg(π_prox/π_behaviour) · min(r A, clip(r, 1-ε, 1+ε) A) ]``,
``r = π_θ / π_prox``. The same weight, truncated (TIS) or used to mask tokens (MIS),
corrects the sampler/trainer mismatch when ``π_prox`` is the trainer's recomputation of
the behaviour version.

Rollout rejection (``REJECTION_MASKS``) drops instead of weighting: a token, or a whole
sequence, whose ratio ``π_prox / π_behaviour`` falls outside ``[low, high]`` leaves the loss
and its normaliser (IcePop, inclusionAI's Ring-1T report, arXiv 2510.18855, masks tokens
outside a two-sided band against MoE train/inference mismatch; verl's rollout correction
offers token, sequence and geometric-mean levels).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from rlaxkit.algorithms.registry import Registry

LOG_RATIO_BOUND = 20.0
"""``|log π_a - log π_b|`` past which a ratio is clamped before ``exp`` (float32 overflows
past about 88.7) and gets no gradient: the objective's ratio, ``k3``, behaviour weights."""

# ``fn(log_ratio [B, T], loss_mask [B, T], log_low, log_high) -> accepted [B, T]``.
RejectionFn = Callable[[jax.Array, jax.Array, float, float], jax.Array]
REJECTION_MASKS: Registry[RejectionFn] = Registry("rejection mask")


def loglinear_proximal_logprobs(
    behaviour_logprobs: jax.Array,
    current_logprobs: jax.Array,
    versions: jax.Array,
    proximal_version: jax.Array | int,
) -> jax.Array:
    """AReaL's log-linear approximation of the proximal log-probs, without a forward pass.

    With ``v_b`` the version that sampled a token, ``v_prox`` the trainer's version
    before the update and ``v_θ = v_prox + 1``:
    ``α = (v_prox - v_b) / (v_θ - v_b)`` and
    ``log π_prox ≈ log π_b + α (log π_θ - log π_b)``. A token sampled by the current
    version (``v_b = v_prox``) gets ``α = 0``, i.e. its behaviour log-prob, which is then
    exact. Versions newer than ``v_prox`` (impossible unless a restore rewound the
    trainer) are treated as ``v_prox``.

    Args:
        behaviour_logprobs: ``[B, T]`` log π_b.
        current_logprobs: ``[B, T]`` log π_θ (the caller stops its gradient).
        versions: ``[B, T]`` int32 version of each token.
        proximal_version: the trainer version ``v_prox``.
    """
    gap = (proximal_version - jnp.minimum(versions, proximal_version)).astype(jnp.float32)
    alpha = gap / (gap + 1.0)
    return behaviour_logprobs + alpha * (current_logprobs - behaviour_logprobs)


def behaviour_weights(
    proximal_logprobs: jax.Array,
    behaviour_logprobs: jax.Array,
    loss_mask: jax.Array,
    *,
    mode: str,
    cap: float,
    level: str = "token",
) -> tuple[jax.Array, jax.Array]:
    """Stop-gradient importance weights ``w = π_prox / π_behaviour`` per token.

    ``level='token'``: ``log w_t = log π_prox(t) - log π_b(t)``; ``level='sequence'``:
    one weight per row, ``log w_i = Σ_t log π_prox(t) - log π_b(t)`` (the sequence
    likelihood ratio). Modes: ``none`` (w = 1), ``full`` (w), ``truncate``
    (``min(w, C)``, truncated IS) and ``mask`` (``w`` where ``w <= C``, else 0: masked IS;
    a dropped token stays in the aggregation normaliser).

    Returns:
        ``(weights, kept)``, each ``[B, T]``; ``kept`` is 0 for tokens ``mask`` dropped.
    """
    mask = loss_mask.astype(jnp.float32)
    # ``where``, not ``* mask``: a masked ``-inf`` must not become ``nan``.
    log_w = jnp.where(mask > 0, proximal_logprobs - behaviour_logprobs, 0.0)
    if level == "sequence":
        log_w = jnp.where(mask > 0, jnp.sum(log_w, axis=1, keepdims=True), 0.0)
    log_w = jnp.clip(log_w, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    log_cap = jnp.log(jnp.float32(cap))
    kept = jnp.ones_like(mask)
    if mode == "none":
        weights = jnp.ones_like(mask)
    elif mode == "full":
        weights = jnp.exp(log_w)
    elif mode == "truncate":
        weights = jnp.exp(jnp.minimum(log_w, log_cap))
    elif mode == "mask":
        kept = (log_w <= log_cap).astype(jnp.float32)
        weights = jnp.exp(jnp.minimum(log_w, log_cap)) * kept
    else:
        raise ValueError(f"mode: must be one of ('none', 'full', 'truncate', 'mask'), got {mode!r}")
    return jax.lax.stop_gradient(weights * mask), kept * mask


def _token_log_ratio(log_ratio: jax.Array, loss_mask: jax.Array) -> jax.Array:
    return jnp.where(loss_mask > 0, log_ratio, 0.0)


def _inside(log_ratio: jax.Array, log_low: float, log_high: float) -> jax.Array:
    return ((log_ratio >= log_low) & (log_ratio <= log_high)).astype(jnp.float32)


@REJECTION_MASKS.register("none")
def _accept_all(log_ratio, loss_mask, log_low, log_high):
    """Every token is kept."""
    return loss_mask


@REJECTION_MASKS.register("token")
def _token_rejection(log_ratio, loss_mask, log_low, log_high):
    """Keep token ``t`` iff ``low ≤ π_prox(t)/π_b(t) ≤ high`` (IcePop's two-sided band)."""
    return _inside(_token_log_ratio(log_ratio, loss_mask), log_low, log_high) * loss_mask


@REJECTION_MASKS.register("sequence")
def _sequence_rejection(log_ratio, loss_mask, log_low, log_high):
    """Keep row ``i`` iff ``low ≤ Π_t π_prox(t)/π_b(t) ≤ high`` (the sequence likelihood
    ratio; long sequences drift further, so its band is usually wide)."""
    total = jnp.sum(_token_log_ratio(log_ratio, loss_mask), axis=1, keepdims=True)
    return _inside(total, log_low, log_high) * loss_mask


@REJECTION_MASKS.register("geometric")
def _geometric_rejection(log_ratio, loss_mask, log_low, log_high):
    """Keep row ``i`` iff ``low ≤ (Π_t π_prox(t)/π_b(t))^{1/|o_i|} ≤ high`` (the per-token
    geometric mean, length-independent; its band is narrow, e.g. ``[0.999, 1.001]``)."""
    lengths = jnp.maximum(jnp.sum(loss_mask, axis=1, keepdims=True), 1.0)
    total = jnp.sum(_token_log_ratio(log_ratio, loss_mask), axis=1, keepdims=True)
    return _inside(total / lengths, log_low, log_high) * loss_mask


def rejection_mask(
    proximal_logprobs: jax.Array,
    behaviour_logprobs: jax.Array,
    loss_mask: jax.Array,
    level: str,
    low: float,
    high: float,
) -> jax.Array:
    """The tokens a rollout rejection mask keeps, ``[B, T]`` (1 kept, 0 rejected or off
    the mask; stop-gradient).

    ``level`` names a ``REJECTION_MASKS`` entry: ``none``, ``token``, ``sequence`` or
    ``geometric``; the ratio ``π_prox/π_b`` is compared with ``[low, high]`` in log space,
    so no ``exp`` overflows, and a ``-inf`` log-prob off the mask is never read.

    >>> lp = jnp.log(jnp.array([[0.5, 0.5, 0.5]]))
    >>> rejection_mask(lp, lp - jnp.log(jnp.array([[1.0, 3.0, 0.1]])), jnp.ones((1, 3)),
    ...                "token", 0.5, 5.0).tolist()
    [[1.0, 1.0, 0.0]]
    """
    fn = REJECTION_MASKS.get(level)
    mask = loss_mask.astype(jnp.float32)
    log_ratio = jnp.where(mask > 0, proximal_logprobs - behaviour_logprobs, 0.0)
    return jax.lax.stop_gradient(fn(log_ratio, mask, math.log(low), math.log(high)))
