"""Figures of simulated (or real) runs. Each function returns a matplotlib ``Figure``
drawn on the Agg canvas (no display, no pyplot state), ready for ``savefig`` or a
notebook cell.

- :func:`timeline_figure`: per-worker generations coloured by weight version, trainer
  steps, pushes, preemptions, from a trace;
- :func:`staleness_figure`: histogram of per-rollout staleness;
- :func:`utilisation_figure`: trainer utilisation, goodput and worker utilisation per
  run;
- :func:`eta_curve_figure`: throughput against the staleness bound η;
- :func:`checkpoint_figure`: waste against checkpoint interval, with Young/Daly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from rlaxkit.trace import TraceEvent, generation_records

from .metrics import SimResult
from .studies import CheckpointStudy, EtaPoint

__all__ = [
    "checkpoint_figure",
    "eta_curve_figure",
    "staleness_figure",
    "timeline_figure",
    "utilisation_figure",
]


def _figure(width: float = 7.0, height: float = 4.0) -> Figure:
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def timeline_figure(events: Iterable[TraceEvent], *, max_workers: int = 16) -> Figure:
    """Gantt chart of a trace: one row per worker (first ``max_workers``), one for the
    trainer; generations coloured by their weight version, preemptions as red marks."""
    events = list(events)
    records = generation_records(events)
    workers = sorted({r.actor for r in records}, key=lambda name: int(name.split("-")[-1]))
    workers = workers[:max_workers]
    rows = {name: i + 1 for i, name in enumerate(workers)}
    rows["trainer"] = 0
    versions = [r.version for r in records if r.version is not None] or [0]
    colours = matplotlib.colormaps["viridis"]
    top = max(versions) or 1
    figure = _figure(9.0, 1.0 + 0.35 * len(rows))
    axes = figure.add_subplot()
    for record in records:
        if record.actor not in rows:
            continue
        axes.plot(
            [record.start_s, record.end_s],
            [rows[record.actor]] * 2,
            color=colours((record.first_version or 0) / top),
            linewidth=3,
            alpha=0.5,
            solid_capstyle="butt",
        )
    for event in events:
        if event.kind == "train_step":
            axes.barh(0, event["duration_s"], left=event.t - event["duration_s"], color="tab:blue")
        elif event.kind == "push":
            axes.plot(event.t, 0, marker="|", color="black", markersize=12)
        elif event.kind == "preemption" and event.actor in rows:
            axes.plot(event.t, rows[event.actor], marker="x", color="red", markersize=10)
    axes.set_yticks(list(rows.values()), list(rows))
    axes.set_xlabel("time (s)")
    axes.set_title("timeline (colour: weight version; x: preemption)")
    return figure


def staleness_figure(staleness: Mapping[int, int] | SimResult) -> Figure:
    """Bar chart of how many trained rollouts had each staleness."""
    counts = staleness.staleness if isinstance(staleness, SimResult) else dict(staleness)
    figure = _figure(5.0, 3.5)
    axes = figure.add_subplot()
    ages = sorted(counts)
    total = sum(counts.values()) or 1
    axes.bar(ages, [counts[a] / total for a in ages], color="tab:purple")
    axes.set_xlabel("staleness (trainer version - rollout version)")
    axes.set_ylabel("fraction of trained rollouts")
    axes.set_xticks(ages)
    return figure


def utilisation_figure(results: Sequence[SimResult]) -> Figure:
    """Grouped bars of trainer utilisation, goodput and worker utilisation per run."""
    figure = _figure(max(5.0, 1.2 * len(results) + 2), 3.5)
    axes = figure.add_subplot()
    x = np.arange(len(results))
    width = 0.27
    series = [
        ("trainer", [r.trainer_utilisation for r in results]),
        ("goodput", [r.goodput for r in results]),
        ("workers", [r.worker_utilisation for r in results]),
    ]
    for offset, (label, values) in zip((-width, 0.0, width), series, strict=True):
        axes.bar(x + offset, values, width, label=label)
    axes.set_xticks(x, [r.scenario for r in results], rotation=20, ha="right")
    axes.set_ylim(0, 1.05)
    axes.set_ylabel("fraction of wall time")
    axes.legend()
    return figure


def eta_curve_figure(curve: Sequence[EtaPoint]) -> Figure:
    """Trained samples/s against the staleness bound η (log-2 spaced x axis)."""
    figure = _figure(5.0, 3.5)
    axes = figure.add_subplot()
    etas = [p.max_staleness for p in curve]
    axes.plot(etas, [p.samples_per_s for p in curve], marker="o")
    axes.set_xscale("symlog", base=2, linthresh=1)
    axes.set_xticks(etas, [str(e) for e in etas])
    axes.set_xlabel("max staleness η")
    axes.set_ylabel("trained samples/s")
    axes.set_ylim(bottom=0)
    return figure


def checkpoint_figure(study: CheckpointStudy) -> Figure:
    """Simulated waste per checkpoint interval, the fitted optimum and Young/Daly's."""
    figure = _figure(5.0, 3.5)
    axes = figure.add_subplot()
    axes.plot(study.intervals_s, study.waste, marker="o", label="simulated")
    axes.axvline(study.fitted_best_s, color="tab:green", label="fitted optimum")
    axes.axvline(study.young_daly_s, color="tab:red", linestyle="--", label="sqrt(2 δ M)")
    axes.set_xlabel("checkpoint interval (s of compute)")
    axes.set_ylabel("waste = 1 - goodput")
    axes.legend()
    return figure
