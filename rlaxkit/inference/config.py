"""How to sample: the sampling configuration, and the shape buckets that keep the number of
compiled programs small.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MIN_LENGTH_BUCKET = 16  # shortest prompt width that gets its own program (tokens)


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """What distribution to draw completion tokens from, and when to stop.

    The logits of a step are divided by ``temperature``; then, in this order, ``top_k``
    keeps the ``k`` most likely tokens, ``top_p`` keeps the smallest most-likely prefix of
    what is left whose (renormalised) mass reaches ``top_p``, and ``min_p`` keeps the
    tokens whose probability is at least ``min_p`` times the most likely one's. The token
    is drawn from the renormalised kept set. ``temperature == 0`` is greedy: exact
    argmax, no randomness, the truncation settings unused.

    The config is hashable and is a static argument of the compiled programs: changing
    any field compiles new ones.

    Attributes:
        temperature: >= 0; 0 is greedy.
        top_k: >= 0; 0 keeps every token.
        top_p: in (0, 1]; 1 keeps every token.
        min_p: in [0, 1); 0 keeps every token.
        max_new_tokens: >= 1, the most tokens a completion may have (stop token included).
        n: >= 1, completions sampled per prompt (the prompt is prefilled once).
        stop_tokens: token ids that end a completion; the stop token is part of it.
        stop_sequences: token-id sequences that end a completion when it ends with one of
            them (matched within the completion only; the sequence is part of it).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_new_tokens: int = 64
    n: int = 1
    stop_tokens: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        # Normalise lists to tuples so the config stays hashable (a static jit argument).
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        object.__setattr__(
            self,
            "stop_sequences",
            tuple(tuple(int(t) for t in seq) for seq in self.stop_sequences),
        )
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1) (0 disables it), got {self.min_p}")
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        if not (isinstance(self.n, int) and self.n >= 1):
            raise ValueError(f"n must be an integer >= 1, got {self.n}")
        if any(t < 0 for t in self.stop_tokens):
            raise ValueError(f"stop_tokens must be token ids >= 0, got {self.stop_tokens}")
        for seq in self.stop_sequences:
            if not seq or any(t < 0 for t in seq):
                raise ValueError(
                    f"stop_sequences must be non-empty sequences of token ids >= 0, got {seq}"
                )

    @property
    def greedy(self) -> bool:
        """Whether tokens are the exact argmax (``temperature == 0``)."""
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        """Whether top-k, top-p or min-p can remove tokens from the sampled distribution."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)


def bucket_rows(rows: int) -> int:
    """Batch rows rounded up to a power of two (1, 2, 4, ...)."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    return 1 << (rows - 1).bit_length()


def bucket_length(length: int, cap: int | None = None, minimum: int = MIN_LENGTH_BUCKET) -> int:
    """Token width rounded up to a power of two, at least ``minimum``.

    With ``cap``, the bucket never exceeds it (``length`` must not): a prefill chunk must
    fit the cache it is written into.
    """
    width = max(minimum, 1 << max(length - 1, 0).bit_length())
    if cap is not None:
        if length > cap:
            raise ValueError(f"length {length} exceeds the cap of {cap} tokens")
        width = min(width, cap)
    return width


@dataclass(frozen=True, kw_only=True)
class InferenceConfig:
    """How a worker's engine holds its KV cache (``inference:`` in a run config).

    Attributes:
        kv_cache: ``dense`` (every row reserves its longest context), ``paged`` (rows
            hold pages of ``page_size`` slots as they grow, a prompt's full pages shared by
            its samples; ``rlaxkit.inference.engine``) or ``auto``: ``paged`` on TPU,
            where it fits several times the rows, ``dense`` elsewhere, where it decodes
            faster (``benchmarks/paged.py``).
        page_size: slots per page; must divide ``attention_block``.
        num_pages: pages in a worker's pool, the null page included; ``None``: the dense
            cache's slots (``slots_per_worker`` rows of the longest context) plus one.
        attention_block: slots one block of the TPU attention kernel reads.
    """

    kv_cache: Literal["auto", "dense", "paged"] = "auto"
    page_size: int = 16
    num_pages: int | None = None
    attention_block: int = 128

    def __post_init__(self) -> None:
        if self.kv_cache not in ("auto", "dense", "paged"):
            raise ValueError(f"kv_cache must be 'auto', 'dense' or 'paged', got {self.kv_cache!r}")
        for name in ("page_size", "attention_block"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_pages is not None and not (
            isinstance(self.num_pages, int) and self.num_pages >= 2
        ):
            raise ValueError(
                f"num_pages must be an integer >= 2 (page 0 is the null page) or null, "
                f"got {self.num_pages!r}"
            )
