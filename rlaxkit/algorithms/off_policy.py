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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
    log_w = (proximal_logprobs - behaviour_logprobs) * mask
    if level == "sequence":
        log_w = jnp.sum(log_w, axis=1, keepdims=True) * mask
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
