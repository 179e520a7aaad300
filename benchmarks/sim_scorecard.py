"""The simulator's accuracy card: real runs, each predicted from one fault-free run.

A fixed matrix of cells. Each cell is a real run of the local runtime (the tests' tiny
model, the settings of ``benchmarks/sim_fidelity.py``: two workers in one slice, a
checkpoint every 10 steps) at a staleness bound η with a fault plan, and the
simulator's prediction of it, calibrated once per η on a fault-free run of the same
config (``sim.calibrate(..., faults=plan)``, the serial host). Per cell: samples/s,
goodput, lost and re-issued samples, staleness mean and p90 (as
``sim.calibration.host.fault_figures`` counts them), measured, predicted and the error
(predicted ÷ measured − 1; staleness and counts measured as zero: predicted − measured).

The machine's load: runs are timed on the process's CPU clock with XLA on one thread
(``sim_fidelity.ONE_THREAD_XLA``), so what other processes take of the cores does not
enter a duration; the load average before and after is printed with the card. The
``none`` plan is a second fault-free run: its errors are the spread of repeated runs.

Cells, full run (``--quick``: η ∈ {0, 2}, plans none, workers and trainer, 30 steps):

- local, η ∈ {0, 2, 8} × plans none, workers, slice, trainer;
- local, the parameter server killed: not predicted (the serial host does not model
  the parameter server's faults; the row says so);
- Ray, η = 1, worker preemptions that kill actors (``sim_fidelity.ray_fidelity``; full
  run only).

Multi-turn runs with a tool latency and a long-tailed length task are not cells yet.

Usage::

    python benchmarks/sim_scorecard.py --quick

The last line printed is one JSON object: per figure the largest absolute error over
the cells, the cells within 10 % (staleness within 0.2 versions) and the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim_fidelity  # noqa: E402

# Within these the cell passes: relative error for rates and counts, versions for staleness.
RELATIVE_GOAL = 0.10
STALENESS_GOAL = 0.2
NOT_MODELLED = {
    "param_server": (
        "not predicted: the serial host (the local runtime's deterministic mode) does not "
        "model the parameter server's faults (sim.scenario.SERIAL_FAULT_KINDS)"
    ),
}


def cell_passes(row: dict[str, Any]) -> bool:
    """Every figure within its goal (lost samples: where the real run lost some)."""
    for figure, error in row["errors"].items():
        if error is None:
            continue
        goal = STALENESS_GOAL if figure.startswith("staleness") else RELATIVE_GOAL
        if abs(error) > goal:
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", sim_fidelity.ONE_THREAD_XLA)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="η 0 and 2, three plans, 30 steps")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--runs", type=int, default=2, help="real runs of each cell")
    parser.add_argument("--repeats", type=int, default=20, help="simulations per cell")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--ray-steps", type=int, default=60)
    args = parser.parse_args(argv)
    etas: tuple[int, ...] = (0, 2, 8)
    plan_names: tuple[str, ...] = tuple(sim_fidelity.PLANS)
    steps, runs, with_ray = args.steps, args.runs, True
    if args.quick:
        etas, plan_names = (0, 2), ("none", "workers", "trainer")
        steps, runs, with_ray = 30, 1, False
    load_before = os.getloadavg()
    started = time.perf_counter()
    cache = sim_fidelity.run_cache("rlaxkit-sim-scorecard-")
    plans = {name: sim_fidelity.PLANS[name] for name in plan_names}
    rows: dict[str, dict[str, Any]] = {}
    for eta in etas:
        record = sim_fidelity.local_recorder(
            cache, "cpu", args.warmup_steps, overrides=(f"staleness.max_staleness={eta}",)
        )
        if eta == etas[0]:
            record(sim_fidelity.PLANS["trainer"], 10)  # warm start, compilations, not timed
        report = sim_fidelity.fidelity(
            record,
            steps=steps,
            warmup_steps=args.warmup_steps,
            repeats=args.repeats,
            runs=runs,
            plans=plans,
            host=sim_fidelity.CPU_CLOCK_HOST,
        )
        for name, row in report["plans"].items():
            rows[f"local eta={eta} {name}"] = row
    if with_ray:
        rows["ray eta=1 workers"] = sim_fidelity.ray_fidelity(
            cache, steps=args.ray_steps, warmup_steps=args.warmup_steps, repeats=args.repeats
        )
    figures = sim_fidelity.FIGURES
    print(f"{'cell':>24} {'figure':>15} {'measured':>10} {'predicted':>10} {'error':>8}")
    for name, row in rows.items():
        for figure in figures:
            m, p, e = row["measured"][figure], row["predicted"][figure], row["errors"][figure]
            error = "-" if e is None else f"{e:+.3f}"
            print(f"{name:>24} {figure:>15} {m:>10.4g} {p:>10.4g} {error:>8}")
    for name, why in NOT_MODELLED.items():
        print(f"{'local ' + name:>24} {why}")
    passed = [name for name, row in rows.items() if cell_passes(row)]
    card: dict[str, Any] = {
        f"{figure}_err": max(
            (abs(e) for row in rows.values() if (e := row["errors"][figure]) is not None),
            default=0.0,
        )
        for figure in figures
    }
    card |= {
        "cells": len(rows),
        "cells_within_goal": len(passed),
        "cells_off_goal": sorted(set(rows) - set(passed)),
        "not_predicted": sorted(NOT_MODELLED),
        "clock": "cpu",
        "steps": steps,
        "runs": runs,
        "repeats": args.repeats,
        "wall_s": round(time.perf_counter() - started, 1),
        "load_avg_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    print(json.dumps(card))
    return 0


if __name__ == "__main__":
    sys.exit(main())
