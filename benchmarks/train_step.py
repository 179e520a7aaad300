"""Train-step throughput: tokens/s and model FLOP utilisation (MFU) of the jitted RL step.

One ``TrainBatch`` of ``B`` rows x ``T`` tokens (a quarter prompt, three quarters
completion, no padding) goes through ``rlaxkit.trainer.step.make_train_step`` with the GRPO
preset (no KL, so no reference model): advantages, one forward and one backward pass of
the policy, AdamW. The step is warmed up (compiled) first; every timed step asserts that
nothing compiles.

**FLOPs counted** (model FLOPs, forward + backward = 3 x forward):

* ``6 · N · B·T`` with ``N`` the matmul weights: q, k, v, o, gate, up, down of every
  layer and the LM head (embedding lookups, norms and biases are not matmuls and are
  not counted). The LM head runs on the ``T - 1`` positions that predict a token.
* attention: ``QKᵀ`` and ``PV`` are ``2 · 2 · heads · head_dim`` FLOPs per (query, key)
  pair in the forward pass, x 3 for forward + backward, over the causal pairs only
  (``T (T + 1) / 2`` per row per layer), although the kernel computes the masked half too.

Softmaxes, norms, RoPE, the loss and the optimizer are not counted.

**Peak**: the best f32 matmul FLOP/s measured in this process (before and after the
timed steps), over square matmuls of
1024 and 2048 and the model's own MLP matmul shape ``[B·T, hidden] x [hidden, mlp]``
(taking the best keeps the MFU from being flattered by a slow reference).

**Bench model**: Qwen3-shaped, hidden 512, MLP 1536, 4 layers, 8 heads / 4 key-value
heads of width 64, vocabulary 2048; 8 rows x 256 tokens (``--quick``). At this width the
matmuls carry ~13.6M weights x 6 FLOPs per token against O(hidden) elementwise work per
token, so the step is matmul-bound the way a real model's is, while one step still takes
about a second on 2 CPU cores; a narrower model would measure the elementwise
overheads instead. Target: MFU >= 0.4.

Usage::

    python benchmarks/train_step.py --quick   # < 60 s on 2 cores
    python benchmarks/train_step.py           # hidden 1024, 16 x 512 tokens
    python benchmarks/train_step.py --quick --scan --remat full   # what they cost

``--scan`` stacks the layers under ``lax.scan`` and ``--remat`` recomputes activations
in the backward pass (``TrainConfig.remat``); the FLOPs counted stay the model's, so
the MFU falls by what the recomputation costs.

The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
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

from rlaxkit.algorithms import algorithm  # noqa: E402
from rlaxkit.data.batch import TrainBatch  # noqa: E402
from rlaxkit.models import ModelConfig, Transformer  # noqa: E402
from rlaxkit.trainer.config import OptimizerConfig, TrainConfig  # noqa: E402
from rlaxkit.trainer.state import create_train_state  # noqa: E402
from rlaxkit.trainer.step import make_train_step  # noqa: E402
from rlaxkit.util.jaxutil import count_compilations, matmul_peak_flops  # noqa: E402

TARGET_MFU = 0.4


@dataclass(frozen=True)
class Setting:
    model: ModelConfig
    rows: int
    length: int
    repeats: int
    squares: tuple[int, ...] = (1024, 2048)  # square matmuls timed for the peak


def qwen3(hidden: int, layers: int, vocab: int) -> ModelConfig:
    return ModelConfig(
        family="qwen3",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_layers=layers,
        num_heads=hidden // 64,
        num_kv_heads=hidden // 128,
    )


QUICK = Setting(model=qwen3(512, 4, 2048), rows=8, length=256, repeats=3)
FULL = Setting(model=qwen3(1024, 4, 4096), rows=16, length=512, repeats=5)
SMOKE = Setting(model=qwen3(128, 1, 256), rows=4, length=32, repeats=2, squares=(256,))


def matmul_weights(config: ModelConfig) -> tuple[int, int]:
    """``(per-layer matmul weights, LM-head weights)``."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * config.intermediate_size
    return per_layer, h * config.vocab_size


def step_flops(config: ModelConfig, rows: int, length: int) -> float:
    """Model FLOPs of one forward + backward pass (see the module docstring)."""
    per_layer, head = matmul_weights(config)
    dense = 6.0 * rows * (config.num_layers * per_layer * length + head * (length - 1))
    pairs = rows * length * (length + 1) / 2
    attention = 3 * 4.0 * config.num_layers * config.num_heads * config.head_dim * pairs
    return dense + attention


def peak_flops(
    config: ModelConfig, tokens: int, repeats: int = 5, squares: tuple[int, ...] = (1024, 2048)
) -> dict[str, float]:
    """Measured f32 matmul FLOP/s: ``squares`` and the model's MLP shape."""
    out = {f"square_{n}": matmul_peak_flops(n, repeats) for n in squares}
    a = jnp.ones((tokens, config.hidden_size), jnp.float32)
    b = jnp.ones((config.hidden_size, config.intermediate_size), jnp.float32)
    f = jax.jit(jnp.dot)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    out["model_mlp_shape"] = 2.0 * tokens * config.hidden_size * config.intermediate_size / best
    return out


def make_batch(config: ModelConfig, rows: int, length: int, seed: int) -> TrainBatch:
    """``rows`` full-length sequences: a quarter prompt, the rest completion."""
    rng = np.random.RandomState(seed)
    prompt = length // 4
    loss_mask = np.zeros((rows, length), np.float32)
    loss_mask[:, prompt:] = 1.0
    return TrainBatch(
        tokens=rng.randint(0, config.vocab_size, (rows, length)).astype(np.int32),
        attention_mask=np.ones((rows, length), bool),
        loss_mask=loss_mask,
        behaviour_logprobs=(-np.log(config.vocab_size) * loss_mask).astype(np.float32),
        versions=np.where(loss_mask > 0, 0, -1).astype(np.int32),
        rewards=rng.rand(rows).astype(np.float32),
        group_ids=(np.arange(rows) // 4).astype(np.int32),
        sequence_mask=np.ones((rows,), bool),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="hidden 512, < 60 s")
    parser.add_argument("--smoke", action="store_true", help="tiny model (tests only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scan", action="store_true", help="scan over stacked layers")
    parser.add_argument("--remat", choices=("none", "dots", "full"), default="none")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]  # the machine may be shared: say how busy it was
    setting = SMOKE if args.smoke else QUICK if args.quick else FULL
    config, rows, length = (
        setting.model.replace(scan_layers=args.scan),
        setting.rows,
        setting.length,
    )
    print(f"devices: {jax.devices()}")
    print(f"model: {config}")
    model = Transformer(config, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model)
    train_config = TrainConfig(
        algorithm=algorithm("grpo", loss={"kl_coef": 0.0}),
        optimizer=OptimizerConfig(learning_rate=1e-5),
        remat=args.remat,
    )
    state = create_train_state(train_config, params, seed=args.seed)
    train_step = make_train_step(train_config, graphdef)
    batches = [make_batch(config, rows, length, args.seed + i) for i in range(2)]

    # The peak is measured before and after the timed steps and the better one kept, so
    # a machine that gets busier (or quieter) mid-run does not flatter the MFU.
    peaks = peak_flops(config, rows * length, squares=setting.squares)
    start = time.perf_counter()
    state, _ = train_step(state, batches[0])  # warm-up: compiles
    jax.block_until_ready(state)
    compile_s = time.perf_counter() - start
    times = []
    for i in range(setting.repeats):
        with count_compilations() as compiles:
            start = time.perf_counter()
            state, metrics = train_step(state, batches[i % 2])
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - start)
        if compiles.count:
            raise RuntimeError(f"timed step {i} compiled {compiles.count} programs")
    step_s = float(np.median(times))
    after = peak_flops(config, rows * length, squares=setting.squares)
    peaks = {k: max(v, after[k]) for k, v in peaks.items()}
    peak = max(peaks.values())
    flops = step_flops(config, rows, length)
    tokens = rows * length
    report = {
        "quick": args.quick,
        "smoke": args.smoke,
        "scan": args.scan,
        "remat": args.remat,
        "rows": rows,
        "length": length,
        "params": config.num_params(),
        "matmul_params": sum(
            (config.num_layers * matmul_weights(config)[0], matmul_weights(config)[1])
        ),
        "first_step_s": compile_s,
        "step_s": step_s,
        "step_min_s": min(times),
        "tokens_per_s": tokens / step_s,
        "model_flops_per_step": flops,
        "flops_per_s": flops / step_s,
        "peak_flops": peak,
        "peak_flops_by_shape": peaks,
        "mfu": flops / step_s / peak,
        "target_mfu": TARGET_MFU,
        "loss_finite": bool(np.isfinite(float(metrics["loss"]))),
    }
    print(f"\n{rows} x {length} tokens, {config.num_params() / 1e6:.1f}M params")
    print(f"first step (compile + run) {compile_s:.1f} s; median step {step_s:.3f} s")
    print(f"tokens/s {report['tokens_per_s']:.0f}")
    print(
        f"model FLOP/s {flops / step_s / 1e9:.1f} G; matmul peak {peak / 1e9:.1f} G "
        f"({', '.join(f'{k} {v / 1e9:.1f}' for k, v in peaks.items())}); "
        f"MFU {report['mfu']:.2f} (target >= {TARGET_MFU})"
    )
    report["load_average_1m"] = [load_before, os.getloadavg()[0]]
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
