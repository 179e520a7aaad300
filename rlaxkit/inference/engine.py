"""Continuous batching with interruptible generation: a fixed set of decode rows ("slots")
that are refilled with queued requests as soon as rows finish, and that can take new
weights between chunks of decode steps.

Under long-tailed response lengths a static batch spends most of its steps waiting for
its longest row; here a finished row is refilled by prefilling the next request's prompt
into that row alone (at its own offset, its old cache entries invalidated) while the
other rows keep decoding, all with the programs of ``rlaxkit.inference.programs`` at
bucketed shapes, so nothing recompiles once the buckets are warm.

Weights may change between chunks (RLAX's workers pull from the parameter server; AReaL
interrupts generation for new weights). Either the KV cache is kept (earlier tokens'
keys and values stay those of the old weights) or, as in AReaL, it is recomputed from
prompt + completion-so-far under the new weights. Every token records the version of
the weights whose forward pass produced its logits.

Multi-turn requests (an agent calling a tool) are submitted with ``hold=True``: a row
whose completion ends with one of ``config.stop_sequences`` (the tool call) is parked,
keeping its cache and offset, instead of being freed. ``resume`` prefills the tool's
answer into that row at its offset and the next turn decodes from there, without
prefilling the history again; ``release`` frees a parked row whose tool is slow (its
episode goes on later as a new request whose prompt is the whole history).

With ``kv_cache="paged"`` the cache is a pool of pages (``rlaxkit.inference.paged``):
a row takes pages as it grows and gives them back when it finishes, the samples of a
prompt share its full pages, and a request is admitted when its pages are free, not only
when a row is. When the pool runs short, the youngest generating row is preempted back to
the front of the queue (``preemptions`` counts them) with the tokens it has, their
log-probs and versions; it goes on later from its prompt and those tokens, prefilled
again, drawing its next tokens with their own keys (``rows.Rows.offset``).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Literal

import jax
import numpy as np
from flax import nnx

from rlaxkit.inference import programs
from rlaxkit.inference.config import SamplingConfig, bucket_length, bucket_rows
from rlaxkit.inference.generate import MIN_VIEW_TOKENS, as_prompts, budgets
from rlaxkit.inference.page_table import RowPages
from rlaxkit.inference.paged import Attention, check_attention, default_attention
from rlaxkit.inference.results import (
    Completion,
    KeyLike,
    ModelLike,
    key_data,
    matching_params,
    packed,
    split_model,
)
from rlaxkit.inference.rows import FINISH_REASONS, INTERRUPTED, NO_TOKEN, STOP
from rlaxkit.inference.samples import (
    KeptTokens,
    PendingResume,
    QueuedSample,
    SampleBooks,
    prompt_key,
)
from rlaxkit.rules.paging import check_pages
from rlaxkit.util.jaxutil import host_arrays

# A chunk decodes on one of at most this many cache prefixes (the last the whole cache).
ENGINE_VIEWS = 8


def engine_views(prompt_width: int, slots: int) -> tuple[int, ...]:
    """The cache prefixes an ``InferenceEngine`` chunk may decode on, shortest first:
    eighths of ``slots`` (rounded up to 16 slots), then ``slots``; a view fewer than 16
    slots short of ``slots`` is left out. A cache of fewer than ``MIN_VIEW_TOKENS`` new
    tokens (``slots - prompt_width``) has one view.

    Each is one compiled program (``decode_steps(..., view=...)``). Rows refill at
    different times, so a chunk's view follows its longest row, which is long most of
    the time; even steps, not ``generate``'s doublings, keep the view close to that row
    there. On ``benchmarks/engine_views.py --quick`` (576 slots, budgets of 64-512
    tokens) eighths decoded 1.18-1.27x the whole cache's tokens/s, doublings 1.07-1.15x
    (most chunks on the 512-slot view), and steps of 32 slots (17 programs) 1.19x.
    """
    if slots - prompt_width < MIN_VIEW_TOKENS:
        return (slots,)
    step = 16 * -(-slots // (16 * ENGINE_VIEWS))
    views = [step * k for k in range(1, ENGINE_VIEWS) if slots - step * k >= 16]
    return (*views, slots)


# Returns ``None`` (no new weights) or ``(weights, version)``; polled between chunks.
WeightSource = Callable[[], "tuple[ModelLike | nnx.State, int] | None"]


def _device_of(params: nnx.State) -> jax.Device:
    """The one device ``params`` are committed to (else the default device)."""
    for leaf in jax.tree.leaves(params):
        if isinstance(leaf, jax.Array) and leaf.committed and len(leaf.devices()) == 1:
            return next(iter(leaf.devices()))
    return jax.devices()[0]


class InferenceEngine:
    """Generates completions for submitted requests on ``num_slots`` decode rows.

    For example (a literal block: it needs a model; the engine's tests run it)::

        engine = InferenceEngine(model, SamplingConfig(max_new_tokens=8), num_slots=4,
                                 max_prompt_len=32)
        rid = engine.submit([1, 2, 3], rng=0)
        completions = engine.run()

    Args:
        model: a ``Transformer`` or ``(graphdef, params)``.
        config: the sampling configuration shared by all requests.
        num_slots: decode rows (the batch of every decode step).
        max_prompt_len: the longest prompt accepted; rounded up to a power of two.
        max_context_len: the KV-cache length of a row: the most tokens a multi-turn
            request's prompt, completions and observations may hold (less one: the
            last sampled token is never cached). Default: ``max_prompt_len`` (rounded)
            plus ``config.max_new_tokens``, room for one turn.
        version: the version of ``model``'s weights.
        chunk_steps: decode steps between two points where weights may change.
        refill_fraction: while requests are queued, a chunk also ends as soon as this
            fraction of the rows (at least one) has finished, so they are refilled.
        cache_views: decode each chunk on the shortest cache prefix that holds its
            rows' writes (``engine_views``: eighths of the cache), so attention reads
            fewer slots while the rows are short; ``False``: always the whole cache.
            The tokens are the same either way.
        kv_cache: ``"dense"`` (a row reserves ``max_context_len`` slots), ``"paged"``
            (rows hold pages as they grow; see the module docstring) or ``"auto"``: paged
            on TPU, dense elsewhere (``benchmarks/paged.py``).
        page_size: slots per page (paged).
        num_pages: pages in the pool, the null page included (paged; default: as many
            as the dense cache's slots, plus the null page).
        attention: ``"reference"`` (XLA) or ``"kernel"`` (the TPU ragged paged attention
            kernel); default: the kernel on TPU (paged).
        attention_block: slots one block of the kernel reads; ``page_size`` divides it.
        compile_rebuild: compile the cache rebuild now (``compile_rebuild``).
    """

    def __init__(
        self,
        model: ModelLike,
        config: SamplingConfig,
        *,
        num_slots: int,
        max_prompt_len: int,
        max_context_len: int | None = None,
        version: int = 0,
        chunk_steps: int = 32,
        refill_fraction: float = 0.25,
        cache_views: bool = True,
        kv_cache: Literal["auto", "dense", "paged"] = "dense",
        page_size: int = 16,
        num_pages: int | None = None,
        attention: Attention | None = None,
        attention_block: int = 128,
        compile_rebuild: bool = False,
    ):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if max_prompt_len < 1:
            raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
        if chunk_steps < 1:
            raise ValueError(f"chunk_steps must be >= 1, got {chunk_steps}")
        if not 0 < refill_fraction <= 1:
            raise ValueError(f"refill_fraction must be in (0, 1], got {refill_fraction}")
        self.graphdef, self.params = split_model(model)
        self._packed = packed(self.params)  # what the programs take
        self.model_config = self.graphdef.model_config(self.params)
        self.config = config
        self.num_slots = num_slots
        self.prompt_width = bucket_length(max_prompt_len)
        self.max_context_len = self.prompt_width + config.max_new_tokens
        if max_context_len is not None:
            if max_context_len < self.max_context_len:
                raise ValueError(
                    f"max_context_len must be >= max_prompt_len (rounded: {self.prompt_width})"
                    f" + max_new_tokens ({config.max_new_tokens}), got {max_context_len}"
                )
            self.max_context_len = max_context_len
        self.version = version
        self.chunk_steps = chunk_steps
        self.refill_rows = max(1, math.ceil(refill_fraction * num_slots))
        # Committed where the weights are: the programs' outputs are, and an uncommitted
        # first state would key a second program of the same shapes (a second compile).
        self._device = _device_of(self.params)
        slots = self.max_context_len
        self._pages: RowPages | None = None
        self.preemptions = 0  # rows sent back to the queue for want of pages
        if kv_cache == "auto":
            kv_cache = "paged" if self._device.platform == "tpu" else "dense"
        if kv_cache == "paged":
            slots = page_size * -(-slots // page_size)
            if num_pages is None:
                num_pages = num_slots * (slots // page_size) + 1
            check_pages(
                page_size=page_size,
                num_pages=num_pages,
                attention_block=attention_block,
                max_prompt_tokens=self.prompt_width,
                # a multi-turn row grows to the whole context
                max_new_tokens=self.max_context_len - self.prompt_width,
            )
            attention = attention or default_attention()
            check_attention(attention)
            state = programs.init_paged_state(
                self.model_config,
                config,
                num_slots,
                slots,
                num_pages,
                page_size,
                attention,
                attention_block // page_size,
            )
            self._pages = RowPages(num_slots, slots, num_pages, page_size)
        elif kv_cache == "dense":
            state = programs.init_state(
                self.model_config, config, num_slots, self.prompt_width, self.max_context_len
            )
        else:
            raise ValueError(f"kv_cache must be 'auto', 'dense' or 'paged', got {kv_cache!r}")
        self.kv_cache = kv_cache
        self.state = jax.device_put(state, self._device)
        self._books = SampleBooks.empty(num_slots)  # where each sample is, between chunks
        self._launched = False  # a chunk was dispatched and not yet finished
        self._views = engine_views(self.prompt_width, slots) if cache_views else (slots,)
        if self._pages is not None:  # whole pages: a view is a prefix of the page table
            self._views = tuple(sorted({page_size * -(-v // page_size) for v in self._views}))
        if compile_rebuild:
            self.compile_rebuild()

    @property
    def num_queued(self) -> int:
        """Samples waiting for a row, and resumed rows waiting for their observation's
        prefill (at the next launch)."""
        return len(self._books.queue) + len(self._books.resumes)

    @property
    def num_running(self) -> int:
        """Rows generating. Parked rows are not counted: they hold a row but run no
        decode step (``num_parked``)."""
        busy = len(self._books.slots) - self._books.slots.count(None)
        return busy - len(self._books.parked) - len(self._books.resumes)

    @property
    def num_held(self) -> int:
        """Rows holding a sequence: running, parked or waiting for an observation (the
        rows whose cache ``update_weights(..., recompute_cache=True)`` rebuilds)."""
        return len(self._books.slots) - self._books.slots.count(None)

    @property
    def num_parked(self) -> int:
        """Rows held for an observation (``resume``) or a ``release``; no request
        takes them."""
        return len(self._books.parked)

    @property
    def parked(self) -> list[tuple[int, int]]:
        """``(request_id, sample_index)`` of every parked row, sorted."""
        return sorted(self._books.parked)

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing running: stepping would do nothing. Parked rows
        do not count, for only the caller's ``resume`` or ``release`` moves them on (so
        ``run`` returns once every other row is done)."""
        return not self._books.queue and not self._books.resumes and self.num_running == 0

    def submit(
        self,
        prompt: Sequence[int],
        rng: KeyLike,
        *,
        max_new_tokens: int | None = None,
        request_id: int | None = None,
        hold: bool = False,
        sample_index: int | None = None,
    ) -> int:
        """Queues ``config.n`` samples of ``prompt``; returns the request id.

        ``request_id`` (default: the next unused integer) must not belong to a request
        still queued, running or parked.

        With ``sample_index``, only that sample of ``request_id`` is queued, and the
        request's other samples may still be in flight (not this one): a multi-turn
        sample whose parked row was ``release``d goes on as a prompt of its whole
        history, with the tokens ``resume(request_id, ..., rng, sample_index=j)`` would
        have given it.

        With ``hold``, a sample whose completion ends with one of
        ``config.stop_sequences`` (and not with a stop token) parks its row: the
        completion is returned with ``parked=True`` and the row keeps its cache until
        ``resume`` or ``release``. A row without room for one more observation token
        and one new token is freed instead (``parked=False``).

        Sample ``j`` uses key ``fold_in(rng, j)`` and token ``t`` of it
        ``fold_in(fold_in(rng, j), t)``, so its tokens do not depend on which row or
        chunk generates them: the same as ``generate(model, [prompt], config, [rng])``.
        """
        budget = (
            self.config.max_new_tokens
            if max_new_tokens is None  # nothing to check
            else int(budgets(max_new_tokens, 1, self.config)[0])
        )
        (array,) = as_prompts(
            [prompt],
            self.model_config.vocab_size,
            self.model_config.max_position_embeddings,
            self.config.max_new_tokens if sample_index is None else budget,
        )
        if len(array) > self.prompt_width:
            raise ValueError(
                f"prompt of {len(array)} tokens exceeds max_prompt_len ({self.prompt_width})"
            )
        if hold and not self.config.stop_sequences:
            raise ValueError("hold=True needs config.stop_sequences (the tool-call ends)")
        data = key_data(rng)
        if sample_index is not None:
            if request_id is None or not 0 <= sample_index < self.config.n:
                raise ValueError(
                    f"sample_index={sample_index} needs a request_id and must lie in "
                    f"[0, {self.config.n})"
                )
            if self._holds((request_id, sample_index)):
                raise ValueError(
                    f"request {request_id} sample {sample_index} is already queued, "
                    "running or parked"
                )
            self._books.unfinished[request_id] += 1
            self._books.queue.append(
                QueuedSample(request_id, sample_index, array, data, budget, hold)
            )
            return request_id
        if request_id is None:
            request_id = next(i for i in self._books.ids if i not in self._books.unfinished)
        elif request_id in self._books.unfinished:
            raise ValueError(f"request {request_id} is already queued, running or parked")
        self._books.unfinished[request_id] = self.config.n
        for j in range(self.config.n):
            self._books.queue.append(QueuedSample(request_id, j, array, data, budget, hold))
        return request_id

    def _holds(self, key: tuple[int, int]) -> bool:
        """Whether sample ``key`` (request, sample) is queued, in a row or parked."""
        samples = [*self._books.queue, *(s for s in self._books.slots if s is not None)]
        return any((s.request_id, s.sample_index) == key for s in samples)

    def resume(
        self,
        request_id: int,
        observation: Sequence[int],
        rng: KeyLike,
        *,
        sample_index: int = 0,
        max_new_tokens: int | None = None,
        hold: bool | None = None,
    ) -> None:
        """Continues a parked sample after ``observation`` (e.g. a tool's answer).

        At the next launch the observation's tokens are prefilled into the parked row
        at its offset (the history's cache is kept, whatever weights computed it) and
        the next turn decodes from there. Its completion comes back like any other,
        with ``prompt_tokens`` the whole context before it (prompt, earlier turns and
        observations) and the log-probs and versions of its new tokens only. Token
        ``t`` uses key ``fold_in(fold_in(rng, sample_index), t)``: the tokens that
        ``submit(prompt_tokens, rng)`` would give sample ``sample_index``.

        Args:
            request_id, sample_index: the parked sample.
            observation: token ids, at least one.
            rng: seed or key of the next turn.
            max_new_tokens: the next turn's budget (default ``config.max_new_tokens``).
            hold: whether the next turn parks too (default: as submitted).

        Raises:
            ValueError: the sample is not parked, or its context, the observation and
                the budget do not fit the row's ``max_context_len`` cache slots.
        """
        key = (request_id, sample_index)
        row = self._books.parked.get(key)
        if row is None:
            state = (
                "unknown or finished (parked rows come from submit(..., hold=True))"
                if request_id not in self._books.unfinished
                else "already resumed"
                if any(r.key == key for r in self._books.resumes)
                else "queued or generating"
            )
            raise ValueError(
                f"request {request_id} sample {sample_index} is not parked: it is {state}"
            )
        array = np.asarray(observation, np.int32).reshape(-1)
        if array.size == 0:
            raise ValueError("observation is empty; it needs at least one token")
        if array.min() < 0 or array.max() >= self.model_config.vocab_size:
            raise ValueError(
                f"observation has token ids outside [0, {self.model_config.vocab_size})"
            )
        (budget,) = budgets(max_new_tokens, 1, self.config)
        sample = self._books.slots[row]
        assert sample is not None, f"parked row {row} holds no sample"
        needed = len(sample.prompt) + len(array) + int(budget) - 1
        if needed > self.max_context_len:
            raise ValueError(
                f"request {request_id} sample {sample_index}: {len(sample.prompt)} tokens so "
                f"far + {len(array)} observation tokens + {int(budget)} new tokens need "
                f"{needed} cache slots, more than max_context_len ({self.max_context_len}). "
                "Pass a smaller max_new_tokens, or release the request and submit its "
                "history to an engine with a larger max_context_len"
            )
        data = key_data(rng)
        del self._books.parked[key]
        self._books.slots[row] = sample._replace(
            prompt=np.concatenate([sample.prompt, array]),
            key_data=data,
            budget=int(budget),
            hold=sample.hold if hold is None else hold,
        )
        self._books.resumes.append(PendingResume(key, row, array))

    def release(self, request_id: int, sample_index: int | None = None) -> None:
        """Frees parked rows of ``request_id`` (one sample, or all when ``sample_index``
        is None) for other requests; their caches are dropped. To go on later, submit
        the history (the last completion's ``prompt_tokens + tokens``, then the
        observation) as a new prompt."""
        keys = [
            k for k in self._books.parked if k[0] == request_id and sample_index in (None, k[1])
        ]
        if not keys:
            raise ValueError(
                f"request {request_id}"
                + ("" if sample_index is None else f" sample {sample_index}")
                + " has no parked row"
            )
        for k in keys:
            row = self._books.parked.pop(k)
            self._books.slots[row] = None
            self._free_pages(row)
            self._release(request_id)

    def update_weights(
        self, weights: ModelLike | nnx.State, version: int, *, recompute_cache: bool = False
    ) -> None:
        """Generates with ``weights`` (same architecture) from the next decode step on.

        Args:
            weights: a ``Transformer``, ``(graphdef, params)`` or the ``params`` alone
                (any pytree with the structure, shapes and dtypes of the current ones,
                e.g. an ``nnx.State`` pulled from a parameter server).
            version: their version, recorded for every token they produce.
            recompute_cache: rebuild the KV cache of every running or parked row under
                the new weights (AReaL); otherwise the cached keys and values are kept.
        """
        self.params, self._packed = matching_params(weights, self.graphdef, self._packed)
        self.version = version
        if recompute_cache and any(s is not None for s in self._books.slots):
            # Parked rows go on later: their caches are rebuilt with the running ones'.
            waiting = np.zeros((self.num_slots,), bool)
            waiting[self._waiting_rows()] = True
            self._sync_pages()
            self.state = programs.recompute_cache(self.graphdef, self._packed, self.state, waiting)

    def compile_rebuild(self) -> None:
        """Compiles what ``update_weights(..., recompute_cache=True)`` runs, for this
        engine's shapes: a worker that pulls in flight calls it when it starts, so its
        first such pull does not compile mid-run."""
        waiting = np.zeros((self.num_slots,), bool)
        programs.recompute_cache.lower(self.graphdef, self._packed, self.state, waiting).compile()

    def step(self) -> list[Completion]:
        """Refills free rows, runs one chunk of decode steps, returns what finished."""
        self.launch()
        return self.finish()

    def launch(self) -> bool:
        """The first half of ``step``: prefills resumed rows' observations, refills free
        rows and dispatches one chunk of decode steps. Returns whether a chunk runs;
        ``finish`` waits for it. With asynchronous dispatch (accelerators) this returns
        before the chunk has run, and another engine's chunk, or host work, runs in
        between; XLA:CPU under ``rlaxkit.util.hostmem`` runs the chunk on this thread first."""
        self._extend()
        if self._pages is not None:
            self._grow()
        self._refill()
        self._launched = bool(self.num_running)
        if self._launched:
            self._sync_pages()
            self.state, _ = programs.decode_steps(
                self.graphdef,
                self._packed,
                self.state,
                np.int32(self.version),
                np.int32(self.chunk_steps),
                np.int32(self.refill_rows if self._books.queue else self.num_slots + 1),
                config=self.config,
                view=self._view(),
            )
        return self._launched

    def _view(self) -> int:
        """The cache prefix this chunk decodes on: the shortest of ``engine_views`` that
        holds ``chunk_steps`` more writes of every generating row, so the chunk runs the
        steps the whole cache would (its tokens; log-probs to a few float32 ulps,
        ``programs.decode_steps``) while attention reads fewer slots early in long
        completions. A cache of fewer than ``MIN_VIEW_TOKENS`` new tokens has one view."""
        if len(self._views) == 1:
            return self._views[0]
        waiting = self._waiting_rows()
        rows = [r for r, s in enumerate(self._books.slots) if s is not None and r not in waiting]
        needed = int(self._books.ends[rows].max(initial=0)) + self.chunk_steps
        return next((view for view in self._views if view >= needed), self._views[-1])

    def finish(self) -> list[Completion]:
        """The second half of ``step``: waits for the launched chunk and returns what
        finished (nothing if no chunk was launched)."""
        if not self._launched:
            return []
        self._launched = False
        if len(self._views) > 1 or self._pages is not None:  # offsets in the same read
            active, ends = host_arrays((self.state.rows.active, self.state.cache.end))
            self._books.ends = ends.astype(np.int64)  # a copy: the next chunk donates the state
        else:
            active = np.asarray(self.state.rows.active)
        waiting = set(self._waiting_rows())
        done = [
            r
            for r, s in enumerate(self._books.slots)
            if s is not None and not active[r] and r not in waiting
        ]
        return self._collect(done)

    def run(
        self, weight_source: WeightSource | None = None, *, recompute_cache: bool = False
    ) -> list[Completion]:
        """Steps until idle; between chunks takes new weights from ``weight_source``.

        Args:
            weight_source: polled before every chunk; ``(weights, version)`` updates.
            recompute_cache: passed to ``update_weights``.

        Returns:
            Every completion finished by this call, ordered by request and sample.
        """
        finished: list[Completion] = []
        while not self.idle:
            if weight_source is not None and (new := weight_source()) is not None:
                self.update_weights(*new, recompute_cache=recompute_cache)
            finished.extend(self.step())
        return sorted(finished, key=lambda c: (c.request_id, c.sample_index))

    def abort(self) -> list[Completion]:
        """Stops everything: running rows are returned as ``"interrupted"`` with what they
        have generated; queued samples, parked rows and pending resumes are dropped."""
        for sample in self._books.queue:
            self._release(sample.request_id)
        self._books.queue.clear()
        for row in self._waiting_rows():
            waiting = self._books.slots[row]
            assert waiting is not None, f"parked row {row} holds no sample"
            self._books.slots[row] = None
            self._free_pages(row)
            self._release(waiting.request_id)
        self._books.parked.clear()
        self._books.resumes.clear()
        running = [r for r, s in enumerate(self._books.slots) if s is not None]
        out = self._collect(running, interrupted=True)
        if running:
            self._sync_pages()
            index = np.full((bucket_rows(len(running)),), self.num_slots, np.int32)
            index[: len(running)] = running
            self.state = programs.release_rows(self.state, index)
        return out

    def cancel(self, request_id: int) -> int:
        """Drops every sample of ``request_id`` between chunks: queued, parked, waiting
        for an observation or running (its row stops and takes the next queued sample
        at the next launch). Nothing is returned for them. Returns the rows freed."""
        books = self._books
        kept = collections.deque(s for s in books.queue if s.request_id != request_id)
        for _ in range(len(books.queue) - len(kept)):
            self._release(request_id)
        books.queue = kept
        books.resumes = [r for r in books.resumes if r.key[0] != request_id]
        books.parked = {k: row for k, row in books.parked.items() if k[0] != request_id}
        slots = books.slots
        rows = [r for r, s in enumerate(slots) if s is not None and s.request_id == request_id]
        for row in rows:
            slots[row] = None
            self._free_pages(row)
            self._release(request_id)
        if rows:
            index = np.full((bucket_rows(len(rows)),), self.num_slots, np.int32)
            index[: len(rows)] = rows
            self._sync_pages()
            self.state = programs.release_rows(self.state, index)
        return len(rows)

    def _release(self, request_id: int) -> None:
        """One sample of ``request_id`` is finished or dropped."""
        self._books.unfinished[request_id] -= 1
        if not self._books.unfinished[request_id]:
            del self._books.unfinished[request_id]

    def _waiting_rows(self) -> list[int]:
        """Rows parked, or resumed and waiting for their observation's prefill."""
        return [*self._books.parked.values(), *(r.row for r in self._books.resumes)]

    def _extend(self) -> None:
        """Prefills the pending resumes' observations into their rows, in one program."""
        if not self._books.resumes:
            return
        resumes, waiting = self._books.resumes, list[PendingResume]()
        if self._pages is not None:  # each needs its observation's pages; else it waits
            preempted: list[int] = []  # (resumed rows are waiting rows: never preempted)
            ready: list[PendingResume] = []
            for resume in resumes:
                slots = int(self._books.ends[resume.row]) + len(resume.observation)
                taken = self._take_pages(resume.row, slots, preempted)
                (ready if taken else waiting).append(resume)
            if preempted:
                self._preempt(preempted)
            resumes = ready
        self._books.resumes = waiting
        if not resumes:
            return
        num_rows = bucket_rows(len(resumes))
        width = bucket_length(max(len(r.observation) for r in resumes), cap=self.max_context_len)
        observations = np.zeros((num_rows, width), np.int32)
        lengths = np.ones((num_rows,), np.int32)
        dest = np.full((num_rows,), self.num_slots, np.int32)  # padding: out of range
        sample_index = np.zeros((num_rows,), np.int32)
        budget = np.ones((num_rows,), np.int32)
        samples = []
        for resume in resumes:
            sample = self._books.slots[resume.row]
            assert sample is not None, f"resumed row {resume.row} holds no sample"
            samples.append(sample)
        keys = np.zeros((num_rows, *samples[0].key_data.shape), np.uint32)
        for a, (resume, sample) in enumerate(zip(resumes, samples, strict=True)):
            observations[a, : len(resume.observation)] = resume.observation
            lengths[a], dest[a] = len(resume.observation), resume.row
            self._books.ends[resume.row] += len(resume.observation)
            sample_index[a], budget[a], keys[a] = (
                sample.sample_index,
                sample.budget,
                sample.key_data,
            )
        self._sync_pages()
        self.state = programs.extend_rows(
            self.graphdef,
            self._packed,
            self.state,
            observations,
            lengths,
            dest,
            keys,
            sample_index,
            budget,
        )

    def _refill(self) -> None:
        """Starts queued samples on free rows, one shared prefill per distinct request."""
        free = [r for r, s in enumerate(self._books.slots) if s is None]
        if not free or not self._books.queue:
            return
        admitted = self._admit(free)
        if not admitted:
            return
        # Samples of one prompt share its prefill; a preempted sample (its prompt grown
        # by its tokens) or a resubmitted history is a prompt of its own.
        prompt_of: dict[tuple[int, int], int] = {}
        for sample in admitted:
            prompt_of.setdefault(prompt_key(sample), len(prompt_of))
        firsts = {prompt_key(s): s for s in reversed(admitted)}
        unique = [firsts[key] for key in prompt_of]
        # Rows are always padded to ``num_slots`` (copying a prefilled prompt to a row is
        # cheap), so only the number of distinct prompts and their width key programs.
        num_prompts, num_rows = bucket_rows(len(unique)), self.num_slots
        # A preempted multi-turn row's prompt is its history, which may outgrow prompts.
        width = bucket_length(max(len(s.prompt) for s in unique), cap=self.max_context_len)
        prompts = np.zeros((num_prompts, width), np.int32)
        lengths = np.ones((num_prompts,), np.int32)
        for i, sample in enumerate(unique):
            prompts[i, : len(sample.prompt)] = sample.prompt
            lengths[i] = len(sample.prompt)
        dest = np.full((num_rows,), self.num_slots, np.int32)  # padding: out of range
        source = np.zeros((num_rows,), np.int32)
        sample_index = np.zeros((num_rows,), np.int32)
        budget = np.ones((num_rows,), np.int32)
        keys = np.zeros((num_rows, *admitted[0].key_data.shape), np.uint32)
        count = len(admitted)  # each column in one assignment, not one a sample
        rows = free[:count]
        for row, sample in zip(rows, admitted, strict=True):
            self._books.slots[row] = sample
            self._books.ends[row] = len(sample.prompt) - 1
            self._books.admitted[row] = next(self._books.admissions)
        dest[:count] = rows
        source[:count] = [prompt_of[prompt_key(s)] for s in admitted]
        window = self.state.rows.recent.shape[1]
        offset = np.zeros((num_rows,), np.int32)
        recent = np.full((num_rows, window), NO_TOKEN, np.int32)
        for a, sample in enumerate(admitted):
            if sample.done is not None:
                offset[a] = len(sample.done.tokens)
                if window:  # its last tokens, for the stop sequences
                    tail = sample.done.tokens[-window:]
                    recent[a, window - len(tail) :] = tail
        sample_index[:count] = [s.sample_index for s in admitted]
        budget[:count] = [s.budget for s in admitted]
        keys[:count] = [s.key_data for s in admitted]
        self._sync_pages()
        self.state = programs.start_rows(
            self.graphdef,
            self._packed,
            self.state,
            prompts,
            lengths,
            dest,
            source,
            keys,
            sample_index,
            budget,
            offset,
            recent,
        )

    def _collect(self, rows: list[int], interrupted: bool = False) -> list[Completion]:
        """Completions of ``rows`` (fetched in one gather), whose rows become free."""
        if not rows:
            return []
        index = np.zeros((bucket_rows(len(rows)),), np.int32)
        index[: len(rows)] = rows
        fetched = host_arrays(programs.take_rows(self.state.rows, index))
        tokens, logprobs, plain, versions, generated, finish = fetched
        lengths, codes = generated.tolist(), finish.tolist()  # Python ints, once
        out = []
        for i, row in enumerate(rows):
            sample, length = self._books.slots[row], lengths[i]
            assert sample is not None, f"row {row} holds no sample"  # callers pass busy rows
            code = INTERRUPTED if interrupted and codes[i] == 0 else codes[i]
            parts = (tokens[i, :length], logprobs[i, :length], plain[i, :length])
            completion, logprob, plain_logprob, version = (*parts, versions[i, :length])
            prompt, done = sample.prompt, sample.done
            if done is not None:  # the tokens it had before a preemption come first
                prompt = prompt[: len(prompt) - len(done.tokens)]
                completion, logprob, plain_logprob, version = (
                    np.concatenate([before, after])
                    for before, after in zip(
                        done, (completion, logprob, plain_logprob, version), strict=True
                    )
                )
            parked = (
                sample.hold
                and not interrupted
                and self._parks(sample._replace(prompt=prompt), code, completion)
            )
            if parked:
                history = np.concatenate([prompt, completion])
                self._books.slots[row] = sample._replace(prompt=history, done=None)
                self._books.parked[sample.request_id, sample.sample_index] = row
            else:
                self._books.slots[row] = None
                self._free_pages(row)
                self._release(sample.request_id)
            out.append(  # positional, in the field order (one is built a sample)
                Completion(
                    sample.request_id,
                    sample.sample_index,
                    prompt,
                    completion,
                    logprob,
                    plain_logprob,
                    version,
                    FINISH_REASONS[code],
                    parked,
                )
            )
        return out

    def _parks(self, sample: QueuedSample, code: int, completion: np.ndarray) -> bool:
        """Whether a finished row waits for an observation: held, stopped by a stop
        sequence (a stop token ends the episode), and with room for one observation
        token and one new token."""
        if not sample.hold or code != STOP or completion[-1] in self.config.stop_tokens:
            return False
        tail = completion.tolist()
        if not any(tail[-len(seq) :] == list(seq) for seq in self.config.stop_sequences):
            return False
        return len(sample.prompt) + len(completion) + 1 <= self.max_context_len

    # The paged cache's pages (``kv_cache="paged"``).

    def _admit(self, free: list[int]) -> list[QueuedSample]:
        """Queued samples that start now on rows ``free[:k]``, in queue order: as many as
        there are free rows and, on pages, free pages for their prompts and first chunk
        (the samples of one prompt started together share its full pages)."""
        queue = self._books.queue
        if self._pages is None:
            return [queue.popleft() for _ in range(min(len(free), len(queue)))]
        admitted: list[QueuedSample] = []
        first_row: dict[int, int] = {}  # request -> the row holding its prompt's pages
        while queue and len(admitted) < len(free):
            sample, row = queue[0], free[len(admitted)]
            share = first_row.get(sample.request_id)
            first = len(sample.prompt) - 1 + min(self.chunk_steps, sample.budget)
            cost = self._pages.start_cost(len(sample.prompt), first, share is not None)
            if cost > self._pages.free_pages:
                break
            self._pages.start(row, len(sample.prompt), first, share)
            first_row.setdefault(sample.request_id, row)
            admitted.append(queue.popleft())
        return admitted

    def _grow(self) -> None:
        """Every generating row holds the pages of its next chunk, oldest rows first; when
        the pool runs short the youngest generating row goes back to the queue."""
        waiting = set(self._waiting_rows())
        generating = sorted(
            (r for r, s in enumerate(self._books.slots) if s is not None and r not in waiting),
            key=lambda r: self._books.admitted[r],
        )
        preempted: list[int] = []
        for row in generating:
            if row in preempted:
                continue
            if not self._take_pages(row, self._chunk_slots(row), preempted):
                preempted.append(row)
        if preempted:
            self._preempt(preempted)

    def _chunk_slots(self, row: int) -> int:
        """Slots row ``row`` writes by the end of the next chunk (at most its budget's)."""
        sample = self._books.slots[row]
        assert sample is not None, f"row {row} holds no sample"
        last = len(sample.prompt) - 1 + sample.budget
        return int(min(self._books.ends[row] + self.chunk_steps, last))

    def _take_pages(self, row: int, slots: int, preempted: list[int] | None = None) -> bool:
        """Row ``row`` holds the pages of its first ``slots`` slots, younger generating
        rows preempted (added to ``preempted``) as needed. False: even that was not
        enough, and ``row`` itself must go."""
        assert self._pages is not None
        preempted = [] if preempted is None else preempted
        waiting = set(self._waiting_rows())
        while self._pages.grow_cost(row, slots) > self._pages.free_pages:
            younger = [
                r
                for r, s in enumerate(self._books.slots)
                if s is not None
                and r not in waiting
                and r not in preempted
                and self._books.admitted[r] > self._books.admitted[row]
            ]
            if not younger:
                return False
            victim = max(younger, key=lambda r: self._books.admitted[r])
            self._pages.free(victim)
            preempted.append(victim)
        self._pages.grow(row, slots)
        return True

    def _preempt(self, rows: list[int]) -> None:
        """Rows ``rows`` stop and their samples go back to the front of the queue, oldest
        first, their pages free. A sample keeps the tokens it has (with their log-probs
        and versions): it goes on later from its prompt and those tokens, prefilled
        again, with the keys of its next tokens."""
        taken = np.zeros((bucket_rows(len(rows)),), np.int32)
        taken[: len(rows)] = rows
        fetched = host_arrays(programs.take_rows(self.state.rows, taken))
        tokens, logprobs, plain, versions, generated, _ = fetched
        order = sorted(range(len(rows)), key=lambda i: -self._books.admitted[rows[i]])
        for i in order:
            row, length = rows[i], int(generated[i])
            sample = self._books.slots[row]
            assert sample is not None, f"row {row} holds no sample"
            self._books.slots[row] = None
            self._free_pages(row)
            if length:
                kept = KeptTokens(
                    tokens[i, :length], logprobs[i, :length], plain[i, :length],
                    versions[i, :length],
                )  # fmt: skip
                if sample.done is not None:
                    kept = KeptTokens(
                        *(np.concatenate(pair) for pair in zip(sample.done, kept, strict=True))
                    )
                sample = sample._replace(
                    prompt=np.concatenate([sample.prompt, tokens[i, :length]]),
                    budget=sample.budget - length,
                    done=kept,
                )
            self._books.queue.appendleft(sample)
            self.preemptions += 1
        index = np.full((len(taken),), self.num_slots, np.int32)
        index[: len(rows)] = rows
        self._sync_pages()
        self.state = programs.release_rows(self.state, index)

    def _free_pages(self, row: int) -> None:
        if self._pages is not None:
            self._pages.free(row)

    def _sync_pages(self) -> None:
        """The device's page table is the host's (before a program reads the cache)."""
        if self._pages is None or not self._pages.dirty:
            return
        table = jax.device_put(self._pages.table.copy(), self._device)
        cache = dataclasses.replace(self.state.cache, page_table=table)
        self.state = dataclasses.replace(self.state, cache=cache)
        self._pages.dirty = False

    @property
    def pages_in_use(self) -> int:
        """Pages rows hold now (0 on a dense cache)."""
        return 0 if self._pages is None else self._pages.pool.used_pages
