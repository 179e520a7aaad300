"""``generate`` splits its rows into batches that decode side by side (``chunks``): the
same tokens as one batch, log-probs to a float32 ulp or two, every row placed once, and
``compile_generate`` compiles what a chunked call runs."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_decode_views import assert_same

from rlaxkit.inference import SamplingConfig, compile_generate, generate
from rlaxkit.inference import chunks as chunk_module
from rlaxkit.inference.chunks import ChunkLayout
from rlaxkit.util.jaxutil import count_compilations

# Ragged prompts and budgets, a stop token: rows end at different steps in every chunk.
PROMPTS = [[1, 7, 9], [4], [2, 2, 8, 31, 5, 6, 7, 60], [11, 3], [9, 9, 9, 9, 9], [40], [3, 33]]
BUDGETS = [12, 3, 7, 12, 1, 5, 9]


@pytest.mark.parametrize("n", [1, 3])
def test_chunks_sample_what_one_batch_samples(tiny_model, n):
    config = SamplingConfig(temperature=1.0, max_new_tokens=12, n=n, stop_tokens=(5,))
    one = generate(tiny_model, PROMPTS, config, 3, max_new_tokens=BUDGETS, chunks=1)
    assert one.tokens.shape == (7, n, 12)
    # 2: a prompt's samples split across chunks when n = 3; 7 * n: one row a chunk.
    for chunks in (2, 3, 7 * n):
        split = generate(tiny_model, PROMPTS, config, 3, max_new_tokens=BUDGETS, chunks=chunks)
        assert_same(split, one)
        assert all(np.array_equal(p, q) for p, q in zip(split.prompts, one.prompts, strict=True))


@settings(max_examples=200, deadline=None)
@given(
    num_prompts=st.integers(1, 40),
    n=st.integers(1, 6),
    chunks=st.integers(1, 12),
    seed=st.integers(0, 99),
)
def test_every_row_is_placed_once_with_its_prompt_and_sample(num_prompts, n, chunks, seed):
    rng = np.random.RandomState(seed)
    prompts = [rng.randint(1, 50, rng.randint(1, 6)).astype(np.int32) for _ in range(num_prompts)]
    layout = ChunkLayout.of(num_prompts, n, chunks)
    assert layout.rows & (layout.rows - 1) == 0 and layout.prompts & (layout.prompts - 1) == 0
    # Padding at most doubles the rows, as for one batch.
    assert layout.rows * len(layout.chunks) <= 2 * num_prompts * n
    assert len(layout.chunks) <= chunks
    seen = []
    for start, stop in layout.chunks:
        assert 0 < stop - start <= layout.rows
        tokens, lengths, dest, source, prompt, sample = layout.inputs((start, stop), prompts, 8)
        assert tokens.shape == (layout.prompts, 8) and dest.shape == (layout.rows,)
        real = dest < layout.rows
        assert real.sum() == stop - start and (dest[~real] == layout.rows).all()
        assert sorted(dest[real]) == list(range(stop - start))
        for r in np.flatnonzero(real):
            row = start + dest[r]
            seen.append(row)
            assert prompt[r] == row // n and sample[r] == row % n
            # The row prefills its own prompt from the chunk's prompt table.
            assert lengths[source[r]] == len(prompts[row // n])
            np.testing.assert_array_equal(
                tokens[source[r], : lengths[source[r]]], prompts[row // n]
            )
        assert (source >= 0).all() and (source < layout.prompts).all()
    assert sorted(seen) == list(range(num_prompts * n))


def test_default_is_one_chunk_a_core_on_cpu_and_one_elsewhere(monkeypatch):
    default = chunk_module.default_chunks
    monkeypatch.setattr(chunk_module, "_cores", lambda: 2)
    assert [default(r) for r in (1, 8, 15, 16, 64, 4096)] == [1, 1, 1, 2, 2, 2]
    monkeypatch.setattr(chunk_module, "_cores", lambda: 3)
    assert default(64) == 2  # a power of two: the chunks split a padded batch evenly
    monkeypatch.setattr(chunk_module, "_cores", lambda: 16)
    assert [default(r) for r in (16, 64, 4096)] == [2, 8, 16]
    monkeypatch.setattr(chunk_module.jax, "default_backend", lambda: "gpu")
    assert default(4096) == 1


def test_compile_generate_covers_a_chunked_call(tiny_model, no_persistent_cache):
    config = SamplingConfig(temperature=1.0, max_new_tokens=8, n=2)
    for thread in compile_generate(tiny_model, config, 7, 8, chunks=2):
        thread.join()
    with count_compilations() as compiles:
        result = generate(tiny_model, PROMPTS, config, 0, chunks=2)
    assert compiles.count == 0
    assert result.tokens.shape == (7, 2, 8)


@pytest.mark.parametrize("chunks", [0, -1, 1.5, "2"])
def test_bad_chunks_are_refused(tiny_model, chunks):
    with pytest.raises((ValueError, TypeError), match="chunks"):
        generate(tiny_model, PROMPTS, SamplingConfig(max_new_tokens=4), 0, chunks=chunks)


def test_chunks_run_side_by_side_on_helper_threads_that_later_calls_reuse():
    import threading

    chunks = [(0, 1), (1, 2), (2, 3)]
    barrier = threading.Barrier(len(chunks), timeout=30)

    def run(chunk, fail=None):
        barrier.wait()  # passes only once every chunk runs at the same time
        if chunk == fail:
            raise KeyError(f"chunk {chunk}")
        return chunk

    assert chunk_module.run_chunks(run, chunks) == chunks
    threads = threading.active_count()
    barrier.reset()
    with pytest.raises(KeyError, match=r"chunk \(1, 2\)"):
        chunk_module.run_chunks(lambda chunk: run(chunk, fail=(1, 2)), chunks)
    barrier.reset()
    assert chunk_module.run_chunks(run, chunks) == chunks
    assert threading.active_count() == threads  # the helpers of the first call, again
    assert chunk_module.run_chunks(lambda chunk: chunk, [(0, 4)]) == [(0, 4)]


def test_calls_side_by_side_take_helpers_of_their_own():
    # Two callers' chunks all run at once: a helper busy with one call's chunk is not
    # handed another's, which would wait behind it.
    import threading

    chunks = [(0, 1), (1, 2)]
    barrier = threading.Barrier(2 * len(chunks), timeout=30)
    results = []

    def call():
        results.append(chunk_module.run_chunks(lambda chunk: (barrier.wait(), chunk)[1], chunks))

    callers = [threading.Thread(target=call) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=60)
    assert results == [chunks, chunks]


def test_a_helper_is_idle_again_when_its_chunk_ends_not_when_the_caller_returns():
    # So a caller interrupted while it waits for its helpers (Ctrl-C in a notebook) does
    # not keep them out of use: each puts itself back once its chunk is done.
    import threading
    import time

    ended = threading.Event()
    seen = []

    def run(chunk):
        if chunk == (1, 2):  # on a helper
            seen.append(threading.current_thread())
            ended.set()
            return chunk
        assert ended.wait(timeout=30)  # the caller's chunk, still running
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with chunk_module._idle_lock:
                idle = [helper for helper in chunk_module._idle if helper.thread is seen[0]]
            if idle:
                return chunk
            time.sleep(0.001)
        raise AssertionError("the helper was not idle while its caller still ran")

    assert chunk_module.run_chunks(run, [(0, 1), (1, 2)]) == [(0, 1), (1, 2)]


def test_a_forked_child_runs_chunks_on_helpers_of_its_own():
    # The parent's helper threads do not exist in a forked child: it starts its own.
    import os
    import signal
    import warnings

    chunk_module.run_chunks(lambda chunk: chunk, [(0, 1), (1, 2)])  # the parent has helpers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # JAX warns that a multithreaded process forks
        pid = os.fork()
    if pid == 0:  # the child: exit 0 only if both chunks ran, killed if it hangs
        signal.alarm(30)
        ok = chunk_module.run_chunks(lambda chunk: chunk, [(0, 1), (1, 2)]) == [(0, 1), (1, 2)]
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
