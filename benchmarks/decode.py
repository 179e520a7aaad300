"""Decode throughput: full recomputation vs KV cache, static vs continuous batching.

All numbers come from one run on one machine, in float32, after a warm-up that compiles
every program (the timed passes assert that nothing compiles):

1. ``kv_vs_recompute``: one batch of ``B`` ragged prompts, every row generating exactly
   ``--new-tokens`` (128) tokens, sampled at temperature 1, once with the KV-cache
   sampler (``rlaxkit.inference.generate``) and once by full recomputation
   (``generate_by_recompute``: the training forward over the sequence so far at every
   step, widths bucketed to powers of two). Ratio of tokens/s; the goal is >= 5.
2. ``continuous_vs_static``: 128 and 256 requests (512 and 1024 without ``--quick``)
   at the two batch sizes, whose response lengths
   follow a long-tailed law (Pareto, shape 1.2, scale 6 tokens, capped at 128: median
   ~10, mean ~20, a few rows run to the cap). The random model never emits a stop token
   on purpose, so a request's length is set by its ``max_new_tokens`` budget drawn from
   that law. Static batching runs them ``B`` at a time with ``generate`` (each batch
   waits for its longest row); continuous batching runs them through an
   ``InferenceEngine`` with ``B`` slots. Ratio of tokens/s; the goal is >= 1.5. Both run
   one program at a time (``generate(..., chunks=1)``): the ratio is the batching's.
   ``continuous_vs_static_side_by_side`` sets the engine against ``generate``'s default,
   whose batches decode side by side on a CPU's cores, which the engine does not do.
3. ``mfu``: model FLOPs of the continuous-batching run at the larger batch size (every
   prompt and generated token's forward pass: ``2 * matmul params`` plus attention
   ``4 * layers * heads * head_dim * context`` per token; padding and idle rows do not
   count) per second, over ``matmul_peak_flops()`` measured in the same run.

Usage::

    python benchmarks/decode.py --quick    # small model, batch sizes 8 and 32; < 60 s
    python benchmarks/decode.py            # larger model, batch sizes 16 and 64

The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rlaxkit.inference import (  # noqa: E402
    InferenceEngine,
    SamplingConfig,
    bucket_length,
    generate,
    generate_by_recompute,
)
from rlaxkit.models import ModelConfig, abstract_model  # noqa: E402
from rlaxkit.util.jaxutil import count_compilations, matmul_peak_flops  # noqa: E402

GOAL_KV_VS_RECOMPUTE = 5.0
GOAL_CONTINUOUS_VS_STATIC = 1.5
PARETO_SHAPE, PARETO_SCALE_TOKENS = 1.2, 6.0
PROMPT_TOKENS = (8, 48)  # prompt lengths drawn uniformly in this range


@dataclass(frozen=True)
class Setting:
    model: ModelConfig
    batch_sizes: tuple[int, int]
    requests: tuple[int, int]  # long-tail requests at each batch size


QUICK = Setting(
    model=ModelConfig(
        family="qwen3",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
    ),
    batch_sizes=(8, 32),
    requests=(128, 256),
)
FULL = Setting(
    model=ModelConfig(
        family="qwen3",
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
    ),
    batch_sizes=(16, 64),
    requests=(512, 1024),
)


def random_model(config: ModelConfig, seed: int = 0):
    """A model with N(0, 0.02^2) weights (unit norm scales), filled from numpy."""
    model = abstract_model(config)
    rng = np.random.RandomState(seed)
    flat = [
        (path, (1.0 if "norm" in str(path[-2]) else 0.0) + 0.02 * rng.standard_normal(x.shape))
        for path, x in nnx.to_flat_state(nnx.state(model, nnx.Param))
    ]
    nnx.update(model, nnx.from_flat_state([(p, jnp.asarray(v, jnp.float32)) for p, v in flat]))
    return model


def token_flops(config: ModelConfig, context: np.ndarray) -> float:
    """Forward FLOPs of tokens seeing ``context`` tokens each (matmuls + attention)."""
    h, d = config.hidden_size, config.head_dim
    per_layer = (
        h * config.num_heads * d * 2  # q and o projections
        + h * config.num_kv_heads * d * 2  # k and v projections
        + 3 * h * config.intermediate_size  # SwiGLU
    )
    matmul_params = config.num_layers * per_layer + h * config.vocab_size
    attention = 4 * config.num_layers * config.num_heads * d * context.astype(np.float64)
    return float(np.sum(2 * matmul_params + attention))


def workload_flops(config: ModelConfig, prompts, lengths) -> float:
    """FLOPs of prefilling every prompt and generating ``lengths`` tokens after it."""
    total = 0.0
    for prompt, length in zip(prompts, lengths, strict=True):
        total += token_flops(config, np.arange(1, len(prompt) + length + 1))
    return total


def long_tailed_budgets(count: int, cap: int, rng: np.random.RandomState) -> list[int]:
    lengths = PARETO_SCALE_TOKENS * (1 + rng.pareto(PARETO_SHAPE, count))
    return np.minimum(lengths, cap).astype(int).tolist()


def timed(fn, *args, repeats: int = 1, **kwargs):
    """``(result, seconds)``: the best of ``repeats`` calls, none of which may compile."""
    best = float("inf")
    for _ in range(repeats):
        with count_compilations() as compiles:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            best = min(best, time.perf_counter() - start)
        if compiles.count:
            raise RuntimeError(f"{fn.__name__} compiled {compiles.count} programs when timed")
    return out, best


def run_static(model, prompts, keys, budgets, config, batch, chunks=1):
    """``generate`` on consecutive groups of ``batch`` requests; total tokens.

    ``chunks=1``: each group decodes as one batch, one program at a time, as the
    continuous engine does; ``None``: as ``generate`` does by default (side by side on
    a CPU's cores)."""
    tokens = 0
    for i in range(0, len(prompts), batch):
        result = generate(
            model,
            prompts[i : i + batch],
            config,
            keys[i : i + batch],
            max_new_tokens=budgets[i : i + batch],
            chunks=chunks,
        )
        tokens += int(result.lengths.sum())
    return tokens


def run_continuous(model, prompts, keys, budgets, config, batch, prompt_width):
    engine = InferenceEngine(model, config, num_slots=batch, max_prompt_len=prompt_width)
    for prompt, key, budget in zip(prompts, keys, budgets, strict=True):
        engine.submit(prompt, key, max_new_tokens=budget)
    return sum(c.num_tokens for c in engine.run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, < 60 s")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    setting = QUICK if args.quick else FULL
    rng = np.random.RandomState(args.seed)
    model = random_model(setting.model, args.seed)
    config = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens)
    prompt_width = PROMPT_TOKENS[1]
    peak = matmul_peak_flops()
    print(f"devices: {jax.devices()}  matmul peak: {peak / 1e9:.1f} GFLOP/s")
    print(f"model: {setting.model}")
    report: dict[str, object] = {"peak_flops": peak, "quick": args.quick}

    def draw(count):
        prompts = [
            rng.randint(0, setting.model.vocab_size, rng.randint(*PROMPT_TOKENS)).tolist()
            for _ in range(count)
        ]
        keys = [jax.random.key(int(k)) for k in rng.randint(0, 2**31 - 1, count)]
        return prompts, keys

    print(f"\n{'batch':>5} {'method':<28} {'tokens':>7} {'seconds':>8} {'tokens/s':>10}")
    ratios_kv, ratios_cont, ratios_side = [], [], []
    for batch, count in zip(setting.batch_sizes, setting.requests, strict=True):
        # 1. KV cache vs recomputation, every row generating exactly new_tokens tokens.
        prompts, keys = draw(batch)
        fixed = [args.new_tokens] * batch
        # One batch a call (``chunks=1``), as the recompute sampler runs: the ratio is the
        # cache's, not ``generate``'s batches side by side.
        kv_call = functools.partial(generate, chunks=1)
        kv_call(model, prompts, config, keys, max_new_tokens=fixed)  # warm-up: compile
        # The recompute sampler compiles one program per width it passes through (64,
        # 128, 192 here); prompts filling the 64-token bucket pass through all of them in
        # 66 steps instead of 128.
        width = bucket_length(max(len(p) for p in prompts))
        long_prompts = [p * (width // len(p) + 1) for p in prompts]
        long_prompts = [p[:width] for p in long_prompts]
        generate_by_recompute(model, long_prompts, config, keys, max_new_tokens=width + 2)
        kv, kv_s = timed(kv_call, model, prompts, config, keys, max_new_tokens=fixed, repeats=3)
        re, re_s = timed(generate_by_recompute, model, prompts, config, keys, max_new_tokens=fixed)
        assert (kv.lengths == args.new_tokens).all() and (re.lengths == args.new_tokens).all()
        n = batch * args.new_tokens
        for name, s in (("recompute", re_s), ("kv_cache", kv_s)):
            label = f"{name} ({args.new_tokens} new)"
            print(f"{batch:>5} {label:<28} {n:>7} {s:>8.3f} {n / s:>10.0f}")
            report[f"b{batch}_{name}_tokens_per_s"] = n / s
        ratios_kv.append(re_s / kv_s)

        # 2. Static vs continuous batching under long-tailed lengths.
        prompts, keys = draw(count)
        budgets = long_tailed_budgets(count, args.new_tokens, rng)
        work = (prompts, keys, budgets, config, batch)
        run_static(model, *work)  # warm-up (compiles)
        run_static(model, *work, chunks=None)
        run_continuous(model, *work, prompt_width)
        static_tokens, static_s = timed(run_static, model, *work, repeats=3)
        _, side_s = timed(run_static, model, *work, chunks=None)
        cont_tokens, cont_s = timed(run_continuous, model, *work, prompt_width, repeats=3)
        assert static_tokens == cont_tokens == sum(budgets)
        for name, tokens, s in (
            ("static", static_tokens, static_s),
            ("static_side_by_side", static_tokens, side_s),
            ("continuous", cont_tokens, cont_s),
        ):
            label = f"{name} (long tail, {count} req)"
            print(f"{batch:>5} {label:<28} {tokens:>7} {s:>8.3f} {tokens / s:>10.0f}")
            report[f"b{batch}_{name}_tokens_per_s"] = tokens / s
        ratios_cont.append(static_s / cont_s)
        ratios_side.append(side_s / cont_s)
        flops = workload_flops(setting.model, prompts, budgets)
        report[f"b{batch}_continuous_flops_per_s"] = flops / cont_s
        report[f"b{batch}_continuous_mfu"] = flops / cont_s / peak

    big = setting.batch_sizes[-1]
    report["kv_vs_recompute"] = min(ratios_kv)
    report["continuous_vs_static"] = min(ratios_cont)
    report["continuous_vs_static_side_by_side"] = min(ratios_side)
    report["mfu"] = report[f"b{big}_continuous_mfu"]
    report["budgets_median_mean_max"] = [
        float(np.median(budgets)),
        float(np.mean(budgets)),
        max(budgets),
    ]
    print(
        f"\nkv_vs_recompute (worse batch size): {report['kv_vs_recompute']:.1f}x "
        f"(goal >= {GOAL_KV_VS_RECOMPUTE}); continuous_vs_static: "
        f"{report['continuous_vs_static']:.2f}x (goal >= {GOAL_CONTINUOUS_VS_STATIC}); "
        f"MFU (continuous, batch {big}): {report['mfu']:.2%}; against static batches "
        f"decoding side by side: {report['continuous_vs_static_side_by_side']:.2f}x"
    )
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
