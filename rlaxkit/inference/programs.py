"""The compiled KV-cache programs: start rows from prompts (prefill), run decode steps,
rebuild the cache under new weights. Every program is jitted with the model's graph
definition and the sampling config static and the decode state donated, so a run
compiles one program per shape bucket and updates the cache in place.

Layout: row ``b`` holds its prompt in cache slots ``0 .. len_b - 2`` (the position of a
token equals its slot) and keeps the last prompt token, later the last sampled token, as
``pending``: the token the next decode step feeds. A decode step therefore always
produces the logits of the next token, and the first completion token is drawn by the
first decode step, exactly like all later ones.

Multi-turn rows keep this layout: a row that stopped (its last sampled token pending)
is extended by an observation as if its prompt had been ``prompt + completion +
observation`` all along (``extend_rows``), so the next turn's decode steps, and a cache
rebuilt under new weights, treat it like any other row.

``begin_rows`` (``init_state`` and ``start_rows`` in one program, ``generate``'s) and
``decode_steps`` also come in two tiers (``tiered=True``,
``rlaxkit.util.jaxutil.TieredJit``): a shape's first call runs a quickly compiled program
while the optimised one compiles in the background, for a loop's first step.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from rlaxkit.inference.config import SamplingConfig
from rlaxkit.inference.paged import (
    Attention,
    PagedKVCache,
    gather_rows,
    paged_decode,
    scatter_rows,
)
from rlaxkit.inference.results import StaticGraph
from rlaxkit.inference.rows import Rows, sample_and_record
from rlaxkit.models import KVCache, ModelConfig, Transformer
from rlaxkit.util.jaxutil import Packed, TieredJit


@jax.tree_util.register_dataclass
@dataclass
class DecodeState:
    """Everything the decode loop carries, ``R`` rows.

    Attributes:
        cache: the KV cache, ``slots`` per row (``prompt_width + max_new_tokens`` unless
            set): dense, or in pages (``rlaxkit.inference.paged``; the engine's
            ``kv_cache="paged"``).
        prompt: ``[R, P]`` int32 prompt tokens, right-padded with 0 (``P`` is the
            prompt width, or ``slots`` where prompts grow by turns).
        prompt_len: ``[R]`` int32.
        pending: ``[R]`` int32, the token the next decode step feeds (its position is
            ``cache.end``).
        rows: the completions so far.
    """

    cache: KVCache | PagedKVCache
    prompt: jax.Array
    prompt_len: jax.Array
    pending: jax.Array
    rows: Rows


@functools.partial(
    jax.jit, static_argnames=("model_config", "config", "rows", "prompt_width", "slots")
)
def init_state(
    model_config: ModelConfig,
    config: SamplingConfig,
    rows: int,
    prompt_width: int,
    slots: int | None = None,
) -> DecodeState:
    """An empty decode state: ``rows`` inactive rows, prompts up to ``prompt_width``.

    ``slots`` (default ``prompt_width + config.max_new_tokens``) sets the cache length
    per row; when it is given the prompt buffers are ``slots`` wide too, so a row's
    prompt can grow by whole turns (``extend_rows``).
    """
    width = prompt_width if slots is None else slots
    if slots is None:
        slots = prompt_width + config.max_new_tokens
    return DecodeState(
        cache=KVCache.zeros(model_config, rows, slots),
        prompt=jnp.zeros((rows, width), jnp.int32),
        prompt_len=jnp.ones((rows,), jnp.int32),
        pending=jnp.zeros((rows,), jnp.int32),
        rows=Rows.empty(rows, config),
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "model_config",
        "config",
        "rows",
        "slots",
        "num_pages",
        "page_size",
        "attention",
        "block_pages",
    ),
)
def init_paged_state(
    model_config: ModelConfig,
    config: SamplingConfig,
    rows: int,
    slots: int,
    num_pages: int,
    page_size: int,
    attention: Attention = "reference",
    block_pages: int = 8,
) -> DecodeState:
    """``init_state(model_config, config, rows, slots, slots)`` with the cache in a pool
    of ``num_pages`` pages of ``page_size`` slots (every row's pages the null page)."""
    return DecodeState(
        cache=PagedKVCache.zeros(
            model_config,
            rows,
            slots,
            num_pages,
            page_size,
            attention=attention,
            block_pages=block_pages,
        ),
        prompt=jnp.zeros((rows, slots), jnp.int32),
        prompt_len=jnp.ones((rows,), jnp.int32),
        pending=jnp.zeros((rows,), jnp.int32),
        rows=Rows.empty(rows, config),
    )


def _decode(
    model: Transformer,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache | PagedKVCache,
    token_mask: jax.Array,
) -> tuple[jax.Array, Any]:
    """``model.decode`` on a dense cache, ``paged_decode`` on pages."""
    if isinstance(cache, PagedKVCache):
        return paged_decode(model, tokens, positions, cache, token_mask)
    return model.decode(tokens, positions, cache, token_mask)


def _cache_dtype(cache: KVCache | PagedKVCache) -> jnp.dtype:
    return cache.pages[0].dtype if isinstance(cache, PagedKVCache) else cache.k[0].dtype


def _start_rows(
    graphdef: StaticGraph,
    params: nnx.State | Packed,
    state: DecodeState,
    prompts: jax.Array,
    prompt_len: jax.Array,
    dest: jax.Array,
    source: jax.Array,
    request_key_data: jax.Array,
    sample_index: jax.Array,
    budget: jax.Array,
    offset: jax.Array | None = None,
    recent: jax.Array | None = None,
) -> DecodeState:
    """Prefills ``U`` prompts once and starts ``A`` rows from them.

    Row ``dest[a]`` becomes sample ``sample_index[a]`` of prompt ``source[a]``: the
    prompt's cache rows are copied, so ``n`` samples of a prompt share one prefill.
    ``dest`` entries ``>= R`` are padding and change nothing.

    Args:
        prompts: ``[U, W]`` int32, right-padded, ``W <= prompt_width``.
        prompt_len: ``[U]`` int32, each ``>= 1``.
        dest, source, sample_index, budget: ``[A]`` int32.
        request_key_data: ``[A, ...]`` uint32 key data (``jax.random.key_data``) of the
            requests' PRNG keys.
        offset, recent: ``Rows.start``'s, for rows that go on from preempted ones (their
            prompts end with the tokens they had).
    """
    model = graphdef.merge(params)
    num_prompts, width = prompts.shape
    slots = state.cache.slots
    # Every prompt token but the last goes into the cache; the last is the pending token.
    context_mask = jnp.arange(width)[None] < (prompt_len - 1)[:, None]
    positions = jnp.broadcast_to(jnp.arange(width), prompts.shape)
    prefill = KVCache.zeros(model.config, num_prompts, width, _cache_dtype(state.cache))
    _, prefill = model.decode(prompts, positions, prefill, context_mask)

    valid = jnp.pad(prefill.valid[source], ((0, 0), (0, slots - width)))
    valid = state.cache.valid.at[dest].set(valid, mode="drop")
    end = state.cache.end.at[dest].set(prompt_len[source] - 1, mode="drop")
    cache: KVCache | PagedKVCache
    if isinstance(state.cache, PagedKVCache):
        # Samples of one prompt write its shared full pages with the same values.
        rows_part = KVCache(
            k=[p[source] for p in prefill.k],
            v=[p[source] for p in prefill.v],
            valid=prefill.valid[source],
            end=prefill.end[source],
        )
        write = jnp.ones((len(dest), width), bool)
        pages = scatter_rows(state.cache, dest, rows_part, write)
        cache = dataclasses.replace(state.cache, pages=pages, valid=valid, end=end)
    else:
        k, v = state.cache.with_rows(prefill, dest, source)
        cache = KVCache(k=k, v=v, valid=valid, end=end)
    stored = jnp.pad(prompts, ((0, 0), (0, state.prompt.shape[1] - width)))
    last = jnp.take_along_axis(prompts, (prompt_len - 1)[:, None], axis=1)[:, 0]
    request_keys = jax.random.wrap_key_data(request_key_data)
    return DecodeState(
        cache=cache,
        prompt=state.prompt.at[dest].set(stored[source], mode="drop"),
        prompt_len=state.prompt_len.at[dest].set(prompt_len[source], mode="drop"),
        pending=state.pending.at[dest].set(last[source], mode="drop"),
        rows=state.rows.start(dest, request_keys, sample_index, budget, offset, recent),
    )


_START_ROWS_JIT: dict[str, Any] = {"static_argnames": ("graphdef",), "donate_argnames": ("state",)}
start_rows = jax.jit(_start_rows, **_START_ROWS_JIT)


def _begin_rows(
    graphdef: StaticGraph,
    params: nnx.State | Packed,
    *inputs: jax.Array,
    model_config: ModelConfig,
    config: SamplingConfig,
    rows: int,
) -> DecodeState:
    """``start_rows(graphdef, params, state, *inputs)`` on a fresh ``state =
    init_state(model_config, config, rows, W)`` (``W``: the prompts' width), in one
    program: ``generate``'s first call, one dispatch and one compile fewer than the two.
    ``inputs`` are ``start_rows``'s from ``prompts`` on."""
    state = init_state(model_config, config, rows, inputs[0].shape[1])
    return _start_rows(graphdef, params, state, *inputs)


_BEGIN_ROWS_JIT: dict[str, Any] = {
    "static_argnames": ("graphdef", "model_config", "config", "rows")
}
begin_rows = jax.jit(_begin_rows, **_BEGIN_ROWS_JIT)
tiered_begin_rows = TieredJit(_begin_rows, **_BEGIN_ROWS_JIT)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("state",))
def extend_rows(
    graphdef: StaticGraph,
    params: nnx.State | Packed,
    state: DecodeState,
    observations: jax.Array,
    observation_len: jax.Array,
    dest: jax.Array,
    request_key_data: jax.Array,
    sample_index: jax.Array,
    budget: jax.Array,
) -> DecodeState:
    """Appends an observation to each of ``A`` stopped rows and starts their next
    completions, prefilling only the new tokens at the rows' offsets.

    Row ``dest[a]`` (prompt ``p``, completion ``c`` of ``C`` tokens, ``c[-1]``
    pending) gets the prompt ``p + c + o`` with ``o = observations[a, :L]``: the cache
    receives ``c[-1], o[0], ..., o[L-2]`` at slots ``end .. end + L - 1`` and ``o[-1]``
    becomes pending, exactly the cache ``start_rows`` would build from ``p + c + o``.
    The row's completion buffers restart as in ``start_rows``. The caller keeps
    ``end + L + budget - 1 <= slots``; ``dest`` entries ``>= R`` are padding.

    Args:
        observations: ``[A, W]`` int32, right-padded.
        observation_len: ``[A]`` int32, each ``>= 1``.
        dest, sample_index, budget: ``[A]`` int32.
        request_key_data: ``[A, ...]`` uint32 key data of the next turns' PRNG keys.
    """
    model = graphdef.merge(params)
    num_rows, slots = state.cache.valid.shape
    width = observations.shape[1]
    row = jnp.minimum(dest, num_rows - 1)  # padding reads a real row; its writes drop
    feed = jnp.concatenate([state.pending[row][:, None], observations[:, :-1]], axis=1)
    feed_mask = jnp.arange(width)[None] < observation_len[:, None]
    start = state.cache.end[row]
    positions = start[:, None] + jnp.arange(width)[None]

    # ``decode`` writes ``width`` slots from each row's end and a dynamic update slice
    # clamps its start to stay in bounds, which would shift the write back; ``width``
    # spare slots keep every write where it belongs (real tokens fit by the caller).
    def pad(full):  # [rows, kv_heads, slots, head_dim]
        return jnp.pad(full, ((0, 0), (0, 0), (0, width), (0, 0)))

    if isinstance(state.cache, PagedKVCache):
        rows_cache = gather_rows(state.cache, row)
    else:
        k, v = state.cache.each_layer(lambda x: x[row])
        rows_cache = KVCache(k=k, v=v, valid=state.cache.valid[row], end=start)
    k, v = rows_cache.each_layer(pad)
    part = KVCache(k=k, v=v, valid=jnp.pad(state.cache.valid[row], ((0, 0), (0, width))), end=start)
    _, part = model.decode(feed, positions, part, feed_mask)

    def put(full, new):
        return full.at[dest].set(new[:, :, :slots], mode="drop")

    valid = state.cache.valid.at[dest].set(part.valid[:, :slots], mode="drop")
    end = state.cache.end.at[dest].set(start + observation_len, mode="drop")
    cache: KVCache | PagedKVCache
    if isinstance(state.cache, PagedKVCache):
        slot = jnp.arange(slots)[None]
        new = (slot >= start[:, None]) & (slot < (start + width)[:, None])  # the row's own
        pages = scatter_rows(state.cache, dest, part, new)
        cache = dataclasses.replace(state.cache, pages=pages, valid=valid, end=end)
    else:
        k, v = state.cache.each_layer(put, part)
        cache = KVCache(k=k, v=v, valid=valid, end=end)
    prompt_len, generated = state.prompt_len[row][:, None], state.rows.num_generated[row][:, None]
    index = jnp.arange(state.prompt.shape[1])[None]
    max_new = state.rows.tokens.shape[1]
    from_completion = jnp.take_along_axis(
        state.rows.tokens[row], jnp.clip(index - prompt_len, 0, max_new - 1), axis=1
    )
    observed_at = jnp.clip(index - prompt_len - generated, 0, width - 1)
    from_observation = jnp.take_along_axis(observations, observed_at, axis=1)
    new_len = prompt_len + generated + observation_len[:, None]
    prompt = jnp.where(
        index < prompt_len,
        state.prompt[row],
        jnp.where(
            index < prompt_len + generated,
            from_completion,
            jnp.where(index < new_len, from_observation, 0),
        ),
    )
    last = jnp.take_along_axis(observations, (observation_len - 1)[:, None], axis=1)[:, 0]
    request_keys = jax.random.wrap_key_data(request_key_data)
    return DecodeState(
        cache=cache,
        prompt=state.prompt.at[dest].set(prompt, mode="drop"),
        prompt_len=state.prompt_len.at[dest].set(new_len[:, 0], mode="drop"),
        pending=state.pending.at[dest].set(last, mode="drop"),
        rows=state.rows.start(dest, request_keys, sample_index, budget),
    )


def decode_step(
    model: Transformer, state: DecodeState, version: jax.Array, config: SamplingConfig
) -> DecodeState:
    """One token for every active row: feed ``pending``, sample, record."""
    active = state.rows.active
    positions = state.cache.end[:, None]
    logits, cache = _decode(model, state.pending[:, None], positions, state.cache, active[:, None])
    # Rows that are not generating keep their write offset, so they never run off the end.
    cache = dataclasses.replace(cache, end=jnp.where(active, cache.end, state.cache.end))
    rows, tokens = sample_and_record(state.rows, logits[:, 0], version, config)
    pending = jnp.where(active, tokens, state.pending)
    return dataclasses.replace(state, cache=cache, pending=pending, rows=rows)


def decode_steps(
    graphdef: StaticGraph,
    params: nnx.State | Packed,
    state: DecodeState,
    version: ArrayLike,
    max_steps: ArrayLike,
    min_finished: ArrayLike,
    *,
    config: SamplingConfig,
    view: int | None = None,
    tiered: bool = False,
) -> tuple[DecodeState, jax.Array]:
    """Runs decode steps in a ``lax.while_loop`` until every row has stopped, ``max_steps``
    steps have run, or ``min_finished`` rows have finished in this call.

    ``max_steps`` and ``min_finished`` are traced: changing them compiles nothing. Nor do
    ``config.n`` and ``config.max_new_tokens``, which the loop reads from the shapes.

    ``view`` (static, one program per value) runs the steps on the cache's first ``view``
    slots only, so attention reads ``view`` slots instead of all of them; the loop also
    stops before any generating row would write at or past slot ``view``. Slots past the
    view hold nothing a generating row attends to, so the steps give the tokens of the
    whole cache and its log-probs to a few float32 ulps (the softmax sums the same terms,
    less the masked slots' exact zeros, in an order XLA may choose differently). Rows
    that are not generating keep their cache. ``None`` or ``view >= slots`` is the whole
    cache.

    ``tiered`` runs the two-tier program (``TieredJit``): quickly compiled on a shape's
    first call.

    Returns:
        The state and the number of steps run.
    """
    program = _tiered_decode_steps if tiered else _decode_steps
    return program(
        graphdef,
        params,
        state,
        version,
        max_steps,
        min_finished,
        config=step_config(config),
        view=_static_view(view, state.cache.slots),
    )


def compile_decode_steps(
    graphdef: StaticGraph,
    params: nnx.State | Packed,
    state: DecodeState,
    config: SamplingConfig,
    view: int | None = None,
    tiered: bool = False,
) -> None:
    """Compiles ``decode_steps`` (with ``view``; ``tiered``: its first call's quick
    program) for abstract (or concrete) ``params`` and ``state``."""
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    program = _tiered_decode_steps if tiered else _decode_steps
    view = _static_view(view, state.cache.slots)
    program.lower(
        graphdef, params, state, scalar, scalar, scalar, config=step_config(config), view=view
    ).compile()


def _static_view(view: int | None, slots: int) -> int | None:
    """``view`` as ``_decode_steps`` keys it: ``None`` for the whole cache."""
    if view is not None and view < 1:
        raise ValueError(f"view must be a positive number of cache slots, got {view}")
    return None if view is None or view >= slots else view


@functools.cache
def step_config(config: SamplingConfig) -> SamplingConfig:
    """``config`` without the fields a decode step reads from shapes (``n``,
    ``max_new_tokens``), so they do not key compiled programs."""
    return dataclasses.replace(config, n=1, max_new_tokens=1)


def _decode_steps_fn(
    graphdef: StaticGraph,
    params: nnx.State | Packed,
    state: DecodeState,
    version: jax.Array,
    max_steps: jax.Array,
    min_finished: jax.Array,
    *,
    config: SamplingConfig,
    view: int | None = None,
) -> tuple[DecodeState, jax.Array]:
    model = graphdef.merge(params)
    was_active = state.rows.active
    full = state.cache
    if view is not None:
        state = dataclasses.replace(state, cache=_prefix(full, view))

    def keep_going(carry):
        state, step = carry
        active = state.rows.active
        finished = jnp.sum(was_active & ~active)
        go = jnp.any(active) & (step < max_steps) & (finished < min_finished)
        if view is not None:  # a step writes slot ``end`` of every generating row
            go &= ~jnp.any(active & (state.cache.end >= view))
        return go

    def body(carry):
        state, step = carry
        return decode_step(model, state, version, config), step + 1

    state, steps = jax.lax.while_loop(keep_going, body, (state, jnp.zeros((), jnp.int32)))
    if view is not None:
        state = dataclasses.replace(state, cache=_write_prefix(full, state.cache, view))
    return state, steps


_DECODE_STEPS_JIT: dict[str, Any] = {
    "static_argnames": ("graphdef", "config", "view"),
    "donate_argnames": ("state",),
}
_decode_steps = jax.jit(_decode_steps_fn, **_DECODE_STEPS_JIT)
_tiered_decode_steps = TieredJit(_decode_steps_fn, **_DECODE_STEPS_JIT)


def _prefix(cache: KVCache | PagedKVCache, view: int) -> KVCache | PagedKVCache:
    """The first ``view`` slots of every row (on pages: a multiple of the page size)."""
    if isinstance(cache, PagedKVCache):
        return dataclasses.replace(
            cache,
            page_table=cache.page_table[:, : view // cache.page_size],
            valid=cache.valid[:, :view],
        )
    k, v = cache.each_layer(lambda x: x[:, :, :view])
    return KVCache(k=k, v=v, valid=cache.valid[:, :view], end=cache.end)


def _write_prefix(
    full: KVCache | PagedKVCache, part: KVCache | PagedKVCache, view: int
) -> KVCache | PagedKVCache:
    """``full`` with its first ``view`` slots from ``part`` (``_prefix`` after steps).

    A row that is not generating still writes (nothing valid) at its ``end``, which the
    prefix clamps to slot ``view - 1`` when ``end >= view``; such rows keep that slot of
    ``full``, so the prefix changes nothing the whole cache would have kept. (On pages
    such writes go to the null page and past-the-view validity is dropped: the pool and
    the page table are the whole cache's already.)
    """
    if isinstance(full, PagedKVCache):
        assert isinstance(part, PagedKVCache)
        valid = jax.lax.dynamic_update_slice_in_dim(full.valid, part.valid, 0, axis=1)
        return dataclasses.replace(full, pages=part.pages, valid=valid, end=part.end)
    assert isinstance(part, KVCache)
    outside = (full.end >= view)[:, None, None]  # [rows, 1, 1]: broadcast over heads, dim

    def put(whole: jax.Array, new: jax.Array) -> jax.Array:
        last = jnp.where(outside, whole[:, :, view - 1], new[:, :, view - 1])
        return jax.lax.dynamic_update_slice_in_dim(
            whole, new.at[:, :, view - 1].set(last), 0, axis=2
        )

    last_valid = jnp.where(full.end >= view, full.valid[:, view - 1], part.valid[:, view - 1])
    valid = part.valid.at[:, view - 1].set(last_valid)
    k, v = full.each_layer(put, part)
    valid = jax.lax.dynamic_update_slice_in_dim(full.valid, valid, 0, axis=1)
    return KVCache(k=k, v=v, valid=valid, end=part.end)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("state",))
def recompute_cache(
    graphdef: StaticGraph,
    params: nnx.State | Packed,
    state: DecodeState,
    keep: jax.Array | None = None,
) -> DecodeState:
    """Rebuilds the cache of every active row, and of the rows ``keep`` marks, from its
    prompt and completion so far under ``params``.

    The context of row ``b`` is ``prompt + completion[:-1]`` (the last token stays
    pending), prefilled in one pass of width ``slots``; the completion buffers are kept.
    This is AReaL's interruptible generation: after a weight update the remaining tokens
    are produced by the new weights on a cache computed by them too. ``keep`` (``[R]``
    bool) adds rows that are stopped but will go on (waiting for an observation); a
    row left out loses its cache.
    """
    model = graphdef.merge(params)
    rows, slots = state.cache.valid.shape
    index = jnp.arange(slots)[None]
    prompt_len = state.prompt_len[:, None]
    from_prompt = jnp.take_along_axis(
        state.prompt, jnp.minimum(index, state.prompt.shape[1] - 1), axis=1
    )
    max_new = state.rows.tokens.shape[1]
    generated_at = jnp.clip(index - prompt_len, 0, max_new - 1)
    from_completion = jnp.take_along_axis(state.rows.tokens, generated_at, axis=1)
    context = jnp.where(index < prompt_len, from_prompt, from_completion)
    length = state.prompt_len + state.rows.num_generated - 1
    rebuilt = state.rows.active if keep is None else state.rows.active | keep
    mask = (index < length[:, None]) & rebuilt[:, None]
    fresh = KVCache.zeros(model.config, rows, slots, _cache_dtype(state.cache))
    positions = jnp.broadcast_to(index, context.shape)
    _, cache = model.decode(context, positions, fresh, mask)
    end = jnp.where(rebuilt, length, state.cache.end)
    if isinstance(state.cache, PagedKVCache):
        # Rows sharing a prompt page rebuild it to the same values; rows left out write
        # nothing (their pages may be another row's now).
        pages = scatter_rows(state.cache, jnp.arange(rows), cache, mask)
        paged = dataclasses.replace(state.cache, pages=pages, valid=cache.valid, end=end)
        return dataclasses.replace(state, cache=paged)
    return dataclasses.replace(state, cache=dataclasses.replace(cache, end=end))


@jax.jit
def take_rows(rows: Rows, index: jax.Array) -> tuple[jax.Array, ...]:
    """``(tokens, logprobs, plain_logprobs, versions, num_generated, finish)`` of the rows
    ``index`` (callers pad ``index`` to a bucket so few shapes are compiled)."""
    return tuple(
        x[index]
        for x in (
            rows.tokens,
            rows.logprobs,
            rows.plain_logprobs,
            rows.versions,
            rows.num_generated,
            rows.finish,
        )
    )


@functools.partial(jax.jit, donate_argnames=("state",))
def release_rows(state: DecodeState, index: jax.Array) -> DecodeState:
    """Rows ``index`` stop generating (entries ``>= R`` are ignored)."""
    active = state.rows.active.at[index].set(False, mode="drop")
    return dataclasses.replace(state, rows=dataclasses.replace(state.rows, active=active))
