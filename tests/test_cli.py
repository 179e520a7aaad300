"""The CLI's main job writes a complete run directory; bad input exits 2 with a message."""

import json
import os
import signal
import time

import pytest

from rlaxkit.cli import StopRequest, main
from rlaxkit.config import small_run_config
from rlaxkit.config.run import SMALL_RUN, RunConfig
from rlaxkit.observe.metrics import read_metrics
from rlaxkit.rules.trace import read_trace
from rlaxkit.util.rundirs import claim_run_dir

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
    assert summary["status"] == "finished"
    assert main(["plot", str(run)]) == 0
    capsys.readouterr()
    # One seed, one answer: eval repeats the run's own final evaluation and says its seed.
    assert main(["eval", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"sampling seed {summary['eval_seed']}" in out
    pass_at_1 = next(line for line in out.splitlines() if line.split()[:1] == ["1"])
    assert float(pass_at_1.split()[1]) == round(summary["pass@1_after"], 3)
    # The second run into the folder: the same config finished, so nothing is appended.
    assert main(["train", *argv, "--run-dir", str(run), "--no-progress"]) == 0
    assert "finished after 3 steps; nothing to do" in capsys.readouterr().out
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    # Another config is refused before any work, with the three ways on.
    assert main(["train", *args("checkpoint.every_steps=2", "steps=4"), "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "holds a run with another config (it differs at steps)" in err
    assert "--resume" in err and "--new" in err and "--overwrite" in err
    assert len(err.strip().splitlines()) == 1


def test_bad_override_exits_2_naming_the_field(capsys):
    assert main(["train", "--set", "staleness.max_staleness=-1"]) == 2
    assert "max_staleness" in capsys.readouterr().err
    assert main(["plot", "no/such/run"]) == 2


def _one_line_exit_2(capsys, argv, *needles):
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in captured.err + captured.out, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 3\nsampling:\n  n: [4\n")
    _one_line_exit_2(capsys, ["train", str(bad)], f"{bad}: YAML syntax error at line ")
    _one_line_exit_2(
        capsys,
        ["train", "--set", "tracking=[jsonl"],
        "override 'tracking=[jsonl'",
        "tracking=[jsonl]",
    )


def test_eval_of_what_is_not_a_finished_run_says_what_to_give(tmp_path, capsys):
    afile = tmp_path / "notes.txt"
    afile.write_text("x")
    _one_line_exit_2(capsys, ["eval", str(afile)], "is a file, not a run directory")
    _one_line_exit_2(capsys, ["eval", str(tmp_path)], "is not a run directory (no config.yaml)")
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    RunConfig().save(crashed / "config.yaml")
    reason = "TrainingStalled: 201 prompt groups in a row were dropped"
    (crashed / "summary.json").write_text(json.dumps({"status": "failed", "reason": reason}))
    _one_line_exit_2(
        capsys, ["eval", str(crashed)], "has no final policy (final/); it is failed: " + reason
    )


def test_a_warm_start_too_short_is_refused_before_rl_and_the_summary_says_why(tmp_path, capsys):
    """No warm start: held-out pass@1 0, so every group of equal rewards would be dropped;
    the run stopped after minutes with a traceback and no summary."""
    run = tmp_path / "run"
    # 200 held-out samples (MIN_EVAL_SAMPLES) on two-digit sums: fewer cannot tell 0 apart.
    enough_eval = (
        "sft.steps=0",
        "task.options.max_digits=2",
        "eval.num_problems=25",
        "eval.samples=8",
    )
    err = _one_line_exit_2(
        capsys,
        ["train", *args(*enough_eval), "--run-dir", str(run), "--no-progress"],
        "held-out pass@1 before RL is 0.000",
        "warm start longer (sft.steps)",
        "batching.equal_rewards=keep",
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"].endswith(err.split(": ", 1)[1])
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text()


def test_run_directory_ownership_rules(tmp_path):
    """``claim_run_dir`` on hand-made folders: the rule without any training."""
    config = RunConfig().to_dict()
    run = tmp_path / "run"
    assert claim_run_dir(run, "run", config).action == "fresh"
    run.mkdir()
    (run / "warm_start-abc").mkdir()  # a warm-start cache alone is no run
    assert claim_run_dir(run, "run", config).action == "fresh"
    RunConfig().save(run / "config.yaml")
    failed = {"status": "failed", "reason": "KeyboardInterrupt: SIGINT outside the RL steps"}
    (run / "summary.json").write_text(json.dumps(failed))
    again = claim_run_dir(run, "run", config)  # stopped in its warm start: nothing to lose
    assert again.action == "fresh" and "stopped before its first step" in again.message
    assert sorted(p.name for p in run.iterdir()) == ["warm_start-abc"]
    RunConfig().save(run / "config.yaml")
    (run / "summary.json").write_text(json.dumps(failed))
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="holds a failed run .* with no checkpoint"):
        claim_run_dir(run, "run", config)
    assert claim_run_dir(run, "run", config, has_checkpoint=True).action == "resume"
    with pytest.raises(ValueError, match=r"holds a run \(config.yaml\)|holds a run"):
        claim_run_dir(run, "simulated", {"name": "toy"})
    beside = claim_run_dir(run, "run", config, "new")
    assert beside.run_dir == tmp_path / "run-2" and beside.action == "fresh"
    cleared = claim_run_dir(run, "run", config, "overwrite")
    assert cleared.action == "fresh" and sorted(p.name for p in run.iterdir()) == ["warm_start-abc"]
    with pytest.raises(ValueError, match="holds no run to resume"):
        claim_run_dir(run, "run", config, "resume")


def test_a_second_experiment_on_a_folder_without_a_checkpoint_is_refused(tmp_path, cache):
    """``Experiment(run_dir=D)`` twice from Python follows the CLI's rule: without a
    checkpoint to resume from, the second would append its lines to the first run's."""
    from rlaxkit.runtime import Experiment

    config = small_run_config()
    run = tmp_path / "run"
    with Experiment(config, run_dir=run, cache_dir=cache) as exp:
        exp.run(2)
    lines = (run / "metrics.jsonl").read_text(), (run / "trace.jsonl").read_text()
    for again in (config, small_run_config("steps=5")):
        with pytest.raises(ValueError) as refused:
            Experiment(again, run_dir=run, cache_dir=cache)
        message = str(refused.value)
        assert len(message.splitlines()) == 1, message
        assert f"run directory {run} holds" in message
        assert f"give another run_dir (e.g. {tmp_path / 'run-2'})" in message
        assert "delete_run_files" in message and "checkpoint.every_steps" in message
    assert "differs at steps" in message
    assert ((run / "metrics.jsonl").read_text(), (run / "trace.jsonl").read_text()) == lines


def test_a_signal_outside_the_rl_steps_stops_at_once():
    """Ctrl-C in the warm start said it would stop after the current step, then ran on
    for 24 s: outside the steps there is no step to finish."""
    with StopRequest(log=lambda _: None) as stop:
        with pytest.raises(KeyboardInterrupt, match="SIGINT outside the RL steps"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        with stop.steps():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        assert stop.requested == "SIGINT"


def test_the_drops_error_counts_the_groups_it_names():
    """It said "1600 prompt groups in a row were dropped ({'filtered': 1606})": the bound
    and the run's total. Both figures are now the drops in a row."""
    from types import SimpleNamespace

    from rlaxkit.rules.stalls import TrainingStalled
    from rlaxkit.runtime.loop import Loop

    dropped = {i: "stale" for i in range(5)} | {i: "filtered" for i in range(5, 211)}
    exp = SimpleNamespace(
        config=RunConfig.from_overrides(["staleness.batch_size=4"]),
        buffer=SimpleNamespace(dropped=dropped),
        reward_failures=lambda: {},
        fleet=SimpleNamespace(reward_counters=lambda: {"scored": 800}),
        books=SimpleNamespace(history=[], first_reward_error=None),
    )
    with pytest.raises(TrainingStalled, match=r"^203 prompt groups in a row were dropped "):
        Loop.check_drops(exp, dropped_before=8)  # 203 > 50 batches of 4
    with pytest.raises(TrainingStalled, match=r"\(\{'filtered': 203\}\) without one batch"):
        Loop.check_drops(exp, dropped_before=8)
    Loop.check_drops(exp, dropped_before=11)  # 200 in a row: not yet
