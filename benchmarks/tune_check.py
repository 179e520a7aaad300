"""Is the tuner's advice worth what it predicts? The tuned and the default settings, run.

1. A fault-free run of the deterministic local runtime (the tests' tiny model and two
   workers in one slice, as ``benchmarks/sim_fidelity.py`` runs it) with the settings a
   cautious user starts from, ``START``: synchronous (η = 0) and a checkpoint every 20
   steps; on the process's CPU clock, as that benchmark explains.
2. ``sim.fit_scenario`` fits the serial host to it with the fault plan ``PLAN`` (trainer
   and worker preemptions), and ``sim.tune`` searches the staleness bound, the push
   interval, the pull mode and the checkpoint interval of that scenario.
3. ``sim.calibrate`` predicts the samples/s of the default and of the tuned settings
   over the window after the warm-up steps (the window the measurement uses, averaged
   over ``--repeats`` seeds), and both settings run for real with ``PLAN``, ``--runs``
   times each in the order default, tuned, tuned, default, ...

The figure is ``gain_error = (1 + measured gain) / (1 + predicted gain) - 1``: 0 when the
tuned run beats the default by exactly the predicted margin (goal: within ±0.10).

Usage::

    python benchmarks/tune_check.py --quick

The last line printed is one JSON object: the default and tuned settings, predicted and
measured samples/s of each, both gains and ``gain_error``.
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

import sim  # noqa: E402
from rlaxkit.rules.fault_plan import Fault, FaultPlan  # noqa: E402

# Logical seconds (rounds of runtime.round_s = 1 s; about 1.6 rounds per step here).
PLAN = FaultPlan(
    (
        Fault(kind="preempt_trainer", at_step=9, restart_after_s=3.0),
        Fault(kind="preempt_worker", target="worker-0", at_s=20.0, restart_after_s=4.0),
        Fault(kind="preempt_trainer", at_step=19, restart_after_s=2.0),
    )
)
# The settings the user brings (the "default" the tuned settings are compared with).
START = ("staleness.max_staleness=0", "checkpoint.every_steps=20")
SPACE = sim.TuneSpace(
    max_staleness=(0, 1, 2, 4),
    push_every_steps=(1, 2),
    pull_mode=("between_requests", "in_flight"),
    checkpoint_every_steps=(5, 10, 20),
)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", sim_fidelity.ONE_THREAD_XLA)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 steps, 2 runs of each")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--runs", type=int, default=2, help="real runs of each setting")
    parser.add_argument("--repeats", type=int, default=10, help="simulations per setting")
    parser.add_argument("--warmup-steps", type=int, default=3)
    args = parser.parse_args(argv)
    steps, runs = (30, 2) if args.quick else (args.steps, args.runs)
    load_before = os.getloadavg()
    started = time.perf_counter()
    cache = sim_fidelity.run_cache("rlaxkit-tune-check-")
    warmup = args.warmup_steps
    record = sim_fidelity.local_recorder(cache, "cpu", warmup, overrides=START)
    record(PLAN, 10)  # warm start, compilations and a restore, not timed
    base = record(FaultPlan(), steps)
    scenario, _ = sim.fit_scenario(base, warmup_steps=warmup, faults=PLAN)
    scenario = sim.with_overrides(scenario, sim_fidelity.CPU_CLOCK_HOST)
    tuned = sim.tune(scenario, SPACE, seeds=range(3))
    default_settings, best_settings = tuned.default.settings, tuned.best.settings
    report: dict[str, Any] = {"default": default_settings, "tuned": best_settings}
    settings_of = {"default": default_settings, "tuned": best_settings}
    recorders = {
        label: sim_fidelity.local_recorder(cache, "cpu", warmup, overrides=sim.run_overrides(s))
        for label, s in settings_of.items()
    }
    # Runs in the order default, tuned, tuned, default, ...: a drift of the machine's
    # speed over the benchmark favours neither (one run after the other, the tuned
    # setting measured last was the slower of the ablation's passes).
    runs_of: dict[str, list[dict[str, float]]] = {"default": [], "tuned": []}
    for r in range(runs):
        for label in ("default", "tuned") if r % 2 == 0 else ("tuned", "default"):
            runs_of[label].append(sim_fidelity._measure(recorders[label](PLAN, steps), warmup))
    for label, settings in settings_of.items():
        prediction = sim.calibrate(
            base,
            warmup_steps=warmup,
            faults=PLAN,
            overrides={**settings, **sim_fidelity.CPU_CLOCK_HOST},
            repeats=args.repeats,
        )
        measured = runs_of[label]
        report[f"{label}_predicted_samples_per_s"] = prediction.predicted_figures["samples_per_s"]
        report[f"{label}_measured_samples_per_s"] = sum(m["samples_per_s"] for m in measured) / runs
        report[f"{label}_measured_goodput"] = sum(m["goodput"] for m in measured) / runs
    predicted_gain = (
        report["tuned_predicted_samples_per_s"] / report["default_predicted_samples_per_s"] - 1
    )
    measured_gain = (
        report["tuned_measured_samples_per_s"] / report["default_measured_samples_per_s"] - 1
    )
    report |= {
        "tuner_predicted_gain": round(tuned.predicted_gain, 4),
        "predicted_gain": round(predicted_gain, 4),
        "measured_gain": round(measured_gain, 4),
        "gain_error": round((1 + measured_gain) / (1 + predicted_gain) - 1, 4),
        "settings_simulated": len(tuned.evaluated),
        "steps": steps,
        "runs": runs,
        "clock": "cpu",
        "wall_s": round(time.perf_counter() - started, 1),
        "load_avg_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }
    for key, value in report.items():
        if isinstance(value, float):
            report[key] = round(value, 4)
    print(tuned.table())
    print(
        f"samples/s   default: predicted {report['default_predicted_samples_per_s']:.4g}, "
        f"measured {report['default_measured_samples_per_s']:.4g}\n"
        f"samples/s   tuned:   predicted {report['tuned_predicted_samples_per_s']:.4g}, "
        f"measured {report['tuned_measured_samples_per_s']:.4g}\n"
        f"gain: predicted {predicted_gain:+.1%}, measured {measured_gain:+.1%} "
        f"(gain_error {report['gain_error']:+.3f})"
    )
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
