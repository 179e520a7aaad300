"""What calibration says beyond its model: the extrapolations of a prediction, and a save's
background write read from the steps after it."""

import pytest

from rlaxkit.rules.fault_plan import FaultPlan
from rlaxkit.rules.trace import MemoryTrace
from sim import calibrate, presets, simulate


def _trace(scenario):
    trace = MemoryTrace()
    simulate(scenario, trace=trace)
    return trace.events


def test_a_prediction_beyond_its_calibration_names_the_extrapolation(caplog):
    # Calibrated on a fault-free run of 2 workers; asked about 40 workers with trainer
    # preemptions: both are named, in the report and in the log.
    plan = FaultPlan.from_dicts([{"kind": "preempt_trainer", "at_step": 5}])
    events = _trace(presets.local_runtime(target_steps=10))
    with caplog.at_level("WARNING", logger="sim.calibrate"):
        result = calibrate(events, overrides={"fleet.num_workers": 40, "fault_plan": plan})
    assert len(result.extrapolations) == 2
    assert "'preempt_trainer' never fired" in result.extrapolations[0]
    assert "fleet.num_workers = 40 predicted from a run with 2 (20x)" in result.extrapolations[1]
    assert result.report().count("extrapolated:") == 2
    assert len(caplog.records) == 2
    # The same configuration is no extrapolation.
    assert calibrate(events).extrapolations == ()


def test_a_saves_background_write_is_read_from_the_steps_after_it():
    from rlaxkit.rules.trace import TraceEvent
    from sim.calibration.fits import fit_save_cost

    # Steps 1 s apart; the save after step 10 blocks 0.1 s and its write adds 0.5 s to
    # each of the next three intervals: 0.1 + 1.5 = 1.6 s in all.
    ends, t = [], 0.0
    for step in range(1, 31):
        t += 1.0 + (0.1 if step == 11 else 0.0) + (0.5 if 11 <= step <= 13 else 0.0)
        ends.append(t)
    events = [
        TraceEvent(t, "train_step", "trainer", s, {"step": s, "samples": 4, "duration_s": 0.5})
        for s, t in enumerate(ends, 1)
    ]
    events.append(
        TraceEvent(ends[9] + 0.1, "checkpoint_save", "trainer", 10, {"step": 10, "duration_s": 0.1})
    )
    assert fit_save_cost(events) == pytest.approx(1.6)
    assert fit_save_cost(events[:-1]) is None  # no save
