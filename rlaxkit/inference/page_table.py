"""The host's side of a paged KV cache: which pages each decode row holds.

``InferenceEngine(kv_cache="paged")`` keeps one ``RowPages``: it gives a row the pages its
prompt needs when the row starts (the full prompt pages shared by the samples of one
prompt started together), more as the row grows (a chunk's worth before each chunk), and
takes them back when the row finishes, is released or preempted. The device reads the
table (``page_table``, ``[rows, pages_per_row]``) whenever it changed.
"""

from __future__ import annotations

import numpy as np

from rlaxkit.rules.paging import NULL_PAGE, PagePool, pages_for, shared_prompt_pages


class RowPages:
    """Pages held by each of ``rows`` decode rows of ``slots`` slots, from one pool.

    Args:
        rows: decode rows.
        slots: slots per row (a multiple of ``page_size``).
        num_pages: pages in the pool, the null page included.
        page_size: slots per page.
    """

    def __init__(self, rows: int, slots: int, num_pages: int, page_size: int):
        self.pool = PagePool(num_pages, page_size)
        self.page_size = page_size
        self.table = np.full((rows, slots // page_size), NULL_PAGE, np.int32)
        self.held: list[list[int]] = [[] for _ in range(rows)]
        self.dirty = False  # the device's table is out of date
        self.peak_used = 0  # most pages held at once

    @property
    def free_pages(self) -> int:
        """Pages no row holds."""
        return self.pool.free_pages

    def start_cost(self, prompt_len: int, first_slots: int, shared: bool) -> int:
        """Pages a row of a ``prompt_len``-token prompt takes to start and write its first
        ``first_slots`` slots; ``shared``: the prompt's full pages are held already."""
        total = pages_for(first_slots, self.page_size)
        return total - (shared_prompt_pages(prompt_len, self.page_size) if shared else 0)

    def start(self, row: int, prompt_len: int, first_slots: int, share: int | None) -> None:
        """Row ``row`` starts: it holds the pages of its first ``first_slots`` slots, the
        full prompt pages those of row ``share`` when given (a sample of the same prompt,
        started in the same prefill)."""
        assert not self.held[row], f"row {row} holds pages already"
        shared: list[int] = []
        if share is not None:
            shared = self.held[share][: shared_prompt_pages(prompt_len, self.page_size)]
            self.pool.share(shared, 1)
        own = self.pool.take(pages_for(first_slots, self.page_size) - len(shared))
        self._set(row, shared + own)

    def grow_cost(self, row: int, slots: int) -> int:
        """Pages row ``row`` still needs to hold its first ``slots`` slots."""
        return max(0, pages_for(slots, self.page_size) - len(self.held[row]))

    def grow(self, row: int, slots: int) -> None:
        """Row ``row`` holds the pages of its first ``slots`` slots (capped at the row)."""
        count = min(self.grow_cost(row, slots), self.table.shape[1] - len(self.held[row]))
        if count > 0:
            self._set(row, self.held[row] + self.pool.take(count))

    def free(self, row: int) -> None:
        """Row ``row`` lets go of its pages (shared ones stay with their other holders)."""
        if self.held[row]:
            self.pool.give_back(self.held[row])
            self._set(row, [])

    def _set(self, row: int, pages: list[int]) -> None:
        self.held[row] = pages
        self.table[row] = NULL_PAGE
        self.table[row, : len(pages)] = pages
        self.dirty = True
        self.peak_used = max(self.peak_used, self.pool.used_pages)
