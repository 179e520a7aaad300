"""A scenario whose random preemptions would explode is refused before it runs, naming
the field and the fix."""

import time

import pytest

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
