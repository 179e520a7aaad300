"""The CLI's main job writes a complete run directory; bad input exits 2 with a message."""

import json

from rlaxkit.cli import main
from rlaxkit.config import SMALL_RUN
from rlaxkit.metrics import read_metrics
from rlaxkit.trace import read_trace

SMALL = [
    *SMALL_RUN,
    "eval.num_problems=8",
    "eval.samples=2",
    "steps=3",
]


def args(*overrides):
    return [x for o in [*SMALL, *overrides] for x in ("--set", o)]


def test_train_writes_a_complete_run_directory(tmp_path, capsys):
    # The trainer is preempted right after the last step: it restores the checkpoint of
    # step 2 and takes step 3 again, and every file of the run says so.
    run, plan = tmp_path / "run", tmp_path / "plan.yaml"
    plan.write_text("faults: [{kind: preempt_trainer, at_step: 3, restart_after_s: 1}]\n")
    argv = [*args("checkpoint.every_steps=2"), "--faults", str(plan)]
    assert main(["train", *argv, "--run-dir", str(run), "--no-progress"]) == 0
    for name in ("config.yaml", "metrics.jsonl", "trace.jsonl", "summary.json"):
        assert (run / name).stat().st_size > 0, name
    assert (run / "final" / "config.json").exists()
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    trace = read_trace(run / "trace.jsonl")
    steps = [e for e in trace if e.kind == "train_step"]
    assert [(e["step"], e.discarded) for e in steps] == [
        (1, False),
        (2, False),
        (3, True),
        (3, False),
    ]
    (preempted,) = [e for e in trace if e.kind == "preemption" and e.actor == "trainer"]
    (restore,) = [e for e in trace if e.kind == "checkpoint_restore"]
    assert preempted["lost_steps"] == 1 and restore["step"] == 2
    assert {p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()} >= {"0", "2"}
    kinds = {e.kind for e in read_trace(run / "trace.jsonl")}
    assert {
        "run_start",
        "generation_start",
        "generation_end",
        "train_step",
        "push",
        "pull",
    } <= kinds
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["lost_steps"], summary["restarts"]) == (3, 1, {"trainer": 1})
    assert [f["kind"] for f in summary["faults"]["fired"]] == ["preempt_trainer"]
    assert 0 <= summary["pass@1_before"] <= 1 and 0 <= summary["pass@1_after"] <= 1
    assert all(0 <= e["pass@1_se"] <= 0.5 for e in summary["evals"])  # the plot's band
    assert sorted(p.name for p in (run / "plots").glob("*.png")) == [
        "reward.png",
        "staleness.png",
        "timeline.png",
    ]
    out = capsys.readouterr().out
    assert "held-out pass@1 before RL" in out and "after RL" in out
    assert main(["plot", str(run)]) == 0
    assert main(["eval", str(run)]) == 0
    assert "pass@k" in capsys.readouterr().out


def test_bad_override_exits_2_naming_the_field(capsys):
    assert main(["train", "--set", "staleness.max_staleness=-1"]) == 2
    assert "max_staleness" in capsys.readouterr().err
    assert main(["plot", "no/such/run"]) == 2
