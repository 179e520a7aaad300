"""Weight-sync throughput: push + pull through each parameter server, against memcpy.

For each parameter size the trainer pushes a pytree of float32 leaves (at most 32 MiB
each, like a layer's weights) and a reader pulls it back; the figure of merit is

    GB/s = parameter bytes / (push seconds + pull seconds)

next to plain memcpy (``numpy`` copies of every leaf into new arrays) measured in the
same run on the same bytes. ``fraction_of_memcpy`` is that ratio; the goal is >= 0.5.
Every timing is the median of ``--repeats`` rounds after one warm-up round.

Stores:

- ``in_process``: zero copy (references to immutable arrays), so its "GB/s" only says
  that no bytes move.
- ``tensorstore``: zarr3 snapshots in ``--dir`` (default: a fresh temp dir), fsynced
  before publishing (the default ``durable=True``), read back by a second store object
  that knows only the directory, as another process would.
- ``tensorstore_nosync``: the same without fsync (atomic against a killed process, not
  against a machine crash).

To add a store (a Ray object-store one comes later), add a factory to ``STORES``.

Usage::

    python benchmarks/weight_sync.py --quick     # 10, 64, 256 MB; under a minute
    python benchmarks/weight_sync.py             # 10, 100, 1000 MB

The last line printed is one JSON object with every number, and ``fraction_of_memcpy``
of the worst store at the largest size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from rlaxkit.param_server import (  # noqa: E402
    InProcessParameterServer,
    ParameterServer,
    TensorStoreParameterServer,
    tree_nbytes,
)

MB = 10**6
LEAF_BYTES = 32 * 2**20  # Largest leaf: a big layer's weight matrix.
FULL_SIZES_MB = (10, 100, 1000)
QUICK_SIZES_MB = (10, 64, 256)  # --quick stops at 256 MB to stay under a minute.
GOAL_FRACTION = 0.5

# name -> factory(scratch_dir) -> (writer, reader). The reader is another object on
# the same store where the store allows it, so the pull really reads what was pushed.
StoreFactory = Callable[[Path], tuple[ParameterServer, ParameterServer]]


def _in_process(_: Path) -> tuple[ParameterServer, ParameterServer]:
    store = InProcessParameterServer(keep=2)
    return store, store


def _tensorstore(durable: bool) -> StoreFactory:
    def make(scratch: Path) -> tuple[ParameterServer, ParameterServer]:
        writer = TensorStoreParameterServer(scratch, keep=2, durable=durable)
        return writer, TensorStoreParameterServer(scratch)

    return make


STORES: dict[str, StoreFactory] = {
    "in_process": _in_process,
    "tensorstore": _tensorstore(durable=True),
    "tensorstore_nosync": _tensorstore(durable=False),
}


def make_params(total_bytes: int, seed: int = 0) -> dict[str, jax.Array]:
    """A dict of float32 ``(rows, 1024)`` leaves adding up to about ``total_bytes``."""
    rng = np.random.default_rng(seed)
    row_bytes = 1024 * 4
    params, left, i = {}, total_bytes, 0
    while left >= row_bytes:
        rows = min(left, LEAF_BYTES) // row_bytes
        params[f"layer_{i:03d}"] = jax.device_put(rng.random((rows, 1024), np.float32))
        left -= rows * row_bytes
        i += 1
    return params


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_memcpy(params: dict[str, jax.Array], repeats: int) -> float:
    """Seconds to copy every leaf's bytes into new host arrays (numpy copy)."""
    host = [np.asarray(x) for x in params.values()]
    return median_seconds(lambda: [np.copy(x) for x in host], repeats)


def time_store(
    factory: StoreFactory, scratch: Path, params: dict[str, jax.Array], repeats: int
) -> tuple[float, float]:
    """Median (push seconds, pull seconds) of one store; checks the first pull."""
    writer, reader = factory(scratch)
    pushes, pulls = [], []
    for round_index in range(repeats + 1):  # Round 0 warms up.
        version = round_index + 1
        start = time.perf_counter()
        writer.push(version, params)
        pushed_at = time.perf_counter()
        got_version, pulled = reader.pull(min_version=version, timeout=60)
        jax.block_until_ready(pulled)
        pulled_at = time.perf_counter()
        if got_version != version:
            raise RuntimeError(f"pulled version {got_version}, pushed {version}")
        if round_index == 0:
            for name, leaf in params.items():
                if not np.array_equal(np.asarray(pulled[name]), np.asarray(leaf)):
                    raise RuntimeError(f"leaf {name} came back different")
        else:
            pushes.append(pushed_at - start)
            pulls.append(pulled_at - pushed_at)
        del pulled
    return statistics.median(pushes), statistics.median(pulls)


def run(sizes_mb: tuple[int, ...], stores: list[str], repeats: int, root: Path) -> dict:
    results = []
    memcpy_gbps = {}
    header = f"{'store':<20}{'MB':>7}{'push s':>10}{'pull s':>10}{'GB/s':>10}{'/memcpy':>9}"
    print(header)
    for size_mb in sizes_mb:
        params = make_params(size_mb * MB)
        nbytes = tree_nbytes(params)
        memcpy_s = time_memcpy(params, repeats)
        memcpy_gbps[size_mb] = nbytes / memcpy_s / 1e9
        print(f"{'memcpy':<20}{size_mb:>7}{'':>10}{memcpy_s:>10.4f}{memcpy_gbps[size_mb]:>10.2f}")
        for name in stores:
            scratch = root / f"{name}-{size_mb}"
            push_s, pull_s = time_store(STORES[name], scratch, params, repeats)
            shutil.rmtree(scratch, ignore_errors=True)
            gbps = nbytes / max(push_s + pull_s, 1e-9) / 1e9
            fraction = gbps / memcpy_gbps[size_mb]
            print(
                f"{name:<20}{size_mb:>7}{push_s:>10.4f}{pull_s:>10.4f}{gbps:>10.2f}{fraction:>9.2f}"
            )
            results.append(
                {
                    "store": name,
                    "size_mb": size_mb,
                    "bytes": nbytes,
                    "push_s": push_s,
                    "pull_s": pull_s,
                    "gbps": gbps,
                    "fraction_of_memcpy": fraction,
                }
            )
        del params
    largest = [r for r in results if r["size_mb"] == max(sizes_mb)]
    worst = min(largest, key=lambda r: r["fraction_of_memcpy"])
    return {
        "benchmark": "weight_sync",
        "sizes_mb": list(sizes_mb),
        "repeats": repeats,
        "memcpy_gbps": {str(k): v for k, v in memcpy_gbps.items()},
        "results": results,
        "worst_store": worst["store"],
        "fraction_of_memcpy": worst["fraction_of_memcpy"],
        "goal_fraction_of_memcpy": GOAL_FRACTION,
        "scratch_dir": str(root),
        "cpu_count": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10/64/256 MB, 3 repeats")
    parser.add_argument("--sizes-mb", type=int, nargs="+", help="override the sizes")
    parser.add_argument("--stores", nargs="+", choices=sorted(STORES), default=list(STORES))
    parser.add_argument("--repeats", type=int, help="timed rounds per measurement")
    parser.add_argument("--dir", type=Path, help="scratch directory (default: a temp dir)")
    args = parser.parse_args(argv)

    sizes = tuple(args.sizes_mb or (QUICK_SIZES_MB if args.quick else FULL_SIZES_MB))
    repeats = args.repeats or (3 if args.quick else 5)
    if args.quick and not args.sizes_mb:
        print(f"--quick: sizes capped at {max(sizes)} MB (full run: up to {FULL_SIZES_MB[-1]} MB)")
    root = Path(tempfile.mkdtemp(prefix="weight_sync-", dir=args.dir))
    start = time.perf_counter()
    try:
        report = run(sizes, args.stores, repeats, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["quick"] = args.quick
    report["wall_s"] = time.perf_counter() - start
    verdict = "meets" if report["fraction_of_memcpy"] >= GOAL_FRACTION else "misses"
    print(
        f"worst store at {max(sizes)} MB: {report['worst_store']}, "
        f"{report['fraction_of_memcpy']:.2f} of memcpy ({verdict} the goal {GOAL_FRACTION})"
    )
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
