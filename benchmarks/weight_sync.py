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
- ``ray_object_store``: the Ray backend's store. This process, as the trainer, puts
  each version into Ray's object store once and registers it with a parameter-server
  actor; a reader actor (another process, as an inference worker) gets it (zero-copy
  views of shared memory) and puts it on the device (``jax.device_put``), as a worker
  does before decoding. "pull" is that whole round trip, actor call included. A local Ray cluster
  is started for it (its start-up is not timed); skipped when Ray is not installed.

To add a store, add a factory to ``STORES``.

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
import zlib
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


def digest(params: dict[str, Any]) -> dict[str, int]:
    """CRC-32 of every leaf's bytes: how a reader in another process proves what it got."""
    return {name: zlib.crc32(np.ascontiguousarray(np.asarray(x))) for name, x in params.items()}


class _PullActor:
    """A Ray actor reading the store as an inference worker would."""

    def __init__(self, actor_name: str):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import ray

        from rlaxkit.param_server.ray_store import RayObjectStoreParameterServer

        self.store = RayObjectStoreParameterServer(ray.get_actor(actor_name), to_device=True)

    def ready(self) -> bool:
        return True

    def pull(self, min_version: int, timeout: float, check: bool):
        version, params = self.store.pull(min_version=min_version, timeout=timeout)
        jax.block_until_ready(params)
        return version, (digest(params) if check else None)


class _RemoteReader:
    """The ``pull`` side of the protocol, run by a ``_PullActor`` in another process.

    Returns ``(version, digests)``: CRC-32 per leaf on the first pull (checked by
    ``time_store``), ``None`` afterwards.
    """

    def __init__(self, handle: Any, server: Any):
        self.handle, self.server, self.pulls = handle, server, 0

    def pull(self, min_version: int | None = None, timeout: float | None = None):
        import ray

        check = self.pulls == 0
        self.pulls += 1
        return ray.get(self.handle.pull.remote(min_version, timeout, check))

    def close(self) -> None:
        """Stops both actors, freeing the versions held in the object store."""
        import ray

        ray.kill(self.handle)
        ray.kill(self.server)


def _ray_object_store(_: Path) -> tuple[ParameterServer, ParameterServer]:
    import ray

    from rlaxkit.param_server.ray_store import (
        RayObjectStoreParameterServer,
        parameter_server_actor,
    )

    if not ray.is_initialized():
        # A short session dir: Ray's socket paths must fit in 107 bytes.
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            _temp_dir=tempfile.mkdtemp(prefix="ray-"),
        )
    name = f"weight-sync-{os.getpid()}-{time.monotonic_ns()}"
    server = parameter_server_actor(keep=2, name=name)
    reader = ray.remote(_PullActor).options(num_cpus=0).remote(name)
    ray.get(reader.ready.remote())  # Start-up (imports) is not part of the timing.
    return RayObjectStoreParameterServer(server), _RemoteReader(reader, server)


def _ray_available() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


STORES: dict[str, StoreFactory] = {
    "in_process": _in_process,
    "tensorstore": _tensorstore(durable=True),
    "tensorstore_nosync": _tensorstore(durable=False),
}
if _ray_available():
    STORES["ray_object_store"] = _ray_object_store


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
            if isinstance(reader, _RemoteReader):  # another process: compare digests
                if pulled != digest(params):
                    raise RuntimeError("the reader process got different bytes")
            else:
                for name, leaf in params.items():
                    if not np.array_equal(np.asarray(pulled[name]), np.asarray(leaf)):
                        raise RuntimeError(f"leaf {name} came back different")
        else:
            pushes.append(pushed_at - start)
            pulls.append(pulled_at - pushed_at)
        del pulled
    if hasattr(reader, "close"):
        reader.close()
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
