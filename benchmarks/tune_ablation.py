"""Which of the tuner's knobs does the simulator mispredict? One knob at a time, run.

Calibrates on one fault-free real run at ``tune_check.START`` (η = 0, a checkpoint
every 20 steps), as ``benchmarks/tune_check.py`` does, then predicts and measures (with
``tune_check.PLAN``) the default settings and changes of the knobs the tuner picked:
η = 4 alone, in-flight pulls alone, a push every 2 steps (with η = 4: at η = 0 it
cannot run, ``rlaxkit.rules.policies.check_admission``), η = 4 with in-flight pulls,
and all three. Runs as ``benchmarks/sim_fidelity.py`` times them (CPU clock, one XLA
thread, the window after the warm-up steps); each setting runs ``--runs`` times, taken
in turn (every other pass in reverse order, so that a drift of the machine's speed over
the benchmark favours no setting), and its error is ``predicted / mean measured - 1``.

Usage::

    python benchmarks/tune_ablation.py --quick   # 30 steps, 2 runs of each setting

``--save DIR`` writes each real run's trace and one simulated trace per setting there
(JSONL) for comparing them event by event. The last line printed is one JSON object:
per setting, its settings, predicted and measured samples/s (each run's too) and the
error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim_fidelity  # noqa: E402
import tune_check  # noqa: E402

import sim  # noqa: E402
from rlaxkit.rules.fault_plan import FaultPlan  # noqa: E402
from rlaxkit.rules.trace import MemoryTrace, TraceEvent  # noqa: E402
from sim.scenario import with_overrides  # noqa: E402

DEFAULT = {
    "staleness.max_staleness": 0,
    "weight_sync.push_every_steps": 1,
    "weight_sync.pull_mode": "between_requests",
    "checkpointing.every_steps": 20,
}
CHANGES: dict[str, dict[str, Any]] = {
    "default": {},
    "eta4": {"staleness.max_staleness": 4},
    "in_flight": {"weight_sync.pull_mode": "in_flight"},
    "eta4_push2": {"staleness.max_staleness": 4, "weight_sync.push_every_steps": 2},
    "eta4_in_flight": {"staleness.max_staleness": 4, "weight_sync.pull_mode": "in_flight"},
    "all3": {
        "staleness.max_staleness": 4,
        "weight_sync.push_every_steps": 2,
        "weight_sync.pull_mode": "in_flight",
    },
}


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", sim_fidelity.ONE_THREAD_XLA)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 steps, 2 runs of each")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--runs", type=int, default=3, help="real runs of each setting")
    parser.add_argument("--repeats", type=int, default=10, help="simulations per setting")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=sorted(CHANGES), help="these settings")
    parser.add_argument("--save", type=Path, help="write the real and simulated traces here")
    args = parser.parse_args(argv)
    steps, runs = (30, 2) if args.quick else (args.steps, args.runs)
    names = args.only or list(CHANGES)
    load_before = os.getloadavg()
    started = time.perf_counter()
    cache = sim_fidelity.run_cache("rlaxkit-tune-ablation-")
    warmup, plan = args.warmup_steps, tune_check.PLAN
    record = sim_fidelity.local_recorder(cache, "cpu", warmup, overrides=tune_check.START)
    record(plan, 10)  # warm start, compilations and a restore, not timed
    base = record(FaultPlan(), steps)
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)
        _write(base, args.save / "base.jsonl")
    settings = {name: {**DEFAULT, **CHANGES[name]} for name in names}
    predicted = {}
    for name in names:
        prediction = sim.calibrate(
            base,
            warmup_steps=warmup,
            faults=plan,
            overrides={**settings[name], **sim_fidelity.CPU_CLOCK_HOST},
            repeats=args.repeats,
        )
        predicted[name] = prediction.predicted_figures["samples_per_s"]
        if args.save:
            simulated = MemoryTrace()
            sim.simulate(with_overrides(prediction.scenario, {"seed": 0}), trace=simulated)
            _write(simulated.events, args.save / f"sim_{name}.jsonl")
    recorders = {
        name: sim_fidelity.local_recorder(
            cache, "cpu", warmup, overrides=sim.run_overrides(settings[name])
        )
        for name in names
    }
    measured: dict[str, list[float]] = {name: [] for name in names}
    for run in range(runs):  # every other pass in reverse (the module docstring)
        for name in names if run % 2 == 0 else names[::-1]:
            events = recorders[name](plan, steps)
            measured[name].append(sim_fidelity._measure(events, warmup)["samples_per_s"])
            if args.save:
                _write(events, args.save / f"real_{name}_{run}.jsonl")
    rows = {}
    for name in names:
        mean = sum(measured[name]) / runs
        rows[name] = {
            "settings": CHANGES[name],
            "predicted_samples_per_s": round(predicted[name], 2),
            "measured_samples_per_s": round(mean, 2),
            "measured_runs": [round(m, 2) for m in measured[name]],
            "error": round(predicted[name] / mean - 1, 4),
        }
    print(f"{'setting':>15} {'predicted':>10} {'measured':>10} {'error':>8}  runs")
    for name, row in rows.items():
        print(
            f"{name:>15} {row['predicted_samples_per_s']:>10.4g} "
            f"{row['measured_samples_per_s']:>10.4g} {row['error']:>+8.3f}  "
            f"{row['measured_runs']}"
        )
    report = {
        "settings": rows,
        "steps": steps,
        "runs": runs,
        "repeats": args.repeats,
        "clock": "cpu",
        "wall_s": round(time.perf_counter() - started, 1),
        "load_avg_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }
    print(json.dumps(report))
    return 0


def _write(events: Iterable[TraceEvent], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for event in events:
            handle.write(event.to_json() + "\n")


if __name__ == "__main__":
    sys.exit(main())
