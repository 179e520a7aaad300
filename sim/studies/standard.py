"""Studies built from sweeps: the η curve, sync vs async, and the checkpoint interval.

- :func:`eta_curve`: throughput as the staleness bound η grows (AReaL: it rises, then
  saturates once the fleet or the trainer is the bottleneck).
- :func:`async_vs_sync`: throughput ratio of η > 0 over η = 0 on the same chips.
- :func:`checkpoint_interval_study`: the simulated best checkpoint interval under
  exponential trainer preemptions, against Young's ``sqrt(2 · save_s · MTBF)`` (Young
  1974; Daly 2006 refines it by ``- save_s`` and higher-order terms).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from sim.presets import checkpoint_study
from sim.scenario import Scenario
from sim.studies.sweep import sweep

__all__ = [
    "CheckpointStudy",
    "EtaPoint",
    "async_vs_sync",
    "checkpoint_interval_study",
    "eta_curve",
    "young_daly_interval_s",
]


@dataclass(frozen=True)
class EtaPoint:
    """Mean throughput over seeds at one staleness bound."""

    max_staleness: int
    samples_per_s: float
    mean_staleness: float
    time_to_target_s: float


def eta_curve(
    base: Scenario,
    etas: Sequence[int] = (0, 1, 2, 4, 8),
    *,
    seeds: Sequence[int] = (0,),
    processes: int | None = None,
) -> list[EtaPoint]:
    """Trained samples/s of ``base`` at each η, averaged over ``seeds``."""
    points = sweep(base, {"staleness.max_staleness": list(etas)}, seeds=seeds, processes=processes)
    curve = []
    for eta in etas:
        runs = [p.result for p in points if p.overrides["staleness.max_staleness"] == eta]
        curve.append(
            EtaPoint(
                max_staleness=eta,
                samples_per_s=float(np.mean([r.samples_per_s for r in runs])),
                mean_staleness=float(np.mean([r.mean_staleness for r in runs])),
                time_to_target_s=float(np.mean([r.sim_time_s for r in runs])),
            )
        )
    return curve


def async_vs_sync(curve: Sequence[EtaPoint], *, max_staleness: int) -> float:
    """Throughput at ``max_staleness`` divided by throughput at η = 0."""
    by_eta = {point.max_staleness: point.samples_per_s for point in curve}
    return by_eta[max_staleness] / by_eta[0]


def young_daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimal compute time between checkpoints: ``sqrt(2·δ·M)``."""
    return math.sqrt(2.0 * save_s * mtbf_s)


@dataclass(frozen=True)
class CheckpointStudy:
    """Waste (1 - goodput) per checkpoint interval, and the fitted optimum.

    ``fitted_best_s`` minimises ``waste(τ) ≈ a + b/τ + c·τ`` (the shape of the
    first-order model: saves cost δ/τ, a failure loses τ/2 on average) fitted by least
    squares to the simulated points: ``τ* = sqrt(b / c)``; ``fit`` holds ``(a, b, c)``.
    ``young_daly_s`` is ``sqrt(2 δ M)`` with δ = ``save_s`` (the time to write a
    checkpoint) and M = ``mtbf_s`` (the mean time between trainer preemptions); both are
    NaN where unknown.
    """

    intervals_s: tuple[float, ...]
    waste: tuple[float, ...]
    fitted_best_s: float
    best_measured_s: float
    young_daly_s: float
    save_s: float = float("nan")
    mtbf_s: float = float("nan")
    fit: tuple[float, float, float] | None = None

    @property
    def relative_error(self) -> float:
        """``|fitted_best_s / young_daly_s - 1|``."""
        return abs(self.fitted_best_s / self.young_daly_s - 1.0)


def checkpoint_interval_study(
    every_steps: Sequence[int] = (2, 3, 4, 5, 6, 8, 10, 13, 16, 20),
    *,
    seeds: Sequence[int] = (0, 1, 2),
    save_s: float = 60.0,
    mtbf_s: float = 3600.0,
    step_s: float = 120.0,
    horizon_s: float = 200 * 3600.0,
    processes: int | None = None,
    make: Callable[..., Scenario] = checkpoint_study,
) -> CheckpointStudy:
    """Simulate each checkpoint interval under exponential trainer preemptions.

    The checkpoint interval in compute seconds is ``every_steps · step_s``. Every
    interval sees the same preemption times (same seeds), so differences come from the
    interval, not from luck.
    """
    base = make(save_s=save_s, mtbf_s=mtbf_s, step_s=step_s, horizon_s=horizon_s)
    points = sweep(
        base, {"checkpointing.every_steps": list(every_steps)}, seeds=seeds, processes=processes
    )
    intervals, waste = [], []
    for steps in every_steps:
        runs = [p.result for p in points if p.overrides["checkpointing.every_steps"] == steps]
        intervals.append(steps * step_s)
        waste.append(1.0 - float(np.mean([r.goodput for r in runs])))
    tau = np.asarray(intervals)
    design = np.stack([np.ones_like(tau), 1.0 / tau, tau], axis=1)
    (a, b, c), *_ = np.linalg.lstsq(design, np.asarray(waste), rcond=None)
    fitted = math.sqrt(b / c) if b > 0 and c > 0 else float("nan")
    return CheckpointStudy(
        intervals_s=tuple(intervals),
        waste=tuple(waste),
        fitted_best_s=fitted,
        best_measured_s=intervals[int(np.argmin(waste))],
        young_daly_s=young_daly_interval_s(save_s, mtbf_s),
        save_s=save_s,
        mtbf_s=mtbf_s,
        fit=(float(a), float(b), float(c)),
    )
