"""Fitting the serial host (:mod:`sim.host`) to a trace of the deterministic local runtime.

In that runtime one thread does everything, so the run's wall time is the sum of what
it did, and the trace times most of it directly:

- ``decode`` events (one per worker chunk) fit, by non-negative least squares,
  ``duration = chunk_s + chunk_s_per_step · steps + prefill_s_per_seq · started +
  finish_s_per_seq · finished + chunk_s_after_step · [first chunk after a train step]``;
  chunks that compiled a program (over ``COMPILE_FACTOR`` times the median) are left
  out, and so are ``pipelined`` ones (dispatched when the previous worker's results
  were fetched, they decoded while the host scored those; their duration is only the
  launch and the wait left over);
- ``reward`` events (one scoring call per chunk that completed groups) fit
  ``duration = score_s + score_s_per_seq · samples``;
- ``train_step``, ``push`` and ``pull`` events are fitted by :mod:`sim.calibrate` as
  for any run.

What no event times (issuing prompts, building rollouts, trace records, the buffer,
metrics) is host time. Cut the timeline at every chunk: each *gap* between the end
of one chunk and the start of the next (or the window's ends) holds, besides timed
events, the host work of the chunk before it, the prompt issues of a round starting
in it, and the work of any train step in it. Per gap, by non-negative least squares::

    gap - timed = chunk_host_s · [a chunk before it] + sample_s · scored
                  + issue_s_per_seq · issued + step_s · train_steps

``scored`` and ``issued`` count the gap's ``generation_end`` and ``generation_start``
events. One gap per chunk makes enough rows to tell these terms apart: in a two-worker
run half the gaps lie inside a round (no issues), half between rounds. A fixed cost
per round is not fitted: where every round issues about as many sequences it cannot
be told from the issue cost (the fit then swings between the two), and the runtime
does little per round besides issuing, so ``chunk_host_s`` carries it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from rlaxkit.faults import FaultPlan
from rlaxkit.trace import TraceEvent

from .calibrate_fits import compiled, nonnegative_lstsq
from .specs import HOST_COSTS, HostSpec

__all__ = ["FAULT_DROPS", "fault_figures", "fit_host", "host_gaps", "serial_fault_settings"]

# Drop reasons of groups lost to a fault (rlaxkit.ledger).
FAULT_DROPS = ("preempted", "rolled_back", "trainer_preempted")

_TIMED = ("reward", "pull", "push", "train_step", "checkpoint_save")


class _Gap:
    """Host time between two chunks and what happened in it."""

    __slots__ = ("begin_s", "timed_s", "after_chunk", "scored", "issued", "steps")

    def __init__(self, begin_s: float, after_chunk: bool) -> None:
        self.begin_s = begin_s
        self.timed_s = 0.0
        self.after_chunk = after_chunk
        self.scored = self.issued = self.steps = 0

    def row(self, end_s: float) -> tuple[float, list[float]]:
        """``(untimed seconds, [after_chunk, scored, issued, steps])``."""
        features = [self.after_chunk, self.scored, self.issued, self.steps]
        return end_s - self.begin_s - self.timed_s, [float(x) for x in features]


def host_gaps(
    events: Iterable[TraceEvent], start_s: float, end_s: float, *, opens_after_step: bool
) -> tuple[np.ndarray, np.ndarray, list[bool]]:
    """The gaps of the window ``(start_s, end_s]`` (see the module docstring);
    ``opens_after_step``: the window starts at the end of a train step.

    Returns:
        ``(untimed_s, features, after_step)``: per gap its untimed seconds and its
        features ``[after_chunk, scored, issued, train_steps]``; and per chunk,
        whether it is the first after a train step.
    """
    untimed, rows, after_step = [], [], []
    gap = _Gap(start_s, after_chunk=False)
    trained = opens_after_step
    for event in sorted(events, key=lambda e: e.t):
        if not start_s < event.t <= end_s:
            continue
        kind = event.kind
        if kind == "decode":
            seconds, features = gap.row(event.t - float(event["duration_s"]))
            untimed.append(seconds)
            rows.append(features)
            after_step.append(trained)
            trained = False
            gap = _Gap(event.t, after_chunk=True)
            continue
        if kind in _TIMED:
            gap.timed_s += float(event.get("duration_s", 0.0))
        if kind == "train_step":
            gap.steps += 1
            trained = True
        elif kind == "generation_start":
            gap.issued += 1
        elif kind == "generation_end":
            gap.scored += 1
    seconds, features = gap.row(end_s)
    untimed.append(seconds)
    rows.append(features)
    return np.array(untimed), np.array(rows), after_step


def fit_host(
    events: list[TraceEvent], *, chunk_steps: int, start_s: float = float("-inf")
) -> tuple[HostSpec, dict[str, float]]:
    """A serial :class:`HostSpec` fitted to the events after ``start_s``.

    Raises:
        ValueError: the trace has no ``decode`` events (only the deterministic local
            runtime's workers write them, one per chunk).
    """
    steps = [e.t for e in events if e.kind == "train_step" and e.t > start_s]
    chunks = sorted((e for e in events if e.kind == "decode" and e.t > start_s), key=lambda e: e.t)
    if not chunks or not steps:
        raise ValueError(
            "trace: no decode events to fit the serial host (the deterministic local "
            "runtime's workers write one per chunk; record the trace with this version, "
            "or calibrate with executor='parallel')"
        )
    windowed = bool(np.isfinite(start_s))  # a window opens at the end of a train step
    begin = start_s if windowed else min(e.t for e in events)
    end = max(steps)
    untimed, features, after_step = host_gaps(events, begin, end, opens_after_step=windowed)
    inside = [e for e in chunks if e.t <= end]
    duration = np.array([float(e["duration_s"]) for e in inside])
    design = np.array(
        [
            [
                1.0,
                float(e.get("steps", chunk_steps)),
                float(e["started"]),
                float(e["finished"]),
                float(first),
            ]
            for e, first in zip(inside, after_step, strict=True)
        ]
    )
    # A chunk that compiled a program lasts hundreds of times a normal one.
    compiling = compiled(duration)
    # A pipelined chunk ran while the host scored an earlier one: its duration is only
    # the wait left over, not its cost, so only the round's first chunk fits the costs.
    costed = ~compiling & np.array([not e.get("pipelined", False) for e in inside])
    chunk = nonnegative_lstsq(design[costed], duration[costed], drop_constant=True)

    scoring = [e for e in events if e.kind == "reward" and start_s < e.t <= end]
    score = np.zeros(2)
    if scoring:
        seconds = np.array([float(e["duration_s"]) for e in scoring])
        samples = np.array([float(e.get("samples", 1)) for e in scoring])
        ones = np.ones_like(samples)
        score = nonnegative_lstsq(np.stack([ones, samples], axis=1), seconds, drop_constant=True)

    # Host terms: the intercept column (a chunk before the gap) is the first.
    host = nonnegative_lstsq(features, np.maximum(untimed, 0.0), drop_constant=True)
    spec = HostSpec(
        executor="serial",
        chunk_steps=chunk_steps,
        chunk_s=float(chunk[0]),
        chunk_s_per_step=float(chunk[1]),
        prefill_s_per_seq=float(chunk[2]),
        finish_s_per_seq=float(chunk[3]),
        chunk_s_after_step=float(chunk[4]),
        score_s=float(score[0]),
        score_s_per_seq=float(score[1]),
        chunk_host_s=float(host[0]),
        sample_s=float(host[1]),
        issue_s_per_seq=float(host[2]),
        step_s=float(host[3]),
    )
    fitted = {f"host_{name}": float(getattr(spec, name)) for name in HOST_COSTS}
    fitted["host_mean_chunk_s"] = float(duration[costed].mean())
    fitted["host_compiling_chunks"] = float(np.count_nonzero(compiling))
    fitted["host_compiling_s"] = float(duration[compiling].sum())
    fitted["host_untimed_s"] = float(untimed.sum())
    return spec, fitted


def serial_fault_settings(
    events: list[TraceEvent], config: Mapping[str, Any], plan: FaultPlan | None
) -> tuple[FaultPlan, dict[str, Any]]:
    """The plan the serial host replays and the scenario overrides of the runtime's
    fault clock (``runtime.round_s``, ``restart_s``, ``workers_per_slice``).

    The plan must be the one the run was given: the runtime fires faults on its
    logical clock of rounds, and its trace records when they fired in wall (or CPU)
    time only, without a trainer's downtime, and no event marks a round in which no
    worker decoded, so neither the times nor the downtimes can be read back exactly.

    Raises:
        ValueError: the trace records preemptions and no plan was given.
    """
    if plan is None:
        fired = [e for e in events if e.kind == "preemption"]
        if fired:
            raise ValueError(
                f"faults: the trace records {len(fired)} preemptions; the serial host "
                "replays them on the runtime's logical clock, which the trace does not "
                "carry: pass the run's plan (calibrate(trace, faults=plan))"
            )
        plan = FaultPlan()
    runtime = config.get("runtime") or {}
    overrides: dict[str, Any] = {}
    if "round_s" in runtime:
        overrides["host.round_s"] = float(runtime["round_s"])
    if "restart_s" in runtime:  # one downtime for workers and trainer alike
        overrides["fleet.restart_s"] = float(runtime["restart_s"])
        overrides["trainer.restart_s"] = float(runtime["restart_s"])
    if "workers_per_slice" in runtime:
        overrides["fleet.workers_per_slice"] = int(runtime["workers_per_slice"])
    return plan, overrides


def fault_figures(
    events: Iterable[TraceEvent], start_s: float, group_size: int
) -> dict[str, float]:
    """What faults cost a run, read the same way from a real or a simulated trace.

    Over the window after ``start_s``, on the kept (not ``discarded``) train steps:
    ``samples_per_s``; ``goodput``, their compute seconds per second; the staleness of
    their rollouts (``staleness_mean``, ``staleness_p90``). Over the whole run:
    ``reissued_samples``, sequences started again after their worker lost them (a
    sample id started more than once); ``lost_samples``, those plus the samples of
    groups dropped for a fault (``FAULT_DROPS``, ``group_size`` each); ``lost_steps``,
    discarded train steps.
    """
    events = list(events)
    kept = [e for e in events if e.kind == "train_step" and not e.discarded and e.t > start_s]
    end_s = max((e.t for e in kept), default=start_s)
    window_s = max(end_s - start_s, 1e-12)
    staleness = np.array([float(s) for e in kept for s in e.get("staleness", ())])
    starts = [str(e["sample"]) for e in events if e.kind == "generation_start"]
    reissued = len(starts) - len(set(starts))
    fault_drops = sum(1 for e in events if e.kind == "drop" and e.get("reason") in FAULT_DROPS)
    return {
        "samples_per_s": sum(float(e["samples"]) for e in kept) / window_s,
        "goodput": sum(float(e["duration_s"]) for e in kept) / window_s,
        "reissued_samples": float(reissued),
        "lost_samples": float(reissued + group_size * fault_drops),
        "lost_steps": float(sum(1 for e in events if e.kind == "train_step" and e.discarded)),
        "staleness_mean": float(staleness.mean()) if staleness.size else 0.0,
        "staleness_p90": float(np.quantile(staleness, 0.9)) if staleness.size else 0.0,
    }
