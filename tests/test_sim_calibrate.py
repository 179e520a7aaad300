"""Calibration recovers known parameters from a simulated trace and predicts runs."""

import pytest

from rlaxkit.rules.trace import JsonlTraceWriter, MemoryTrace, TraceEvent
from sim import calibrate, fit_scenario, presets, simulate
from sim.calibration.window import window_start, window_summary
from sim.scenario import with_overrides


def _trace(scenario):
    trace = MemoryTrace()
    simulate(scenario, trace=trace)
    return trace.events


@pytest.mark.parametrize("pauses_fleet", [False, True])
def test_recovers_known_parameters(pauses_fleet):
    truth = presets.local_runtime(target_steps=30, pauses_fleet=pauses_fleet)
    scenario, fitted = fit_scenario(_trace(truth))
    assert fitted["decode_s_per_token"] == pytest.approx(truth.fleet.decode_s_per_token)
    assert fitted["decode_s_per_token_per_seq"] == pytest.approx(
        truth.fleet.decode_s_per_token_per_seq
    )
    assert fitted["prefill_tokens_per_s"] == pytest.approx(truth.fleet.prefill_tokens_per_s)
    assert fitted["trainer_tokens_per_s"] == pytest.approx(truth.trainer.tokens_per_s)
    assert fitted["step_overhead_s"] == pytest.approx(truth.trainer.step_overhead_s)
    # push: 0.01 s latency + 4 MB at 1 GB/s
    assert fitted["push_s"] == pytest.approx(0.014)
    assert scenario.staleness == truth.staleness
    assert scenario.fleet.occupancy_scope == "host"
    assert scenario.trainer.pauses_fleet is pauses_fleet
    assert scenario.workload.group_size == truth.workload.group_size


def test_predicts_the_measured_run(tmp_path):
    truth = presets.local_runtime(target_steps=30)
    path = tmp_path / "local.jsonl"
    with JsonlTraceWriter(path) as writer:
        for event in _trace(truth):
            writer.emit(event)
    result = calibrate(path)
    print("\n" + result.report())
    errors = result.errors()
    assert abs(errors["samples_per_s"]) < 0.10
    assert abs(errors["tokens_per_s"]) < 0.10
    assert abs(errors["mean_staleness_abs"]) < 0.25


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_predicts_a_second_configuration(max_staleness):
    # Calibrate on an η = 1 run, predict a run at another η, compare with the truth.
    fitted_on = _trace(presets.local_runtime(target_steps=30, max_staleness=1))
    second = simulate(presets.local_runtime(target_steps=30, max_staleness=max_staleness, seed=7))
    prediction = calibrate(fitted_on, overrides={"staleness.max_staleness": max_staleness})
    assert prediction.predicted.samples_per_s == pytest.approx(second.samples_per_s, rel=0.10)


def test_runtime_style_config_is_understood():
    events = _trace(presets.local_runtime(target_steps=10))
    config = events[0]["config"]
    runtime_config = {
        "staleness": config["staleness"],
        "weight_sync": config["weight_sync"],
        "checkpoint": config["checkpoint"],
        "runtime": {"backend": "local", "mode": "deterministic", "num_workers": 2,
                    "slots_per_worker": 4},
        "sampling": {"n": 4, "max_new_tokens": 128},
    }  # fmt: skip
    events[0] = TraceEvent(0.0, "run_start", "controller", None, {"config": runtime_config})
    scenario, _ = fit_scenario(events, executor="parallel")
    assert (scenario.fleet.num_workers, scenario.fleet.slots_per_worker) == (2, 4)
    assert scenario.workload.group_size == 4
    assert scenario.workload.max_response_tokens == 128
    assert scenario.trainer.pauses_fleet and scenario.fleet.occupancy_scope == "host"
    assert not scenario.host.serial
    # A local deterministic run is the serial host by default, fitted from the decode
    # events this simulated (parallel) trace lacks.
    with pytest.raises(ValueError, match="no decode events"):
        fit_scenario(events)


def test_missing_config_is_an_error():
    events = [e for e in _trace(presets.toy()) if e.kind != "run_start"]
    with pytest.raises(ValueError, match=r"run_start\.config\.staleness"):
        fit_scenario(events)


def test_trace_preemptions_are_replayed():
    scenario = presets.local_runtime(target_steps=20)
    from rlaxkit.rules.fault_plan import Fault, FaultPlan
    from sim import with_overrides

    plan = FaultPlan(
        (Fault(kind="preempt_worker", target="worker-1", at_s=3.0, restart_after_s=2.0),)
    )
    events = _trace(with_overrides(scenario, {"fault_plan": plan}))
    fitted, _ = fit_scenario(events)
    assert fitted.fault_plan == plan


def test_measured_window_leaves_out_the_time_before_the_loop_and_warmup_steps():
    # A runtime trace starts with run_start, then warm start and a first evaluation
    # (no events), then the loop. Shift a simulated trace by 100 s to stand for that.
    events = _trace(presets.local_runtime(target_steps=10))
    shifted = [events[0]] + [
        TraceEvent(e.t + 100.0, e.kind, e.actor, e.version, e.fields) for e in events[1:]
    ]
    steps = [e for e in shifted if e.kind == "train_step"]
    whole = window_summary(events, 0)
    assert window_start(shifted, 0) == pytest.approx(100.0 + min(e.t for e in events[1:]))
    assert window_summary(shifted, 0).samples_per_s == pytest.approx(whole.samples_per_s)
    after_two = window_summary(shifted, 2)
    assert after_two.steps == len(steps) - 2
    assert after_two.duration_s == pytest.approx(steps[-1].t - steps[1].t)
    with pytest.raises(ValueError, match="warmup_steps"):
        window_start(shifted, len(steps))


def test_dynamic_filtering_is_simulated_and_fitted():
    # A quarter of the finished groups dropped for equal rewards costs a quarter more
    # generation per trained group; calibration recovers the share from the drops.
    base = presets.local_runtime(target_steps=30)
    filtered = with_overrides(base, {"workload.filtered_fraction": 0.25})
    trace = MemoryTrace()
    result = simulate(filtered, trace=trace)
    drops = [e for e in trace.events if e.kind == "drop"]
    assert "filtered" in {e["reason"] for e in drops}
    assert result.samples_per_s < simulate(base).samples_per_s
    _, fitted = fit_scenario(trace.events)
    assert fitted["filtered_fraction"] == pytest.approx(0.25, abs=0.05)
    with pytest.raises(ValueError, match="filtered_fraction"):
        with_overrides(base, {"workload.filtered_fraction": 1.0})
