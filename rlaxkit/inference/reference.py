"""Generation by full recomputation, without a KV cache: every step runs the training
forward over the whole sequence so far. It is the baseline the KV-cache sampler is
checked against (same tokens, same log-probs) and measured against (tokens per second).

It shares the sampler, the stop checks and the key schedule with the KV-cache programs,
so for the same keys both draw the same tokens up to float rounding of the logits.
To stay honest as a baseline it does not pad every step to the final length: the loop
runs in stages whose width is the sequence length rounded up to a power of two, one
compiled program per width, and only the last position of each row is unembedded.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from rlaxkit.inference.config import SamplingConfig, bucket_length, bucket_rows
from rlaxkit.inference.generate import as_prompts, budgets, collect_result
from rlaxkit.inference.programs import step_config
from rlaxkit.inference.results import GenerationResult, KeyLike, ModelLike, prompt_keys, split_model
from rlaxkit.inference.rows import Rows, sample_and_record


@jax.tree_util.register_dataclass
@dataclass
class RecomputeState:
    """``sequence [R, P + M]``: prompt then completion, right-padded; ``length [R]``."""

    sequence: jax.Array
    length: jax.Array
    rows: Rows


@functools.partial(jax.jit, static_argnames=("config",))
def _start(sequence, length, request_key_data, sample_index, budget, dest, *, config):
    rows = Rows.empty(sequence.shape[0], config)
    rows = rows.start(dest, jax.random.wrap_key_data(request_key_data), sample_index, budget)
    return RecomputeState(sequence=sequence, length=length, rows=rows)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "config", "width"), donate_argnames=("state",)
)
def _stage(graphdef, params, state, version, *, config, width):
    """Decode steps while every active row still fits in ``width`` tokens."""
    model = graphdef.merge(params)
    rows, total = state.sequence.shape

    def keep_going(state):
        active = state.rows.active
        return jnp.any(active) & jnp.all(~active | (state.length <= width))

    def body(state):
        tokens = state.sequence[:, :width]
        positions = jnp.broadcast_to(jnp.arange(width), tokens.shape)
        mask = positions < state.length[:, None]
        hidden = model.hidden_states(tokens, positions, mask)
        last = jnp.take_along_axis(hidden, (state.length - 1)[:, None, None], axis=1)[:, 0]
        active = state.rows.active
        rows_out, drawn = sample_and_record(state.rows, model.unembed(last), version, config)
        column = jnp.where(active, state.length, total)
        sequence = state.sequence.at[jnp.arange(rows), column].set(drawn, mode="drop")
        length = state.length + active.astype(jnp.int32)
        return dataclasses.replace(state, sequence=sequence, length=length, rows=rows_out)

    return jax.lax.while_loop(keep_going, body, state)


def generate_by_recompute(
    model: ModelLike,
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig,
    rng: KeyLike | Sequence[KeyLike],
    *,
    version: int = 0,
    max_new_tokens: int | Sequence[int] | None = None,
) -> GenerationResult:
    """Like ``rlaxkit.inference.generate`` (same arguments, same result), without a cache."""
    graphdef, params = split_model(model)
    prompt_arrays = as_prompts(prompts, graphdef.model_config(params).vocab_size)
    num_prompts, n = len(prompt_arrays), config.n
    budget = budgets(max_new_tokens, num_prompts, config)
    keys = prompt_keys(rng, num_prompts)
    num_rows = num_prompts * n
    rows = bucket_rows(num_rows)
    total = bucket_length(max(len(p) for p in prompt_arrays)) + config.max_new_tokens
    row = np.arange(rows)
    source = np.minimum(row // n, num_prompts - 1)
    sequence = np.zeros((rows, total), np.int32)
    for r in range(num_rows):
        sequence[r, : len(prompt_arrays[source[r]])] = prompt_arrays[source[r]]
    length = np.array([len(prompt_arrays[s]) for s in source], np.int32)
    dest = np.where(row < num_rows, row, rows).astype(np.int32)
    state = _start(
        sequence,
        length,
        keys[source],
        (row % n).astype(np.int32),
        budget[source],
        dest,
        config=config,
    )
    while True:
        active, length = jax.device_get((state.rows.active, state.length))
        if not active.any():
            break
        width = bucket_length(int(length[active].max()), cap=total)
        state = _stage(
            graphdef, params, state, np.int32(version), config=step_config(config), width=width
        )
    return collect_result(state.rows, prompt_arrays, config)
