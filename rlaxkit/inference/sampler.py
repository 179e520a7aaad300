"""Drawing one token per row from logits: temperature, top-k, top-p, min-p, greedy, and the
log-probs the trainer needs. Pure functions on arrays, jit-able.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlaxkit.inference.config import SamplingConfig
from rlaxkit.logprobs import logprobs_from_logits


def kept_tokens(
    scaled_logits: jax.Array, *, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> jax.Array:
    """Which tokens survive top-k, then top-p, then min-p truncation, ``[..., vocab]`` bool.

    With ``p = softmax(scaled_logits)``:

    * top-k keeps tokens whose logit is ``>=`` the ``k``-th largest (ties at the boundary
      are all kept);
    * top-p sorts what top-k kept by probability, renormalises, and keeps the shortest
      prefix whose mass reaches ``top_p`` (a token is kept when the mass strictly before
      it is ``< top_p``, so the most likely token always is);
    * min-p keeps tokens with ``p >= min_p * max(p)``, i.e. ``logit >= max + log(min_p)``.

    The most likely token is always kept. Settings at their neutral values (0, 1, 0) are
    skipped at trace time.

    Args:
        scaled_logits: ``[..., vocab]`` logits already divided by the temperature.
        top_k: 0 disables; otherwise at most the vocab size is meaningful.
        top_p: in (0, 1]; 1 disables.
        min_p: in [0, 1); 0 disables.
    """
    vocab = scaled_logits.shape[-1]
    keep = jnp.ones(scaled_logits.shape, bool)
    k = top_k if 0 < top_k < vocab else vocab
    if top_p < 1.0 or k < vocab:
        # Candidates in descending order; only the top k of them when top-k is on, so a
        # large vocabulary is sorted only when top-p alone is asked for.
        candidates = jax.lax.top_k(scaled_logits, k)[0]
        if k < vocab:
            keep &= scaled_logits >= candidates[..., -1:]
        if top_p < 1.0:
            probs = jax.nn.softmax(candidates, axis=-1)
            mass_before = jnp.cumsum(probs, axis=-1) - probs
            count = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)
            cutoff = jnp.take_along_axis(candidates, count - 1, axis=-1)
            keep &= scaled_logits >= cutoff
    if min_p > 0.0:
        top = jnp.max(scaled_logits, axis=-1, keepdims=True)
        keep &= scaled_logits >= top + jnp.log(min_p)
    return keep


def inverse_cdf_sample(keys: jax.Array, scaled_logits: jax.Array) -> jax.Array:
    """One token per row drawn from ``softmax(scaled_logits)`` by inverting its CDF.

    With ``w = exp(z - max z)`` and ``c = cumsum(w)``, row ``b`` takes the first token
    ``i`` with ``c_i > u_b · c_V`` for one uniform ``u_b ~ U[0, 1)`` drawn with
    ``keys[b]``: token ``i`` is chosen with probability ``w_i / Σ w``, exactly the
    categorical distribution. Tokens with ``z = -inf`` (truncated away) have ``w = 0``
    and are never chosen. Compared with the Gumbel-max trick (``jax.random.categorical``)
    this draws one random number per row instead of one per vocabulary entry, which is
    most of a CPU decode step's sampling time.

    Args:
        keys: ``[rows]`` PRNG keys.
        scaled_logits: ``[rows, vocab]`` float32, ``-inf`` allowed where the most likely
            token is finite.

    Returns:
        ``[rows]`` int32 token ids.
    """
    weights = jnp.exp(scaled_logits - jnp.max(scaled_logits, axis=-1, keepdims=True))
    cdf = jnp.cumsum(weights, axis=-1)
    uniform = jax.vmap(jax.random.uniform)(keys)
    tokens = jnp.sum(cdf <= (uniform[:, None] * cdf[:, -1:]), axis=-1)
    # u · c_V rounds to at most c_V; never step past the last token with weight.
    last = weights.shape[-1] - 1 - jnp.argmax(weights[:, ::-1] > 0, axis=-1)
    return jnp.minimum(tokens, last).astype(jnp.int32)


def sample_tokens(
    keys: jax.Array, logits: jax.Array, config: SamplingConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One token per row, with its log-prob under the sampled and the plain distribution.

    The *sampled* distribution is the truncated, renormalised ``softmax(logits / T)`` the
    token was drawn from; the *plain* one is ``softmax(logits / T)`` without truncation,
    computed with ``rlaxkit.logprobs.logprobs_from_logits``, exactly what the trainer
    recomputes. They are equal when ``config.truncates`` is false. Greedy
    (``T == 0``) takes the exact argmax (lowest id among ties) and records both log-probs
    under ``softmax(logits)``, i.e. temperature 1, since ``T = 0`` has no finite density.

    Args:
        keys: ``[rows]`` PRNG keys, one per row (unused when greedy).
        logits: ``[rows, vocab]`` float32.
        config: the sampling configuration (static).

    Returns:
        ``tokens [rows]`` int32, ``logprobs [rows]`` (sampled distribution) and
        ``plain_logprobs [rows]`` (temperature only), float32.
    """
    logits = logits.astype(jnp.float32)
    if config.greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logprobs = logprobs_from_logits(logits, tokens, 1.0)
        return tokens, logprobs, logprobs
    scaled = logits / config.temperature
    if config.truncates:
        keep = kept_tokens(scaled, top_k=config.top_k, top_p=config.top_p, min_p=config.min_p)
        scaled = jnp.where(keep, scaled, -jnp.inf)
    tokens = inverse_cdf_sample(keys, scaled)
    plain = logprobs_from_logits(logits, tokens, config.temperature)
    if not config.truncates:
        return tokens, plain, plain
    picked = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0]
    return tokens, picked - jax.nn.logsumexp(scaled, axis=-1), plain
