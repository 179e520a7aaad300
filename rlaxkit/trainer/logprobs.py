"""Per-token log-probabilities of given tokens under a model: the trainer's side of the
sampler/trainer log-prob parity that every off-policy correction depends on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlaxkit.models.transformer import Transformer


def logprobs_from_logits(
    logits: jax.Array, targets: jax.Array, temperature: float | jax.Array = 1.0
) -> jax.Array:
    """``log softmax(logits / temperature)[target]`` per position, in float32.

    Args:
        logits: ``[..., vocab]``.
        targets: ``[...]`` integer token ids.
        temperature: > 0; the sampler's temperature, so behaviour and recomputed
            log-probs describe the same distribution.
    """
    scaled = logits.astype(jnp.float32) / temperature
    picked = jnp.take_along_axis(scaled, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(scaled, axis=-1)


def entropy_from_logits(logits: jax.Array, temperature: float | jax.Array = 1.0) -> jax.Array:
    """Entropy ``-sum p log p`` of ``softmax(logits / temperature)`` per position."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def logprobs_and_entropy(
    logits: jax.Array, targets: jax.Array, temperature: float | jax.Array = 1.0
) -> tuple[jax.Array, jax.Array]:
    """``logprobs_from_logits`` and ``entropy_from_logits`` in one pass over the logits.

    With ``z = logits / T``, ``m = max z``, ``s = Σ exp(z - m)`` and ``lse = m + log s``:
    ``log p[target] = z[target] - lse`` and ``H = lse - Σ exp(z - m) z / s``. The
    trainer's forward reads its ``[B, T, vocab]`` logits once here instead of three times
    (pick, log-sum-exp, entropy's own log-softmax), and the backward pass goes through a
    single softmax.
    """
    scaled = logits.astype(jnp.float32) / temperature
    top = jax.lax.stop_gradient(jnp.max(scaled, axis=-1, keepdims=True))
    unnormalised = jnp.exp(scaled - top)
    total = jnp.sum(unnormalised, axis=-1)
    lse = top[..., 0] + jnp.log(total)
    picked = jnp.take_along_axis(scaled, targets[..., None], axis=-1)[..., 0]
    entropy = lse - jnp.sum(unnormalised * scaled, axis=-1) / total
    return picked - lse, entropy


def token_logprobs(
    model: Transformer,
    tokens: jax.Array,
    positions: jax.Array,
    attention_mask: jax.Array,
    temperature: float | jax.Array = 1.0,
) -> jax.Array:
    """Log-prob of every token given the tokens before it, ``[B, T]``.

    Entry ``[b, t]`` is ``log p(tokens[b, t] | tokens[b, :t])`` for ``t >= 1``; entry
    ``[b, 0]`` (no context) is 0. Padding entries are meaningless; mask them.
    """
    logits = model(tokens, positions, attention_mask)
    picked = logprobs_from_logits(logits[:, :-1], tokens[:, 1:], temperature)
    return jnp.pad(picked, ((0, 0), (1, 0)))
