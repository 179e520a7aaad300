"""The sim package surface: re-exports, scenario configs, distributions, sweeps,
figures, and the benchmark entry point."""

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.figure import Figure

import sim
from rlaxkit.rules.fault_plan import FaultPlan
from rlaxkit.rules.trace import MemoryTrace

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "sim"


def test_public_surface():
    for name in sim.__all__:
        assert getattr(sim, name) is not None, name
    assert callable(sim.simulate) and callable(sim.calibrate) and callable(sim.sweep)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    if path.name.startswith("faults"):
        assert len(FaultPlan.load(path)) > 0
    else:
        scenario = sim.load_scenario(path)
        assert scenario.name
        assert sim.scenario_from_dict(sim.scenario_to_dict(scenario)) == scenario


def test_scenario_round_trip_and_validation(tmp_path):
    scenario = sim.presets.areal_like()
    sim.save_scenario(scenario, tmp_path / "s.yaml")
    assert sim.load_scenario(tmp_path / "s.yaml") == scenario
    data = sim.scenario_to_dict(scenario)
    data["fleet"]["slots_per_worker"] = 0
    with pytest.raises(ValueError, match=r"^fleet\.slots_per_worker:"):
        sim.scenario_from_dict(data)
    data = sim.scenario_to_dict(scenario)
    data["workload"]["response_tokens"] = {"type": "gamma"}
    with pytest.raises(ValueError, match=r"workload\.response_tokens\.type"):
        sim.scenario_from_dict(data)
    with pytest.raises(ValueError, match=r"^staleness\.batch_size: must equal"):
        sim.with_overrides(scenario, {"staleness.batch_size": 3})
    with pytest.raises(ValueError, match=r"^staleness\.max_staleness: must be >="):
        sim.with_overrides(
            scenario, {"staleness.max_staleness": 0, "weight_sync.push_every_steps": 2}
        )
    with pytest.raises(ValueError, match=r"^fleet\.gpus: unknown field"):
        sim.with_overrides(scenario, {"fleet.gpus": 3})
    # Changing the batch keeps the policy's batch size in step.
    bigger = sim.with_overrides(scenario, {"workload.prompts_per_step": 8})
    assert bigger.staleness.batch_size == 8


def test_distributions():
    long_tail = sim.LongTail.from_latency(p99_s=40.0, tail_extra_s=80.0, seconds_per_token=0.02)
    stream = sim.distributions.Stream(long_tail, seed=0, name="t")
    draws = [stream.next() for _ in range(20000)]
    # 99% of the body is under 2000 tokens (40 s); the 1% tail reaches 6000 (120 s).
    within = sum(d <= 2000 for d in draws) / len(draws)
    assert 0.975 < within < 0.995
    assert max(draws) <= 6000 and max(draws) > 5000
    normal = sim.Lognormal.from_median_p99(100.0, 400.0)
    assert normal.quantile(0.99) == pytest.approx(400.0)
    assert sim.Lognormal.fit([normal.quantile(q / 100) for q in range(1, 100)]).median == (
        pytest.approx(100.0, rel=0.01)
    )
    assert sim.distribution_from_dict(3) == sim.Constant(value=3.0)
    assert sim.distribution_from_dict(sim.distribution_to_dict(long_tail)) == long_tail
    with pytest.raises(ValueError, match=r"^d\.sigma:"):
        sim.distribution_from_dict({"type": "lognormal", "median": 1, "sigma": -1}, where="d")


def test_sweep_parallel_matches_serial():
    base = sim.presets.areal_like(target_steps=5)
    grid = {"staleness.max_staleness": [0, 2]}
    serial = sim.sweep(base, grid, seeds=(0, 1), processes=1)
    parallel = sim.sweep(base, grid, seeds=(0, 1), processes=2)
    assert [p.result.step_end_s for p in serial] == [p.result.step_end_s for p in parallel]
    table = sim.format_table([p.row() for p in serial])
    assert table.splitlines()[0].split()[:2] == ["staleness.max_staleness", "seed"]
    assert len(table.splitlines()) == 5


def test_figures_render():
    trace = MemoryTrace()
    result = sim.simulate(
        sim.with_overrides(
            sim.presets.areal_like(max_staleness=2, target_steps=4),
            {"preemptions.worker_mtbf_s": 200.0},
        ),
        trace=trace,
    )
    curve = [sim.EtaPoint(e, 1.0 + e, 0.5 * e, 10.0) for e in (0, 1, 2)]
    study = sim.CheckpointStudy((100.0, 200.0), (0.3, 0.2), 150.0, 200.0, 160.0)
    figures = [
        sim.timeline_figure(trace.events),
        sim.staleness_figure(result),
        sim.utilisation_figure([result, result]),
        sim.eta_curve_figure(curve),
        sim.checkpoint_figure(study),
    ]
    for figure in figures:
        assert isinstance(figure, Figure) and figure.axes
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
        assert buffer.getvalue()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_bench_quick_prints_json_summary():
    completed = subprocess.run(
        # One simulated hour of the 1024-chip run, not the headline's 13: the path, not
        # the simulator's speed, is under test here.
        [sys.executable, "-m", "sim.bench", "--quick", "--hours", "1"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    lines = completed.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert {"rlax_1024_wall_s", "events_per_s", "async_vs_sync"} <= set(summary)
    assert summary["rlax_1024_hours"] == 1.0 and summary["rlax_1024_steps"] > 0
    assert summary["async_vs_sync"] >= 2.0
    # Wall time is a benchmark figure (goal: <= 30 s on 2 cores), printed, not asserted.
    assert summary["rlax_1024_wall_s"] > 0


def test_the_simulator_imports_neither_the_runtime_nor_jax():
    """sim shares plain-Python parts with the runtime (policies, the ledger of groups,
    faults, the trace schema) and nothing else: recording a real run lives with the
    runtime (``rlaxkit.runtime.record``)."""
    import subprocess
    import sys

    code = (
        "import sys, sim, sim.calibration.calibrate, sim.studies.standard, sim.studies.sweep\n"
        "bad = [m for m in sys.modules if m == 'jax' or m.startswith('rlaxkit.runtime')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
