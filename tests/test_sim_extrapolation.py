"""What calibration says beyond its model: the extrapolations of a prediction."""

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
