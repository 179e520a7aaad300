"""Figures that compare runs, checkpoints or settings: curves of several runs, pass@k,
bars of summary numbers, throughput against fleet size, a simulated series over a
measured one, and two traces overlaid (sim against real)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import (
    MaxNLocator,
    NullLocator,
)

from rlaxkit.observe.style import (
    LOG_SPAN,
    SHARE_RATIO,
    SIZE_IN,
    log_ticks,
    new_figure,
    smoothed,
    style_axes,
)
from rlaxkit.rules.trace import (
    TraceEvent,
    durations,
    generation_records,
    staleness_distribution,
)


def curves_figure(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    keys: Sequence[str] = ("reward/mean",),
    *,
    x: str = "step",
    smooth: int = 1,
) -> Figure:
    """One panel per metric key; one line per run, ``key`` against ``x``.

    Args:
        runs: label -> that run's per-step metrics.
        keys: metrics to draw (a run without a key is skipped in that panel).
        x: the x-axis metric (``step``, or e.g. ``time/wall_s`` when a caller adds it).
        smooth: trailing moving-average window, in points.
    """
    if not keys:
        raise ValueError("keys: give at least one metric name, e.g. ('reward/mean',)")
    figure = new_figure(max(SIZE_IN[0], 3.6 * len(keys)), SIZE_IN[1])
    for i, key in enumerate(keys):
        axes = figure.add_subplot(1, len(keys), i + 1)
        for label, metrics in runs.items():
            rows = [m for m in metrics if key in m and x in m]
            if rows:
                values = smoothed([float(m[key]) for m in rows], smooth)
                axes.plot([m[x] for m in rows], values, label=label, lw=1.2)
        axes.set_xlabel(x)
        axes.set_title(key, fontsize="medium")
        style_axes(axes, legend=i == 0)
    return figure


def compare_runs_figure(runs: Mapping[str, Mapping[str, Any]], *, smooth: int = 1) -> Figure:
    """Four panels comparing runs: reward per step, held-out pass@k, staleness of the
    trained rollouts, and wall-clock seconds per trainer step.

    Args:
        runs: label -> ``{"metrics": per-step metrics, "pass_at_k": EvalReport.rows,
            "staleness": {age: count}, "step_s": seconds per step}``; a missing entry
            leaves that run out of its panel. Labels ``"head · suffix"`` (e.g.
            ``"η=2 · decoupled"``) share a colour per head and a line style (and bar
            hatching) per suffix.
        smooth: trailing moving-average window of the reward curves, in steps.
    """
    figure = new_figure(11.0, 7.0)
    (reward, passk), (stale, timing) = figure.subplots(2, 2)
    # Label "head · suffix": the head picks the colour, the suffix the line style.
    suffixes = list(dict.fromkeys(label.rpartition(" · ")[2] for label in runs if " · " in label))
    styles = dict(zip(suffixes, ("-", "--", ":", "-."), strict=False))
    colours: dict[str, str] = {}
    for label in runs:
        head = label.rpartition(" · ")[0] or label
        colours.setdefault(head, f"C{len(colours) % 10}")
    width = 0.8 / max(len(runs), 1)
    ages: set[int] = set()
    for i, (label, run) in enumerate(runs.items()):
        colour = colours[label.rpartition(" · ")[0] or label]
        style = styles.get(label.rpartition(" · ")[2], "-") if " · " in label else "-"
        metrics = run.get("metrics") or []
        if metrics:
            values = smoothed([m["reward/mean"] for m in metrics], smooth)
            reward.plot([m["step"] for m in metrics], values, style, color=colour, label=label)
        rows = sorted(run.get("pass_at_k") or [], key=lambda r: r["k"])
        if rows:
            ks = [r["k"] for r in rows]
            passk.plot(ks, [r["pass@k"] for r in rows], style, marker="o", color=colour)
            passk.set_xscale("log", base=2)
            passk.set_xticks(ks, [str(k) for k in ks])
        counts = run.get("staleness") or {}
        if counts:
            total = sum(counts.values())
            ages.update(counts)
            stale.bar(
                np.array(sorted(counts)) - 0.4 + (i + 0.5) * width,
                [counts[a] / total for a in sorted(counts)],
                width,
                color=colour,
                hatch="//" if style != "-" else None,
                edgecolor="white",
            )
        if run.get("step_s") is not None:
            timing.bar(i, run["step_s"], color=colour, hatch="//" if style != "-" else None)
    reward.set(xlabel="trainer step", ylabel="train reward (mean)", ylim=(0, 1.02))
    reward.xaxis.set_major_locator(MaxNLocator(integer=True))
    passk.set(xlabel="k", ylabel="held-out pass@k", ylim=(0, 1.02))
    stale.set(xlabel="staleness of trained rollouts", ylabel="fraction")
    if ages:
        stale.set_xticks(sorted(ages))
    timing.set_xticks(range(len(runs)), list(runs), rotation=35, ha="right", fontsize="small")
    timing.set_ylabel("seconds per trainer step")
    for axes, title in (
        (reward, "train reward by trainer step"),
        (passk, "held-out pass@k (k samples per problem)"),
        (stale, "staleness of trained rollouts (versions)"),
        (timing, "wall-clock seconds per trainer step"),
    ):
        axes.set_title(title, fontsize="medium")
        style_axes(axes)
    reward.legend(frameon=False, fontsize="x-small", ncol=2, loc="lower right")
    return figure


def pass_at_k_figure(reports: Mapping[str, Sequence[Mapping[str, Any]]]) -> Figure:
    """Held-out pass@k against k (log-2 axis), one line per run or checkpoint.

    Args:
        reports: label -> rows with ``k`` and ``pass@k`` (``EvalReport.rows``).
    """
    figure = new_figure(5.0, 3.5)
    axes = figure.add_subplot()
    ks: set[int] = set()
    for label, rows in reports.items():
        rows = sorted(rows, key=lambda r: r["k"])
        ks.update(r["k"] for r in rows)
        axes.plot([r["k"] for r in rows], [r["pass@k"] for r in rows], "o-", label=label)
    axes.set_xscale("log", base=2)
    if ks:
        axes.set_xticks(sorted(ks), [str(k) for k in sorted(ks)])
    axes.set_xlabel("k (samples per problem)")
    axes.set_ylabel("pass@k")
    axes.set_ylim(0, 1.02)
    axes.set_title("held-out pass@k: a problem solved by any of k samples", fontsize="medium")
    style_axes(axes, legend=True)
    return figure


def comparison_figure(
    values: Mapping[str, float], *, ylabel: str, title: str | None = None
) -> Figure:
    """Bars of one number per run (wall time, trained samples/s, ...)."""
    figure = new_figure(max(5.0, 0.7 * len(values) + 2), 3.5)
    axes = figure.add_subplot()
    labels = list(values)
    axes.bar(range(len(labels)), [values[k] for k in labels], color="tab:blue")
    axes.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    axes.set_ylabel(ylabel)
    axes.set_title(title or f"{ylabel} by run", fontsize="medium")
    style_axes(axes)
    return figure


def scaling_figure(
    sizes: Sequence[float],
    series: Mapping[str, Sequence[float]],
    *,
    xlabel: str = "inference chips",
    ylabel: str = "trained samples/s",
    ceiling: float | Mapping[str, float] | None = None,
    ceiling_label: str = "trainer bound",
    title: str = "throughput by fleet size",
) -> Figure:
    """Throughput against fleet size on log-log axes, with ideal linear scaling.

    The dotted line is linear scaling from each series' first point. ``ceiling`` draws
    horizontal bounds (e.g. the trainer's samples/s when it never waits): one value,
    labelled ``ceiling_label``, or label -> value, each in its own line style. The y
    axis labels 1-2-5 steps, or its decades past two, never every minor tick.
    """
    if not sizes:
        raise ValueError("sizes: give at least one fleet size")
    figure = new_figure(*SIZE_IN)
    axes = figure.add_subplot()
    x = np.asarray(sizes, float)
    for label, values in series.items():
        y = np.asarray(values, float)
        if len(y) != len(x):
            raise ValueError(f"series {label!r} has {len(y)} values for {len(x)} sizes")
        line = axes.plot(x, y, "o-", label=label)[0]
        axes.plot(x, y[0] * x / x[0], ":", color=line.get_color(), lw=1)
    bounds = {ceiling_label: ceiling} if isinstance(ceiling, int | float) else dict(ceiling or {})
    for (label, value), style in zip(bounds.items(), ("--", "-.", (0, (5, 1, 1, 1))), strict=False):
        axes.axhline(value, color="black", ls=style, lw=1, label=label)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xticks(x, [f"{s:g}" for s in x])
    axes.xaxis.set_minor_locator(NullLocator())
    log_ticks(axes.yaxis, axes.get_ylim())
    axes.plot([], [], ":", color="0.4", lw=1, label="linear scaling from the first point")
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize="medium")
    axes.grid(alpha=0.3, which="major")
    axes.spines[["top", "right"]].set_visible(False)
    axes.legend(
        frameon=False, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2
    )
    return figure


def overlay_figure(
    panels: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    labels: tuple[str, str] = ("measured", "simulated"),
) -> Figure:
    """Predicted against measured, one panel per quantity.

    Args:
        panels: title -> ``(measured, simulated)`` samples of that quantity. Drawn as
            empirical CDFs, so distributions of different sizes compare directly.
        labels: legend names of the two series.
    """
    if not panels:
        raise ValueError("panels: give at least one quantity to overlay")
    figure = new_figure(max(SIZE_IN[0], 3.5 * len(panels)), 3.6)
    for i, (title, pair) in enumerate(panels.items()):
        axes = figure.add_subplot(1, len(panels), i + 1)
        for values, label, style in zip(pair, labels, ("-", "--"), strict=True):
            ordered = np.sort(np.asarray(values, float))
            if len(ordered):
                cdf = np.arange(1, len(ordered) + 1) / len(ordered)
                axes.step(ordered, cdf, style, where="post", label=label)
        axes.set_title(title, fontsize="medium")
        axes.set_ylabel("CDF" if i == 0 else "")
        axes.set_ylim(0, 1.02)
        style_axes(axes, legend=i == 0)
    return figure


def trace_overlay_figure(
    first: Iterable[TraceEvent],
    second: Iterable[TraceEvent],
    *,
    labels: tuple[str, str] = ("measured", "simulated"),
) -> Figure:
    """Two traces of the same schema side by side (a real run and its simulation, or any
    two runs): generation latency and train-step time as CDFs (a log time axis when the
    times span more than ``LOG_SPAN`` times, as a run's compilations make them), the
    staleness of trained rollouts, and trained samples against the time since each
    run's first generation began (a warm start is not part of the comparison). When the
    two runs trained more than ``SHARE_RATIO`` times apart in samples, each is drawn as
    a share of its own total, and the axis says so.
    """
    traces = (list(first), list(second))
    figure = new_figure(9.0, 6.0)
    (latency, step), (stale, progress) = figure.subplots(2, 2)
    styles = ("-", "--")
    totals = [sum(int(e["samples"]) for e in t if e.kind == "train_step") for t in traces]
    shares = min(totals) > 0 and max(totals) > SHARE_RATIO * min(totals)
    for events, label, style, colour, total in zip(
        traces, labels, styles, ("C0", "C1"), totals, strict=True
    ):
        for axes, values in (
            (latency, [r.latency_s for r in generation_records(events)]),
            (step, durations(events, "train_step")),
        ):
            ordered = np.sort(np.asarray(values, float))
            if len(ordered):
                cdf = np.arange(1, len(ordered) + 1) / len(ordered)
                axes.step(ordered, cdf, style, where="post", color=colour, label=label)
        steps = [e for e in events if e.kind == "train_step"]
        starts = [e.t for e in events if e.kind == "generation_start"]
        origin = min(starts, default=0.0)
        if steps:
            trained = np.cumsum([int(e["samples"]) for e in steps]) / (total if shares else 1)
            times = [e.t - origin for e in steps]
            progress.step(times, trained, style, where="post", color=colour, label=label)
    width = 0.4
    for i, (events, colour, label) in enumerate(zip(traces, ("C0", "C1"), labels, strict=True)):
        counts = staleness_distribution(events)
        total = sum(counts.values()) or 1
        ages = np.array(sorted(counts), float)
        stale.bar(
            ages + (i - 0.5) * width,
            [counts[a] / total for a in sorted(counts)],
            width,
            color=colour,
            hatch="//" if i else None,
            edgecolor="white",
            label=label,
        )
    for axes in (latency, step):
        low, high = axes.dataLim.intervalx
        if low > 0 and high > LOG_SPAN * low:
            axes.set_xscale("log")
            log_ticks(axes.xaxis, (low, high))
    latency.set(xlabel="generation latency (s)", ylabel="CDF", ylim=(0, 1.02))
    step.set(xlabel="train-step time (s)", ylabel="CDF", ylim=(0, 1.02))
    stale.set(xlabel="staleness of trained rollouts (versions)", ylabel="fraction")
    stale.xaxis.set_major_locator(MaxNLocator(integer=True))
    progress.set(
        xlabel="time since the run's first generation began (s)",
        ylabel="share of the run's samples trained" if shares else "samples trained",
    )
    for axes, title in (
        (latency, "generation latency, cumulative"),
        (step, "train-step time, cumulative"),
        (stale, "staleness of trained rollouts"),
        (progress, "samples trained over time" + (" (each run's own total)" if shares else "")),
    ):
        axes.set_title(title, fontsize="medium")
    for axes in (latency, step, stale, progress):
        style_axes(axes)
    latency.legend(frameon=False, fontsize="small", loc="lower right")
    stale.legend(frameon=False, fontsize="small")
    return figure
