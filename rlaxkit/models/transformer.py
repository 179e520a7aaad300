"""Flax NNX decoder of the Qwen2 / Qwen3 / Llama-3 family, with a preallocated KV cache.

The computation follows the Hugging Face reference implementations of those families
(RMSNorm in float32, rotate-half RoPE, grouped-query attention, SwiGLU MLP), so logits
match ``transformers`` to float32 rounding. Weights may be float32 or bfloat16; the
attention softmax, the norms and the logits are float32 either way.

Two entry points share one block implementation:

* ``model(tokens, positions, attention_mask)`` — the training forward: causal
  attention within the sequence, keys masked by ``attention_mask`` (left or right
  padding both work because positions are passed in).
* ``model.decode(tokens, positions, cache, token_mask)`` — writes the new keys and
  values into a ``KVCache`` at each row's own write offset and attends to everything
  valid in the cache up to each query's slot. Prefill is ``decode`` with many tokens;
  one decode step is ``decode`` with one.

Depth and memory: with ``ModelConfig.scan_layers`` the blocks are stored stacked and
the training forward is one ``lax.scan`` over them (one block's program, compiled once);
``hidden_states(..., remat=...)`` recomputes each block's activations in the backward
pass instead of keeping them (``"dots"`` keeps the outputs of the weight matmuls,
``"full"`` only each block's input). Neither changes a number. ``decode`` scans the
stacked blocks too, over a stacked cache (``rlaxkit.models.kv_cache``); per-layer models
decode in a Python loop over one cache array per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeAlias, overload

import jax
import jax.numpy as jnp
from flax import nnx

from rlaxkit.models.config import ModelConfig
from rlaxkit.models.kv_cache import KVCache, store

Rope: TypeAlias = tuple[jax.Array, jax.Array]  # ``rope_tables``: (cos, sin), [B, T, 1, D]
_MASKED = -1e30  # finite, so a fully masked (padding) query row gives no NaN

RematPolicy = Literal["none", "dots", "full"]
REMAT_POLICIES: tuple[str, ...] = ("none", "dots", "full")


def check_remat(remat: str) -> None:
    """Raises ``ValueError`` naming ``remat`` unless it is one of ``REMAT_POLICIES``."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat: must be one of {REMAT_POLICIES}, got {remat!r}")


def _rematted(
    fn: Callable[..., object], remat: RematPolicy, *, in_scan: bool
) -> Callable[..., Any]:
    """``fn`` under ``jax.checkpoint`` with the policy ``remat`` names.

    ``"dots"`` saves the results of matmuls without batch dimensions, which here are the
    weight projections (activations are ``[B·T, hidden]``); the attention scores, which
    grow with the square of the length, are recomputed. ``"full"`` saves nothing but the
    block's inputs. Under ``lax.scan`` the scan itself keeps XLA from merging the
    recomputation into the forward pass, so ``prevent_cse`` is off there (JAX's advice).
    """
    if remat == "none":
        return fn
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable if remat == "dots" else None
    return jax.checkpoint(fn, policy=policy, prevent_cse=not in_scan)


def rope_frequencies(config: ModelConfig) -> jax.Array:
    """Inverse frequencies ``theta^(-2i/d)`` for ``i < d/2``, with Llama-3 scaling if set."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * jnp.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> Rope:
    """``(cos, sin)`` of the rotate-half angles at ``positions``, each ``[B, T, 1, D]``.

    Computed once per forward, on the half angles, and shared by every layer's queries
    and keys: where each layer computes its own, XLA fuses the sines and cosines into
    their consumers and, in the backward, evaluates them once per head (about a tenth of
    the small GRPO step on CPU).

    Args:
        positions: ``[batch, seq]`` integer positions.
        inv_freq: ``[head_dim / 2]`` (``rope_frequencies``).
    """
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    widen = lambda table: jnp.concatenate([table, table], axis=-1)[:, :, None, :]
    return widen(cos), widen(sin)


def apply_rope(x: jax.Array, rope: Rope) -> jax.Array:
    """Rotate-half RoPE: ``x * cos + rotate_half(x) * sin``.

    Args:
        x: ``[batch, seq, heads, head_dim]``.
        rope: ``rope_tables`` at the tokens' positions.
    """
    cos, sin = rope
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
    return out.astype(x.dtype)


class RMSNorm(nnx.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, normalised in float32."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


def _linear(din: int, dout: int, bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        din,
        dout,
        use_bias=bias,
        dtype=dtype,
        param_dtype=dtype,
        kernel_init=nnx.initializers.normal(0.02),
        rngs=rngs,
    )


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE and optional per-head q/k RMSNorm."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.param_dtype)
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            d,
        )
        self.q_proj = _linear(h, config.num_heads * d, config.qkv_bias, dtype, rngs)
        self.k_proj = _linear(h, config.num_kv_heads * d, config.qkv_bias, dtype, rngs)
        self.v_proj = _linear(h, config.num_kv_heads * d, config.qkv_bias, dtype, rngs)
        self.o_proj = _linear(config.num_heads * d, h, config.o_bias, dtype, rngs)
        qk_norm = config.qk_norm
        self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype) if qk_norm else None

    def project(self, x: jax.Array, rope: Rope) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries ``[B,T,H,D]``, keys and values ``[B,T,KV,D]``, RoPE applied.

        ``x`` is ``[B·T, hidden]``: the projections are plain 2-D matmuls, whose weight
        gradients XLA's CPU backend computes without transposing a 3-D activation.
        """
        b, t = rope[0].shape[:2]
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, rope), apply_rope(k, rope), v

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
        """Softmax attention of ``q [B,T,H,D]`` over ``k, v [B,KV,S,D]``; ``mask [B,T,S]``."""
        b, t, _, d = q.shape
        groups = self.num_heads // self.num_kv_heads
        q = q.reshape(b, t, self.num_kv_heads, groups, d)
        scores = jnp.einsum("btkgd,bksd->bkgts", q, k, preferred_element_type=jnp.float32)
        scores = scores * (d**-0.5)
        scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        # Batch dims leading in the output too: the dot writes a contiguous result.
        out = jnp.einsum("bkgts,bksd->bkgtd", probs, v).transpose(0, 3, 1, 2, 4)
        return self.o_proj(out.reshape(b * t, self.num_heads * d))  # [B·T, hidden]


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.param_dtype)
        h, m = config.hidden_size, config.intermediate_size
        self.gate_proj = _linear(h, m, False, dtype, rngs)
        self.up_proj = _linear(h, m, False, dtype, rngs)
        self.down_proj = _linear(m, h, False, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """Pre-norm decoder block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.param_dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, rngs)

    @overload
    def __call__(
        self,
        x: jax.Array,
        rope: Rope,
        mask: jax.Array,
        cache_kv: None = None,
    ) -> tuple[jax.Array, None]: ...

    @overload
    def __call__(
        self,
        x: jax.Array,
        rope: Rope,
        mask: jax.Array,
        cache_kv: tuple[jax.Array, jax.Array, jax.Array],
        layer: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]: ...

    def __call__(
        self,
        x: jax.Array,
        rope: Rope,
        mask: jax.Array,
        cache_kv: tuple[jax.Array, jax.Array, jax.Array] | None = None,
        layer: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """``cache_kv`` is ``(keys, values, start)``: this layer's ``[B, KV, S, D]``, or
        with ``layer`` every layer's stacked ``[L, B, KV, S, D]`` (``KVCache.stacked``)."""
        b, t, h = x.shape
        x = x.reshape(b * t, h)  # dense layers see 2-D activations (see ``project``)
        q, k, v = self.self_attn.project(self.input_layernorm(x), rope)
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, KV, T, D]
        new_kv = None
        if cache_kv is not None:
            cache_k, cache_v, start = cache_kv
            cache_k, cache_v = store(cache_k, k, start, layer), store(cache_v, v, start, layer)
            new_kv = (cache_k, cache_v)
            k, v = (cache_k, cache_v) if layer is None else (cache_k[layer], cache_v[layer])
        x = x + self.self_attn.attend(q, k, v, mask)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x.reshape(b, t, h), new_kv


def _run_block(graphdef: nnx.GraphDef, state: object, *args: object) -> Any:
    return nnx.merge(graphdef, state)(*args)


_block_program = jax.jit(_run_block, static_argnums=0)


def call_block(block: Block, *args: Any) -> Any:
    """``block(*args)`` as a nested ``jax.jit`` call keyed by the block's graph.

    The layers of a model share one graph and one set of shapes, so tracing the first
    layer serves the others: JAX reuses its jaxpr, its linearisation and its lowering
    (one function that the program calls once per layer, which XLA inlines before it
    optimises). A train step traces and lowers about a quarter of a second sooner on
    a 4-layer model; the compiled program, and every number it computes, are those of
    calling the blocks directly. Called eagerly (no trace), it calls the block
    directly: a jitted block would compile once for every new shape.
    """
    if not isinstance(args[0], jax.core.Tracer):
        return block(*args)
    graphdef, state = nnx.split(block)
    return _block_program(graphdef, state, *args)


class Transformer(nnx.Module):
    """Decoder-only language model of the Qwen2 / Qwen3 / Llama-3 family.

    ``Transformer(cfg, rngs=nnx.Rngs(0))`` builds one and ``model(tokens, positions)``
    gives the logits. The example traces both with ``eval_shape`` (shapes only, nothing
    initialised, compiled or computed) to show the logits' shape, ``[batch, length,
    vocab]``:

    >>> from flax import nnx
    >>> cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1)
    >>> model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    >>> tokens, positions = jnp.array([[1, 2, 3]]), jnp.arange(3)[None]
    >>> jax.eval_shape(lambda m: m(tokens, positions), model).shape
    (1, 3, 32)
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtype = jnp.dtype(config.param_dtype)
        self.embed_tokens = nnx.Embed(
            config.vocab_size,
            config.hidden_size,
            dtype=dtype,
            param_dtype=dtype,
            embedding_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )
        blocks = [Block(config, rngs) for _ in range(config.num_layers)]
        if config.scan_layers:
            # Built one by one and stacked, so both layouts start from the same numbers.
            states = [nnx.state(block) for block in blocks]
            stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
            self.layers: Block | nnx.List[Block] = nnx.merge(nnx.graphdef(blocks[0]), stacked)
        else:
            self.layers = nnx.List(blocks)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = _linear(config.hidden_size, config.vocab_size, False, dtype, rngs)

    def unembed(self, hidden: jax.Array) -> jax.Array:
        """float32 logits ``[..., vocab]`` from final hidden states."""
        if self.lm_head is None:
            table = self.embed_tokens.embedding[...]
            return jnp.einsum("...h,vh->...v", hidden, table, preferred_element_type=jnp.float32)
        kernel = self.lm_head.kernel[...]
        return jnp.einsum("...h,hv->...v", hidden, kernel, preferred_element_type=jnp.float32)

    def hidden_states(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        remat: RematPolicy = "none",
        stream: Callable[[jax.Array], jax.Array] = lambda x: x,
    ) -> jax.Array:
        """Final-norm hidden states ``[B, T, hidden]`` of the training forward.

        ``remat`` chooses what the backward pass recomputes (see the module docstring);
        it changes memory and time, never the result. ``stream`` is applied to the
        residual stream before and after each block (the trainer places it on its mesh:
        ``rlaxkit.trainer.sharding.constrain_stream``); it must not change a value.
        """
        check_remat(remat)
        if attention_mask is None:
            attention_mask = jnp.ones(tokens.shape, bool)
        t = tokens.shape[1]
        causal = jnp.tril(jnp.ones((t, t), bool))
        mask = causal[None] & attention_mask.astype(bool)[:, None, :]
        rope = rope_tables(positions, rope_frequencies(self.config))
        x = stream(self.embed_tokens(tokens))
        if isinstance(self.layers, Block):  # stacked: one scan step per layer
            graphdef, stacked = nnx.split(self.layers)

            def scan_step(x: jax.Array, layer_state: object) -> tuple[jax.Array, None]:
                block = nnx.merge(graphdef, layer_state)
                return stream(block(x, rope, mask)[0]), None

            x, _ = jax.lax.scan(_rematted(scan_step, remat, in_scan=True), x, stacked)
        elif remat == "none":
            for layer in self.layers:
                x = stream(call_block(layer, x, rope, mask)[0])
        else:
            for layer in self.layers:
                graphdef, layer_state = nnx.split(layer)

                def step(layer_state: Any, x: jax.Array, graphdef: Any = graphdef) -> jax.Array:
                    return stream(nnx.merge(graphdef, layer_state)(x, rope, mask)[0])

                x = _rematted(step, remat, in_scan=False)(layer_state, x)
        return self.norm(x)

    def blocks(self) -> list[Block]:
        """One ``Block`` per layer; with stacked layers, views of each layer's slice."""
        if isinstance(self.layers, Block):
            graphdef, stacked = nnx.split(self.layers)
            return [
                nnx.merge(graphdef, jax.tree.map(lambda w, i=i: w[i], stacked))
                for i in range(self.config.num_layers)
            ]
        return list(self.layers)

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array | None = None
    ) -> jax.Array:
        """float32 logits ``[B, T, vocab]``; ``attention_mask`` is 1 for real tokens."""
        return self.unembed(self.hidden_states(tokens, positions, attention_mask))

    def decode(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        token_mask: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Appends ``tokens [B, T]`` to the cache and returns their logits.

        Row ``b`` writes its ``T`` tokens to slots ``cache.end[b] .. cache.end[b]+T-1``
        (the caller keeps ``end + T <= cache.slots``); a query in slot ``s`` attends to
        every valid slot ``<= s``. ``token_mask`` marks padding among the new tokens,
        which is stored but never attended to.

        Returns:
            float32 logits ``[B, T, vocab]`` and the updated cache.
        """
        b, t = tokens.shape
        if token_mask is None:
            token_mask = jnp.ones((b, t), bool)
        start = cache.end
        slot_ids = jnp.arange(cache.slots)
        new_slots = start[:, None] + jnp.arange(t)[None]  # [B, T]
        write = jax.vmap(lambda buf, new, i: jax.lax.dynamic_update_slice_in_dim(buf, new, i, 0))
        valid = write(cache.valid, token_mask.astype(bool), start)
        mask = valid[:, None, :] & (slot_ids[None, None, :] <= new_slots[:, :, None])
        rope = rope_tables(positions, rope_frequencies(self.config))
        x = self.embed_tokens(tokens)
        if isinstance(self.layers, Block) and cache.stacked:  # one scan step per layer
            graphdef, stacked = nnx.split(self.layers)

            Carry = tuple[jax.Array, jax.Array, jax.Array]

            def scan_step(carry: Carry, layer: tuple[object, jax.Array]) -> tuple[Carry, None]:
                x, k, v = carry
                block = nnx.merge(graphdef, layer[0])
                x, (k, v) = block(x, rope, mask, (k, v, start), layer=layer[1])
                return (x, k, v), None

            assert isinstance(cache.k, jax.Array) and isinstance(cache.v, jax.Array)
            layers = (stacked, jnp.arange(self.config.num_layers))
            (x, k_all, v_all), _ = jax.lax.scan(scan_step, (x, cache.k, cache.v), layers)
            new_cache = KVCache(k=k_all, v=v_all, valid=valid, end=start + t)
        else:
            ks, vs = [], []
            for block, k, v in zip(self.blocks(), cache.k, cache.v, strict=True):
                x, (k, v) = call_block(block, x, rope, mask, (k, v, start))
                ks.append(k)
                vs.append(v)
            new_cache = KVCache(k=ks, v=vs, valid=valid, end=start + t)
            if cache.stacked:  # a stacked cache given to per-layer blocks stays stacked
                new_cache.k, new_cache.v = jnp.stack(ks), jnp.stack(vs)
        return self.unembed(self.norm(x)), new_cache


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """Positions ``0, 1, ...`` counted over real tokens only (padding gets 0).

    For a left-padded row ``[0, 0, 1, 1, 1]`` this gives ``[0, 0, 0, 1, 2]``, so a padded
    prompt sees exactly the positions it would see alone.
    """
    mask = attention_mask.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0) * mask
