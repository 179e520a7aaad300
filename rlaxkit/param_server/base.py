"""The parameter-server contract and what every store shares.

A parameter server holds the newest weight versions the trainer has published. The
trainer calls :meth:`ParameterServer.push` with a strictly increasing version; inference
workers call :meth:`ParameterServer.pull` for the newest version at or above the one
they need. This follows the RLAX design (arXiv 2512.06392, §"parameter server"): one
master trainer pushes, a fleet of workers pulls on its own schedule, and the server keeps
only the last ``keep`` snapshots.

Every store records what it moved (:class:`TransferStats`) and can report each push and
pull to an ``on_event(kind, version, **fields)`` hook, with the field names of the trace
schema (``duration_s``, ``bytes``), so the runtime can write trace events without this
package importing the trace module.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
from collections.abc import Callable
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from rlaxkit.rules.validation import check_int, is_int

__all__ = [
    "EventHook",
    "ParameterServer",
    "TransferRecord",
    "TransferStats",
    "check_keep",
    "check_new_version",
    "pull_timeout_error",
    "record_transfer",
    "tree_nbytes",
]

EventHook = Callable[..., None]
"""``on_event(kind, version, **fields)``; kind is ``"push"`` or ``"pull"`` (a transfer),
or ``"restart"`` (a push found the parameter server restarted empty; version ``None``)."""


@runtime_checkable
class ParameterServer(Protocol):
    """A versioned weight store: the trainer pushes, inference workers pull.

    Versions strictly increase. A store keeps its last ``keep`` versions (a version a
    reader is still copying may outlive them briefly), and no reader, however slow,
    blocks a push.
    """

    def push(self, version: int, params: object) -> None:
        """Publishes ``params`` (any JAX pytree) as ``version``.

        Raises:
            ValueError: ``version`` is not newer than the latest published version.
        """
        ...

    def pull(self, min_version: int | None = None, timeout: float | None = None) -> tuple[int, Any]:
        """Returns ``(version, params)`` for the newest version, waiting for one ``>=
        min_version`` (any version when ``None``) for at most ``timeout`` seconds
        (forever when ``None``).

        Raises:
            TimeoutError: no such version appeared within ``timeout``.
        """
        ...

    def latest_version(self) -> int | None:
        """The newest published version, or ``None`` before the first push."""
        ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransferRecord:
    """One push or pull: how long the copy took and how many bytes it moved.

    ``wait_s`` is the time a pull spent waiting for a version to appear; it is not part
    of ``duration_s``, which times the transfer alone.
    """

    kind: Literal["push", "pull"]
    version: int
    duration_s: float
    bytes: int
    wait_s: float = 0.0


class TransferStats:
    """Running totals of pushes and pulls, plus the most recent records (thread-safe).

    Args:
        history: how many recent :class:`TransferRecord` objects to keep.
    """

    def __init__(self, history: int = 1024) -> None:
        self._lock = threading.Lock()
        self.records: collections.deque[TransferRecord] = collections.deque(maxlen=history)
        self.count = {"push": 0, "pull": 0}
        self.seconds = {"push": 0.0, "pull": 0.0}
        self.bytes = {"push": 0, "pull": 0}

    def add(self, record: TransferRecord) -> None:
        """Counts one transfer."""
        with self._lock:
            self.records.append(record)
            self.count[record.kind] += 1
            self.seconds[record.kind] += record.duration_s
            self.bytes[record.kind] += record.bytes

    def last(self, kind: Literal["push", "pull"]) -> TransferRecord | None:
        """The most recent record of ``kind`` still in the history, if any."""
        with self._lock:
            return next((r for r in reversed(self.records) if r.kind == kind), None)

    def as_dict(self) -> dict[str, float]:
        """Flat totals, e.g. ``{"push_count": 3, "push_seconds": 0.1, "push_bytes": ...}``."""
        with self._lock:
            out: dict[str, float] = {}
            for kind in ("push", "pull"):
                out[f"{kind}_count"] = self.count[kind]
                out[f"{kind}_seconds"] = self.seconds[kind]
                out[f"{kind}_bytes"] = self.bytes[kind]
            return out


def record_transfer(
    stats: TransferStats, on_event: EventHook | None, record: TransferRecord
) -> None:
    """Adds ``record`` to ``stats`` and reports it to ``on_event`` with trace field names."""
    stats.add(record)
    if on_event is not None:
        fields: dict[str, object] = {"duration_s": record.duration_s, "bytes": record.bytes}
        if record.kind == "pull":
            fields["wait_s"] = record.wait_s
        on_event(record.kind, record.version, **fields)


def tree_nbytes(tree: object) -> int:
    """Total bytes of the array leaves of a pytree.

    Leaves may be ``jax.Array``, ``numpy`` arrays, ``jax.ShapeDtypeStruct`` (abstract
    arrays count the bytes they would hold) or Python scalars.

    >>> import numpy as np
    >>> tree_nbytes({"w": np.zeros((4, 8), np.float32), "b": np.zeros(8, np.float32)})
    160
    """
    # Imported here so the module stays cheap for pure-Python callers.
    from rlaxkit.util.jaxutil import tree_leaves

    total = 0
    for leaf in tree_leaves(tree):
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            total += math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        else:
            total += np.asarray(leaf).nbytes
    return total


def check_keep(keep: int) -> int:
    """Validates the number of versions a store keeps."""
    return check_int("keep", keep, minimum=1, allowed="an int >= 1 (versions retained)")


def check_new_version(version: int, latest: int | None) -> None:
    """Raises ``ValueError`` unless ``version`` is a non-negative int newer than ``latest``."""
    if not is_int(version, numpy=True):
        raise ValueError(f"version must be an int, got {version!r}")
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    if latest is not None and version <= latest:
        raise ValueError(
            f"version {version} is not newer than the latest published version {latest}; "
            "versions must strictly increase"
        )


def pull_timeout_error(
    min_version: int | None, timeout: float | None, latest: int | None, where: str
) -> TimeoutError:
    """The error a pull raises when no wanted version appeared in time."""
    wanted = "any version" if min_version is None else f"a version >= {min_version}"
    return TimeoutError(
        f"pull from {where}: {wanted} did not appear within {timeout} s "
        f"(latest published version: {latest})"
    )
