"""The host model of the Ray placement's rounds (``HostSpec.concurrent_chunks``,
``worker_start_s``): workers that decode at once, replacement actors that take time to
start, and calibration that recovers both from a trace."""

import dataclasses

import pytest
from test_sim_host import _serial

from rlaxkit.rules.fault_plan import Fault, FaultPlan
from rlaxkit.rules.trace import MemoryTrace, TraceEvent
from sim import Uniform, calibrate, fit_scenario, simulate, with_overrides
from sim.calibration.host import restart_costs


def _concurrent(**kwargs):
    scenario = _serial(**kwargs)
    return with_overrides(scenario, {"host.concurrent_chunks": True})


def test_a_round_of_workers_decoding_at_once_lasts_as_long_as_the_slowest():
    # Two workers with the same chunks: taking turns, a round costs both chunks; at
    # once, one. Everything else (pulls, issues, train steps) is the same work.
    serial, concurrent = MemoryTrace(), MemoryTrace()
    simulate(_serial(workers=2, eta=1, target_steps=6), trace=serial)
    simulate(_concurrent(workers=2, eta=1, target_steps=6), trace=concurrent)
    chunks = {
        name: [e for e in trace.events if e.kind == "decode"]
        for name, trace in (("serial", serial), ("concurrent", concurrent))
    }
    assert [e["duration_s"] for e in chunks["serial"][:1]] == [
        e["duration_s"] for e in chunks["concurrent"][:1]
    ]
    # At once: the first two chunks (one per worker) end together.
    first, second = chunks["concurrent"][:2]
    assert first.actor != second.actor and first.t == pytest.approx(second.t)
    end = {
        name: max(e.t for e in trace.events) for name, trace in (("s", serial), ("c", concurrent))
    }
    assert end["c"] < end["s"]


def test_calibration_recovers_the_concurrent_host_and_predicts_its_own_run():
    truth = _concurrent(workers=2, eta=1, response=Uniform(low=1.0, high=12.0), target_steps=40)
    trace = MemoryTrace()
    simulate(truth, trace=trace)
    scenario, _ = fit_scenario(trace.events)
    host = scenario.host
    assert host.serial and host.concurrent_chunks
    for name in ("chunk_s", "chunk_s_per_step", "prefill_s_per_seq", "finish_s_per_seq"):
        assert getattr(host, name) == pytest.approx(getattr(truth.host, name), abs=1e-9), name
    result = calibrate(trace.events)
    assert abs(result.errors()["samples_per_s"]) < 0.05


def test_a_replacement_worker_holds_up_the_round_of_its_first_pull():
    plan = FaultPlan(
        (Fault(kind="preempt_worker", target="worker-0", at_s=3.0, restart_after_s=1.0),)
    )
    base = _concurrent(workers=2, eta=1, target_steps=20)
    runs = {}
    for start_s in (0.0, 0.5):
        trace = MemoryTrace()
        scenario = with_overrides(base, {"fault_plan": plan, "host.worker_start_s": start_s})
        simulate(scenario, trace=trace)
        runs[start_s] = trace.events
    restart = next(e for e in runs[0.5] if e.kind == "restart")
    pull = next(
        e for e in runs[0.5] if e.kind == "pull" and e.actor == "worker-0" and e.t > restart.t
    )
    assert pull.t - pull["duration_s"] - restart.t >= 0.5 - 1e-9
    end = {k: max(e.t for e in events) for k, events in runs.items()}
    assert end[0.5] - end[0.0] == pytest.approx(0.5, abs=0.05)


def _event(t, kind, actor, **fields):
    return TraceEvent(t, kind, actor, None, fields)


def test_restart_costs_add_a_new_actors_slow_first_pull_and_chunks():
    events = [
        *(_event(0.1 * i, "pull", "worker-1", duration_s=0.01) for i in range(1, 5)),
        *(
            _event(
                0.1 * i + 0.05,
                "decode",
                "worker-1",
                duration_s=0.004,
                rows=1,
                started=0,
                finished=0,
            )
            for i in range(1, 9)
        ),  # fmt: skip
        _event(1.0, "restart", "worker-0"),
        _event(4.0, "worker_start", "worker-0", duration_s=2.5),
        _event(4.3, "pull", "worker-0", duration_s=0.26),  # 0.25 over the median pull
        _event(4.8, "decode", "worker-0", duration_s=0.404, rows=1, started=1, finished=0),
        _event(5.0, "decode", "worker-0", duration_s=0.104, rows=1, started=0, finished=0),
        _event(5.1, "decode", "worker-0", duration_s=0.004, rows=1, started=0, finished=1),
        _event(5.2, "decode", "worker-0", duration_s=0.404, rows=1, started=0, finished=0),
    ]
    # 2.5 + 0.25 + (0.4 + 0.1): the chunks count until the first one at its usual cost.
    assert restart_costs(events) == pytest.approx([3.25])
    assert restart_costs([e for e in events if e.kind != "worker_start"]) == []


def test_concurrent_chunks_must_be_a_bool():
    from sim import HostSpec

    with pytest.raises(ValueError, match="concurrent_chunks"):
        HostSpec(executor="serial", concurrent_chunks="yes")
    assert dataclasses.replace(HostSpec(), worker_start_s=1.0).worker_start_s == 1.0
