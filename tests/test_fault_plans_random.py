"""Random fault plans on the local deterministic backend: every kind of fault, mixed at
random times and steps with random run settings. Whatever the plan, nothing accepted is
lost, the accounting holds, and a run stopped at a step (checkpointed there, or not)
and resumed is the uninterrupted run, bit for bit.

``random_case(seed)`` draws a case; the seeds below were chosen for what they cover
(named with each). Other seeds make a fuzzer: ``python tests/test_fault_plans_random.py
FIRST LAST`` runs seeds ``FIRST .. LAST - 1`` and prints one line per seed."""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path
from typing import Any, get_args

import jax
import numpy as np
import pytest
from test_fault_injection import learning

from rlaxkit.config.run import small_run_config
from rlaxkit.rules.fault_plan import FaultKind
from rlaxkit.runtime import Experiment

KINDS = get_args(FaultKind)  # the first four have a downtime


def random_plan(rng: random.Random, workers: int, slices: int, steps: int) -> list[dict]:
    """Two to eight faults of any kind, each at a random step or fault-clock time."""
    faults = []
    for _ in range(rng.randint(2, 8)):
        kind = rng.choice(KINDS)
        if rng.random() < 0.4:
            fault: dict[str, Any] = {"kind": kind, "at_step": rng.randint(1, steps - 1)}
        else:
            fault = {"kind": kind, "at_s": round(rng.uniform(0, 25), 1)}
        if kind in ("preempt_worker", "slow_worker"):
            fault["target"] = f"worker-{rng.randrange(workers)}"
        if kind == "preempt_slice":
            fault["target"] = f"slice-{rng.randrange(slices)}"
        if kind in KINDS[:4] and rng.random() < 0.7:  # the kinds with a downtime
            fault["restart_after_s"] = round(rng.uniform(0, 6), 1)
        if kind == "slow_worker":
            fault["factor"] = round(rng.uniform(1.5, 4), 1)
            fault["duration_s"] = round(rng.uniform(1, 10), 1)
        if kind in ("fail_pull", "hang_reward"):
            fault["count"] = rng.randint(1, 3)
            if kind == "fail_pull" and rng.random() < 0.5:
                fault["target"] = f"worker-{rng.randrange(workers)}"
        faults.append(fault)
    return faults


def random_case(seed: int) -> dict[str, Any]:
    """Run settings, a plan, and where the run stops to be resumed."""
    rng = random.Random(seed)
    workers, per_slice = rng.choice([2, 3]), rng.choice([1, 2])
    steps = rng.randint(4, 6)
    plan = random_plan(rng, workers, -(-workers // per_slice), steps)
    push_every = rng.choice([1, 1, 2])
    settings = [
        f"steps={steps}",
        "runtime.chunk_steps=2",
        "runtime.restart_s=2",
        f"runtime.num_workers={workers}",
        f"runtime.workers_per_slice={per_slice}",
        f"checkpoint.every_steps={rng.choice([1, 2, 3])}",
        f"weight_sync.push_every_steps={push_every}",
        f"staleness.max_staleness={max(push_every - 1, rng.choice([0, 1, 2]))}",
    ]
    if rng.random() < 0.25:
        settings.append("trainer.lora.rank=4")
    if rng.random() < 0.25:
        settings += ["param_server.delta=true", "param_server.snapshot_every=2"]
    if rng.random() < 0.3:
        settings.append("weight_sync.pull_mode=in_flight")
    # A checkpoint of the caller's own changes what a later trainer preemption restores,
    # so the stopped run saves one only when the plan has none.
    trainer_faults = any(f["kind"] == "preempt_trainer" for f in plan)
    save = not trainer_faults and rng.random() < 0.5
    return {
        "settings": settings,
        "plan": plan,
        "stop_at": rng.randint(1, steps - 1),
        "save": save,
        "extra_rounds": rng.choice([0, 1, 2, 3]) if save else 0,
    }


def check_case(case: dict[str, Any], cache: Path, root: Path) -> dict[str, Any]:
    """Runs ``case`` uninterrupted and stopped-then-resumed; asserts what the module
    docstring says. Returns the uninterrupted run's summary."""
    config = small_run_config(*case["settings"])
    plan = case["plan"]
    with Experiment(config, run_dir=root / "a", cache_dir=cache, faults=plan) as exp:
        # The same calls as the stopped run, less its stop: rounds called by hand are
        # rounds a plain ``run`` need not take (it trains as soon as a batch is ready).
        exp.run(case["stop_at"])
        for _ in range(case["extra_rounds"]):
            exp.round()
        exp.run()
        exp.check_accounting()
        summary = exp.summary()
        assert exp.version == config.steps and summary["accepted_lost"] == 0
        expected = learning(exp.history)
        expected_params = jax.device_get(exp.params())
    with Experiment(config, run_dir=root / "b", cache_dir=cache, faults=plan) as exp:
        exp.run(case["stop_at"])
        if case["save"]:  # mid-collection, after a few rounds of the next step
            for _ in range(case["extra_rounds"]):
                exp.round()
            exp.save_checkpoint()
    with Experiment(config, run_dir=root / "b", cache_dir=cache, faults=plan) as exp:
        assert exp.resumed_from is not None
        exp.run()
        exp.check_accounting()
        assert exp.summary()["accepted_lost"] == 0
        assert learning(exp.history) == expected
        got = jax.device_get(exp.params())
    for a, b in zip(jax.tree.leaves(expected_params), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(a, b)
    return summary


# Seeds and what their cases hold (see random_case).
SEEDS = {
    # A LoRA run with delta publication, on-policy (η = 0), three workers in slices of
    # two; two parameter-server outages after step 3 and a timed one, worker
    # preemptions, failing pulls and hanging rewards. Stopped at step 3, whose push the
    # outage holds back when its checkpoint is taken: the checkpoint must keep it.
    302: "lora_delta_push_held_at_the_checkpoint",
    # Three workers, delta publication, pushes every 2 steps; after step 1 a slice
    # preemption, a parameter-server outage, a slow worker and failing pulls; after
    # step 3 a worker preemption and hanging rewards. Stopped at step 2 and
    # checkpointed one round into step 3.
    115: "delta_outage_saved_mid_collection",
}


@pytest.mark.slow
@pytest.mark.parametrize("seed", list(SEEDS), ids=list(SEEDS.values()))
def test_a_random_fault_plan_loses_nothing_and_resumes_to_the_uninterrupted_run(
    seed, cache, tmp_path
):
    summary = check_case(random_case(seed), cache, tmp_path)
    assert sum(summary["preemptions"].values()) > 0


if __name__ == "__main__":
    cache_dir = Path(tempfile.mkdtemp(prefix="fault_plans_"))
    for seed in range(int(sys.argv[1]), int(sys.argv[2])):
        case = random_case(seed)
        try:
            with tempfile.TemporaryDirectory() as d:
                result = check_case(case, cache_dir, Path(d))
            print("ok", seed, result["preemptions"], result["restarts"], flush=True)
        except Exception as error:  # noqa: BLE001 (a fuzzer reports and goes on)
            print("FAILED", seed, type(error).__name__, error, case, flush=True)
