"""A paged KV cache and attention over its pages.

Every layer keeps one pool of pages, ``[num_pages, page_size, 2 * kv_heads, head_dim]``,
keys and values interleaved on the head axis (key head ``j`` at ``2j``, its value at
``2j + 1``): the layout of JAX's ragged paged attention kernel
(``jax.experimental.pallas.ops.tpu.ragged_paged_attention``), so the TPU kernel reads the
pool as it is, and one page copy moves a token's keys and values together. Row ``b``'s
slot ``s`` is in page ``page_table[b, s // page_size]`` at offset ``s % page_size``; the
host decides which pages a row holds (``rlaxkit.rules.paging.PagePool``) and several rows may
hold the same page (the full pages of a shared prompt). Page 0 is the null page: writes
that must land nowhere (padding, rows that are not generating) go there.

Attention has one interface (``paged_decode``) and two implementations:

* ``"reference"`` (XLA, any backend, the CPU default): gathers each row's pages into the
  dense ``[rows, kv_heads, slots, head_dim]`` layout and runs the model's own attention,
  masked by ``valid`` exactly as the dense cache is, so its numbers are the dense
  cache's (slots a row does not hold are masked and add exact zeros).
* ``"kernel"`` (TPU): JAX's ragged paged attention Pallas kernel, which reads only the
  pages each row holds, up to its length, with no gather. It takes each row's context as
  its first ``kv_len`` slots, which our layout guarantees (a row's valid slots are always
  ``0 .. end - 1``), and the same interleaved layout, so it is used as shipped.

Only single-token decode steps take the kernel; prefills, observation appends and cache
rebuilds write their new tokens into the pages with ``scatter_rows`` after a dense pass
over the rows concerned (``rlaxkit.inference.programs``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import jax
import jax.numpy as jnp

from rlaxkit.models import KVCache, ModelConfig, Transformer
from rlaxkit.models.transformer import Block, rope_frequencies, rope_tables
from rlaxkit.rules.paging import NULL_PAGE

Attention = Literal["reference", "kernel"]
ATTENTION: tuple[str, ...] = ("reference", "kernel")


def default_attention() -> Attention:
    """The kernel on TPU, the XLA reference elsewhere."""
    return "kernel" if jax.default_backend() == "tpu" else "reference"


@jax.tree_util.register_dataclass
@dataclass
class PagedKVCache:
    """Keys and values of every layer in pages, ``R`` rows of ``slots`` slots each.

    Attributes:
        pages: one array per layer, ``[num_pages, page_size, 2 * kv_heads, head_dim]``.
        page_table: ``[R, slots // page_size]`` int32 page of each row's page-sized span.
        valid: ``[R, slots]`` bool, the slot holds a real (non-padding) token.
        end: ``[R]`` int32, the next slot each row writes to.
    """

    pages: list[jax.Array]
    page_table: jax.Array
    valid: jax.Array
    end: jax.Array
    attention: Attention = field(default="reference", metadata={"static": True})
    block_pages: int = field(default=8, metadata={"static": True})

    @property
    def slots(self) -> int:
        """Capacity of a row in tokens."""
        return self.valid.shape[1]

    @property
    def page_size(self) -> int:
        """Token slots per page."""
        return self.pages[0].shape[1]

    @classmethod
    def zeros(
        cls,
        config: ModelConfig,
        rows: int,
        slots: int,
        num_pages: int,
        page_size: int,
        dtype: jnp.dtype | None = None,
        *,
        attention: Attention = "reference",
        block_pages: int = 8,
    ) -> PagedKVCache:
        """An empty pool of ``num_pages`` pages; every row's pages are the null page.
        ``attention`` and ``block_pages`` (static: they key compiled programs) choose how
        decode steps read it (``paged_decode``)."""
        if slots % page_size:
            raise ValueError(f"slots ({slots}) must be a multiple of page_size ({page_size})")
        dtype = dtype or jnp.dtype(config.param_dtype)
        shape = (num_pages, page_size, 2 * config.num_kv_heads, config.head_dim)
        return cls(
            pages=[jnp.zeros(shape, dtype) for _ in range(config.num_layers)],
            page_table=jnp.full((rows, slots // page_size), NULL_PAGE, jnp.int32),
            valid=jnp.zeros((rows, slots), bool),
            end=jnp.zeros((rows,), jnp.int32),
            attention=attention,
            block_pages=block_pages,
        )


def interleave(k: jax.Array, v: jax.Array) -> jax.Array:
    """``[..., kv_heads, D]`` keys and values as ``[..., 2 * kv_heads, D]`` (k, v, k, ...)."""
    return jnp.stack([k, v], axis=-2).reshape(*k.shape[:-2], 2 * k.shape[-2], k.shape[-1])


def gather_dense(pages: jax.Array, page_table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys and values of rows ``page_table [A, n]`` in the dense layout
    ``[A, kv_heads, n * page_size, head_dim]``."""
    rows, count = page_table.shape
    _, page_size, heads2, dim = pages.shape
    kv = pages[page_table].reshape(rows, count * page_size, heads2, dim)
    k, v = kv[:, :, 0::2], kv[:, :, 1::2]
    return jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)


def gather_rows(cache: PagedKVCache, rows: jax.Array) -> KVCache:
    """The dense cache of ``rows`` (``[A]`` row indices in range)."""
    table = cache.page_table[rows]
    ks, vs = zip(*(gather_dense(p, table) for p in cache.pages), strict=True)
    return KVCache(k=list(ks), v=list(vs), valid=cache.valid[rows], end=cache.end[rows])


def scatter_rows(
    cache: PagedKVCache, dest: jax.Array, part: KVCache, write: jax.Array
) -> list[jax.Array]:
    """The pools with slots ``0 .. W - 1`` of dense ``part`` (``[A, kv_heads, >= W, D]``,
    ``W = write.shape[1]``) written into rows ``dest`` where ``write [A, W]`` is set.

    Rows ``dest >= R`` (padding) and slots past a row's pages write to the null page. Rows
    sharing a page write it with the same values (they hold the same prompt).
    """
    num_rows, per_row = cache.page_table.shape
    width = write.shape[1]
    slot = jnp.arange(width)
    column = slot // cache.page_size
    in_range = (dest < num_rows)[:, None] & (column < per_row)[None] & write
    table = cache.page_table[jnp.minimum(dest, num_rows - 1)][:, jnp.minimum(column, per_row - 1)]
    page = jnp.where(in_range, table, NULL_PAGE)  # [A, W]
    offset = jnp.broadcast_to(slot % cache.page_size, page.shape)
    pools = []
    for pool, k, v in zip(cache.pages, part.k, part.v, strict=True):
        kv = interleave(jnp.swapaxes(k[:, :, :width], 1, 2), jnp.swapaxes(v[:, :, :width], 1, 2))
        pools.append(pool.at[page, offset].set(kv.astype(pool.dtype)))
    return pools


def _kernel_attention(
    q: jax.Array, pages: jax.Array, page_table: jax.Array, kv_len: jax.Array, block_pages: int
) -> jax.Array:
    """JAX's ragged paged attention for one query per row: ``q [R, H, D] -> [R, H, D]``."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    rows = q.shape[0]
    return ragged_paged_attention(
        q,
        pages,
        kv_len,
        page_table,
        jnp.arange(rows + 1, dtype=jnp.int32),  # one query token per row
        jnp.array([rows], jnp.int32),
        sm_scale=q.shape[-1] ** -0.5,
        num_kv_pages_per_block=min(block_pages, page_table.shape[1]),
        num_queries_per_block=min(rows, 16),
    )


def _paged_block(
    block: Block,
    x: jax.Array,
    rope: tuple[jax.Array, jax.Array],
    mask: jax.Array,
    pool: jax.Array,
    page: jax.Array,
    offset: jax.Array,
    page_table: jax.Array,
    kv_len: jax.Array,
    attention: Attention,
    block_pages: int,
) -> tuple[jax.Array, jax.Array]:
    """``Block.__call__`` with the cache in pages: the same projections, attention and MLP
    (so the reference path computes the dense cache's numbers)."""
    b, t, h = x.shape
    x = x.reshape(b * t, h)
    q, k, v = block.self_attn.project(block.input_layernorm(x), rope)
    pool = pool.at[page, offset].set(interleave(k, v).astype(pool.dtype))
    if attention == "kernel":
        out = _kernel_attention(q[:, 0], pool, page_table, kv_len, block_pages)
        attended = block.self_attn.o_proj(out.reshape(b * t, -1))
    else:
        keys, values = gather_dense(pool, page_table)
        attended = block.self_attn.attend(q, keys, values, mask)
    x = x + attended
    x = x + block.mlp(block.post_attention_layernorm(x))
    return x.reshape(b, t, h), pool


def paged_decode(
    model: Transformer,
    tokens: jax.Array,
    positions: jax.Array,
    cache: PagedKVCache,
    token_mask: jax.Array | None = None,
) -> tuple[jax.Array, PagedKVCache]:
    """``Transformer.decode`` on a paged cache: appends ``tokens [B, T]`` at each row's
    ``end`` and returns their float32 logits ``[B, T, vocab]`` and the cache.

    Tokens that ``token_mask`` marks as padding are written to the null page and their
    slots marked invalid, as the dense cache marks them. With ``cache.attention ==
    "kernel"`` (TPU, ``T == 1``) the ragged paged attention kernel reads the pages,
    ``cache.block_pages`` pages per block; a row's context must then be its slots
    ``0 .. end``.
    """
    attention, block_pages = cache.attention, cache.block_pages
    b, t = tokens.shape
    if token_mask is None:
        token_mask = jnp.ones((b, t), bool)
    if attention == "kernel" and t != 1:
        raise ValueError(f"the paged attention kernel decodes one token per row, got {t}")
    start = cache.end
    new_slots = start[:, None] + jnp.arange(t)[None]  # [B, T]
    per_row = cache.page_table.shape[1]
    column = new_slots // cache.page_size
    in_range = token_mask & (column < per_row)
    table = jnp.take_along_axis(cache.page_table, jnp.minimum(column, per_row - 1), axis=1)
    page = jnp.where(in_range, table, NULL_PAGE)
    offset = new_slots % cache.page_size
    row_index = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    valid = cache.valid.at[row_index, new_slots].set(token_mask, mode="drop")
    slot_ids = jnp.arange(cache.slots)
    mask = valid[:, None, :] & (slot_ids[None, None, :] <= new_slots[:, :, None])
    rope = rope_tables(positions, rope_frequencies(model.config))
    kv_len = jnp.maximum(start + t, 1).astype(jnp.int32)
    x = model.embed_tokens(tokens)
    pools = []
    for layer, pool in zip(model.blocks(), cache.pages, strict=True):
        x, pool = _paged_block(
            layer, x, rope, mask, pool, page, offset, cache.page_table, kv_len, attention,
            block_pages,
        )  # fmt: skip
        pools.append(pool)
    logits = model.unembed(model.norm(x))
    return logits, dataclasses.replace(cache, pages=pools, valid=valid, end=start + t)


def check_attention(attention: str) -> None:
    """Raises ``ValueError`` naming ``attention`` unless it is one of ``ATTENTION``."""
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
