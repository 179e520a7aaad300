"""Least-squares fits shared by calibration: the parallel fleet's decode model and the
trainer's step time (see :mod:`sim.calibrate` for what each reads from a trace)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike

from rlaxkit.trace import GenerationRecord, TraceEvent, generation_records

__all__ = [
    "COMPILE_FACTOR",
    "compiled",
    "fit_decode",
    "fit_group_lengths",
    "fit_trainer",
    "nonnegative_lstsq",
    "pause_overlap",
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
    (multi-turn episodes, :func:`sim.calibrate_turns.fit_turns`): per ``(actor,
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


def fit_trainer(events: list[TraceEvent], start_s: float = float("-inf")) -> dict[str, float]:
    steps = [e for e in events if e.kind == "train_step" and "tokens" in e.fields and e.t > start_s]
    if not steps:
        raise ValueError("trace: no train_step events with tokens to fit the trainer")
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


def fit_group_lengths(records: Sequence[GenerationRecord]) -> tuple[list[float], float] | None:
    """Group lengths and the within-group spread of a trace's completions.

    Samples are named ``"<group>:<index>"`` in the runtime's traces and
    ``"<group>/<index>"`` in the simulator's. For each group with two or
    more finished samples: its mean length ``L`` and the logs of its samples' lengths.
    ``σ`` is the pooled standard deviation of ``log(length)`` within groups (each group's
    variance with one degree of freedom taken out, weighted by its degrees of freedom),
    the spread of :attr:`sim.specs.WorkloadSpec.within_group_sigma`.

    >>> from rlaxkit.trace import GenerationRecord
    >>> def record(sample, tokens):
    ...     return GenerationRecord("w0", sample, 0.0, 1.0, tokens, 4, 1, 0, 0)
    >>> lengths = [("0:0", 10), ("0:1", 10), ("1:0", 40), ("1:1", 40)] * 2
    >>> fit_group_lengths([record(f"{g}{i}", n) for i, (g, n) in enumerate(lengths)])
    >>> records = [record(f"{g}:{i}", n) for g in range(4) for i, n in enumerate((8, 12))]
    >>> means, sigma = fit_group_lengths(records)
    >>> means, round(sigma, 3)
    ([10.0, 10.0, 10.0, 10.0], 0.287)

    Returns:
        ``(group mean lengths, σ)``, or ``None`` when fewer than
        ``MIN_GROUPS_FOR_SPREAD`` groups have two finished samples (or samples are not
        named by group).
    """
    groups: dict[str, list[int]] = {}
    for record in records:
        named = _SAMPLE_NAME.match(record.sample)
        if named is None or record.tokens < 1:
            continue
        groups.setdefault(named.group(1), []).append(record.tokens)
    full = [tokens for tokens in groups.values() if len(tokens) >= 2]
    if len(full) < MIN_GROUPS_FOR_SPREAD:
        return None
    squares = sum(float(np.var(np.log(tokens)) * len(tokens)) for tokens in full)
    dof = sum(len(tokens) - 1 for tokens in full)
    means = [float(np.mean(tokens)) for tokens in full]
    return means, float(np.sqrt(squares / dof))
