"""Pages of a paged KV cache, in plain Python: the pool a worker's engine takes pages from,
and the rule of how many rows fit, which the simulator's worker model calls too.

A row's cache is cut into pages of ``page_size`` token slots; slot ``s`` of a row lives in
its page ``s // page_size``. Rows take pages as they grow and give them back when they
finish, so a worker holds pages for the tokens its rows have, not for the longest row
they might write. The ``n`` samples of a prompt share its full pages (a page all of whose
slots hold prompt tokens); the last, partly filled page is each sample's own copy, since
each sample writes its own tokens after the prompt.

Page 0 is the null page: a row's unused page-table entries point at it and writes that
must land nowhere (padding, rows that are not generating) go there. It is never handed
out and nothing reads it unmasked.

>>> pool = PagePool(num_pages=9, page_size=4)   # 8 usable pages of 4 slots
>>> shared = pool.take(2)                         # a 9-token prompt: slots 0..7 shared
>>> pool.share(shared, 3)                         # by 4 samples (1 + 3 more holders)
>>> pool.free_pages
6
>>> pool.give_back(shared)                        # one sample finishes: still held
>>> pool.free_pages
6
>>> rows_that_fit(pool_tokens=32 * 1024, page_size=16, row_tokens=[1000, 3000, 500])
21
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

NULL_PAGE = 0


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` slots (``ceil(tokens / page_size)``).

    >>> pages_for(17, 16), pages_for(16, 16), pages_for(0, 16)
    (2, 1, 0)
    """
    return -(-max(tokens, 0) // page_size)


def shared_prompt_pages(prompt_tokens: int, page_size: int) -> int:
    """Full pages of a prompt's cached context, which its samples share.

    A prompt of ``L`` tokens caches ``L - 1`` of them (the last is fed by the first decode
    step), so the first ``(L - 1) // page_size`` pages are full and never written again.

    >>> shared_prompt_pages(33, 16), shared_prompt_pages(32, 16)
    (2, 1)
    """
    return max(prompt_tokens - 1, 0) // page_size


class PagePool:
    """The free pages of one worker's cache and how many rows hold each taken page.

    Args:
        num_pages: pages in the pool, the null page included (``num_pages - 1`` usable).
        page_size: token slots per page.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        # Lowest page first: a run takes the same pages run after run.
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self._holders = [0] * num_pages

    @property
    def free_pages(self) -> int:
        """Pages no row holds."""
        return len(self._free)

    @property
    def used_pages(self) -> int:
        """Pages some row holds."""
        return self.num_pages - 1 - len(self._free)

    def take(self, count: int) -> list[int]:
        """``count`` free pages, each now held once; raises if fewer are free."""
        if count > len(self._free):
            raise ValueError(f"{count} pages asked for, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._holders[page] = 1
        return pages

    def share(self, pages: Iterable[int], extra_holders: int) -> None:
        """``pages`` are held by ``extra_holders`` more rows."""
        for page in pages:
            self._holders[page] += extra_holders

    def give_back(self, pages: Iterable[int]) -> None:
        """One holder lets go of each of ``pages``; a page no row holds is free again."""
        for page in pages:
            if page == NULL_PAGE:
                continue
            if self._holders[page] < 1:
                raise ValueError(f"page {page} is not held")
            self._holders[page] -= 1
            if not self._holders[page]:
                self._free.append(page)


def rows_that_fit(
    *, pool_tokens: int, page_size: int, row_tokens: Sequence[int], max_rows: int | None = None
) -> int:
    """How many rows of a workload decode at once in a pool of ``pool_tokens`` slots.

    Rows whose cache lengths are drawn from ``row_tokens`` (a sample of the workload, used
    round-robin) each hold ``pages_for(length, page_size)`` pages; a worker admits a row
    while its pages are free, so in steady state the rows of a full pool hold, on average,
    the sample's mean number of pages each. That mean decides the count; ``max_rows``
    (the decode batch a program was compiled for) caps it. A dense cache is the case
    where every length is the longest.

    >>> rows_that_fit(pool_tokens=4096, page_size=64, row_tokens=[4096])   # dense: 1 row
    1
    >>> rows_that_fit(pool_tokens=4096, page_size=64, row_tokens=[100, 300])
    18
    """
    if not row_tokens:
        raise ValueError("row_tokens must hold at least one row length")
    mean_pages = sum(pages_for(t, page_size) for t in row_tokens) / len(row_tokens)
    pool_pages = pool_tokens // page_size
    rows = math.floor(pool_pages / mean_pages) if mean_pages else pool_pages
    return rows if max_rows is None else min(rows, max_rows)


def check_pages(
    *,
    page_size: int,
    num_pages: int,
    attention_block: int,
    max_prompt_tokens: int,
    max_new_tokens: int,
    prefix: str = "",
    new_tokens_field: str = "max_new_tokens",
) -> None:
    """Raises ``ValueError`` naming the field and the smallest value that works unless a
    pool of ``num_pages`` pages of ``page_size`` slots can run a row at all.

    ``page_size`` must divide ``attention_block`` (the slots one block of the attention
    kernel reads: its pages per block are ``attention_block // page_size``); the pool must
    hold one row of the longest prompt (``max_prompt_tokens``) and one row's whole
    context, prompt and ``max_new_tokens`` (the last token is never cached), since a
    worker preempts every other row before it stops a row short of its budget. The null
    page counts against ``num_pages``.

    >>> check_pages(page_size=16, num_pages=3, attention_block=128, max_prompt_tokens=16,
    ...             max_new_tokens=32, prefix="inference.")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: max_new_tokens: 32 ... at most 17 fit, or raise inference.num_pages to at least 4
    """
    if not (isinstance(page_size, int) and page_size >= 1):
        raise ValueError(f"{prefix}page_size must be an integer >= 1, got {page_size!r}")
    if not (isinstance(attention_block, int) and attention_block >= 1):
        raise ValueError(
            f"{prefix}attention_block must be an integer >= 1, got {attention_block!r}"
        )
    if attention_block % page_size:
        divisors = [d for d in range(page_size, 0, -1) if attention_block % d == 0]
        raise ValueError(
            f"{prefix}page_size: {page_size} does not divide the attention block of "
            f"{attention_block} slots ({prefix}attention_block); the largest page size "
            f"below it that does is {divisors[0]}"
        )
    prompt_pages = 1 + pages_for(max_prompt_tokens - 1, page_size)
    if num_pages < prompt_pages:
        raise ValueError(
            f"{prefix}num_pages: {num_pages} pages (null page included) cannot hold one row "
            f"of the longest prompt ({max_prompt_tokens} tokens); the smallest that works "
            f"is {prompt_pages}"
        )
    row_slots = max_prompt_tokens - 1 + max_new_tokens
    row_pages = 1 + pages_for(row_slots, page_size)
    if num_pages < row_pages:
        most = (num_pages - 1) * page_size - (max_prompt_tokens - 1)
        raise ValueError(
            f"{new_tokens_field}: {max_new_tokens} new tokens after a prompt of "
            f"{max_prompt_tokens} need {row_slots} slots, more than the pool holds "
            f"({num_pages - 1} usable pages of {page_size}); at most {most} fit, or raise "
            f"{prefix}num_pages to at least {row_pages}"
        )
