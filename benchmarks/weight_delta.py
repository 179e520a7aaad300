"""Delta publication after a real train step: what changes, and what a delta pull saves.

A Qwen3-shaped model (untied embeddings, vocabulary 4096) takes two GRPO train steps
with the default optimizer (AdamW, learning rate 1e-6, weight decay 0.01, the usual
setting for RL fine-tuning); the weights after step 1 and after step 2 are two
consecutive published versions, ``A`` and ``B``. Reported:

- ``element_changed_fraction``: elements whose bits differ between ``A`` and ``B``, in
  float32 (the master weights) and in bfloat16 (``A`` and ``B`` rounded, as inference
  weights are often published);
- ``chunk_changed_fraction``: the fraction of the bytes a delta push stores (chunks whose
  bytes changed) at 4 KiB, 64 KiB and 1 MiB chunks, float32 and bfloat16;
- ``word_changed_fraction``: 16-bit words whose bits differ (what the word patches of a
  reader one version behind carry, plus a bit per word);
- a timed sync through the TensorStore store (snapshots in a directory that another
  process reads), of the float32 weights and of their bfloat16 rounding: the trainer
  pushes ``A, B, A, B, ...`` as consecutive versions (each pair one real step apart)
  and a reader one version behind pulls each, through
  :class:`rlaxkit.param_server.delta_store.DeltaParameterServer` (1 MiB chunks, a full
  snapshot every 4 pushes) and through the plain store. A pull ends when the reader
  holds the newest version as arrays *and has touched every 4 KiB page of them*.
  ``delta_pull_speedup`` = full pull s / delta pull s (medians, same run);
  ``delta_bytes_ratio`` = median bytes a delta pull read / the model's bytes (the mean
  over pulls, snapshots included, is under ``delta_sync``);
  ``delta_push_slowdown`` = delta push s / full push s (the pusher hashes every byte).
  The plain keys are float32's; ``_bfloat16`` ones the rounded weights'.

``delta_changed_fraction`` (the headline) is the float32 chunk fraction at 1 MiB, the
configuration timed. Run alone with ``python benchmarks/weight_delta.py [--quick]``;
``benchmarks/weight_sync.py`` runs it too.
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

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rlaxkit.algorithms import algorithm  # noqa: E402
from rlaxkit.data.batch import BucketSpec, Sample, collate  # noqa: E402
from rlaxkit.models import ModelConfig, Transformer  # noqa: E402
from rlaxkit.param_server import TensorStoreParameterServer  # noqa: E402
from rlaxkit.param_server.delta import (  # noqa: E402
    ChunkLayout,
    byte_view,
    changed_chunks,
    chunk_checksums,
)
from rlaxkit.param_server.delta_store import DeltaParameterServer, delta_keep  # noqa: E402
from rlaxkit.trainer.config import OptimizerConfig, TrainConfig  # noqa: E402
from rlaxkit.trainer.state import create_train_state  # noqa: E402
from rlaxkit.trainer.step import make_train_step  # noqa: E402

VOCAB = 4096
CHUNK_SIZES = (4096, 65536, 1 << 20)
TIMED_CHUNK_BYTES = 1 << 20
SNAPSHOT_EVERY = 4
PAGE_BYTES = 4096


def model_config(quick: bool) -> ModelConfig:
    """Qwen3-shaped: ~8 MB of float32 with ``quick`` (2 layers, width 128), ~24 MB
    without (4 layers, width 256)."""
    hidden, layers = (128, 2) if quick else (256, 4)
    return ModelConfig(
        family="qwen3",
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
    )


def random_batch(seed: int, rows: int = 16, prompt: int = 8, completion: int = 24) -> Any:
    """GRPO groups of 4 random prompts and completions with 0/1 rewards."""
    rng = np.random.RandomState(seed)
    samples = [
        Sample(
            prompt_tokens=rng.randint(1, VOCAB, prompt).tolist(),
            completion_tokens=rng.randint(1, VOCAB, completion).tolist(),
            behaviour_logprobs=(-rng.rand(completion) * 4).tolist(),
            versions=0,
            reward=float(rng.randint(0, 2)),
            group_id=i // 4,
        )
        for i in range(rows)
    ]
    return collate(samples, bucket=BucketSpec(lengths=(prompt + completion,), batch_sizes=(rows,)))


def two_versions(quick: bool) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], float]:
    """Host float32 weights after train steps 1 and 2, and the seconds both took."""
    graphdef, params = nnx.split(Transformer(model_config(quick), rngs=nnx.Rngs(0)))
    config = TrainConfig(
        algorithm=algorithm("grpo", loss={"kl_coef": 0.0}), optimizer=OptimizerConfig()
    )
    state = create_train_state(config, params)
    step = make_train_step(config, graphdef)
    start = time.perf_counter()
    versions = []
    for seed in (0, 1):
        state, _ = step(state, random_batch(seed))
        leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(state.params))
        versions.append({jax.tree_util.keystr(p): np.array(x) for p, x in leaves})
    return versions[0], versions[1], time.perf_counter() - start


def changed_fractions(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, Any]:
    """Element and chunk changed fractions of ``a -> b``, float32 and bfloat16."""
    out: dict[str, Any] = {
        "element_changed_fraction": {},
        "chunk_changed_fraction": {},
        "word_changed_fraction": {},
    }
    for dtype in ("float32", "bfloat16"):
        cast = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
        old = [byte_view(x.astype(cast)) for x in a.values()]
        new = [byte_view(x.astype(cast)) for x in b.values()]
        item = np.dtype(cast).itemsize
        differ = sum(
            int(np.any((x != y).reshape(-1, item), axis=1).sum())
            for x, y in zip(old, new, strict=True)
        )
        elements = sum(x.size for x in old) // item
        out["element_changed_fraction"][dtype] = differ / elements
        words = sum(
            int(np.sum(x.view(np.uint16) != y.view(np.uint16)))
            for x, y in zip(old, new, strict=True)
        )
        out["word_changed_fraction"][dtype] = words / (sum(x.size for x in old) // 2)
        for chunk_bytes in CHUNK_SIZES:
            layout = ChunkLayout.of([x.size for x in old], chunk_bytes)
            sums_old = np.concatenate([chunk_checksums(x, chunk_bytes) for x in old])
            sums_new = np.concatenate([chunk_checksums(x, chunk_bytes) for x in new])
            ids = changed_chunks(sums_old, sums_new)
            fraction = layout.payload_bytes(ids) / int(layout.size.sum())
            out["chunk_changed_fraction"][f"{dtype}_{chunk_bytes}"] = fraction
    return out


def touch_pages(params: Any) -> None:
    """One byte of every page of every leaf, so lazily mapped memory is faulted in."""
    for leaf in jax.tree.leaves(params):
        int(np.asarray(leaf).reshape(-1).view(np.uint8)[::PAGE_BYTES].sum())


def time_sync(
    a: dict[str, np.ndarray], b: dict[str, np.ndarray], root: Path, repeats: int, delta: bool
) -> dict[str, float]:
    """Median push and pull seconds and pull bytes of ``A, B, A, ...`` pushes, each
    pulled by a reader one version behind, through the TensorStore store."""
    directory = root
    keep = delta_keep(2, SNAPSHOT_EVERY) if delta else 2
    writer: Any = TensorStoreParameterServer(directory, keep=keep)
    reader: Any = TensorStoreParameterServer(directory)
    if delta:
        options = {"snapshot_every": SNAPSHOT_EVERY, "chunk_bytes": TIMED_CHUNK_BYTES}
        writer = DeltaParameterServer(writer, **options)
        reader = DeltaParameterServer(reader, **options)
    warmup = SNAPSHOT_EVERY + 1  # Every buffer written once; the first push is a snapshot.
    pushes, pulls, pulled_bytes, was_snapshot = [], [], [], []
    for version in range(1, warmup + repeats + 1):
        params = a if version % 2 else b
        start = time.perf_counter()
        writer.push(version, params)
        pushed_at = time.perf_counter()
        got, pulled = reader.pull(min_version=version, timeout=60)
        jax.block_until_ready(pulled)
        touch_pages(pulled)
        pulled_at = time.perf_counter()
        assert got == version
        if version == warmup + 1:  # bit for bit what was pushed
            for key, leaf in params.items():
                assert np.asarray(pulled[key]).tobytes() == leaf.tobytes(), key
        if version > warmup:
            pushes.append(pushed_at - start)
            pulls.append(pulled_at - pushed_at)
            pulled_bytes.append(reader.stats.last("pull").bytes)
            was_snapshot.append(delta and (version - 1) % SNAPSHOT_EVERY == 0)
        del pulled
    # After a snapshot push a reader one behind reads the changed chunks (a snapshot
    # holds no word patches); after a delta push, their word patches.
    return {
        "push_s": statistics.median(pushes),
        "pull_s": statistics.median(pulls),
        "pull_bytes": statistics.median(pulled_bytes),
        "mean_pull_bytes": statistics.fmean(pulled_bytes),
        "snapshot_pushes": sum(was_snapshot),
    }


def measure(quick: bool, root: Path, repeats: int | None = None) -> dict[str, Any]:
    """Every number of the module docstring, as one dict."""
    a, b, train_s = two_versions(quick)
    model_bytes = sum(x.nbytes for x in a.values())
    report: dict[str, Any] = {"model_bytes": model_bytes, "train_two_steps_s": train_s}
    report.update(changed_fractions(a, b))
    repeats = repeats or (6 if quick else 12)
    for suffix, cast in (("", np.float32), ("_bfloat16", ml_dtypes.bfloat16)):
        a_cast = {k: x.astype(cast) for k, x in a.items()}
        b_cast = {k: x.astype(cast) for k, x in b.items()}
        nbytes = sum(x.nbytes for x in a_cast.values())
        full = time_sync(a_cast, b_cast, root / f"full{suffix}", repeats, delta=False)
        delta = time_sync(a_cast, b_cast, root / f"delta{suffix}", repeats, delta=True)
        report[f"full_sync{suffix}"], report[f"delta_sync{suffix}"] = full, delta
        report[f"delta_bytes_ratio{suffix}"] = delta["pull_bytes"] / nbytes
        report[f"delta_pull_speedup{suffix}"] = full["pull_s"] / delta["pull_s"]
        report[f"delta_push_slowdown{suffix}"] = delta["push_s"] / full["push_s"]
    report["delta_changed_fraction"] = report["chunk_changed_fraction"][
        f"float32_{TIMED_CHUNK_BYTES}"
    ]
    return report


def print_summary(report: dict[str, Any]) -> None:
    elements = report["element_changed_fraction"]
    chunks = report["chunk_changed_fraction"]
    print(
        f"after a real train step ({report['model_bytes'] / 1e6:.1f} MB float32): elements "
        f"changed {elements['float32']:.3f} (float32), {elements['bfloat16']:.3f} (bfloat16)"
    )
    for name, fraction in chunks.items():
        print(f"  bytes in changed chunks, {name:<18} {fraction:.3f}")
    words = report["word_changed_fraction"]
    print(
        f"  16-bit words changed: {words['float32']:.3f} (float32), "
        f"{words['bfloat16']:.3f} (bfloat16)"
    )
    for dtype, suffix in (("float32", ""), ("bfloat16", "_bfloat16")):
        full, delta = report[f"full_sync{suffix}"], report[f"delta_sync{suffix}"]
        print(
            f"TensorStore sync of {dtype}, one version behind: full pull {full['pull_s']:.4f}"
            f" s, delta pull {delta['pull_s']:.4f} s (speedup "
            f"{report['delta_pull_speedup' + suffix]:.2f}), delta reads "
            f"{report['delta_bytes_ratio' + suffix]:.3f} of the bytes; push "
            f"{full['push_s']:.4f} s vs {delta['push_s']:.4f} s"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, fewer rounds")
    parser.add_argument("--repeats", type=int, help="timed pulls per store")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="weight_delta-") as root:
        report = measure(args.quick, Path(root), args.repeats)
    report.update(benchmark="weight_delta", quick=args.quick, wall_s=time.perf_counter() - start)
    print_summary(report)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
