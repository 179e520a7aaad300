"""Calibration: a scenario fitted from a run's trace (the trainer's step cost, the
workers' decode cost, the host's gaps, saves and restarts, multi-turn tool time), and the
simulation of it checked against the run. ``sim.calibrate`` is the entry point.

Names are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlaxkit.rules.surface import lazy_names

if TYPE_CHECKING:
    from sim.calibration.calibrate import Calibration, fit_scenario
    from sim.calibration.extrapolation import extrapolations
    from sim.calibration.fits import fit_decode, fit_length_correlation, fit_save_cost, fit_trainer
    from sim.calibration.host import fault_figures, fit_host, restart_costs
    from sim.calibration.turns import TurnFit, fit_turns
    from sim.calibration.window import window_summary

_MODULES = {
    "Calibration": "calibrate",
    "extrapolations": "extrapolation",
    "fit_scenario": "calibrate",
    "window_summary": "window",
    "fit_decode": "fits",
    "fit_length_correlation": "fits",
    "fit_save_cost": "fits",
    "fit_trainer": "fits",
    "fault_figures": "host",
    "fit_host": "host",
    "restart_costs": "host",
    "fit_turns": "turns",
    "TurnFit": "turns",
}


__getattr__ = lazy_names(__name__, _MODULES, globals())


__all__ = [
    "Calibration",
    "extrapolations",
    "fault_figures",
    "fit_decode",
    "fit_host",
    "fit_length_correlation",
    "fit_save_cost",
    "fit_scenario",
    "fit_trainer",
    "fit_turns",
    "restart_costs",
    "TurnFit",
    "window_summary",
]
