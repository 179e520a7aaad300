"""How well the simulator predicts real local runs with faults, calibrated on one without.

Runs the deterministic local backend on the tests' tiny model (``config.SMALL_RUN``, η
= 1, 2 workers in one slice, a checkpoint every ``CHECKPOINT_EVERY`` steps): a
fault-free base run, then one run per fault plan of :data:`PLANS` (worker preemptions;
a slice preemption; trainer preemptions, timed and at steps). ``sim.calibrate`` fits
the serial host (``sim/entities/host.py``) to the base trace and replays each plan on the
runtime's logical clock (``faults=plan``), averaging its figures over ``--repeats``
seeds; each is compared with the run that had the plan:

- ``samples_per_s`` and ``goodput`` (kept train compute per second) over the window
  after ``--warmup-steps`` train steps;
- ``lost_samples``: sequences started again after a fault, plus the samples of groups
  a fault dropped (``sim.calibration.host.fault_figures``);
- ``staleness_mean`` and ``staleness_p90`` of the kept steps' rollouts (in versions).

Every error is predicted ÷ measured - 1, staleness predicted - measured (versions).
Runs are timed on the process's CPU clock (``--clock cpu``, as
``benchmarks/sim_calibration.py`` explains) with XLA on one thread (``XLA_FLAGS``
below), first run a few throw-away steps (warm start and compilations), and run again
when their window compiled a program. The ``none`` plan is a second fault-free run:
its errors are the spread of repeated runs, which no prediction can beat.

Usage::

    python benchmarks/sim_fidelity.py --quick   # about 2 min on 2 cores

The last line printed is one JSON object: the largest absolute error of each figure
over the plans (``*_err``; lost samples over the plans whose real runs lost some, and
``lost_samples_where_none_measured``, the samples the simulator lost in the others) and
the per-plan rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# One XLA thread: on the CPU clock a multi-threaded XLA counts its pool's spinning, and
# repeated windows of one configuration then differ by 30% (decode time 0.21 s against
# 0.38 s); with one thread they differ by 2-3%. Set by ``main`` (before JAX starts its
# backend), not at import: a test that imports this module must not change the flags
# of the processes it starts.
ONE_THREAD_XLA = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"

import sim  # noqa: E402
from rlaxkit.rules.fault_plan import Fault, FaultPlan  # noqa: E402
from rlaxkit.rules.trace import TraceEvent  # noqa: E402
from sim.calibration.host import fault_figures, restart_costs  # noqa: E402
from sim.calibration.window import compiled_in_window, window_start  # noqa: E402

# The serial host of a run timed on the CPU clock: no two pieces of work overlap on it
# (``sim.HostSpec.serial_chunks``). Every prediction of a CPU-clock run here, in
# sim_scorecard, tune_check and tune_ablation uses it.
CPU_CLOCK_HOST = {"host.serial_chunks": True}
CHECKPOINT_EVERY = 10  # steps between checkpoints (a restore goes back up to 9 steps)
BASE = (
    "staleness.max_staleness=1",
    f"checkpoint.every_steps={CHECKPOINT_EVERY}",
    "runtime.workers_per_slice=2",
    # On the CPU clock the threads' seconds add up: one chunk after another.
    "runtime.threaded_chunks=false",
)
# Times are logical seconds (rounds of runtime.round_s = 1 s; about 1.6 rounds per step
# here), all after the warm-up steps. ``none`` is a second fault-free run: the spread
# of repeated runs, which bounds every other row.
PLANS: dict[str, FaultPlan] = {
    "none": FaultPlan(),
    "workers": FaultPlan(
        (
            Fault(kind="preempt_worker", target="worker-0", at_s=10.0, restart_after_s=4.0),
            Fault(kind="preempt_worker", target="worker-1", at_s=18.0, restart_after_s=3.0),
            Fault(kind="preempt_worker", target="worker-0", at_s=26.0, restart_after_s=6.0),
            Fault(kind="preempt_worker", target="worker-1", at_s=34.0, restart_after_s=2.0),
        )
    ),
    "slice": FaultPlan(
        (
            Fault(kind="preempt_slice", target="slice-0", at_s=14.0, restart_after_s=5.0),
            Fault(kind="preempt_slice", target="slice-0", at_s=30.0, restart_after_s=3.0),
        )
    ),
    "trainer": FaultPlan(
        (
            Fault(kind="preempt_trainer", at_step=8, restart_after_s=3.0),
            Fault(kind="preempt_trainer", at_step=17, restart_after_s=2.0),
            Fault(kind="preempt_trainer", at_s=32.0, restart_after_s=4.0),
        )
    ),
}
FIGURES = ("samples_per_s", "goodput", "lost_samples", "staleness_mean", "staleness_p90")
RELATIVE = ("samples_per_s", "goodput", "lost_samples")

Recorder = Callable[[FaultPlan, int], list[TraceEvent]]


def local_recorder(
    cache: str, clock: str, warmup_steps: int, attempts: int = 3, overrides: tuple[str, ...] = ()
) -> Recorder:
    """Records a run of the deterministic local runtime with a fault plan
    (``rlaxkit.runtime.record_local_run``: a run directory of its own for trainer
    restores, objects frozen before it, run again if its window compiled) on ``clock``.
    ``overrides`` (``"section.field=value"``) change ``BASE``."""
    from rlaxkit.config.run import small_run_config
    from rlaxkit.runtime import record_local_run

    config = small_run_config(*BASE, *overrides)

    def record(plan: FaultPlan, steps: int) -> list[TraceEvent]:
        events, _ = record_local_run(
            config,
            steps,
            warmup_steps=warmup_steps,
            clock=clock,
            cache_dir=cache,
            attempts=attempts,
            faults=plan,
        )
        return events

    return record


def ray_recorder(cache: str, warmup_steps: int, attempts: int = 3) -> Recorder:
    """Records a run of the deterministic loop on the Ray placement (a local Ray
    cluster of 2 CPUs, started by the caller) on the wall clock: the workers are actor
    processes, so a preemption kills one and a new one starts after the downtime."""
    from rlaxkit.config.ray import small_cluster_config
    from rlaxkit.config.run import small_run_config
    from rlaxkit.runtime.driver import Experiment

    config = small_run_config(*BASE, "runtime.backend=ray")

    def record(plan: FaultPlan, steps: int) -> list[TraceEvent]:
        for _ in range(attempts):
            with (
                tempfile.TemporaryDirectory() as run_dir,
                Experiment(
                    config,
                    run_dir=run_dir,
                    cache_dir=Path(cache),
                    faults=plan,
                    ray_config=small_cluster_config(),
                ) as exp,
            ):
                exp.run(steps)
                events = list(exp.trace.memory.events)
            if steps <= warmup_steps or not compiled_in_window(events, warmup_steps):
                break
        return events

    return record


def ray_fidelity(cache: str, *, steps: int, warmup_steps: int, repeats: int) -> dict[str, Any]:
    """The Ray row: a fault-free run calibrates the simulator (``concurrent_chunks``:
    the workers' chunks run at once), which predicts a run of the ``workers`` plan, in
    which every preemption kills a worker actor for real.

    The round in which a replacement actor first pulls waits for it to be up, and its
    first pull and chunks load its programs (``HostSpec.worker_start_s``,
    ``sim.calibration.host.restart_costs``). The fault-free run's trace times only the
    fleet's first actors, which start beside the trainer's and compete with it for the
    CPUs, so a short probe run with one preemption (also the warm-up) times a
    replacement on its own; the prediction is made with both (``predicted``: the
    probe's; ``predicted_initial``: the first actors')."""
    from rlaxkit.param_server.ray_store import local_cluster

    with local_cluster(num_cpus=2):
        record = ray_recorder(cache, warmup_steps)
        probe_plan = FaultPlan(
            (Fault(kind="preempt_worker", target="worker-0", at_s=4.0, restart_after_s=1.0),)
        )
        probe = record(probe_plan, 8)  # also the warm-up: compilations, warm start
        probe_s = max(restart_costs(probe))
        base = record(FaultPlan(), steps)
        plan = PLANS["workers"]
        measured = _measure(record(plan, steps), warmup_steps)
    initial = sim.calibrate(base, warmup_steps=warmup_steps, faults=plan, repeats=repeats)
    probed = sim.calibrate(
        base,
        warmup_steps=warmup_steps,
        faults=plan,
        repeats=repeats,
        overrides={"host.worker_start_s": probe_s},
    )
    predicted = probed.predicted_figures
    errors = {
        figure: (
            predicted[figure] - measured[figure]
            if figure not in RELATIVE
            else (predicted[figure] / measured[figure] - 1.0 if measured[figure] else None)
        )
        for figure in FIGURES
    }
    return {
        "measured": {k: round(v, 4) for k, v in measured.items()},
        "predicted": {k: round(v, 4) for k, v in predicted.items()},
        "predicted_initial": {k: round(v, 4) for k, v in initial.predicted_figures.items()},
        "errors": {k: None if v is None else round(v, 4) for k, v in errors.items()},
        "worker_start_probe_s": round(probe_s, 3),
        "worker_start_initial_s": round(initial.scenario.host.worker_start_s, 3),
    }


def run_cache(prefix: str) -> str:
    """A fresh folder for a benchmark's runs (warm-start caches, checkpoints), whose
    ``jax`` subfolder is the persistent compilation cache unless one is set already:
    the runs after the first load their programs instead of compiling them."""
    cache = tempfile.mkdtemp(prefix=prefix)
    import jax

    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.join(cache, "jax"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return cache


def _measure(events: list[TraceEvent], warmup_steps: int) -> dict[str, float]:
    config = next(e for e in events if e.kind == "run_start")["config"]
    group_size = int(config.get("sampling", {}).get("n", config.get("group_size", 1)))
    return fault_figures(events, window_start(events, warmup_steps), group_size)


def fidelity(
    record: Recorder,
    *,
    steps: int,
    warmup_steps: int,
    repeats: int,
    runs: int = 1,
    plans: dict[str, FaultPlan] = PLANS,
    host: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Calibrates on a fault-free run and predicts the runs of each plan; the report.

    With ``runs`` above 1 there are that many base runs and runs per plan, taken in
    turn; each base run predicts the plans' runs after it, and the mean prediction is
    compared with the mean measurement. ``host``: overrides of the fitted scenario's
    host for every prediction (``CPU_CLOCK_HOST`` for runs timed on the CPU clock).
    """
    measured_runs: dict[str, list[dict[str, float]]] = {name: [] for name in plans}
    predicted_runs: dict[str, list[dict[str, float]]] = {name: [] for name in plans}
    for _ in range(runs):
        base = record(FaultPlan(), steps)
        for name, plan in plans.items():
            measured_runs[name].append(_measure(record(plan, steps), warmup_steps))
            prediction = sim.calibrate(
                base, overrides=host, warmup_steps=warmup_steps, faults=plan, repeats=repeats
            )
            predicted_runs[name].append(prediction.predicted_figures)
    rows = {}
    for name in plans:
        measured, predicted = _mean(measured_runs[name]), _mean(predicted_runs[name])
        errors: dict[str, float | None] = {}
        for figure in FIGURES:
            m, p = measured[figure], predicted[figure]
            if figure not in RELATIVE:
                errors[figure] = p - m
            else:  # none measured: no relative error (the count is in the row)
                errors[figure] = p / m - 1.0 if m else None
        rows[name] = {
            "measured": {k: round(v, 4) for k, v in measured.items()},
            "predicted": {k: round(v, 4) for k, v in predicted.items()},
            "errors": {k: None if v is None else round(v, 4) for k, v in errors.items()},
        }
    report = {
        f"{figure}_err": max(
            (abs(e) for row in rows.values() if (e := row["errors"][figure]) is not None),
            default=0.0,
        )
        for figure in FIGURES
    }
    # Plans that lost nothing in the real runs: the samples the simulator lost there.
    report["lost_samples_where_none_measured"] = max(
        (
            row["predicted"]["lost_samples"]
            for row in rows.values()
            if row["errors"]["lost_samples"] is None
        ),
        default=0.0,
    )
    return {**report, "plans": rows}


def _mean(figures: list[dict[str, float]]) -> dict[str, float]:
    return {key: sum(f[key] for f in figures) / len(figures) for key in figures[0]}


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", ONE_THREAD_XLA)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 steps, 2 runs each")
    parser.add_argument("--runs", type=int, default=3, help="real runs of each plan")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=20, help="simulations per plan")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument(
        "--ray",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="add the Ray row (default: on, off with --quick)",
    )
    parser.add_argument("--ray-steps", type=int, default=60)
    args = parser.parse_args(argv)
    steps, runs = (30, 2) if args.quick else (args.steps, args.runs)
    load_before = os.getloadavg()
    started = time.perf_counter()
    cache = run_cache("rlaxkit-sim-fidelity-")
    record = local_recorder(cache, args.clock, args.warmup_steps)
    record(PLANS["trainer"], 10)  # warm start, compilations and a restore, not timed
    report = fidelity(
        record,
        steps=steps,
        warmup_steps=args.warmup_steps,
        repeats=args.repeats,
        runs=runs,
        host=CPU_CLOCK_HOST if args.clock == "cpu" else None,
    )
    with_ray = (not args.quick) if args.ray is None else args.ray
    if with_ray:
        on_ray = ray_fidelity(
            cache, steps=args.ray_steps, warmup_steps=args.warmup_steps, repeats=args.repeats
        )
        report["plans"]["ray_workers"] = on_ray
        report |= {
            f"ray_{figure}_err": on_ray["errors"][figure]
            for figure in FIGURES
            if on_ray["errors"][figure] is not None
        }
    print(f"{'plan':>11} {'figure':>15} {'measured':>10} {'predicted':>10} {'error':>8}")
    for name, row in report["plans"].items():
        for figure in FIGURES:
            m, p, e = row["measured"][figure], row["predicted"][figure], row["errors"][figure]
            error = "-" if e is None else f"{e:+.3f}"
            print(f"{name:>11} {figure:>15} {m:>10.4g} {p:>10.4g} {error:>8}")
    report |= {
        "clock": args.clock,
        "steps": steps,
        "runs": runs,
        "repeats": args.repeats,
        "wall_s": round(time.perf_counter() - started, 1),
        "load_avg_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
