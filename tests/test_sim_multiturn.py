"""Multi-turn episodes with tools in the simulator: exact timelines, versions across
turns, validation, and calibration from a trace's ``tool_call`` events.

The toy preset (sim.presets.toy) with one tool call per episode: a group is 2 episodes
on 1 worker with 2 slots; each episode is a 5-token prompt, a 10-token turn, a tool call
of 2 s that appends 3 tokens, and a second 10-token turn. Prefill 10 tokens/s, decode
0.1 s per token, reward 0.25 s, train 20 tokens/s, push 1 s, pull 0.5 s.
"""

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

import sim
from rlaxkit.rules.fault_plan import Fault, FaultPlan
from rlaxkit.rules.trace import MemoryTrace, TraceEvent
from sim import Constant, Empirical, Lognormal, presets, simulate, with_overrides
from sim.calibration.turns import fit_turns

MULTI_TURN = {
    "workload.turns": Constant(value=1),
    "workload.tool_latency_s": Constant(value=2.0),
    "workload.observation_tokens": Constant(value=3),
}


def _log(trace, kinds=None):
    return [
        (round(e.t, 9), e.kind, e.actor, e.version)
        for e in trace.events
        if kinds is None or e.kind in kinds
    ]


def test_a_held_slot_prefills_only_the_observation_exact_event_log():
    trace = MemoryTrace()
    result = simulate(presets.toy(target_steps=1, **MULTI_TURN), trace=trace)
    assert _log(trace) == [
        (0.0, "run_start", "trainer", 0),
        (0.5, "pull", "worker-0", 0),
        (0.5, "generation_start", "worker-0", 0),
        (0.5, "generation_start", "worker-0", 0),
        # 4.0 = 0.5 + 0.5 prefill (5 tokens) + 1.0 decode (10 tokens) + 2.0 tool
        (4.0, "tool_call", "worker-0", 0),
        (4.0, "tool_call", "worker-0", 0),
        # 5.3 = 4.0 + 0.3 prefill of the 3 observation tokens only + 1.0 decode
        (5.3, "generation_end", "worker-0", 0),
        (5.3, "generation_end", "worker-0", 0),
        (5.55, "reward", "verifier", 0),
        (5.55, "reward", "verifier", 0),
        # 2 x (5 + 10 + 3 + 10) = 56 tokens at 20 tokens/s: 2.8 s
        (8.35, "train_step", "trainer", 1),
        (9.35, "push", "trainer", 1),
    ]
    calls = [e for e in trace.events if e.kind == "tool_call"]
    assert [(e["sample"], e["turn"], e["duration_s"], e["outcome"]) for e in calls] == [
        ("0/0", 0, 2.0, "ok"),
        ("0/1", 0, 2.0, "ok"),
    ]
    assert {(e["observation_tokens"], e["action_tokens"], e["released"]) for e in calls} == {
        (3, 10, False)
    }
    ends = [e for e in trace.events if e.kind == "generation_end"]
    assert {(e["tokens"], tuple(e["turn_tokens"])) for e in ends} == {(23, (10, 10))}
    assert result.samples_trained == 2 and result.time_to_step(1) == pytest.approx(8.35)


def test_a_released_slot_re_prefills_the_whole_context_exact_event_log():
    # Held 0.5 s past the end of the first turn (2.0 → 2.5), then released; the tool
    # answers at 4.0 and both episodes start again in free slots, prefilling
    # 5 + 10 + 3 = 18 tokens (1.8 s) before their second turn (1.0 s): 6.8.
    trace = MemoryTrace()
    scenario = presets.toy(target_steps=1, **MULTI_TURN, **{"fleet.release_after_s": 0.5})
    engine = sim.Simulation(scenario, trace=trace)
    result = engine.run()
    assert _log(trace, {"tool_call", "generation_end", "train_step"}) == [
        (4.0, "tool_call", "worker-0", 0),
        (4.0, "tool_call", "worker-0", 0),
        (6.8, "generation_end", "worker-0", 0),
        (6.8, "generation_end", "worker-0", 0),
        (9.85, "train_step", "trainer", 1),  # 6.8 + 0.25 reward + 2.8 train
    ]
    assert {e["released"] for e in trace.events if e.kind == "tool_call"} == {True}
    assert engine.counters.slots_released == 2 and engine.counters.tool_calls == 2
    assert engine.counters.tool_hold_s == pytest.approx(2 * 0.5)
    assert result.samples_trained == 2
    assert (result.tool_calls, result.slots_released) == (2, 2)
    # 1 slot-second held of 2 slots x 9.85 s
    assert result.tool_hold_fraction == pytest.approx(1.0 / (2 * 9.85))
    # A tool faster than release_after_s keeps its slot: the held timeline.
    held = simulate(with_overrides(scenario, {"fleet.release_after_s": 2.0}))
    assert held.time_to_step(1) == pytest.approx(8.35)


def test_a_released_slot_serves_another_group_while_the_tool_runs():
    # η = 1 admits a second group: the first group's slots go to it while its tools
    # run (2.5 → 4.0), so two groups finish by the time one would with held slots.
    def run(release_after_s):
        overrides = {
            **MULTI_TURN,
            "workload.tool_latency_s": Constant(value=6.0),
            "fleet.release_after_s": release_after_s,
            "staleness.max_staleness": 1,
            "trainer.chip_flops": 2000.0,  # a fast trainer: generation is the bottleneck
            "target_steps": 8,
        }
        return simulate(presets.toy(**overrides))

    held, released = run(None), run(0.0)
    assert released.samples_per_s > 1.3 * held.samples_per_s
    assert released.steps == held.steps == 8


@pytest.mark.parametrize("release_after_s", [None, 0.5])
def test_a_preemption_during_a_tool_call_loses_the_episode_and_it_starts_over(release_after_s):
    # worker-0 is preempted at 3.0 while both episodes wait for their tools (held, or
    # released at 2.5); it restarts at 6.0 (restart_s 3), pulls by 6.5 and generates
    # the group again from scratch: the timeline of the first test shifted by 6.0 s
    # (held: 10.0 tools, 11.3 ends, 14.35 step; released: 12.8 ends, 15.85 step). The
    # lost episodes' tools answer into nothing: no tool_call event at 4.0.
    scenario = presets.toy(
        target_steps=1, **MULTI_TURN, **{"fleet.release_after_s": release_after_s}
    )
    fault = Fault(kind="preempt_worker", at_s=3.0, target="worker-0")
    scenario = dataclasses.replace(scenario, fault_plan=FaultPlan((fault,)))
    trace = MemoryTrace()
    result = simulate(scenario, trace=trace)
    shift = 0.0 if release_after_s is None else 1.5
    assert _log(trace, {"preemption", "restart", "tool_call", "generation_end", "train_step"}) == [
        (3.0, "preemption", "worker-0", 0),
        (6.0, "restart", "worker-0", None),
        (10.0, "tool_call", "worker-0", 0),
        (10.0, "tool_call", "worker-0", 0),
        (11.3 + shift, "generation_end", "worker-0", 0),
        (11.3 + shift, "generation_end", "worker-0", 0),
        (14.35 + shift, "train_step", "trainer", 1),
    ]
    assert result.samples_trained == 2


def test_versions_across_turns_staleness_counts_from_the_oldest_policy_token():
    # In-flight pulls with η = 1: a new version arrives while an episode waits for its
    # tool; the episode's next turn recomputes its cache under the new weights, so the
    # group spans two versions and trains with the staleness of its first turn.
    trace = MemoryTrace()
    scenario = presets.toy(
        **{
            **MULTI_TURN,
            "workload.tool_latency_s": Constant(value=5.0),
            "staleness.max_staleness": 1,
            "weight_sync.pull_mode": "in_flight",
            "target_steps": 4,
        },
    )
    result = simulate(scenario, trace=trace)
    ends = [e for e in trace.events if e.kind == "generation_end"]
    spanning = [e for e in ends if e["first_version"] < e.version]
    assert spanning, "some episode's turns ran under two versions"
    steps = [e for e in trace.events if e.kind == "train_step"]
    assert max(max(e["staleness"]) for e in steps) <= 1
    assert result.max_staleness >= 1 and result.steps == 4


def test_single_turn_workloads_are_unchanged_by_the_new_fields():
    base = presets.areal_like(max_staleness=2, target_steps=6)
    zero = with_overrides(
        base,
        {
            "workload.turns": Empirical(values=(0, 0)),
            "workload.tool_latency_s": Lognormal(median=3.0, sigma=1.0),
            "fleet.release_after_s": 1.0,
        },
    )
    assert not zero.workload.multi_turn
    assert simulate(base).step_end_s == simulate(zero).step_end_s


def test_validation_errors_name_the_field():
    with pytest.raises(ValueError, match=r"^release_after_s: must be a number >= 0"):
        presets.toy(**{"fleet.release_after_s": -1.0})
    with pytest.raises(ValueError, match=r"^turns: must be a distribution"):
        presets.toy(**{"workload.turns": 2})
    data = sim.scenario_to_dict(presets.toy())
    data["workload"]["tool_latency_s"] = {"type": "zipf"}
    with pytest.raises(ValueError, match=r"^workload\.tool_latency_s\.type: must be one of"):
        sim.scenario_from_dict(data)
    data = sim.scenario_to_dict(presets.toy())
    data["fleet"]["release_after_s"] = "soon"
    with pytest.raises(ValueError, match=r"^fleet\.release_after_s: must be a number"):
        sim.scenario_from_dict(data)
    serial = presets.local_runtime(max_staleness=0, target_steps=2)
    with pytest.raises(ValueError, match=r"^workload\.turns: host\.executor 'serial'"):
        with_overrides(serial, {"host.executor": "serial", "workload.turns": Constant(value=1)})


def test_a_multi_turn_scenario_round_trips_through_its_dict():
    scenario = presets.toy(
        **{
            "workload.turns": Empirical(values=(0, 1, 3)),
            "workload.tool_latency_s": Lognormal(median=2.0, sigma=1.2),
            "workload.observation_tokens": Constant(value=7),
            "fleet.release_after_s": 4.0,
        }
    )
    assert sim.scenario_from_dict(sim.scenario_to_dict(scenario)) == scenario


def test_calibration_fits_turns_and_tool_latency_and_predicts_its_own_run():
    scenario = presets.toy(
        **{
            "workload.turns": Empirical(values=(0, 1, 2, 3)),
            "workload.tool_latency_s": Lognormal(median=1.0, sigma=1.0),
            "workload.observation_tokens": Constant(value=3),
            "workload.prompts_per_step": 2,
            "fleet.slots_per_worker": 8,
            "staleness.max_staleness": 1,
            "target_steps": 200,
        }
    )
    trace = MemoryTrace()
    simulate(scenario, trace=trace)
    calls = [e for e in trace.events if e.kind == "tool_call"]
    ends = [e for e in trace.events if e.kind == "generation_end"]
    fitted, figures = sim.fit_scenario(trace.events)
    # Held slots: the tool time taken out, each episode's latency is its turns' decode
    # plus the prefill of its prompt and observations, which the fit recovers exactly.
    assert figures["decode_s_per_token"] == pytest.approx(0.1)
    assert figures["prefill_tokens_per_s"] == pytest.approx(10.0)
    assert fitted.fleet.release_after_s is None
    workload = fitted.workload
    assert isinstance(workload.tool_latency_s, Empirical)
    assert sorted(workload.tool_latency_s.values) == sorted(e["duration_s"] for e in calls)
    per_episode = {e["sample"]: 0 for e in ends}
    for e in calls:
        if e["sample"] in per_episode:  # the run ends with some episodes unfinished
            per_episode[e["sample"]] += 1
    assert sorted(workload.turns.values) == sorted(per_episode.values())
    assert set(workload.observation_tokens.values) == {3.0}
    assert set(workload.response_tokens.values) == {10.0}  # per turn, not per episode
    calibration = sim.calibrate(trace.events, warmup_steps=3)
    # Two seeds of this run gave -2.2% and -2.3% (the trace's draws are the fitted
    # empirical laws; the prediction simulates them again).
    assert abs(calibration.errors()["samples_per_s"]) < 0.05
    assert abs(calibration.errors()["mean_staleness_abs"]) < 0.05
    released = with_overrides(scenario, {"fleet.release_after_s": 1.0, "target_steps": 5})
    trace = MemoryTrace()
    simulate(released, trace=trace)
    assert sim.fit_scenario(trace.events)[0].fleet.release_after_s == 1.0


def test_tool_calls_without_generation_events_count_turns_by_sample():
    # What run_episodes writes on its own: tool_call events, no generation events.
    def call(t, sample, turn, duration_s, tokens):
        fields = {"sample": sample, "turn": turn, "duration_s": duration_s, "outcome": "ok"}
        return TraceEvent(t, "tool_call", "environment", 0, fields | {"observation_tokens": tokens})

    fit = fit_turns(
        [call(1.0, "0/0", 0, 0.5, 4), call(2.0, "0/0", 1, 3.0, 2), call(2.5, "1/0", 0, 0.1, 4)]
    )
    assert sorted(fit.turns.values) == [1.0, 2.0]
    assert fit.tool_latency_s.values == (0.5, 3.0, 0.1)
    assert fit.observation_tokens.values == (4.0, 2.0, 4.0)
    assert fit.response_tokens is None and fit.adjust == {}
    assert not fit_turns([]).multi_turn


def test_the_multiturn_benchmark_reports_eta_and_released_figures(capsys):
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "multiturn.py"
    spec = importlib.util.spec_from_file_location("bench_multiturn", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--smoke"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rates = report["samples_per_s"]
    assert set(rates) == {"held", "released", "in_flight", "no_tail", "no_tail_in_flight"}
    for name, by_eta in rates.items():
        assert set(by_eta) == {"0", "2"} and all(v > 0 for v in by_eta.values())
        assert report["eta2_over_eta0"][name] == by_eta["2"] / by_eta["0"]
    assert set(report["tail_hidden"]) == {"held", "released", "in_flight"}
