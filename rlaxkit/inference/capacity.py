"""How many rows an inference worker decodes at once with a dense and with a paged KV
cache: the planner's arithmetic, fed with the bytes a TPU compile reports.

A dense row reserves its longest context (``context_tokens`` slots); a paged row holds
the pages of its real length (``rlaxkit.rules.paging.rows_that_fit`` over a sample of
lengths, e.g. a lognormal's draws or a measured histogram). Both share what the chip's
HBM holds after the weights and the decode step's scratch.

>>> dense, paged = rows_per_worker(
...     free_bytes=64 * 2**30, kv_bytes_per_token=64 * 2**10, context_tokens=32 * 1024,
...     row_tokens=[2000, 6000, 32 * 1024], page_size=64)
>>> (dense, paged)
(32, 77)
"""

from __future__ import annotations

from collections.abc import Sequence

from rlaxkit.rules.paging import rows_that_fit


def rows_per_worker(
    *,
    free_bytes: float,
    kv_bytes_per_token: float,
    context_tokens: int,
    row_tokens: Sequence[int],
    page_size: int,
) -> tuple[int, int]:
    """``(dense_rows, paged_rows)`` that fit in ``free_bytes`` of cache per chip.

    Args:
        free_bytes: HBM per chip left for the KV cache.
        kv_bytes_per_token: cache bytes one token takes per chip (all layers).
        context_tokens: a dense row's slots (prompt width + most new tokens).
        row_tokens: a sample of rows' real lengths (prompt + completion).
        page_size: slots per page.
    """
    pool_tokens = int(free_bytes // kv_bytes_per_token)
    dense = pool_tokens // context_tokens
    paged = rows_that_fit(pool_tokens=pool_tokens, page_size=page_size, row_tokens=row_tokens)
    return dense, paged
