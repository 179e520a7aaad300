"""SimPy discrete-event simulator of rlaxkit fleets (workers, staleness, preemption).

The simulated trainer, workers, parameter server and verifier call the very same
``rlaxkit.rules.policies`` objects as the runtime, read the same
``rlaxkit.rules.fault_plan`` plans and write the same ``rlaxkit.rules.trace`` events; only
the clock is simulated.

>>> import sim
>>> result = sim.simulate(sim.presets.toy(target_steps=2))
>>> result.steps, result.max_staleness
(2, 0)
"""

from sim import presets
from sim.calibration.calibrate import Calibration, calibrate, fit_scenario
from sim.calibration.window import window_summary
from sim.distributions import (
    Constant,
    Empirical,
    Lognormal,
    LongTail,
    Uniform,
    distribution_from_dict,
    distribution_to_dict,
)
from sim.engine import Simulation, run_config, simulate
from sim.host_spec import HostSpec
from sim.metrics import SimResult
from sim.presets import areal_like, checkpoint_study, local_runtime, planned, rlax_like, toy
from sim.report import staleness_figure, timeline_figure
from sim.scenario import (
    Scenario,
    load_scenario,
    save_scenario,
    scenario_from_dict,
    scenario_to_dict,
    with_overrides,
)
from sim.specs import (
    CheckpointSpec,
    FleetSpec,
    ParamServerSpec,
    PreemptionSpec,
    TrainerCostSpec,
    VerifierSpec,
    WorkloadSpec,
)
from sim.studies.figures import checkpoint_figure, eta_curve_figure, utilisation_figure
from sim.studies.standard import (
    CheckpointStudy,
    EtaPoint,
    async_vs_sync,
    checkpoint_interval_study,
    eta_curve,
    young_daly_interval_s,
)
from sim.studies.sweep import SweepPoint, format_table, sweep
from sim.studies.tune import RUN_CONFIG_KEYS, TunePoint, TuneResult, TuneSpace, run_overrides, tune

__all__ = [
    "planned",
    "window_summary",
    "Calibration",
    "CheckpointSpec",
    "RUN_CONFIG_KEYS",
    "CheckpointStudy",
    "Constant",
    "Empirical",
    "EtaPoint",
    "FleetSpec",
    "HostSpec",
    "Lognormal",
    "LongTail",
    "ParamServerSpec",
    "PreemptionSpec",
    "Scenario",
    "SimResult",
    "Simulation",
    "SweepPoint",
    "TrainerCostSpec",
    "TunePoint",
    "TuneResult",
    "TuneSpace",
    "Uniform",
    "VerifierSpec",
    "WorkloadSpec",
    "areal_like",
    "async_vs_sync",
    "calibrate",
    "checkpoint_figure",
    "checkpoint_interval_study",
    "checkpoint_study",
    "distribution_from_dict",
    "distribution_to_dict",
    "eta_curve",
    "eta_curve_figure",
    "fit_scenario",
    "format_table",
    "load_scenario",
    "local_runtime",
    "presets",
    "rlax_like",
    "run_config",
    "run_overrides",
    "save_scenario",
    "scenario_from_dict",
    "scenario_to_dict",
    "simulate",
    "staleness_figure",
    "sweep",
    "tune",
    "timeline_figure",
    "toy",
    "utilisation_figure",
    "with_overrides",
    "young_daly_interval_s",
]
