"""FaultPlan: round trips, validation errors naming the field, random plans."""

import statistics
from pathlib import Path

import pytest

from rlaxkit.rules.fault_plan import Fault, FaultPlan, random_preemptions

EXAMPLE = Path(__file__).resolve().parents[1] / "configs" / "sim" / "faults_example.yaml"


def _plan():
    return FaultPlan(
        (
            Fault(kind="preempt_worker", target="worker-3", at_s=600.0, restart_after_s=120.0),
            Fault(kind="preempt_slice", target="slice-0", at_s=1800.0),
            Fault(kind="preempt_trainer", at_step=40, restart_after_s=300.0),
            Fault(kind="kill_param_server", at_s=900.0, restart_after_s=30.0),
            Fault(kind="slow_worker", target="worker-1", at_s=100.0, factor=3.0, duration_s=60.0),
            Fault(kind="fail_pull", target="worker-2", at_step=5, count=2),
            Fault(kind="hang_reward", at_s=50.0),
        )
    )


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_round_trip(tmp_path, suffix):
    plan = _plan()
    path = tmp_path / f"plan{suffix}"
    plan.save(path)
    assert FaultPlan.load(path) == plan


def test_bare_list_and_mapping_forms():
    items = [{"kind": "hang_reward", "at_s": 1}]
    assert FaultPlan.from_dicts(items) == FaultPlan.from_dicts({"faults": items})
    assert FaultPlan.from_dicts(items).faults[0].at_s == 1.0


def test_shipped_example_parses():
    plan = FaultPlan.load(EXAMPLE)
    assert {f.kind for f in plan} == {
        "preempt_worker", "preempt_slice", "preempt_trainer", "kill_param_server",
        "slow_worker", "fail_pull", "hang_reward",
    }  # fmt: skip


def test_timed_and_step_views():
    plan = _plan()
    assert [f.at_s for f in plan.timed()] == [50.0, 100.0, 600.0, 900.0, 1800.0]
    assert sorted(plan.by_step()) == [5, 40]
    assert plan.faults[2].resolved_target == "trainer"
    assert len(plan.merged(plan)) == 2 * len(plan)


@pytest.mark.parametrize(
    ("item", "field"),
    [
        ({"kind": "explode", "at_s": 1}, "kind"),
        ({"kind": "hang_reward"}, "at_s"),
        ({"kind": "hang_reward", "at_s": 1, "at_step": 2}, "at_s"),
        ({"kind": "hang_reward", "at_s": -1}, "at_s"),
        ({"kind": "preempt_trainer", "at_step": 1.5}, "at_step"),
        ({"kind": "preempt_worker", "at_s": 1}, "target"),
        (
            {"kind": "slow_worker", "at_s": 1, "target": "w", "factor": 0.5, "duration_s": 1},
            "factor",
        ),
        ({"kind": "slow_worker", "at_s": 1, "target": "w", "factor": 2}, "duration_s"),
        ({"kind": "preempt_trainer", "at_s": 1, "restart_after_s": -5}, "restart_after_s"),
        ({"kind": "hang_reward", "at_s": 1, "restart_after_s": 5}, "restart_after_s"),
        ({"kind": "hang_reward", "at_s": 1, "factor": 2}, "factor"),
        ({"kind": "fail_pull", "at_s": 1, "count": 0}, "count"),
        ({"kind": "hang_reward", "at_s": 1, "when": 3}, "when"),
    ],
)
def test_validation_names_the_field(item, field):
    items = [{"kind": "hang_reward", "at_s": 0}, item]
    with pytest.raises(ValueError, match=rf"^faults\[1\]\.{field}"):
        FaultPlan.from_dicts(items)


def test_random_plan_is_seeded_and_bounded():
    kwargs = {"targets": ["worker-0", "worker-1"], "horizon_s": 1e5, "mtbf_s": 1e3}
    a = random_preemptions(seed=1, **kwargs)
    assert a == random_preemptions(seed=1, **kwargs)
    assert a != random_preemptions(seed=2, **kwargs)
    times = [f.at_s for f in a]
    assert times == sorted(times) and times[0] > 0 and times[-1] < 1e5
    assert {f.target for f in a} == {"worker-0", "worker-1"}


@pytest.mark.parametrize(("distribution", "shape"), [("exponential", 1.0), ("weibull", 0.7)])
def test_random_plan_mean_interval(distribution, shape):
    # 1 target, horizon 4000 MTBFs: the mean gap is the MTBF within a few percent.
    plan = random_preemptions(
        targets=["trainer"], kind="preempt_trainer", horizon_s=4e6, mtbf_s=1e3,
        distribution=distribution, weibull_shape=shape, seed=0,
    )  # fmt: skip
    times = [0.0] + [f.at_s for f in plan]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1e3, rel=0.06)
    assert all(f.target is None and f.resolved_target == "trainer" for f in plan)


def test_random_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="^mtbf_s:"):
        random_preemptions(targets=["a"], horizon_s=1, mtbf_s=0)
    with pytest.raises(ValueError, match="^distribution:"):
        random_preemptions(targets=["a"], horizon_s=1, mtbf_s=1, distribution="pareto")
    with pytest.raises(ValueError, match="^kind:"):
        random_preemptions(targets=["a"], horizon_s=1, mtbf_s=1, kind="hang_reward")
