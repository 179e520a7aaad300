"""Adapter publication for LoRA runs: the base weights once, then adapter versions.

A LoRA run trains adapters on a frozen base (``rlaxkit.models.lora``), so a version
differs from the next only in its adapters. :class:`AdapterParameterServer` wraps any
store and publishes a version as a *record* (a ``dict``) that holds the adapters and
names the version whose record holds the base:

- ``meta``: JSON (as ``uint8``): format, ``base_version``, and the LoRA ``rank``,
  ``alpha`` and ``targets`` (a reader needs no config of its own);
- ``adapters``: the bytes of the adapters' leaves, in ``jax.tree.leaves`` order, in one
  ``uint8`` array (one file or object per version, not one per adapter: a store's cost
  per leaf, tens of adapters per layer, would outweigh their bytes);
- ``base`` and ``skeleton`` (a *base record* only): the base's leaves, and the pickled
  trees of ``jax.ShapeDtypeStruct`` leaves of base and adapters that a reader rebuilds
  them in (an ``nnx.State`` comes back an ``nnx.State`` through any store).

The pusher writes a base record on its first push, after a ``reset`` and when
:meth:`AdapterParameterServer.publish_base` gives a new base, and *pins* it
(``push(..., pin=True)``: the in-process, TensorStore and Ray stores keep a pinned
version beyond ``keep`` until the next pinned push, and the Ray client registers it
again after its actor restarted empty). Every other push moves the adapters and the
``meta`` bytes only, about ``2r / hidden`` of each adapted kernel: at rank 8 on all
seven projections 2.9% of the weights of the 128-wide bench model, 0.9% of
Qwen2.5-0.5B's (``benchmarks/weight_lora.py``).

A reader reads the newest record, and the base record only when it holds no base or
another one (its first pull, a restart: a fresh client holds nothing, the base moved),
then merges ``W + (alpha / rank) · A @ B`` into its copy of the base with
:func:`rlaxkit.models.lora.merge_adapters`, jitted: the trainer's ``TrainState.params``
come from the same function, and on CPU the two agree bit for bit (test). A pull
returns ``(version, merged params)``, so a worker uses it as any full pull.

A store that can hand out only its newest version (no ``read``: the fault plan's store
of the local backend) cannot serve an older base record; there every record carries the
base, as references to the one host copy the pusher keeps, so nothing more is copied
(this object's ``stats`` count the adapters; the wrapped store's own count, and the
trace's push bytes from it, include the base it is handed each time).

>>> import jax, numpy as np
>>> from flax import nnx
>>> from rlaxkit.models.lora import LoraConfig
>>> from rlaxkit.param_server import InProcessParameterServer
>>> lora = LoraConfig(rank=1, alpha=1.0, targets=("q_proj",))
>>> base = nnx.State({"q_proj": {"kernel": nnx.Param(np.ones((2, 2), np.float32))}})
>>> adapters = nnx.State({"q_proj": {"lora_a": nnx.LoRAParam(np.ones((2, 1), np.float32)),
...                                  "lora_b": nnx.LoRAParam(np.ones((1, 2), np.float32))}})
>>> store = AdapterParameterServer(InProcessParameterServer(keep=2), lora=lora)
>>> store.publish_base(base)
>>> store.push(1, adapters)
>>> version, params = store.pull()
>>> version, np.asarray(params["q_proj"]["kernel"][...]).tolist()
(1, [[2.0, 2.0], [2.0, 2.0]])
"""

from __future__ import annotations

import functools
import json
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from rlaxkit.models.lora import LoraConfig, merge_adapters
from rlaxkit.param_server.base import (
    EventHook,
    TransferRecord,
    TransferStats,
    check_new_version,
    pull_timeout_error,
    record_transfer,
    tree_nbytes,
)
from rlaxkit.param_server.delta import byte_view

__all__ = ["FORMAT", "AdapterParameterServer", "merged_record"]

FORMAT = "rlaxkit.param_server.adapters/1"


@functools.cache
def _merge(lora: LoraConfig) -> Callable[[object, object], object]:
    """``merge_adapters`` jitted for ``lora`` (one program per config and shapes)."""
    return jax.jit(lambda base, adapters: merge_adapters(base, adapters, lora))


def _skeleton(tree: object) -> object:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _unpack(packed: np.ndarray, skeleton: object) -> list[np.ndarray]:
    """The leaves of ``skeleton`` (shapes and dtypes) cut from their packed bytes."""
    leaves, at = [], 0
    for spec in jax.tree.leaves(skeleton):
        dtype = np.dtype(spec.dtype)
        size = int(np.prod(spec.shape, dtype=np.int64)) * dtype.itemsize
        leaves.append(packed[at : at + size].view(dtype).reshape(spec.shape))
        at += size
    if at != packed.size:
        raise ValueError(f"adapter record: {packed.size} bytes for adapters of {at}")
    return leaves


def _leaves(stored: Any) -> list[object]:
    """A record's list of leaves: a list (in-process, Ray) or, read back from
    TensorStore, a ``dict`` keyed by position."""
    if isinstance(stored, list | tuple):
        return list(stored)
    return [stored[i] for i in range(len(stored))]


def merged_record(version: int, params: object) -> dict[str, object]:
    """The record of full weights ``params`` as ``version`` (what ``push_merged``
    stores): pulls return them as they are."""
    meta = {"format": FORMAT, "base_version": int(version), "merged": True}
    leaves = [np.array(x) for x in jax.device_get(jax.tree.leaves(params))]
    return {
        "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8).copy(),
        "base": leaves,
        "skeleton": np.frombuffer(pickle.dumps((_skeleton(params), None)), np.uint8),
    }


class AdapterParameterServer:
    """The ``ParameterServer`` protocol for LoRA runs over another store: pushes take the
    adapters, pulls return the base merged with them (see the module docstring).

    Args:
        inner: the store that holds the records. With ``read`` (the in-process,
            TensorStore and Ray stores) the base is stored once and pinned; without it
            every record carries the base by reference.
        lora: the adapters' config (the pusher's; a reader takes it from the records).
        poll_interval_s: how often a waiting pull asks the store again.
        default_timeout_s: the timeout of a pull that gives none (``None``: forever).
        on_event: optional ``on_event(kind, version, duration_s=..., bytes=..., ...)``;
            leave it ``None`` when ``inner`` reports its own transfers.
    """

    def __init__(
        self,
        inner: Any,
        *,
        lora: LoraConfig | None = None,
        poll_interval_s: float = 0.01,
        default_timeout_s: float | None = None,
        on_event: EventHook | None = None,
    ) -> None:
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s: must be > 0, got {poll_interval_s}")
        self.inner = inner
        self.lora = lora
        self.poll_interval_s = poll_interval_s
        self.default_timeout_s = default_timeout_s
        self.on_event = on_event
        self.stats = TransferStats()
        self.base_pulls = 0  # Pulls that read a base record.
        self._lock = threading.Lock()
        # The pusher's side: the base's host leaves and skeleton, and the version of
        # the record that holds them in the store (None: the next push writes one).
        self._base: tuple[list[np.ndarray], bytes] | None = None
        self._base_version: int | None = None
        # The reader's side: (base version, device base, adapter skeleton, lora config).
        self._held: tuple[int, object, object, LoraConfig] | None = None

    def __getstate__(self) -> dict[str, object]:
        # A client travels without what it pushed or holds: its first push writes a
        # base record and its first pull reads one.
        return {
            "inner": self.inner,
            "lora": self.lora,
            "poll_interval_s": self.poll_interval_s,
            "default_timeout_s": self.default_timeout_s,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        AdapterParameterServer.__init__(self, state.pop("inner"), **state)

    @property
    def pins(self) -> bool:
        """True when the base is stored once (the wrapped store can ``read`` versions)."""
        return hasattr(self.inner, "read")

    # ----------------------------------------------------------------- passthrough
    def latest_version(self) -> int | None:
        """The newest published version, or ``None`` before the first push."""
        return self.inner.latest_version()

    def versions(self) -> list[int]:
        """The versions the wrapped store retains, oldest first."""
        versions = getattr(self.inner, "versions", None)
        return [] if versions is None else list(versions())

    def republish(self) -> int | None:
        """The wrapped store's ``republish`` (Ray: after its actor restarted empty; the
        pinned base record is registered again with the newest versions)."""
        return self.inner.republish()

    # ----------------------------------------------------------------- pushing
    def publish_base(self, base: object) -> None:
        """Keeps a host copy of the frozen ``base`` weights; the next push stores it."""
        host = [np.array(x) for x in jax.device_get(jax.tree.leaves(base))]
        skeleton = pickle.dumps(_skeleton(base))
        with self._lock:
            self._base = (host, skeleton)
            self._base_version = None

    def _record(self, version: int, adapters: object, with_base: bool) -> tuple[dict, int]:
        """The record of ``version`` and the bytes it moves into the store."""
        if self._base is None or self.lora is None:
            raise RuntimeError("publish_base(base) with a lora config before the first push")
        base_version = version if with_base else self._base_version
        meta = {
            "format": FORMAT,
            "base_version": base_version,
            "rank": self.lora.rank,
            "alpha": self.lora.alpha,
            "targets": list(self.lora.targets),
        }
        leaves = [np.asarray(x) for x in jax.device_get(jax.tree.leaves(adapters))]
        packed = np.concatenate([np.empty(0, np.uint8), *(byte_view(x) for x in leaves)])
        record: dict[str, Any] = {
            "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8).copy(),
            "adapters": packed,
        }
        nbytes = tree_nbytes(record)
        if with_base or not self.pins:
            base, skeleton = self._base
            skeletons = (pickle.loads(skeleton), _skeleton(adapters))
            record["base"] = base  # The same host arrays in every record without pins.
            record["skeleton"] = np.frombuffer(pickle.dumps(skeletons), np.uint8).copy()
            if with_base:
                nbytes += tree_nbytes(base) + record["skeleton"].nbytes
        return record, nbytes

    def push(self, version: int, adapters: object, *, reset: bool = False) -> None:
        """Publishes ``adapters`` as ``version`` (a base record when the store lacks the
        base: the first push, or ``reset``).

        Args:
            reset: forget what was pushed before (a restarted trainer, whose store lost
                its versions); the wrapped store is told to reset too.

        Raises:
            ValueError: ``version`` is not newer than the latest published version.
            RuntimeError: no base was given (:meth:`publish_base`).
        """
        with self._lock:
            if not reset:
                check_new_version(version, self.inner.latest_version())
            version = int(version)
            start = time.perf_counter()
            with_base = reset or self._base_version is None
            record, nbytes = self._record(version, adapters, with_base)
            options: dict[str, object] = {"reset": True} if reset else {}
            if with_base and self.pins:
                options["pin"] = True
            self.inner.push(version, record, **options)
            if with_base:
                self._base_version = version
            duration_s = time.perf_counter() - start
        push = TransferRecord(kind="push", version=version, duration_s=duration_s, bytes=nbytes)
        record_transfer(self.stats, self.on_event, push)

    def push_merged(self, version: int, params: object, *, reset: bool = False) -> None:
        """Publishes full weights ``params`` as ``version`` (a resumed run whose newest
        published version is older than its train state: only the merged weights of that
        version were saved). Pulls return them as they are; the next push stores the
        base again."""
        with self._lock:
            if not reset:
                check_new_version(version, self.inner.latest_version())
            version = int(version)
            start = time.perf_counter()
            record = merged_record(version, params)
            self.inner.push(version, record, **({"reset": True} if reset else {}))
            self._base_version = None
            nbytes = tree_nbytes(record)
            duration_s = time.perf_counter() - start
        push = TransferRecord(kind="push", version=version, duration_s=duration_s, bytes=nbytes)
        record_transfer(self.stats, self.on_event, push)

    def rollback(self, version: int, adapters: object) -> None:
        """The wrapped store's ``rollback`` (the fault plan's store starts a new lineage,
        an empty store) with a base record of ``version``."""
        with self._lock:
            record, _ = self._record(int(version), adapters, with_base=True)
            self.inner.rollback(int(version), record)
            self._base_version = int(version)

    # ----------------------------------------------------------------- pulling
    def pull(self, min_version: int | None = None, timeout: float | None = None) -> tuple[int, Any]:
        """Returns ``(version, params)``: the newest version's adapters merged into the
        base, reading the base record only when this client holds another base.

        Waits until a version ``>= min_version`` exists (any when ``None``), for at most
        ``timeout`` seconds (the default timeout, or forever, when ``None``).

        Raises:
            TimeoutError: no such version was published within ``timeout``.
            ValueError: a record is not an adapter record.
            RuntimeError: the base record a version names is no longer stored.
        """
        timeout = self.default_timeout_s if timeout is None else timeout
        start = time.perf_counter()
        if not self.pins:
            version, record = self.inner.pull(min_version, timeout)
            ready_at = time.perf_counter()
            return self._finish(int(version), record, start, ready_at)
        deadline = None if timeout is None else start + timeout
        while True:
            latest = self.inner.latest_version()
            if latest is not None and (min_version is None or latest >= min_version):
                ready_at = time.perf_counter()
                record = self.inner.read(latest)
                if record is None:
                    continue  # Evicted since we asked: go again on the newest.
                return self._finish(int(latest), record, start, ready_at)
            remaining = None if deadline is None else deadline - time.perf_counter()
            if remaining is not None and remaining <= 0:
                raise pull_timeout_error(min_version, timeout, latest, "the adapter store")
            time.sleep(
                self.poll_interval_s if remaining is None else min(self.poll_interval_s, remaining)
            )

    def _finish(self, version: int, record: Any, start: float, ready_at: float) -> tuple[int, Any]:
        meta = json.loads(np.asarray(record["meta"]).tobytes())
        if meta.get("format") != FORMAT:
            raise ValueError(
                f"version {version}: not an adapter record (format {meta.get('format')!r})"
            )
        if meta.get("merged"):  # full weights (push_merged): nothing to merge
            skeleton, _ = pickle.loads(np.asarray(record["skeleton"]).tobytes())
            full = _leaves(record["base"])
            params = jax.tree.unflatten(jax.tree.structure(skeleton), jax.device_put(full))
            nbytes = sum(int(np.asarray(x).nbytes) for x in full)
            return self._pulled(version, params, nbytes, start, ready_at)
        packed = np.asarray(record["adapters"])
        nbytes = int(np.asarray(record["meta"]).nbytes) + int(packed.nbytes)
        base_version = int(meta["base_version"])
        held = self._held
        if held is None or held[0] != base_version:
            nbytes += self._take_base(version, base_version, record, meta)
            held = self._held
            assert held is not None
        _, base, adapter_skeleton, lora = held
        adapters = jax.tree.unflatten(
            jax.tree.structure(adapter_skeleton), jax.device_put(_unpack(packed, adapter_skeleton))
        )
        return self._pulled(version, _merge(lora)(base, adapters), nbytes, start, ready_at)

    def _pulled(
        self, version: int, params: object, nbytes: int, start: float, ready_at: float
    ) -> tuple[int, Any]:
        jax.block_until_ready(params)
        pull = TransferRecord(
            kind="pull",
            version=version,
            duration_s=time.perf_counter() - ready_at,
            bytes=nbytes,
            wait_s=ready_at - start,
        )
        record_transfer(self.stats, self.on_event, pull)
        return version, params

    def _take_base(self, version: int, base_version: int, record: Any, meta: dict) -> int:
        """Reads the base of record ``base_version`` onto the device; returns its bytes."""
        if "base" in record:
            base_record = record
        else:
            base_record = self.inner.read(base_version) if self.pins else None
            if base_record is None:
                raise RuntimeError(
                    f"version {version}: its base record (version {base_version}) is no "
                    "longer stored; the store must keep pinned versions (push(pin=True))"
                )
        skeleton = np.asarray(base_record["skeleton"])
        base_skeleton, adapter_skeleton = pickle.loads(skeleton.tobytes())
        leaves = _leaves(base_record["base"])
        base = jax.tree.unflatten(jax.tree.structure(base_skeleton), jax.device_put(leaves))
        lora = LoraConfig(
            rank=int(meta["rank"]), alpha=float(meta["alpha"]), targets=tuple(meta["targets"])
        )
        self._held = (base_version, base, adapter_skeleton, lora)
        self.base_pulls += 1
        return int(skeleton.nbytes) + sum(int(np.asarray(x).nbytes) for x in leaves)
