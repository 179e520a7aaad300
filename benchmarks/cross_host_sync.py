"""Weight transfer between hosts: Ray object-store push and pull across network
namespaces, against the same pull on the pushing host, measured in one run.

A two-host Ray cluster of network namespaces on this machine
(``tests/netns_cluster.py``: a veth pair per host on a bridge, each Ray node bound to
its own address) runs this script again inside host ``a`` as the "trainer": for each
size it puts a fresh version of float32 parameters (leaves of at most 32 MiB) into
``a``'s object store, then a reader actor on ``a`` and one on ``b`` each get it and
touch one byte of every 4 KiB page (as ``benchmarks/weight_sync.py``'s readers do, so
lazily mapped memory pays inside the pull):

- **push**: ``ray.put`` of the version on ``a`` (the same for both readers);
- **pull**: the reader's whole round trip (actor call, ``ray.get``, touching pages).
  On ``a`` that maps ``a``'s shared memory; on ``b`` Ray's object manager first moves
  the bytes from ``a``'s store into ``b``'s over the network (``b``'s node has its own
  object store; ``/dev/shm`` being one machine's changes nothing of that path).

Every figure is bytes / seconds, the median of ``--repeats`` rounds after one warm-up
round. The bridge is a kernel (or gVisor) software switch, so "network" here means
Ray's real transfer protocol over TCP between two addresses, at memory speed, not a
datacenter link: a lower bound on the protocol's cost, not on a NIC's.

Needs root (network namespaces) and ``ip``. Usage::

    sudo RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/cross_host_sync.py --quick

The last line printed is one JSON object (``cross_host_push_bytes_per_s``,
``cross_host_pull_bytes_per_s``, ``same_host_pull_bytes_per_s``,
``cross_host_push_pull_bytes_per_s``, ``same_host_push_pull_bytes_per_s``,
``cross_over_same_host``, at the largest size; ``rows``: every size).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

LEAF_BYTES = 32 * 1024**2  # at most one leaf of this size, like a layer's weights
PAGE_BYTES = 4096


def make_params(total_bytes: int, seed: int) -> dict[str, np.ndarray]:
    """Float32 leaves of at most ``LEAF_BYTES`` adding up to ``total_bytes``."""
    rng = np.random.default_rng(seed)
    params, left, i = {}, total_bytes, 0
    while left > 0:
        size = min(left, LEAF_BYTES) // 4
        params[f"leaf_{i}"] = rng.standard_normal(size, dtype=np.float32)
        left, i = left - size * 4, i + 1
    return params


class Reader:
    """A worker's side: gets a version and touches every page of it."""

    def node(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def pull(self, refs: list[Any]) -> int:
        import ray

        params = ray.get(refs[0])
        touched = 0
        for leaf in params.values():
            flat = leaf.reshape(-1).view(np.uint8)
            touched += int(flat[::PAGE_BYTES].sum() >= 0)
        return touched


def measure(address: str, sizes_mb: list[int], repeats: int) -> dict[str, Any]:
    """Inside host ``a``: push each size, pull it on ``a`` and on ``b``."""
    import ray

    ray.init(address=address, log_to_driver=False)
    reader = ray.remote(Reader)
    readers = {
        where: reader.options(num_cpus=0, resources={f"host_{where}": 1}).remote()
        for where in ("a", "b")
    }
    nodes = {where: ray.get(r.node.remote()) for where, r in readers.items()}
    rows = []
    for size_mb in sizes_mb:
        total = size_mb * 1024**2
        times: dict[str, list[float]] = {"push": [], "a": [], "b": []}
        for round_ in range(repeats + 1):
            params = make_params(total, seed=round_)
            start = time.perf_counter()
            ref = ray.put(params)
            push_s = time.perf_counter() - start
            pulls = {}
            for where, r in readers.items():
                start = time.perf_counter()
                ray.get(r.pull.remote([ref]))
                pulls[where] = time.perf_counter() - start
            del ref, params
            if round_:  # the first round warms both stores up
                times["push"].append(push_s)
                for where in ("a", "b"):
                    times[where].append(pulls[where])
        push, same, cross = (statistics.median(times[k]) for k in ("push", "a", "b"))
        rows.append(
            {
                "size_mb": size_mb,
                "push_s": push,
                "same_host_pull_s": same,
                "cross_host_pull_s": cross,
                "cross_host_push_bytes_per_s": total / push,
                "cross_host_pull_bytes_per_s": total / cross,
                "same_host_pull_bytes_per_s": total / same,
                "cross_host_push_pull_bytes_per_s": total / (push + cross),
                "same_host_push_pull_bytes_per_s": total / (push + same),
            }
        )
    ray.shutdown()
    return {"nodes": nodes, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 and 64 MB, 3 repeats")
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[10, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inside", default=None, help=argparse.SUPPRESS)  # host a's run
    args = parser.parse_args(argv)
    sizes, repeats = ([10, 64], 3) if args.quick else (args.sizes_mb, args.repeats)
    if args.inside:
        print(json.dumps(measure(args.inside, sizes, repeats)))
        return 0
    from netns_cluster import NetnsCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(json.dumps({"skipped": reason}))
        return 1
    store_bytes = max(256 * 1024**2, 3 * max(sizes) * 1024**2)
    hosts = {"a": {"host_a": 1}, "b": {"host_b": 1}}
    with NetnsCluster(hosts, num_cpus=1, object_store_bytes=store_bytes) as cluster:
        argv_inside = [cluster.python, __file__, "--inside", cluster.address]
        argv_inside += ["--sizes-mb", *map(str, sizes), "--repeats", str(repeats)]
        out = cluster.run("a", argv_inside, timeout_s=1800)
    result = json.loads(out.strip().splitlines()[-1])
    for row in result["rows"]:
        print(
            f"{row['size_mb']:>5} MB  push {row['cross_host_push_bytes_per_s'] / 1e9:6.2f} GB/s"
            f"  pull same host {row['same_host_pull_bytes_per_s'] / 1e9:6.2f} GB/s"
            f"  across hosts {row['cross_host_pull_bytes_per_s'] / 1e9:6.2f} GB/s"
        )
    last = result["rows"][-1]
    summary = {
        **{k: v for k, v in last.items() if k.endswith("bytes_per_s")},
        "size_mb": last["size_mb"],
        "cross_over_same_host": (
            last["cross_host_push_pull_bytes_per_s"] / last["same_host_push_pull_bytes_per_s"]
        ),
        "nodes": result["nodes"],
        "rows": result["rows"],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
