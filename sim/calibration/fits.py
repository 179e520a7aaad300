"""Least-squares fits shared by calibration: the parallel fleet's decode model, the
trainer's step time and what a checkpoint save costs (see :mod:`sim.calibrate` for what
each reads from a trace).

A save costs the run more than it blocks the trainer: an asynchronous save returns once
its arrays are copied and writes them in a thread, which competes with the work beside
it (wholly on the process's CPU clock). The costs of steps, chunks and host work are
fitted from the time away from saves (:func:`save_spans`, :func:`away_from`), and each
save is charged its own cost (:func:`fit_save_cost`), so that a prediction for another
checkpoint interval charges its own saves, not the calibration run's spread over every
step.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike

from rlaxkit.rules.trace import GenerationRecord, TraceEvent, generation_records, step_span

__all__ = [
    "COMPILE_FACTOR",
    "MIN_BASELINE_INTERVALS",
    "away_from",
    "compiled",
    "fit_decode",
    "fit_length_correlation",
    "fit_save_cost",
    "fit_trainer",
    "nonnegative_lstsq",
    "pause_overlap",
    "save_spans",
]

# Fewest groups with two or more finished samples that fit a within-group spread;
# with fewer, calibration keeps independent lengths.
MIN_GROUPS_FOR_SPREAD = 4
_SAMPLE_NAME = re.compile(r"^(.+)[:/]\d+$")

# A chunk or train step over this many times the median of its kind compiled a program
# for a shape not seen before: it happens once per shape and process, so fits leave
# it out (a measured window that holds one still pays for it).
COMPILE_FACTOR = 20.0


def compiled(seconds: ArrayLike) -> np.ndarray:
    """Which of these durations of one kind compiled a program (``COMPILE_FACTOR``)."""
    durations = np.asarray(seconds, dtype=float)
    if not durations.size:
        return np.zeros(0, bool)
    return durations > COMPILE_FACTOR * np.median(durations)


def pause_overlap(records: Sequence[GenerationRecord], events: list[TraceEvent]) -> np.ndarray:
    """Seconds of each generation spent inside train-step compute (host pauses)."""
    steps = sorted((e.t - float(e["duration_s"]), e.t) for e in events if e.kind == "train_step")
    overlap = np.zeros(len(records))
    for i, record in enumerate(records):
        for begin, end in steps:
            if begin >= record.end_s:
                break
            overlap[i] += max(0.0, min(end, record.end_s) - max(begin, record.start_s))
    return overlap


def nonnegative_lstsq(
    design: np.ndarray, target: np.ndarray, *, drop_constant: bool = False
) -> np.ndarray:
    """Least squares with coefficients forced >= 0 by dropping negative columns.

    With ``drop_constant``, columns that never vary are left out from the start,
    except the first (the intercept): they could not be told from it.
    """
    active = list(range(design.shape[1]))
    if drop_constant:
        active = [0] + [j for j in active[1:] if np.ptp(design[:, j]) > 0]
    coef = np.zeros(design.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(design[:, active], target, rcond=None)
        if np.all(solution >= -1e-12):
            coef[active] = np.maximum(solution, 0.0)
            return coef
        active.pop(int(np.argmin(solution)))
    return coef


def fit_decode(
    events: list[TraceEvent],
    *,
    pauses_fleet: bool,
    start_s: float = float("-inf"),
    adjust: Mapping[tuple[str, str], tuple[float, int, int]] | None = None,
) -> dict[str, float]:
    """The decode model ``latency = prompt / prefill_rate + tokens · (a + b ·
    (occupancy - 1))`` by least squares over uninterrupted generations. ``adjust``
    (multi-turn episodes, :func:`sim.calibration.turns.fit_turns`): per ``(actor,
    sample)``, the tool seconds taken out of its latency, its policy tokens (the
    decoded ones) and observation tokens (prefilled, added to the prompt)."""
    adjust = adjust or {}
    records = [r for r in generation_records(events) if not r.interrupted and r.start_s >= start_s]
    if not records:
        raise ValueError("trace: no completed generation_start/generation_end pairs to fit")
    overlap = np.zeros(len(records))
    if pauses_fleet:
        # Prefer generations no train step paused (their occupancy held from start to
        # end); with too few of them, take the pause time out of the others.
        overlap = pause_overlap(records, events)
        if np.count_nonzero(overlap == 0) >= 20:
            records = [r for r, o in zip(records, overlap, strict=True) if o == 0]
            overlap = np.zeros(len(records))
    none = (0.0, 0, 0)
    fixes = [adjust.get((r.actor, r.sample), none) for r in records]
    tokens = np.array(
        [fix[1] if fix[1] else r.tokens for r, fix in zip(records, fixes, strict=True)],
        dtype=float,
    )
    prompt = np.array(
        [(r.prompt_tokens or 0) + fix[2] for r, fix in zip(records, fixes, strict=True)],
        dtype=float,
    )
    occupancy = np.array([max(1, r.occupancy or 1) - 1 for r in records], dtype=float)
    latency = np.array([r.latency_s for r in records], dtype=float) - overlap
    latency -= np.array([fix[0] for fix in fixes], dtype=float)
    columns = [tokens, tokens * occupancy]
    if prompt.any():
        columns.append(prompt)
    coef = nonnegative_lstsq(np.stack(columns, axis=1), latency)
    per_token = coef[0] if coef[0] > 0 else float(np.sum(latency) / np.sum(tokens))
    prefill_s_per_token = coef[2] if len(coef) > 2 else 0.0
    return {
        "decode_s_per_token": float(per_token),
        "decode_s_per_token_per_seq": float(coef[1]),
        "prefill_tokens_per_s": (
            float(1.0 / prefill_s_per_token) if prefill_s_per_token > 0 else float("inf")
        ),
    }


def fit_trainer(
    events: list[TraceEvent],
    start_s: float = float("-inf"),
    spans: Sequence[tuple[float, float]] = (),
) -> dict[str, float]:
    """``duration_s = step_overhead_s + tokens / tokens_per_s`` over the train steps after
    ``start_s`` whose compute lies outside the ``spans`` (:func:`save_spans`; all of them
    when fewer than two do), compiling steps left out."""
    steps = [e for e in events if e.kind == "train_step" and "tokens" in e.fields and e.t > start_s]
    if not steps:
        raise ValueError("trace: no train_step events with tokens to fit the trainer")
    bounds = np.array([step_span(e) for e in steps], dtype=float)
    away = away_from(spans, bounds[:, 0], bounds[:, 1])
    if np.count_nonzero(away) >= 2:
        steps = [e for e, keep in zip(steps, away, strict=True) if keep]
    tokens = np.array([e["tokens"] for e in steps], dtype=float)
    seconds = np.array([e["duration_s"] for e in steps], dtype=float)
    # A step that compiled its program (a new shape) says nothing about the next ones.
    compiling = compiled(seconds)
    tokens, seconds = tokens[~compiling], seconds[~compiling]
    proportional = {
        "tokens_per_s": float(tokens.sum() / seconds.sum()),
        "step_overhead_s": 0.0,
        "compiling_steps": int(np.count_nonzero(compiling)),
    }
    if np.ptp(tokens) <= 1e-9 * max(1.0, tokens.mean()):
        return proportional
    overhead, per_token = nonnegative_lstsq(np.stack([np.ones_like(tokens), tokens], 1), seconds)
    # When every step trains about as many tokens (a small run's batches), noise decides
    # how the time splits into overhead and rate: a slope with a standard error above
    # half its value is not measured. Then take the time as proportional to tokens,
    # the safer extrapolation to other batch sizes.
    residual = seconds - overhead - per_token * tokens
    spread = float(np.sum((tokens - tokens.mean()) ** 2))
    slope_se = np.sqrt(np.sum(residual**2) / max(len(tokens) - 2, 1) / spread)
    if per_token <= 0 or slope_se > 0.5 * per_token:
        return proportional
    return {
        "tokens_per_s": float(1.0 / per_token),
        "step_overhead_s": float(overhead),
        "compiling_steps": proportional["compiling_steps"],
    }


def save_spans(events: Sequence[TraceEvent]) -> list[tuple[float, float]]:
    """Per ``checkpoint_save``, in trace order, the time it took on the run's timeline:
    from the start of its blocking part to the end of its background write (its
    ``checkpoint_write`` event, the first of its step that ends after the save began).
    A save without one ended when it returned: a synchronous save, or a trace recorded
    before the runtime timed its writes (whose writes then stay in the fitted costs)."""
    writes: dict[int, list[float]] = {}
    for event in events:
        if event.kind == "checkpoint_write":
            # the runtime stamps it when it learns of it; ``written_s`` is the write's end
            writes.setdefault(int(event["step"]), []).append(float(event.get("written_s", event.t)))
    spans = []
    for event in events:
        if event.kind == "checkpoint_save":
            begin = event.t - float(event["duration_s"])
            ends = [t for t in writes.get(int(event["step"]), ()) if t >= begin]
            spans.append((begin, max(event.t, min(ends, default=event.t))))
    return spans


def away_from(
    spans: Sequence[tuple[float, float]], begins: ArrayLike, ends: ArrayLike
) -> np.ndarray:
    """Which intervals ``[begins[i], ends[i]]`` overlap none of the ``spans``.

    >>> away_from([(1.0, 2.0)], [0.0, 1.5, 2.5], [0.9, 3.0, 4.0]).tolist()
    [True, False, True]
    """
    begin, end = np.asarray(begins, dtype=float), np.asarray(ends, dtype=float)
    away = np.ones(begin.shape, dtype=bool)
    for lo, hi in spans:
        away &= (end <= lo) | (begin >= hi)
    return away


# Fewest train-step intervals away from every save that give the baseline a save's
# cost is measured against.
MIN_BASELINE_INTERVALS = 4


def fit_save_cost(events: Sequence[TraceEvent], start_s: float = float("-inf")) -> float | None:
    """What a checkpoint save costs the run, its background write included.

    Read from the train steps' spacing: every interval between train steps after
    ``start_s`` that overlaps a save's span (:func:`save_spans`), less the mean interval
    of the steps away from every save (the mean, not the median: steps come in bursts
    when rollouts wait, and only the mean of such intervals adds up), summed, and
    divided among the saves whose spans lie between the window's first and last train
    step. An interval that two saves' spans overlap counts once; one that only the span
    of a save outside the window overlaps (a save before the loop writing on into it)
    counts neither way.

    Returns:
        Seconds per save, or ``None`` when the window holds no save or fewer than
        ``MIN_BASELINE_INTERVALS`` intervals away from saves.
    """
    ends = np.array(
        sorted(e.t for e in events if e.kind == "train_step" and not e.discarded and e.t > start_s)
    )
    spans = save_spans(events)
    if not spans or len(ends) < 2:
        return None
    intervals, lo, hi = np.diff(ends), ends[:-1], ends[1:]
    inside = [(b, e) for b, e in spans if ends[0] <= b and e <= ends[-1]]
    away = away_from(spans, lo, hi)
    if not inside or np.count_nonzero(away) < MIN_BASELINE_INTERVALS:
        return None
    baseline = float(np.mean(intervals[away]))
    held = ~away_from(inside, lo, hi)
    return max(0.0, float(np.sum(intervals[held] - baseline)) / len(inside))


def fit_length_correlation(records: Sequence[GenerationRecord]) -> float | None:
    """How alike a group's completion lengths are: ``ρ`` of
    :attr:`sim.specs.WorkloadSpec.length_correlation`.

    Samples are named ``"<group>:<index>"`` in the runtime's traces and
    ``"<group>/<index>"`` in the simulator's. Each length becomes a normal score
    ``Φ⁻¹(rank / (n + 1))`` over all the trace's lengths (ties share their mean rank), and
    ``ρ`` is the intraclass correlation of the scores of groups with two or more finished
    samples (one-way analysis of variance, with the mean group size corrected for
    unequal groups), clipped to ``[0, 1]``.

    >>> from rlaxkit.rules.trace import GenerationRecord
    >>> def record(sample, tokens):
    ...     return GenerationRecord("w0", sample, 0.0, 1.0, tokens, 4, 1, 0, 0)
    >>> alike = [record(f"{g}:{i}", 10 * g + i) for g in range(1, 9) for i in range(2)]
    >>> round(fit_length_correlation(alike), 2)  # groups far apart, samples alike
    0.96

    Returns:
        ``ρ``, or ``None`` when fewer than ``MIN_GROUPS_FOR_SPREAD`` groups have two
        finished samples (or samples are not named by group).
    """
    groups: dict[str, list[int]] = {}
    for record in records:
        named = _SAMPLE_NAME.match(record.sample)
        if named is None:
            continue
        groups.setdefault(named.group(1), []).append(record.tokens)
    full = [tokens for tokens in groups.values() if len(tokens) >= 2]
    if len(full) < MIN_GROUPS_FOR_SPREAD:
        return None
    lengths = np.concatenate([np.asarray(tokens, dtype=float) for tokens in full])
    order = np.argsort(lengths, kind="stable")
    ranks = np.empty(len(lengths))
    ranks[order] = np.arange(1, len(lengths) + 1)
    for value in np.unique(lengths):  # ties: their mean rank
        tied = lengths == value
        ranks[tied] = ranks[tied].mean()
    normal = statistics.NormalDist()
    scores = np.array([normal.inv_cdf(r / (len(lengths) + 1)) for r in ranks])
    sizes = np.array([len(tokens) for tokens in full])
    groups_of_scores = np.split(scores, np.cumsum(sizes)[:-1])
    means = np.array([g.mean() for g in groups_of_scores])
    total, count = len(scores), len(full)
    between = float(np.sum(sizes * (means - scores.mean()) ** 2)) / (count - 1)
    within = sum(float(np.sum((g - g.mean()) ** 2)) for g in groups_of_scores) / (total - count)
    size = (total - float(np.sum(sizes**2)) / total) / (count - 1)
    if between + (size - 1) * within <= 0:
        return 0.0
    rho = (between - within) / (between + (size - 1) * within)
    return float(min(1.0, max(0.0, rho)))
