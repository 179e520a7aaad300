"""Delta publication, the pure part: fixed-size chunks, their checksums, diff and patch.

A weight tree is a list of leaves, each a flat byte buffer. Every leaf is cut into
chunks of ``chunk_bytes`` (its last chunk may be shorter; an empty leaf has none), and
the chunks of all leaves are numbered in leaf order: chunk ``g`` of the tree is chunk
``g - first[i]`` of leaf ``i``. A version is described by one checksum per chunk; two
versions differ exactly in the chunks whose checksums differ, so a reader that holds
one version and the checksums of another needs only those chunks to rebuild the other,
bit for bit.

**Word patches.** A chunk changed by a small step often differs in few of its 16-bit
words (a bfloat16 weight moved by less than its rounding step keeps its bits). For a
reader that holds exactly the previous version, :func:`word_patches` describes each
changed chunk as a bitmask of its changed words and their new values, and
:func:`patch_chunks` applies them: ``words / 8 + 2 · changed words`` bytes instead of
the chunk's ``2 · words``.

**Checksum: SHA-256, first 16 bytes.** The diff is only as exact as the checksum: a
changed chunk whose checksum collides with the old one is silently not sent. A 32-bit
CRC collides once in 2^32 changed chunks, which a 70B model (140k chunks of 1 MiB in
bf16, nearly all changed each step) reaches within a few thousand steps; 128 bits
never do. Measured on the 2-core test machine over 64 MiB of float32 (1 MiB chunks):
``zlib.crc32`` 4.0 GB/s, SHA-256 1.4 GB/s (the CPU's SHA instructions), BLAKE2b 0.75
GB/s, MD5 0.6 GB/s, a memcpy 4.5 GB/s. So SHA-256 is the fastest checksum that is safe
to trust for exactness; only the pusher hashes (the reader compares stored checksums),
and ``hashlib`` releases the GIL, so a pusher hashes leaves on several threads.

>>> import numpy as np
>>> old = np.arange(10, dtype=np.uint8)
>>> new = old.copy(); new[5] = 99
>>> changed = changed_chunks(chunk_checksums(old, 4), chunk_checksums(new, 4))
>>> changed.tolist()  # bytes 4..7 are chunk 1
[1]
>>> layout = ChunkLayout.of([10], 4)
>>> payload = gather_chunks([new], layout, changed)
>>> apply_chunks([old], layout, changed, payload)[0].tolist() == new.tolist()
True
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

from rlaxkit.rules.validation import check_int

__all__ = [
    "CHECKSUM_BYTES",
    "ChunkLayout",
    "apply_chunks",
    "byte_view",
    "changed_chunks",
    "check_chunk_bytes",
    "chunk_checksums",
    "gather_chunks",
    "num_chunks",
    "patch_chunks",
    "patch_nbytes",
    "scatter_chunks",
    "word_patches",
]

CHECKSUM_BYTES = 16  # Leading bytes of SHA-256 kept per chunk (see the module docstring).


def check_chunk_bytes(chunk_bytes: int) -> int:
    """Validates a chunk size in bytes."""
    return check_int("chunk_bytes", chunk_bytes, minimum=1, allowed="an int >= 1 (bytes)")


def num_chunks(nbytes: int, chunk_bytes: int) -> int:
    """Chunks of a buffer of ``nbytes``: ``ceil(nbytes / chunk_bytes)``.

    >>> num_chunks(10, 4), num_chunks(8, 4), num_chunks(0, 4)
    (3, 2, 0)
    """
    return -(-nbytes // chunk_bytes)


def byte_view(array: np.ndarray) -> np.ndarray:
    """The bytes of ``array`` as a flat ``uint8`` array (a view when it is contiguous)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def chunk_checksums(buffer: np.ndarray, chunk_bytes: int) -> np.ndarray:
    """``(num_chunks, CHECKSUM_BYTES)`` uint8: the first 16 bytes of SHA-256 per chunk.

    Args:
        buffer: a flat ``uint8`` array (see :func:`byte_view`).
        chunk_bytes: the chunk size.
    """
    count = num_chunks(buffer.size, chunk_bytes)
    out = np.empty((count, CHECKSUM_BYTES), np.uint8)
    data = buffer.data  # A memoryview: its slices copy nothing.
    for j in range(count):
        digest = hashlib.sha256(data[j * chunk_bytes : (j + 1) * chunk_bytes]).digest()
        out[j] = np.frombuffer(digest[:CHECKSUM_BYTES], np.uint8)
    return out


def changed_chunks(old: np.ndarray | None, new: np.ndarray) -> np.ndarray:
    """Sorted ids (int64) of the chunks whose checksums differ; all of them when ``old``
    is ``None`` or describes a different number of chunks."""
    if old is None or old.shape != new.shape:
        return np.arange(new.shape[0], dtype=np.int64)
    return np.flatnonzero(np.any(old != new, axis=1)).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """Where every chunk of a tree lies: ``leaf[g]``, byte ``start[g]`` in that leaf and
    ``size[g]`` bytes, for the chunks ``g`` of all leaves numbered in leaf order.

    >>> layout = ChunkLayout.of([10, 0, 4], 4)
    >>> layout.leaf.tolist(), layout.start.tolist(), layout.size.tolist()
    ([0, 0, 0, 2], [0, 4, 8, 0], [4, 4, 2, 4])
    """

    chunk_bytes: int
    leaf_bytes: tuple[int, ...]
    leaf: np.ndarray
    start: np.ndarray
    size: np.ndarray

    @classmethod
    def of(cls, leaf_bytes: Sequence[int], chunk_bytes: int) -> ChunkLayout:
        """The layout of leaves of ``leaf_bytes`` bytes cut into ``chunk_bytes`` chunks."""
        check_chunk_bytes(chunk_bytes)
        counts = [num_chunks(int(n), chunk_bytes) for n in leaf_bytes]
        leaf = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        first = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])[:-1]
        start = (np.arange(leaf.size, dtype=np.int64) - first[leaf]) * chunk_bytes
        nbytes = np.asarray(leaf_bytes, dtype=np.int64)
        size = np.minimum(chunk_bytes, nbytes[leaf] - start) if leaf.size else start
        return cls(chunk_bytes, tuple(int(n) for n in leaf_bytes), leaf, start, size)

    @property
    def num_chunks(self) -> int:
        """Chunks of all leaves together."""
        return int(self.leaf.size)

    def payload_bytes(self, ids: np.ndarray) -> int:
        """Bytes of the chunks ``ids`` together."""
        return int(self.size[ids].sum())

    def offsets(self, ids: np.ndarray) -> np.ndarray:
        """Where each of the chunks ``ids`` starts in their concatenation (one more entry
        than ``ids``: the last is the total)."""
        return np.concatenate([[0], np.cumsum(self.size[ids], dtype=np.int64)])


def gather_chunks(
    buffers: Sequence[np.ndarray], layout: ChunkLayout, ids: np.ndarray
) -> np.ndarray:
    """The bytes of chunks ``ids`` of the leaves ``buffers`` (flat ``uint8``), concatenated
    in the order of ``ids``."""
    offsets = layout.offsets(ids)
    out = np.empty(int(offsets[-1]), np.uint8)
    for k, g in enumerate(ids.tolist()):
        start = int(layout.start[g])
        out[offsets[k] : offsets[k + 1]] = buffers[layout.leaf[g]][start : start + layout.size[g]]
    return out


def scatter_chunks(
    buffers: Sequence[np.ndarray],
    layout: ChunkLayout,
    ids: np.ndarray,
    payload: np.ndarray,
    positions: np.ndarray | None = None,
) -> None:
    """Writes chunks ``ids`` into the writable flat ``uint8`` leaves ``buffers``, in place.

    Args:
        positions: where each of ``ids`` starts in ``payload`` (default: ``payload`` is
            their concatenation in the order of ``ids``).
    """
    starts = layout.offsets(ids)[:-1] if positions is None else positions
    for g, at in zip(ids.tolist(), starts.tolist(), strict=True):
        start, size = int(layout.start[g]), int(layout.size[g])
        buffers[layout.leaf[g]][start : start + size] = payload[at : at + size]


def apply_chunks(
    base: Sequence[np.ndarray | None], layout: ChunkLayout, ids: np.ndarray, payload: np.ndarray
) -> list[np.ndarray]:
    """New flat ``uint8`` leaves: ``base`` with chunks ``ids`` replaced by ``payload`` (their
    concatenation). A leaf with no chunk in ``ids`` is ``base``'s own buffer, not a copy;
    a ``None`` base leaf must be covered by ``ids`` entirely.

    Raises:
        ValueError: a ``None`` base leaf is not covered entirely.
    """
    touched = set(np.unique(layout.leaf[ids]).tolist())
    out: list[np.ndarray] = []
    for i, nbytes in enumerate(layout.leaf_bytes):
        old = base[i]
        if old is not None and i not in touched:
            out.append(old)
        elif old is not None:
            out.append(old.copy())
        else:
            covered = int(layout.size[ids][layout.leaf[ids] == i].sum())
            if covered != nbytes:
                raise ValueError(f"leaf {i}: no base, and ids cover {covered} of {nbytes} bytes")
            out.append(np.empty(nbytes, np.uint8))
    scatter_chunks(out, layout, ids, payload)
    return out


def word_patches(
    old: Sequence[np.ndarray], new: Sequence[np.ndarray], layout: ChunkLayout, ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(masks, values, counts)`` turning chunks ``ids`` of ``old`` into those of ``new``
    (flat ``uint8`` leaves of the same layout), or ``None`` when a chunk has an odd size.

    ``masks`` concatenates each chunk's ``np.packbits`` of its changed 16-bit words,
    ``values`` (``uint16``) their new values, ``counts`` how many per chunk.

    >>> old = [np.zeros(8, np.uint8)]
    >>> new = [np.array([0, 0, 7, 0, 0, 0, 0, 9], np.uint8)]
    >>> layout = ChunkLayout.of([8], 8)
    >>> masks, values, counts = word_patches(old, new, layout, np.array([0]))
    >>> masks.tolist(), counts.tolist()  # words 1 and 3 changed: bits 0101 0000
    ([80], [2])
    >>> patched = [old[0].copy()]
    >>> patch_chunks(patched, layout, np.array([0]), masks, values, counts)
    >>> patched[0].tolist() == new[0].tolist()
    True
    """
    if np.any(layout.size[ids] % 2):
        return None
    masks, values, counts = [], [], []
    for g in ids.tolist():
        start, size = int(layout.start[g]), int(layout.size[g])
        before = old[layout.leaf[g]][start : start + size].view(np.uint16)
        after = new[layout.leaf[g]][start : start + size].view(np.uint16)
        changed = before != after
        masks.append(np.packbits(changed))
        values.append(after[changed])
        counts.append(int(changed.sum()))
    return (
        np.concatenate([np.empty(0, np.uint8), *masks]),
        np.concatenate([np.empty(0, np.uint16), *values]),
        np.asarray(counts, np.int64),
    )


def patch_nbytes(layout: ChunkLayout, ids: np.ndarray, counts: np.ndarray) -> int:
    """Bytes of the word patches of chunks ``ids`` with ``counts`` changed words."""
    words = layout.size[ids] // 2
    return int(((words + 7) // 8).sum() + 2 * counts.sum())


def patch_chunks(
    buffers: Sequence[np.ndarray],
    layout: ChunkLayout,
    ids: np.ndarray,
    masks: np.ndarray,
    values: np.ndarray,
    counts: np.ndarray,
) -> None:
    """Applies :func:`word_patches` of chunks ``ids`` to the writable flat ``uint8``
    leaves ``buffers``, in place."""
    words = layout.size[ids] // 2
    mask_at = np.concatenate([[0], np.cumsum((words + 7) // 8)])
    value_at = np.concatenate([[0], np.cumsum(counts)])
    for k, g in enumerate(ids.tolist()):
        start, size = int(layout.start[g]), int(layout.size[g])
        changed = np.unpackbits(masks[mask_at[k] : mask_at[k + 1]], count=int(words[k]))
        target = buffers[layout.leaf[g]][start : start + size].view(np.uint16)
        # Through indices: assigning through a boolean mask, or finding the indices of a
        # 2-D bit array, is several times slower in NumPy.
        target[np.flatnonzero(changed.view(bool))] = values[value_at[k] : value_at[k + 1]]
