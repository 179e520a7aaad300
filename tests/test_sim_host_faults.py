"""Faults on the serial host (sim/entities/host.py), fired as the deterministic runtime fires them.

The fault clock is logical, ``rounds · host.round_s`` (1 s per round here): a timed
fault fires before the first round at or after its ``at_s``; a step fault after that
step's compute, before its push or save. Costs are the ones of tests/test_sim_host.py:
one worker of 8 slots (2 groups of 4 samples), 2 groups per step, 4-token prompts and
6-token completions, chunks of 4 decode steps; pull and push 0.002 s each.
"""

import statistics

import pytest
from test_sim_host import COSTS
from test_sim_host import _serial as serial_scenario

from rlaxkit.rules.fault_plan import Fault, FaultPlan
from rlaxkit.rules.trace import MemoryTrace, summarize
from sim import (
    HostSpec,
    PreemptionSpec,
    Uniform,
    calibrate,
    with_overrides,
)
from sim.engine import Simulation


def _serial(faults, *, steps=3, **changes):
    """test_sim_host's serial scenario, checkpointing every step, with ``faults``."""
    overrides = {k: changes.pop(k) for k in list(changes) if "." in k}
    plan = {"checkpointing.every_steps": 1, "fault_plan": FaultPlan(tuple(faults))}
    return serial_scenario(target_steps=steps, **changes, **(plan | overrides))


def _run(scenario):
    trace = MemoryTrace()
    simulation = Simulation(scenario, trace=trace)
    return simulation, simulation.run(), trace.events


def test_worker_and_trainer_preemption_exact_event_log():
    # Round 0 (clock 0): pull 0.002; issue groups 0, 1 (8 sequences x 0.0003); a chunk
    # of 4 steps starting 8 (0.018) ends at 0.0224; host 0.0004 (0.0228).
    # Round 1 (clock 1): worker-0 is preempted before it, down until clock 3; its two
    # groups are re-issued. Rounds at clocks 1 and 2 have no live worker (no time).
    # Round 3: it restarts, pulls (0.0248), takes groups 0 and 1 again (0.0272), and
    # the chunk ends at 0.0452 (host: 0.0456). Round 4: the last 2 steps finishing 8
    # (0.0136, t = 0.0592), scoring 0.0028 (0.062), host 0.0008 (0.0628); train 80
    # tokens / 8000 + step_s 0.001: step 1 at 0.0738, push 0.0758, checkpoint 1.
    # Rounds 5, 6 as 3, 4 with a pull first and 0.003 for the first chunk after a step:
    # step 2 at 0.1298. Its fault fires now (clock 7): the trainer is preempted, down
    # until clock 8, with no push or save. Round 7 issues nothing (η = 0, the two
    # groups of step 2 still count as trained) and takes no time; at clock 8 the
    # trainer restores checkpoint 1 (step 2's train_step is discarded, its groups go
    # back to the buffer), pushes version 1 (0.1318) and trains them again: step 2 at
    # 0.1428, push 0.1448. Step 3 then takes one more round pair: 0.1988, push 0.2008.
    plan = [
        Fault(kind="preempt_worker", target="worker-0", at_s=1.0, restart_after_s=2.0),
        Fault(kind="preempt_trainer", at_step=2, restart_after_s=1.0),
    ]
    simulation, result, events = _run(_serial(plan))
    log = [
        (round(e.t, 9), e.kind, e.actor, e.version)
        for e in events
        if e.kind not in ("generation_start", "generation_end", "run_start")
    ]
    assert log == [
        (0.002, "pull", "worker-0", 0),
        (0.0224, "decode", "worker-0", 0),
        (0.0228, "preemption", "worker-0", None),
        (0.0228, "restart", "worker-0", None),
        (0.0248, "pull", "worker-0", 0),
        (0.0452, "decode", "worker-0", 0),
        (0.0592, "decode", "worker-0", 0),
        (0.062, "reward", "verifier", None),
        (0.0738, "train_step", "trainer", 1),
        (0.0758, "push", "trainer", 1),
        (0.0758, "checkpoint_save", "trainer", 1),
        (0.0778, "pull", "worker-0", 1),
        (0.1012, "decode", "worker-0", 1),
        (0.1152, "decode", "worker-0", 1),
        (0.118, "reward", "verifier", None),
        (0.1298, "train_step", "trainer", 2),
        (0.1298, "preemption", "trainer", 2),
        (0.1298, "restart", "trainer", 2),
        (0.1298, "checkpoint_restore", "trainer", 1),
        (0.1318, "push", "trainer", 1),
        (0.1428, "train_step", "trainer", 2),
        (0.1448, "push", "trainer", 2),
        (0.1448, "checkpoint_save", "trainer", 2),
        (0.1468, "pull", "worker-0", 2),
        (0.1702, "decode", "worker-0", 2),
        (0.1842, "decode", "worker-0", 2),
        (0.187, "reward", "verifier", None),
        (0.1988, "train_step", "trainer", 3),
        (0.2008, "push", "trainer", 3),
        (0.2008, "checkpoint_save", "trainer", 3),
    ]
    preemption = next(e for e in events if e.kind == "preemption" and e.actor == "worker-0")
    assert preemption["reissued"] == 2 and preemption["down_s"] == 2.0
    assert (
        next(e for e in events if e.actor == "trainer" and e.kind == "preemption")["lost_steps"]
        == 1
    )
    assert [e.get("discarded", False) for e in events if e.kind == "train_step"] == [
        False,
        True,
        False,
        False,
    ]
    # Groups 0 and 1 were started twice (8 sequences lost), each group trained once.
    starts = [e["rollout"] for e in events if e.kind == "generation_start"]
    assert [starts.count(str(g)) for g in range(6)] == [8, 8, 4, 4, 4, 4]
    assert simulation.host is not None and simulation.host.rounds == 10  # clocks 0-9
    assert result.steps == 3 and result.lost_steps == 1
    assert simulation.counters.lost_compute_s == pytest.approx(0.010)
    assert result.goodput == pytest.approx(0.030 / 0.1988)  # 3 kept steps of 0.010 s, to step 3
    assert summarize(events).steps == 3  # the discarded step does not count
    assert dict(result.preemptions) == {"worker": 1, "trainer": 1}


def test_slice_and_slow_worker_on_the_logical_clock():
    # Two workers in one slice: both go down at clock 2 for 3 s and come back at 5.
    # worker-1 is slowed 2x from clock 0 for 100 s: it decodes every other round.
    plan = [
        Fault(kind="slow_worker", target="worker-1", at_s=0.0, factor=2.0, duration_s=100.0),
        Fault(kind="preempt_slice", target="slice-0", at_s=2.0, restart_after_s=3.0),
    ]
    scenario = _serial(plan, workers=2, eta=1, steps=4, **{"fleet.workers_per_slice": 2})
    _, result, events = _run(scenario)
    down = [(e.actor, e.kind) for e in events if e.kind in ("preemption", "restart")]
    assert down == [
        ("worker-0", "preemption"),
        ("worker-1", "preemption"),
        ("worker-0", "restart"),
        ("worker-1", "restart"),
    ]
    assert dict(result.preemptions) == {"slice": 1}
    chunks = [e.actor for e in events if e.kind == "decode"]
    # Round 0: worker-0 only (worker-1's credit is 0.5), round 1: both.
    assert chunks[:3] == ["worker-0", "worker-0", "worker-1"]
    assert result.steps == 4


def test_serial_host_refuses_what_it_does_not_model():
    with pytest.raises(ValueError, match=r"fault_plan\[0\]\.kind.*kill_param_server"):
        _serial([Fault(kind="kill_param_server", at_s=1.0)])
    with pytest.raises(ValueError, match=r"host\.executor.*random preemptions"):
        with_overrides(_serial([]), {"preemptions": PreemptionSpec(worker_mtbf_s=60.0)})
    with pytest.raises(ValueError, match="no worker named 'worker-5'"):
        Simulation(_serial([Fault(kind="preempt_worker", target="worker-5", at_s=1.0)]))


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("pull_mode", ["between_requests", "in_flight"])
@pytest.mark.parametrize("recovery", ["reissue", "drop"])
def test_books_balance_under_every_fault(pull_mode, recovery, overlap):
    # Three workers of random lengths, η = 2, checkpoints every 3 steps; the plan takes
    # workers, a slice and the trainer down (timed and at steps), twice the same step.
    plan = [
        Fault(kind="preempt_worker", target="worker-0", at_s=3.0, restart_after_s=4.0),
        Fault(kind="preempt_trainer", at_step=4, restart_after_s=2.0),
        Fault(kind="preempt_slice", target="slice-1", at_s=9.0, restart_after_s=1.0),
        Fault(kind="preempt_trainer", at_s=15.0, restart_after_s=6.0),
        Fault(kind="preempt_worker", target="worker-2", at_step=7, restart_after_s=0.0),
        Fault(kind="slow_worker", target="worker-1", at_s=20.0, factor=3.0, duration_s=10.0),
        Fault(kind="preempt_trainer", at_step=10),
        Fault(kind="preempt_trainer", at_step=14),  # the last: restored, step 14 redone
    ]
    scenario = _serial(
        plan,
        workers=3,
        eta=2,
        steps=14,
        response=Uniform(low=1.0, high=14.0),
        **{
            "checkpointing.every_steps": 3,
            "fleet.workers_per_slice": 2,
            "weight_sync.pull_mode": pull_mode,
            "recovery.worker_lost": recovery,
            "recovery.trainer_lost": "requeue" if recovery == "reissue" else "drop",
            "trainer.restart_s": 2.0,
            # The rounds beside each step run only while no fault is due or active.
            "host": HostSpec(executor="serial", chunk_steps=4, overlap_training=overlap, **COSTS),
        },
    )
    simulation, result, events = _run(scenario)
    issued = len({e["rollout"] for e in events if e.kind == "generation_start"})
    ledger = simulation.buffer.ledger
    ledger.check(issued)  # every group in flight, ready, trained or dropped; none lost
    assert result.steps == 14 and len(ledger.trained) == 14 * 2
    assert result.lost_steps >= 3 and result.preemptions["trainer"] == 4
    assert 14 in {e["step"] for e in events if e.kind == "train_step" and e.discarded}
    assert max(result.staleness) <= 2
    kept = [e for e in events if e.kind == "train_step" and not e.discarded]
    assert [e["step"] for e in kept] == list(range(1, 15))
    if recovery == "drop":
        assert {"preempted", "trainer_preempted"} <= set(result.drops)


PLAN = [
    Fault(kind="preempt_worker", target="worker-0", at_s=8.0, restart_after_s=3.0),
    Fault(kind="preempt_trainer", at_step=9, restart_after_s=2.0),
    Fault(kind="preempt_worker", target="worker-1", at_s=30.0, restart_after_s=1.0),
]


def _truth(plan, steps=24, seed=0):
    scenario = _serial(
        plan,
        workers=2,
        eta=1,
        steps=steps,
        response=Uniform(low=1.0, high=12.0),
        **{"checkpointing.every_steps": 5, "seed": seed},
    )
    return _run(scenario)[2]


def test_calibration_replays_the_plan_on_the_logical_clock():
    # Fitted on a fault-free serial trace (exact costs), the plan replayed predicts the
    # runs that had it: the same decisions; only the random lengths differ, so the
    # prediction (8 seeds) is compared with the mean of 8 runs of other seeds.
    plan = FaultPlan(tuple(PLAN))
    runs = [calibrate(_truth(PLAN, seed=seed), warmup_steps=3, faults=plan) for seed in range(1, 9)]
    truth = {
        k: statistics.fmean(r.measured_figures[k] for r in runs) for k in runs[0].measured_figures
    }
    prediction = calibrate(_truth([]), warmup_steps=3, faults=plan, repeats=8)
    assert len(prediction.scenario.fault_plan) == 3
    assert prediction.predicted.steps == 24  # the faults' run, not a diluted longer one
    predicted = prediction.predicted_figures
    assert truth["lost_steps"] == 4 and predicted["lost_steps"] == pytest.approx(4.0)
    for figure in ("samples_per_s", "goodput", "lost_samples"):
        assert predicted[figure] == pytest.approx(truth[figure], rel=0.1), figure
    assert abs(predicted["staleness_mean"] - truth["staleness_mean"]) < 0.1


def test_calibration_needs_the_plan_of_a_faulty_serial_run():
    with pytest.raises(ValueError, match=r"faults: the trace records \d+ preemptions"):
        calibrate(_truth(PLAN), warmup_steps=3)


def test_fidelity_benchmark_runs_on_simulated_runs():
    # benchmarks/sim_fidelity.py's logic, with simulated runs standing in for real ones.
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "sim_fidelity.py"
    spec = importlib.util.spec_from_file_location("sim_fidelity", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    plans = {"none": FaultPlan(), "faults": FaultPlan(tuple(PLAN))}
    report = bench.fidelity(
        lambda plan, steps: _truth(list(plan), steps=steps),
        steps=16,
        warmup_steps=3,
        repeats=2,
        plans=plans,
    )
    expected = {f"{f}_err" for f in bench.FIGURES} | {"plans", "lost_samples_where_none_measured"}
    assert set(report) == expected
    assert report["plans"]["none"]["errors"]["lost_samples"] is None  # none lost: no ratio
    assert report["plans"]["faults"]["measured"]["lost_steps"] > 0
