"""The on-disk layout of the TensorStore parameter server and its file-system steps.

Names (version directories, pointer, manifest, scratch names), chunking, aligned
buffers, read-only memory maps that hold a lease, and the small POSIX operations a
crash-safe publish is made of: fsync of files and directories, atomic replacement of a
JSON file, and a liveness check for the process that owns a scratch directory.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import math
import mmap
import os
import uuid
import weakref
from collections.abc import Mapping
from pathlib import Path

import numpy as np

__all__ = [
    "FORMAT",
    "MANIFEST",
    "POINTER",
    "READABLE_FORMATS",
    "SPARE_PREFIX",
    "TMP_PREFIX",
    "TRASH_PREFIX",
    "Lease",
    "aligned_empty",
    "chunk_shape",
    "fsync_path",
    "map_array",
    "parse_dirname",
    "raw_chunk_key",
    "scratch_name",
    "scratch_owner_alive",
    "version_dirname",
    "write_file",
    "write_json_atomically",
]

# /2: each leaf may be one raw chunk that readers memory-map (manifest field "raw").
FORMAT = "rlaxkit.param_server/2"
READABLE_FORMATS = ("rlaxkit.param_server/1", FORMAT)
POINTER = "latest.json"
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"  # Being written; never read.
TRASH_PREFIX = ".trash-"  # Evicted and unreachable; being deleted.
SPARE_PREFIX = ".spare-"  # Evicted and unreachable; its files await the next push.
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


def raw_chunk_key(ndim: int) -> str:
    """The file name of the only chunk of a zarr3 array stored as one chunk ("default"
    chunk keys with separator "."): ``c`` for a scalar, ``c.0.0`` for a matrix."""
    return "c" + ".0" * ndim


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


def write_file(path: Path, array: np.ndarray, *, create: bool, durable: bool) -> None:
    """Writes ``array``'s bytes as the whole of ``path``: a new file (``create``), or over
    an existing file of the same size, in place (its pages are in memory already)."""
    data = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data  # a memoryview
    flags = os.O_WRONLY | (os.O_CREAT | os.O_TRUNC if create else 0)
    fd = os.open(path, flags, 0o644)
    try:
        done = 0
        while done < data.nbytes:  # pwrite may write less than asked (2 GiB at most).
            done += os.pwrite(fd, data[done:], done)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomically(path: Path, payload: Mapping[str, object], durable: bool) -> None:
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


class Lease:
    """A shared ``flock`` on a version's manifest, held until :meth:`release` or until
    nothing refers to the lease any more (every array mapped under it is gone).

    The writer evicts a version only if it can take the exclusive lock without
    waiting, so a version stays on disk while a reader copies it or uses arrays mapped
    from it. Raises ``FileNotFoundError`` if ``path`` does not exist.
    """

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self._close = weakref.finalize(self, os.close, self.fd)
        fcntl.flock(self.fd, fcntl.LOCK_SH)

    def release(self) -> None:
        """Releases the lock now (arrays mapped under it stay valid on a local file
        system, where an open mapping keeps a deleted file's pages)."""
        self._close()


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int64,
)
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapping:
    """A private memory map of a whole file, unmapped when the last array on it dies.

    ``mmap(2)`` through ctypes rather than Python's ``mmap`` module, which keeps a
    duplicate file descriptor open per map: a model of hundreds of leaves, with a few
    versions held, would otherwise hold hundreds of descriptors. The map is private
    (copy-on-write), so nothing a reader does can reach the file other readers see.
    """

    def __init__(self, path: Path, nbytes: int, lease: Lease) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise ValueError(
                    f"{path}: {size} bytes on disk, the manifest says {nbytes}; the snapshot "
                    "is damaged (a machine crash before it reached the disk?): push a new "
                    "version, or use durable=True to survive machine crashes"
                )
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            address = _libc.mmap(None, nbytes, prot, mmap.MAP_PRIVATE, fd, 0)
            if address is None or address == _MAP_FAILED:
                errno = ctypes.get_errno()
                raise OSError(errno, f"mmap of {path}: {os.strerror(errno)}")
        finally:
            os.close(fd)  # The map does not need the descriptor.
        self.lease = lease  # Held for as long as any array on this map is alive.
        self.__array_interface__ = {
            "data": (address, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }
        weakref.finalize(self, _libc.munmap, address, nbytes)


def map_array(path: Path, shape: tuple[int, ...], dtype: np.dtype, lease: Lease) -> np.ndarray:
    """A read-only array on the raw bytes of ``path``, mapped, not copied.

    The array (and every view of it, and a ``jax.Array`` that aliases it) keeps the map
    and ``lease`` alive. Pages are read from the page cache when first touched.

    Raises:
        ValueError: the file does not hold exactly ``shape`` x ``dtype`` bytes.
        OSError: the file system cannot map the file.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    array = np.asarray(_Mapping(path, nbytes, lease)).view(dtype).reshape(shape)
    array.flags.writeable = False
    return array
