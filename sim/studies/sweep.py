"""Parameter sweeps: many seeded runs in parallel processes, and a results table.

>>> from sim.presets import toy
>>> points = sweep(toy(), {"fleet.slots_per_worker": [2, 4]}, processes=1)
>>> [p.result.steps for p in points]
[3, 3]
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import sys
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from sim.engine import simulate
from sim.metrics import SimResult
from sim.scenario import Scenario, with_overrides

__all__ = ["SweepPoint", "format_table", "sweep"]


@dataclass(frozen=True)
class SweepPoint:
    """One run of a sweep: the overrides applied, its seed, and what it measured."""

    overrides: dict[str, Any]
    seed: int
    result: SimResult

    def row(self) -> dict[str, object]:
        """Overrides, seed and the result's scalar metrics in one flat dict."""
        return {**self.overrides, "seed": self.seed, **self.result.to_row()}


def _run_point(args: tuple[Scenario, dict[str, object], int]) -> SweepPoint:
    base, overrides, seed = args
    scenario = with_overrides(base, {**overrides, "seed": seed})
    return SweepPoint(overrides=overrides, seed=seed, result=simulate(scenario))


def sweep(
    base: Scenario,
    grid: Mapping[str, Sequence[object]],
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
            multithreaded library (JAX) is safe; they do not run the caller's script
            again (see :func:`_main_script_hidden`), so a script without an
            ``if __name__ == "__main__":`` guard, such as a notebook run with
            ``python notebooks/04_scaling.py``, may call ``sweep``.

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
        with _main_script_hidden():
            futures = [pool.submit(_run_point, job) for job in jobs]  # starts the processes
        return [future.result() for future in futures]


@contextlib.contextmanager
def _main_script_hidden() -> Iterator[None]:
    """While processes start, ``__main__`` is a module without a file, as in Jupyter.

    A spawned child imports the parent's ``__main__`` script again (as ``__mp_main__``)
    before it runs anything, so that functions defined there unpickle. A script without
    a main guard then runs its own top level in every child, calls ``sweep`` again and
    fails with "An attempt has been made to start a new process before the current
    process has finished its bootstrapping phase". A sweep's jobs need nothing of the
    script: ``_run_point`` and its ``Scenario`` arguments live in ``sim``. So, as for a
    notebook kernel's ``__main__``, which has no file, the children are told of no
    script (nor of a ``python -m`` module). ``fork`` would also skip the import but
    copies a parent whose JAX threads may hold locks; threads would run SimPy's
    pure-Python events one at a time.
    ``ProcessPoolExecutor`` starts its spawned processes inside ``submit`` on the
    calling thread, so the stand-in is seen by them alone.
    """
    main = sys.modules["__main__"]
    if getattr(main, "__file__", None) is None and getattr(main, "__spec__", None) is None:
        yield  # no script to hide (Jupyter, a REPL)
        return
    stand_in = types.ModuleType("__main__")
    sys.modules["__main__"] = stand_in
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def format_table(rows: Sequence[Mapping[str, object]], columns: Sequence[str] | None = None) -> str:
    """Fixed-width text table of ``rows`` (dicts), one line per row, with a header."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    cells = [[_fmt(row.get(column, "")) for column in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
