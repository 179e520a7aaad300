"""The Ray backend resumes a run from its run directory: closed (or stopped by SIGTERM)
after M steps and resumed, an N-step run trains the same prompts, with the same
learning metrics and weights, bit for bit, as the uninterrupted run.

Every checkpoint here holds prompts in flight (``runtime.chunk_steps=1``: a prompt
takes several rounds), which the resumed workers regenerate by replaying their logs.
"""

import dataclasses
import json
import os
import signal

import jax
import numpy as np
import pytest
from test_runtime import learning_metrics

from rlaxkit.cli import run_job
from rlaxkit.config.run import small_run_config
from rlaxkit.observe.metrics import read_metrics
from rlaxkit.rules.trace import read_trace
from rlaxkit.runtime import Experiment

ray = pytest.importorskip("ray")

from rlaxkit.config.ray import small_cluster_config  # noqa: E402
from rlaxkit.runtime import RayExperiment  # noqa: E402
from rlaxkit.trainer.checkpoint import CheckpointManager  # noqa: E402

pytestmark = pytest.mark.ray

STEPS = 6
# In-flight pulls: the workers' replay logs span several weight versions. Pushes every
# 2 steps and checkpoints every 3: the step-3 checkpoint's published version is 2.
SETTINGS = (
    "runtime.backend=ray",
    "runtime.chunk_steps=1",
    "weight_sync.pull_mode=in_flight",
    "weight_sync.push_every_steps=2",
    "checkpoint.every_steps=3",
    f"steps={STEPS}",
)


def comparable(history):
    return [
        {k: v for k, v in m.items() if not k.startswith("fleet/")}
        for m in learning_metrics(history)
    ]


def trained(exp):
    return sorted(g.group_id for g in exp.last_batch["groups"])


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def train_steps(run_dir):
    return [e["step"] for e in read_trace(run_dir / "trace.jsonl") if e.kind == "train_step"]


def test_closed_and_resumed_run_equals_the_uninterrupted_run(ray_cluster, cache, tmp_path):
    config = small_run_config(*SETTINGS)
    settings = small_cluster_config()
    with RayExperiment(
        config, run_dir=tmp_path / "ref", cache_dir=cache, ray_config=settings
    ) as exp:
        reference = [(exp.step(), trained(exp))[1] for _ in range(STEPS)]
        reference_history, reference_params = exp.history, leaves(exp.params())

    run = tmp_path / "run"
    with RayExperiment(config, run_dir=run, cache_dir=cache, ray_config=settings) as exp:
        prompts = [(exp.step(), trained(exp))[1] for _ in range(5)]  # checkpoints: 0, 3
    checkpoints = run / "checkpoints"
    with CheckpointManager(checkpoints, async_save=False) as manager:
        assert manager.all_steps() == (0, 3)
        saved = manager.restore(3, json=["meta", "workers"])
    assert saved["meta"]["published_version"] == 2 and 2 in saved["meta"]["weights"]
    assert all(w["in_flight"] for w in saved["workers"])  # prompts in flight at step 3
    # A save cut short leaves only Orbax's temporary directory: never resumed from.
    (checkpoints / "5.orbax-checkpoint-tmp-1").mkdir()

    with pytest.raises(ValueError, match="sampling.n is 4 in the checkpoint, 8 now"):
        RayExperiment(small_run_config(*SETTINGS, "sampling.n=8"), run_dir=run)
    with pytest.raises(ValueError, match="resume=False"):
        RayExperiment(config, run_dir=run, resume=False)
    local_run = tmp_path / "local"  # a checkpoint the local backend wrote
    with CheckpointManager(local_run / "checkpoints", async_save=False) as manager:
        manager.save(3, json={"meta": {**saved["meta"], "backend": "local"}})
    with pytest.raises(ValueError, match="resume it with runtime.backend=local"):
        RayExperiment(config, run_dir=local_run)

    with RayExperiment(config, run_dir=run, cache_dir=cache, ray_config=settings) as exp:
        assert exp.resumed_from == 3 and exp.version == 3
        in_flight = {w.worker_id: sorted(w.in_flight) for w in exp.workers}
        assert in_flight == {w["worker_id"]: w["in_flight"] for w in saved["workers"]}
        exp.check_accounting()
        prompts = prompts[:3]
        while exp.version < STEPS:
            exp.step()
            prompts.append(trained(exp))
            exp.check_accounting()
        history, params = exp.history, leaves(exp.params())
        summary = exp.summary()

    assert prompts == reference
    assert comparable(history) == comparable(reference_history)
    for got, expected in zip(params, reference_params, strict=True):
        np.testing.assert_array_equal(got, expected)
    assert summary["accepted_lost"] == 0 and summary["resumed_from"] == 3
    assert summary["lost_steps"] == 2  # steps 4 and 5 were taken again
    assert summary["buffer"]["trained"] == STEPS * config.staleness.batch_size
    # The files go on from the checkpoint: each step once, in order.
    assert [row["step"] for row in read_metrics(run / "metrics.jsonl")] == list(range(1, 7))
    assert train_steps(run) == list(range(1, STEPS + 1))
    events = read_trace(run / "trace.jsonl")
    (restart,) = [e for e in events if e.kind == "restart"]
    assert restart["resumed_from"] == 3 and restart["lost_steps"] == 2
    before = events[: events.index(restart)]
    assert restart.t >= max(e.t for e in before)  # the clock went on, past the lost steps
    restores = [e["step"] for e in events if e.kind == "checkpoint_restore"]
    assert restores == [3]


def close_to(got, reference):
    """Metrics of one step that differ by more than 1e-5 absolute + 1e-5 relative (as
    tests/test_distributed_ray.py compares two trainer processes with one)."""
    return {
        key: (a, b)
        for key in got.keys() | reference.keys()
        for a, b in [(got.get(key), reference.get(key))]
        if not (
            abs(a - b) <= 1e-5 + 1e-5 * abs(b)
            if isinstance(a, float) and isinstance(b, float)
            else a == b
        )
    }


def test_sigterm_on_the_cli_path_checkpoints_and_the_next_run_resumes(
    ray_cluster, cache, tmp_path, monkeypatch
):
    """``rlaxkit train`` on Ray: SIGTERM after step 3 checkpoints and returns; the same
    command resumes and finishes as the local backend's uninterrupted run (which the
    Ray backend equals: tests/test_ray_backend.py). Weights through TensorStore here.

    The resumed run's trainer is two processes (``ray`` settings may change on a
    resume): they restore the one-process checkpoint onto their mesh, and, reducing in
    another order, agree with one process to 1e-5 rather than bitwise."""
    overrides = ("runtime.chunk_steps=1", "eval.num_problems=4", "eval.samples=2", "steps=5")
    with Experiment(small_run_config(*overrides), cache_dir=cache) as local:
        local.run()
        reference = learning_metrics(local.history)
    config = small_run_config(
        *overrides,
        "runtime.backend=ray",
        "ray.weight_store=tensorstore",
        "ray.trainer.num_cpus=0.25",
        "ray.worker.num_cpus=0.25",
    )
    original_step = RayExperiment.step

    def step_then_sigterm(exp):
        metrics = original_step(exp)
        if exp.version == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # as a preemption notice would
        return metrics

    run = tmp_path / "run"
    monkeypatch.setattr(RayExperiment, "step", step_then_sigterm)
    stopped = run_job(config, run, progress=False, log=lambda _: None, cache_dir=cache)
    monkeypatch.setattr(RayExperiment, "step", original_step)
    assert stopped["preempted"] and stopped["signal"] == "SIGTERM" and stopped["step"] == 3
    assert stopped["checkpoint_saved"] and not (run / "final").exists()

    lines = []
    config = dataclasses.replace(config, ray=dataclasses.replace(config.ray, trainer_processes=2))
    summary = run_job(config, run, progress=False, log=lines.append, cache_dir=cache)
    assert "resumed from the checkpoint of step 3" in lines
    assert summary["resumed_from"] == 3 and summary["lost_steps"] == 0
    assert summary["accepted_lost"] == 0 and (run / "final" / "config.json").exists()
    rows = comparable(read_metrics(run / "metrics.jsonl"))
    assert rows[:3] == reference[:3]  # the stopped run's, kept
    for step, (got, expected) in enumerate(zip(rows, reference, strict=True), start=1):
        assert not close_to(got, expected), f"step {step}: {close_to(got, expected)}"
    assert train_steps(run) == [1, 2, 3, 4, 5]
    # The evaluation before RL ran once; the resumed run kept it (in ``extra``).
    saved = json.loads((run / "summary.json").read_text())
    assert [e["step"] for e in saved["evals"]] == [0, 5]
