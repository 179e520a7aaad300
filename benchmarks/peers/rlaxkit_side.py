"""rlaxkit's half of ``run.py``: the work of ``workloads.py`` through rlaxkit's public API.

The GRPO step is ``benchmarks/grpo_step.py``'s ``GRPOLoop`` (the jitted KV-cache sampler,
reward, collate, the tiered train step) on the prompts and reward of ``workloads.py``;
decode is ``rlaxkit.inference.generate``. Each invocation does one piece of work and
prints one JSON object as its last line, with the same keys as ``tunix_side.py``:

* ``--work step``: the first two steps compile, then ``--steps`` timed steps, none of
  which may compile;
* ``--work first_step``: in this fresh process, with JAX's persistent compilation cache
  off, from the model existing to the first step's end (optimizer state, every
  compile, the step itself);
* ``--work decode``: a warm-up call, then ``--repeats`` timed calls;
* ``--work peak``: this machine's float32 matmul FLOP/s (``matmul_peak_flops``);
* ``--work floor``: the matmul floor (``floor.py``) of each ``--floors`` job.

Usage::

    .venv/bin/python benchmarks/peers/rlaxkit_side.py --work step --setting small
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import floor  # noqa: E402
import jax  # noqa: E402
import workloads  # noqa: E402
from flax import nnx  # noqa: E402
from grpo_step import GRPOLoop, Setting, qwen3, timed_steps  # noqa: E402

from rlaxkit.inference import SamplingConfig, generate  # noqa: E402
from rlaxkit.inference.chunks import HELPER_THREAD_NAME  # noqa: E402
from rlaxkit.models import ModelConfig, Transformer  # noqa: E402
from rlaxkit.util import hostmem  # noqa: E402
from rlaxkit.util.jaxutil import Packed, count_compilations, matmul_peak_flops  # noqa: E402


def model_config(shape: workloads.ModelShape) -> ModelConfig:
    config = qwen3(shape.hidden, shape.vocab, layers=shape.layers)
    assert config.head_dim == shape.head_dim and config.intermediate_size == shape.mlp
    assert config.rope_theta == workloads.ROPE_THETA
    assert config.rms_norm_eps == workloads.RMS_NORM_EPS
    return config


def build_model(shape: workloads.ModelShape, seed: int = 0) -> tuple[Transformer, int]:
    model = Transformer(model_config(shape), rngs=nnx.Rngs(seed))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if params != shape.num_params():
        raise RuntimeError(f"rlaxkit model has {params} parameters, expected {shape.num_params()}")
    return model, params


def make_loop(work: workloads.GRPOWork, model: Transformer, tiered: bool = True) -> GRPOLoop:
    setting = Setting(
        name=work.name,
        model=model.config,
        prompts=work.prompts,
        samples=work.samples,
        new_tokens=work.new_tokens,
    )
    # 64 batches of prompts, as many as the peer's driver could ask for.
    prompts = [
        p
        for i in range(64)
        for p in workloads.prompt_ids(work.prompts, work.prompt_tokens, work.model.vocab, i)
    ]
    return GRPOLoop(
        setting,
        prompts,
        lambda _, tokens: workloads.reward(tokens),
        pad_id=workloads.PAD_ID,
        eos_id=workloads.EOS_ID,
        model=model,
        tiered=tiered,
        # The prompts' own width, as the peer's rollout is told it (``max_prompt_length``).
        min_prompt_width=work.prompt_tokens,
    )


def run_steps(work: workloads.GRPOWork, steps: int, tiered: bool = True) -> dict[str, object]:
    """``tiered=False`` (tests): one optimised train-step compile instead of two tiers."""
    model, params = build_model(work.model)
    loop = make_loop(work, model, tiered)
    loop.start_compiling()
    loop.step(0)
    loop.step(1)
    timed = timed_steps(loop, 2, steps)
    phases = {k: [s[k] for s in timed] for k in ("generate_s", "score_collate_s", "train_s")}
    return {
        "params": params,
        "step_s": [s["step_s"] for s in timed],
        "flops": work.flops(),
        **phases,
    }


def run_first_step(work: workloads.GRPOWork) -> dict[str, object]:
    jax.config.update("jax_enable_compilation_cache", False)
    model, params = build_model(work.model)
    start = time.perf_counter()
    loop = make_loop(work, model)
    loop.start_compiling()
    loop.step(0)
    return {"params": params, "first_step_s": time.perf_counter() - start}


def run_decode(work: workloads.DecodeWork, repeats: int) -> dict[str, object]:
    model, params = build_model(work.model)
    prompts = workloads.prompt_ids(work.batch, work.prompt_tokens, work.model.vocab, 0)
    config = SamplingConfig(temperature=1.0, max_new_tokens=work.new_tokens)
    # Split and flattened once, as a sampler holding its weights does (``InferenceEngine``
    # packs them per weight update; the peer's sampler splits at construction).
    graphdef, weights = nnx.split(model)
    split = (graphdef, Packed.of(weights))

    def call(seed: int):
        # Pads to the prompts' own 4 tokens, as the peer's sampler is told them
        # (``max_prompt_length``), not to generate's default 16.
        result = generate(split, prompts, config, seed, min_prompt_width=work.prompt_tokens)
        if not (result.lengths == work.new_tokens).all():
            raise RuntimeError(f"rows generated {result.lengths} tokens, not {work.new_tokens}")
        return result

    call(0)  # compiles
    seconds = []
    for i in range(repeats):
        with count_compilations() as compiles:
            start = time.perf_counter()
            call(i + 1)
            seconds.append(time.perf_counter() - start)
        if compiles.count:
            raise RuntimeError(f"decode call {i} compiled {compiles.count} programs")
    tokens = work.batch * work.new_tokens
    return {"params": params, "seconds": seconds, "tokens": tokens, "flops": work.flops()}


def floors(jobs: list[str]) -> dict[str, float]:
    """``{"step_large": seconds, ...}``: the matmul floor of each ``work:setting`` job."""
    out = {}
    for job in jobs:
        work, setting = job.split(":")
        shape = workloads.grpo_work(setting) if work == "step" else workloads.decode_work(setting)
        out[f"{work}_{setting}"] = floor.floor_seconds(work, shape)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--work", choices=("step", "first_step", "decode", "peak", "floor"), required=True
    )
    parser.add_argument("--setting", choices=("small", "large", "tiny"), default="small")
    parser.add_argument("--steps", type=int, default=5, help="timed GRPO steps")
    parser.add_argument("--repeats", type=int, default=5, help="timed decode calls")
    parser.add_argument("--floors", nargs="*", default=[], help="work:setting, e.g. step:large")
    args = parser.parse_args(argv)
    report: dict[str, object]
    if args.work == "step":
        report = run_steps(workloads.grpo_work(args.setting), args.steps)
    elif args.work == "first_step":
        report = run_first_step(workloads.grpo_work(args.setting))
    elif args.work == "decode":
        report = run_decode(workloads.decode_work(args.setting), args.repeats)
    elif args.work == "floor":
        report = {"floor_s": floors(args.floors)}
    else:
        report = {"peak_flops": matmul_peak_flops()}
    kept = hostmem.status()  # whether XLA:CPU kept its freed buffers in this process
    report.update(
        side="rlaxkit",
        work=args.work,
        setting=args.setting,
        host_memory_kept=kept is not None and kept.kept,
    )
    print(json.dumps(report), flush=True)
    # Background compiles (the train step's optimised tier) finish before the
    # interpreter exits: XLA aborts the process if it is torn down under them.
    # ``generate``'s helper threads wait for work until the process ends.
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and thread.name != HELPER_THREAD_NAME:
            thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
