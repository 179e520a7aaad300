"""Preemption tolerance: SIGTERM then resume equals the uninterrupted run, bit for bit;
kill -9 during a checkpoint write leaves the previous checkpoint; mismatches fail early.

One uninterrupted reference run (in process, through the CLI) is shared by the module;
the preempted runs are real subprocesses of ``rlaxkit train``.
"""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from rlaxkit.cli import main
from rlaxkit.config.run import SMALL_RUN, small_run_config
from rlaxkit.observe.metrics import read_metrics
from rlaxkit.rules.trace import read_trace
from rlaxkit.runtime import Experiment

# chunk_steps=1: prompts take several rounds, so every checkpoint has prompts in flight.
SMALL = [
    "runtime.chunk_steps=1",
    "eval.num_problems=4",
    "eval.samples=2",
    "checkpoint.every_steps=2",
    "steps=8",
]
ROOT = Path(__file__).resolve().parents[1]


def cli_args(run_dir, cache, *overrides):
    sets = [x for o in [*SMALL_RUN, *SMALL, *overrides] for x in ("--set", o)]
    return ["train", *sets, "--run-dir", str(run_dir), "--cache-dir", str(cache), "--no-progress"]


def learning(rows):
    return [
        {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows
    ]


def final_params(run_dir):
    (path,) = (Path(run_dir) / "final").glob("*.safetensors")
    return load_file(path)


def subprocess_env():
    # The test session's compilation cache settings are in os.environ (conftest.py).
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))


def wait_for_rows(process, metrics, rows, timeout_s=240):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"rlaxkit train exited early: {process.communicate()}")
        if metrics.exists() and len(metrics.read_text().splitlines()) >= rows:
            return
        time.sleep(0.05)
    process.kill()
    pytest.fail("no metrics within the time limit")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    """The uninterrupted run (its warm start goes into the session's shared cache, which
    every run in this module loads)."""
    root = tmp_path_factory.mktemp("preemption")
    run = root / "uninterrupted"
    assert main(cli_args(run, cache)) == 0
    return {"cache": cache, "run": run, "root": root}


@pytest.mark.slow
def test_sigterm_then_resume_equals_the_uninterrupted_run(reference, tmp_path):
    run = tmp_path / "preempted"
    command = [sys.executable, "-m", "rlaxkit.cli", *cli_args(run, reference["cache"])]
    process = subprocess.Popen(
        command, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    wait_for_rows(process, run / "metrics.jsonl", rows=3)
    process.send_signal(__import__("signal").SIGTERM)
    out, _ = process.communicate(timeout=240)
    assert process.returncode == 0, out.decode()[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["preempted"] and summary["signal"] == "SIGTERM"
    stopped = summary["step"]
    assert 3 <= stopped < 8
    assert not (run / "final").exists()

    assert main(cli_args(run, reference["cache"])) == 0  # resumes from the checkpoint
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["resumed_from"] == stopped
    expected, got = final_params(reference["run"]), final_params(run)
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    # Every step's learning metrics, before and after the preemption, match.
    assert learning(read_metrics(run / "metrics.jsonl")) == learning(
        read_metrics(reference["run"] / "metrics.jsonl")
    )
    kinds = [e.kind for e in read_trace(run / "trace.jsonl")]
    assert "checkpoint_restore" in kinds and kinds.count("run_end") == 2


KILLED_WRITER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    import orbax.checkpoint._src.path.async_path as async_path
    sys.path.insert(0, {tests!r})
    from test_preemption import SMALL
    from rlaxkit.config.run import small_run_config
    from rlaxkit.runtime import Experiment

    rename = async_path.rename

    async def stalled_rename(src, dst):
        if Path(str(dst)).name == "4":  # the data of step 4 is written, not committed
            print("WRITING", flush=True)
            await asyncio.sleep(600)
        return await rename(src, dst)

    async_path.rename = stalled_rename
    exp = Experiment(small_run_config(*SMALL), run_dir={run!r}, cache_dir={cache!r})
    exp.run(4)
    exp.close()  # waits for the write of step 4, which never commits: killed here
    """
)


@pytest.mark.slow
def test_kill_9_during_a_checkpoint_write_keeps_the_previous_one(reference, tmp_path):
    run = tmp_path / "killed"
    script = KILLED_WRITER.format(
        tests=str(ROOT / "tests"), run=str(run), cache=str(reference["cache"])
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    line = b""
    deadline = time.monotonic() + 240
    while b"WRITING" not in line and time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            pytest.fail(f"the writer exited: {process.communicate()}")
    process.kill()  # SIGKILL: no handler, no cleanup
    process.communicate()
    checkpoints = run / "checkpoints"
    assert any("tmp" in p.name for p in checkpoints.iterdir()), list(checkpoints.iterdir())
    assert not (checkpoints / "4").exists()

    killed = read_trace(run / "trace.jsonl")
    taken = [e["step"] for e in killed if e.kind == "train_step"]
    assert taken[-2:] == [3, 4]  # the killed run got past the checkpoint of step 2
    with Experiment(
        small_run_config(*SMALL),
        run_dir=run,
        cache_dir=reference["cache"],
    ) as exp:
        assert exp.resumed_from == 2
        assert exp.books.lost_steps == 2  # steps 3 and 4, taken again
        exp.run()
        exp.check_accounting()
        history = exp.history
    assert learning(history) == learning(read_metrics(reference["run"] / "metrics.jsonl"))
    assert [row["step"] for row in read_metrics(run / "metrics.jsonl")] == list(range(1, 9))
    # The trace was cut back to the checkpoint: each step once, in time order.
    events = read_trace(run / "trace.jsonl")
    assert [e["step"] for e in events if e.kind == "train_step"] == list(range(1, 9))
    pairs = zip(events, events[1:], strict=False)
    assert not [(a.kind, a.t, b.kind, b.t) for a, b in pairs if a.t > b.t]


def test_checkpoint_of_another_model_or_plan_is_a_clear_error(reference, capsys):
    run = reference["run"]  # holds checkpoints of the reference config
    with pytest.raises(ValueError, match=r"model\.config\.hidden_size is 32 in the checkpoint"):
        Experiment(small_run_config(*SMALL, "model.config.hidden_size=48"), run_dir=run)
    # The CLI refuses the folder before its checkpoint: it holds a run of another config.
    assert main(cli_args(run, reference["cache"], "sampling.n=8")) == 2
    assert "another config (it differs at sampling.n)" in capsys.readouterr().err
    plan = reference["root"] / "plan.yaml"
    plan.write_text("faults: [{kind: hang_reward, at_s: 1}]\n")
    with pytest.raises(ValueError, match="another fault plan"):
        Experiment(
            small_run_config(*SMALL),
            run_dir=run,
            cache_dir=reference["cache"],
            faults=plan,
        )


def test_the_loops_background_writes_are_traced(reference):
    # The first save, before the loop, waits for its write; the loop's (steps 2, 4, 6
    # and 8) return once their arrays are copied, and each write is traced when the
    # trainer next replies: the last one's, after the last step, may not be.
    events = read_trace(reference["run"] / "trace.jsonl")
    saves = {e["step"]: e for e in events if e.kind == "checkpoint_save"}
    writes = {e["step"]: e for e in events if e.kind == "checkpoint_write"}
    assert sorted(saves) == [0, 2, 4, 6, 8]
    assert {2, 4, 6} <= set(writes) <= set(saves)
    for step, write in writes.items():
        save = saves[step]
        returned_s = write["written_s"] - write["duration_s"]  # it starts as the save returns
        assert save.t - save["duration_s"] <= returned_s <= save.t
        assert write["written_s"] <= write.t  # stamped once known: the trace stays in order
