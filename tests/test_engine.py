"""The continuous-batching engine: same completions as static batching, refills without
recompiling, interruptible generation with per-token versions (keep or recompute the KV
cache), abort."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlaxkit.inference import InferenceEngine, SamplingConfig, generate
from rlaxkit.inference.results import packed
from rlaxkit.models import ModelConfig, abstract_model, relayout
from rlaxkit.trainer.logprobs import token_logprobs
from rlaxkit.util.jaxutil import count_compilations

VOCAB = 64
CONFIG = SamplingConfig(temperature=1.0, max_new_tokens=16)


def peaked_model(seed=0):
    """A tiny Qwen3-shaped model with N(0, 0.3^2) weights: far from flat distributions."""
    config = ModelConfig(
        family="qwen3",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
    )
    model = abstract_model(config)
    rng = np.random.RandomState(seed)
    flat = [
        (path, (1.0 if "norm" in str(path[-2]) else 0.0) + 0.3 * rng.standard_normal(x.shape))
        for path, x in nnx.to_flat_state(nnx.state(model, nnx.Param))
    ]
    nnx.update(model, nnx.from_flat_state([(p, jnp.asarray(v, jnp.float32)) for p, v in flat]))
    return model


@pytest.fixture(scope="module")
def models():
    return [peaked_model(seed) for seed in range(3)]


def workload(count, seed=0):
    """Ragged prompts, per-request keys and long-tailed budgets (most short, a few long)."""
    rng = np.random.RandomState(seed)
    prompts = [rng.randint(0, VOCAB, rng.randint(1, 17)).tolist() for _ in range(count)]
    keys = [jax.random.key(1000 * seed + i) for i in range(count)]
    budgets = np.minimum(1 + rng.pareto(1.2, count) * 3, 16).astype(int).tolist()
    return prompts, keys, budgets


@functools.partial(nnx.jit, static_argnames=("width",))
def _trainer_logprobs(model, tokens, length, temperature, width):
    positions = jnp.arange(width)[None]
    return token_logprobs(model, tokens[None], positions, positions < length, temperature)[0]


def trainer_logprobs(model, prompt, completion, temperature=1.0):
    """``token_logprobs`` of the completion given the prompt (padded to 32 tokens)."""
    sequence = np.zeros(32, np.int32)
    full = np.concatenate([prompt, completion])
    sequence[: len(full)] = full
    out = _trainer_logprobs(model, sequence, len(full), np.float32(temperature), width=32)
    return np.asarray(out)[len(prompt) : len(full)]


def assert_same(completion, expected):
    assert completion.tokens.tolist() == expected.tokens.tolist()
    assert completion.finish_reason == expected.finish_reason
    np.testing.assert_array_equal(completion.versions, expected.versions)
    np.testing.assert_allclose(completion.logprobs, expected.logprobs, atol=1e-5, rtol=0)
    np.testing.assert_allclose(completion.plain_logprobs, expected.plain_logprobs, atol=1e-5)


def test_continuous_batching_equals_static_batching(models):
    model = models[0]
    config = dataclasses.replace(CONFIG, n=2, stop_tokens=(3, 11))
    prompts, keys, budgets = workload(10)
    static = generate(model, prompts, config, keys, max_new_tokens=budgets)
    engine = InferenceEngine(model, config, num_slots=4, max_prompt_len=16, chunk_steps=4)
    for prompt, key, budget in zip(prompts, keys, budgets, strict=True):
        engine.submit(prompt, key, max_new_tokens=budget)
    completions = engine.run()
    assert engine.idle and len(completions) == 20  # 20 samples through 4 rows: refilled
    assert {c.finish_reason for c in completions} == {"stop", "length"}
    for c in completions:
        assert_same(c, static.completion(c.request_id, c.sample_index))

    # Slot placement does not matter: reversed submission order, other chunk boundaries.
    engine = InferenceEngine(model, config, num_slots=4, max_prompt_len=16, chunk_steps=3)
    for i in reversed(range(10)):
        engine.submit(prompts[i], keys[i], max_new_tokens=budgets[i], request_id=i)
    for c in engine.run():
        assert_same(c, static.completion(c.request_id, c.sample_index))


def test_engines_launched_together_give_the_completions_of_separate_runs(models):
    # The local runtime dispatches a worker's chunk before it is done with the previous
    # worker's: two engines stepped with their launches and finishes interleaved give
    # exactly what each gives alone, chunk by chunk.
    config = dataclasses.replace(CONFIG, n=2, stop_tokens=(3, 11))
    prompts, keys, budgets = workload(8, seed=2)

    def engines():
        out = []
        for model in models[:2]:
            engine = InferenceEngine(model, config, num_slots=4, max_prompt_len=16, chunk_steps=3)
            for prompt, key, budget in zip(prompts, keys, budgets, strict=True):
                engine.submit(prompt, key, max_new_tokens=budget)
            out.append(engine)
        return out

    alone = []
    for engine in engines():
        alone.append([])
        while not engine.idle:
            alone[-1].append(engine.step())
    together, pair = [[], []], engines()
    while not all(engine.idle for engine in pair):
        launched = [engine.launch() for engine in pair]
        for chunks, engine, ran in zip(together, pair, launched, strict=True):
            if ran:
                chunks.append(engine.finish())
            else:
                assert engine.finish() == []
    for serial, interleaved in zip(alone, together, strict=True):
        assert [len(c) for c in serial] == [len(c) for c in interleaved]
        for a, b in zip(sum(serial, []), sum(interleaved, []), strict=True):
            assert (a.request_id, a.sample_index) == (b.request_id, b.sample_index)
            assert_same(b, a)
    assert pair[0].finish() == []  # nothing launched: nothing to wait on


def test_no_recompilation_on_a_second_workload(models):
    """Same bucket schedule (lengths set by budgets alone), new prompts, keys and weights."""
    prompts, keys, budgets = workload(12, seed=1)

    def run(model, prompts, keys):
        engine = InferenceEngine(model, CONFIG, num_slots=4, max_prompt_len=16, chunk_steps=4)
        for prompt, key, budget in zip(prompts, keys, budgets, strict=True):
            engine.submit(prompt, key, max_new_tokens=budget)
        return engine.run()

    run(models[0], prompts, keys)
    rng = np.random.RandomState(5)
    other_prompts = [rng.randint(0, VOCAB, len(p)).tolist() for p in prompts]
    with count_compilations() as compiles:
        out = run(models[1], other_prompts, [jax.random.key(i + 50) for i in range(12)])
    assert compiles.count == 0
    assert [c.num_tokens for c in out] == budgets


def interrupted_run(models, recompute_cache, new_weights=(1, 2), **options):
    """4 requests on 4 rows, chunks of 5 steps; weights change after each of the first two
    chunks (to ``models[v]`` with version ``v``). ``options`` go to the engine."""
    prompts, keys, _ = workload(4, seed=2)
    engine = InferenceEngine(
        models[0], CONFIG, num_slots=4, max_prompt_len=16, chunk_steps=5, **options
    )
    for prompt, key in zip(prompts, keys, strict=True):
        engine.submit(prompt, key)
    done = engine.step()
    for version in new_weights:
        engine.update_weights(models[version], version, recompute_cache=recompute_cache)
        done += engine.step()
    done += engine.run()
    return prompts, keys, sorted(done, key=lambda c: c.request_id)


@pytest.mark.parametrize("recompute_cache", [False, True])
def test_interrupted_generation_records_the_version_of_every_token(models, recompute_cache):
    prompts, keys, done = interrupted_run(models, recompute_cache)
    before = generate(models[0], prompts, CONFIG, keys)
    for c in done:
        assert c.versions.tolist() == [0] * 5 + [1] * 5 + [2] * 6
        assert c.finish_reason == "length"
        # Tokens of the first chunk are those of an uninterrupted run with version 0.
        assert c.tokens[:5].tolist() == before.tokens[c.request_id, 0, :5].tolist()
        # Each token's log-prob is the trainer's under the weights that produced it; with
        # the kept cache that holds for version 0 only (later tokens saw stale keys).
        for version in (0, 1, 2):
            at = c.versions == version
            expected = trainer_logprobs(models[version], c.prompt_tokens, c.tokens)[at]
            if recompute_cache or version == 0:
                np.testing.assert_allclose(c.logprobs[at], expected, atol=1e-5, rtol=0)
            else:
                assert np.abs(c.logprobs[at] - expected).max() > 1e-3


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_stacked_blocks_decode_in_one_scan_as_per_layer_blocks(models, kv_cache):
    # Stacked blocks (``scan_layers``) prefill, decode and rebuild a stacked dense cache in
    # one layer scan each, and a paged cache with its per-layer pools: the tokens of the
    # per-layer model, the log-probs to float32 rounding.
    stacked = [relayout(model, scan_layers=True) for model in models]
    prompts, keys, _ = workload(4, seed=2)
    np.testing.assert_array_equal(
        generate(stacked[0], prompts, CONFIG, keys).tokens,
        generate(models[0], prompts, CONFIG, keys).tokens,
    )
    options = {"kv_cache": kv_cache} | ({"page_size": 4} if kv_cache == "paged" else {})
    got = interrupted_run(stacked, recompute_cache=True, **options)[2]
    want = interrupted_run(models, recompute_cache=True, **options)[2]
    for completion, expected in zip(got, want, strict=True):
        assert_same(completion, expected)


@pytest.mark.parametrize("recompute_cache", [False, True])
def test_a_version_bump_with_the_same_weights_changes_no_token(models, recompute_cache):
    prompts, keys, done = interrupted_run(
        [models[0]] * 3, recompute_cache=recompute_cache, new_weights=(1, 2)
    )
    uninterrupted = generate(models[0], prompts, CONFIG, keys)
    for c in done:
        expected = uninterrupted.completion(c.request_id)
        assert c.tokens.tolist() == expected.tokens.tolist()
        np.testing.assert_allclose(c.logprobs, expected.logprobs, atol=1e-5, rtol=0)


def test_weights_from_a_source_between_chunks(models):
    prompts, keys, _ = workload(3, seed=3)
    engine = InferenceEngine(models[0], CONFIG, num_slots=4, max_prompt_len=16, chunk_steps=4)
    for prompt, key in zip(prompts, keys, strict=True):
        engine.submit(prompt, key)
    pushes = iter([None, (models[1], 1), None, (nnx.state(models[2]), 2)])
    done = engine.run(lambda: next(pushes, None), recompute_cache=True)
    for c in done:
        assert c.versions.tolist() == [0] * 4 + [1] * 8 + [2] * 4


def test_abort_returns_partial_completions_and_the_engine_goes_on(models):
    prompts, keys, _ = workload(6, seed=4)
    engine = InferenceEngine(models[0], CONFIG, num_slots=4, max_prompt_len=16, chunk_steps=3)
    for prompt, key in zip(prompts, keys, strict=True):
        engine.submit(prompt, key)
    assert engine.step() == []
    partial = engine.abort()
    assert engine.idle and len(partial) == 4
    full = generate(models[0], prompts, CONFIG, keys)
    for c in partial:
        assert c.finish_reason == "interrupted" and c.num_tokens == 3
        assert c.tokens.tolist() == full.tokens[c.request_id, 0, :3].tolist()
    engine.submit(prompts[5], keys[5], request_id=5)
    (again,) = engine.run()
    assert_same(again, full.completion(5))


def test_bad_requests_and_weights_fail_loudly(models):
    engine = InferenceEngine(models[0], CONFIG, num_slots=2, max_prompt_len=16)
    with pytest.raises(ValueError, match="exceeds max_prompt_len"):
        engine.submit(list(range(17)), 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.submit([1, 2], 0, max_new_tokens=17)
    assert engine.submit([1, 2], 0, request_id=1) == 1
    assert engine.submit([3], 0) == 0 and engine.submit([4], 0) == 2  # unused ids
    with pytest.raises(ValueError, match="request 1 is already queued"):
        engine.submit([1, 2], 0, request_id=1)
    other = abstract_model(dataclasses.replace(models[0].config, num_layers=1))
    with pytest.raises(ValueError, match="architecture"):
        engine.update_weights(other, 1)
    with pytest.raises(ValueError, match="structure"):
        engine.update_weights(nnx.state(other), 1)
    halved = jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(models[1]))
    with pytest.raises(ValueError, match=r"embed_tokens.*is bfloat16\[64, 32\], expected float32"):
        engine.update_weights(halved, 1)
    # Packed weights (a pytree flattened once) are taken too; the engine keeps the tree.
    engine.update_weights(packed(nnx.state(models[1])), 1)
    assert isinstance(engine.params, nnx.State) and engine.version == 1
    with pytest.raises(ValueError, match="num_slots"):
        InferenceEngine(models[0], CONFIG, num_slots=0, max_prompt_len=16)


def test_committed_weights_compile_each_program_once(models, no_persistent_cache):
    """Weights pulled onto a device are committed, as every program's output is: the
    engine's first state is committed there too, so the first refill's program is the
    later refills' (else an uncommitted first state keys a second one)."""
    graphdef, params = nnx.split(models[0])
    params = jax.device_put(params, jax.devices()[0])
    engine = InferenceEngine((graphdef, params), CONFIG, num_slots=4, max_prompt_len=16)
    engine.submit([1, 2, 3], jax.random.key(0), max_new_tokens=4)
    engine.run()
    with count_compilations() as compiles:
        engine.submit([4, 5, 6], jax.random.key(1), max_new_tokens=4)
        (completion,) = engine.run()
    assert compiles.count == 0 and completion.num_tokens == 4


def test_a_compiled_rebuild_is_not_compiled_again_by_the_first_pull_in_flight(
    models, no_persistent_cache
):
    """A worker that pulls in flight compiles the cache rebuild when it starts
    (``compile_rebuild``); its first rebuild then compiles nothing, and the completions
    are those of an engine that compiled the rebuild on the spot (row counts no other
    test of this module uses: neither reuses another's program)."""
    prompts, keys, _ = workload(3, seed=5)
    done = []
    for ahead, slots in ((False, 7), (True, 6)):
        engine = InferenceEngine(
            models[0], CONFIG, num_slots=slots, max_prompt_len=16, chunk_steps=4,
            compile_rebuild=ahead,
        )  # fmt: skip
        for prompt, key in zip(prompts, keys, strict=True):
            engine.submit(prompt, key)
        engine.step()
        with count_compilations() as compiles:
            engine.update_weights(models[1], 1, recompute_cache=True)
        assert compiles.count == (0 if ahead else 1)
        done.append(sorted(engine.run(), key=lambda c: c.request_id))
    for a, b in zip(*done, strict=True):
        assert_same(a, b)


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_cancel_frees_a_running_row_between_chunks_and_the_others_go_on(models, kv_cache):
    """``cancel`` drops a request whatever state its samples are in; a running row is
    freed at once for the next queued sample, and the rows it did not touch produce what
    they would have."""
    prompts, keys, _ = workload(4, seed=6)
    full = generate(models[0], prompts, CONFIG, keys)
    engine = InferenceEngine(
        models[0], CONFIG, num_slots=2, max_prompt_len=16, chunk_steps=2, kv_cache=kv_cache
    )
    for i, (prompt, key) in enumerate(zip(prompts, keys, strict=True)):
        engine.submit(prompt, key, request_id=i)
    assert engine.step() == []  # 0 and 1 run (16 tokens each, no stop token); 2, 3 wait
    assert engine.num_running == 2 and engine.num_queued == 2
    assert engine.cancel(1) == 1 and engine.num_running == 1  # its row is free
    assert engine.cancel(3) == 0 and engine.num_queued == 1  # queued: gone
    done = engine.run()
    assert sorted(c.request_id for c in done) == [0, 2]
    for c in done:
        assert_same(c, full.completion(c.request_id))
    assert engine.idle and engine.cancel(0) == 0 and engine.pages_in_use == 0
