"""Figures of runs and studies from metrics and traces, in one style; ``plot_run(run_dir)``
writes a run's figures as PNGs (``rlaxkit plot RUN_DIR``, ``make demo``).

Every function returns a matplotlib ``Figure`` on the Agg canvas (no pyplot state, no
display needed), ready for ``savefig`` or to be the last expression of a notebook cell.
Trace figures (timeline, staleness histogram) are drawn by the functions the simulator
uses (``sim.report``), so a real run and a simulated one look alike.

- :func:`reward_figure`: training reward per step, held-out pass@1 points;
- :func:`curves_figure`: one metric per step for several runs (reward, pass rate, ...);
- :func:`pass_at_k_figure`: held-out pass@k against k for several runs or checkpoints;
- :func:`update_figure`: what one train step did: ratios against advantages, update size;
- :func:`drift_figure`, :func:`audit_figure`: drift attribution (staleness and mismatch)
  and the sampled-against-trained audit over a run (``rlaxkit.observe.drift``,
  ``rlaxkit.rules.audit``);
- :func:`comparison_figure`: bars of summary numbers (wall time, samples/s) per run;
- :func:`scaling_figure`: throughput against fleet size, with linear scaling;
- :func:`overlay_figure`: a simulated series over a measured one;
- :func:`trace_overlay_figure`: two traces (sim against real, or any two) overlaid;
- :func:`throughput_figure`, :func:`drops_figure`, :func:`timeline_figure`,
  :func:`staleness_figure`: a trace's throughput and goodput over time, drops stacked by
  reason, the Gantt chart, the staleness histogram (from ``sim.report``);
- :func:`plot_run`: a run directory's figures as PNGs (``rlaxkit plot RUN_DIR``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import (
    FuncFormatter,
    LogLocator,
    MaxNLocator,
    NullFormatter,
    NullLocator,
)

from rlaxkit.observe.metrics import read_metrics
from rlaxkit.rules.trace import (
    TraceEvent,
    durations,
    generation_records,
    read_trace,
    staleness_distribution,
    trace_path,
)
from sim.report import drops_figure, staleness_figure, throughput_figure, timeline_figure

__all__ = [
    "DPI",
    "FIGURES",
    "SIZE_IN",
    "audit_figure",
    "compare_runs_figure",
    "comparison_figure",
    "curves_figure",
    "drift_figure",
    "drops_figure",
    "overlay_figure",
    "pass_at_k_figure",
    "plot_run",
    "reward_figure",
    "scaling_figure",
    "staleness_figure",
    "throughput_figure",
    "timeline_figure",
    "trace_overlay_figure",
    "update_figure",
]

DPI = 100
SIZE_IN = (7.0, 4.0)  # every PNG plot_run writes: 700 x 400 pixels at DPI
LOG_SPAN = 10.0  # times spanning more than this factor are drawn on a log axis
SHARE_RATIO = 3.0  # runs this many times apart in samples are each drawn as a share


def _figure(width: float = SIZE_IN[0], height: float = SIZE_IN[1]) -> Figure:
    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _style(axes: Axes, *, legend: bool = False) -> Axes:
    """The one look: light grid, no top/right spines, small legend without a frame."""
    axes.grid(alpha=0.3)
    axes.spines[["top", "right"]].set_visible(False)
    if legend and axes.get_legend_handles_labels()[0]:
        axes.legend(frameon=False, fontsize="small")
    return axes


def _log_ticks(axis: Any, limits: tuple[float, float]) -> None:
    """Labels on a log axis that do not collide: 1-2-5 steps within two decades,
    the decades only beyond, plain numbers, no minor labels."""
    low, high = limits
    steps = (1.0, 2.0, 5.0) if high / max(low, 1e-300) < 100 else (1.0,)
    axis.set_major_locator(LogLocator(base=10, subs=steps))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _smooth(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing moving average (the first points average what exists so far)."""
    array = np.asarray(values, float)
    if window <= 1 or len(array) == 0:
        return array
    cumulative = np.cumsum(np.insert(array, 0, 0.0))
    ends = np.arange(1, len(array) + 1)
    starts = np.maximum(ends - window, 0)
    return (cumulative[ends] - cumulative[starts]) / (ends - starts)


def reward_figure(metrics: Sequence[Mapping[str, Any]], evals: Sequence[Mapping] = ()) -> Figure:
    """Training reward per trainer step, with held-out pass@1 points if given.

    Args:
        metrics: the run's per-step metrics (``step`` and ``reward/mean`` are read).
        evals: ``{"step", "pass@1"}`` rows (``summary.json``'s ``evals``); with
            ``pass@1_se`` the curve gets its 95% band.
    """
    figure = _figure()
    axes = figure.add_subplot()
    steps = [m["step"] for m in metrics]
    axes.plot(steps, [m["reward/mean"] for m in metrics], label="train reward (mean)", lw=1)
    if evals:
        eval_steps = [e["step"] for e in evals]
        passed = np.array([e["pass@1"] for e in evals])
        axes.plot(eval_steps, passed, "o-", label="held-out pass@1", color="black")
        if all("pass@1_se" in e for e in evals):
            band = 1.96 * np.array([e["pass@1_se"] for e in evals])
            axes.fill_between(
                eval_steps,
                passed - band,
                passed + band,
                color="black",
                alpha=0.15,
                label="95% interval (over problems)",
            )
    axes.set_xlabel("trainer step")
    axes.set_ylabel("reward / accuracy")
    axes.set_ylim(0, 1)
    axes.set_title("train reward and held-out pass@1 by trainer step", fontsize="medium")
    _style(axes)
    axes.legend(frameon=False, fontsize="small", loc="lower right")  # rewards rise: room below
    return figure


def drift_figure(metrics: Sequence[Mapping[str, Any]]) -> Figure:
    """Drift attribution over the run (``rlaxkit.observe.drift``): per attributed step the mean
    ``|staleness|`` (``log π_θ − log π_v``) and ``|mismatch|`` (``log π_v − log μ``),
    solid, and their k3 KL estimates, dashed, in nats on a symlog axis (exact zeros stay
    visible). Steps that were not attributed are skipped."""
    figure = _figure()
    axes = figure.add_subplot()
    rows = [m for m in metrics if "drift/tokens" in m]
    steps = [m["step"] for m in rows]
    for part, color in (("staleness", "C0"), ("mismatch", "C3")):
        axes.plot(
            steps,
            [m[f"drift/{part}/abs_mean"] for m in rows],
            "o-",
            ms=3,
            lw=1,
            color=color,
            label=f"{part}: mean |log-ratio|",
        )
        axes.plot(
            steps,
            [m[f"drift/{part}/k3"] for m in rows],
            "--",
            lw=1,
            color=color,
            label=f"{part}: KL (k3)",
        )
    axes.set_yscale("symlog", linthresh=1e-4)
    axes.set_xlabel("trainer step")
    axes.set_ylabel("nats per token")
    axes.set_title(
        "drift per trained token\nstaleness: the trainer's weights vs the version sampled;"
        " mismatch: that version vs the sampler",
        fontsize="small",
    )
    _style(axes)
    axes.legend(
        frameon=False, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2
    )
    return figure


def audit_figure(metrics: Sequence[Mapping[str, Any]]) -> Figure:
    """The distribution audit per step (``rlaxkit.rules.audit``): the mean completion length
    and the mean per-prompt pass rate of the rollouts a step settled (sampled) and of
    those it trained, one panel each."""
    figure = _figure()
    rows = [m for m in metrics if "audit/length_ks" in m]
    steps = [m["step"] for m in rows]
    for i, (name, label, title) in enumerate(
        (
            ("length", "completion tokens", "completion length"),
            ("pass_rate", "per-prompt pass rate", "pass rate"),
        )
    ):
        axes = figure.add_subplot(1, 2, i + 1)
        for which, style in (("sampled", "-"), ("trained", "--")):
            values = [m[f"audit/{name}_{which}_mean"] for m in rows]
            axes.plot(steps, values, style, lw=1, label=f"{which} by the step")
        axes.set_xlabel("trainer step")
        axes.set_ylabel(f"mean {label}")
        axes.set_title(f"{title}: sampled vs trained rollouts", fontsize="medium")
        _style(axes, legend=i == 0)
    return figure


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
    figure = _figure(max(SIZE_IN[0], 3.6 * len(keys)), SIZE_IN[1])
    for i, key in enumerate(keys):
        axes = figure.add_subplot(1, len(keys), i + 1)
        for label, metrics in runs.items():
            rows = [m for m in metrics if key in m and x in m]
            if rows:
                values = _smooth([float(m[key]) for m in rows], smooth)
                axes.plot([m[x] for m in rows], values, label=label, lw=1.2)
        axes.set_xlabel(x)
        axes.set_title(key, fontsize="medium")
        _style(axes, legend=i == 0)
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
    figure = _figure(11.0, 7.0)
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
            values = _smooth([m["reward/mean"] for m in metrics], smooth)
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
        _style(axes)
    reward.legend(frameon=False, fontsize="x-small", ncol=2, loc="lower right")
    return figure


def pass_at_k_figure(reports: Mapping[str, Sequence[Mapping[str, Any]]]) -> Figure:
    """Held-out pass@k against k (log-2 axis), one line per run or checkpoint.

    Args:
        reports: label -> rows with ``k`` and ``pass@k`` (``EvalReport.rows``).
    """
    figure = _figure(5.0, 3.5)
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
    _style(axes, legend=True)
    return figure


def update_figure(
    ratios: np.ndarray,
    advantages: np.ndarray,
    update_norms: Mapping[str, float],
    *,
    clip: tuple[float, float] = (0.2, 0.2),
    top: int = 12,
    update_label: str = "||Δθ|| / ||θ||",
) -> Figure:
    """What a train step did: per-token ratio against advantage, and the update's size.

    Left: each completion token's ratio ``π_new / π_behaviour`` against its advantage,
    with the clip band ``[1 - ε_low, 1 + ε_high]``. Right: the size of the change of the
    ``top`` parameter tensors that moved most.

    Args:
        ratios: ``[N]`` per-token ratios.
        advantages: ``[N]`` the same tokens' advantages.
        update_norms: parameter path -> size of its change (e.g. ``||Δθ|| / ||θ||``).
        clip: ``(ε_low, ε_high)``.
        top: how many parameter tensors to list.
        update_label: the x label of the right panel.
    """
    ratios, advantages = np.asarray(ratios, float), np.asarray(advantages, float)
    if ratios.shape != advantages.shape:
        raise ValueError(
            f"ratios {ratios.shape} and advantages {advantages.shape} must have one entry "
            "per token each"
        )
    figure = _figure(10.0, 4.0)
    left, right = figure.subplots(1, 2, width_ratios=(1.1, 1))
    jitter = np.random.default_rng(0).uniform(-0.02, 0.02, advantages.shape)
    inside = (ratios >= 1 - clip[0]) & (ratios <= 1 + clip[1])
    left.axhspan(1 - clip[0], 1 + clip[1], color="tab:green", alpha=0.12, label="clip band")
    left.scatter(advantages[inside] + jitter[inside], ratios[inside], s=8, label="inside")
    left.scatter(
        advantages[~inside] + jitter[~inside],
        ratios[~inside],
        s=8,
        color="tab:red",
        label="clipped",
    )
    left.axhline(1.0, color="black", lw=0.8)
    left.set_xlabel("advantage")
    left.set_ylabel("ratio π_new / π_behaviour")
    left.set_title(
        f"per-token ratio against advantage (ε_low {clip[0]:g}, ε_high {clip[1]:g})",
        fontsize="medium",
    )
    _style(left, legend=True)
    largest = sorted(update_norms.items(), key=lambda kv: kv[1], reverse=True)[:top]
    names = [_short(name) for name, _ in largest][::-1]
    right.barh(names, [norm for _, norm in largest][::-1], color="tab:blue")
    right.set_xlabel(update_label)
    right.tick_params(axis="y", labelsize="x-small")
    right.set_title(f"the {len(largest)} tensors that moved most", fontsize="medium")
    _style(right)
    return figure


def _short(path: str) -> str:
    parts = [p for p in path.split("/") if p not in ("value", "layers", "kernel")]
    return "/".join(parts[-3:])


def comparison_figure(
    values: Mapping[str, float], *, ylabel: str, title: str | None = None
) -> Figure:
    """Bars of one number per run (wall time, trained samples/s, ...)."""
    figure = _figure(max(5.0, 0.7 * len(values) + 2), 3.5)
    axes = figure.add_subplot()
    labels = list(values)
    axes.bar(range(len(labels)), [values[k] for k in labels], color="tab:blue")
    axes.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    axes.set_ylabel(ylabel)
    axes.set_title(title or f"{ylabel} by run", fontsize="medium")
    _style(axes)
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
    figure = _figure(*SIZE_IN)
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
    _log_ticks(axes.yaxis, axes.get_ylim())
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
    figure = _figure(max(SIZE_IN[0], 3.5 * len(panels)), 3.6)
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
        _style(axes, legend=i == 0)
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
    figure = _figure(9.0, 6.0)
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
            _log_ticks(axes.xaxis, (low, high))
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
        _style(axes)
    latency.legend(frameon=False, fontsize="small", loc="lower right")
    stale.legend(frameon=False, fontsize="small")
    return figure


FIGURES = ("reward", "staleness", "timeline", "throughput", "drops", "drift", "audit")
TRAIN_JOB_FIGURES = ("reward", "staleness", "timeline")  # what ``rlaxkit train`` writes


def plot_run(
    run_dir: str | Path,
    *,
    figures: Sequence[str] = FIGURES,
    compare: str | Path | None = None,
    progress: bool = False,
) -> list[Path]:
    """Writes a run directory's figures as ``plots/NAME.png`` (each when its inputs
    exist) and returns the paths: ``reward``, ``drift`` and ``audit`` (from
    ``metrics.jsonl``), ``staleness``,
    ``timeline``, ``throughput`` and ``drops`` (from ``trace.jsonl``); with ``compare``
    (another run directory, real or simulated) also ``compare.png``, the two traces
    overlaid by :func:`trace_overlay_figure`. ``progress``: a bar, one tick a figure
    (a fleet-scale trace takes tens of seconds).

    Every PNG is ``SIZE_IN`` inches at ``DPI`` (700 x 400 pixels), ``compare.png``
    excepted (900 x 600: four panels).

    Raises:
        FileNotFoundError: the directory has neither ``metrics.jsonl`` nor ``trace.jsonl``.
    """
    from tqdm.auto import tqdm

    unknown = set(figures) - set(FIGURES)
    if unknown:
        raise ValueError(f"figures: unknown {sorted(unknown)}; allowed: {list(FIGURES)}")
    run_dir = Path(run_dir)
    metrics_file, trace_file = run_dir / "metrics.jsonl", trace_path(run_dir)
    if not metrics_file.exists() and not trace_file.exists():
        raise FileNotFoundError(
            f"{run_dir} has neither metrics.jsonl nor trace.jsonl; pass a run directory "
            "written by `rlaxkit train`, `rlaxkit simulate` or Experiment(run_dir=...)"
        )
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    # name -> draws the figure; each entry only when its inputs exist.
    jobs: dict[str, Callable[[], Figure]] = {}
    if metrics_file.exists() and {"reward", "drift", "audit"} & set(figures):
        metrics = read_metrics(metrics_file)
        summary_file = run_dir / "summary.json"
        evals = (
            json.loads(summary_file.read_text()).get("evals", []) if summary_file.exists() else []
        )
        if "reward" in figures and metrics and "reward/mean" in metrics[0]:
            jobs["reward"] = lambda: reward_figure(metrics, evals)
        # Each when the run measured it: drift on attributed steps, the audit every step.
        if "drift" in figures and any("drift/tokens" in m for m in metrics):
            jobs["drift"] = lambda: drift_figure(metrics)
        if "audit" in figures and any("audit/length_ks" in m for m in metrics):
            jobs["audit"] = lambda: audit_figure(metrics)
    if trace_file.exists():
        events = read_trace(trace_file)
        histogram = staleness_distribution(events)
        if histogram and "staleness" in figures:
            jobs["staleness"] = lambda: staleness_figure(histogram)
        drawers: dict[str, Callable[[list[TraceEvent]], Figure]] = {
            "timeline": timeline_figure,
            "throughput": throughput_figure,
            "drops": drops_figure,
        }
        for name, draw in drawers.items():
            if name in figures:
                jobs[name] = functools.partial(draw, events)
        if compare is not None:
            other = Path(compare)
            labels = (_source_label(run_dir), _source_label(other))

            def overlay() -> Figure:
                other_trace = read_trace(trace_path(other) if other.is_dir() else other)
                return trace_overlay_figure(events, other_trace, labels=labels)

            jobs["compare"] = overlay
    written = []
    bar = tqdm(jobs, desc="plots", unit="figure", disable=not progress, leave=False)
    for name in bar:
        bar.set_postfix_str(name)
        size = (9.0, 6.0) if name == "compare" else SIZE_IN
        written.append(_save(jobs[name](), out / f"{name}.png", size=size))
    return written


def _source_label(path: Path) -> str:
    """``"simulated (NAME)"`` for a run directory ``rlaxkit simulate`` wrote (it holds
    scenario.yaml), else ``"measured (NAME)"``: a legend says which line is which."""
    directory = path if path.is_dir() else path.parent
    kind = "simulated" if (directory / "scenario.yaml").exists() else "measured"
    return f"{kind} ({directory.name})" if directory.name else kind


def _save(figure: Figure, path: Path, size: tuple[float, float] = SIZE_IN) -> Path:
    """Saves at exactly ``size`` x ``DPI`` (no tight bbox, so the size is fixed)."""
    figure.set_size_inches(*size)
    figure.savefig(path, dpi=DPI)
    return path
