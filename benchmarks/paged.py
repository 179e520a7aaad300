"""The paged KV cache against the dense one: rows per TPU worker, decode throughput,
shared prompt pages, and CPU tokens/s.

1. **Rows per worker** (QwQ-32B, Qwen2.5-32B's shape: 64 layers, 40 query and 8 KV heads
   of 128, bf16) on a worker of the RLAX plan (``configs/plan/qwq32b_v5p_1024.yaml``: 8
   v5p chips), tensor-parallel (per chip: 5 query and 1 KV heads, an eighth of the MLP):
   the TPU compiler (libtpu, compile-only ``v5p:2x2x1`` devices) compiles one layer's
   decode step of one chip and its memory analysis gives the cache bytes per token and
   the step's scratch; the weights are the model's parameters over the worker's chips. A
   dense row reserves 32k slots; paged rows hold the pages of their lengths: a 512-token
   prompt and a lognormal completion (median 4096, p99 at the 32k cap, capped there)
   (``rlaxkit.inference.capacity.rows_per_worker``).
2. **Decode tokens/s per chip**: the compiler's estimated step time (``optimal_seconds``)
   at the row counts that fit in the same HBM, 64 times one layer's step. The dense step
   reads every row's 32k slots; the paged kernel reads each row's pages only, which the
   estimate takes as the dense step over the rows' mean page-rounded length (the Pallas
   kernel is a custom call without a cost model in XLA, so its own estimate would be
   empty). ``--quick`` compiles at 8 rows and extrapolates linearly in rows x slots.
3. **Prompt cache bytes, shared over unshared**, groups of 8 samples, prompts drawn from a
   lognormal (median ``--prompt-median`` tokens), through the engine's page allocator
   (``rlaxkit.inference.page_table.RowPages``): full prompt pages held once, the last,
   partly filled one copied for each sample.
4. **CPU tokens/s**, dense and paged engines, same requests in one run (same tokens).

Usage::

    python benchmarks/paged.py --quick   # < 60 s
    python benchmarks/paged.py

The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from decode import QUICK, random_model  # noqa: E402
from flax import nnx  # noqa: E402

from rlaxkit.inference import InferenceEngine, SamplingConfig  # noqa: E402
from rlaxkit.inference.capacity import rows_per_worker  # noqa: E402
from rlaxkit.inference.page_table import RowPages  # noqa: E402
from rlaxkit.models import KVCache, ModelConfig, abstract_model  # noqa: E402
from rlaxkit.planning import load_plan_config  # noqa: E402
from rlaxkit.planning.specs import MODEL_PRESETS  # noqa: E402
from rlaxkit.util.jaxutil import count_compilations  # noqa: E402

# QwQ-32B (Qwen2.5-32B's dimensions), as the planner knows it, in bfloat16.
QWQ_32B = dataclasses.replace(MODEL_PRESETS["qwq-32b"], param_dtype="bfloat16")
# A v5p worker of the RLAX plan, tensor-parallel over its chips.
ROOT = Path(__file__).resolve().parents[1]
CHIPS = load_plan_config(ROOT / "configs/plan/qwq32b_v5p_1024.yaml").sampler_chips
HBM_BYTES = 95e9  # v5p HBM per chip
MAX_TOKENS = 32 * 1024  # context of a dense row (prompt + completion)
PROMPT_TOKENS = 512
COMPLETION_MEDIAN = 4096  # lognormal completion lengths, p99 at MAX_TOKENS, capped there
TPU_PAGE_SIZE = 64


def lognormal(generator, median, p99, count, cap):
    sigma = math.log(p99 / median) / 2.3263478740408408  # z of the 99th percentile
    return np.minimum(np.exp(generator.normal(math.log(median), sigma, count)), cap)


def chip_layer(config: ModelConfig) -> ModelConfig:
    """One layer of one chip's tensor-parallel shard (the vocabulary left out)."""
    return ModelConfig(
        family=config.family,
        vocab_size=128,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size // CHIPS,
        num_layers=1,
        num_heads=config.num_heads // CHIPS,
        num_kv_heads=config.num_kv_heads // CHIPS,
        head_dim=config.head_dim,
        param_dtype=config.param_dtype,
    )


def compile_layer_step(device, layer: ModelConfig, rows: int, slots: int):
    """The TPU compile of one layer's decode step over a dense cache of ``rows x slots``."""
    sharding = jax.sharding.SingleDeviceSharding(device)

    def on(tree):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree
        )

    graphdef, params = nnx.split(abstract_model(layer))

    def step(params, cache, tokens):
        return nnx.merge(graphdef, params).decode(tokens, cache.end[:, None], cache)

    cache = on(jax.eval_shape(lambda: KVCache.zeros(layer, rows, slots)))
    tokens = on(jax.ShapeDtypeStruct((rows, 1), jnp.int32))
    with jax.default_device(device):
        return jax.jit(step, donate_argnums=1).lower(on(params), cache, tokens).compile()


def tpu_figures(quick: bool, generator) -> dict[str, float]:
    from jax.experimental import topologies

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices[0]
    layer = chip_layer(QWQ_32B)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(abstract_model(QWQ_32B))))
    weight_bytes = params * 2 / CHIPS
    probe_rows = 8
    dense_probe = compile_layer_step(device, layer, probe_rows, MAX_TOKENS)
    memory = dense_probe.memory_analysis()
    layer_kv_bytes = 2 * probe_rows * MAX_TOKENS * layer.num_kv_heads * layer.head_dim * 2
    layer_weight_bytes = memory.argument_size_in_bytes - layer_kv_bytes - probe_rows * 4
    kv_bytes_per_token = QWQ_32B.num_layers * layer_kv_bytes / (probe_rows * MAX_TOKENS)
    free = HBM_BYTES - weight_bytes - memory.temp_size_in_bytes
    completions = lognormal(generator, COMPLETION_MEDIAN, MAX_TOKENS, 4096, MAX_TOKENS)
    lengths = np.minimum(PROMPT_TOKENS + completions, MAX_TOKENS).astype(int)
    dense_rows, paged_rows = rows_per_worker(
        free_bytes=free,
        kv_bytes_per_token=kv_bytes_per_token,
        context_tokens=MAX_TOKENS,
        row_tokens=lengths.tolist(),
        page_size=TPU_PAGE_SIZE,
    )
    live = int(np.mean(np.ceil(lengths / TPU_PAGE_SIZE) * TPU_PAGE_SIZE))
    live = TPU_PAGE_SIZE * -(-live // TPU_PAGE_SIZE)

    def seconds(compiled):
        return float(compiled.cost_analysis()["optimal_seconds"])

    if quick:  # t(rows, slots) = fixed + per_slot * rows * slots, from two compiles at 8 rows
        short = compile_layer_step(device, layer, probe_rows, live)
        per_slot = (seconds(dense_probe) - seconds(short)) / (probe_rows * (MAX_TOKENS - live))
        fixed = seconds(short) - per_slot * probe_rows * live
        dense_s = fixed + per_slot * dense_rows * MAX_TOKENS
        paged_s = fixed + per_slot * paged_rows * live
    else:
        dense_s = seconds(compile_layer_step(device, layer, dense_rows, MAX_TOKENS))
        paged_s = seconds(compile_layer_step(device, layer, paged_rows, live))
    dense_step, paged_step = QWQ_32B.num_layers * dense_s, QWQ_32B.num_layers * paged_s
    print(
        f"QwQ-32B on {CHIPS} v5p chips: weights {weight_bytes / 1e9:.1f} GB/chip, KV "
        f"{kv_bytes_per_token / 1e3:.1f} KB/token/chip, layer weights (compiler) "
        f"{layer_weight_bytes / 1e6:.0f} MB, scratch {memory.temp_size_in_bytes / 1e6:.0f} MB; "
        f"{free / 1e9:.1f} GB/chip for the cache"
    )
    print(
        f"  dense {dense_rows} rows x {MAX_TOKENS} slots: step {dense_step * 1e3:.1f} ms; "
        f"paged {paged_rows} rows, mean {live} slots: step {paged_step * 1e3:.1f} ms"
    )
    dense_tps, paged_tps = dense_rows / dense_step / CHIPS, paged_rows / paged_step / CHIPS
    return {
        "dense_rows_per_worker": dense_rows,
        "paged_rows_per_worker": paged_rows,
        "rows_per_worker_paged_over_dense": paged_rows / dense_rows,
        "kv_bytes_per_token_per_chip": kv_bytes_per_token,
        "dense_decode_step_s": dense_step,
        "paged_decode_step_s": paged_step,
        "dense_decode_tokens_per_s_per_chip": dense_tps,
        "paged_decode_tokens_per_s_per_chip": paged_tps,
        "decode_tokens_per_s_per_chip_paged_over_dense": paged_tps / dense_tps,
        "mean_row_tokens": float(lengths.mean()),
    }


def prompt_sharing(generator, median: int, group: int = 8, page_size: int = 16) -> float:
    """Pages the engine's allocator holds for groups' prompts, shared over unshared."""
    prompts = np.maximum(lognormal(generator, median, 4 * median, 256, 8 * median), 2)
    totals = []
    for share in (True, False):
        held = 0
        for length in prompts.astype(int).tolist():
            pages = RowPages(
                group, page_size * -(-length // page_size), 1 + group * 4096, page_size
            )
            for row in range(group):
                pages.start(row, length, length - 1, 0 if share and row else None)
            held += pages.pool.used_pages
        totals.append(held)
    return totals[0] / totals[1]


def cpu_tokens_per_s(quick: bool, seed: int) -> dict[str, float]:
    """Dense and paged engines on the benchmark's small model, the same requests."""
    model_config = QUICK.model
    model = random_model(model_config, seed)
    rng = np.random.RandomState(seed)
    new_tokens, count, slots = (128, 16, 8) if quick else (512, 48, 16)
    config = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens, n=2)
    requests = [
        (
            rng.randint(0, model_config.vocab_size, rng.randint(8, 48)).tolist(),
            jax.random.key(int(rng.randint(0, 2**31 - 1))),
            int(min(new_tokens, 1 + rng.lognormal(math.log(new_tokens / 4), 0.8))),
        )
        for _ in range(count)
    ]

    def run(options):
        engine = InferenceEngine(
            model, config, num_slots=slots, max_prompt_len=64, chunk_steps=16, **options
        )
        for prompt, key, budget in requests:
            engine.submit(prompt, key, max_new_tokens=budget)
        return engine.run()

    sides = {"dense": {}, "paged": {"kv_cache": "paged", "page_size": 16}}
    best, tokens = {}, {}
    for options in sides.values():
        run(options)  # compiles
    for _ in range(1 if quick else 3):
        for name, options in sides.items():
            with count_compilations() as compiles:
                start = time.perf_counter()
                done = run(options)
                seconds = time.perf_counter() - start
            assert compiles.count == 0, f"{name}: a timed run compiled {compiles.count} programs"
            best[name] = min(best.get(name, math.inf), seconds)
            tokens[name] = [c.tokens.tolist() for c in done]
    if tokens["dense"] != tokens["paged"]:
        raise AssertionError("the paged engine sampled other tokens than the dense one")
    total = sum(len(t) for t in tokens["dense"])
    out = {f"cpu_{name}_tokens_per_s": total / best[name] for name in sides}
    out["cpu_tokens_per_s_paged_over_dense"] = best["dense"] / best["paged"]
    print(
        f"CPU, {count} requests x 2 samples, {slots} rows: dense "
        f"{out['cpu_dense_tokens_per_s']:.0f} tokens/s, paged "
        f"{out['cpu_paged_tokens_per_s']:.0f} tokens/s"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="< 60 s")
    parser.add_argument("--prompt-median", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    generator = np.random.default_rng(args.seed)
    report: dict[str, object] = {"quick": args.quick}
    report.update(tpu_figures(args.quick, generator))
    for median in sorted({256, args.prompt_median}):
        ratio = prompt_sharing(generator, median)
        print(f"prompt cache, groups of 8, prompts of median {median}: shared/unshared {ratio:.3f}")
        report[f"prompt_cache_bytes_shared_over_unshared_median_{median}"] = ratio
    report["prompt_cache_bytes_shared_over_unshared"] = report[
        f"prompt_cache_bytes_shared_over_unshared_median_{args.prompt_median}"
    ]
    report.update(cpu_tokens_per_s(args.quick, args.seed))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
