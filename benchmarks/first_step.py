"""The runtime's start in a fresh process: building ``Experiment`` and its first step.

What a user waits for before ``rlaxkit train`` or a notebook shows its first metrics,
without JAX's persistent compilation cache: every program traces and compiles. Each
measurement is a fresh Python process (this script with ``--child``) that builds
``Experiment(config, cache_dir=...)`` on a cached warm start (made once, by a first
child, in a temporary directory) and takes two steps. Reported per process, the median
over ``--repeats`` processes:

- ``build_s``: ``Experiment(...)`` (task, model graph, warm start loaded, train state,
  workers); ``build_cpu_s`` its CPU seconds (all threads).
- ``first_step_s``: the first ``step()``, with its ``generate_s`` (workers compile and
  sample the first batch) and ``train_s`` (the trainer's step, compiled meanwhile on a
  background thread when the batch has the shape the trainer expected);
  ``first_step_cpu_s``: its CPU seconds. ``second_step_s``: the next step, compiled.
- ``start_s`` = ``build_s + first_step_s``; ``first_over_second``: how many later steps
  the start costs.

The config is ``configs/demo.yaml`` (``make demo``'s run, its warm start included: a
shorter one leaves a policy whose first batches take more rounds and other shapes).
``--quick`` measures one process instead of three (making the warm start takes about
25 s); ``--smoke`` is the tests' tiny run, one process.
``--backend ray`` places the trainer and workers in Ray actors on a local cluster.

Usage::

    python benchmarks/first_step.py --quick

The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(args: argparse.Namespace) -> dict[str, float]:
    """One fresh process: build, step, step (or, with ``--prepare``, build only)."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    from rlaxkit.config.run import RunConfig, small_run_config
    from rlaxkit.runtime import Experiment

    overrides = list(args.override or [])
    if args.backend == "ray":
        overrides.append("runtime.backend=ray")
    if args.smoke:
        config = small_run_config(*overrides)
    else:
        config = RunConfig.from_yaml(ROOT / "configs" / "demo.yaml", overrides)
    ray_config = None
    if args.backend == "ray":
        import ray

        from rlaxkit.config.ray import small_cluster_config

        ray.init(include_dashboard=False, num_cpus=4)
        ray_config = small_cluster_config()
    wall, cpu = time.perf_counter(), time.process_time()
    with Experiment(config, cache_dir=args.cache, ray_config=ray_config) as exp:
        built_wall, built_cpu = time.perf_counter(), time.process_time()
        if args.prepare:
            return {"build_s": built_wall - wall}
        first = exp.step()
        first_wall, first_cpu = time.perf_counter(), time.process_time()
        exp.step()
        second_wall = time.perf_counter()
    return {
        "build_s": built_wall - wall,
        "build_cpu_s": built_cpu - cpu,
        "first_step_s": first_wall - built_wall,
        "first_step_cpu_s": first_cpu - built_cpu,
        "generate_s": first["time/generate_s"],
        "train_s": first["time/train_s"],
        "second_step_s": second_wall - first_wall,
    }


def run_child(args: argparse.Namespace, cache: str, prepare: bool = False) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", "--cache", cache, "--backend", args.backend]
    command += ["--smoke"] if args.smoke else []
    command += ["--prepare"] if prepare else []
    for override in args.override or []:
        command += ["--override", override]
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # every program compiles
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"child failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 fresh process, not 3")
    parser.add_argument("--smoke", action="store_true", help="the tests' tiny run, 1 process")
    parser.add_argument("--repeats", type=int, default=None, help="fresh processes measured")
    parser.add_argument("--backend", choices=("local", "ray"), default="local")
    parser.add_argument("--override", action="append", help="a config override (repeatable)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    repeats = args.repeats or (1 if args.smoke or args.quick else 3)
    with tempfile.TemporaryDirectory(prefix="rlaxkit-first-step-") as cache:
        prepared = run_child(args, cache, prepare=True)  # the warm start, cached
        runs = [run_child(args, cache) for _ in range(repeats)]
    report: dict[str, object] = {
        key: statistics.median(run[key] for run in runs) for key in runs[0]
    }
    report["start_s"] = report["build_s"] + report["first_step_s"]  # type: ignore[operator]
    report["first_over_second"] = report["first_step_s"] / report["second_step_s"]  # type: ignore[operator]
    report["runs"] = runs
    report["backend"] = args.backend
    report["warm_start_build_s"] = prepared["build_s"]
    for run in runs:
        print(
            f"build {run['build_s']:.2f} s, first step {run['first_step_s']:.2f} s "
            f"(generate {run['generate_s']:.2f} s, train {run['train_s']:.2f} s), "
            f"second step {run['second_step_s']:.3f} s"
        )
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
