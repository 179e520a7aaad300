"""The serial host (sim/entities/host.py): hand-derived timings, exact fits, clear errors."""

import pytest

from rlaxkit.rules.fault_plan import Fault, FaultPlan
from rlaxkit.rules.trace import MemoryTrace, step_span
from sim import (
    Constant,
    HostSpec,
    ParamServerSpec,
    PreemptionSpec,
    TrainerCostSpec,
    Uniform,
    calibrate,
    fit_scenario,
    presets,
    simulate,
    with_overrides,
)
from sim.host_spec import HOST_COSTS

COSTS = {
    "chunk_s": 0.010,
    "chunk_s_per_step": 0.001,
    "prefill_s_per_seq": 0.0005,
    "finish_s_per_seq": 0.0002,
    "chunk_s_after_step": 0.003,
    # What the fit takes when no rebuild is measured: a prefill of each of the 8 rows.
    "rebuild_s": 0.004,
    "score_s": 0.002,
    "score_s_per_seq": 0.0001,
    "issue_s_per_seq": 0.0003,
    "chunk_host_s": 0.0004,
    "sample_s": 0.00005,
    "step_s": 0.001,
}


def _serial(*, workers=1, eta=0, response=None, target_steps=3, **overrides):
    """One worker of 8 slots (2 groups of 4), 2 groups per step, 4-token prompts;
    pushes and pulls take their 2 ms latency (no bytes); 8000 trained tokens/s."""
    base = presets.local_runtime(num_workers=workers, max_staleness=eta, target_steps=target_steps)
    return with_overrides(
        base,
        {
            "host": HostSpec(executor="serial", chunk_steps=4, **COSTS),
            "trainer": TrainerCostSpec.from_rate(tokens_per_s=8000.0),
            "param_server": ParamServerSpec(
                weight_bytes=0.0, push_bytes_per_s=1.0, pull_bytes_per_s=1.0, latency_s=0.002
            ),
            "fleet.slots_per_worker": 8,
            "workload.prompts_per_step": 2,
            "workload.prompt_tokens": Constant(value=4.0),
            "workload.response_tokens": response or Constant(value=6.0),
            **overrides,
        },
    )


def test_synchronous_serial_host_exact_timeline():
    # Round 1: pull 0.002; issue 2 groups = 8 seqs x 0.0003 = 0.0024 (t = 0.0044); chunk
    # of 4 steps starting 8: 0.010 + 0.004 + 8 x 0.0005 = 0.018 (t = 0.0224); nothing
    # complete: host 0.0004 (t = 0.0228). Round 2: chunk of the last 2 steps finishing
    # 8: 0.010 + 0.002 + 8 x 0.0002 = 0.0136 (t = 0.0364); scoring 0.002 + 8 x 0.0001 =
    # 0.0028 (t = 0.0392); host 0.0004 + 8 x 0.00005 = 0.0008 (t = 0.0400). Train 80
    # tokens / 8000 = 0.010 + step_s 0.001: train_step at 0.051, push ends at 0.053.
    # Every later step adds the pull 0.002, the same rounds with 0.003 more for the
    # first chunk after a train step, and the train step and push: 0.056 s.
    trace = MemoryTrace()
    result = simulate(_serial(), trace=trace)
    chunks = [(round(e.t, 9), e["rows"], e["started"], e["finished"], e["steps"])
              for e in trace.events if e.kind == "decode"]  # fmt: skip
    assert chunks[:4] == [
        (0.0224, 8, 8, 0, 4),
        (0.0364, 8, 0, 8, 2),
        (0.0784, 8, 8, 0, 4),  # 0.053 + 0.002 + 0.0024 + 0.018 + 0.003
        (0.0924, 8, 0, 8, 2),
    ]
    steps = [e.t for e in trace.events if e.kind == "train_step"]
    assert steps == pytest.approx([0.051, 0.107, 0.163])
    assert result.samples_per_s == pytest.approx(3 * 8 / 0.163)
    assert result.staleness == {0: 6}  # eta = 0: on-policy
    rewards = [e for e in trace.events if e.kind == "reward"]
    assert [e["samples"] for e in rewards] == [8, 8, 8]
    assert [e["duration_s"] for e in rewards] == pytest.approx([0.0028] * 3)


def test_overlapped_serial_host_exact_timeline():
    # η = 1. Step 1 as above: its batch at 0.0400, its compute 0.010. Beside it, the
    # rounds of step 2's batch on version 0: issue 0.0024 and the first chunk 0.018
    # (t = 0.0604), host 0.0004; the last chunk 0.0136 (t = 0.0744), scoring 0.0028 and
    # host 0.0008 (t = 0.0780). The step waits for them, then step_s: train_step at
    # 0.079, push until 0.081. Step 2's batch is ready; beside its compute: the pull
    # 0.002, issue 0.0024, the first chunk 0.018 + 0.003 after a step (t = 0.1064), then
    # as before: train_step at 0.125. Each later step adds 0.046 (0.056 serially).
    trace = MemoryTrace()
    host = HostSpec(executor="serial", chunk_steps=4, overlap_training=True, **COSTS)
    result = simulate(_serial(eta=1, target_steps=4, host=host), trace=trace)
    chunks = [(round(e.t, 9), e.version) for e in trace.events if e.kind == "decode"]
    assert chunks[:6] == [
        (0.0224, 0),
        (0.0364, 0),
        (0.0604, 0),
        (0.0744, 0),
        (0.1064, 1),
        (0.1204, 1),
    ]
    steps = [e for e in trace.events if e.kind == "train_step"]
    assert [e.t for e in steps] == pytest.approx([0.079, 0.125, 0.171, 0.217])
    assert result.staleness == {0: 2, 1: 6}  # each later batch sampled a version back
    # The event comes after the rounds and step_s; the compute ran beside the rounds.
    assert [step_span(e) for e in steps[:2]] == [
        pytest.approx((0.040, 0.050)),
        pytest.approx((0.081, 0.091)),
    ]
    with pytest.raises(ValueError, match="overlap_training: a setting of the serial host"):
        HostSpec(overlap_training=True)


def test_fit_recovers_the_serial_host_from_its_own_trace():
    # Two workers at eta = 1 with lengths of 1-12 tokens: chunks start, finish and step
    # in every combination, so every cost is identifiable and the fit is exact.
    truth = _serial(workers=2, eta=1, response=Uniform(low=1.0, high=12.0), target_steps=40)
    trace = MemoryTrace()
    simulate(truth, trace=trace)
    scenario, fitted = fit_scenario(trace.events)
    assert scenario.host.serial and scenario.host.chunk_steps == 4
    for name in HOST_COSTS:
        assert getattr(scenario.host, name) == pytest.approx(COSTS[name], abs=1e-9), name
        assert fitted[f"host_{name}"] == pytest.approx(COSTS[name], abs=1e-9)
    assert fitted["trainer_tokens_per_s"] == pytest.approx(8000.0)
    assert fitted["push_s"] == pytest.approx(0.002) and fitted["pull_s"] == pytest.approx(0.002)


def test_a_pull_in_flight_rebuilds_the_rows_and_their_next_chunk_waits_for_it():
    in_flight = {"weight_sync.pull_mode": "in_flight"}
    kind = {"response": Uniform(low=1.0, high=12.0), "target_steps": 40}
    truth = _serial(workers=2, eta=1, **kind, **in_flight)
    truth = with_overrides(truth, {"host.rebuild_s": 0.007})
    trace = MemoryTrace()
    simulate(truth, trace=trace)
    events = trace.events
    rebuilds = [i for i, e in enumerate(events) if e.kind == "pull" and e.get("rebuilt")]
    assert len(rebuilds) >= 5
    # The rebuilt worker's next chunk costs its decode, prefills and finishes plus 7 ms.
    host = truth.host
    for i in rebuilds:
        pull = events[i]
        chunk = next(e for e in events[i + 1 :] if e.kind == "decode" and e.actor == pull.actor)
        cost = host.chunk_time_s(chunk["steps"], chunk["started"], chunk["finished"])
        if not chunk.get("pipelined"):
            assert chunk["duration_s"] - cost in (pytest.approx(0.007), pytest.approx(0.010))
    # Fitted back exactly; between requests the same run rebuilds nothing.
    scenario, fitted = fit_scenario(events)
    assert scenario.host.rebuild_s == pytest.approx(0.007, abs=1e-9)
    assert fitted["host_rebuilt_chunks"] >= 3
    between = MemoryTrace()
    simulate(_serial(workers=2, eta=1, **kind), trace=between)
    assert not any(e.kind == "pull" and e.get("rebuilt") for e in between.events)
    # Calibrated between requests, a prediction in flight says its rebuilds are estimated.
    prediction = calibrate(between.events, overrides=in_flight)
    assert any("rebuilt a worker's KV cache 0 times" in s for s in prediction.extrapolations)
    assert calibrate(events, overrides=in_flight).extrapolations == ()


@pytest.mark.parametrize("overrides", [{"staleness.max_staleness": 0}, {"fleet.num_workers": 1}])
def test_calibrated_serial_host_predicts_another_setting(overrides):
    # Fitted on an eta = 1, two-worker run, predict a run with other settings.
    kind = {"response": Uniform(low=1.0, high=12.0), "target_steps": 30}
    fitted_on = MemoryTrace()
    simulate(_serial(workers=2, eta=1, **kind), trace=fitted_on)
    second = simulate(with_overrides(_serial(workers=2, eta=1, **kind), {**overrides, "seed": 7}))
    prediction = calibrate(fitted_on.events, overrides=overrides)
    assert prediction.predicted.samples_per_s == pytest.approx(second.samples_per_s, rel=0.05)


def test_calibration_simulates_a_longer_run_than_the_trace():
    trace = MemoryTrace()
    simulate(_serial(target_steps=10), trace=trace)
    result = calibrate(trace.events)
    assert result.scenario.target_steps == 10  # the run as measured
    assert result.predicted.steps == 200  # the prediction: random draws averaged out
    assert abs(result.errors()["samples_per_s"]) < 1e-6  # constant lengths: steady


def test_serial_host_rejects_faults_it_cannot_replay_and_bad_costs():
    # It replays preemptions and slow workers on the runtime's logical clock (tests in
    # test_sim_host_faults.py), not an outage it does not model nor random preemptions.
    plan = FaultPlan((Fault(kind="kill_param_server", at_s=1.0),))
    with pytest.raises(ValueError, match=r"fault_plan\[0\]\.kind: host\.executor 'serial'"):
        with_overrides(_serial(), {"fault_plan": plan})
    with pytest.raises(ValueError, match=r"host\.executor: 'serial'.*random preemptions"):
        with_overrides(_serial(), {"preemptions": PreemptionSpec(worker_mtbf_s=60.0)})
    with pytest.raises(ValueError, match="executor"):
        HostSpec(executor="threads")
    with pytest.raises(ValueError, match="chunk_s_per_step"):
        HostSpec(executor="serial", chunk_s_per_step=-1.0)
    with pytest.raises(ValueError, match="chunk_steps"):
        HostSpec(executor="serial", chunk_steps=0)


def test_serial_scenario_round_trips_through_a_dict(tmp_path):
    from sim import load_scenario, save_scenario, scenario_from_dict, scenario_to_dict

    scenario = _serial(workers=2, eta=1)
    assert scenario_from_dict(scenario_to_dict(scenario)) == scenario
    save_scenario(scenario, tmp_path / "serial.yaml")
    assert load_scenario(tmp_path / "serial.yaml").host == scenario.host


def test_serial_chunks_overlap_nothing():
    # tests/test_threaded_chunks.py's two workers at η = 1, with no work overlapping
    # (a run timed on the CPU clock). Round 1 issues at 0.0088; worker-0's chunk of
    # 0.018 ends at 0.0268, its host time 0.0004 (0.0272); only then worker-1's chunk of
    # 0.018 (0.0452) and its host time (0.0456). Round 2: chunks of 0.0136, each
    # followed by its scoring and host time, 0.0036: 0.0592, 0.0628, 0.0764, 0.0800.
    # Train 0.011: step 1 at 0.091, where one chunk decoding while the host scores the
    # other gives 0.087 and the two decoding at once 0.0594.
    trace = MemoryTrace()
    host = HostSpec(executor="serial", chunk_steps=4, serial_chunks=True, **COSTS)
    simulate(_serial(workers=2, eta=1, target_steps=1, host=host), trace=trace)
    chunks = [(round(e.t, 9), e.actor, round(e["duration_s"], 9), e.get("pipelined", False))
              for e in trace.events if e.kind == "decode"]  # fmt: skip
    assert chunks == [
        (0.0268, "worker-0", 0.018, False),
        (0.0452, "worker-1", 0.018, False),
        (0.0592, "worker-0", 0.0136, False),
        (0.0764, "worker-1", 0.0136, False),
    ]
    assert [e.t for e in trace.events if e.kind == "train_step"] == pytest.approx([0.091])
    with pytest.raises(ValueError, match="serial_chunks: no work overlaps then"):
        HostSpec(executor="serial", serial_chunks=True, threaded_chunks=True)
