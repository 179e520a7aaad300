"""Fitting the serial host (:mod:`sim.entities.host`) to a trace of the deterministic local runtime.

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

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rlaxkit.rules.fault_plan import FaultPlan
from rlaxkit.rules.trace import TraceEvent
from sim.calibration.fits import away_from, compiled, nonnegative_lstsq
from sim.host_spec import HOST_COSTS, HostSpec

__all__ = [
    "FAULT_DROPS",
    "after_rebuild",
    "fault_figures",
    "fit_host",
    "host_gaps",
    "restart_costs",
    "serial_fault_settings",
]

# Drop reasons of groups lost to a fault (rlaxkit.rules.ledger).
FAULT_DROPS = ("preempted", "rolled_back", "trainer_preempted")

_TIMED = ("reward", "pull", "push", "train_step", "checkpoint_save")


class _Gap:
    """Host time between two chunks (or rounds) and what happened in it."""

    __slots__ = ("begin_s", "timed_s", "spans", "after_chunk", "scored", "issued", "steps")

    def __init__(self, begin_s: float, after_chunk: bool) -> None:
        self.begin_s = begin_s
        self.timed_s = 0.0
        self.spans: list[tuple[float, float]] = []  # timed events that may overlap
        self.after_chunk = after_chunk
        self.scored = self.issued = self.steps = 0

    def row(self, end_s: float) -> tuple[float, list[float]]:
        """``(untimed seconds, [after_chunk, scored, issued, steps])``."""
        features = [self.after_chunk, self.scored, self.issued, self.steps]
        timed = self.timed_s + _covered(self.spans, self.begin_s, end_s)
        return end_s - self.begin_s - timed, [float(x) for x in features]


def _covered(spans: list[tuple[float, float]], begin_s: float, end_s: float) -> float:
    """Seconds of ``[begin_s, end_s]`` that the ``spans`` cover (overlaps once)."""
    covered, reach = 0.0, begin_s
    for lo, hi in sorted(spans):
        lo, hi = max(lo, reach), min(hi, end_s)
        if hi > lo:
            covered, reach = covered + hi - lo, hi
    return covered


def _rounds(chunks: list[TraceEvent]) -> list[list[TraceEvent]]:
    """Chunks grouped into the rounds of a fleet whose workers decode at once: chunks
    whose spans ``[t - duration_s, t]`` overlap belong to one round."""
    rounds: list[list[TraceEvent]] = []
    reach = float("-inf")
    for chunk in sorted(chunks, key=lambda e: e.t - float(e["duration_s"])):
        if rounds and chunk.t - float(chunk["duration_s"]) < reach:
            rounds[-1].append(chunk)
            reach = max(reach, chunk.t)
        else:
            rounds.append([chunk])
            reach = chunk.t
    return rounds


def host_gaps(
    events: Iterable[TraceEvent],
    start_s: float,
    end_s: float,
    *,
    opens_after_step: bool,
    concurrent: bool = False,
) -> tuple[np.ndarray, np.ndarray, list[bool], np.ndarray]:
    """The gaps of the window ``(start_s, end_s]`` (see the module docstring);
    ``opens_after_step``: the window starts at the end of a train step. With
    ``concurrent`` (workers that decode at once, :attr:`HostSpec.concurrent_chunks`)
    the timeline is cut at every round instead of every chunk, and timed events that
    overlap (concurrent pulls) count once.

    Returns:
        ``(untimed_s, features, after_step, bounds)``: per gap its untimed seconds, its
        features ``[after_chunk, scored, issued, train_steps]`` and its ``(begin,
        end)`` seconds; and per chunk, in time order, whether it is (in) the first
        chunk (round) after a train step.
    """
    events = sorted(events, key=lambda e: e.t)
    chunk_round: dict[int, int] = {}
    chunks = [e for e in events if e.kind == "decode" and start_s < e.t <= end_s]
    if concurrent:  # one pseudo-chunk per round, spanning its chunks
        merged = []
        for index, members in enumerate(_rounds(chunks)):
            begin = min(e.t - float(e["duration_s"]) for e in members)
            last = max(e.t for e in members)
            fields = {"duration_s": last - begin}
            for name in ("rows", "started", "finished"):
                fields[name] = sum(int(e[name]) for e in members)
            merged.append(TraceEvent(last, "decode", "fleet", None, fields))
            chunk_round |= {id(e): index for e in members}
        events = sorted([e for e in events if e.kind != "decode"] + merged, key=lambda e: e.t)
    untimed, rows, after_step, bounds = [], [], [], []
    gap = _Gap(start_s, after_chunk=False)
    trained = opens_after_step
    for event in events:
        if not start_s < event.t <= end_s:
            continue
        kind = event.kind
        if kind == "decode":
            seconds, features = gap.row(event.t - float(event["duration_s"]))
            untimed.append(seconds)
            rows.append(features)
            bounds.append((gap.begin_s, event.t - float(event["duration_s"])))
            after_step.append(trained)
            trained = False
            gap = _Gap(event.t, after_chunk=True)
            continue
        if kind in _TIMED and concurrent:
            duration = float(event.get("duration_s", 0.0))
            gap.spans.append((event.t - duration, event.t))
        elif kind in _TIMED:
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
    bounds.append((gap.begin_s, end_s))
    if concurrent:  # per chunk: whether its round was the first after a train step
        after_step = [after_step[chunk_round[id(e)]] for e in chunks]
    return np.array(untimed), np.array(rows), after_step, np.array(bounds, dtype=float)


def fit_host(
    events: list[TraceEvent],
    *,
    chunk_steps: int,
    start_s: float = float("-inf"),
    concurrent: bool = False,
    threaded: bool = False,
    spans: Sequence[tuple[float, float]] = (),
    slots_per_worker: int = 1,
) -> tuple[HostSpec, dict[str, float]]:
    """A serial :class:`HostSpec` fitted to the events after ``start_s``;
    ``concurrent``: the workers decode at once (the Ray placement's rounds,
    :attr:`HostSpec.concurrent_chunks`); ``threaded``: they decode at once on the
    local placement (:attr:`HostSpec.threaded_chunks`). The local placement's costs
    are fitted the same way either way: a chunk after a round's first is ``pipelined``
    and its event times only the host thread's wait and fetch.

    Chunks, gaps and scoring calls that overlap one of the ``spans`` (checkpoint saves
    and their background writes, :func:`sim.calibration.fits.save_spans`) are left out
    of the fits, unless fewer than ``MIN_AWAY_ROWS`` of a kind are away from them: a
    save is charged on its own (:attr:`sim.specs.CheckpointSpec.background_s`).

    ``rebuild_s`` is fitted from the chunks after a cache rebuild (``after_rebuild``)
    when ``MIN_REBUILDS`` of them are among the chunks that fit the costs; else it is a
    prefill of every one of the ``slots_per_worker`` rows, a lower bound (a rebuild
    reads each row's whole context, a prefill its prompt).

    ``worker_start_s`` is the median of the trace's :func:`restart_costs`, or without a
    restart of its ``worker_start`` events (0 without any: the local placement's
    workers start in no time).

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
    untimed, features, after_step, gap_bounds = host_gaps(
        events, begin, end, opens_after_step=windowed, concurrent=concurrent
    )
    inside = [e for e in chunks if e.t <= end]
    duration = np.array([float(e["duration_s"]) for e in inside])
    rebuilt = after_rebuild(events, inside)
    design = np.array(
        [
            [
                1.0,
                float(e.get("steps", chunk_steps)),
                float(e["started"]),
                float(e["finished"]),
                float(first),
                float(again),
            ]
            for e, first, again in zip(inside, after_step, rebuilt, strict=True)
        ]
    )
    # A chunk that compiled a program lasts hundreds of times a normal one.
    compiling = compiled(duration)
    # A pipelined chunk ran while the host scored an earlier one: its duration is only
    # the wait left over, not its cost, so only the round's first chunk fits the costs.
    costed = ~compiling & np.array([not e.get("pipelined", False) for e in inside])
    costed &= _away(spans, [e.t - float(e["duration_s"]) for e in inside], [e.t for e in inside])
    chunk = nonnegative_lstsq(design[costed], duration[costed], drop_constant=True)

    scoring = [e for e in events if e.kind == "reward" and start_s < e.t <= end]
    score = np.zeros(2)
    if scoring:
        away = _away(spans, [e.t - float(e["duration_s"]) for e in scoring], [e.t for e in scoring])
        scoring = [e for e, keep in zip(scoring, away, strict=True) if keep]
        seconds = np.array([float(e["duration_s"]) for e in scoring])
        samples = np.array([float(e.get("samples", 1)) for e in scoring])
        ones = np.ones_like(samples)
        score = nonnegative_lstsq(np.stack([ones, samples], axis=1), seconds, drop_constant=True)

    # Host terms: the intercept column (a chunk before the gap) is the first.
    away = _away(spans, gap_bounds[:, 0], gap_bounds[:, 1])
    host = nonnegative_lstsq(features[away], np.maximum(untimed[away], 0.0), drop_constant=True)
    # A replacement's start when the trace has one; else the first actors' (which
    # start beside the trainer's and compete with it for the CPUs).
    starts = restart_costs(events) or [
        float(e["duration_s"]) for e in events if e.kind == "worker_start"
    ]
    spec = HostSpec(
        executor="serial",
        chunk_steps=chunk_steps,
        chunk_s=float(chunk[0]),
        chunk_s_per_step=float(chunk[1]),
        prefill_s_per_seq=float(chunk[2]),
        finish_s_per_seq=float(chunk[3]),
        chunk_s_after_step=float(chunk[4]),
        rebuild_s=float(chunk[5])
        if rebuilt[costed].sum() >= MIN_REBUILDS
        else float(chunk[2]) * slots_per_worker,
        score_s=float(score[0]),
        score_s_per_seq=float(score[1]),
        chunk_host_s=float(host[0]),
        sample_s=float(host[1]),
        issue_s_per_seq=float(host[2]),
        step_s=float(host[3]),
        concurrent_chunks=concurrent,
        threaded_chunks=threaded,
        worker_start_s=float(np.median(starts)) if starts else 0.0,
    )
    fitted = {f"host_{name}": float(getattr(spec, name)) for name in HOST_COSTS}
    fitted["host_worker_start_s"] = spec.worker_start_s
    fitted["host_rebuilt_chunks"] = float(rebuilt[costed].sum())
    fitted["host_mean_chunk_s"] = float(duration[costed].mean())
    fitted["host_compiling_chunks"] = float(np.count_nonzero(compiling))
    fitted["host_compiling_s"] = float(duration[compiling].sum())
    fitted["host_untimed_s"] = float(untimed.sum())
    return spec, fitted


# Fewest rows of a kind (chunks, gaps, scoring calls) away from saves that fit its costs
# without the rest.
MIN_AWAY_ROWS = 10
# Fewest chunks after a cache rebuild that fit ``HostSpec.rebuild_s``; with fewer the
# calibration run did not measure it (``fit_host`` estimates it, and
# ``sim.calibration.extrapolation.extrapolations`` says so).
MIN_REBUILDS = 3


def after_rebuild(events: Iterable[TraceEvent], chunks: Sequence[TraceEvent]) -> np.ndarray:
    """Which ``chunks`` are their worker's first after a pull that rebuilt its rows'
    cache (a ``pull`` with ``rebuilt``): the runtime dispatches the rebuild and that
    chunk waits for it."""
    pending: set[str] = set()
    first: set[int] = set()
    ids = {id(e) for e in chunks}
    for event in sorted(events, key=lambda e: e.t):
        if event.kind == "pull" and event.get("rebuilt"):
            pending.add(event.actor)
        elif event.kind == "decode" and event.actor in pending:
            pending.discard(event.actor)
            if id(event) in ids:
                first.add(id(event))
    return np.array([id(e) in first for e in chunks], dtype=bool)


def _away(spans: Sequence[tuple[float, float]], begins: Any, ends: Any) -> np.ndarray:
    """``away_from``, or every row when fewer than ``MIN_AWAY_ROWS`` are away."""
    away = away_from(spans, begins, ends)
    return away if np.count_nonzero(away) >= MIN_AWAY_ROWS else np.ones_like(away)


def restart_costs(events: Iterable[TraceEvent]) -> list[float]:
    """Seconds each restarted worker held up the run, per ``restart`` followed by the
    worker's ``worker_start`` (the Ray placement's replacement actors): its start, plus
    what its first pull and its first chunks took over the run's median pull and chunk
    (a new process loads its programs: here a first chunk of about 0.45 s against
    4 ms, and a first pull of 0.25 s against 6 ms)."""
    events = sorted(events, key=lambda e: e.t)
    pulls = [float(e["duration_s"]) for e in events if e.kind == "pull"]
    chunks = [float(e["duration_s"]) for e in events if e.kind == "decode"]
    if not pulls or not chunks:
        return []
    pull_s, chunk_s = float(np.median(pulls)), float(np.median(chunks))
    costs = []
    for restart in (e for e in events if e.kind == "restart"):
        own = [e for e in events if e.actor == restart.actor and e.t > restart.t]
        start = next((e for e in own if e.kind == "worker_start"), None)
        if start is None:
            continue
        cost = float(start["duration_s"])
        first_pull = next((e for e in own if e.kind == "pull"), None)
        if first_pull is not None:
            cost += max(0.0, float(first_pull["duration_s"]) - pull_s)
        for chunk in (e for e in own if e.kind == "decode"):
            if float(chunk["duration_s"]) <= 2 * chunk_s:
                break  # its programs are loaded
            cost += float(chunk["duration_s"]) - chunk_s
        costs.append(cost)
    return costs


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
