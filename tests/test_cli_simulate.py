"""``rlaxkit simulate SCENARIO.yaml`` writes a run directory laid out as a real run's; the
chunked run behind its progress bar gives the same result and trace as ``sim.simulate``."""

import json

import yaml

import sim
from rlaxkit.cli import _simulate_in_chunks, load_scenario_with_overrides, main
from rlaxkit.observe.perfetto import validate
from rlaxkit.rules.trace import MemoryTrace, read_trace

TOY = "configs/sim/toy.yaml"


def test_simulate_writes_a_run_directory(tmp_path, capsys):
    run = tmp_path / "run"
    overrides = ["--set", "fleet.num_workers=2", "--set", "target_steps=4"]
    assert main(["simulate", TOY, *overrides, "--run-dir", str(run), "--no-progress"]) == 0
    for name in ("scenario.yaml", "trace.jsonl", "summary.json", "run.perfetto.json"):
        assert (run / name).stat().st_size > 0, name
    resolved = yaml.safe_load((run / "scenario.yaml").read_text())
    assert resolved["fleet"]["num_workers"] == 2 and resolved["target_steps"] == 4
    summary = json.loads((run / "summary.json").read_text())
    expected = sim.simulate(sim.load_scenario(run / "scenario.yaml"))
    assert summary["steps"] == 4
    assert {k: v for k, v in summary.items() if k in expected.to_row()} == expected.to_row()
    assert [e.kind for e in read_trace(run / "trace.jsonl")].count("train_step") == 4
    validate(json.loads((run / "run.perfetto.json").read_text()))
    plots = {p.name for p in (run / "plots").glob("*.png")}
    assert {"timeline.png", "staleness.png"} <= plots
    out = capsys.readouterr().out
    assert "4 steps" in out and "ui.perfetto.dev" in out
    # The second run into the folder: the same scenario is done; another one, or a real
    # run, is refused before any work.
    events = (run / "trace.jsonl").read_text()
    assert main(["simulate", TOY, *overrides, "--run-dir", str(run)]) == 0
    assert "finished after 4 steps; nothing to do" in capsys.readouterr().out
    assert (run / "trace.jsonl").read_text() == events
    assert main(["simulate", TOY, "--set", "target_steps=5", "--run-dir", str(run)]) == 2
    assert "another config (it differs at fleet.num_workers, target_steps)" in (
        capsys.readouterr().err
    )
    assert main(["train", "--run-dir", str(run)]) == 2
    assert "holds a simulated run (scenario.yaml); choose --resume" in capsys.readouterr().err


def test_chunked_run_is_the_plain_run():
    # Fleet-scale, preemptions, horizon stop: the chunk timeouts must not move any event.
    scenario = sim.presets.rlax_like(inference_chips=64, hours=1.0)
    plain, chunked = MemoryTrace(), MemoryTrace()
    expected = sim.simulate(scenario, trace=plain)
    result = _simulate_in_chunks(scenario, chunked, progress=False)
    assert result.to_row() == expected.to_row()
    assert result.step_end_s == expected.step_end_s
    assert chunked.events == plain.events


def test_chunked_run_stops_at_the_target_step():
    scenario = sim.presets.toy(target_steps=3)
    result = _simulate_in_chunks(scenario, MemoryTrace(), progress=False)
    assert result.to_row() == sim.simulate(scenario).to_row()


def test_overrides_are_yaml_and_keep_the_batch_size_in_step(tmp_path):
    scenario = load_scenario_with_overrides(
        TOY,
        [
            "workload.prompts_per_step=3",
            "workload.response_tokens={type: constant, value: 7}",
        ],
    )
    assert scenario.workload.prompts_per_step == scenario.staleness.batch_size == 3
    assert scenario.workload.response_tokens == sim.Constant(value=7)


def test_a_bad_override_exits_2_naming_the_field(tmp_path, capsys):
    assert main(["simulate", TOY, "--set", "fleet.wokers=2", "--run-dir", str(tmp_path)]) == 2
    assert "fleet.wokers" in capsys.readouterr().err
    assert main(["simulate", str(tmp_path / "missing.yaml")]) == 2


def test_a_compact_trace_is_read_as_it_is(tmp_path, capsys):
    """``--compact-trace`` gzips a finished run's trace; plots, the Perfetto export and
    ``read_trace`` take the ``.gz`` as they took the plain file."""
    run = tmp_path / "run"
    overrides = ["--set", "fleet.num_workers=2", "--set", "target_steps=4", "--no-progress"]
    assert main(["simulate", TOY, *overrides, "--run-dir", str(run), "--compact-trace"]) == 0
    assert not (run / "trace.jsonl").exists()
    assert [e.kind for e in read_trace(run / "trace.jsonl.gz")].count("train_step") == 4
    assert "trace.jsonl.gz (" in capsys.readouterr().out
    assert main(["plot", str(run)]) == 0
    assert main(["trace", str(run), "-o", str(tmp_path / "again.json")]) == 0
    validate(json.loads((tmp_path / "again.json").read_text()))
