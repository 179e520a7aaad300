"""The decoder's preallocated KV cache: one array per layer, or one stacked array.

A model whose blocks are stacked (``ModelConfig.scan_layers``) gets a stacked cache,
``[layers, batch, kv_heads, slots, head_dim]``, and ``Transformer.decode`` runs its
layers as one ``lax.scan`` that writes each layer's new keys and values into the stack
in place (``store``): XLA compiles one block instead of one per layer and computes the
same numbers. Per-layer models keep a list of ``[batch, kv_heads, slots, head_dim]``
arrays. ``KVCache.each_layer`` applies a function to every layer in either layout, so
the sampler's programs are written once for both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import jax
import jax.numpy as jnp

from rlaxkit.models.config import ModelConfig

# One array per layer, or the layers stacked on a leading axis.
Layers: TypeAlias = list[jax.Array] | jax.Array


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    """Preallocated keys and values of every layer.

    Attributes:
        k: one array per layer, ``[batch, kv_heads, slots, head_dim]`` (heads before
            slots: the layout attention contracts in, so a decode step reads the cache
            without transposing it); or, for a model with stacked blocks, one array
            ``[layers, batch, kv_heads, slots, head_dim]``.
        v: like ``k``.
        valid: ``[batch, slots]`` bool, the slot holds a real (non-padding) token.
        end: ``[batch]`` int32, the next slot each row writes to.
    """

    k: Layers
    v: Layers
    valid: jax.Array
    end: jax.Array

    @property
    def slots(self) -> int:
        """Capacity of the cache in tokens per row."""
        return self.valid.shape[1]

    @property
    def stacked(self) -> bool:
        """The layers' keys and values are one array each (``scan_layers`` models)."""
        return not isinstance(self.k, list)

    @classmethod
    def zeros(
        cls, config: ModelConfig, batch: int, slots: int, dtype: jnp.dtype | None = None
    ) -> KVCache:
        """An empty cache for ``batch`` rows of ``slots`` tokens each, stacked when the
        model's blocks are (``config.scan_layers``).

        >>> cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8,
        ...                   num_layers=3, num_heads=2, num_kv_heads=1)
        >>> KVCache.zeros(cfg, 2, 5).k[0].shape, KVCache.zeros(cfg, 2, 5).stacked
        ((2, 1, 5, 4), False)
        >>> KVCache.zeros(cfg.replace(scan_layers=True), 2, 5).k.shape
        (3, 2, 1, 5, 4)
        """
        dtype = dtype or jnp.dtype(config.param_dtype)
        shape = (batch, config.num_kv_heads, slots, config.head_dim)
        layers = config.num_layers
        if config.scan_layers:
            k: Layers = jnp.zeros((layers, *shape), dtype)
            v: Layers = jnp.zeros((layers, *shape), dtype)
        else:
            k = [jnp.zeros(shape, dtype) for _ in range(layers)]
            v = [jnp.zeros(shape, dtype) for _ in range(layers)]
        return cls(
            k=k, v=v, valid=jnp.zeros((batch, slots), bool), end=jnp.zeros((batch,), jnp.int32)
        )

    def each_layer(self, fn: Callable[..., jax.Array], *others: KVCache) -> tuple[Layers, Layers]:
        """``(keys, values)``: ``fn`` applied to every layer's ``[batch, kv_heads, slots,
        head_dim]`` keys, then values, with the same layer of each of ``others`` as further
        arguments. Stacked caches stay stacked (``fn`` is mapped over the layer axis, one
        program for all layers); where any is a list, the result is a list."""

        def each(name: str) -> Layers:
            arrays = [getattr(cache, name) for cache in (self, *others)]
            if any(isinstance(a, list) for a in arrays):
                return [fn(*layer) for layer in zip(*arrays, strict=True)]
            return jax.vmap(fn)(*arrays)

        return each("k"), each("v")

    def with_rows(self, part: KVCache, dest: jax.Array, source: jax.Array) -> tuple[Layers, Layers]:
        """``(keys, values)``: this cache with rows ``dest`` set to ``part``'s rows
        ``source`` over ``part``'s slots (a ``dest`` past the last row changes nothing).
        A stacked cache is written a layer at a time: mapped over the layers, the
        gathered rows of all of them were one temporary, which XLA:TPU kept whole
        (docs/running_at_scale.md)."""
        width = part.slots

        def copy(full: jax.Array, rows: jax.Array) -> jax.Array:
            return full.at[dest, :, :width].set(rows[source], mode="drop")

        if not (self.stacked and part.stacked):
            return self.each_layer(copy, part)

        def layers(full: Layers, rows: Layers) -> jax.Array:
            assert not isinstance(full, list) and not isinstance(rows, list)

            def one(i: jax.Array, full: jax.Array) -> jax.Array:
                layer = jax.lax.dynamic_index_in_dim(rows, i, keepdims=False)[source]
                return full.at[i, dest, :, :width].set(layer, mode="drop")

            return jax.lax.fori_loop(0, full.shape[0], one, full)

        return layers(self.k, part.k), layers(self.v, part.v)


def store(
    cache: jax.Array, new: jax.Array, start: jax.Array, layer: jax.Array | None = None
) -> jax.Array:
    """``cache`` with ``new [B, KV, T, D]`` written at slots ``start[b] .. start[b] + T - 1``
    of each row ``b``, a start past ``slots - T`` moved back to it, as a dynamic update
    slice moves it.

    ``cache`` is one layer's ``[B, KV, S, D]``, or with ``layer`` the stacked
    ``[L, B, KV, S, D]``, written at that layer only: in place inside the layer scan, where
    taking the layer's slice out and putting it back would copy the whole layer.
    """
    if layer is None:
        write = jax.vmap(lambda buf, x, i: jax.lax.dynamic_update_slice_in_dim(buf, x, i, 1))
        return write(cache, new.astype(cache.dtype), start)
    rows, heads, t, dim = new.shape
    first = jnp.clip(start, 0, cache.shape[-2] - t)
    # One window [T, D] per row and head at (layer, row, head, first). XLA:TPU writes such
    # windows in place in the cache's own layout; with one window [KV, T, D] per row (a
    # dynamic update slice mapped over the rows), or indexed as cache[layer, rows, :,
    # slots], it laid the whole stack out again around the decode loop wherever a chip
    # held two heads (Qwen3-8B's v5e worker: 22.24 GiB, refused).
    row, head = jnp.meshgrid(jnp.arange(rows), jnp.arange(heads), indexing="ij")
    index = jnp.stack(
        [
            jnp.broadcast_to(layer, row.shape),
            row,
            head,
            jnp.broadcast_to(first[:, None], row.shape),
        ],
        axis=-1,
    ).reshape(rows * heads, 4)
    numbers = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(1, 2),
        inserted_window_dims=(0, 1, 2),
        scatter_dims_to_operand_dims=(0, 1, 2, 3),
    )
    return jax.lax.scatter(
        cache,
        index.astype(jnp.int32),
        new.reshape(rows * heads, t, dim).astype(cache.dtype),
        numbers,
        indices_are_sorted=True,
        unique_indices=True,
        mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
    )
