"""A critic for PPO: the decoder's hidden states followed by a scalar head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rlaxkit.models import ModelConfig, Transformer


class ValueModel(nnx.Module):
    """``V(tokens[:t])`` for every position, aligned like ``token_logprobs``.

    Entry ``[b, t]`` is the value of the state *before* ``tokens[b, t]`` is taken (read
    from the hidden state at ``t - 1``); entry ``[b, 0]`` is 0. This is the alignment GAE
    needs: the action at ``t`` is scored against ``V(s_t)``.

    One value per token (traced with ``eval_shape``: shapes only, nothing initialised or
    computed):

    >>> cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1)
    >>> critic = nnx.eval_shape(lambda: ValueModel(cfg, rngs=nnx.Rngs(0)))
    >>> tokens, positions = jnp.array([[1, 2, 3]]), jnp.arange(3)[None]
    >>> jax.eval_shape(lambda c: c(tokens, positions), critic).shape
    (1, 3)
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.backbone = Transformer(config, rngs=rngs)
        # The critic never unembeds: drop the LM head so it has no dead parameters
        # (and no optimizer state for them).
        self.backbone.lm_head = None
        dtype = jnp.dtype(config.param_dtype)
        self.head = nnx.Linear(
            config.hidden_size,
            1,
            dtype=dtype,
            param_dtype=dtype,
            kernel_init=nnx.initializers.zeros_init(),
            rngs=rngs,
        )

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array | None = None
    ) -> jax.Array:
        hidden = self.backbone.hidden_states(tokens, positions, attention_mask)
        values = self.head(hidden)[..., 0].astype(jnp.float32)
        return jnp.pad(values[:, :-1], ((0, 0), (1, 0)))
