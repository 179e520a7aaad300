"""Studies built from many simulations: the η curve, sync against async, the checkpoint
interval against Young and Daly, sweeps over a grid, and the tuner. ``sim.sweep`` and
``sim.tune`` are the entry points.

Names are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlaxkit.rules.surface import lazy_names

if TYPE_CHECKING:
    from sim.studies.standard import (
        CheckpointStudy,
        EtaPoint,
        async_vs_sync,
        checkpoint_interval_study,
        eta_curve,
        young_daly_interval_s,
    )
    from sim.studies.sweep import SweepPoint, format_table
    from sim.studies.tune import TunePoint, TuneResult, TuneSpace

_MODULES = {
    "async_vs_sync": "standard",
    "checkpoint_interval_study": "standard",
    "CheckpointStudy": "standard",
    "eta_curve": "standard",
    "EtaPoint": "standard",
    "young_daly_interval_s": "standard",
    "format_table": "sweep",
    "SweepPoint": "sweep",
    "TunePoint": "tune",
    "TuneResult": "tune",
    "TuneSpace": "tune",
}


__getattr__ = lazy_names(__name__, _MODULES, globals())


__all__ = [
    "async_vs_sync",
    "checkpoint_interval_study",
    "CheckpointStudy",
    "eta_curve",
    "EtaPoint",
    "format_table",
    "SweepPoint",
    "TunePoint",
    "TuneResult",
    "TuneSpace",
    "young_daly_interval_s",
]
