"""The one style every figure of rlaxkit is drawn in: size and resolution, axes, legends,
log ticks and smoothing (docs/figures.md has the rule)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import (
    FuncFormatter,
    LogLocator,
    NullFormatter,
)

DPI = 100


SIZE_IN = (7.0, 4.0)  # every PNG plot_run writes: 700 x 400 pixels at DPI


LOG_SPAN = 10.0  # times spanning more than this factor are drawn on a log axis


SHARE_RATIO = 3.0  # runs this many times apart in samples are each drawn as a share


def new_figure(width: float = SIZE_IN[0], height: float = SIZE_IN[1]) -> Figure:
    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def style_axes(axes: Axes, *, legend: bool = False) -> Axes:
    """The one look: light grid, no top/right spines, small legend without a frame."""
    axes.grid(alpha=0.3)
    axes.spines[["top", "right"]].set_visible(False)
    if legend and axes.get_legend_handles_labels()[0]:
        axes.legend(frameon=False, fontsize="small")
    return axes


def log_ticks(axis: Axis, limits: tuple[float, float]) -> None:
    """Labels on a log axis that do not collide: 1-2-5 steps within two decades,
    the decades only beyond, plain numbers, no minor labels."""
    low, high = limits
    steps = (1.0, 2.0, 5.0) if high / max(low, 1e-300) < 100 else (1.0,)
    axis.set_major_locator(LogLocator(base=10, subs=steps))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def smoothed(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing moving average (the first points average what exists so far)."""
    array = np.asarray(values, float)
    if window <= 1 or len(array) == 0:
        return array
    cumulative = np.cumsum(np.insert(array, 0, 0.0))
    ends = np.arange(1, len(array) + 1)
    starts = np.maximum(ends - window, 0)
    return (cumulative[ends] - cumulative[starts]) / (ends - starts)


def short_name(path: str) -> str:
    parts = [p for p in path.split("/") if p not in ("value", "layers", "kernel")]
    return "/".join(parts[-3:])
