"""The on-disk layout of the TensorStore parameter server and its file-system steps.

Names (version directories, pointer, manifest, scratch names), chunking, aligned
buffers, and the small POSIX operations a crash-safe publish is made of: fsync of files
and directories, atomic replacement of a JSON file, and a liveness check for the process
that owns a scratch directory.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "FORMAT",
    "MANIFEST",
    "POINTER",
    "TMP_PREFIX",
    "TRASH_PREFIX",
    "aligned_empty",
    "chunk_shape",
    "fsync_path",
    "parse_dirname",
    "scratch_name",
    "scratch_owner_alive",
    "version_dirname",
    "write_json_atomically",
]

FORMAT = "rlaxkit.param_server/1"
POINTER = "latest.json"
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"  # Being written; never read.
TRASH_PREFIX = ".trash-"  # Evicted and unreachable; being deleted.
# JAX's CPU client aliases (does not copy) host buffers aligned to this many bytes.
ALIGN_BYTES = 64


def version_dirname(version: int) -> str:
    """The directory name of a version; zero-padded so names sort like versions."""
    return f"v{version:012d}"


def parse_dirname(name: str) -> int | None:
    """The version a directory name stands for, or ``None`` for any other name."""
    if len(name) == 13 and name[0] == "v" and name[1:].isdigit():
        return int(name[1:])
    return None


def scratch_name(prefix: str, name: str) -> str:
    """A unique scratch name for ``name``: ``<prefix><name>-<pid>-<random>``."""
    return f"{prefix}{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def scratch_owner_alive(name: str) -> bool:
    """Whether the process that made scratch ``name`` still runs (on this machine)."""
    pid = name.rsplit("-", 2)[-2] if name.count("-") >= 2 else ""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def chunk_shape(shape: tuple[int, ...], itemsize: int, target_bytes: int) -> list[int]:
    """A chunk shape of at most about ``target_bytes``, split along the leading axes.

    Several chunks per large leaf let TensorStore write and read them in parallel.

    >>> chunk_shape((1024, 1024), 4, 1 << 20)
    [256, 1024]
    """
    chunk = [max(1, n) for n in shape]
    for axis in range(len(chunk)):
        inner_bytes = itemsize * math.prod(chunk[axis + 1 :])
        chunk[axis] = max(1, min(chunk[axis], target_bytes // inner_bytes))
        if inner_bytes * chunk[axis] <= target_bytes:
            break
    return chunk


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data starts on an ``ALIGN_BYTES`` boundary."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN_BYTES, np.uint8)
    offset = (-raw.ctypes.data) % ALIGN_BYTES
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def fsync_path(path: Path) -> None:
    """fsyncs a file or directory by path (a directory fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomically(path: Path, payload: dict[str, Any], durable: bool) -> None:
    """Replaces ``path`` with ``payload`` so that readers see the old or the new file."""
    tmp = path.with_name(scratch_name(TMP_PREFIX, path.name))
    with open(tmp, "w") as f:
        json.dump(payload, f)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_path(path.parent)
