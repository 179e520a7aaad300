"""The measured window of a trace: where it starts (after the compiling first steps),
whether a program compiled inside it, and its summary."""

from __future__ import annotations

from rlaxkit.rules.trace import (
    TraceEvent,
    TraceSummary,
    summarize,
)
from rlaxkit.rules.validation import check_int
from sim.calibration.fits import (
    compiled,
)


def window_start(events: list[TraceEvent], warmup_steps: int) -> float:
    """Start of the measured window (see the module docstring)."""
    check_int("warmup_steps", warmup_steps, minimum=0)
    steps = sorted(e.t for e in events if e.kind == "train_step")
    if warmup_steps:
        if len(steps) <= warmup_steps:
            raise ValueError(
                f"warmup_steps: the trace has {len(steps)} train steps; it needs more than "
                f"warmup_steps = {warmup_steps} to measure anything (lower warmup_steps or "
                "run longer)"
            )
        return steps[warmup_steps - 1]
    loop = [e.t for e in events if e.kind != "run_start"]
    return min(loop) if loop else 0.0


def compiled_in_window(events: list[TraceEvent], warmup_steps: int) -> bool:
    """Whether a chunk or train step in the measured window compiled a program (took
    over ``COMPILE_FACTOR`` times the median of its kind): the window then measured
    the compiler too, and a benchmark or test may run it again."""
    start = window_start(events, warmup_steps)
    return any(
        compiled([e["duration_s"] for e in events if e.kind == kind and e.t > start]).any()
        for kind in ("decode", "train_step")
    )


def window_summary(events: list[TraceEvent], warmup_steps: int) -> TraceSummary:
    """``summarize`` over the measured window: the steps that end after its start."""
    start = window_start(events, warmup_steps)
    inside = [e for e in events if e.t > start and e.kind != "run_start"]
    return summarize([TraceEvent(start, "run_start", "controller", None, {}), *inside])
