"""Figures of a run from its metrics and trace; ``plot_run(run_dir)`` writes them as PNGs.

Trace figures (worker/trainer timeline, staleness histogram) are drawn by the same
functions the simulator uses (``sim.report``), so a real run and a simulated one look
alike and can be overlaid.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from rlaxkit.metrics import read_metrics
from rlaxkit.trace import read_trace, staleness_distribution
from sim.report import staleness_figure, timeline_figure

DPI = 100
SIZE_IN = (7.0, 4.0)  # every figure: 700 x 400 pixels at DPI


def reward_figure(metrics: Sequence[dict[str, Any]], evals: Sequence[dict] = ()) -> Figure:
    """Training reward and pass rate per step, with held-out pass@1 points if given."""
    fig = Figure(figsize=SIZE_IN, dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    steps = [m["step"] for m in metrics]
    ax.plot(steps, [m["reward/mean"] for m in metrics], label="train reward (mean)", lw=1)
    if evals:
        ax.plot(
            [e["step"] for e in evals],
            [e["pass@1"] for e in evals],
            "o-",
            label="held-out pass@1",
            color="black",
        )
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def plot_run(run_dir: str | Path) -> list[Path]:
    """Writes ``plots/reward.png``, ``plots/staleness.png`` and ``plots/timeline.png``
    for a run directory (each written when its inputs exist); returns the paths."""
    run_dir = Path(run_dir)
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    written = []
    metrics_file = run_dir / "metrics.jsonl"
    if not metrics_file.exists() and not (run_dir / "trace.jsonl").exists():
        raise FileNotFoundError(f"{run_dir} has neither metrics.jsonl nor trace.jsonl")
    if metrics_file.exists():
        metrics = read_metrics(metrics_file)
        summary_file = run_dir / "summary.json"
        evals = (
            json.loads(summary_file.read_text()).get("evals", []) if summary_file.exists() else []
        )
        if metrics:
            written.append(_save(reward_figure(metrics, evals), out / "reward.png"))
    trace_file = run_dir / "trace.jsonl"
    if trace_file.exists():
        events = read_trace(trace_file)
        histogram = staleness_distribution(events)
        if histogram:
            written.append(_save(staleness_figure(histogram), out / "staleness.png"))
        written.append(_save(timeline_figure(events), out / "timeline.png"))
    return written


def _save(fig: Figure, path: Path) -> Path:
    fig.set_size_inches(*SIZE_IN)
    fig.savefig(path, dpi=DPI)
    return path
