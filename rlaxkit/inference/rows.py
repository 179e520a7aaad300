"""Per-row sampling progress shared by every sampler: the completion buffers, the stop
checks and the PRNG key schedule.

A row is one completion being generated. Its token ``t`` is drawn with key
``fold_in(row_key, t)`` where ``row_key = fold_in(request_key, sample_index)``, so a
completion depends only on its request's key, its sample index and the weights, never on
which row, batch or chunk of decode steps it was generated in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from rlaxkit.inference.config import SamplingConfig
from rlaxkit.inference.sampler import sample_tokens

RUNNING, STOP, LENGTH, INTERRUPTED = 0, 1, 2, 3
FINISH_REASONS = {STOP: "stop", LENGTH: "length", INTERRUPTED: "interrupted"}
NO_TOKEN = -1  # fills the stop-sequence window; never a token id


@jax.tree_util.register_dataclass
@dataclass
class Rows:
    """What every row has generated so far, ``R`` rows of at most ``M`` new tokens.

    Attributes:
        keys: ``[R]`` PRNG keys, ``fold_in(request_key, sample_index)``.
        budget: ``[R]`` int32, the most new tokens this row may generate (``<= M``).
        num_generated: ``[R]`` int32.
        tokens: ``[R, M]`` int32 completion tokens; 0 after the end.
        logprobs: ``[R, M]`` float32, log-prob under the distribution sampled from.
        plain_logprobs: ``[R, M]`` float32, log-prob under ``softmax(logits / T)``.
        versions: ``[R, M]`` int32 weight version that produced each token; -1 after
            the end.
        recent: ``[R, L]`` int32, the last ``L`` tokens (``L`` = longest stop sequence).
        active: ``[R]`` bool, still generating.
        finish: ``[R]`` int32 finish code (``RUNNING`` while active or empty).
        offset: ``[R]`` int32 tokens the row's sample had before this row (a row that
            goes on from a preempted one: its token ``t`` is the sample's ``offset + t``
            and draws with key ``fold_in(row_key, offset + t)``); 0 otherwise.
    """

    keys: jax.Array
    budget: jax.Array
    num_generated: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    plain_logprobs: jax.Array
    versions: jax.Array
    recent: jax.Array
    active: jax.Array
    finish: jax.Array
    offset: jax.Array

    @classmethod
    def empty(cls, rows: int, config: SamplingConfig) -> Rows:
        """``rows`` inactive rows with room for ``config.max_new_tokens`` tokens."""
        m = config.max_new_tokens
        window = max((len(s) for s in config.stop_sequences), default=0)
        return cls(
            keys=jax.random.split(jax.random.key(0), rows),
            budget=jnp.zeros((rows,), jnp.int32),
            num_generated=jnp.zeros((rows,), jnp.int32),
            tokens=jnp.zeros((rows, m), jnp.int32),
            logprobs=jnp.zeros((rows, m), jnp.float32),
            plain_logprobs=jnp.zeros((rows, m), jnp.float32),
            versions=jnp.full((rows, m), -1, jnp.int32),
            recent=jnp.full((rows, window), NO_TOKEN, jnp.int32),
            active=jnp.zeros((rows,), bool),
            finish=jnp.zeros((rows,), jnp.int32),
            offset=jnp.zeros((rows,), jnp.int32),
        )

    def start(
        self,
        dest: jax.Array,
        request_keys: jax.Array,
        sample_index: jax.Array,
        budget: jax.Array,
        offset: jax.Array | None = None,
        recent: jax.Array | None = None,
    ) -> Rows:
        """Rows ``dest`` begin new completions; indices ``>= R`` are ignored (padding).

        Args:
            dest: ``[A]`` int32 row indices.
            request_keys: ``[A]`` PRNG keys of the requests.
            sample_index: ``[A]`` int32, which of its request's samples each row is.
            budget: ``[A]`` int32 max new tokens per row.
            offset: ``[A]`` int32 tokens the samples had already (default 0).
            recent: ``[A, L]`` int32 their last ``L`` tokens (default none).
        """
        row_keys = jax.vmap(jax.random.fold_in)(request_keys, sample_index)

        def put(array, value):
            value = jnp.broadcast_to(jnp.asarray(value, array.dtype), (len(dest), *array.shape[1:]))
            return array.at[dest].set(value, mode="drop")

        return Rows(
            keys=put(self.keys, row_keys),
            budget=put(self.budget, budget),
            num_generated=put(self.num_generated, 0),
            tokens=put(self.tokens, 0),
            logprobs=put(self.logprobs, 0.0),
            plain_logprobs=put(self.plain_logprobs, 0.0),
            versions=put(self.versions, -1),
            recent=put(self.recent, NO_TOKEN if recent is None else recent),
            active=put(self.active, True),
            finish=put(self.finish, RUNNING),
            offset=put(self.offset, 0 if offset is None else offset),
        )


def _ends_with_stop_sequence(recent: jax.Array, config: SamplingConfig) -> jax.Array:
    """``[R]`` bool: the window ``recent [R, L]`` ends with one of the stop sequences."""
    window = recent.shape[1]
    hits = jnp.zeros(recent.shape[:1], bool)
    for seq in config.stop_sequences:
        tail = recent[:, window - len(seq) :]
        hits |= jnp.all(tail == jnp.asarray(seq, jnp.int32)[None], axis=1)
    return hits


def sample_and_record(
    rows: Rows, logits: jax.Array, version: jax.Array, config: SamplingConfig
) -> tuple[Rows, jax.Array]:
    """Draws the next token of every active row from ``logits [R, V]`` and records it.

    A row stops ("stop") when the token is a stop token or completes a stop sequence,
    else ("length") when it reaches its budget. Inactive rows are left unchanged; nothing
    is written after a row's end, so its buffers stay 0 (versions -1) there.

    Returns:
        The updated rows and the drawn tokens ``[R]`` (meaningless for inactive rows).
    """
    active = rows.active
    step_keys = jax.vmap(jax.random.fold_in)(rows.keys, rows.num_generated + rows.offset)
    tokens, logprobs, plain = sample_tokens(step_keys, logits, config)
    max_new = rows.tokens.shape[1]
    index = jnp.arange(len(active))
    column = jnp.where(active, rows.num_generated, max_new)  # inactive: out of range, dropped

    def write(buffer, values):
        return buffer.at[index, column].set(values.astype(buffer.dtype), mode="drop")

    num_generated = rows.num_generated + active.astype(jnp.int32)
    recent = rows.recent
    if recent.shape[1]:
        shifted = jnp.concatenate([recent[:, 1:], tokens[:, None]], axis=1)
        recent = jnp.where(active[:, None], shifted, recent)
    stop_ids = jnp.asarray(config.stop_tokens or (NO_TOKEN,), jnp.int32)
    stopped = jnp.any(tokens[:, None] == stop_ids[None], axis=1)
    if config.stop_sequences:
        stopped |= _ends_with_stop_sequence(recent, config)
    stopped &= active
    at_length = active & ~stopped & (num_generated >= rows.budget)
    finish = jnp.where(stopped, STOP, jnp.where(at_length, LENGTH, rows.finish))
    rows = dataclasses.replace(
        rows,
        num_generated=num_generated,
        tokens=write(rows.tokens, tokens),
        logprobs=write(rows.logprobs, logprobs),
        plain_logprobs=write(rows.plain_logprobs, plain),
        versions=write(rows.versions, jnp.broadcast_to(version, tokens.shape)),
        recent=recent,
        active=active & ~stopped & ~at_length,
        finish=finish.astype(jnp.int32),
    )
    return rows, tokens
