"""Weight-sync throughput: push + pull through each parameter server, against memcpy.

For each parameter size the trainer pushes a pytree of float32 leaves (at most 32 MiB
each, like a layer's weights) and a reader pulls it back; the figure of merit is

    GB/s = parameter bytes / (push seconds + pull seconds)

What the two sides of ``fraction_of_memcpy`` (store GB/s / memcpy GB/s) measure:

- **memcpy**: one copy of every leaf into newly allocated ``numpy`` arrays, in this
  process: the cost of moving the bytes once. The allocator reuses what the round
  before freed, so some destination pages are mapped already and some are not;
  ``memcpy_into_written_gbps`` (a copy into buffers written before) shows how much of
  memcpy is page faults.
- **push + pull**: a whole weight update. Push ends when the version is published;
  pull starts then and ends when the reader holds the newest version as arrays on its
  JAX device *and has touched every 4 KiB page of them* (one byte each), so a store
  that maps memory lazily pays its page faults inside pull. Every store moves the
  bytes at least once (into the store); a store whose reader copies them again moves
  them twice and so reaches at most about 0.5 of memcpy; a reader that maps the
  store's memory (the Ray object store, the TensorStore store's files) pays for page
  mapping instead of a copy.

``fraction_of_memcpy`` is that of the worst store in its default configuration at the
largest size; the goal is >= 0.5.

Timing: each store is first pushed and pulled ``keep + 1`` times (the warm-up): a
store reaches its steady state once every buffer of its working set (the ``keep``
versions it retains plus the one being written) has been written once, and a trainer
pushes thousands of times. The first push, onto memory never written before, is
reported as ``cold_push_s``. Then every timing is the median of ``--repeats`` rounds.

Stores:

- ``in_process``: zero copy (references to immutable arrays), so its "GB/s" only says
  that no bytes move.
- ``tensorstore``: snapshots in ``--dir`` (default: a fresh temp dir), in the store's
  default configuration (no fsync: atomic against a killed writer, not against a
  machine crash), read back by a second store object that knows only the directory, as
  another process would (memory-mapped files).
- ``tensorstore_durable``: the same with ``durable=True`` (fsync before publishing), an
  opt-in mode for a directory that must survive machine crashes. Its pushes are bound
  by the disk, so it is reported beside the headline (``durable_fraction_of_memcpy``)
  with ``disk_write_fsync_gbps``: writing the same bytes over one file in the same
  directory and fsyncing it, about the most a durable push can reach.
- ``ray_object_store``: the Ray backend's store. This process, as the trainer, puts
  each version into Ray's object store once and registers it with a parameter-server
  actor; a reader actor (another process, as an inference worker) gets it (zero-copy
  views of shared memory) and puts it on the device (``jax.device_put``), as a worker
  does before decoding. "pull" is that whole round trip, actor call included. A local
  Ray cluster is started for it with the store's ``RAY_SYSTEM_CONFIG``
  (``--ray-default-config``: Ray's defaults, to compare); its start-up is not timed;
  skipped when Ray is not installed.

To add a store, add a factory to ``STORES``.

**Delta publication** (``benchmarks/weight_delta.py``, run here too unless
``--no-delta``): the fraction of bytes that change after a real train step
(``delta_changed_fraction``), and the time and bytes of a delta pull against a full
pull through the TensorStore store (``delta_pull_speedup``, ``delta_bytes_ratio``, and
``_bfloat16`` for the weights rounded to bfloat16); the numbers of that module are
under ``"delta"``.

**LoRA publication** (``benchmarks/weight_lora.py``, run here too unless ``--no-lora``):
``lora_push_bytes_fraction`` (an adapter version's push bytes ÷ a full push's, rank 8
on the bench model; goal <= 0.02), ``lora_push_bytes_fraction_qwen2_5_0_5b`` (the same
from the shapes of Qwen2.5-0.5B), ``lora_sync_speedup`` (full ÷ adapter push + pull
seconds through TensorStore) and ``lora_decode_unmerged_vs_merged`` (decode tokens/s
with the adapters as an extra low-rank matmul ÷ merged into the weights); the numbers of
that module are under ``"lora"``.

Usage::

    python benchmarks/weight_sync.py --quick     # 10, 64, 256 MB; under a minute
    python benchmarks/weight_sync.py             # 10, 100, 1000 MB

The delta measurement adds its two train steps (compiled in 10-20 s on two busy cores);
``--no-delta`` leaves it out, ``--delta-only`` runs only it. ``--cross-host`` adds the
row between hosts (``benchmarks/cross_host_sync.py``: two Ray nodes in network
namespaces; needs root; its ``cross_host_*`` keys join the JSON).

The last line printed is one JSON object with every number, and ``fraction_of_memcpy``
of the worst store at the largest size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Its sibling weight_delta.py, also when this file is imported from elsewhere (a test).
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import weight_delta  # noqa: E402
import weight_lora  # noqa: E402

from rlaxkit.param_server import (  # noqa: E402
    InProcessParameterServer,
    ParameterServer,
    TensorStoreParameterServer,
    tree_nbytes,
)

MB = 10**6
LEAF_BYTES = 32 * 2**20  # Largest leaf: a big layer's weight matrix.
PAGE_BYTES = 4096
FULL_SIZES_MB = (10, 100, 1000)
QUICK_SIZES_MB = (10, 64, 256)  # --quick stops at 256 MB to stay under a minute.
GOAL_FRACTION = 0.5
KEEP = 2  # Versions every store retains.
WARMUP_ROUNDS = KEEP + 1  # Every buffer of a store's working set written once.
OPT_IN = ("tensorstore_durable",)  # Not the default configuration: beside the headline.

# name -> factory(scratch_dir) -> (writer, reader). The reader is another object on
# the same store where the store allows it, so the pull really reads what was pushed.
StoreFactory = Callable[[Path], tuple[ParameterServer, ParameterServer]]
RAY_DEFAULT_CONFIG = False  # --ray-default-config: start Ray without RAY_SYSTEM_CONFIG.


def _in_process(_: Path) -> tuple[ParameterServer, ParameterServer]:
    store = InProcessParameterServer(keep=KEEP)
    return store, store


def _tensorstore(durable: bool) -> StoreFactory:
    def make(scratch: Path) -> tuple[ParameterServer, ParameterServer]:
        writer = TensorStoreParameterServer(scratch, keep=KEEP, durable=durable)
        return writer, TensorStoreParameterServer(scratch)

    return make


def digest(params: dict[str, Any]) -> dict[str, int]:
    """CRC-32 of every leaf's bytes: how a reader in another process proves what it got."""
    return {name: zlib.crc32(np.ascontiguousarray(np.asarray(x))) for name, x in params.items()}


def touch_pages(params: Any) -> int:
    """Reads one byte of every 4 KiB page of every leaf (``np.asarray`` of a CPU
    ``jax.Array`` is a view of its buffer), so lazily mapped memory is faulted in."""
    total = 0
    for leaf in jax.tree.leaves(params):
        flat = np.asarray(leaf).reshape(-1).view(np.uint8)
        total += int(flat[::PAGE_BYTES].sum())
    return total


class _PullActor:
    """A Ray actor reading the store as an inference worker would (one for every size:
    its start, imports included, takes seconds on a busy machine and is not timed)."""

    def __init__(self) -> None:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        from rlaxkit.param_server import ray_store  # noqa: F401  (imported before timing)

        self.store: Any = None

    def connect(self, actor_name: str) -> bool:
        import ray

        from rlaxkit.param_server.ray_store import RayObjectStoreParameterServer

        self.store = RayObjectStoreParameterServer(ray.get_actor(actor_name), to_device=True)
        return True

    def pull(self, min_version: int, timeout: float, check: bool):
        version, params = self.store.pull(min_version=min_version, timeout=timeout)
        jax.block_until_ready(params)
        touch_pages(params)
        return version, (digest(params) if check else None)


class _RemoteReader:
    """The ``pull`` side of the protocol, run by a ``_PullActor`` in another process.

    Returns ``(version, digests)``: CRC-32 per leaf on the first pull (checked by
    ``time_store``), ``None`` afterwards. The actor touches the pages itself.
    """

    def __init__(self, handle: Any, server: Any):
        self.handle, self.server, self.pulls = handle, server, 0

    def pull(self, min_version: int | None = None, timeout: float | None = None):
        import ray

        check = self.pulls == 0
        self.pulls += 1
        return ray.get(self.handle.pull.remote(min_version, timeout, check))

    def close(self) -> None:
        """Stops the parameter-server actor, freeing the versions held in the object
        store (the reader actor holds none between pulls; the next size reuses it)."""
        import ray

        ray.kill(self.server)


def _ray_object_store(_: Path) -> tuple[ParameterServer, ParameterServer]:
    import ray

    from rlaxkit.param_server.ray_store import (
        RAY_SYSTEM_CONFIG,
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
            _system_config=None if RAY_DEFAULT_CONFIG else RAY_SYSTEM_CONFIG,
        )
    global _PULL_ACTOR
    name = f"weight-sync-{os.getpid()}-{time.monotonic_ns()}"
    server = parameter_server_actor(keep=KEEP, name=name)
    if _PULL_ACTOR is None:
        _PULL_ACTOR = ray.remote(_PullActor).options(num_cpus=0).remote()
    ray.get(_PULL_ACTOR.connect.remote(name))  # Start-up is not part of the timing.
    return RayObjectStoreParameterServer(server), _RemoteReader(_PULL_ACTOR, server)


_PULL_ACTOR: Any = None  # The reader actor, started once for every size.


def _ray_available() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


STORES: dict[str, StoreFactory] = {
    "in_process": _in_process,
    "tensorstore": _tensorstore(durable=False),
    "tensorstore_durable": _tensorstore(durable=True),
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


def time_memcpy_into_written(params: dict[str, jax.Array], repeats: int) -> float:
    """Seconds to copy every leaf into host arrays written before (no page faults)."""
    host = [np.asarray(x) for x in params.values()]
    out = [np.copy(x) for x in host]
    return median_seconds(
        lambda: [np.copyto(o, x) for o, x in zip(out, host, strict=True)], repeats
    )


def time_disk_write_fsync(params: dict[str, jax.Array], scratch: Path, repeats: int) -> float:
    """Seconds to write every leaf's bytes over one file in ``scratch`` (in place, as a
    durable push writes over the files of the version it evicted) and fsync it: about
    the most a durable push can reach on that file system."""
    host = [np.asarray(x) for x in params.values()]
    scratch.mkdir(parents=True, exist_ok=True)
    path = scratch / "disk-probe"
    path.touch()

    def write_and_fsync() -> None:
        with open(path, "r+b") as f:
            for x in host:
                f.write(memoryview(x).cast("B"))
            f.flush()
            os.fsync(f.fileno())

    seconds = median_seconds(write_and_fsync, repeats)
    path.unlink()
    return seconds


def time_store(
    factory: StoreFactory, scratch: Path, params: dict[str, jax.Array], repeats: int
) -> tuple[float, float, float]:
    """``(median push s, median pull s, first push s)`` of one store; checks the first
    pull and times the rounds after the warm-up."""
    writer, reader = factory(scratch)
    pushes, pulls, cold_push_s = [], [], 0.0
    for round_index in range(WARMUP_ROUNDS + repeats):
        version = round_index + 1
        start = time.perf_counter()
        writer.push(version, params)
        pushed_at = time.perf_counter()
        got_version, pulled = reader.pull(min_version=version, timeout=60)
        if not isinstance(reader, _RemoteReader):  # The reader actor does this itself.
            jax.block_until_ready(pulled)
            touch_pages(pulled)
        pulled_at = time.perf_counter()
        if got_version != version:
            raise RuntimeError(f"pulled version {got_version}, pushed {version}")
        if round_index == 0:
            cold_push_s = pushed_at - start
            if isinstance(reader, _RemoteReader):  # another process: compare digests
                if pulled != digest(params):
                    raise RuntimeError("the reader process got different bytes")
            else:
                for name, leaf in params.items():
                    if not np.array_equal(np.asarray(pulled[name]), np.asarray(leaf)):
                        raise RuntimeError(f"leaf {name} came back different")
        elif round_index >= WARMUP_ROUNDS:
            pushes.append(pushed_at - start)
            pulls.append(pulled_at - pushed_at)
        del pulled
    if hasattr(reader, "close"):
        reader.close()
    return statistics.median(pushes), statistics.median(pulls), cold_push_s


def run(sizes_mb: tuple[int, ...], stores: list[str], repeats: int, root: Path) -> dict:
    results = []
    memcpy_gbps, memcpy_written_gbps, disk_gbps = {}, {}, {}
    header = f"{'store':<22}{'MB':>7}{'push s':>10}{'pull s':>10}{'GB/s':>10}{'/memcpy':>9}"
    print(header)
    for size_mb in sizes_mb:
        params = make_params(size_mb * MB)
        nbytes = tree_nbytes(params)
        memcpy_s = time_memcpy(params, repeats)
        memcpy_gbps[size_mb] = nbytes / memcpy_s / 1e9
        memcpy_written_gbps[size_mb] = nbytes / time_memcpy_into_written(params, repeats) / 1e9
        print(f"{'memcpy':<22}{size_mb:>7}{'':>10}{memcpy_s:>10.4f}{memcpy_gbps[size_mb]:>10.2f}")
        if any(name in OPT_IN for name in stores):
            disk_s = time_disk_write_fsync(params, root / f"disk-{size_mb}", repeats)
            disk_gbps[size_mb] = nbytes / disk_s / 1e9
            print(f"{'disk write+fsync':<22}{size_mb:>7}{disk_s:>10.4f}{'':>10}", end="")
            print(f"{disk_gbps[size_mb]:>10.2f}")
        for name in stores:
            scratch = root / f"{name}-{size_mb}"
            push_s, pull_s, cold_push_s = time_store(STORES[name], scratch, params, repeats)
            shutil.rmtree(scratch, ignore_errors=True)
            gbps = nbytes / max(push_s + pull_s, 1e-9) / 1e9
            fraction = gbps / memcpy_gbps[size_mb]
            print(
                f"{name:<22}{size_mb:>7}{push_s:>10.4f}{pull_s:>10.4f}{gbps:>10.2f}{fraction:>9.2f}"
            )
            results.append(
                {
                    "store": name,
                    "size_mb": size_mb,
                    "bytes": nbytes,
                    "push_s": push_s,
                    "pull_s": pull_s,
                    "cold_push_s": cold_push_s,
                    "gbps": gbps,
                    "fraction_of_memcpy": fraction,
                }
            )
        del params
    largest = [r for r in results if r["size_mb"] == max(sizes_mb)]
    default = [r for r in largest if r["store"] not in OPT_IN] or largest
    worst = min(default, key=lambda r: r["fraction_of_memcpy"])
    durable = [r for r in largest if r["store"] == "tensorstore_durable"]
    return {
        "benchmark": "weight_sync",
        "sizes_mb": list(sizes_mb),
        "repeats": repeats,
        "warmup_rounds": WARMUP_ROUNDS,
        "memcpy_gbps": {str(k): v for k, v in memcpy_gbps.items()},
        "memcpy_into_written_gbps": {str(k): v for k, v in memcpy_written_gbps.items()},
        "disk_write_fsync_gbps": {str(k): v for k, v in disk_gbps.items()},
        "ray_system_config": not RAY_DEFAULT_CONFIG,
        "results": results,
        "worst_store": worst["store"],
        "fraction_of_memcpy": worst["fraction_of_memcpy"],
        "durable_fraction_of_memcpy": durable[0]["fraction_of_memcpy"] if durable else None,
        "goal_fraction_of_memcpy": GOAL_FRACTION,
        "scratch_dir": str(root),
        "cpu_count": os.cpu_count(),
    }


def cross_host(quick: bool) -> dict[str, Any]:
    """The cross-host row: ``benchmarks/cross_host_sync.py`` run as a script of its own
    (it starts and removes its own namespaces and Ray nodes); its figures at the largest
    size, prefixed ``cross_host_`` / ``same_host_`` as it prints them."""
    script = Path(__file__).with_name("cross_host_sync.py")
    command = [sys.executable, str(script), *(["--quick"] if quick else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
        raise RuntimeError(f"{script.name} failed ({done.returncode}): " + " | ".join(tail))
    row = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"cross-host (network namespaces): pull {row['cross_host_pull_bytes_per_s'] / 1e9:.2f} "
        f"GB/s, {row['cross_over_same_host']:.2f} of the same-host pull"
    )
    return {k: v for k, v in row.items() if k != "rows"} | {"cross_host_rows": row.get("rows")}


def main(argv: list[str] | None = None) -> int:
    global RAY_DEFAULT_CONFIG
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10/64/256 MB, 3 repeats")
    parser.add_argument("--sizes-mb", type=int, nargs="+", help="override the sizes")
    parser.add_argument("--stores", nargs="+", choices=sorted(STORES), default=list(STORES))
    parser.add_argument("--repeats", type=int, help="timed rounds per measurement")
    parser.add_argument("--dir", type=Path, help="scratch directory (default: a temp dir)")
    parser.add_argument(
        "--ray-default-config",
        action="store_true",
        help="start Ray with its default system config instead of RAY_SYSTEM_CONFIG",
    )
    parser.add_argument(
        "--no-delta", action="store_true", help="skip the delta-publication measurement"
    )
    parser.add_argument(
        "--delta-only", action="store_true", help="only the delta-publication measurement"
    )
    parser.add_argument(
        "--no-lora", action="store_true", help="skip the LoRA-publication measurement"
    )
    parser.add_argument(
        "--cross-host",
        action="store_true",
        help="add the cross-host row (benchmarks/cross_host_sync.py: a Ray cluster of "
        "network namespaces; needs root and ip)",
    )
    args = parser.parse_args(argv)
    RAY_DEFAULT_CONFIG = args.ray_default_config

    sizes = tuple(args.sizes_mb or (QUICK_SIZES_MB if args.quick else FULL_SIZES_MB))
    repeats = args.repeats or (3 if args.quick else 5)
    if args.quick and not args.sizes_mb:
        print(f"--quick: sizes capped at {max(sizes)} MB (full run: up to {FULL_SIZES_MB[-1]} MB)")
    root = Path(tempfile.mkdtemp(prefix="weight_sync-", dir=args.dir))
    load_before = os.getloadavg()[0]  # the machine may be shared: say how busy it was
    start = time.perf_counter()
    phase_s: dict[str, float] = {}  # where the time goes (the machine may be shared)
    try:
        report = {} if args.delta_only else run(sizes, args.stores, repeats, root)
        phase_s["stores"] = time.perf_counter() - start
        if not args.no_delta:
            delta = weight_delta.measure(args.quick, root / "delta")
            report["delta"] = delta
            for key in (
                "delta_changed_fraction",
                "delta_pull_speedup",
                "delta_bytes_ratio",
                "delta_push_slowdown",
                "delta_pull_speedup_bfloat16",
                "delta_bytes_ratio_bfloat16",
            ):
                report[key] = delta[key]
        phase_s["delta"] = time.perf_counter() - start - sum(phase_s.values())
        if not (args.no_lora or args.delta_only):
            lora = weight_lora.measure(args.quick, root / "lora", args.repeats)
            report["lora"] = lora
            for key in weight_lora.HEADLINE:
                report[key] = lora[key]
            phase_s["lora"] = time.perf_counter() - start - sum(phase_s.values())
        if args.cross_host:
            report |= cross_host(args.quick)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["quick"] = args.quick
    report["wall_s"] = time.perf_counter() - start
    report["phase_s"] = phase_s
    report["load_average_1m"] = [load_before, os.getloadavg()[0]]
    if "delta" in report:
        weight_delta.print_summary(report["delta"])
    if "lora" in report:
        weight_lora.print_summary(report["lora"])
    if args.delta_only:
        print(json.dumps(report))
        return 0
    verdict = "meets" if report["fraction_of_memcpy"] >= GOAL_FRACTION else "misses"
    print(
        f"worst store at {max(sizes)} MB: {report['worst_store']}, "
        f"{report['fraction_of_memcpy']:.2f} of memcpy ({verdict} the goal {GOAL_FRACTION})"
    )
    if report["durable_fraction_of_memcpy"] is not None:
        largest = str(max(sizes))
        disk = report["disk_write_fsync_gbps"][largest] / report["memcpy_gbps"][largest]
        print(
            f"tensorstore_durable (opt-in fsync): {report['durable_fraction_of_memcpy']:.2f} "
            f"of memcpy; writing and fsyncing the bytes over one file reaches {disk:.2f}"
        )
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
