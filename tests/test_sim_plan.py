"""The simulator takes a plan: a stored plan's compiled costs replace the presets'
assumed ones (``sim.presets.from_plan``, a scenario's ``plan:`` key)."""

from __future__ import annotations

import json

import pytest

from rlaxkit.planning import PlanConfig, ProgramCost
from rlaxkit.planning.costs import Plan
from sim.presets import from_plan, rlax_like, toy
from sim.scenario import scenario_from_dict, scenario_to_dict


def _program(name, devices, **fields):
    base = dict(argument_bytes=1, output_bytes=0, alias_bytes=0, temp_bytes=1, flops=1.0)
    base |= dict(bytes_accessed=0.0, compile_s=1.0)
    return ProgramCost(name=name, devices=devices, **(base | fields))


def _tpu_summary():
    """A v5p:2x2x1 plan with the compiler's times set by hand: a 2 s train step of
    3.0e14 FLOPs per device, a 40 ms decode step of 8 slots, a 0.5 s prefill of 4
    prompts of 64 tokens, a publish writing 1 GiB per device."""
    config = PlanConfig(
        model="qwen2.5-0.5b",
        target="v5p:2x2x1",
        mesh=(1, 2, 2),
        rows=4,
        prompt_tokens=64,
        completion_tokens=192,
        sampler_chips=2,
        slots=8,
        samples_per_prompt=2,
        total_chips=12,
        programs=("train", "prefill", "decode", "publish"),
    )
    programs = (
        _program("train", 4, flops=3.0e14, optimal_s=2.0),
        _program("prefill", 2, optimal_s=0.5),
        _program("decode", 2, optimal_s=0.04),
        _program("publish", 4, output_bytes=2**30),
    )
    return Plan(config=config, model=config.model_config(), programs=programs).summary()


def test_a_tpu_plan_sets_the_simulated_costs_to_the_compilers_estimates():
    summary = _tpu_summary()
    assert summary["compiler"] == "XLA:TPU for v5p:2x2x1"
    assert summary["est_mfu"] == pytest.approx(3.0e14 / (2.0 * 459e12))
    s = from_plan(summary, base=toy())
    assert s.name == "toy_planned_tpu"
    assert s.trainer.step_s(4 * 256) == pytest.approx(2.0, rel=1e-12)  # the compiler's 2 s
    fleet = s.fleet
    full_step = fleet.decode_s_per_token + 8 * fleet.decode_s_per_token_per_seq
    assert full_step == pytest.approx(0.04, rel=1e-12)  # one step, every slot running
    assert fleet.prefill_tokens_per_s == pytest.approx(4 * 64 / 0.5)
    assert s.param_server.weight_bytes == 2 * 2**30  # one worker's copy: 2 chips x 1 GiB
    assert fleet.num_workers == (12 - 4) // 2
    assert summary["decode_tokens_per_s_per_chip"] == pytest.approx(8 / 0.04 / 2)


def test_a_stored_cpu_plan_is_the_labelled_fallback():
    path = "configs/plan/qwen3_32b_v5p.plan.json"
    with open(path) as f:
        summary = json.load(f)
    s = from_plan(path)
    assert s.name == "rlax_like_1024_planned_cpu"
    tokens = 64 * 8192
    compute_s = s.trainer.step_s(tokens) - s.trainer.step_overhead_s  # the preset's host part
    assert compute_s == pytest.approx(summary["step_s"], rel=1e-12)


def test_a_scenario_names_a_plan(tmp_path):
    stored = tmp_path / "p.plan.json"
    stored.write_text(json.dumps(_tpu_summary()))
    data = scenario_to_dict(rlax_like(hours=1.0))
    s = scenario_from_dict({**data, "plan": str(tmp_path / "p.yaml")})
    assert s.name == "rlax_like_1024_planned_tpu"
    compute_s = s.trainer.step_s(4 * 256) - s.trainer.step_overhead_s
    assert compute_s == pytest.approx(2.0, rel=1e-12)
    with pytest.raises(ValueError, match=r"has no stored result q.plan.json; compile it once"):
        scenario_from_dict({**data, "plan": str(tmp_path / "q.yaml")})


def test_the_stored_qwen25_7b_tpu_plan_feeds_the_simulator():
    """Its decode step as XLA:TPU estimated it for a 4-chip v5p worker, 64 slots."""
    with open("configs/plan/qwen25_7b_v5p_tpu.plan.json") as f:
        summary = json.load(f)
    s = from_plan("configs/plan/qwen25_7b_v5p_tpu.yaml")
    assert s.name == "rlax_like_1024_planned_tpu"
    fleet = s.fleet
    full_step = fleet.decode_s_per_token + 64 * fleet.decode_s_per_token_per_seq
    assert full_step == pytest.approx(summary["est_decode_step_s"], rel=1e-12)
    assert fleet.chips_per_worker == 4 and fleet.slots_per_worker == 64
