"""Fault plans at the edges of a run: a fault that could never fire is refused when the
plan is loaded, naming it and the bound; every kind fires at the first and at the last
step; a trainer preempted at the last step restores and does the lost steps again, so
that the summary, trace, metrics and checkpoints agree on ``steps`` kept steps."""

import json
import logging
import re

import pytest
from mlflow.tracking import MlflowClient

from rlaxkit.config.run import small_run_config
from rlaxkit.observe.metrics import read_metrics
from rlaxkit.rules.fault_plan import FaultPlan
from rlaxkit.rules.trace import read_trace
from rlaxkit.runtime import Experiment
from rlaxkit.runtime.faults import FaultInjector, plausible_end_s

SMALL = ["runtime.chunk_steps=2", "runtime.restart_s=1", "steps=2", "checkpoint.every_steps=1"]


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        (
            {"kind": "preempt_trainer", "at_step": 0},
            r"faults\[0\] \(preempt_trainer\)\.at_step: 0 is outside this run's steps 1\.\.2",
        ),
        (
            {"kind": "preempt_worker", "target": "worker-0", "at_step": 3},
            r"faults\[0\] \(preempt_worker\)\.at_step: 3 is outside this run's steps 1\.\.2",
        ),
        (
            {"kind": "hang_reward", "at_s": 1e6},
            r"faults\[0\] \(hang_reward\)\.at_s: 1e\+06 s is past any plausible end of this"
            r" run \(1032 s on the fault clock",
        ),
        (
            {"kind": "slow_worker", "target": "worker-7", "at_s": 1, "factor": 2, "duration_s": 1},
            r"faults\[0\]\.target: no worker named 'worker-7'; have \['worker-0', 'worker-1'\]",
        ),
    ],
    ids=["step_0", "past_the_last_step", "time_past_the_end", "no_such_worker"],
)
def test_a_fault_that_cannot_fire_is_refused_when_the_plan_is_loaded(tmp_path, fault, message):
    config = small_run_config(*SMALL)
    with pytest.raises(ValueError, match=message):
        FaultInjector.for_plan(FaultPlan.from_dicts([fault]), config, tmp_path)


def test_the_bound_counts_the_plans_downtimes(tmp_path):
    config = small_run_config(*SMALL)
    down = {"kind": "kill_param_server", "at_s": 1, "restart_after_s": 30}
    # 4 x 2 steps x ceil(16 rows / 16 slots) x (256 tokens / 2 a round + 1) rounds x 1 s,
    # plus the 30 s the parameter server is down.
    assert plausible_end_s(FaultPlan.from_dicts([down]), config) == 4 * 2 * 1 * 129 * 1 + 30
    FaultInjector.for_plan(FaultPlan.from_dicts([down, {"kind": "hang_reward", "at_s": 1062}]),
                           config, tmp_path)  # fmt: skip
    with pytest.raises(ValueError, match=r"faults\[1\] \(hang_reward\)\.at_s: 1062\.5 s is past"):
        FaultInjector.for_plan(
            FaultPlan.from_dicts([down, {"kind": "hang_reward", "at_s": 1062.5}]), config, tmp_path
        )


class Crash(Exception):
    """An error out of a run's ``with`` block."""


def every_kind(step: int) -> list[dict]:
    """One fault of each kind, all after ``step``."""
    return [
        {"kind": "preempt_worker", "target": "worker-1", "at_step": step},
        {"kind": "preempt_slice", "target": "slice-0", "at_step": step},
        {"kind": "kill_param_server", "at_step": step, "restart_after_s": 1.0},
        {
            "kind": "slow_worker",
            "target": "worker-1",
            "at_step": step,
            "factor": 2,
            "duration_s": 2,
        },
        {"kind": "fail_pull", "at_step": step},
        {"kind": "hang_reward", "at_step": step},
        {"kind": "preempt_trainer", "at_step": step, "restart_after_s": 1.0},
    ]


@pytest.mark.parametrize("at_step", [1, 2], ids=["first_step", "last_step"])
def test_every_kind_fires_at_the_first_and_the_last_step(
    cache, tmp_path, caplog, monkeypatch, at_step
):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the run directory's store
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    # MLflow cannot un-log: after the restore it must still hold each step once. The
    # first-step run then crashes (an error out of its ``with``): MLflow marks it failed.
    config = small_run_config(*SMALL, "tracking=[jsonl,mlflow]")
    # ... and one the run never reaches, which the summary, log and trace name.
    plan = [*every_kind(at_step), {"kind": "hang_reward", "at_s": 1000.0}]
    crash = at_step == 1
    try:
        with (
            caplog.at_level(logging.WARNING, logger="rlaxkit.runtime.driver"),
            Experiment(config, run_dir=tmp_path, cache_dir=cache, faults=plan) as exp,
        ):
            exp.run()
            exp.check_accounting()
            summary = exp.summary()
            if crash:
                raise Crash("after the last step")
    except Crash:
        assert crash
    faults = summary["faults"]
    assert [f["index"] for f in faults["fired"]] == list(range(7))
    (never,) = faults["not_fired"]
    assert never["index"] == 7 and never["at_s"] == 1000.0
    assert re.fullmatch(r"the run stopped at \d+ s on the fault clock, before 1000 s", never["why"])
    assert f"faults[7] (hang_reward) never fired: {never['why']}" in caplog.text
    # The trainer lost the step since its checkpoint (the one before at_step) and did it
    # again: two kept steps, the lost one discarded in the trace.
    assert summary["steps"] == 2 and summary["lost_steps"] == 1
    assert summary["restarts"]["trainer"] == 1 and summary["accepted_lost"] == 0
    assert summary["preemptions"] == {"worker": 1, "slice": 1, "trainer": 1, "param_server": 1}
    trace = read_trace(tmp_path / "trace.jsonl")
    (preempted,) = [e for e in trace if e.kind == "preemption" and e.actor == "trainer"]
    assert preempted["lost_steps"] == summary["lost_steps"]
    steps = [e for e in trace if e.kind == "train_step"]
    assert [e["step"] for e in steps if e.discarded] == [at_step]
    assert [e["step"] for e in steps if not e.discarded] == [1, 2]
    (end,) = [e for e in trace if e.kind == "run_end"]
    assert end["lost_steps"] == 1 and end["faults_not_fired"] == [7]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows == json.loads(json.dumps(exp.history))
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run_id = json.loads((tmp_path / "tracking.json").read_text())["mlflow"]
    points = client.get_metric_history(run_id, "reward/mean")
    assert sorted(m.step for m in points) == [1, 2]  # both committed by checkpoints
    assert {m.step: m.value for m in points} == {r["step"]: r["reward/mean"] for r in rows}
    assert client.get_run(run_id).info.status == ("FAILED" if crash else "FINISHED")
    # The newest checkpoint is the last kept step's, taken after the redo.
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert saved[-1] == 2
