"""Parameter sweeps: many seeded runs in parallel processes, and a results table.

>>> from sim.presets import toy
>>> points = sweep(toy(), {"fleet.slots_per_worker": [2, 4]}, processes=1)
>>> [p.result.steps for p in points]
[3, 3]
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from .engine import simulate
from .metrics import SimResult
from .scenario import Scenario, with_overrides

__all__ = ["SweepPoint", "format_table", "sweep"]


@dataclass(frozen=True)
class SweepPoint:
    """One run of a sweep: the overrides applied, its seed, and what it measured."""

    overrides: dict[str, Any]
    seed: int
    result: SimResult

    def row(self) -> dict[str, Any]:
        """Overrides, seed and the result's scalar metrics in one flat dict."""
        return {**self.overrides, "seed": self.seed, **self.result.to_row()}


def _run_point(args: tuple[Scenario, dict[str, Any], int]) -> SweepPoint:
    base, overrides, seed = args
    scenario = with_overrides(base, {**overrides, "seed": seed})
    return SweepPoint(overrides=overrides, seed=seed, result=simulate(scenario))


def sweep(
    base: Scenario,
    grid: Mapping[str, Sequence[Any]],
    *,
    seeds: Iterable[int] = (0,),
    processes: int | None = None,
) -> list[SweepPoint]:
    """Run ``base`` at every combination of ``grid`` values and every seed.

    Args:
        base: The scenario to vary.
        grid: Dotted field paths (see :func:`sim.scenario.with_overrides`) to the
            values each takes; the runs are the Cartesian product.
        seeds: Seeds per combination (the same seeds for every combination, so points
            share their random preemptions and lengths: common random numbers).
        processes: Worker processes (``None``: one per CPU; ``1``: run in this process).
            Processes are spawned, not forked, so a parent that has loaded a
            multithreaded library (JAX) is safe.

    Returns:
        One :class:`SweepPoint` per run, in grid order then seed order.
    """
    names = list(grid)
    combos = [dict(zip(names, values, strict=True)) for values in itertools.product(*grid.values())]
    jobs = [(base, combo, seed) for combo in combos for seed in seeds]
    processes = processes or os.cpu_count() or 1
    if processes == 1 or len(jobs) == 1:
        return [_run_point(job) for job in jobs]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(processes, len(jobs)), mp_context=context) as pool:
        return list(pool.map(_run_point, jobs))


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Fixed-width text table of ``rows`` (dicts), one line per row, with a header."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    cells = [[_fmt(row.get(column, "")) for column in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
