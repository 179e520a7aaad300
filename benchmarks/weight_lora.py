"""LoRA publication: the bytes an adapter version moves, and decode with merged weights
against the adapters applied as an extra low-rank matmul.

The bench model is ``weight_delta``'s (Qwen3-shaped, vocabulary 4096; ``--quick``: 2
layers of width 128, ~6 MB of float32) with rank-8 adapters (alpha 16) on all seven
projections, ``B`` drawn non-zero as after some training. Reported:

- ``lora_push_bytes_fraction``: bytes of an adapter version's push through
  :class:`rlaxkit.param_server.AdapterParameterServer` (the adapters and a short JSON
  ``meta``) ÷ bytes of a full push of the merged weights. The first push, which stores
  the base once, is ``lora_base_push_bytes_fraction``. Also a timed sync through the
  TensorStore store (a reader in a second store object, as another process): median
  push + pull seconds of adapter versions against full versions (``lora_sync_speedup``;
  an adapter pull includes merging into the held base, jitted).
- ``lora_decode_unmerged_vs_merged``: decode tokens/s (``rlaxkit.inference.generate``,
  KV cache, ``B`` rows sampling ``N`` new tokens each) with the adapters applied at
  every projection as ``x @ W + (x @ A) @ (s·B)`` (each targeted ``nnx.Linear``
  wrapped in ``nnx.LoRA`` around it, built here only) ÷ tokens/s with
  ``W + s·A @ B`` merged into the kernels, best of ``--repeats`` timed passes each,
  none of which compiles. Both sample the same tokens up to float rounding.
- ``lora_push_bytes_fraction_qwen2_5_0_5b``: the push fraction from the config of
  Qwen2.5-0.5B (float32 weights; no weights built). Adapters are ``r·(in + out)`` of a kernel's
  ``in·out`` values, about ``2r / hidden`` of it: the bench model's width of 128 puts
  rank 8 near 3%, a real model's width far lower.

The unmerged path lives in this benchmark, not in the model: a worker merges once per
pulled version (milliseconds), and every decode step then pays nothing, while the extra
matmuls cost every step (see docs/performance.md for the figure).

Run alone with ``python benchmarks/weight_lora.py [--quick]``; ``weight_sync.py`` runs
it too. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import weight_delta  # noqa: E402
from flax import nnx  # noqa: E402

from rlaxkit.inference import SamplingConfig, generate  # noqa: E402
from rlaxkit.models import ModelConfig, abstract_model  # noqa: E402
from rlaxkit.models.lora import LoraConfig, adapter_shapes, merge_adapters  # noqa: E402
from rlaxkit.param_server import (  # noqa: E402
    AdapterParameterServer,
    TensorStoreParameterServer,
    tree_nbytes,
)
from rlaxkit.util.jaxutil import count_compilations  # noqa: E402

LORA = LoraConfig(rank=8, alpha=16.0)
GOAL_PUSH_BYTES_FRACTION = 0.02
REAL_MODEL = "qwen2.5-0.5b"  # The smallest preset: the largest adapter fraction of them.
HEADLINE = (  # The keys weight_sync.py copies to its top level.
    "lora_push_bytes_fraction",
    "lora_push_bytes_fraction_qwen2_5_0_5b",
    "lora_base_push_bytes_fraction",
    "lora_sync_speedup",
    "lora_decode_unmerged_vs_merged",
)


def lora_model(quick: bool, seed: int = 0) -> tuple[Any, Any, Any]:
    """``(graphdef, base params, adapters)``: the bench model, per-layer (unscanned), with
    N(0, 0.02²) weights, and rank-8 adapters with ``A`` as ``init_adapters`` draws it
    and ``B`` N(0, 0.01²), as after some training; all drawn with numpy (an eager
    ``nnx`` initialisation takes seconds on two busy cores)."""
    config = weight_delta.model_config(quick).replace(scan_layers=False)
    model = abstract_model(config)
    rng = np.random.RandomState(seed)
    flat = [
        (path, (1.0 if "norm" in str(path[-2]) else 0.0) + 0.02 * rng.standard_normal(x.shape))
        for path, x in nnx.to_flat_state(nnx.state(model, nnx.Param))
    ]
    nnx.update(model, nnx.from_flat_state([(p, jnp.asarray(v, jnp.float32)) for p, v in flat]))
    graphdef, params = nnx.split(model)
    leaves = []
    for path, shape in adapter_shapes(params, LORA):
        if path[-1] == "lora_a":
            bound = 1.0 / np.sqrt(shape[-2])
            value = rng.uniform(-bound, bound, shape)
        else:
            value = 0.01 * rng.standard_normal(shape)
        leaves.append((path, nnx.LoRAParam(jnp.asarray(value, jnp.float32))))
    return graphdef, params, nnx.from_flat_state(leaves)


def time_sync(root: Path, params: Any, versions: list[Any], lora: bool) -> dict[str, Any]:
    """Median push and pull seconds of ``versions`` (adapters, or merged weights) pushed
    one after another through the TensorStore store, each pulled by a second client."""
    writer: Any = TensorStoreParameterServer(root, keep=2)
    reader: Any = TensorStoreParameterServer(root)
    if lora:
        writer, reader = AdapterParameterServer(writer, lora=LORA), AdapterParameterServer(reader)
        writer.publish_base(params)
    pushes, pulls, push_bytes = [], [], []
    for version, tree in enumerate(versions):
        start = time.perf_counter()
        writer.push(version, tree)
        pushed_at = time.perf_counter()
        got, pulled = reader.pull(min_version=version, timeout=60)
        jax.block_until_ready(pulled)
        weight_delta.touch_pages(pulled)
        assert got == version
        if version >= 2:  # the base, and the spare directory's files, written once
            pushes.append(pushed_at - start)
            pulls.append(time.perf_counter() - pushed_at)
        push_bytes.append(
            writer.stats.last("push").bytes if lora else tree_nbytes(jax.device_get(tree))
        )
        del pulled
    return {
        "push_s": statistics.median(pushes),
        "pull_s": statistics.median(pulls),
        "first_push_bytes": push_bytes[0],
        "push_bytes": statistics.median(push_bytes[1:]),
    }


def measure_push(model: tuple[Any, Any, Any], root: Path, rounds: int) -> dict[str, Any]:
    """Bytes and seconds of adapter versions against full versions (module docstring)."""
    _, params, adapters = model
    merge = jax.jit(lambda base, a: merge_adapters(base, a, LORA))
    # Each version's adapters a little apart, so no store can skip an unchanged one.
    adapter_versions = [
        jax.tree.map(lambda x, i=i: x + 1e-3 * i, adapters) for i in range(rounds + 2)
    ]
    full_versions = [merge(params, a) for a in adapter_versions]
    full_bytes = tree_nbytes(params)
    lora_sync = time_sync(root / "lora", params, adapter_versions, lora=True)
    full_sync = time_sync(root / "full", params, full_versions, lora=False)
    return {
        "model_bytes": full_bytes,
        "adapter_bytes": tree_nbytes(adapters),
        "lora_rank": LORA.rank,
        "lora_targets": list(LORA.targets),
        "lora_sync": lora_sync,
        "full_sync": full_sync,
        "lora_push_bytes_fraction": lora_sync["push_bytes"] / full_bytes,
        "lora_base_push_bytes_fraction": lora_sync["first_push_bytes"] / full_bytes,
        "lora_sync_speedup": (full_sync["push_s"] + full_sync["pull_s"])
        / (lora_sync["push_s"] + lora_sync["pull_s"]),
        "goal_lora_push_bytes_fraction": GOAL_PUSH_BYTES_FRACTION,
    }


def unmerged_model(graphdef: Any, params: Any, adapters: Any) -> nnx.Module:
    """The base model with every adapted ``nnx.Linear`` wrapped in ``nnx.LoRA``:
    ``linear(x) + (x @ A) @ (s·B)`` at every call (the scale folded into ``B``)."""
    model = nnx.merge(graphdef, params)
    for path, leaf in nnx.to_flat_state(adapters):
        *module_path, which = (getattr(k, "key", k) for k in path)
        if which != "lora_a":
            continue
        parent = model
        for key in module_path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        linear = getattr(parent, module_path[-1])
        b = _at(adapters, (*module_path, "lora_b"))
        wrapped = nnx.LoRA(
            leaf.shape[-2],
            LORA.rank,
            b.shape[-1],
            base_module=linear,
            rngs=nnx.Rngs(0),
        )
        wrapped.lora_a[...] = leaf[...]
        wrapped.lora_b[...] = LORA.scale * b
        setattr(parent, module_path[-1], wrapped)
    return model


def _at(state: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        state = state[key]
    return state[...]


def measure_decode(model: tuple[Any, Any, Any], quick: bool, repeats: int) -> dict[str, Any]:
    """Decode tokens/s, adapters merged against applied as extra matmuls; the two are
    timed in turn, best of ``repeats`` each (the machine may be shared)."""
    graphdef, params, adapters = model
    models = {
        "merged": nnx.merge(graphdef, merge_adapters(params, adapters, LORA)),
        "unmerged": unmerged_model(graphdef, params, adapters),
    }
    rows, new_tokens = (8, 64) if quick else (16, 128)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(1, weight_delta.VOCAB, 12).tolist() for _ in range(rows)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens, stop_tokens=())
    keys = [jax.random.key(i) for i in range(rows)]
    out: dict[str, Any] = {"decode_rows": rows, "decode_new_tokens": new_tokens}
    results = {name: generate(m, prompts, sampling, keys) for name, m in models.items()}
    best = dict.fromkeys(models, float("inf"))
    for _ in range(repeats):
        for name, m in models.items():
            with count_compilations() as compiles:
                start = time.perf_counter()
                jax.block_until_ready(generate(m, prompts, sampling, keys).tokens)
                best[name] = min(best[name], time.perf_counter() - start)
            if compiles.count:
                raise RuntimeError(f"{name} decode compiled {compiles.count} programs when timed")
    for name, result in results.items():
        out[f"decode_{name}_tokens_per_s"] = int(np.asarray(result.lengths).sum()) / best[name]
    same = np.asarray(results["merged"].tokens) == np.asarray(results["unmerged"].tokens)
    out["decode_same_tokens_fraction"] = float(np.mean(same))
    out["lora_decode_unmerged_vs_merged"] = (
        out["decode_unmerged_tokens_per_s"] / out["decode_merged_tokens_per_s"]
    )
    return out


def adapter_params(config: ModelConfig, rank: int) -> int:
    """Adapter values of rank ``rank`` on all seven projections: ``r · (in + out)`` per
    kernel per layer (``measure`` checks it against ``adapter_shapes``)."""
    h, m = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + m) + (m + h)
    return config.num_layers * rank * per_layer


def real_model_fraction(name: str) -> float:
    """Adapter bytes ÷ weight bytes of the preset ``name`` (arithmetic on its config; an
    adapter push moves these bytes and a ``meta`` of under 200)."""
    from rlaxkit.planning import MODEL_PRESETS

    config = MODEL_PRESETS[name]
    weight_bytes = config.num_params() * np.dtype(config.param_dtype).itemsize
    return adapter_params(config, LORA.rank) * 4 / weight_bytes


def measure(quick: bool, root: Path, repeats: int | None = None) -> dict[str, Any]:
    """Every number of the module docstring, as one dict."""
    repeats = repeats or (5 if quick else 8)
    model = lora_model(quick)
    counted = adapter_params(weight_delta.model_config(quick), LORA.rank)
    assert counted == sum(x.size for x in jax.tree.leaves(model[2])), "adapter_params"
    report = measure_push(model, root, rounds=2 * repeats + 1)
    report["lora_push_bytes_fraction_qwen2_5_0_5b"] = real_model_fraction(REAL_MODEL)
    report.update(measure_decode(model, quick, repeats))
    return report


def print_summary(report: dict[str, Any]) -> None:
    lora, full = report["lora_sync"], report["full_sync"]
    verdict = (
        "meets"
        if report["lora_push_bytes_fraction"] <= report["goal_lora_push_bytes_fraction"]
        else "misses"
    )
    print(
        f"LoRA rank {report['lora_rank']} on {report['model_bytes'] / 1e6:.1f} MB: an adapter "
        f"push moves {report['lora_push_bytes_fraction']:.4f} of a full push ({verdict} the "
        f"goal {report['goal_lora_push_bytes_fraction']}); the base push "
        f"{report['lora_base_push_bytes_fraction']:.3f}; from {REAL_MODEL}'s shapes "
        f"{report['lora_push_bytes_fraction_qwen2_5_0_5b']:.4f}"
    )
    print(
        f"  TensorStore push + pull: adapters {lora['push_s']:.4f} + {lora['pull_s']:.4f} s, "
        f"full {full['push_s']:.4f} + {full['pull_s']:.4f} s (speedup "
        f"{report['lora_sync_speedup']:.2f})"
    )
    print(
        f"  decode tokens/s: merged {report['decode_merged_tokens_per_s']:.0f}, extra matmul "
        f"{report['decode_unmerged_tokens_per_s']:.0f} (ratio "
        f"{report['lora_decode_unmerged_vs_merged']:.2f})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small bench model")
    parser.add_argument("--repeats", type=int, help="timed rounds per measurement")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="weight_lora-") as root:
        report = measure(args.quick, Path(root), args.repeats)
    report["wall_s"] = time.perf_counter() - start
    print_summary(report)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
