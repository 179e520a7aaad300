"""rlaxkit's half of ``benchmarks/peers/run.py`` on tiny shapes, so the script cannot rot.

The peer's half needs its own 1.6 GB virtualenv and is not run here; its results are
stood in for by rlaxkit's own, which exercises the summary (medians, ratios, fractions
of peak, the parameter-count check) exactly as a real run does.
"""

import importlib
import math
import sys
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parent.parent / "benchmarks" / "peers"


@pytest.fixture(scope="module")
def drivers():
    sys.path[:0] = [str(PEERS), str(PEERS.parent)]
    try:
        yield importlib.import_module("rlaxkit_side"), importlib.import_module("run")
    finally:
        for path in (str(PEERS), str(PEERS.parent)):
            sys.path.remove(path)


def test_both_sides_build_the_same_qwen3_shapes(drivers):
    side, _ = drivers
    workloads = importlib.import_module("workloads")
    for shape in (workloads.SMALL_MODEL, workloads.LARGE_MODEL):
        config = side.model_config(shape)
        # Hand count, small: 4 layers x (attention 128*32*12 + q/k norms 64 + SwiGLU
        # 3*128*512 + norms 256) + embedding 512*128 + final norm 128 = 1 049 984.
        assert config.num_params() == shape.num_params()
        assert (config.head_dim, config.intermediate_size) == (shape.hidden // 4, 4 * shape.hidden)
    assert workloads.SMALL_MODEL.num_params() == 1_049_984


def test_rlaxkit_half_runs_and_summarises_on_tiny_shapes(drivers):
    side, run = drivers
    workloads = importlib.import_module("workloads")
    step = side.run_steps(workloads.TINY_GRPO, steps=1, tiered=False)
    decode = side.run_decode(workloads.TINY_DECODE, repeats=1)
    assert step["params"] == decode["params"] == workloads.TINY_MODEL.num_params()
    assert len(step["step_s"]) == 1 and decode["tokens"] == 2 * 4
    results = {}
    for name in ("tunix", "rlaxkit"):  # rlaxkit's results stand in for the peer's
        for setting in ("small", "large"):
            results[(name, "step", setting)] = [step]
            results[(name, "decode", setting)] = [decode]
    report = run.summarise(results, peak_flops=1e11)
    for key in ("step_small_x", "step_large_x", "decode_small_x", "decode_large_x"):
        assert report[key] == pytest.approx(1.0), key
    fraction = report["rlaxkit_step_small_peak_fraction"]
    assert math.isfinite(fraction) and fraction > 0
    floors = side.floors(["step:tiny", "decode:tiny"])
    assert set(floors) == {"step_tiny", "decode_tiny"} and all(f > 0 for f in floors.values())
    for name in ("tunix", "rlaxkit"):
        results[(name, "step", "tiny")] = [step]
        results[(name, "decode", "tiny")] = [decode]
    report = run.summarise(results, peak_flops=1e11, floors=floors)
    for key in ("step_tiny", "decode_tiny"):
        took = step["step_s"][0] if key == "step_tiny" else decode["seconds"][0]
        assert report[f"rlaxkit_{key}_floor_fraction"] == pytest.approx(floors[key] / took)
        # Both sides took the same time: the bound is the side's time over the floor.
        assert report[f"{key}_x_bound"] == pytest.approx(took / floors[key])
        assert report[f"{key}_goal_floor_fraction"] == pytest.approx(2 * floors[key] / took)
    results[("tunix", "step", "small")] = [dict(step, params=step["params"] + 1)]
    with pytest.raises(RuntimeError, match="parameter counts differ"):
        run.summarise(results, peak_flops=1e11)


def test_the_rlaxkit_side_exits_with_generate_helpers_waiting():
    # The driver joins its threads before exiting, so that no background compile is
    # torn down; ``generate``'s helper threads wait for work for the life of the
    # process, and joining one would never return.
    import subprocess

    script = (
        "import sys; sys.path[:0] = sys.argv[1:3]\n"
        "from rlaxkit.inference import chunks\n"
        "chunks.run_chunks(lambda chunk: chunk, [(0, 1), (1, 2)])  # starts a helper\n"
        "import rlaxkit_side\n"
        "sys.exit(rlaxkit_side.main(['--work', 'floor']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(PEERS), str(PEERS.parent)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"side": "rlaxkit"' in done.stdout
