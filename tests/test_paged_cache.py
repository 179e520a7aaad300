"""The paged KV cache: an engine on pages gives the dense engine's completions (tokens
equal, log-probs within 1e-5) with refills, stop tokens, shared prompt pages, a small pool
that preempts rows, mid-row weight updates and multi-turn resumes; pages come back when
rows finish; a pool that cannot run a row is refused, naming the field."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from test_engine import CONFIG, assert_same, peaked_model, workload
from test_engine_multiturn import OBSERVATION, engine_for, first_turn, tool_call
from test_worker import (
    PROBLEMS,
    assert_identical,
    issue,
    make_worker,
    problem_for,
    run_until_idle,
    weights,  # noqa: F401 (a fixture)
)

from rlaxkit.config.io import apply_overrides
from rlaxkit.config.run import RunConfig
from rlaxkit.inference import InferenceConfig, InferenceEngine
from rlaxkit.param_server import InProcessParameterServer
from rlaxkit.rules.paging import check_pages, rows_that_fit
from rlaxkit.rules.trace import MemoryTrace

# 4 rows of 16 prompt + 16 new tokens: 32 slots, 8 pages of 4 a row. 20 pages (19 usable,
# 76 slots) is less than the dense cache's 128 slots: rows are admitted by pages.
PAGED = {"kv_cache": "paged", "page_size": 4, "num_pages": 20}


@pytest.fixture(scope="module")
def models():
    return [peaked_model(seed) for seed in range(2)]


def run(model, config, prompts, keys, budgets, **options):
    engine = InferenceEngine(
        model, config, num_slots=4, max_prompt_len=16, chunk_steps=4, **options
    )
    for prompt, key, budget in zip(prompts, keys, budgets, strict=True):
        engine.submit(prompt, key, max_new_tokens=budget)
    return engine, engine.run()


def test_paged_equals_dense_with_refills_stops_and_shared_prompts(models):
    config = dataclasses.replace(CONFIG, n=2, stop_tokens=(3, 11))
    prompts, keys, budgets = workload(10)
    _, dense = run(models[0], config, prompts, keys, budgets)
    engine, paged = run(models[0], config, prompts, keys, budgets, **PAGED)
    assert {c.finish_reason for c in paged} == {"stop", "length"} and len(paged) == 20
    for a, b in zip(dense, paged, strict=True):
        assert (a.request_id, a.sample_index) == (b.request_id, b.sample_index)
        assert_same(b, a)
    assert engine.pages_in_use == 0 and engine.idle  # every page came back


def test_a_short_pool_preempts_the_youngest_row_and_changes_no_token(models):
    # Four 15-token prompts, 16 new tokens each: a row grows to 8 pages, four rows to 32;
    # 19 pages admit three, and the youngest goes back to the queue when the others grow.
    rng = np.random.RandomState(3)
    prompts = [rng.randint(0, 64, 15).tolist() for _ in range(4)]
    keys = [jax.random.key(i) for i in range(4)]
    _, dense = run(models[0], CONFIG, prompts, keys, [16] * 4)
    engine, paged = run(models[0], CONFIG, prompts, keys, [16] * 4, **PAGED)
    assert engine.preemptions >= 1 and engine.pages_in_use == 0
    for a, b in zip(dense, paged, strict=True):
        assert_same(b, a)

    # A preempted sample keeps the tokens it had: the first chunk's tokens of the three
    # rows that started keep version 0 after a version bump (same weights) that comes
    # before any preemption; regenerated, they would be version 1.
    engine = InferenceEngine(
        models[0], CONFIG, num_slots=4, max_prompt_len=16, chunk_steps=4, **PAGED
    )
    for prompt, key in zip(prompts, keys, strict=True):
        engine.submit(prompt, key)
    assert engine.step() == [] and engine.preemptions == 0 and engine.num_running == 3
    engine.update_weights(models[0], 1)
    bumped = sorted(engine.run(), key=lambda c: c.request_id)
    assert engine.preemptions >= 1
    for a, b in zip(dense, bumped, strict=True):
        assert b.tokens.tolist() == a.tokens.tolist()
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
    assert [c.versions[:4].tolist() for c in bumped[:3]] == [[0] * 4] * 3
    assert bumped[3].versions.tolist() == [1] * 16


@pytest.mark.parametrize("recompute_cache", [False, True])
def test_weights_updated_mid_row_give_the_dense_completions(models, recompute_cache):
    prompts, keys, _ = workload(4, seed=2)

    def interrupted(**options):
        engine = InferenceEngine(
            models[0], CONFIG, num_slots=4, max_prompt_len=16, chunk_steps=5, **options
        )
        for prompt, key in zip(prompts, keys, strict=True):
            engine.submit(prompt, key)
        done = engine.step()
        engine.update_weights(models[1], 1, recompute_cache=recompute_cache)
        return sorted(done + engine.run(), key=lambda c: c.request_id)

    # A pool as large as the dense cache: the same rows run in the same chunks.
    dense, paged = interrupted(), interrupted(kv_cache="paged", page_size=4)
    for a, b in zip(dense, paged, strict=True):
        assert b.versions.tolist() == [0] * 5 + [1] * 11
        assert_same(b, a)


def test_a_multi_turn_resume_past_the_first_turn_on_pages(models):
    model, prompt = models[0], [5, 17, 2, 40, 33]
    pair = tool_call(model, prompt)
    turns = []
    for options in ({}, {"kv_cache": "paged", "page_size": 4}):
        engine = engine_for(model, pair, **options)
        request, turn1 = first_turn(engine, prompt)
        engine.resume(request, OBSERVATION, 1)
        (turn2,) = engine.run()
        turns.append((turn1, turn2))
        assert engine.pages_in_use == 0
    (dense1, dense2), (paged1, paged2) = turns
    assert_same(paged1, dense1)
    assert_same(paged2, dense2)
    assert len(paged2.prompt_tokens) + paged2.num_tokens > len(prompt) + paged1.num_tokens


def test_samples_of_a_prompt_share_its_full_pages(models):
    # A 16-token prompt caches 15 tokens: 3 full pages of 4, held once for 4 samples;
    # each sample's own pages hold the partly filled 4th page and its first chunk.
    config = dataclasses.replace(CONFIG, n=4)
    engine = InferenceEngine(
        models[0], config, num_slots=4, max_prompt_len=16, chunk_steps=4, **PAGED
    )
    engine.submit(list(range(1, 17)), 0)
    engine.launch()
    own = 2  # slots 12..18 (15 cached + 4 new - 1): pages 3 and 4
    assert engine.pages_in_use == 3 + 4 * own
    unshared = 4 * (3 + own)
    assert engine.pages_in_use / unshared < 0.6
    engine.finish()
    engine.abort()
    assert engine.pages_in_use == 0


def test_pools_that_cannot_run_a_row_are_refused_naming_the_field():
    ok = {"page_size": 16, "num_pages": 5, "attention_block": 128}
    check_pages(**ok, max_prompt_tokens=16, max_new_tokens=49)
    with pytest.raises(ValueError, match=r"page_size: 24 does not divide .* is 16"):
        check_pages(**ok | {"page_size": 24}, max_prompt_tokens=16, max_new_tokens=8)
    with pytest.raises(ValueError, match=r"num_pages: 5 .* longest prompt .* smallest .* is 6"):
        check_pages(**ok, max_prompt_tokens=66, max_new_tokens=8)
    with pytest.raises(ValueError, match=r"max_new_tokens: 50 .* at most 49 fit.* at least 6"):
        check_pages(**ok, max_prompt_tokens=16, max_new_tokens=50)


def test_rows_that_fit_follow_the_mean_pages_of_a_row():
    assert rows_that_fit(pool_tokens=32 * 1024, page_size=16, row_tokens=[32 * 1024]) == 1
    assert rows_that_fit(pool_tokens=1024, page_size=16, row_tokens=[16, 48]) == 32
    assert rows_that_fit(pool_tokens=1024, page_size=16, row_tokens=[1], max_rows=8) == 8


def test_a_paged_worker_restored_from_its_snapshot_equals_the_dense_worker(weights):  # noqa: F811
    """A worker on pages, snapshotted with two prompts in flight and a weight update
    between, restores to the dense worker's rollouts, log-probs and versions."""
    graphdef, params = weights
    paged = InferenceConfig(kv_cache="paged", page_size=4)

    def worker_for(server, inference=None):
        return make_worker(graphdef, server, inference=inference)

    runs = []
    for inference in (None, paged):
        server = InProcessParameterServer()
        server.push(0, params[0])
        worker = worker_for(server, inference)
        worker.sync_weights()
        worker.submit(issue(0), PROBLEMS[0])
        worker.step()
        worker.submit(issue(1), PROBLEMS[1])
        server.push(1, params[1])
        worker.sync_weights()
        worker.step()
        saved = json.loads(json.dumps(worker.snapshot()))
        replay = worker.replay_weights()
        restored = worker_for(server, inference)
        restored.restore(
            saved, issue_for=issue, problem_for=problem_for, weights_for=replay.__getitem__
        )
        runs.append((run_until_idle(worker), run_until_idle(restored)))
    (dense, _), (paged_run, paged_restored) = runs
    assert_identical(paged_restored, paged_run)
    for got, want in zip(paged_run, dense, strict=True):
        assert got.completion_tokens.tolist() == want.completion_tokens.tolist()
        assert got.versions.tolist() == want.versions.tolist()
        np.testing.assert_allclose(got.behaviour_logprobs, want.behaviour_logprobs, atol=1e-5)


def test_the_run_config_refuses_a_paged_cache_that_cannot_run_a_row():
    def load(*overrides):
        data = apply_overrides(RunConfig().to_dict(), ["inference.kv_cache=paged", *overrides])
        return RunConfig.from_dict(data)

    assert load().inference.kv_cache == "paged"
    with pytest.raises(ValueError, match=r"inference\.page_size: 24 does not divide .* is 16"):
        load("inference.page_size=24")
    with pytest.raises(ValueError, match=r"inference\.num_pages: 2 .* smallest that works is 3"):
        load("inference.num_pages=2", "runtime.max_prompt_tokens=32")
    with pytest.raises(ValueError, match=r"sampling\.max_new_tokens: 40 .* at most 17 fit"):
        load("inference.num_pages=3", "sampling.max_new_tokens=40")


def test_a_worker_counts_the_rows_its_pages_preempted_in_the_trace(weights):  # noqa: F811
    # 6 usable pages of 4 slots: four rows of 4-token prompts start on 2 pages each, so
    # three start, and one goes back to the queue when the others grow to 3 pages.
    graphdef, params = weights
    rollouts, events = [], []
    for inference in (None, InferenceConfig(kv_cache="paged", page_size=4, num_pages=7)):
        server, trace = InProcessParameterServer(), MemoryTrace()
        server.push(0, params[0])
        worker = make_worker(graphdef, server, trace=trace, inference=inference)
        worker.sync_weights()
        worker.submit(issue(0), PROBLEMS[0])
        worker.submit(issue(1), PROBLEMS[1])
        rollouts.append(run_until_idle(worker))
        events.append([e for e in trace.events if e.kind == "decode"])
    assert sum(e.fields.get("preempted", 0) for e in events[1]) >= 1
    assert not any("preempted" in e.fields for e in events[0])
    for got, want in zip(*rollouts, strict=True):
        assert got.completion_tokens.tolist() == want.completion_tokens.tolist()
        np.testing.assert_allclose(got.behaviour_logprobs, want.behaviour_logprobs, atol=1e-5)
