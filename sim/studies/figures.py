"""Figures of the simulator's studies: fleet utilisation, the η curve and the checkpoint
interval against Young's and Daly's."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

from sim.metrics import SimResult
from sim.report import new_figure
from sim.studies.standard import CheckpointStudy, EtaPoint


def utilisation_figure(results: Sequence[SimResult]) -> Figure:
    """Grouped bars of trainer utilisation, goodput and worker utilisation per run."""
    figure = new_figure(max(5.0, 1.2 * len(results) + 2), 3.5)
    axes = figure.add_subplot()
    x = np.arange(len(results))
    width = 0.27
    series = [
        ("trainer busy", [r.trainer_utilisation for r in results]),
        ("goodput", [r.goodput for r in results]),
        ("workers busy", [r.worker_utilisation for r in results]),
    ]
    for offset, (label, values) in zip((-width, 0.0, width), series, strict=True):
        axes.bar(x + offset, values, width, label=label)
    axes.set_xticks(x, [r.scenario for r in results], rotation=20, ha="right")
    axes.set_ylim(0, 1.3)  # headroom for the legend above the bars
    axes.set_yticks([0, 0.25, 0.5, 0.75, 1])
    axes.set_ylabel("fraction of wall time")
    axes.set_title("utilisation and goodput per simulated run", fontsize="medium")
    axes.legend(frameon=False, fontsize="small", ncol=3, loc="upper left")
    return figure


def eta_curve_figure(curve: Sequence[EtaPoint]) -> Figure:
    """Trained samples/s against the staleness bound η (log-2 spaced x axis)."""
    figure = new_figure(5.0, 3.5)
    axes = figure.add_subplot()
    etas = [p.max_staleness for p in curve]
    axes.plot(etas, [p.samples_per_s for p in curve], marker="o", label="simulated")
    axes.set_xscale("symlog", base=2, linthresh=1)
    axes.set_xticks(etas, [str(e) for e in etas])
    axes.set_xlabel("η, the staleness bound (versions)")
    axes.set_ylabel("trained samples/s")
    axes.set_ylim(bottom=0)
    axes.set_title("throughput by staleness bound η (simulated)", fontsize="medium")
    return figure


def checkpoint_figure(study: CheckpointStudy) -> Figure:
    """Simulated waste per checkpoint interval, the curve fitted to it with its
    optimum (a star), and Young's first-order optimum ``sqrt(2 δ M)`` (dashed)."""
    figure = new_figure(7.0, 3.5)
    axes = figure.add_subplot()
    axes.plot(study.intervals_s, study.waste, "o", label="simulated")
    known = not (np.isnan(study.save_s) or np.isnan(study.mtbf_s))
    young = (
        f"Young: √(2δM) = {study.young_daly_s:.0f} s\n"
        f"δ = {study.save_s:g} s (checkpoint save)\nM = {study.mtbf_s:g} s (MTBF)"
        if known
        else f"Young: √(2δM) = {study.young_daly_s:.0f} s"
    )
    axes.axvline(study.young_daly_s, color="tab:red", linestyle="--", lw=1, label=young)
    if study.fit is not None:
        a, b, c = study.fit
        tau = np.linspace(min(study.intervals_s), max(study.intervals_s), 200)
        axes.plot(tau, a + b / tau + c * tau, color="tab:green", lw=1, label="fit a + b/τ + cτ")
    if np.isfinite(study.fitted_best_s):
        best = study.fitted_best_s
        y = (
            study.fit[0] + study.fit[1] / best + study.fit[2] * best
            if study.fit
            else float(np.interp(best, study.intervals_s, study.waste))
        )
        axes.plot(
            best,
            y,
            "*",
            color="tab:green",
            ms=14,
            mec="black",
            mew=0.6,
            zorder=5,
            label=f"fitted optimum {best:.0f} s",
        )
    axes.set_xlabel("checkpoint interval τ (s of compute)")
    axes.set_ylabel("waste = 1 - goodput")
    axes.set_title("waste by checkpoint interval (simulated)", fontsize="medium")
    axes.grid(alpha=0.3)
    axes.spines[["top", "right"]].set_visible(False)
    axes.legend(frameon=False, fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return figure
