"""Planning benchmark: compile time against depth, FLOPs against the train-step
benchmark's count, and the plans of two real models on v5p meshes.

1. **Depth**: the train step of Qwen2.5-0.5B's dimensions cut to 4 and to 32 layers
   (scan over layers, mesh ``(1, 2, 2)``, 4 x 256 tokens) compiled for the plan; the
   ratio of the two compiles' CPU seconds (goal <= 1.5: a scanned program is one
   block's). CPU seconds, not wall: on a machine shared with other jobs the wall clock
   of one compile moves by 2x from one run to the next.
2. **FLOPs**: the plan of ``benchmarks/train_step.py``'s quick model (8 x 256 tokens,
   float32, one device) against that benchmark's model-FLOP count (``step_flops``;
   goal: within 10%), and the compiled step's argument bytes against the bytes of the
   real state and batch built here.
3. **Plans**: Qwen2.5-7B on a ``(1, 16, 4)`` mesh and Qwen3-32B on ``(1, 64, 4)``
   (``configs/plan/*.yaml``: 64 rows of 8192 tokens), each with ``remat=full`` (all
   programs) and ``remat=none`` (train step only): wall and CPU seconds of each, and
   whether the train step fits a v5p chip's 95 GiB.

4. **XLA:TPU** (libtpu, compile-only): every program the runtime runs
   (``rlaxkit.planning.suite``: train steps plain, scanned with remat and LoRA; prefill,
   decode on a cache view, the multi-turn and resume programs, the weight publication)
   compiled for ``v5p:2x2x1``, ``v5e:2x2`` and ``v6e:2x2`` (``tpu_programs_compiled`` of
   ``tpu_programs_total``); the Qwen2.5-7B train step compiled for its v5p-128 target
   beside the XLA:CPU one (``qwen25_7b_v5p_train_gib_tpu`` / ``_cpu``); the shipped TPU
   plans' fit per program and wall time (``qwq32b_rlax_fits``, ``tpu_plan_wall_s``):
   with ``--quick`` the TPU train step and plans are read from their stored
   ``configs/plan/*.plan.json``, else compiled.

Usage::

    python benchmarks/plan.py --quick   # 1, 2, 4 and the Qwen2.5-7B plans
    python benchmarks/plan.py           # ... and the Qwen3-32B plans, TPU plans compiled

The last line printed is one JSON object with every number.

``--quick`` on two shared cores (load 2-5) took 9 min 39 s wall, 459 CPU s: the scanned
compiles 16.7 CPU s at 4 and at 32 layers (ratio 1.00); FLOPs within 4.4 % of the
benchmark's count, argument bytes equal; the XLA:CPU Qwen2.5-7B plans 149 s (remat full,
43.8 GiB a chip, fits) and 81 s (remat none, 560 GiB, does not); all 24 runtime programs
compiled by XLA:TPU for the three chips in 114 CPU s; the stored XLA:TPU train step 25.4
GiB a chip. It is not quick: the two XLA:CPU 7B plans are most of it. Those memory
figures predate the train step's logits constraint (``constrain_logits``), after which
the 7B train step read 24.99 GiB a chip on XLA:CPU (49 s alone, quiet) and 12.04 on
XLA:TPU; with the residual stream split over ``model`` too (``constrain_stream``), the
stored XLA:TPU plan reads 9.89.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402
from flax import nnx  # noqa: E402
from train_step import QUICK, make_batch, step_flops  # noqa: E402

from rlaxkit.algorithms import algorithm  # noqa: E402
from rlaxkit.models import Transformer  # noqa: E402
from rlaxkit.planning import Plan, load_plan_config, plan  # noqa: E402
from rlaxkit.trainer.config import TrainConfig  # noqa: E402
from rlaxkit.trainer.state import create_train_state  # noqa: E402

GIB = 1024**3


def depth(layers: int) -> tuple[float, float]:
    """Compile CPU and wall seconds of the scanned train step with ``layers`` layers."""
    result = plan(
        model="qwen2.5-0.5b",
        num_layers=layers,
        mesh=(1, 2, 2),
        rows=4,
        prompt_tokens=64,
        completion_tokens=192,
        programs=("train",),
    )
    train = result.program("train")
    return train.compile_cpu_s, train.compile_s


def flops_check() -> dict[str, float | bool]:
    """The plan of the train-step benchmark's quick model against its FLOP count."""
    model, rows, length = QUICK.model, QUICK.rows, QUICK.length
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "config.json").write_text(json.dumps(model.to_hf()))
        result = plan(
            model=directory,
            rows=rows,
            prompt_tokens=length // 4,
            completion_tokens=length - length // 4,
            master_dtype="float32",
            compute_dtype="float32",
            programs=("train",),
        )
    train = result.program("train")
    want = step_flops(model, rows, length)
    # The real arrays the benchmark trains on: state (scanned layout) and batch.
    scanned = model.replace(scan_layers=True)
    params = nnx.state(Transformer(scanned, rngs=nnx.Rngs(0)))
    cfg = TrainConfig(algorithm=algorithm("grpo", loss={"kl_coef": 0.0}))
    real = (create_train_state(cfg, params), make_batch(model, rows, length, 0))
    real_bytes = sum(x.nbytes for x in jax.tree.leaves(real))
    return {
        "plan_flops": train.flops,
        "benchmark_flops": want,
        "flops_rel_err": abs(train.flops - want) / want,
        "argument_bytes": train.argument_bytes,
        "real_argument_bytes": real_bytes,
        "argument_bytes_equal": train.argument_bytes == real_bytes,
    }


def big_plan(name: str) -> dict[str, object]:
    """The plan of ``configs/plan/{name}.yaml`` with ``remat=full`` and ``none``."""
    config = load_plan_config(ROOT / "configs" / "plan" / f"{name}.yaml")
    start = time.perf_counter()
    full = plan(dataclasses.replace(config, remat="full"))
    full_s = time.perf_counter() - start
    print(full.table())
    start = time.perf_counter()
    none = plan(dataclasses.replace(config, remat="none", programs=("train",)))
    none_s = time.perf_counter() - start
    print(none.table())
    return {
        "plan_s": full_s,
        "plan_cpu_s": full.cpu_s,
        "plan_no_remat_train_s": none_s,
        "fits_v5p_remat_full": full.fits("train"),
        "fits_v5p_remat_none": none.fits("train"),
        "train_peak_gib_remat_full": full.program("train").peak_bytes / GIB,
        "train_peak_gib_remat_none": none.program("train").peak_bytes / GIB,
        "prefill_fits": full.fits("prefill"),
        "decode_fits": full.fits("decode"),
        "step_s_at_mfu": full.step_s,
        "trainer_tokens_per_s": full.trainer_tokens_per_s,
        "kv_cache_gib_per_worker": full.kv_cache_bytes / GIB,
        "push_gib": full.push_bytes / GIB,
    }


def stored_plan(name: str) -> Plan | None:
    """The plan stored in ``configs/plan/{name}.plan.json``, if there is one."""
    path = ROOT / "configs" / "plan" / f"{name}.plan.json"
    return Plan.from_summary(json.loads(path.read_text())) if path.is_file() else None


def tpu_train(quick: bool) -> tuple[Plan, float | None]:
    """The Qwen2.5-7B train step as XLA:TPU compiles it for v5p-128, and the seconds the
    compile took now: stored in ``qwen25_7b_v5p_tpu.plan.json`` (``--quick``; ``None``),
    else compiled (56 minutes on two loaded cores)."""
    stored = stored_plan("qwen25_7b_v5p_tpu") if quick else None
    if stored is not None and any(p.name == "train" for p in stored.programs):
        print(stored.table())
        return stored, None
    config = load_plan_config(ROOT / "configs" / "plan" / "qwen25_7b_v5p.yaml")
    start = time.perf_counter()
    result = plan(dataclasses.replace(config, target="v5p-128", programs=("train",)))
    print(result.table())
    return result, time.perf_counter() - start


TPU_PLANS = ("qwen25_7b_v5p_tpu", "qwq32b_v5p_1024", "qwen3_8b_v5e_256", "qwen3_8b_v6e_256")


def tpu_programs() -> dict[str, object]:
    """The runtime's programs for a small model, compiled by XLA:TPU for three chips."""
    from rlaxkit.models import ModelConfig
    from rlaxkit.planning.suite import RUNTIME_PROGRAMS, compile_runtime_programs

    model = ModelConfig(
        family="qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
    )
    compiled, failed = 0, []
    start = time.process_time()
    for topology in ("v5p:2x2x1", "v5e:2x2", "v6e:2x2"):
        for name, cost in compile_runtime_programs(topology, model).items():
            compiled += cost.compiled
            if not cost.compiled:
                failed.append(f"{topology}/{name}")
    return {
        "tpu_programs_compiled": compiled,
        "tpu_programs_total": 3 * len(RUNTIME_PROGRAMS),
        "tpu_programs_failed": failed,
        "tpu_programs_cpu_s": time.process_time() - start,
    }


def tpu_plans(quick: bool) -> dict[str, object]:
    """The shipped TPU plans: stored (``--quick``) or compiled now."""
    out: dict[str, object] = {"tpu_plan_wall_s": {}, "tpu_plan_source": {}}
    for name in TPU_PLANS:
        stored = stored_plan(name) if quick else None
        if stored is not None:
            result, source = stored, "stored"
        elif (ROOT / "configs" / "plan" / f"{name}.yaml").is_file() and not quick:
            result = plan(load_plan_config(ROOT / "configs" / "plan" / f"{name}.yaml"))
            source = "compiled"
        else:
            continue
        out["tpu_plan_wall_s"][name] = result.wall_s  # type: ignore[index]
        out["tpu_plan_source"][name] = source  # type: ignore[index]
        fits = {p.name: result.fits(p.name) for p in result.programs}
        out[f"{name}_fits"] = fits
        if name == "qwq32b_v5p_1024":
            out["qwq32b_rlax_fits"] = fits
        summary = result.summary()
        out[f"{name}_est_step_s"] = summary.get("est_step_s")
        out[f"{name}_est_mfu"] = summary.get("est_mfu")
        out[f"{name}_decode_tokens_per_s_per_chip"] = summary.get("decode_tokens_per_s_per_chip")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="skip the Qwen3-32B plans")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    (compile_4, wall_4), (compile_32, wall_32) = depth(4), depth(32)
    print(
        f"scanned train step compile, CPU s: 4 layers {compile_4:.1f}, 32 layers "
        f"{compile_32:.1f} (wall {wall_4:.1f} and {wall_32:.1f})"
    )
    flops = flops_check()
    print(
        f"plan FLOPs {flops['plan_flops']:.4g} vs train_step.py {flops['benchmark_flops']:.4g} "
        f"(rel. err. {flops['flops_rel_err']:.3f}); argument bytes {flops['argument_bytes']} "
        f"vs real arrays {flops['real_argument_bytes']}"
    )
    report: dict[str, object] = {
        "quick": args.quick,
        "compile_cpu_s_4_layers": compile_4,
        "compile_cpu_s_32_layers": compile_32,
        "compile_wall_s_4_layers": wall_4,
        "compile_wall_s_32_layers": wall_32,
        "compile_ratio_32_vs_4": compile_32 / compile_4,
        **flops,
    }
    qwen7 = big_plan("qwen25_7b_v5p")
    report["qwen25_7b_plan_s"] = qwen7["plan_s"]
    report["qwen25_7b_plan_cpu_s"] = qwen7["plan_cpu_s"]
    report["qwen25_7b"] = qwen7
    report["qwen3_32b_plan_s"] = None
    report.update(tpu_programs())
    tpu7, report["qwen25_7b_v5p_tpu_train_s"] = tpu_train(args.quick)
    report["qwen25_7b_v5p_train_gib_tpu"] = tpu7.program("train").peak_bytes / GIB
    report["qwen25_7b_v5p_train_gib_cpu"] = qwen7["train_peak_gib_remat_full"]
    report.update(tpu_plans(args.quick))
    if not args.quick:
        qwen32 = big_plan("qwen3_32b_v5p")
        report["qwen3_32b_plan_s"] = qwen32["plan_s"]
        report["qwen3_32b_plan_cpu_s"] = qwen32["plan_cpu_s"]
        report["qwen3_32b"] = qwen32
    report["load_average_1m"] = [load_before, os.getloadavg()[0]]
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
