"""Faults in the simulator: preemptions keep finished work and lose the rest; the
same FaultPlan format as the runtime drives them. Timings as in test_sim_events."""

import pytest

from rlaxkit.rules.fault_plan import Fault, FaultPlan
from rlaxkit.rules.trace import MemoryTrace
from sim import presets, simulate, with_overrides


def _toy(*faults, **overrides):
    return with_overrides(presets.toy(**overrides), {"fault_plan": FaultPlan(tuple(faults))})


def _log(trace, *kinds):
    return [(round(e.t, 9), e.kind, e.actor) for e in trace.events if e.kind in kinds]


def test_worker_preemption_exact_log():
    # Preempted at 1.0 s mid-decode: the group is lost and, as the runtime does, issued
    # again with the same id (nothing dropped); the worker is back at 4.0 s, pulls until
    # 4.5 s and decodes it until 6.0 s.
    fault = Fault(kind="preempt_worker", target="worker-0", at_s=1.0, restart_after_s=3.0)
    trace = MemoryTrace()
    result = simulate(_toy(fault, target_steps=1), trace=trace)
    assert _log(trace, "preemption", "drop", "restart", "pull", "generation_end", "train_step") == [
        (0.5, "pull", "worker-0"),
        (1.0, "preemption", "worker-0"),
        (4.0, "restart", "worker-0"),
        (4.5, "pull", "worker-0"),
        (6.0, "generation_end", "worker-0"),
        (6.0, "generation_end", "worker-0"),
        (7.75, "train_step", "trainer"),
    ]
    ends = {e["rollout"] for e in trace.events if e.kind == "generation_end"}
    assert result.drops == {} and ends == {"0"}  # group 0, generated again
    assert result.preemptions == {"worker": 1}


def test_worker_preemption_drops_under_the_drop_policy():
    # RecoveryPolicy(worker_lost="drop"): the lost group is dropped and a new one issued.
    fault = Fault(kind="preempt_worker", target="worker-0", at_s=1.0, restart_after_s=3.0)
    scenario = with_overrides(_toy(fault, target_steps=1), {"recovery.worker_lost": "drop"})
    trace = MemoryTrace()
    result = simulate(scenario, trace=trace)
    assert (1.0, "drop", "buffer") in _log(trace, "drop")
    assert result.drops == {"preempted": 1} and result.time_to_step(1) == pytest.approx(7.75)


def test_finished_samples_awaiting_reward_survive_preemption():
    # Decoding ends at 2.0 s, rewards at 2.25 s: a preemption at 2.1 s loses nothing.
    fault = Fault(kind="preempt_worker", target="worker-0", at_s=2.1, restart_after_s=3.0)
    result = simulate(_toy(fault, target_steps=1))
    assert result.drops == {}
    assert result.time_to_step(1) == pytest.approx(3.75)


def test_trainer_preemption_loses_steps_since_checkpoint():
    fault = Fault(kind="preempt_trainer", at_step=3, restart_after_s=5.0)
    scenario = _toy(
        fault,
        target_steps=4,
        **{"checkpointing.every_steps": 2, "checkpoint.save_s": 0.5, "checkpoint.restore_s": 2.0},
    )
    trace = MemoryTrace()
    result = simulate(scenario, trace=trace)
    assert result.lost_steps == 1
    assert result.steps == 4
    preemption = next(e for e in trace.events if e.kind == "preemption")
    assert (preemption.version, preemption["lost_steps"]) == (2, 1)
    restore = next(e for e in trace.events if e.kind == "checkpoint_restore")
    assert (restore["step"], restore["duration_s"]) == (2, 2.0)
    saves = [e["step"] for e in trace.events if e.kind == "checkpoint_save"]
    assert saves == [2, 4]
    # Lost compute counts against goodput, not against utilisation.
    assert result.goodput < result.trainer_utilisation
    assert result.goodput == pytest.approx(4 * 1.5 / result.time_to_step(4))


def test_slice_preemption_is_correlated():
    fault = Fault(kind="preempt_slice", target="slice-1", at_s=1.0)
    scenario = _toy(fault, **{"fleet.num_workers": 4, "fleet.workers_per_slice": 2})
    trace = MemoryTrace()
    result = simulate(scenario, trace=trace)
    down = [(e.t, e.actor) for e in trace.events if e.kind == "preemption"]
    assert down == [(1.0, "worker-2"), (1.0, "worker-3")]
    assert result.preemptions == {"slice": 1, "worker": 2}


def test_killed_store_delays_pulls():
    fault = Fault(kind="kill_param_server", at_s=0.0, restart_after_s=2.0)
    trace = MemoryTrace()
    simulate(_toy(fault, target_steps=1), trace=trace)
    pull = next(e for e in trace.events if e.kind == "pull")
    assert (pull.t, pull["duration_s"]) == (2.5, 2.5)


def test_slow_worker_and_failed_pull():
    slow = Fault(kind="slow_worker", target="worker-0", at_s=0.0, factor=2.0, duration_s=100.0)
    trace = MemoryTrace()
    simulate(_toy(slow, target_steps=1), trace=trace)
    # Per-token time doubles (prefill does not): 0.5 + 0.5 + 2.0.
    assert [e.t for e in trace.events if e.kind == "generation_end"] == [3.0, 3.0]

    fail = Fault(kind="fail_pull", target="worker-0", at_s=0.0)
    trace = MemoryTrace()
    simulate(_toy(fail, target_steps=1), trace=trace)
    # 0.5 s transfer fails, 5 s retry wait, 0.5 s transfer.
    assert _log(trace, "fault", "pull") == [(0.5, "fault", "worker-0"), (6.0, "pull", "worker-0")]


def test_hung_reward_drops_group_after_timeout():
    hang = Fault(kind="hang_reward", at_s=0.0)
    scenario = _toy(hang, target_steps=1, **{"verifier.timeout_s": 10.0})
    result = simulate(scenario)
    assert result.drops == {"reward_timeout": 1}
    # Dropped at 2.0 + 10 s; re-admitted and decoded 12.0-13.5; reward 13.75; step.
    assert result.time_to_step(1) == pytest.approx(15.25)


def test_in_flight_updates_span_versions_and_count_from_oldest():
    scenario = presets.areal_like(max_staleness=2, target_steps=10, pull_mode="in_flight")
    trace = MemoryTrace()
    result = simulate(scenario, trace=trace)
    ends = [e for e in trace.events if e.kind == "generation_end"]
    spanning = [e for e in ends if e["first_version"] < e.version]
    assert spanning, "some generations should have been interrupted by a weight update"
    assert max(result.staleness) <= 2


def test_random_preemptions_at_fleet_scale():
    scenario = with_overrides(
        presets.rlax_like(inference_chips=128, hours=6.0),
        {"preemptions.worker_mtbf_s": 3 * 3600.0, "preemptions.trainer_mtbf_s": 2 * 3600.0},
    )
    result = simulate(scenario)
    assert result.preemptions["worker"] > 5
    assert result.preemptions.get("trainer", 0) >= 1
    assert result.steps > 0 and max(result.staleness) <= 2


def test_unknown_fault_target_is_rejected():
    fault = Fault(kind="preempt_worker", target="worker-9", at_s=1.0)
    with pytest.raises(ValueError, match=r"fault_plan\[0\]\.target"):
        simulate(_toy(fault))


@pytest.mark.parametrize("mode", ["between_requests", "in_flight"])
@pytest.mark.parametrize("pauses_fleet", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_heavy_faults_keep_every_invariant(mode, pauses_fleet, seed):
    """Frequent worker, slice and trainer preemptions plus every other fault kind: the
    run still finishes, staleness stays within η, and every group is accounted for."""
    from sim import Simulation

    plan = FaultPlan(
        (
            Fault(kind="kill_param_server", at_s=3.0, restart_after_s=1.0),
            Fault(kind="slow_worker", target="worker-1", at_s=2.0, factor=3.0, duration_s=5.0),
            Fault(kind="fail_pull", at_step=2, count=2),
            Fault(kind="hang_reward", at_step=4, count=3),
        )
    )
    scenario = with_overrides(
        presets.local_runtime(
            num_workers=4, max_staleness=2, target_steps=30, pauses_fleet=pauses_fleet, seed=seed
        ),
        {
            "weight_sync.pull_mode": mode,
            "fleet.workers_per_slice": 2,
            "preemptions.worker_mtbf_s": 8.0,
            "preemptions.slice_mtbf_s": 20.0,
            "preemptions.trainer_mtbf_s": 15.0,
            "checkpointing.every_steps": 3,
            "verifier.timeout_s": 1.0,
            "fault_plan": plan,
        },
    )
    simulation = Simulation(scenario)
    result = simulation.run()
    assert result.steps == 30
    assert max(result.staleness) <= 2
    buffer = simulation.buffer
    trained = sum(result.staleness.values())  # the surviving steps' groups
    assert trained == 30 * scenario.staleness.batch_size == len(buffer.ledger.trained)
    created = simulation.draws.created
    assert created == trained + sum(result.drops.values()) + buffer.running + len(buffer.ready)
    buffer.ledger.check(created)  # the runtime's accounting invariant, on the same books
    assert buffer.ledger.accepted_lost() == []
    assert simulation.host_active == sum(w.active for w in simulation.workers) >= 0
