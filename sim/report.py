"""Figures of simulated (or real) runs. Each function returns a matplotlib ``Figure``
drawn on the Agg canvas (no display, no pyplot state), ready for ``savefig`` or a
notebook cell.

- :func:`timeline_figure`: per-worker slots with generations coloured by weight version,
  trainer steps, checkpoints, pushes and pulls, idle time and preemptions, from a trace;
- :func:`throughput_figure`: trained and generated samples/s, goodput, over time;
- :func:`drops_figure`: dropped rollouts over time, stacked by reason;
- :func:`staleness_figure`: histogram of per-rollout staleness;

The studies' figures (utilisation, the η curve, the checkpoint interval) are in
``sim.studies.figures``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator, MultipleLocator

from rlaxkit.rules.trace import GenerationRecord, TraceEvent, generation_records, step_span
from sim.metrics import SimResult

__all__ = [
    "drops_figure",
    "staleness_figure",
    "throughput_figure",
    "timeline_figure",
]


def new_figure(width: float = 7.0, height: float = 4.0) -> Figure:
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


MAX_MARKS_PER_ROW = 40  # push or pull marks a row takes before they merge into a bar
MAX_LANES = 4  # slots a worker's band draws one by one; more become an occupancy area
OCCUPANCY_BINS = 350  # time slices of an occupancy area (about one per 2 pixels)
CUT_START = 0.15  # a set-up longer than this share of a run is cut from a time axis


def timeline_figure(events: Iterable[TraceEvent], *, max_workers: int = 16) -> Figure:
    """Gantt chart of a trace: the trainer on top, then one band per worker (the first
    ``max_workers``).

    A worker with at most ``MAX_LANES`` slots has one lane per slot, a generation a bar
    on its lane coloured by its first weight version; with more slots its band is the
    number of sequences in flight over time (full height: all its slots busy), stacked
    by first weight version. A train step is a bar coloured by the version it produced
    (the colour bar maps both), with a white edge so consecutive steps stay apart (when
    they are wide enough to show one); grey is idle, hatching the set-up before the
    first generation (warm start, compilation; over ``CUT_START`` of the run, the axis is
    cut to a sliver of it and its length written). Checkpoint saves are black bars on
    the trainer row; pushes (trainer) and pulls (workers) are tick marks, every k-th one
    past ``MAX_MARKS_PER_ROW`` in a row (the legend says which); a red band runs from a
    preemption (x) to the restart.
    """
    events = list(events)
    records = generation_records(events)
    every_worker = sorted({r.actor for r in records}, key=_actor_number)
    workers = every_worker[:max_workers]
    end_s = max((e.t for e in events), default=1.0)
    steps = [e for e in events if e.kind == "train_step"]
    versions = [r.first_version or 0 for r in records] + [e.version or 0 for e in steps]
    top = max(versions, default=0)
    # One colour per version while they can be told apart, a continuous scale beyond.
    colours = matplotlib.colormaps["viridis"].resampled(top + 1 if top < 16 else 256)
    norm: matplotlib.colors.Normalize = (
        matplotlib.colors.BoundaryNorm(np.arange(-0.5, top + 1.5), top + 1)
        if top < 16
        else matplotlib.colors.Normalize(0, top)
    )
    figure = new_figure(9.0, 1.3 + 0.4 * (len(workers) + 1))
    axes = figure.add_subplot()
    # Rows from the top: trainer at len(workers), worker i at len(workers) - 1 - i.
    rows = {name: len(workers) - 1 - i for i, name in enumerate(workers)}
    rows["trainer"] = len(workers)
    height = 0.8
    # Before the first generation or step: setting up (warm start, first compilations).
    busy = [r.start_s for r in records] + [step_span(e)[0] for e in steps]
    setup_s = min(busy) if busy and min(busy) > 0.05 * end_s else 0.0
    # A long set-up is cut to a sliver: the axis is for the run.
    start_s = setup_s - 0.05 * (end_s - setup_s) if setup_s > CUT_START * end_s else 0.0
    for row in rows.values():
        axes.broken_barh([(0, end_s)], (row - height / 2, height), color="0.92", lw=0)
    lanes = _slot_lanes([r for r in records if r.actor in rows])
    slots = max((len(actor_lanes) for actor_lanes in lanes.values()), default=0)
    for actor, actor_lanes in lanes.items():
        if slots > MAX_LANES:
            edges = np.linspace(start_s, end_s, OCCUPANCY_BINS + 1)
            lane_records = [r for lane in actor_lanes for r in lane]
            _occupancy(
                axes,
                lane_records,
                edges,
                rows[actor] - height / 2,
                height / slots,
                lambda v: colours(norm(v)),
            )
            continue
        lane_h = height / len(actor_lanes)
        base = rows[actor] - height / 2
        for i, lane in enumerate(actor_lanes):
            axes.broken_barh(
                [(r.start_s, r.end_s - r.start_s) for r in lane],
                (base + (len(actor_lanes) - 1 - i) * lane_h, lane_h * 0.9),
                facecolors=[colours(norm(r.first_version or 0)) for r in lane],
                lw=0,
            )
    row = rows["trainer"]
    # A white edge keeps consecutive steps apart where a step is a few pixels wide; on
    # narrower ones it would paint the whole lane white.
    pixels_per_s = figure.get_figwidth() * figure.dpi * 0.8 / max(end_s - start_s, 1e-9)
    step_px = float(np.median([e["duration_s"] for e in steps])) * pixels_per_s if steps else 0
    axes.broken_barh(
        [(step_span(e)[0], e["duration_s"]) for e in steps],
        (row - height / 2, height),
        facecolors=[colours(norm(e.version or 0)) for e in steps],
        edgecolor="white",
        lw=0.8 if step_px >= 4 else 0,
    )
    if setup_s:
        axes.axvspan(
            start_s,
            setup_s,
            facecolor="white",
            edgecolor="0.6",
            hatch="//",
            lw=0,
            label=f"setup (warm start), {setup_s:.0f} s" + (", axis cut" if start_s else ""),
        )
    saves = [e for e in events if e.kind == "checkpoint_save"]
    axes.broken_barh(
        [(e.t - e["duration_s"], e["duration_s"]) for e in saves],
        (row - height / 4, height / 2),
        color="black",
        label="checkpoint save" if saves else None,
    )
    pushes = [e for e in events if e.kind == "push"]
    _marks(axes, pushes, {e.actor: row + height / 2 for e in pushes}, "|", "push")
    pulls = [e for e in events if e.kind == "pull" and e.actor in rows]
    _marks(axes, pulls, {a: rows[a] + height / 2 for a in workers}, 7, "pull")
    _downtime(axes, events, rows, height)
    axes.set_yticks(list(rows.values()), list(rows))
    axes.set_ylim(-0.6, len(workers) + 0.6)
    axes.set_xlim(start_s, end_s)
    _time_axis(axes, end_s)
    axes.spines[["top", "right"]].set_visible(False)
    shown = (
        f"first {len(workers)} of {len(every_worker)} workers"
        if len(every_worker) > len(workers)
        else f"{len(workers)} workers"
    )
    band = (
        f"a worker's band: sequences in flight, full = its {slots} slots"
        if slots > MAX_LANES
        else "a worker's band is its slots"
    )
    axes.set_title(f"timeline ({shown}; {band})", fontsize="medium")
    handles = [Patch(color="0.92", label="idle")] + axes.get_legend_handles_labels()[0]
    long_labels = any(len(str(h.get_label())) > 24 for h in handles)
    axes.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.14),
        ncol=min(len(handles), 2 if long_labels else 3),
        frameon=False,
        fontsize="small",
    )
    bar = figure.colorbar(
        matplotlib.cm.ScalarMappable(norm=norm, cmap=colours), ax=axes, pad=0.01, aspect=30
    )
    bar.set_label("weight version")
    bar.ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=8))
    return figure


def _occupancy(
    axes: Axes,
    records: list[GenerationRecord],
    edges: np.ndarray,
    base: float,
    slot_h: float,
    colour: Any,
) -> None:
    """A worker's sequences in flight per time slice (the mean over the slice), stacked
    by first weight version, from ``base`` up, ``slot_h`` per sequence."""
    width = edges[1] - edges[0]
    by_version: dict[int, np.ndarray] = {}
    for record in records:
        inside = np.minimum(edges[1:], record.end_s) - np.maximum(edges[:-1], record.start_s)
        version = record.first_version or 0
        by_version.setdefault(version, np.zeros(len(edges) - 1))
        by_version[version] += np.clip(inside, 0, None) / width
    bottom = np.full(len(edges) - 1, base)
    for version in sorted(by_version):
        top = bottom + by_version[version] * slot_h
        axes.stairs(top, edges, baseline=bottom, fill=True, color=colour(version), lw=0)
        bottom = top


def _time_axis(axes: Axes, end_s: float) -> None:
    """Label the x axis (seconds) in hours past 3 h, with tick labels to match."""
    if end_s > 3 * 3600:
        axes.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 3600:g}"))
        axes.xaxis.set_major_locator(MultipleLocator(3600 * max(1, round(end_s / 3600 / 8))))
        axes.set_xlabel("time (h)")
    else:
        axes.set_xlabel("time (s)")


def _actor_number(name: str) -> tuple[int, str]:
    suffix = name.rpartition("-")[2]
    return (int(suffix), name) if suffix.isdigit() else (1 << 30, name)


def _slot_lanes(records: list[GenerationRecord]) -> dict[str, list[list[GenerationRecord]]]:
    """Each worker's generations in lanes that never overlap (first free lane)."""
    lanes: dict[str, list[list[GenerationRecord]]] = {}
    for record in sorted(records, key=lambda r: (r.start_s, r.end_s)):
        actor_lanes = lanes.setdefault(record.actor, [])
        lane = next((la for la in actor_lanes if la[-1].end_s <= record.start_s), None)
        if lane is None:
            actor_lanes.append([record])
        else:
            lane.append(record)
    return lanes


def _marks(
    axes: Axes, events: list[TraceEvent], rows: Mapping[str, float], marker: object, label: str
) -> None:
    """A tick per event on its actor's row; past ``MAX_MARKS_PER_ROW`` in a row, every
    k-th event of each actor (k the same for all rows, said in the legend)."""
    if not events:
        return
    per_actor: dict[str, list[float]] = {}
    for event in events:
        per_actor.setdefault(event.actor, []).append(event.t)
    every = -(-max(len(ts) for ts in per_actor.values()) // MAX_MARKS_PER_ROW)
    times = [t for actor_times in per_actor.values() for t in actor_times[::every]]
    heights = [rows[a] for a, ts in per_actor.items() for _ in ts[::every]]
    if every > 1:
        label = f"{label} (1 in {every} of {len(events)} marked)"
    axes.plot(times, heights, ls="", marker=marker, color="black", markersize=6, label=label)


def _downtime(axes: Axes, events: list[TraceEvent], rows: Mapping[str, int], height: float) -> None:
    """Red bands from each preemption to the actor's restart (or the trace's end)."""
    down: dict[str, float] = {}
    bands: list[tuple[str, float, float]] = []
    end_s = max((e.t for e in events), default=0.0)
    for event in events:
        if event.actor not in rows:
            continue
        if event.kind == "preemption":
            down.setdefault(event.actor, event.t)
        elif event.kind == "restart" and event.actor in down:
            bands.append((event.actor, down.pop(event.actor), event.t))
    bands += [(actor, start, end_s) for actor, start in down.items()]
    for i, (actor, start, stop) in enumerate(bands):
        row = rows[actor]
        axes.broken_barh(
            [(start, stop - start)],
            (row - height / 2, height),
            color="tab:red",
            alpha=0.35,
            lw=0,
            label="preempted (down)" if i == 0 else None,
        )
        axes.plot(
            start,
            row,
            marker="x",
            color="tab:red",
            markersize=8,
            label="preemption" if i == 0 else None,
        )


def _bins(events: list[TraceEvent], bins: int, start_s: float = 0.0) -> np.ndarray:
    end_s = max((e.t for e in events), default=1.0) or 1.0
    return np.linspace(start_s, max(end_s, start_s + 1e-9), bins + 1)


def _busy_per_bin(spans: list[tuple[float, float]], edges: np.ndarray) -> np.ndarray:
    """Seconds of ``(start, end)`` spans inside each bin."""
    busy = np.zeros(len(edges) - 1)
    for start, end in spans:
        busy += np.clip(np.minimum(edges[1:], end) - np.maximum(edges[:-1], start), 0, None)
    return busy


def throughput_figure(events: Iterable[TraceEvent], *, bins: int = 40) -> Figure:
    """Throughput and goodput over time.

    Top: samples trained per second, step by step (a step's samples over the time since
    the previous step ended; per slice past ``2 * bins`` steps), and samples generated
    per second in ``bins`` equal slices of the run. Bottom: goodput so far, the
    trainer's compute in steps that survived (a trainer preemption's ``lost_steps`` are
    the steps before it that did not) over the time elapsed since the run began, and the
    share of each slice the trainer was busy, lost steps included. When the first step
    ends past ``CUT_START`` of the run (a warm start, compilations), the axis starts there
    and the title says how long the start took.
    """
    events = list(events)
    steps: list[TraceEvent] = []
    lost: list[TraceEvent] = []
    for event in events:
        if event.kind == "train_step":
            steps.append(event)
        elif event.kind == "preemption" and event.actor == "trainer":
            count = int(event.get("lost_steps") or 0)
            if count:
                lost += steps[-count:]
                del steps[-count:]
    end_s = max((e.t for e in events), default=1.0)
    first_s = min((e.t for e in steps + lost), default=0.0)
    start_s = first_s if first_s > CUT_START * end_s else 0.0
    edges = _bins(events, bins, start_s)
    width = edges[1] - edges[0]
    generated = np.histogram([e.t for e in events if e.kind == "generation_end"], edges)[0]
    useful = _busy_per_bin([(e.t - e["duration_s"], e.t) for e in steps], edges)
    wasted = _busy_per_bin([(e.t - e["duration_s"], e.t) for e in lost], edges)
    figure = new_figure(7.0, 4.0)
    rate, share = figure.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    middles = (edges[:-1] + edges[1:]) / 2
    rate.plot(middles, generated / width, label="generated", color="tab:green")
    ends = np.array([0.0] + [e.t for e in steps])
    samples = np.array([float(e["samples"]) for e in steps])
    if len(steps) > 2 * bins:  # step by step would be a solid block: per slice instead
        trained = np.histogram(ends[1:], edges, weights=samples)[0]
        rate.plot(middles, trained / width, label="trained", color="tab:blue")
    elif len(steps) > 1 or (steps and not start_s):
        # From the axis' start, the first step's rate would count the time before it.
        first = 1 if start_s else 0
        per_step = samples[first:] / np.maximum(np.diff(ends[first:]), 1e-12)
        rate.stairs(per_step, ends[first:], label="trained", color="tab:blue", lw=1.5)
    rate.set_ylabel("samples / s")
    rate.set_ylim(0, rate.get_ylim()[1] * 1.25)  # headroom for the legend
    share.plot(middles, (useful + wasted) / width, label="trainer busy", color="0.7")
    if steps:
        done = np.cumsum([float(e["duration_s"]) for e in steps])
        share.plot(
            ends[1:],
            done / np.maximum(ends[1:], 1e-12),
            label="goodput so far (since the run began)",
            color="black",
            lw=1.5,
        )
    share.set_ylim(0, 1.4)  # headroom for the legend above the 100% line
    share.set_yticks([0, 0.5, 1])
    share.set_ylabel("share of time")
    share.set_xlim(edges[0], edges[-1])
    _time_axis(share, edges[-1])
    for axes in (rate, share):
        axes.grid(alpha=0.3)
        axes.spines[["top", "right"]].set_visible(False)
        axes.legend(frameon=False, fontsize="small", loc="upper left", ncol=2)
    cut = f"; axis from the first step, {start_s:.0f} s after the start" if start_s else ""
    rate.set_title(f"samples per second{cut}", fontsize="medium")
    share.set_title("trainer busy and goodput", fontsize="medium")
    return figure


# A drop reason in words, where its name alone does not say it (``rlaxkit.rules.ledger``).
REASONS = {"filtered": "filtered: a group of equal rewards"}


def drops_figure(events: Iterable[TraceEvent], *, bins: int = 30) -> Figure:
    """Dropped rollouts per time slice, stacked by reason (``stale``, ``preempted``,
    ``filtered``, ...); a run without drops says so. After a set-up over ``CUT_START``
    of the run, the axis starts at the first generation."""
    events = list(events)
    drops = [e for e in events if e.kind == "drop"]
    figure = new_figure(7.0, 4.0)
    axes = figure.add_subplot()
    first_s = min((e.t for e in events if e.kind == "generation_start"), default=0.0)
    end_s = max((e.t for e in events), default=1.0)
    edges = _bins(events, bins, first_s if first_s > CUT_START * end_s else 0.0)
    reasons = sorted({str(e["reason"]) for e in drops})
    bottom = np.zeros(bins)
    for i, reason in enumerate(reasons):
        counts = np.histogram([e.t for e in drops if e["reason"] == reason], edges)[0]
        total = int(counts.sum())
        axes.bar(
            edges[:-1],
            counts,
            np.diff(edges),
            bottom=bottom,
            align="edge",
            label=f"{REASONS.get(reason, reason)} ({total})",
            color=f"C{i}",
            edgecolor="white",
            lw=0.5,
        )
        bottom += counts
    if not drops:
        axes.text(
            0.5, 0.5, "no rollout was dropped", ha="center", va="center", transform=axes.transAxes
        )
        axes.set_xlim(edges[0], edges[-1])
    _time_axis(axes, edges[-1])
    axes.set_ylabel(f"dropped rollouts per {edges[1] - edges[0]:.3g} s")
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    cut = f"; axis from the first generation, {edges[0]:.0f} s after the start" if edges[0] else ""
    axes.set_title(f"dropped rollouts by reason{cut}", fontsize="medium")
    axes.grid(alpha=0.3)
    axes.spines[["top", "right"]].set_visible(False)
    if drops:
        axes.set_ylim(0, bottom.max() * 1.3)  # headroom for the legend above the bars
        axes.legend(frameon=False, fontsize="small", title="reason (total)", loc="upper left")
    return figure


def staleness_figure(staleness: Mapping[int, int] | SimResult) -> Figure:
    """Bar chart of how many trained rollouts had each staleness, each bar labelled
    with its share, the mean in the title."""
    counts = staleness.staleness if isinstance(staleness, SimResult) else dict(staleness)
    figure = new_figure(5.0, 3.5)
    axes = figure.add_subplot()
    ages = sorted(counts)
    total = sum(counts.values()) or 1
    shares = [counts[a] / total for a in ages]
    bars = axes.bar(ages, shares, color="tab:purple")
    axes.bar_label(bars, [f"{share:.1%}" for share in shares], fontsize="small")
    mean = sum(a * counts[a] for a in ages) / total
    axes.set_title(f"staleness of trained rollouts (mean {mean:.2f})", fontsize="medium")
    axes.set_xlabel("staleness (trainer version - rollout version)")
    axes.set_ylabel("fraction of trained rollouts")
    axes.set_xticks(ages)
    axes.set_ylim(0, max(shares, default=1.0) * 1.12)
    axes.grid(alpha=0.3, axis="y")
    axes.spines[["top", "right"]].set_visible(False)
    return figure
