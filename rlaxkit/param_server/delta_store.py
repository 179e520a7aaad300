"""Delta publication: a push stores, and a pull fetches, only the chunks that changed.

:class:`DeltaParameterServer` wraps any store that can :meth:`read` a retained version
(the in-process, TensorStore and Ray stores) and implements the ``ParameterServer``
protocol on top of it. What it pushes to that store is not the weights but a *record*,
a flat dict of five arrays:

- ``meta``: JSON (as ``uint8``): format, chunk size, and each leaf's key path, dtype
  and shape;
- ``sums``: the checksum of every chunk of the version (``delta.chunk_checksums``);
- ``owner``: for every chunk, the version whose record holds its bytes;
- ``changed``, ``payload``: the chunks this record holds and their bytes;
- ``patch_base``, ``patch_masks``, ``patch_values``, ``patch_counts``: the word patches
  (``delta.word_patches``) that turn the changed chunks of version ``patch_base`` (the
  previous push) into this version's, when they are smaller than the chunks (else
  ``patch_base`` is -1 and they are empty);
- ``skeleton``: the pickled tree of ``jax.ShapeDtypeStruct`` leaves, which a reader
  with no template of its own rebuilds its pulls in (an ``nnx.State`` comes back an
  ``nnx.State`` through any store, as it does through Ray's unwrapped).

A push hashes the new weights, compares the checksums with the previous push's and
stores the chunks that differ (``owner`` = this version for them, the previous owner
for the rest). Every ``snapshot_every``-th push, the first push of a client, and any
push whose tree's leaves differ from the previous one store every chunk: a *full
snapshot*, so the owners of a version lie within its last ``snapshot_every`` pushes.

A pull reads the newest record's ``sums`` and ``owner``, compares them with the
checksums of the version the client holds (its previous pull, or nothing), and reads
each differing chunk from the record of its owner: every chunk once, from where it was
last written. So a client that holds nothing, or whose version was evicted long ago,
catches up in one pass over the model's bytes (the snapshot's chunks plus the later
deltas' chunks, never a chunk twice), and a client one version behind (holding
``patch_base``) reads only the word patches. The result is exact bit for bit up to a
SHA-256 collision between two versions of a chunk (``delta`` module docstring). Leaves
with no changed chunk are the held arrays themselves; changed ones are new buffers (the
held ones are never written, since pulled arrays may alias them).

**Retention.** A version's owners must still be stored when it is read, so the wrapped
store must keep at least ``snapshot_every`` versions (it keeps ``keep`` and a reader
needs the newest; ``keep + snapshot_every - 1`` lets the newest ``keep`` all be read).
If a push evicts an owner while a pull reads, the pull starts over on the newest.

**When it pays.** After an optimizer step on float32 weights with Adam nearly every
element changes by a few bits, so every chunk of 64 KiB or more changes; the word
patches still halve what a reader one version behind reads (the high word of most
floats stays), and for weights rounded to bfloat16, where 2.4% of the elements change,
they cut it to about 9% (``benchmarks/weight_delta.py``, after a real GRPO step).
Leaves no step touches (frozen weights, the base of a merged LoRA) cost nothing. It
costs the pusher a SHA-256 pass (about 1.4 GB/s a core) and a copy of the weights, and
the puller a copy of each changed leaf and the patching: it pays where the bytes cross
a slower link than memory. A delta record holds the changed chunks *and* their patches
(the chunks serve readers further behind), so when most chunks change a push writes
more than a full one (about 1.5 times for float32 after a real step). Pull bytes count
what a pull reads: the TensorStore store maps a record and touches only those pages,
and the Ray store, which moves objects whole, puts each part of a record as an object
of its own (``split_records``) for a reader to fetch the parts it uses.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pickle
import threading
import time
from typing import Any, Protocol

import jax
import numpy as np

from rlaxkit.param_server import treepaths
from rlaxkit.param_server.base import (
    EventHook,
    ParameterServer,
    TransferRecord,
    TransferStats,
    check_new_version,
    pull_timeout_error,
    record_transfer,
)
from rlaxkit.param_server.delta import (
    ChunkLayout,
    byte_view,
    changed_chunks,
    check_chunk_bytes,
    chunk_checksums,
    gather_chunks,
    patch_chunks,
    patch_nbytes,
    word_patches,
)
from rlaxkit.param_server.layout import aligned_empty
from rlaxkit.rules.validation import check_int

__all__ = ["FORMAT", "DeltaParameterServer", "ParamServerConfig", "ReadableStore", "delta_keep"]

FORMAT = "rlaxkit.param_server.delta/1"
_HASH_THREADS = max(1, min(4, os.cpu_count() or 1))  # hashlib releases the GIL.
_HASHER: concurrent.futures.ThreadPoolExecutor | None = None
_HASHER_LOCK = threading.Lock()


def _hasher() -> concurrent.futures.ThreadPoolExecutor:
    """The threads every pusher of this process hashes on (started on first use)."""
    global _HASHER
    with _HASHER_LOCK:
        if _HASHER is None:
            _HASHER = concurrent.futures.ThreadPoolExecutor(
                max_workers=_HASH_THREADS, thread_name_prefix="param-server-hash"
            )
        return _HASHER


class ReadableStore(ParameterServer, Protocol):
    """A parameter server that can also read any version it retains."""

    def read(self, version: int) -> Any | None:
        """The tree pushed as ``version`` (host arrays), or ``None`` once evicted."""
        ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamServerConfig:
    """How weights are published (the run config's ``param_server`` section).

    Attributes:
        delta: publish through :class:`DeltaParameterServer`: pushes store and pulls read
            only what changed. Off by default: it costs the pusher a hash and a copy of
            every byte, and on one host (the page cache) a full pull is faster; it pays
            where bytes cross a slow link (``benchmarks/weight_delta.py``).
        snapshot_every: with ``delta``, every this many pushes store every chunk; the
            store must keep at least this many versions (``runtime.keep_versions``).
        chunk_bytes: with ``delta``, the chunk size in bytes (>= 4096).
    """

    delta: bool = False
    snapshot_every: int = 4
    chunk_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not isinstance(self.delta, bool):
            raise ValueError(f"delta: must be true or false, got {self.delta!r}")
        check_int("snapshot_every", self.snapshot_every, minimum=1)
        check_int(
            "chunk_bytes",
            self.chunk_bytes,
            minimum=4096,
            allowed="an int >= 4096 (bytes; every chunk costs a checksum and bookkeeping)",
        )

    def wrap(
        self,
        server: ReadableStore,
        *,
        template: object = None,
        default_timeout_s: float | None = None,
        on_event: EventHook | None = None,
    ) -> ParameterServer:
        """``server`` itself without ``delta``, else a :class:`DeltaParameterServer` over
        it (give ``server`` no ``on_event`` of its own then)."""
        if not self.delta:
            return server
        return DeltaParameterServer(
            server,
            snapshot_every=self.snapshot_every,
            chunk_bytes=self.chunk_bytes,
            template=template,
            default_timeout_s=default_timeout_s,
            on_event=on_event,
        )


def delta_keep(keep: int, snapshot_every: int) -> int:
    """Versions the wrapped store must retain so that its newest ``keep`` versions can
    all be read: each needs the records of up to ``snapshot_every - 1`` earlier pushes.

    >>> delta_keep(2, 8)
    9
    """
    return keep + snapshot_every - 1


@dataclasses.dataclass(frozen=True)
class _Published:
    """What the pusher remembers of its previous push: enough to diff the next one."""

    version: int
    leaves: list[dict[str, Any]]
    buffers: list[np.ndarray]  # A copy of its bytes, for the next push's word patches.
    sums: np.ndarray
    owner: np.ndarray
    since_snapshot: int  # Pushes after the last full snapshot.


@dataclasses.dataclass(frozen=True)
class _Held:
    """What the puller holds: a version's flat byte buffers and their checksums."""

    version: int
    meta: dict[str, Any]
    layout: ChunkLayout
    buffers: list[np.ndarray]
    sums: np.ndarray
    skeleton: bytes


_NO_PATCHES = (np.empty(0, np.uint8), np.empty(0, np.uint16), np.empty(0, np.int64))


class _Evicted(Exception):
    """A record the pull needed is gone (a push evicted it meanwhile)."""


class DeltaParameterServer:
    """The ``ParameterServer`` protocol over delta records in another store.

    >>> import numpy as np
    >>> from rlaxkit.param_server import InProcessParameterServer
    >>> store = DeltaParameterServer(InProcessParameterServer(keep=4), snapshot_every=4,
    ...                              chunk_bytes=64)
    >>> weights = {"w": np.zeros(1024, np.float32)}  # 4096 bytes: 64 chunks
    >>> store.push(1, weights)
    >>> store.pull()[0], store.stats.last("pull").bytes - store.metadata_bytes
    (1, 4096)
    >>> weights["w"][:16] = 1.0  # the first chunk changes: the high word of 16 floats
    >>> store.push(2, weights)
    >>> version, params = store.pull()
    >>> version, store.stats.last("pull").bytes - store.metadata_bytes
    (2, 44)
    >>> bool(np.array_equal(params["w"], weights["w"]))
    True

    One version behind, the pull read that chunk's word patch: a 4-byte mask of its 32
    words, 16 new words (32 bytes) and their count (8 bytes), not its 64 bytes.

    Args:
        inner: the store that holds the records; it must keep at least
            ``snapshot_every`` versions (:func:`delta_keep` for how many readers need).
            Give it no ``on_event`` hook: this object reports the transfers.
        snapshot_every: every this many pushes store a full snapshot (1: every push).
        chunk_bytes: the chunk size in bytes (smaller chunks find sparser changes and
            cost more checksums and bookkeeping).
        template: optional pytree with the weights' key paths; pulls return its
            structure, placed with its leaves' shardings. Without one, a pull returns
            the structure this object last pushed when that matches, else a nested
            ``dict`` (:func:`rlaxkit.param_server.treepaths.nested_dict`).
        poll_interval_s: how often a waiting pull asks the store again.
        default_timeout_s: the timeout of a pull that gives none (``None``: wait
            forever, as the protocol says).
        on_event: optional ``on_event(kind, version, duration_s=..., bytes=..., ...)``.
    """

    def __init__(
        self,
        inner: ReadableStore,
        *,
        snapshot_every: int = 8,
        chunk_bytes: int = 1 << 20,
        template: object = None,
        poll_interval_s: float = 0.01,
        default_timeout_s: float | None = None,
        on_event: EventHook | None = None,
    ) -> None:
        self.snapshot_every = check_int("snapshot_every", snapshot_every, minimum=1)
        self.chunk_bytes = check_chunk_bytes(chunk_bytes)
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s: must be > 0, got {poll_interval_s}")
        if hasattr(inner, "retain_pushes"):  # Ray: republish() must restore the owners.
            inner.retain_pushes = max(inner.retain_pushes, snapshot_every)
        if hasattr(inner, "split_records"):  # Ray: fetch only the parts a pull uses.
            inner.split_records = True
        self.inner = inner
        self.template = template
        self.poll_interval_s = poll_interval_s
        self.default_timeout_s = default_timeout_s
        self.on_event = on_event
        self.stats = TransferStats()
        self.metadata_bytes = 0  # Of the newest record: meta, sums and owner arrays.
        self._push_lock = threading.Lock()
        self._pull_lock = threading.Lock()
        self._published: _Published | None = None
        self._held: _Held | None = None
        self._pushed_tree: tuple[list[treepaths.KeyPath], object] | None = None
        self._layouts: dict[str, ChunkLayout] = {}
        self._skeleton: tuple[bytes, object] = (b"", None)  # (pickled, unpickled), last used

    def __getstate__(self) -> dict[str, object]:
        # A client travels without what it pushed or holds: its first push is a full
        # snapshot and its first pull reads every chunk.
        return {
            "inner": self.inner,
            "snapshot_every": self.snapshot_every,
            "chunk_bytes": self.chunk_bytes,
            "template": self.template,
            "poll_interval_s": self.poll_interval_s,
            "default_timeout_s": self.default_timeout_s,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        DeltaParameterServer.__init__(self, state.pop("inner"), **state)

    # ----------------------------------------------------------------- passthrough
    def latest_version(self) -> int | None:
        """The newest published version, or ``None`` before the first push."""
        return self.inner.latest_version()

    def versions(self) -> list[int]:
        """The versions the wrapped store retains, oldest first."""
        versions = getattr(self.inner, "versions", None)
        return [] if versions is None else list(versions())

    def republish(self) -> int | None:
        """The wrapped store's ``republish`` (Ray: after its actor restarted empty)."""
        republish = getattr(self.inner, "republish", None)
        return None if republish is None else republish()

    # ----------------------------------------------------------------- pushing
    def push(self, version: int, params: object, *, reset: bool = False) -> None:
        """Publishes ``params`` as ``version``: the chunks changed since the previous push,
        or every chunk (a full snapshot; see the module docstring).

        Args:
            reset: forget what was pushed before (a restarted trainer, whose store lost
                its versions): this push is a full snapshot, and the wrapped store is
                told to reset too.

        Raises:
            ValueError: ``version`` is not newer than the latest published version.
        """
        inner_keep = getattr(self.inner, "keep", None)  # The store that evicts: the pusher's.
        if isinstance(inner_keep, int) and inner_keep < self.snapshot_every:
            raise ValueError(
                f"snapshot_every: the wrapped store keeps {inner_keep} versions, fewer than "
                f"snapshot_every={self.snapshot_every}, so the chunks of its newest version "
                "could be evicted; keep at least delta_keep(keep, snapshot_every) versions "
                "there or lower snapshot_every"
            )
        with self._push_lock:
            if not reset:
                check_new_version(version, self.inner.latest_version())
            version = int(version)
            start = time.perf_counter()
            paths, leaves, treedef = treepaths.flatten(params)
            arrays = [np.asarray(x) for x in jax.device_get(leaves)]
            buffers = [byte_view(a) for a in arrays]
            meta_leaves = [
                {"path": p, "dtype": a.dtype.name, "shape": list(a.shape)}
                for p, a in zip(paths, arrays, strict=True)
            ]
            meta = {"format": FORMAT, "chunk_bytes": self.chunk_bytes, "leaves": meta_leaves}
            if self._pushed_tree is None or self._pushed_tree[1] != treedef:
                abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
                skeleton = pickle.dumps(jax.tree.unflatten(treedef, abstract))
                self._skeleton = (skeleton, None)
            layout = self._layout(meta)
            sums = self._checksums(buffers)
            previous = None if reset else self._published
            full = (
                previous is None
                or previous.leaves != meta_leaves
                or previous.since_snapshot + 1 >= self.snapshot_every
            )
            patches = None
            if full or previous is None:
                changed = np.arange(layout.num_chunks, dtype=np.int64)
                owner = np.full(layout.num_chunks, version, np.int64)
            else:
                changed = changed_chunks(previous.sums, sums)
                owner = previous.owner.copy()
                owner[changed] = version
                patches = word_patches(previous.buffers, buffers, layout, changed)
                if patches is not None and (
                    patch_nbytes(layout, changed, patches[2]) >= layout.payload_bytes(changed)
                ):
                    patches = None  # No smaller than the chunks themselves.
            masks, values, counts = patches or _NO_PATCHES
            base = previous.version if patches is not None and previous is not None else -1
            record = {
                "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8).copy(),
                "sums": sums,
                "owner": owner,
                "changed": changed,
                "payload": gather_chunks(buffers, layout, changed),
                "skeleton": np.frombuffer(self._skeleton[0], np.uint8).copy(),
                "patch_base": np.asarray(base, np.int64),
                "patch_masks": masks,
                "patch_values": values.view(np.uint8),
                "patch_counts": counts,
            }
            if reset:
                self.inner.push(version, record, reset=True)  # type: ignore[call-arg]
            else:
                self.inner.push(version, record)
            since = 0 if full or previous is None else previous.since_snapshot + 1
            # The next push's patches need these bytes as they are now: the pushed arrays
            # may change after this call (a numpy array written in place, a jax buffer
            # donated to the next train step), so keep a copy, in the previous one's memory.
            same = previous is not None and previous.leaves == meta_leaves
            kept = previous.buffers if same and previous is not None else None
            if kept is None:
                kept = [np.empty(b.size, np.uint8) for b in buffers]
            for into, now in zip(kept, buffers, strict=True):
                np.copyto(into, now)
            self._published = _Published(version, meta_leaves, kept, sums, owner, since)
            self._pushed_tree = (paths, treedef)
            nbytes = sum(a.nbytes for a in record.values())
            duration_s = time.perf_counter() - start
        push = TransferRecord(kind="push", version=version, duration_s=duration_s, bytes=nbytes)
        record_transfer(self.stats, self.on_event, push)

    def _checksums(self, buffers: list[np.ndarray]) -> np.ndarray:
        """Every chunk's checksum, leaves hashed on several threads."""
        parts = list(_hasher().map(lambda b: chunk_checksums(b, self.chunk_bytes), buffers))
        return np.concatenate([np.empty((0, 16), np.uint8), *parts])

    def _layout(self, meta: dict[str, Any]) -> ChunkLayout:
        """The chunk layout a record's ``meta`` describes (cached by its text)."""
        key = json.dumps([meta["chunk_bytes"], meta["leaves"]])
        layout = self._layouts.get(key)
        if layout is None:
            leaf_bytes = [
                int(np.prod(leaf["shape"], dtype=np.int64)) * np.dtype(leaf["dtype"]).itemsize
                for leaf in meta["leaves"]
            ]
            layout = ChunkLayout.of(leaf_bytes, int(meta["chunk_bytes"]))
            self._layouts = {key: layout}  # The tree rarely changes: keep one.
        return layout

    # ----------------------------------------------------------------- pulling
    def pull(self, min_version: int | None = None, timeout: float | None = None) -> tuple[int, Any]:
        """Returns ``(version, params)`` of the newest version, reading only the chunks
        that differ from what this client holds.

        Waits until a version ``>= min_version`` exists (any version when ``None``), for
        at most ``timeout`` seconds (forever when ``None``).

        Raises:
            TimeoutError: no such version was published within ``timeout``.
            ValueError: a record is not a delta record, or lacks a chunk it should hold.
        """
        timeout = self.default_timeout_s if timeout is None else timeout
        start = time.perf_counter()
        deadline = None if timeout is None else start + timeout
        while True:
            latest = self.inner.latest_version()
            if latest is not None and (min_version is None or latest >= min_version):
                ready_at = time.perf_counter()
                try:
                    with self._pull_lock:
                        held, nbytes = self._catch_up(latest)
                except _Evicted:
                    if self.inner.latest_version() == latest:
                        raise RuntimeError(
                            f"version {latest}: a record its chunks are in is no longer "
                            "stored; the wrapped store keeps too few versions (keep at least "
                            "delta_keep(keep, snapshot_every))"
                        ) from None
                    continue  # Pushes evicted what we read: go again on the newest.
                params = self._to_tree(held)
                pull = TransferRecord(
                    kind="pull",
                    version=latest,
                    duration_s=time.perf_counter() - ready_at,
                    bytes=nbytes,
                    wait_s=ready_at - start,
                )
                record_transfer(self.stats, self.on_event, pull)
                return latest, params
            remaining = None if deadline is None else deadline - time.perf_counter()
            if remaining is not None and remaining <= 0:
                raise pull_timeout_error(min_version, timeout, latest, "the delta store")
            time.sleep(
                self.poll_interval_s if remaining is None else min(self.poll_interval_s, remaining)
            )

    def _read(self, version: int) -> dict[str, object]:
        record = self.inner.read(version)
        if record is None:
            raise _Evicted(version)
        return record

    def _catch_up(self, version: int) -> tuple[_Held, int]:
        """The held state at ``version`` and the bytes read to get there."""
        held = self._held
        if held is not None and held.version == version:
            return held, 0
        record = self._read(version)
        meta = json.loads(np.asarray(record["meta"]).tobytes())
        if meta.get("format") != FORMAT:
            raise ValueError(
                f"version {version}: not a delta record (format {meta.get('format')!r})"
            )
        layout = self._layout(meta)
        sums, owner = np.asarray(record["sums"]), np.asarray(record["owner"])
        self.metadata_bytes = int(np.asarray(record["meta"]).nbytes + sums.nbytes + owner.nbytes)
        same_tree = held is not None and held.meta == meta
        need = changed_chunks(held.sums if held is not None and same_tree else None, sums)
        if (
            held is not None
            and same_tree
            and "patch_base" in record
            and int(np.asarray(record["patch_base"])) == held.version
        ):
            return self._patch(held, version, record, meta, layout, sums, need)
        # Where each needed chunk is: the payload of its owner's record, at an offset.
        payloads: dict[int, np.ndarray] = {}
        source = np.empty(need.size, np.int64)
        position = np.empty(need.size, np.int64)
        owners = owner[need]
        for owner_version in np.unique(owners).tolist():
            mine = owners == owner_version
            ids = need[mine]
            found = record if owner_version == version else self._read(owner_version)
            stored = np.asarray(found["changed"])
            at = np.searchsorted(stored, ids)
            if np.any(at >= stored.size) or np.any(stored[np.minimum(at, stored.size - 1)] != ids):
                raise ValueError(
                    f"version {version}: the record of version {owner_version} lacks chunks "
                    "its owner table assigns to it; the store is damaged or mixes two pushers"
                )
            payloads[owner_version] = np.asarray(found["payload"])
            source[mine] = owner_version
            position[mine] = layout.offsets(stored)[at]
        buffers: list[np.ndarray] = []
        counts = np.bincount(layout.leaf, minlength=len(layout.leaf_bytes))
        needed_leaf = layout.leaf[need]
        for i, nbytes in enumerate(layout.leaf_bytes):
            old = held.buffers[i] if held is not None and same_tree else None
            mine = needed_leaf == i
            if old is not None and not np.any(mine):
                buffers.append(old)  # Unchanged: the same (read-only) buffer.
                continue
            ids, sources, positions = need[mine], source[mine], position[mine]
            if (
                ids.size == counts[i]
                and ids.size
                and np.all(sources == sources[0])
                and np.all(positions - positions[0] == layout.start[ids])
            ):
                # The whole leaf lies in one record, in one piece: use it where it is
                # (mapped, for the TensorStore store), not a copy.
                at = int(positions[0])
                buffers.append(payloads[int(sources[0])][at : at + nbytes])
                continue
            new = aligned_empty((nbytes,), np.dtype(np.uint8))  # JAX aliases aligned memory.
            if old is not None:
                np.copyto(new, old)
            for g, owner_version, at in zip(
                ids.tolist(), sources.tolist(), positions.tolist(), strict=True
            ):
                start, size = int(layout.start[g]), int(layout.size[g])
                new[start : start + size] = payloads[owner_version][at : at + size]
            buffers.append(new)
        for buffer in buffers:
            buffer.flags.writeable = False
        skeleton = np.asarray(record["skeleton"]).tobytes() if "skeleton" in record else b""
        self._held = _Held(version, meta, layout, buffers, sums, skeleton)
        return self._held, self.metadata_bytes + layout.payload_bytes(need)

    def _patch(
        self,
        held: _Held,
        version: int,
        record: dict[str, Any],
        meta: dict[str, Any],
        layout: ChunkLayout,
        sums: np.ndarray,
        need: np.ndarray,
    ) -> tuple[_Held, int]:
        """The held state at ``version`` from the word patches of its record, made
        against the version this client holds (see ``delta``)."""
        changed = np.asarray(record["changed"])
        if not np.array_equal(changed, need):
            raise ValueError(
                f"version {version}: its record patches chunks other than those that differ "
                f"from version {held.version}; the store is damaged or mixes two pushers"
            )
        counts = np.asarray(record["patch_counts"])
        touched = set(np.unique(layout.leaf[need]).tolist())
        buffers = []
        for i, old in enumerate(held.buffers):
            if i in touched:
                new = aligned_empty(old.shape, np.dtype(np.uint8))
                np.copyto(new, old)
                old = new
            buffers.append(old)
        values = np.asarray(record["patch_values"]).view(np.uint16)
        patch_chunks(buffers, layout, need, np.asarray(record["patch_masks"]), values, counts)
        for buffer in buffers:
            buffer.flags.writeable = False
        skeleton = np.asarray(record["skeleton"]).tobytes()
        self._held = _Held(version, meta, layout, buffers, sums, skeleton)
        moved = self.metadata_bytes + counts.nbytes + patch_nbytes(layout, need, counts)
        return self._held, moved

    def _to_tree(self, held: _Held) -> object:
        leaves_meta = held.meta["leaves"]
        paths = [leaf["path"] for leaf in leaves_meta]
        arrays = [
            buffer.view(np.dtype(leaf["dtype"])).reshape(leaf["shape"])
            for buffer, leaf in zip(held.buffers, leaves_meta, strict=True)
        ]
        if self.template is not None:
            treepaths.unflatten_like(self.template, paths, arrays)  # Checks the key paths.
            template_leaves, treedef = jax.tree.flatten(self.template)
            placed = [
                jax.device_put(a, getattr(want, "sharding", None))
                for a, want in zip(arrays, template_leaves, strict=True)
            ]
            return jax.tree.unflatten(treedef, placed)
        placed = jax.device_put(arrays)
        pushed = self._pushed_tree
        if pushed is not None and pushed[0] == paths:
            return jax.tree_util.tree_unflatten(pushed[1], placed)
        if held.skeleton:
            if self._skeleton[0] != held.skeleton or self._skeleton[1] is None:
                self._skeleton = (held.skeleton, pickle.loads(held.skeleton))
            return treepaths.unflatten_like(self._skeleton[1], paths, placed)
        return treepaths.nested_dict(paths, placed)
