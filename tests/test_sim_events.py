"""Exact event logs and closed-form timings of small deterministic simulations.

The toy preset (sim.presets.toy): 1 worker with 2 slots; a group is 2 samples of 10
tokens after a 5-token prompt. Prefill 5 / 10 tok/s = 0.5 s, decode 10 × 0.1 s = 1 s,
reward 0.25 s, train step 30 tokens / 20 tok/s = 1.5 s, push 100 B / 100 B/s = 1 s,
pull 100 B / 200 B/s = 0.5 s.
"""

import pytest

from rlaxkit.rules.trace import MemoryTrace
from sim import presets, simulate, with_overrides


def _log(trace):
    return [(round(e.t, 9), e.kind, e.actor, e.version) for e in trace.events]


def test_synchronous_toy_exact_event_log():
    trace = MemoryTrace()
    result = simulate(presets.toy(target_steps=2), trace=trace)
    gen = "generation"
    assert _log(trace) == [
        (0.0, "run_start", "trainer", 0),
        (0.5, "pull", "worker-0", 0),
        (0.5, f"{gen}_start", "worker-0", 0),
        (0.5, f"{gen}_start", "worker-0", 0),
        (2.0, f"{gen}_end", "worker-0", 0),  # 0.5 + 0.5 prefill + 1.0 decode
        (2.0, f"{gen}_end", "worker-0", 0),
        (2.25, "reward", "verifier", 0),
        (2.25, "reward", "verifier", 0),
        (3.75, "train_step", "trainer", 1),  # 2.25 + 1.5
        (4.75, "push", "trainer", 1),
        (5.25, "pull", "worker-0", 1),
        (5.25, f"{gen}_start", "worker-0", 1),
        (5.25, f"{gen}_start", "worker-0", 1),
        (6.75, f"{gen}_end", "worker-0", 1),
        (6.75, f"{gen}_end", "worker-0", 1),
        (7.0, "reward", "verifier", 1),
        (7.0, "reward", "verifier", 1),
        (8.5, "train_step", "trainer", 2),
        (9.5, "push", "trainer", 2),
    ]
    starts = [e for e in trace.events if e.kind == "generation_start"]
    assert [e["occupancy"] for e in starts] == [1, 2, 1, 2]
    assert [e["staleness"] for e in trace.events if e.kind == "train_step"] == [[0], [0]]
    assert result.staleness == {0: 2}


@pytest.mark.parametrize("steps", [1, 3, 7])
def test_synchronous_throughput_closed_form(steps):
    # Each sync step after the first costs pull + prefill + decode + reward + train + push
    # = 0.5 + 0.5 + 1 + 0.25 + 1.5 + 1 = 4.75 s; step 1 ends at 3.75 s.
    result = simulate(presets.toy(target_steps=steps))
    end = 3.75 + 4.75 * (steps - 1)
    assert result.time_to_step(steps) == pytest.approx(end)
    assert result.samples_per_s == pytest.approx(2 * steps / end)
    assert result.tokens_per_s == pytest.approx(30 * steps / end)
    assert result.goodput == pytest.approx(1.5 * steps / end)


def test_asynchronous_throughput_closed_form():
    # η and worker lag large: no pull after the first; the worker makes a group every
    # 1.5 s (2 slots, prefill + decode) and a fast trainer (0.1 s/step) follows it:
    # step k ends at 0.5 + 1.5 k + 0.25 + 0.1 = 0.85 + 1.5 k.
    scenario = presets.toy(
        **{
            "target_steps": 10,
            "staleness.max_staleness": 100,
            "staleness.max_worker_lag": 100,
            "trainer.chip_flops": 300.0,
        }
    )
    result = simulate(scenario)
    assert list(result.step_end_s) == pytest.approx([0.85 + 1.5 * k for k in range(1, 11)])
    # Every group was sampled with version 0, so step k+1 trains on staleness k.
    assert result.staleness == {k: 1 for k in range(10)}


def test_occupancy_slows_decode():
    # 0.05 s more per token per extra running sequence: the second sample of the
    # group starts at occupancy 2 and decodes at 0.15 s/token.
    trace = MemoryTrace()
    simulate(
        presets.toy(**{"target_steps": 1, "fleet.decode_s_per_token_per_seq": 0.05}), trace=trace
    )
    ends = [e.t for e in trace.events if e.kind == "generation_end"]
    assert ends == pytest.approx([0.5 + 0.5 + 1.0, 0.5 + 0.5 + 1.5])


def test_pulls_share_store_bandwidth():
    # Three workers pull 100 B at once through a 200 B/s store: 66.7 B/s each, 1.5 s.
    scenario = presets.toy(
        **{
            "target_steps": 1,
            "fleet.num_workers": 3,
            "param_server.total_bytes_per_s": 200.0,
        }
    )
    trace = MemoryTrace()
    simulate(scenario, trace=trace)
    first_pulls = [e for e in trace.events if e.kind == "pull"][:3]
    assert [e.t for e in first_pulls] == pytest.approx([1.5, 1.5, 1.5])


def test_eta_zero_means_zero_staleness_everywhere():
    for scenario in (
        presets.areal_like(max_staleness=0, target_steps=6),
        presets.areal_like(max_staleness=0, target_steps=6, pull_mode="between_requests"),
        presets.local_runtime(max_staleness=0, target_steps=10),
        with_overrides(
            presets.rlax_like(inference_chips=64, max_staleness=0, hours=3.0),
            {"preemptions.worker_mtbf_s": 3600.0},
        ),
    ):
        result = simulate(scenario)
        assert result.steps > 0
        assert set(result.staleness) == {0}, scenario.name
        assert "stale" not in result.drops


@pytest.mark.parametrize("eta", [1, 2, 3])
@pytest.mark.parametrize("mode", ["between_requests", "in_flight"])
def test_trained_staleness_never_exceeds_eta(eta, mode):
    result = simulate(presets.areal_like(max_staleness=eta, target_steps=12, pull_mode=mode))
    assert max(result.staleness) <= eta
    assert result.samples_trained == 12 * 16 * 8


def test_same_seed_same_run_other_seed_other_run():
    a = simulate(presets.areal_like(max_staleness=2, target_steps=8, seed=3))
    b = simulate(presets.areal_like(max_staleness=2, target_steps=8, seed=3))
    c = simulate(presets.areal_like(max_staleness=2, target_steps=8, seed=4))
    assert a.step_end_s == b.step_end_s and a.staleness == b.staleness
    assert a.step_end_s != c.step_end_s


def test_trace_does_not_change_the_run():
    # The trace-free fast path scores groups with one timer; timings must not move.
    scenario = presets.areal_like(max_staleness=2, target_steps=8)
    assert simulate(scenario).step_end_s == simulate(scenario, trace=MemoryTrace()).step_end_s
