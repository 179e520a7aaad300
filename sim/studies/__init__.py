"""Studies built from many simulations: the η curve, sync against async, the checkpoint
interval against Young and Daly, sweeps over a grid, and the tuner. ``sim.sweep`` and
``sim.tune`` are the entry points.

Names are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


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
