"""A scenario the simulator cannot run (random preemptions that would explode, an
infinite cost, a value of the wrong type) is refused before it runs, naming the field
and the fix; extreme values it can run, it runs to the end."""

import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sim
from sim.presets import local_runtime, toy
from sim.scenario import MAX_EXPECTED_PREEMPTIONS


def test_a_tiny_worker_mtbf_is_refused_at_once():
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"preemptions\.worker_mtbf_s: 1e-09 s gives about") as err:
        sim.simulate(sim.with_overrides(toy(), {"preemptions.worker_mtbf_s": 1e-9}))
    assert time.perf_counter() - start < 1.0
    # toy: one worker over a 30-day horizon; the limit is met at 2_592_000 s / 1e6.
    assert "raise preemptions.worker_mtbf_s (above 2.59 s" in str(err.value)
    assert "or shorten horizon_s" in str(err.value)


def test_expected_preemptions_sum_every_kind():
    scenario = sim.with_overrides(
        local_runtime(num_workers=4),
        {
            "fleet.workers_per_slice": 2,
            "preemptions.worker_mtbf_s": 8.0,
            "preemptions.slice_mtbf_s": 20.0,
            "preemptions.trainer_mtbf_s": 15.0,
        },
    )
    # 86_400 s · (4 / 8 + 2 / 20 + 1 / 15) = 43_200 + 8_640 + 5_760
    assert scenario.expected_preemptions == pytest.approx(57_600.0)


def test_the_dominant_kind_is_named_and_a_shorter_horizon_is_accepted():
    overrides = {"preemptions.trainer_mtbf_s": 1e-3, "preemptions.worker_mtbf_s": 3600.0}
    with pytest.raises(ValueError, match=r"preemptions\.trainer_mtbf_s: 0\.001 s"):
        sim.with_overrides(toy(), overrides)
    horizon_s = 0.5 * MAX_EXPECTED_PREEMPTIONS * 1e-3
    scenario = sim.with_overrides(toy(), {**overrides, "horizon_s": horizon_s})
    assert scenario.expected_preemptions <= MAX_EXPECTED_PREEMPTIONS


@pytest.mark.parametrize(
    ("override", "message"),
    [
        # An infinite step time: SimPy raised ZeroDivisionError from its core.
        ({"trainer.model_params": math.inf}, r"model_params: must be a finite number > 0"),
        ({"trainer.step_overhead_s": math.inf}, r"step_overhead_s: must be a finite number"),
        # A string where a number goes: a TypeError from a comparison inside a policy.
        ({"checkpointing.every_s": "x"}, r"every_s: must be a number > 0 or None, got 'x'"),
        # A list of faults: AttributeError in the fault injector once the run started.
        ({"fault_plan": [{"kind": "preempt_trainer", "at_s": 1}]}, r"fault_plan: must be"),
        ({"seed": -1}, r"seed: must be an integer >= 0, got -1"),  # NumPy's own error
    ],
)
def test_values_the_simulator_cannot_run_are_refused_naming_the_field(override, message):
    with pytest.raises(ValueError, match=message):
        sim.with_overrides(sim.presets.toy(target_steps=2), override)


@pytest.mark.parametrize("rate", [1e9, 1e12, math.inf])
def test_a_pull_faster_than_the_clock_resolves_finishes(rate):
    """The last bytes of a fast pull need less time than the clock can add to ``now``:
    their timer fired at ``now`` again and again, and the run never ended."""
    scenario = sim.with_overrides(
        sim.presets.toy(target_steps=4), {"param_server.pull_bytes_per_s": rate}
    )
    result = sim.simulate(scenario)
    assert result.steps == 4 and result.samples_per_s == pytest.approx(0.5, rel=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    eta=st.integers(0, 3),
    lag=st.integers(0, 3),
    push_every=st.integers(1, 3),
    workers=st.integers(1, 3),
    prompts=st.integers(1, 2),
    pull_mode=st.sampled_from(["between_requests", "in_flight"]),
)
def test_a_staleness_setting_admission_accepts_reaches_its_target(
    eta, lag, push_every, workers, prompts, pull_mode
):
    """``rlaxkit.rules.policies.check_admission`` refuses the settings under which a fleet can
    make nothing the trainer takes; whatever it lets through, the simulator runs to its
    target within the horizon (no stall, no endless round of stale drops)."""
    overrides = {
        "target_steps": 6,
        "staleness.max_staleness": eta,
        "staleness.max_worker_lag": lag,
        "weight_sync.push_every_steps": push_every,
        "weight_sync.pull_mode": pull_mode,
        "fleet.num_workers": workers,
        "workload.prompts_per_step": prompts,
    }
    try:
        scenario = toy(**overrides)
    except ValueError as error:
        assert eta < lag + push_every - 1, error
        return
    assert sim.simulate(scenario).steps == 6
