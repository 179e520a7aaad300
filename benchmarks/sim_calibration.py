"""How well ``sim.calibrate`` predicts real local runs: calibrate on one run, predict others.

Runs the deterministic local backend on the tests' tiny model (``config.SMALL_RUN``):
a base run at η = 1 with 2 workers, and runs that change one setting each (η = 0,
η = 2, 1 worker, 8 prompts per step). ``sim.calibrate`` fits the serial host model
(``sim/entities/host.py``) to the base trace and predicts each run's samples/s over its
measured window (after ``--warmup-steps`` train steps); the error is predicted ÷
measured - 1. ``self`` predicts the base run itself. With ``--repeats`` above 1 every configuration
runs that many times; ``pooled_errors`` compares the mean prediction with the mean
measurement.

Every configuration first runs a few throw-away steps (the warm start, and the
compilations of its shapes, stay out of the timed runs); a timed run whose window still
compiled a program (a rare shape appearing late) is run again. Each run starts with the
objects that exist before it frozen (``gc.freeze``: a full collection of the process's
heap would otherwise land in a window at random). Runs are timed on the process's CPU
clock by default (``--clock cpu``): on a shared machine the wall time of a window of a
few tenths of a second depends on the other jobs; ``--clock wall`` times them as the
runtime does by default.

What to expect (docs/simulator.md): errors of a few percent, as large as the spread
of repeated runs of one configuration on a loaded machine (a base run measured a few
percent slow or fast shifts every prediction with it). 8 prompts per step leans high:
a bigger batch trains the policy differently, dynamic filtering then drops a larger
share of groups (0.60 to 0.64, and 0.63 to 0.69, in two sets of runs), and the
simulator holds the share it fitted on the base run.

Usage::

    python benchmarks/sim_calibration.py --quick   # < 60 s on 2 cores
    python benchmarks/sim_calibration.py           # longer runs, two repeats

The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import sim  # noqa: E402
from rlaxkit.config.run import small_run_config  # noqa: E402
from rlaxkit.runtime.record import record_local_run  # noqa: E402
from sim.calibration.window import window_summary  # noqa: E402

# On the CPU clock (the default) the threads' seconds add up: one chunk after another.
BASE = ("staleness.max_staleness=1", "runtime.threaded_chunks=false")
# name -> (runtime overrides of the base run, simulator overrides of its fit)
TARGETS = {
    "self": ((), {}),
    "eta0": (("staleness.max_staleness=0",), {"staleness.max_staleness": 0}),
    "eta2": (("staleness.max_staleness=2",), {"staleness.max_staleness": 2}),
    "workers1": (("runtime.num_workers=1",), {"fleet.num_workers": 1}),
    "batch8": (("staleness.batch_size=8",), {"workload.prompts_per_step": 8}),
}


def run(cache: str, steps: int, overrides: tuple[str, ...], clock: str, warmup_steps: int):
    """One run's trace events, and how many runs it took (``record_local_run``)."""
    config = small_run_config(*BASE, *overrides)
    return record_local_run(config, steps, warmup_steps=warmup_steps, clock=clock, cache_dir=cache)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 steps, one repeat")
    parser.add_argument("--smoke", action="store_true", help="a few steps (tests)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = parser.parse_args(argv)
    steps, repeats = args.steps, args.repeats
    if args.quick:
        steps, repeats = 30, 1
    if args.smoke:
        steps, repeats = args.warmup_steps + 3, 1
    load_before = os.getloadavg()
    started = time.perf_counter()
    cache = tempfile.mkdtemp(prefix="rlaxkit-sim-calibration-")
    if not jax.config.jax_compilation_cache_dir:
        # Every run builds a fresh Experiment (a fresh train-step closure): a persistent
        # cache spares its identical programs a second compile (outside the windows).
        jax.config.update("jax_compilation_cache_dir", os.path.join(cache, "jax"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    for overrides, _ in TARGETS.values():  # warm start and compilations, not timed
        run(cache, min(steps, 6), overrides, args.clock, args.warmup_steps)
    measured: dict[str, list[float]] = {name: [] for name in TARGETS}
    predicted: dict[str, list[float]] = {name: [] for name in TARGETS}
    reruns = 0
    for _ in range(repeats):
        traces = {}
        for name, (overrides, _) in TARGETS.items():
            traces[name], attempts = run(cache, steps, overrides, args.clock, args.warmup_steps)
            reruns += attempts - 1
        for name, (_, sim_overrides) in TARGETS.items():
            result = sim.calibrate(
                traces["self"], warmup_steps=args.warmup_steps, overrides=sim_overrides
            )
            measured[name].append(window_summary(traces[name], args.warmup_steps).samples_per_s)
            predicted[name].append(result.predicted_window.samples_per_s)
    print(f"{'setting':>10} {'measured':>10} {'predicted':>10} {'error':>8}  (samples/s)")
    errors = {}
    for name in TARGETS:
        for m, p in zip(measured[name], predicted[name], strict=True):
            print(f"{name:>10} {m:>10.1f} {p:>10.1f} {p / m - 1:>+8.3f}")
        pairs = zip(measured[name], predicted[name], strict=True)
        errors[name] = [round(p / m - 1, 4) for m, p in pairs]
    # Over the repeats: mean prediction (one per base run) against mean measurement.
    pooled = {
        name: round(float(np.mean(predicted[name]) / np.mean(measured[name]) - 1), 4)
        for name in TARGETS
    }
    print("pooled over repeats:", " ".join(f"{k} {v:+.3f}" for k, v in pooled.items()))
    report = {
        "clock": args.clock,
        "steps": steps,
        "repeats": repeats,
        "warmup_steps": args.warmup_steps,
        "errors": errors,
        "pooled_errors": pooled,
        "max_abs_error_eta_workers": max(
            abs(e) for name in ("self", "eta0", "eta2", "workers1") for e in errors[name]
        ),
        "measured_samples_per_s": {k: [round(v, 1) for v in vs] for k, vs in measured.items()},
        "predicted_samples_per_s": {k: [round(v, 1) for v in vs] for k, vs in predicted.items()},
        "reruns_after_compiling": reruns,
        "wall_s": round(time.perf_counter() - started, 1),
        "load_avg_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
