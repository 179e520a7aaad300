"""How ``generate`` splits a batch into batches that decode side by side, one thread each.

On XLA:CPU a decode program at small sizes (tens of rows, a hidden width of hundreds)
keeps about one core busy: its ops run one after another and each is too small to
spread. Batches of the same shape, each decoding in a thread of its own, use the other
cores: on two cores a 64-row decode of 128 tokens ran 2.2x faster as two batches of 32
(``docs/performance.md``, "Decode in batches side by side"). Each prompt's key and each
sample's index travel with its row, so a row samples the same tokens in any batch.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
import numpy as np

from rlaxkit.inference.config import bucket_rows
from rlaxkit.rules.validation import check_int

T = TypeVar("T")

# Below this a batch's decode is mostly fixed cost per step: two batches of 8 rows still
# ran a 16-row decode faster than one, four of 4 did not.
MIN_CHUNK_ROWS = 8


def default_chunks(num_rows: int) -> int:
    """How many batches ``generate`` splits ``num_rows`` rows into by default: on a CPU
    backend one per core the process may run on, rounded down to a power of two, while
    each keeps at least ``MIN_CHUNK_ROWS`` rows; on an accelerator one, which runs a
    whole batch's ops wide.
    """
    if jax.default_backend() != "cpu":
        return 1
    count = max(1, min(_cores(), num_rows // MIN_CHUNK_ROWS))
    return 1 << (count.bit_length() - 1)


@dataclass(frozen=True)
class ChunkLayout:
    """How ``generate`` splits a batch's ``B * n`` rows (row ``i * n + j`` is sample ``j``
    of prompt ``i``) into batches that decode side by side.

    Attributes:
        chunks: ``[start, stop)`` row ranges, consecutive, covering every row once.
        rows: every chunk's rows, padded (a power of two).
        prompts: every chunk's prompts, padded (a power of two): a chunk prefills the
            prompts its rows sample from. Every chunk has the same shapes, so all run
            one set of programs.
        n: samples per prompt.
    """

    chunks: tuple[tuple[int, int], ...]
    rows: int
    prompts: int
    n: int

    @classmethod
    def of(cls, num_prompts: int, n: int, chunks: int | None = None) -> ChunkLayout:
        """``chunks`` batches (default ``default_chunks``) of at most ``ceil(B * n /
        chunks)`` rows; fewer where the rows run out."""
        num_rows = num_prompts * n
        if chunks is None:
            chunks = default_chunks(num_rows)
        check_int("chunks", chunks, minimum=1, numpy=True)
        size = -(-num_rows // min(int(chunks), num_rows))
        ranges = tuple((a, min(a + size, num_rows)) for a in range(0, num_rows, size))
        prompts = max((stop - 1) // n - start // n + 1 for start, stop in ranges)
        return cls(ranges, bucket_rows(size), bucket_rows(prompts), n)

    def inputs(
        self, chunk: tuple[int, int], prompts: list[np.ndarray], width: int
    ) -> tuple[np.ndarray, ...]:
        """One chunk's prefill inputs: its prompts ``[self.prompts, width]`` and their
        lengths, and per row its destination (``self.rows`` for padding, dropped), the
        index of its prompt in the chunk and in ``prompts``, and its sample index."""
        start, stop = chunk
        n = self.n
        first, last = start // n, (stop - 1) // n
        tokens = np.zeros((self.prompts, width), np.int32)
        lengths = np.ones((self.prompts,), np.int32)
        for i, prompt in enumerate(prompts[first : last + 1]):
            tokens[i, : len(prompt)] = prompt
            lengths[i] = len(prompt)
        row = start + np.arange(self.rows)
        dest = np.where(row < stop, row - start, self.rows).astype(np.int32)
        prompt_index = np.minimum(row // n, last)  # padding rows repeat the last prompt
        return (
            tokens,
            lengths,
            dest,
            (prompt_index - first).astype(np.int32),
            prompt_index,
            (row % n).astype(np.int32),
        )


# The name of ``run_chunks``' helper threads: daemon threads that wait for work for
# the life of the process (a program that joins its threads before exiting skips them).
HELPER_THREAD_NAME = "generate-helper"


class _Helper:
    """A daemon thread that runs the jobs put to it, one after another."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=HELPER_THREAD_NAME, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            self.jobs.get()()


# Helpers not running a chunk. A forked child has none of its parent's threads.
_idle: list[_Helper] = []
_idle_lock = threading.Lock()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_idle.clear)


def run_chunks(run: Callable[[tuple[int, int]], T], chunks: Sequence[tuple[int, int]]) -> list[T]:
    """``[run(chunk) for chunk in chunks]``, side by side: the first chunk in this thread,
    each other one in a helper thread of its own, and every chunk done before this
    returns. Helpers are kept for later calls (calls side by side take different ones):
    a fresh thread's start held the calling thread for about 0.7 ms of a 12 ms small
    GRPO sampling, as the new thread took the GIL until its first program ran. An
    error raised in a chunk (the first chunk's, if several) is raised here, after every
    chunk has ended."""
    results: list[Any] = [None] * len(chunks)
    errors: dict[int, BaseException] = {}

    def target(i: int) -> None:
        try:
            results[i] = run(chunks[i])
        except BaseException as error:  # re-raised in the caller's thread
            errors[i] = error

    def job(i: int, helper: _Helper, done: threading.Event) -> None:
        target(i)
        # Idle again as its chunk ends, not when the caller returns: a caller interrupted
        # while it waits (Ctrl-C in a notebook) does not keep its helpers out of use.
        with _idle_lock:
            _idle.append(helper)
        done.set()

    with _idle_lock:
        taken = [_idle.pop() for _ in range(min(len(_idle), len(chunks) - 1))]
    helpers = taken + [_Helper() for _ in range(len(chunks) - 1 - len(taken))]
    finished = [threading.Event() for _ in helpers]
    for i, (helper, done) in enumerate(zip(helpers, finished, strict=True), start=1):
        helper.jobs.put(functools.partial(job, i, helper, done))
    target(0)
    for done in finished:
        done.wait()
    if errors:
        raise errors[min(errors)]
    return results


def _cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
