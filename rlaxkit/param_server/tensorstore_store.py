"""A parameter server of versioned TensorStore snapshots in a directory.

RLAX builds its parameter server on TensorStore (arXiv 2512.06392); this store keeps
each version as one zarr3 array per pytree leaf plus a JSON manifest, so any process
that knows the directory can pull, with no server to run. Layout::

    <directory>/
      latest.json               {"version": 7, "dirname": "v000000000007"}
      v000000000006/            a complete version (manifest.json + one array per leaf)
      v000000000007/
        manifest.json           format, version, bytes, and per leaf: key path, dtype,
        00000/ 00001/ ...       shape, array name, raw chunk file (see ``treepaths``
                                for key paths)
      .tmp-v000000000008-...    a push in progress (never read)
      .spare-v000000000005-...  an evicted version whose files the next push overwrites

**Publishing.** A push writes every array and then the manifest into a ``.tmp-``
directory, renames the directory to its final name in one atomic step and only then
replaces ``latest.json`` atomically (``os.replace``). Readers follow ``latest.json``
alone, so a half-written version is never visible, and a writer killed mid-push leaves
the previous version as the newest. The next writer removes the debris of dead writers.

**No fsync by default.** Atomic renames are what protect readers from a killed writer;
fsync adds nothing there. It only matters if the *machine* crashes: the page cache is
lost and a published version may lack data that never reached the disk. Surviving that
is the checkpoint's job (the trainer restarts from its checkpoint and pushes again), not
the parameter server's, and an fsync per push costs the disk's write bandwidth (on the
test machine, push + pull of 256 MB ran at about 0.4 of a memory copy's speed with
fsync, what the disk's own write + fsync allows, and above 1 without).
``durable=True`` fsyncs data, manifest, directories and pointer before publishing, for
a directory that must outlive machine crashes. A reader that finds a leaf file of the
wrong size says the snapshot is damaged.

**Copies.** Each leaf is a zarr3 array of one uncompressed chunk, so its chunk file
holds exactly the array's bytes (any zarr3 reader, TensorStore included, reads a leaf).
TensorStore creates the arrays (their ``zarr.json``); the push writes each chunk file
from the trainer's host arrays itself (one copy, into the page cache, two leaves at a
time; see ``snapshot``), and a reader *memory-maps* the chunk files instead of copying
them: a pulled ``jax.Array`` on CPU aliases the page cache (on an accelerator,
``device_put`` makes the one host-to-device copy from it). With ``chunk_bytes`` set,
larger leaves are split into chunks that TensorStore writes and readers copy.

**Recycling.** A new file needs fresh memory pages, and their first touch is most of
what writing costs (on the test machine, 256 MB took 0.1-0.7 s onto fresh pages and
about 40 ms over pages in use). So the first version evicted by a push is kept as a
spare (``.spare-*``), and the next push of a tree of the same shapes and dtypes writes
over its files in place. Nothing can see a spare: it was renamed away under the
exclusive lock, so no reader held it and none can reach it.

**Leases: readers hold versions, Python reference counting ends the hold.** A reader
holds a shared ``flock`` on the version's ``manifest.json`` while it reads that version
and for as long as any array mapped from it is alive (the lease ends when the last such
array is garbage-collected; JAX lets go of host memory it aliases at its next call or a
gc pass). The writer evicts a version only if it gets the exclusive
lock *without waiting*; it then renames the directory away, to be recycled or deleted
on a background thread. A version a reader holds is skipped and retried at the next push
(so the directory holds ``keep`` versions plus those readers still use), which means a
slow reader never stalls the trainer and eviction never pulls files from under a
reader. ``flock`` leases vanish with their process, so a crashed reader leaks nothing.
This relies on POSIX ``flock`` and ``mmap`` on a local file system; on network file
systems, whose lock semantics vary, keep ``keep`` well above the number of versions a
reader can hold.

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

from rlaxkit.param_server import layout, snapshot, treepaths
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
            against machine crashes, at the disk's write bandwidth); without it (the
            default) a version is still atomic against a killed process, which the page
            cache survives (see the module docstring).
        chunk_bytes: ``None`` (the default) stores each leaf as one raw chunk that
            readers memory-map; a size splits larger leaves into chunks of about that
            many bytes, which readers copy.
        poll_interval_s: how often a waiting pull re-reads the pointer.
        on_event: optional ``on_event(kind, version, duration_s=..., bytes=..., ...)``
            called after every push and pull.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keep: int = 2,
        *,
        template: object = None,
        durable: bool = False,
        chunk_bytes: int | None = None,
        poll_interval_s: float = 0.01,
        on_event: EventHook | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = check_keep(keep)
        if chunk_bytes is not None and chunk_bytes < 1:
            raise ValueError(
                f"chunk_bytes: must be None (one chunk per leaf) or >= 1, got {chunk_bytes}"
            )
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s: must be > 0, got {poll_interval_s}")
        self.template = template
        self.durable = durable
        self.chunk_bytes = chunk_bytes
        self.poll_interval_s = poll_interval_s
        self.on_event = on_event
        self.stats = TransferStats()
        self.deferred_evictions = 0
        self._pinned: int | None = None  # Kept beyond ``keep`` (see ``push``).
        self._context = ts.Context({"file_io_sync": durable})
        self._push_lock = threading.Lock()
        self._pushed = threading.Condition()
        self._pushed_tree: tuple[list[treepaths.KeyPath], object] | None = None
        self._deleter: concurrent.futures.ThreadPoolExecutor | None = None
        self._writer = concurrent.futures.ThreadPoolExecutor(  # Threads start on first use.
            max_workers=snapshot.WRITE_THREADS, thread_name_prefix="param-server-write"
        )
        # Evicted versions kept for their files (see _evict): (path, [dtype, shape] per leaf).
        self._spares: list[tuple[Path, list[list[object]]]] = []
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
        back as ``jax.Array``; on CPU they alias the mapped files and hold the version (see
        the module docstring).

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
                if read is None:
                    continue  # Evicted between reading the pointer and locking it: go again.
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
            remaining = None if deadline is None else deadline - time.perf_counter()
            if remaining is not None and remaining <= 0:
                raise pull_timeout_error(min_version, timeout, latest, str(self.directory))
            wait_s = (
                self.poll_interval_s if remaining is None else min(self.poll_interval_s, remaining)
            )
            with self._pushed:
                self._pushed.wait(wait_s)

    def read(self, version: int) -> dict[object, object] | None:
        """The host arrays of ``version`` as a nested ``dict`` (see
        :func:`rlaxkit.param_server.treepaths.nested_dict`; raw leaves mapped, holding the
        version's lease while they live), or ``None`` if it is not on disk.

        No template, no device placement and no transfer record: a caller that reads
        versions one by one (the delta client, ``delta_store``) decides what to use of
        them and accounts for it.
        """
        read = self._read_version(int(version))
        if read is None:
            return None
        manifest, arrays = read
        return treepaths.nested_dict([leaf["path"] for leaf in manifest["leaves"]], arrays)

    def _read_version(self, version: int) -> tuple[dict[str, Any], list[np.ndarray]] | None:
        """Reads one version under its lease; ``None`` if it was evicted meanwhile.

        Raw leaves are mapped and keep the lease while they live; chunked leaves (and
        raw ones on a file system that cannot map them) are copied under it.
        """
        vdir = self.directory / layout.version_dirname(version)
        try:
            lease = layout.Lease(vdir / layout.MANIFEST)
        except FileNotFoundError:
            return None
        try:
            # The writer renames a version away under its exclusive lock; if the name no
            # longer leads to the file we locked, that version is gone.
            try:
                same = os.stat(vdir / layout.MANIFEST).st_ino == os.fstat(lease.fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                return None
            with open(lease.fd, closefd=False) as f:
                manifest = json.load(f)
            if manifest.get("format") not in layout.READABLE_FORMATS:
                found = manifest.get("format")
                raise ValueError(f"{vdir}: manifest format {found!r}, expected {layout.FORMAT!r}")
            arrays = snapshot.read_leaves(
                vdir, manifest["leaves"], lease, self._context, self._leaf_read_hook
            )
        finally:
            del lease  # Mapped arrays keep it; with none, the lock is released here.
        return manifest, arrays

    def _to_tree(self, manifest: dict[str, Any], arrays: list[np.ndarray]) -> object:
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
    def push(self, version: int, params: object, *, pin: bool = False) -> None:
        """Writes ``params`` as ``version``, publishes it atomically, evicts beyond ``keep``.

        Args:
            pin: this writer keeps this version, beyond the ``keep`` newest, until its
                next pinned push (a LoRA run's base record, ``adapters``). A new writer
                (a restarted trainer) does not know it and evicts it as any other.

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
            spare = self._take_spare(arrays)
            if spare is None:
                tmp.mkdir()
            else:
                os.rename(spare, tmp)
            try:
                snapshot.write(
                    tmp,
                    version,
                    paths,
                    arrays,
                    chunk_bytes=self.chunk_bytes,
                    durable=self.durable,
                    context=self._context,
                    pool=self._writer,
                    recycled=spare is not None,
                    on_leaf=self._leaf_written_hook,
                )
                os.rename(tmp, final)  # Complete from here on, but not yet named.
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            if self.durable:
                layout.fsync_path(self.directory)
            pointer = {"version": version, "dirname": final.name}
            layout.write_json_atomically(self.directory / layout.POINTER, pointer, self.durable)
            self._pushed_tree = (paths, treedef)
            if pin:
                self._pinned = version
            with self._pushed:
                self._pushed.notify_all()
            self._evict(version)
            duration_s = time.perf_counter() - start
        record = TransferRecord(kind="push", version=version, duration_s=duration_s, bytes=nbytes)
        record_transfer(self.stats, self.on_event, record)

    def _take_spare(self, arrays: list[np.ndarray]) -> Path | None:
        """An evicted version whose files fit ``arrays`` exactly, to be written over;
        spares that do not fit (the tree changed) are deleted."""
        signature = snapshot.signature(arrays)
        found = None
        while self._spares:
            path, spare_signature = self._spares.pop()
            if found is None and spare_signature == signature and self.chunk_bytes is None:
                found = path
            else:
                self._delete_in_background(path)
        return found

    def _remove_debris(self, latest: int | None) -> None:
        """Deletes what dead writers left: their temp dirs, trash, spares, unpublished
        versions."""
        mine = f"-{os.getpid()}-"
        spares = {path.name for path, _ in self._spares}
        for path in self.directory.iterdir():
            name = path.name
            if name.startswith(layout.TRASH_PREFIX):
                if not layout.scratch_owner_alive(name):  # Ours are deleted in the background.
                    shutil.rmtree(path, ignore_errors=True)
            elif name.startswith(layout.SPARE_PREFIX):
                # Single writer: a live owner other than this object would be a second one.
                alive = layout.scratch_owner_alive(name)
                if name not in spares and (not alive or mine in name):
                    shutil.rmtree(path, ignore_errors=True)
            elif name.startswith(layout.TMP_PREFIX):
                # Single writer: a live owner other than us would be a second writer.
                if not layout.scratch_owner_alive(name) or mine in name:
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

        Renaming a version away is the atomic step that takes it from readers. The first
        one becomes the spare whose files the next push overwrites (pages already in
        memory, where new files would need fresh ones); the others are deleted on a
        background thread (slow: the kernel frees their pages), so the trainer does not
        wait for it.
        """
        unpinned = [v for v in self.versions() if v != self._pinned]
        old = [v for v in unpinned[: -self.keep] if v != latest]
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
                # No reader holds it, and once renamed no reader can reach it: its files
                # may be overwritten.
                signature = None
                if not self._spares and self.chunk_bytes is None:
                    signature = snapshot.recyclable_signature(fd)
                prefix = layout.TRASH_PREFIX if signature is None else layout.SPARE_PREFIX
                moved = self.directory / layout.scratch_name(prefix, vdir.name)
                os.rename(vdir, moved)
            finally:
                os.close(fd)
            if signature is None:
                self._delete_in_background(moved)
            else:
                self._spares.append((moved, signature))

    def _delete_in_background(self, path: Path) -> None:
        if self._deleter is None:
            self._deleter = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="param-server-evict"
            )
        self._deletions.append(self._deleter.submit(shutil.rmtree, path, True))

    def wait_for_cleanup(self) -> None:
        """Waits until the files of evicted versions are deleted."""
        while self._deletions:
            self._deletions.pop().result()

    def __repr__(self) -> str:
        return (
            f"TensorStoreParameterServer({str(self.directory)!r}, keep={self.keep}, "
            f"latest={self.latest_version()})"
        )
