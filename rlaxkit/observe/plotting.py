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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from rlaxkit.observe.comparisons import trace_overlay_figure
from rlaxkit.observe.metrics import read_metrics
from rlaxkit.observe.style import DPI, SIZE_IN, new_figure, short_name, style_axes
from rlaxkit.rules.trace import (
    TraceEvent,
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
    "drift_figure",
    "drops_figure",
    "plot_run",
    "reward_figure",
    "staleness_figure",
    "throughput_figure",
    "timeline_figure",
    "update_figure",
]


def reward_figure(metrics: Sequence[Mapping[str, Any]], evals: Sequence[Mapping] = ()) -> Figure:
    """Training reward per trainer step, with held-out pass@1 points if given.

    Args:
        metrics: the run's per-step metrics (``step`` and ``reward/mean`` are read).
        evals: ``{"step", "pass@1"}`` rows (``summary.json``'s ``evals``); with
            ``pass@1_se`` the curve gets its 95% band.
    """
    figure = new_figure()
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
    style_axes(axes)
    axes.legend(frameon=False, fontsize="small", loc="lower right")  # rewards rise: room below
    return figure


def drift_figure(metrics: Sequence[Mapping[str, Any]]) -> Figure:
    """Drift attribution over the run (``rlaxkit.observe.drift``): per attributed step the mean
    ``|staleness|`` (``log π_θ − log π_v``) and ``|mismatch|`` (``log π_v − log μ``),
    solid, and their k3 KL estimates, dashed, in nats on a symlog axis (exact zeros stay
    visible). Steps that were not attributed are skipped."""
    figure = new_figure()
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
    style_axes(axes)
    axes.legend(
        frameon=False, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2
    )
    return figure


def audit_figure(metrics: Sequence[Mapping[str, Any]]) -> Figure:
    """The distribution audit per step (``rlaxkit.rules.audit``): the mean completion length
    and the mean per-prompt pass rate of the rollouts a step settled (sampled) and of
    those it trained, one panel each."""
    figure = new_figure()
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
        style_axes(axes, legend=i == 0)
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
    figure = new_figure(10.0, 4.0)
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
    style_axes(left, legend=True)
    largest = sorted(update_norms.items(), key=lambda kv: kv[1], reverse=True)[:top]
    names = [short_name(name) for name, _ in largest][::-1]
    right.barh(names, [norm for _, norm in largest][::-1], color="tab:blue")
    right.set_xlabel(update_label)
    right.tick_params(axis="y", labelsize="x-small")
    right.set_title(f"the {len(largest)} tensors that moved most", fontsize="medium")
    style_axes(right)
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
    # A redraw after every figure (a handful, each far slower than a redraw): tqdm's
    # adaptive ``miniters`` otherwise skipped the last one, so the bar cleared at 3/4.
    bar = tqdm(
        jobs,
        desc="plots",
        unit="figure",
        disable=not progress,
        leave=False,
        miniters=1,
        mininterval=0,
    )
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
