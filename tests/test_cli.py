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
    run = tmp_path / "run"
    assert main(["train", *args(), "--run-dir", str(run), "--no-progress"]) == 0
    for name in ("config.yaml", "metrics.jsonl", "trace.jsonl", "summary.json"):
        assert (run / name).stat().st_size > 0, name
    assert (run / "final" / "config.json").exists()
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
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
