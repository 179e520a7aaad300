"""``generate`` decodes in growing cache prefixes (views): the same tokens, log-probs and
cache as decoding over the whole cache, and ``compile_generate`` covers every view. The
continuous-batching engine decodes each chunk on the shortest view that holds it: the
chunks and tokens of the whole cache, in a run too (``runtime.cache_views``)."""

import dataclasses
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from rlaxkit.inference import SamplingConfig, compile_generate, generate, programs
from rlaxkit.inference.engine import engine_views
from rlaxkit.inference.results import key_data, split_model
from rlaxkit.util.jaxutil import count_compilations

generate_module = sys.modules["rlaxkit.inference.generate"]

# Prompt width 16 + 112 new tokens: 128 slots, views 32, 64 and 128.
CONFIG = SamplingConfig(temperature=1.0, max_new_tokens=112)


def prompts(lengths, seed=0, vocab=64):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, vocab, n).tolist() for n in lengths]


def without_views(monkeypatch, *args, **kwargs):
    """``generate`` over the whole cache in one program."""
    with monkeypatch.context() as patch:
        patch.setattr(generate_module, "decode_views", lambda width, slots: (slots,))
        return generate(*args, **kwargs)


def assert_same(a, b):
    """Equal tokens; log-probs equal to a few float32 ulps (a view's softmax sums the
    same terms as the whole cache's, the masked slots' exact zeros left out, so XLA may
    add them in another order)."""
    for field in ("tokens", "versions", "mask", "lengths"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
    for field in ("logprobs", "plain_logprobs"):
        np.testing.assert_allclose(
            getattr(a, field), getattr(b, field), rtol=1e-6, atol=1e-6, err_msg=field
        )
    assert a.finish_reasons == b.finish_reasons


def test_views_are_powers_of_two_then_the_cache_for_long_decodes():
    views = generate_module.decode_views
    assert views(16, 32) == (32,)  # the small GRPO shape (16 new tokens): one program
    assert views(16, 48) == (48,)  # 32 new tokens: one program
    assert views(16, 144) == (32, 64, 128, 144)
    assert views(64, 192) == (64, 128, 192)  # every prompt fills more than 32 slots
    # 4-token prompts, 128 new tokens: the 128-slot view would leave a 4-step segment.
    assert views(4, 132) == (32, 64, 132)


def test_engine_views_are_eighths_of_the_cache():
    assert engine_views(16, 24) == (24,)  # the demo's 8 new tokens: one program
    assert engine_views(16, 128) == (16, 32, 48, 64, 80, 96, 112, 128)
    assert engine_views(64, 576) == (80, 160, 240, 320, 400, 480, 560, 576)
    assert engine_views(16, 144) == (32, 64, 96, 128, 144)  # 144 / 8 = 18 slots, rounded up to 32
    assert engine_views(512, 16896)[:2] == (2112, 4224) and len(engine_views(512, 16896)) == 8


def test_short_prompts_padded_to_their_own_width_sample_the_same(tiny_model):
    """``min_prompt_width=4`` pads 4-token prompts to 4, not 16: the same tokens,
    log-probs to a few ulps (the cache has 12 fewer masked slots per row)."""
    model = nnx.split(tiny_model)
    config = dataclasses.replace(CONFIG, n=2, max_new_tokens=16)
    batch = prompts([4, 3, 4], seed=11)
    narrow = generate(model, batch, config, 7, version=1, min_prompt_width=4)
    assert_same(narrow, generate(model, batch, config, 7, version=1))
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="min_prompt_width: must be an integer >= 1"):
            generate(model, batch, config, 7, min_prompt_width=bad)


@pytest.mark.parametrize(
    ("config", "lengths", "budget"),
    [
        # Ragged prompts, 2 samples each, every row spanning all three views.
        (dataclasses.replace(CONFIG, n=2), [1, 5, 16], None),
        # Per-prompt budgets: the 9-token rows stop inside the first view.
        (CONFIG, [3, 16, 7, 12], [112, 9, 60, 9]),
        # Budgets that all end inside the first view: one segment runs.
        (CONFIG, [2, 4], [10, 20]),
        # Stop tokens end rows at different steps (each of 3 ids ends about 5% of steps).
        (dataclasses.replace(CONFIG, n=3, stop_tokens=(3, 17, 40)), [6, 16], None),
    ],
)
def test_generate_with_views_equals_the_whole_cache(
    tiny_model, monkeypatch, config, lengths, budget
):
    model = nnx.split(tiny_model)
    batch = prompts(lengths, seed=len(lengths))
    viewed = generate(model, batch, config, 5, version=3, max_new_tokens=budget)
    whole = without_views(monkeypatch, model, batch, config, 5, version=3, max_new_tokens=budget)
    assert_same(viewed, whole)
    expected = budget if budget is not None else [config.max_new_tokens] * len(lengths)
    if not config.stop_tokens:
        np.testing.assert_array_equal(viewed.lengths, np.repeat([expected], config.n, 0).T)
    else:
        assert viewed.lengths.min() < config.max_new_tokens  # some row stopped early


def test_decode_steps_in_views_leave_the_state_of_the_whole_cache(tiny_model):
    """Including a stopped row whose cache reaches past the first view (its slots are
    kept, as a row waiting for an observation needs)."""
    graphdef, params = split_model(tiny_model)
    config = CONFIG

    def start(state, tokens, dest, budget):
        width = 16
        padded = np.zeros((len(tokens), width), np.int32)
        for i, t in enumerate(tokens):
            padded[i, : len(t)] = t
        dest = np.asarray(dest, np.int32)
        return programs.start_rows(
            graphdef,
            params,
            state,
            padded,
            np.asarray([len(t) for t in tokens], np.int32),
            dest,
            np.arange(len(dest), dtype=np.int32),
            np.stack([key_data(int(d) + 1) for d in dest]),
            np.zeros(len(dest), np.int32),
            np.asarray(budget, np.int32),
        )

    def run(views):
        state = programs.init_state(tiny_model.config, config, 4, 16)
        # Row 1 decodes 40 tokens and stops with its cache end at slot 51.
        state = start(state, prompts([12], seed=1), [1], [40])
        state, _ = programs.decode_steps(graphdef, params, state, 0, 112, 5, config=config)
        assert int(state.cache.end[1]) == 51 and not bool(state.rows.active[1])
        state = start(state, prompts([16, 2], seed=2), [0, 2], [112, 50])
        for view in views:
            before = int(state.cache.end[0])
            state, steps = programs.decode_steps(
                graphdef, params, state, 1, 112, 5, config=config, view=view
            )
            if view is not None:
                # Row 0, the furthest along, stops when its next write would leave the view.
                assert int(state.cache.end[0]) == view and int(steps) == view - before
        return state

    viewed, whole = run([32, 64, None]), run([None])

    def plain(x):
        return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x

    for a, b in zip(jax.tree.leaves(viewed), jax.tree.leaves(whole), strict=True):
        a, b = np.asarray(plain(a)), np.asarray(plain(b))
        if np.issubdtype(a.dtype, np.floating):  # a few ulps, as in ``assert_same``
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_array_equal(a, b)


def test_compile_generate_compiles_every_view(tiny_model):
    # A shape no other test uses: 3 prompts x 2 samples = 8 rows, width 32, 96 new
    # tokens: 128 slots, views 32, 64 and 128.
    config = dataclasses.replace(CONFIG, n=2, max_new_tokens=96, stop_tokens=(5,))
    model = nnx.split(tiny_model)
    for thread in compile_generate(model, config, 3, 20):
        thread.join()
    with count_compilations() as compiles:
        result = generate(model, prompts([20, 3, 17], seed=9), config, 4)
    assert compiles.count == 0
    assert result.tokens.shape == (3, 2, 96)


def test_a_view_must_be_positive(tiny_model):
    graphdef, params = split_model(tiny_model)
    state = programs.init_state(tiny_model.config, CONFIG, 2, 16)
    with pytest.raises(ValueError, match="view must be a positive"):
        programs.decode_steps(graphdef, params, state, 0, 1, 1, config=CONFIG, view=0)


def engine_run(monkeypatch, model, requests, views=True, resume=None, **options):
    """Completions of ``requests`` (``(prompt, rng, options)``) on an engine, and the
    view of every chunk it ran. ``resume(engine, completions)`` resumes parked turns."""
    from rlaxkit.inference import InferenceEngine

    chunks, shortest = [], []
    decode_steps = programs.decode_steps

    def recorded(graphdef, params, state, version, max_steps, *args, **kwargs):
        # The shortest view (of the engine's, or the cache) that holds every generating
        # row's next ``max_steps`` writes.
        end = np.asarray(state.cache.end)[np.asarray(state.rows.active)]
        needed = int(end.max()) + int(max_steps)
        shortest.append(min(v for v in engine_views(16, state.cache.slots) if v >= needed))
        chunks.append(kwargs["view"])
        return decode_steps(graphdef, params, state, version, max_steps, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(programs, "decode_steps", recorded)
        engine = InferenceEngine(model, cache_views=views, **options)
        for prompt, rng, kwargs in requests:
            engine.submit(prompt, rng, **kwargs)
        completions = engine.run()
        if resume is not None:
            resume(engine, completions)
            completions += engine.run()
    if views:
        assert chunks == shortest  # the view each chunk ran on was the shortest to hold it
    return completions, chunks


def assert_same_completions(a, b):
    assert [(c.request_id, c.sample_index, c.parked) for c in a] == [
        (c.request_id, c.sample_index, c.parked) for c in b
    ]
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.versions, y.versions)
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(x.plain_logprobs, y.plain_logprobs, rtol=1e-6, atol=1e-6)
        assert x.finish_reason == y.finish_reason


def test_the_engine_decodes_on_views_with_the_whole_caches_tokens(tiny_model, monkeypatch):
    """Continuous batching with refills: every chunk runs on the shortest view that holds
    its rows' next writes, and the completions are those of the whole cache, chunk for
    chunk (no view stops a chunk early)."""
    model = nnx.split(tiny_model)
    config = dataclasses.replace(CONFIG, n=2, stop_tokens=(3,))
    budgets = [112, 9, 60, 30, 112, 5, 80, 20]
    batch = prompts([1, 5, 16, 7, 12, 3, 9, 14], seed=4)
    requests = [
        (p, i, {"max_new_tokens": b}) for i, (p, b) in enumerate(zip(batch, budgets, strict=True))
    ]
    options = {"config": config, "num_slots": 4, "max_prompt_len": 16, "chunk_steps": 8}
    viewed, views = engine_run(monkeypatch, model, requests, **options)
    whole, chunks = engine_run(monkeypatch, model, requests, views=False, **options)
    assert_same_completions(viewed, whole)
    assert len(views) == len(chunks) and set(chunks) == {128}
    assert len(set(views)) >= 6  # 16 + 112 slots: views every 16 slots


def test_a_resumed_multi_turn_row_decodes_on_views(monkeypatch):
    """A row parked at a tool call keeps its cache past the view a later chunk runs on;
    its resumed turn decodes on views from its own offset, as over the whole cache."""
    from test_engine_multiturn import peaked_model, tool_call

    model, prompt = peaked_model(0), [5, 17, 2, 40, 33]
    config = SamplingConfig(temperature=1.0, max_new_tokens=48)
    pair = tool_call(model, prompt, config, at=20)
    config = dataclasses.replace(config, stop_sequences=(pair,))
    requests = [(prompt, 0, {"hold": True}), ([9, 4, 4, 1], 1, {})]

    def resume(engine, completions):
        (turn1,) = [c for c in completions if c.parked]
        # 30 tokens: the resumed row's writes start past the view its old offset needed.
        engine.resume(turn1.request_id, list(range(10, 40)), 2)

    options = {
        "config": config,
        "num_slots": 2,
        "max_prompt_len": 16,
        "max_context_len": 144,
        "chunk_steps": 4,
    }
    viewed, views = engine_run(monkeypatch, model, requests, resume=resume, **options)
    whole, chunks = engine_run(monkeypatch, model, requests, views=False, resume=resume, **options)
    assert_same_completions(viewed, whole)
    assert len(views) == len(chunks)
    assert [c.parked for c in viewed] == [True, False, False]
    assert min(views) == 32 and 64 in views  # the second turn starts past the first views


def test_runtime_cache_views_is_the_same_run_on_fewer_slots(cache, monkeypatch):
    """``runtime.cache_views`` reaches every worker's engine; with views the run is the
    run over the whole cache (log-prob metrics to float32 ulps)."""
    from test_runtime import SMALL, learning_metrics

    from rlaxkit.config.run import RuntimeConfig, small_run_config
    from rlaxkit.runtime import Experiment

    decode_steps = programs.decode_steps
    runs = {}
    for views in ("true", "false"):
        seen = []

        def recorded(*args, seen=seen, **kwargs):
            seen.append((kwargs["view"], args[2].cache.slots))
            return decode_steps(*args, **kwargs)

        monkeypatch.setattr(programs, "decode_steps", recorded)
        # 64 new tokens on a 16-token prompt width: 80 slots, views every 16.
        config = small_run_config(
            *SMALL,
            "model.config.max_position_embeddings=128",
            "sampling.max_new_tokens=64",
            f"runtime.cache_views={views}",
        )
        with Experiment(config, cache_dir=cache) as exp:
            exp.run(2)
            runs[views] = learning_metrics(exp.history)
        if views == "true":
            assert {view for view, _ in seen} - {80} and {slots for _, slots in seen} == {80}
        else:
            assert {view for view, _ in seen} == {80}
    for viewed, whole in zip(runs["true"], runs["false"], strict=True):
        assert viewed.keys() == whole.keys()
        for key, value in whole.items():
            assert viewed[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    with pytest.raises(ValueError, match="cache_views must be true or false"):
        RuntimeConfig(cache_views=1)
