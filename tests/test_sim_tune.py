"""The tuner: its advice beats the default in simulation, it keeps its constraints, and
an empty search space says which constraint emptied it."""

import json

import pytest

from rlaxkit.cli import main
from rlaxkit.rules.fault_plan import FaultPlan
from sim import presets, simulate, with_overrides
from sim.studies.tune import TuneSpace, tune

SPACE = TuneSpace(max_staleness=(0, 1, 4), push_every_steps=(1, 2), pull_mode=("between_requests",))


def _preempted():
    plan = FaultPlan.from_dicts(
        [
            {"kind": "preempt_worker", "target": "worker-0", "at_s": 2.0},
            {"kind": "preempt_trainer", "at_step": 6, "restart_after_s": 1.0},
        ]
    )
    return with_overrides(presets.local_runtime(target_steps=12), {"fault_plan": plan})


def test_the_tuned_settings_beat_the_default_as_predicted():
    scenario = _preempted()
    result = tune(scenario, SPACE, seeds=(0, 1))
    assert result.default.settings["staleness.max_staleness"] == 1
    # Trainer preemptions put the checkpoint interval in the search.
    assert "checkpointing.every_steps" in result.best.settings
    assert result.best.samples_per_s >= result.default.samples_per_s
    # The prediction is what simulating the tuned settings gives.
    tuned = with_overrides(scenario, result.best.settings)
    again = [simulate(with_overrides(tuned, {"seed": seed})).samples_per_s for seed in (0, 1)]
    assert result.best.samples_per_s == pytest.approx(sum(again) / 2)
    assert "predicted gain" in result.table()


def test_a_staleness_bound_is_kept():
    result = tune(_preempted(), SPACE, seeds=(0,), max_mean_staleness=0.5)
    assert result.best.mean_staleness <= 0.5
    assert all(p.mean_staleness <= 0.5 or p is not result.best for p in result.evaluated)


def test_an_impossible_bound_names_the_constraint():
    with pytest.raises(ValueError, match=r"^min_goodput: no setting reaches goodput 0\.999"):
        tune(_preempted(), SPACE, seeds=(0,), min_goodput=0.999)


def test_a_chip_budget_splits_between_trainer_and_workers():
    scenario = presets.rlax_like(inference_chips=64, prompts_per_step=16, hours=0.5)
    space = TuneSpace(max_staleness=(2,), push_every_steps=(1,), pull_mode=("between_requests",))
    result = tune(scenario, space, chips=128, seeds=(0,))
    assert result.default.settings["trainer.chips"] == 256  # the scenario as it is
    tried = {p.settings["trainer.chips"] for p in result.evaluated if p is not result.default}
    assert tried == {16, 32, 48, 64}  # 1/8 to 1/2 of the budget
    with pytest.raises(
        ValueError,
        match="no setting could be simulated .chips: a budget of 128 leaves no 8-chip worker",
    ):
        tune(scenario, TuneSpace(trainer_chips=(128,)), chips=128, seeds=(0,))


def test_the_command_line_prints_the_advice_or_one_line(capsys):
    command = ["tune", "configs/sim/toy.yaml", "--seeds", "1"]
    assert main([*command, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["tuned"]["samples_per_s"] >= summary["default"]["samples_per_s"]
    assert main([*command, "--max-mean-staleness", "-1"]) == 2
    error = capsys.readouterr().err
    assert error == "rlaxkit tune: max_mean_staleness: must be >= 0, got -1.0\n"


def test_tuned_settings_become_run_config_overrides_and_other_knobs_are_named():
    import sim

    assert sim.run_overrides(
        {"checkpointing.every_steps": 5, "weight_sync.pull_mode": "in_flight"}
    ) == (
        "checkpoint.every_steps=5",
        "weight_sync.pull_mode=in_flight",
    )
    with pytest.raises(ValueError, match=r"\['trainer.chips'\] have no run config setting"):
        sim.run_overrides({"trainer.chips": 64})
