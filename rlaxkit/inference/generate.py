"""Static-batch generation: prefill a batch of ragged prompts once, then decode every row
to its end in compiled ``lax.while_loop``s over growing prefixes of the KV cache.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable, Sequence

import jax
import numpy as np

from rlaxkit.inference import programs
from rlaxkit.inference.chunks import ChunkLayout, run_chunks
from rlaxkit.inference.config import (
    MIN_LENGTH_BUCKET,
    SamplingConfig,
    bucket_length,
)
from rlaxkit.inference.results import (
    GenerationResult,
    KeyLike,
    ModelLike,
    key_data,
    packed,
    prompt_keys,
    split_model,
)
from rlaxkit.inference.rows import FINISH_REASONS, Rows
from rlaxkit.rules.validation import check_int
from rlaxkit.util.jaxutil import host_arrays


def as_prompts(
    prompts: Sequence[Sequence[int]],
    vocab_size: int,
    max_positions: int | None = None,
    new_tokens: int = 0,
) -> list[np.ndarray]:
    """Prompts as int32 arrays, checked to be non-empty and inside the vocabulary; a
    prompt whose tokens plus ``new_tokens`` pass ``max_positions`` (the model's
    ``max_position_embeddings``) is generated with a warning: positions past it were
    never trained."""
    out = []
    for i, prompt in enumerate(prompts):
        array = np.asarray(prompt, np.int32).reshape(-1)
        if array.size == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if array.min() < 0 or array.max() >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size})")
        if max_positions is not None and array.size + new_tokens > max_positions:
            warnings.warn(
                f"prompt {i}: {array.size} tokens + {new_tokens} new pass the model's "
                f"max_position_embeddings ({max_positions}); positions past it were never "
                "trained. Shorten the prompt or sampling.max_new_tokens",
                UserWarning,
                stacklevel=3,
            )
        out.append(array)
    if not out:
        raise ValueError("no prompts given")
    return out


def budgets(
    max_new_tokens: int | Sequence[int] | None, num_prompts: int, config: SamplingConfig
) -> np.ndarray:
    """``[num_prompts]`` int32 per-prompt token budgets, each in ``[1, config.max_new_tokens]``."""
    if max_new_tokens is None:  # the config's budget: nothing to check
        return np.full((num_prompts,), config.max_new_tokens, np.int32)
    values = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (num_prompts,))
    if values.min() < 1 or values.max() > config.max_new_tokens:
        raise ValueError(
            f"max_new_tokens must lie in [1, {config.max_new_tokens}] (the config's "
            f"max_new_tokens), got {values.min()}..{values.max()}"
        )
    return np.array(values)


def generate(
    model: ModelLike,
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig,
    rng: KeyLike | Sequence[KeyLike],
    *,
    version: int = 0,
    max_new_tokens: int | Sequence[int] | None = None,
    tiered: bool = False,
    min_prompt_width: int = MIN_LENGTH_BUCKET,
    chunks: int | None = None,
) -> GenerationResult:
    """Samples ``config.n`` completions of every prompt with a KV cache.

    The ``B`` prompts (ragged) are right-padded to a power-of-two width (at least
    ``min_prompt_width``) and prefilled once; each prompt's cache rows are copied to its
    ``n`` sample rows; the ``B * n`` rows (padded to a power of two) decode in jitted
    ``lax.while_loop``s until every row has stopped. A long decode runs in segments over
    growing prefixes of the cache (``decode_views``), so early steps attend over few
    slots; the tokens are those of decoding over the whole cache, the log-probs equal to
    a few float32 ulps. A second call whose batch and prompt width fall in the same
    buckets compiles nothing.

    Args:
        model: a ``Transformer`` or ``(graphdef, params)`` from ``nnx.split``.
        prompts: ``B`` token-id sequences, each at least one token long.
        config: the sampling configuration.
        rng: one seed or key (prompt ``i`` uses ``fold_in(rng, i)``) or ``B`` of them
            (prompt ``i`` uses ``rng[i]``). Sample ``j`` of a prompt uses
            ``fold_in(prompt_key, j)``, so results do not depend on batch composition.
        version: the weight version, recorded for every token.
        max_new_tokens: per-prompt budgets (one value or ``B``), at most
            ``config.max_new_tokens``; default ``config.max_new_tokens``.
        tiered: the first call of a batch shape runs quickly compiled programs while
            the optimised ones compile in the background (``rlaxkit.util.jaxutil.TieredJit``):
            for a loop whose first step should start soon. Later calls are as fast as
            untiered ones; the first call's tokens and log-probs may differ from theirs
            in the last float32 bits.
        min_prompt_width: the narrowest width prompts are padded to (default 16). Every
            width is its own program, so the default keeps short prompts of varying
            length in one; a caller whose prompts all have the same few tokens can pass
            their length, and then neither prefills nor caches padding (4-token prompts
            padded to 16 spend three quarters of the prefill on it).
        chunks: split the ``B * n`` rows into this many batches of the same shape
            (``ChunkLayout``) that decode side by side, each in a thread of its own;
            default ``default_chunks``: on a CPU backend about one per core. The tokens
            do not depend on it; the log-probs agree to a float32 ulp or two (the
            matmuls' batch differs).

    Returns:
        A ``GenerationResult`` of ``[B, n, config.max_new_tokens]`` arrays.
    """
    check_int("min_prompt_width", min_prompt_width, minimum=1, numpy=True)
    graphdef, weights = split_model(model)
    params = packed(weights)
    model_config = graphdef.model_config(params)
    prompt_arrays = as_prompts(
        prompts,
        model_config.vocab_size,
        model_config.max_position_embeddings,
        config.max_new_tokens,
    )
    num_prompts, n = len(prompt_arrays), config.n
    budget = budgets(max_new_tokens, num_prompts, config)
    keys = prompt_keys(rng, num_prompts)

    width = bucket_length(max(len(p) for p in prompt_arrays), minimum=min_prompt_width)
    layout = ChunkLayout.of(num_prompts, n, chunks)
    # Row ``b`` writes cache slots ``len_b - 1 .. len_b + budget_b - 2``: the views from
    # the first up to one holding every row's last write.
    needed = max(len(p) - 1 + int(b) for p, b in zip(prompt_arrays, budget, strict=True))
    begin = programs.tiered_begin_rows if tiered else programs.begin_rows

    def run(chunk: tuple[int, int]) -> tuple[np.ndarray, ...]:
        start, stop = chunk
        tokens, lengths, dest, source, prompt, sample = layout.inputs(chunk, prompt_arrays, width)
        state = begin(
            graphdef,
            params,
            tokens,
            lengths,
            dest,
            source,
            keys[prompt],
            sample,
            budget[prompt],
            model_config=model_config,
            config=config,
            rows=layout.rows,
        )
        for view in decode_views(width, state.cache.slots):
            state, _ = programs.decode_steps(
                graphdef,
                params,
                state,
                np.int32(version),
                np.int32(config.max_new_tokens),
                np.int32(layout.rows + 1),
                config=config,
                view=view,
                tiered=tiered,
            )
            if view >= needed:
                break
        return fetch_rows(state.rows, stop - start)

    parts = run_chunks(run, layout.chunks)
    fetched = tuple(np.concatenate(x) for x in zip(*parts, strict=True))
    return as_result(fetched, prompt_arrays, config)


MIN_VIEW = 32
MIN_VIEW_TOKENS = 64


def decode_views(prompt_width: int, slots: int) -> tuple[int, ...]:
    """The cache prefixes ``generate`` decodes in, shortest first: the powers of two from
    ``max(MIN_VIEW, prompt_width)`` below ``slots``, then ``slots``; a view fewer than
    ``MIN_VIEW / 2`` slots short of ``slots`` is left out (a segment of a few steps
    would not pay for its program).

    Each is one compiled program (``decode_steps(..., view=...)``); a segment runs until a
    generating row would write past its view and the next view goes on from there, so
    early steps read a short cache instead of all ``slots`` slots. A decode of fewer than
    ``MIN_VIEW_TOKENS`` new tokens (``slots - prompt_width``) runs in one program: its
    steps are too few to pay for compiling more.
    """
    if slots - prompt_width < MIN_VIEW_TOKENS:
        return (slots,)
    views = []
    view = max(MIN_VIEW, prompt_width)
    while view < slots:
        if slots - view >= MIN_VIEW // 2:
            views.append(view)
        view *= 2
    return (*views, slots)


def compile_generate(
    model: ModelLike,
    config: SamplingConfig,
    num_prompts: int,
    max_prompt_len: int,
    tiered: bool = False,
    min_prompt_width: int = MIN_LENGTH_BUCKET,
    chunks: int | None = None,
) -> list[threading.Thread]:
    """Starts compiling ``generate``'s programs for one batch shape, one thread each.

    ``generate(model, prompts, config, ...)`` with ``num_prompts`` prompts of at most
    ``max_prompt_len`` tokens then compiles nothing: its calls find these executables.
    XLA compiles without holding the GIL, so the programs compile side by side and
    alongside whatever the caller does next (e.g. compiling a train step). Join the
    returned threads to wait; a compile error surfaces when ``generate`` is called.
    ``tiered`` compiles the quick programs of ``generate(..., tiered=True)``'s first call,
    ``min_prompt_width`` and ``chunks`` those of ``generate`` called with the same.
    """
    check_int("min_prompt_width", min_prompt_width, minimum=1, numpy=True)
    graphdef, params = split_model(model)
    model_config = graphdef.model_config(params)
    layout = ChunkLayout.of(num_prompts, config.n, chunks)
    rows, padded_prompts = layout.rows, layout.prompts
    width = bucket_length(max_prompt_len, minimum=min_prompt_width)
    spec = jax.ShapeDtypeStruct
    abstract = packed(jax.tree.map(lambda x: spec(x.shape, x.dtype), params))
    state = jax.eval_shape(
        functools.partial(programs.init_state, model_config, config, rows, width)
    )
    key_shape = key_data(0).shape
    row = spec((rows,), np.int32)
    jobs: list[Callable[[], object]] = [
        lambda: (
            (programs.tiered_begin_rows if tiered else programs.begin_rows)
            .lower(
                graphdef,
                abstract,
                spec((padded_prompts, width), np.int32),
                spec((padded_prompts,), np.int32),
                row,
                row,
                spec((rows, *key_shape), np.uint32),
                row,
                row,
                model_config=model_config,
                config=config,
                rows=rows,
            )
            .compile()
        ),
        *(
            functools.partial(
                programs.compile_decode_steps, graphdef, abstract, state, config, view, tiered
            )
            for view in decode_views(width, state.cache.slots)
        ),
    ]
    threads = [threading.Thread(target=job, name="compile-generate") for job in jobs]
    for thread in threads:
        thread.start()
    return threads


def collect_result(
    rows: Rows, prompts: list[np.ndarray], config: SamplingConfig
) -> GenerationResult:
    """The first ``len(prompts) * n`` rows as a ``GenerationResult`` (one device fetch)."""
    return as_result(fetch_rows(rows, len(prompts) * config.n), prompts, config)


def fetch_rows(rows: Rows, count: int) -> tuple[np.ndarray, ...]:
    """The first ``count`` rows' tokens, log-probs, plain log-probs, versions, lengths and
    finish codes, on the host (``rlaxkit.util.jaxutil.host_arrays``)."""
    fetched = host_arrays(
        (
            rows.tokens,
            rows.logprobs,
            rows.plain_logprobs,
            rows.versions,
            rows.num_generated,
            rows.finish,
        )
    )
    return tuple(x[:count] for x in fetched)


def as_result(
    fetched: tuple[np.ndarray, ...], prompts: list[np.ndarray], config: SamplingConfig
) -> GenerationResult:
    """``fetch_rows``' arrays of ``len(prompts) * n`` rows as a ``GenerationResult``."""
    num_prompts, n = len(prompts), config.n
    tokens, logprobs, plain, versions, generated, finish = fetched
    shape = (num_prompts, n, config.max_new_tokens)
    lengths = generated.reshape(num_prompts, n)
    return GenerationResult(
        tokens=tokens.reshape(shape),
        logprobs=logprobs.reshape(shape),
        plain_logprobs=plain.reshape(shape),
        versions=versions.reshape(shape),
        mask=np.arange(config.max_new_tokens) < lengths[..., None],
        lengths=lengths,
        finish_reasons=tuple(
            tuple(FINISH_REASONS[int(code)] for code in finish[i * n : (i + 1) * n])
            for i in range(num_prompts)
        ),
        prompts=tuple(prompts),
    )
