"""One version of the TensorStore parameter server on disk: its leaves and manifest.

Writing: TensorStore creates one zarr3 array per leaf; a leaf stored as one
uncompressed chunk is then written by this module (its chunk file is exactly the
array's bytes, so it can be written over in place and mapped by readers); chunked
leaves are written by TensorStore. Reading: raw leaves are memory-mapped under the
reader's lease, the others copied through TensorStore. The store around it
(``tensorstore_store``) decides names, publication, leases and eviction.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

from rlaxkit.param_server import layout, treepaths

__all__ = ["WRITE_THREADS", "read_leaves", "recyclable_signature", "signature", "write"]

WRITE_THREADS = 2  # Leaves written at once (each a copy into the page cache).


def signature(arrays: list[np.ndarray]) -> list[list[Any]]:
    """``[dtype name, shape]`` per leaf: versions with equal signatures have files of
    the same sizes."""
    return [[a.dtype.name, list(a.shape)] for a in arrays]


def write(
    into: Path,
    version: int,
    paths: list[treepaths.KeyPath],
    arrays: list[np.ndarray],
    *,
    chunk_bytes: int | None,
    durable: bool,
    context: ts.Context,
    pool: concurrent.futures.Executor,
    recycled: bool,
    on_leaf: Callable[[int], None] | None = None,
) -> None:
    """Writes the arrays into directory ``into``, then the manifest, and (when
    ``durable``) fsyncs them all. ``recycled``: ``into`` holds a version of the same
    :func:`signature`, whose files are written over. ``on_leaf(i)`` follows each leaf.

    Raises:
        ValueError: a leaf's dtype cannot be stored.
    """
    raw = _write_leaves(into, paths, arrays, chunk_bytes, durable, context, pool, recycled, on_leaf)
    manifest = {
        "format": layout.FORMAT,
        "version": version,
        "bytes": sum(a.nbytes for a in arrays),
        "leaves": [
            {
                "path": path,
                "array": f"{i:05d}",
                "dtype": a.dtype.name,
                "shape": list(a.shape),
                "raw": raw_key,
            }
            for i, (path, a, raw_key) in enumerate(zip(paths, arrays, raw, strict=True))
        ],
    }
    # A recycled version's old manifest goes: a reader that opened it before the
    # eviction must not find the new version's lock on it.
    (into / layout.MANIFEST).unlink(missing_ok=True)
    with open(into / layout.MANIFEST, "w") as f:
        json.dump(manifest, f)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    if durable:
        # The data files were fsynced as they were written; the directory entries
        # that name them need an fsync of their own.
        for sub, _, _ in os.walk(into):
            layout.fsync_path(Path(sub))


def _write_leaves(
    into: Path,
    paths: list[treepaths.KeyPath],
    arrays: list[np.ndarray],
    chunk_bytes: int | None,
    durable: bool,
    context: ts.Context,
    pool: concurrent.futures.Executor,
    recycled: bool,
    on_leaf: Callable[[int], None] | None,
) -> list[str | None]:
    """Writes every leaf; returns each leaf's raw chunk file name (``None`` when it
    is chunked or empty, so readers copy it through TensorStore).

    TensorStore creates each leaf's zarr3 array (its ``zarr.json``). A leaf stored as
    one chunk is then written by this process: its chunk file is the array's bytes,
    written over the recycled file's pages when there is one. Chunked leaves are
    written by TensorStore.
    """
    raw: list[str | None] = []
    created: list[Any] = []
    for i, (path, a) in enumerate(zip(paths, arrays, strict=True)):
        whole = [max(1, n) for n in a.shape]
        if chunk_bytes is None:
            grid = whole
        else:
            grid = layout.chunk_shape(a.shape, a.dtype.itemsize, chunk_bytes)
        raw.append(layout.raw_chunk_key(a.ndim) if grid == whole and a.size else None)
        if recycled:  # Its zarr.json already describes this shape and dtype.
            created.append(None)
            continue
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(into / f"{i:05d}")},
            "metadata": {
                "shape": list(a.shape),
                "data_type": a.dtype.name,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": grid}},
                # Chunk files c.0.0, c.1.0, ... side by side: one directory per leaf
                # to fsync and remove, not one per chunk row.
                "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
                # Uncompressed little-endian bytes: a one-chunk leaf's file is the
                # array's memory exactly, ready to be mapped.
                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
            },
        }
        try:
            created.append(ts.open(spec, create=True, context=context))
        except ValueError as e:
            raise ValueError(
                f"leaf {treepaths.path_str(path)}: cannot store a {a.dtype} array: {e}"
            ) from e
    writes: list[Any] = []
    for i, a in enumerate(arrays):
        raw_name = raw[i]
        if raw_name is not None:
            if created[i] is not None:
                created[i].result()  # zarr.json and the leaf's directory exist.
            file = into / f"{i:05d}" / raw_name
            writes.append(
                pool.submit(layout.write_file, file, a, create=not recycled, durable=durable)
            )
        elif a.size:
            # The arrays are not modified during the push (jax arrays never are),
            # so TensorStore may write from them instead of copying them first.
            writes.append(created[i].result().write(a, can_reference_source_data_indefinitely=True))
        else:
            # Nothing to write beyond zarr.json (nothing at all over a recycled version).
            writes.append(created[i])
    for i, write in enumerate(writes):
        if write is not None:
            write.result()
        if on_leaf is not None:
            on_leaf(i)
    return raw


def recyclable_signature(manifest_fd: int) -> list[list[Any]] | None:
    """The :func:`signature` of the version whose manifest is open as ``manifest_fd``
    if its files can be written over (every non-empty leaf one raw chunk), else ``None``."""
    try:
        with open(manifest_fd, closefd=False) as f:
            manifest = json.load(f)
    except ValueError:
        return None
    if manifest.get("format") != layout.FORMAT:
        return None
    leaves = manifest["leaves"]
    if any(leaf["raw"] is None and math.prod(leaf["shape"]) for leaf in leaves):
        return None
    return [[leaf["dtype"], leaf["shape"]] for leaf in leaves]


def read_leaves(
    vdir: Path,
    leaves: list[dict[str, Any]],
    lease: layout.Lease,
    context: ts.Context,
    on_leaf: Callable[[int], None] | None = None,
) -> list[np.ndarray]:
    """The arrays of a version's manifest ``leaves``: raw leaves mapped under ``lease``
    (they keep it while they live), chunked ones (and raw ones on a file system that
    cannot map them) copied through TensorStore. ``on_leaf(i)`` follows each leaf.

    Raises:
        ValueError: a raw leaf's file is missing or of the wrong size (damaged).
    """
    arrays: dict[int, np.ndarray] = {}  # leaf index -> array, mapped or copied
    copied = []
    for i, leaf in enumerate(leaves):
        shape, dtype = tuple(leaf["shape"]), np.dtype(leaf["dtype"])
        raw = leaf.get("raw")
        if raw is not None and sys.byteorder == "little":
            try:
                arrays[i] = layout.map_array(vdir / leaf["array"] / raw, shape, dtype, lease)
            except FileNotFoundError as e:
                # TensorStore would read a missing chunk as zeros: refuse instead.
                raise ValueError(f"{e.filename}: missing; the snapshot is damaged") from e
            except OSError:
                copied.append(i)  # A file system that cannot map it: copy it below.
                continue
        else:
            copied.append(i)
            continue
        if on_leaf is not None:
            on_leaf(i)
    opened = {
        i: ts.open(
            {
                "driver": "zarr3",
                "kvstore": {"driver": "file", "path": str(vdir / leaves[i]["array"])},
            },
            open=True,
            read=True,
            context=context,
        )
        for i in copied
    }
    for i in copied:
        arrays[i] = layout.aligned_empty(tuple(leaves[i]["shape"]), np.dtype(leaves[i]["dtype"]))
    reads = {
        i: ts.array(arrays[i], copy=False, write=True).write(store.result())
        for i, store in opened.items()
    }
    for i, read in reads.items():
        read.result()
        if on_leaf is not None:
            on_leaf(i)
    return [arrays[i] for i in range(len(leaves))]
