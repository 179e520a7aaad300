"""A parameter server of versioned TensorStore snapshots in a directory.

RLAX builds its parameter server on TensorStore (arXiv 2512.06392); this store keeps
each version as one zarr3 array per pytree leaf plus a JSON manifest, so any process
that knows the directory can pull, with no server to run. Layout::

    <directory>/
      latest.json               {"version": 7, "dirname": "v000000000007"}
      v000000000006/            a complete version (manifest.json + one array per leaf)
      v000000000007/
        manifest.json           format, version, bytes, and per leaf: key path, dtype,
        00000/ 00001/ ...       shape, array name (see ``treepaths`` for key paths)
      .tmp-v000000000008-...    a push in progress (never read)

**Publishing.** A push writes every array and then the manifest into a ``.tmp-``
directory, fsyncs them (``durable=True``), renames the directory to its final name in
one atomic step and only then replaces ``latest.json`` atomically (``os.replace``).
Readers follow ``latest.json`` alone, so a half-written version is never visible, and a
writer killed mid-push leaves the previous version as the newest. The next writer
removes the debris of dead writers.

**Eviction and readers: shared-lock leases.** A reader holds a shared ``flock`` on the
version's ``manifest.json`` for as long as it copies that version. The writer evicts a
version only if it gets the exclusive lock *without waiting*; it then renames the
directory away and deletes it on a background thread. A version a reader still holds
is skipped and retried at the next push (so the directory may briefly hold more than
``keep`` versions), which means a slow reader never stalls the trainer and eviction
never pulls files from under a reader. ``flock`` leases vanish with their process, so
a crashed reader leaks nothing. This relies on POSIX ``flock`` on a local file system;
on network file systems, whose lock semantics vary, keep ``keep`` well above the number
of versions a read can span.

**Copies.** Large leaves are stored in chunks of about ``chunk_bytes`` so TensorStore
writes and reads them on several threads. A pull reads into 64-byte-aligned host
buffers, which JAX's CPU client adopts without another copy; on an accelerator the pull
costs one more host-to-device transfer.

One process writes at a time; any number of processes and threads may read.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from rlaxkit.param_server import layout, treepaths
from rlaxkit.param_server.base import (
    EventHook,
    TransferRecord,
    TransferStats,
    check_keep,
    check_new_version,
    pull_timeout_error,
    record_transfer,
)

__all__ = ["TensorStoreParameterServer"]


class TensorStoreParameterServer:
    """Versioned weight snapshots in a directory, readable by any process.

    Args:
        directory: where the snapshots live (created if missing).
        keep: how many of the newest versions to retain.
        template: optional pytree (arrays or ``jax.ShapeDtypeStruct``) with the stored
            tree's key paths; pulls return its tree structure, placed with its leaves'
            shardings when they have them. Without one, a pull returns the structure
            this object last pushed when that matches, else a nested ``dict`` (see
            :func:`rlaxkit.param_server.treepaths.nested_dict`).
        durable: fsync data, manifest, directories and pointer before publishing (safe
            against machine crashes); without it a version is still atomic against a
            killed process, which the page cache survives.
        chunk_bytes: target size of one stored chunk; larger leaves are split so their
            chunks are written and read in parallel.
        poll_interval_s: how often a waiting pull re-reads the pointer.
        on_event: optional ``on_event(kind, version, duration_s=..., bytes=..., ...)``
            called after every push and pull.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keep: int = 2,
        *,
        template: Any = None,
        durable: bool = True,
        chunk_bytes: int = 4 << 20,
        poll_interval_s: float = 0.01,
        on_event: EventHook | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = check_keep(keep)
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes: must be >= 1, got {chunk_bytes}")
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s: must be > 0, got {poll_interval_s}")
        self.template = template
        self.durable = durable
        self.chunk_bytes = chunk_bytes
        self.poll_interval_s = poll_interval_s
        self.on_event = on_event
        self.stats = TransferStats()
        self.deferred_evictions = 0
        self._context = ts.Context({"file_io_sync": durable})
        self._push_lock = threading.Lock()
        self._pushed = threading.Condition()
        self._pushed_tree: tuple[list[treepaths.KeyPath], Any] | None = None
        self._deleter: concurrent.futures.ThreadPoolExecutor | None = None
        self._deletions: list[concurrent.futures.Future] = []
        # Test hooks, called with the leaf index after each leaf is written during a push
        # or read during a pull (the reader then holds its lease); they let tests pause
        # a writer or a reader mid-copy.
        self._leaf_written_hook: Callable[[int], None] | None = None
        self._leaf_read_hook: Callable[[int], None] | None = None

    # ----------------------------------------------------------------- reading
    def latest_version(self) -> int | None:
        """The version ``latest.json`` names, or ``None`` before the first push."""
        try:
            with open(self.directory / layout.POINTER) as f:
                return int(json.load(f)["version"])
        except FileNotFoundError:
            return None

    def versions(self) -> list[int]:
        """The complete versions on disk up to the latest, oldest first."""
        latest = self.latest_version()
        if latest is None:
            return []
        found = (layout.parse_dirname(p.name) for p in self.directory.iterdir())
        return sorted(v for v in found if v is not None and v <= latest)

    def pull(self, min_version: int | None = None, timeout: float | None = None) -> tuple[int, Any]:
        """Returns ``(version, params)`` of the newest version, read from disk.

        Waits until a version ``>= min_version`` is published (any version when
        ``None``), for at most ``timeout`` seconds (forever when ``None``). Leaves come
        back as ``jax.Array`` (on CPU they alias the freshly read buffers).

        Raises:
            TimeoutError: no such version was published within ``timeout``.
            ValueError: the template does not match the stored tree.
        """
        start = time.perf_counter()
        deadline = None if timeout is None else start + timeout
        while True:
            latest = self.latest_version()
            if latest is not None and (min_version is None or latest >= min_version):
                ready_at = time.perf_counter()
                read = self._read_version(latest)
                if read is not None:
                    break
                continue  # Evicted between reading the pointer and locking it: go again.
            remaining = None if deadline is None else deadline - time.perf_counter()
            if remaining is not None and remaining <= 0:
                raise pull_timeout_error(min_version, timeout, latest, str(self.directory))
            wait_s = (
                self.poll_interval_s if remaining is None else min(self.poll_interval_s, remaining)
            )
            with self._pushed:
                self._pushed.wait(wait_s)
        manifest, arrays = read
        params = self._to_tree(manifest, arrays)
        record = TransferRecord(
            kind="pull",
            version=latest,
            duration_s=time.perf_counter() - ready_at,
            bytes=int(manifest["bytes"]),
            wait_s=ready_at - start,
        )
        record_transfer(self.stats, self.on_event, record)
        return latest, params

    def _read_version(self, version: int) -> tuple[dict[str, Any], list[np.ndarray]] | None:
        """Reads one version under a shared lock; ``None`` if it was evicted meanwhile."""
        vdir = self.directory / layout.version_dirname(version)
        try:
            fd = os.open(vdir / layout.MANIFEST, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            # The writer renames a version away under its exclusive lock; if the name no
            # longer leads to the file we locked, that version is gone.
            try:
                same = os.stat(vdir / layout.MANIFEST).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                return None
            with open(fd, closefd=False) as f:
                manifest = json.load(f)
            if manifest.get("format") != layout.FORMAT:
                found = manifest.get("format")
                raise ValueError(f"{vdir}: manifest format {found!r}, expected {layout.FORMAT!r}")
            leaves = manifest["leaves"]
            opened = [
                ts.open(
                    {
                        "driver": "zarr3",
                        "kvstore": {"driver": "file", "path": str(vdir / leaf["array"])},
                    },
                    open=True,
                    read=True,
                    context=self._context,
                )
                for leaf in leaves
            ]
            arrays = [
                layout.aligned_empty(tuple(leaf["shape"]), np.dtype(leaf["dtype"]))
                for leaf in leaves
            ]
            copies = [
                ts.array(out, copy=False, write=True).write(store.result())
                for out, store in zip(arrays, opened, strict=True)
            ]
            for i, copy in enumerate(copies):
                copy.result()
                if self._leaf_read_hook is not None:
                    self._leaf_read_hook(i)
        finally:
            os.close(fd)  # Releases the shared lock.
        return manifest, arrays

    def _to_tree(self, manifest: dict[str, Any], arrays: list[np.ndarray]) -> Any:
        paths = [leaf["path"] for leaf in manifest["leaves"]]
        if self.template is not None:
            treepaths.unflatten_like(self.template, paths, arrays)  # Checks the key paths.
            template_leaves, treedef = jax.tree.flatten(self.template)
            placed = []
            for path, leaf, want in zip(paths, arrays, template_leaves, strict=True):
                if tuple(want.shape) != leaf.shape or np.dtype(want.dtype) != leaf.dtype:
                    raise ValueError(
                        f"leaf {treepaths.path_str(path)}: stored {leaf.dtype}{list(leaf.shape)}"
                        f", template wants {np.dtype(want.dtype)}{list(want.shape)}"
                    )
                placed.append(jax.device_put(leaf, getattr(want, "sharding", None)))
            return jax.tree.unflatten(treedef, placed)
        placed = jax.device_put(arrays)
        pushed = self._pushed_tree
        if pushed is not None and pushed[0] == paths:
            return jax.tree_util.tree_unflatten(pushed[1], placed)
        return treepaths.nested_dict(paths, placed)

    # ----------------------------------------------------------------- writing
    def push(self, version: int, params: Any) -> None:
        """Writes ``params`` as ``version``, publishes it atomically, evicts beyond ``keep``.

        Raises:
            ValueError: ``version`` is not newer than the latest published version, or a
                leaf cannot be stored by name.
        """
        with self._push_lock:
            latest = self.latest_version()
            check_new_version(version, latest)
            version = int(version)
            start = time.perf_counter()
            self._remove_debris(latest)
            self._deletions = [f for f in self._deletions if not f.done()]
            paths, leaves, treedef = treepaths.flatten(params)
            arrays = [np.asarray(x) for x in jax.device_get(leaves)]
            nbytes = sum(a.nbytes for a in arrays)
            final = self.directory / layout.version_dirname(version)
            tmp = self.directory / layout.scratch_name(layout.TMP_PREFIX, final.name)
            tmp.mkdir()
            try:
                self._write_snapshot(tmp, version, paths, arrays)
                os.rename(tmp, final)  # Complete from here on, but not yet named.
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            if self.durable:
                layout.fsync_path(self.directory)
            pointer = {"version": version, "dirname": final.name}
            layout.write_json_atomically(self.directory / layout.POINTER, pointer, self.durable)
            self._pushed_tree = (paths, treedef)
            with self._pushed:
                self._pushed.notify_all()
            self._evict(version)
            duration_s = time.perf_counter() - start
        record = TransferRecord(kind="push", version=version, duration_s=duration_s, bytes=nbytes)
        record_transfer(self.stats, self.on_event, record)

    def _write_snapshot(
        self, into: Path, version: int, paths: list[treepaths.KeyPath], arrays: list[np.ndarray]
    ) -> None:
        """Writes the arrays, then the manifest, and (when durable) fsyncs them all."""
        self._write_leaves(into, paths, arrays)
        manifest = {
            "format": layout.FORMAT,
            "version": version,
            "bytes": sum(a.nbytes for a in arrays),
            "leaves": [
                {"path": path, "array": f"{i:05d}", "dtype": a.dtype.name, "shape": list(a.shape)}
                for i, (path, a) in enumerate(zip(paths, arrays, strict=True))
            ],
        }
        with open(into / layout.MANIFEST, "w") as f:
            json.dump(manifest, f)
            if self.durable:
                f.flush()
                os.fsync(f.fileno())
        if self.durable:
            # TensorStore fsyncs the chunk files it writes (``file_io_sync``); the
            # directory entries that name them need an fsync of their own.
            for sub, _, _ in os.walk(into):
                layout.fsync_path(Path(sub))

    def _write_leaves(
        self, into: Path, paths: list[treepaths.KeyPath], arrays: list[np.ndarray]
    ) -> None:
        opened = []
        for i, (path, a) in enumerate(zip(paths, arrays, strict=True)):
            grid = layout.chunk_shape(a.shape, a.dtype.itemsize, self.chunk_bytes)
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
                },
            }
            try:
                opened.append(ts.open(spec, create=True, context=self._context))
            except ValueError as e:
                raise ValueError(
                    f"leaf {treepaths.path_str(path)}: cannot store a {a.dtype} array: {e}"
                ) from e
        # All writes are in flight at once; TensorStore spreads the chunks over threads.
        # The arrays are not modified during the push (jax arrays never are), so
        # TensorStore may write from them directly instead of copying them first.
        writes = [
            store.result().write(a, can_reference_source_data_indefinitely=True)
            for store, a in zip(opened, arrays, strict=True)
        ]
        for i, write in enumerate(writes):
            write.result()
            if self._leaf_written_hook is not None:
                self._leaf_written_hook(i)

    def _remove_debris(self, latest: int | None) -> None:
        """Deletes what dead writers left: their temp dirs, trash, unpublished versions."""
        for path in self.directory.iterdir():
            name = path.name
            if name.startswith(layout.TRASH_PREFIX):
                if not layout.scratch_owner_alive(name):  # Ours are deleted in the background.
                    shutil.rmtree(path, ignore_errors=True)
            elif name.startswith(layout.TMP_PREFIX):
                # Single writer: a live owner other than us would be a second writer.
                if not layout.scratch_owner_alive(name) or f"-{os.getpid()}-" in name:
                    if path.is_dir():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.unlink(missing_ok=True)
            else:
                version = layout.parse_dirname(name)
                # Renamed into place but never named by the pointer: no reader can see it.
                if version is not None and (latest is None or version > latest):
                    shutil.rmtree(path, ignore_errors=True)

    def _evict(self, latest: int) -> None:
        """Evicts versions older than the newest ``keep`` that no reader holds.

        Renaming a version to trash is the atomic step that takes it from readers;
        deleting its files (slow: the kernel frees their pages) happens on a background
        thread, so the trainer does not wait for it.
        """
        old = [v for v in self.versions()[: -self.keep] if v != latest]
        for version in old:
            vdir = self.directory / layout.version_dirname(version)
            try:
                fd = os.open(vdir / layout.MANIFEST, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    self.deferred_evictions += 1  # A reader holds it; retry next push.
                    continue
                trash = self.directory / layout.scratch_name(layout.TRASH_PREFIX, vdir.name)
                os.rename(vdir, trash)
            finally:
                os.close(fd)
            if self._deleter is None:
                self._deleter = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="param-server-evict"
                )
            self._deletions.append(self._deleter.submit(shutil.rmtree, trash, True))

    def wait_for_cleanup(self) -> None:
        """Waits until the files of evicted versions are deleted."""
        while self._deletions:
            self._deletions.pop().result()

    def __repr__(self) -> str:
        return (
            f"TensorStoreParameterServer({str(self.directory)!r}, keep={self.keep}, "
            f"latest={self.latest_version()})"
        )
