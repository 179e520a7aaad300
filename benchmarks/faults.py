"""Goodput with and without injected faults, on the local and the Ray placement, in one
process.

Goodput is the compute of the trainer steps that survive to the end of the run divided
by the run's wall time (``Experiment.summary()``; the simulator's definition). Three
runs of the same tiny deterministic config, one after the other:

1. a warm-up run (compiles every program; not reported);
2. the clean run;
3. the same run under ``configs/faults/standard.yaml`` (every fault kind once: a slow
   worker, failed pulls, a worker and a slice preemption, a hung reward, a trainer
   preemption that rolls back to the last checkpoint, a parameter-server outage); the
   full run adds seeded random worker preemptions;
4. on Ray (when it is installed; ``--no-ray`` skips it): the same config under the same
   plan less the kinds only the local placement injects (``fail_pull``, ``hang_reward``
   reach inside a worker's process), with real actor kills.

The last line printed is a JSON object with ``goodput_clean``, ``goodput_faults``,
``goodput_ratio`` (faults ÷ clean), ``accepted_lost`` (accepted rollouts neither trained,
buffered nor dropped with a reason: must be 0), ``lost_steps``, ``preemptions``, the wall
seconds of both runs, ``rounds_clean`` / ``rounds_faults`` with ``round_ratio``, and
for the Ray run ``accepted_lost_ray`` and ``goodput_faults_ray``.

How to read it: in deterministic mode the faults' downtimes pass on the logical clock
(decode rounds), not the wall clock, and in one process a worker that is down frees the
CPU for the others, so wall goodput only loses the compute the faults waste (lost
steps, the restore, regenerated prompts, checkpoint writes) and on a shared machine
moves with the noise of the other processes. The deterministic cost of the downtimes is
``round_ratio``: rounds the faulted run needed for the same steps ÷ the clean run's.

Usage::

    python benchmarks/faults.py --quick   # < 60 s on 2 cores
    python benchmarks/faults.py --steps 30
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from rlaxkit.config.io import apply_overrides  # noqa: E402
from rlaxkit.config.run import SMALL_RUN, RunConfig  # noqa: E402
from rlaxkit.rules.fault_plan import FaultPlan, random_preemptions  # noqa: E402
from rlaxkit.runtime import Experiment  # noqa: E402

STANDARD = Path(__file__).resolve().parents[1] / "configs" / "faults" / "standard.yaml"
TINY = [
    *SMALL_RUN,
    "runtime.chunk_steps=2",
    "checkpoint.every_steps=2",
]


def run(config: RunConfig, run_dir: Path, cache: Path, plan: FaultPlan | None, **extra) -> dict:
    """One run to ``config.steps``; its summary with the accounting checked."""
    with Experiment(config, run_dir=run_dir, cache_dir=cache, faults=plan, **extra) as exp:
        exp.run()
        exp.check_accounting()
        summary = exp.summary()
        summary["preemptions"] = sum(1 for e in exp.trace.memory.events if e.kind == "preemption")
    return summary


def run_on_ray(config: RunConfig, root: Path, plan: FaultPlan) -> dict | None:
    """The faulted run on the Ray placement (``None`` without Ray)."""
    if importlib.util.find_spec("ray") is None:
        return None
    from rlaxkit.config.ray import small_cluster_config
    from rlaxkit.runtime.faults import RAY_KINDS

    ray_plan = FaultPlan(tuple(f for f in plan if f.kind in RAY_KINDS))
    from rlaxkit.param_server.ray_store import local_cluster

    on_ray = RunConfig.from_dict(apply_overrides(config.to_dict(), ["runtime.backend=ray"]))
    with local_cluster(num_cpus=2):
        extra = {"ray_config": small_cluster_config()}
        return run(on_ray, root / "ray", root / "cache", ray_plan, **extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 steps (< 60 s on 2 cores)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray run")
    args = parser.parse_args()
    steps = 8 if args.quick else args.steps
    config = RunConfig.from_dict(apply_overrides(RunConfig().to_dict(), [*TINY, f"steps={steps}"]))
    plan = FaultPlan.load(STANDARD)
    if not args.quick:
        plan = plan.merged(
            random_preemptions(
                targets=["worker-0", "worker-1"], horizon_s=4.0 * steps, mtbf_s=10.0, seed=0
            )
        )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # Every Experiment jits its own step functions: the persistent cache lets the
        # measured runs load what the warm-up compiled instead of compiling again.
        jax.config.update("jax_compilation_cache_dir", str(root / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        run(config, root / "warmup", root / "cache", plan)
        clean = run(config, root / "clean", root / "cache", None)
        faults = run(config, root / "faults", root / "cache", plan)
        on_ray = None if args.no_ray else run_on_ray(config, root, plan)
    for name, summary in (("clean", clean), ("faults", faults)):
        print(
            f"{name:7s} goodput {summary['goodput']:.3f}  useful {summary['useful_train_s']:.2f} s"
            f"  wall {summary['wall_s']:.2f} s  lost steps {summary['lost_steps']}"
            f"  preemptions {summary['preemptions']}  failed pulls {summary['failed_pulls']}"
            f"  reward failures {summary['reward_failures']}"
        )
    result = {
        "steps": steps,
        "goodput_clean": round(clean["goodput"], 4),
        "goodput_faults": round(faults["goodput"], 4),
        "goodput_ratio": round(faults["goodput"] / clean["goodput"], 4),
        "accepted_lost": clean["accepted_lost"] + faults["accepted_lost"],
        "lost_steps": faults["lost_steps"],
        "preemptions": faults["preemptions"],
        "failed_pulls": faults["failed_pulls"],
        "wall_clean_s": round(clean["wall_s"], 3),
        "wall_faults_s": round(faults["wall_s"], 3),
        "rounds_clean": clean["rounds"],
        "rounds_faults": faults["rounds"],
        "round_ratio": round(faults["rounds"] / clean["rounds"], 4),
    }
    if on_ray is not None:
        print(
            f"ray     goodput {on_ray['goodput']:.3f}  wall {on_ray['wall_s']:.2f} s  lost "
            f"steps {on_ray['lost_steps']}  preemptions {on_ray['preemptions']}"
        )
        result |= {
            "accepted_lost_ray": on_ray["accepted_lost"],
            "goodput_faults_ray": round(on_ray["goodput"], 4),
            "lost_steps_ray": on_ray["lost_steps"],
            "preemptions_ray": on_ray["preemptions"],
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
