"""The work both sides of the peer comparison do, in plain Python and numpy only: this
module is imported by rlaxkit's driver (``rlaxkit_side.py``, the project's venv) and by
the peer's (``tunix_side.py``, the peer's own venv, where rlaxkit is not installed).

The model is Qwen3-shaped on both sides: 4 layers, 4 query heads of width ``hidden / 4``,
2 key-value heads, per-head q/k RMSNorm, SwiGLU of width ``4 * hidden``, tied
embeddings, RoPE base 10 000, float32. Prompts are token ids drawn from a seeded numpy
generator; token 1 opens every prompt (the peer's sampler prepends its tokenizer's
beginning-of-sequence id, so its text prompts carry one token fewer), token 2 ends a
completion, token 0 pads. The reward of a completion is the fraction of its tokens
with an even id: cheap, and it varies within a group so advantages are not all zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_WORD_ID = 3  # prompt tokens after the first are drawn from [3, vocab)
ROPE_THETA = 10_000.0
RMS_NORM_EPS = 1e-6
LEARNING_RATE = 1e-4


@dataclass(frozen=True)
class ModelShape:
    """One Qwen3 shape; ``head_dim = hidden / heads``, ``mlp = 4 * hidden``."""

    hidden: int
    vocab: int
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def mlp(self) -> int:
        return 4 * self.hidden

    def num_params(self) -> int:
        """Parameters with tied embeddings: what both sides must report."""
        h, d = self.hidden, self.head_dim
        attention = h * d * (2 * self.heads + 2 * self.kv_heads) + 2 * d  # + q/k norms
        layer = attention + 3 * h * self.mlp + 2 * h  # + the two block norms
        return self.layers * layer + self.vocab * h + h  # + embedding and final norm

    def matmul_params(self) -> int:
        """Weights that take part in a matmul per token (embedding lookup excluded,
        the tied output projection included)."""
        h, d = self.hidden, self.head_dim
        attention = h * d * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attention + 3 * h * self.mlp) + self.vocab * h

    def forward_flops(self, tokens: int, context: int) -> float:
        """Forward FLOPs of ``tokens`` tokens of one causal sequence of ``context``
        tokens: ``2 * matmul_params`` per token plus attention scores and values,
        ``4 * layers * heads * head_dim`` per (query, key) pair, causally counted."""
        pairs = tokens * (context + 1) / 2  # a token at position t sees t + 1 keys
        attention = 4 * self.layers * self.heads * self.head_dim * pairs
        return 2.0 * self.matmul_params() * tokens + attention


@dataclass(frozen=True)
class GRPOWork:
    """One synchronous GRPO iteration: ``prompts x samples`` completions of
    ``new_tokens`` tokens at temperature 1, rewards, one PPO-clip update, no reference
    model (KL coefficient 0)."""

    name: str
    model: ModelShape
    prompts: int
    samples: int
    new_tokens: int
    prompt_tokens: int = 8

    def flops(self) -> float:
        """Model FLOPs of one iteration: every row's forward over prompt and completion
        while sampling, then forward and backward (3x forward) of the update."""
        context = self.prompt_tokens + self.new_tokens
        rows = self.prompts * self.samples
        forward = rows * self.model.forward_flops(context, context)
        return 4.0 * forward


@dataclass(frozen=True)
class DecodeWork:
    """``batch`` prompts of ``prompt_tokens`` tokens, ``new_tokens`` tokens each at
    temperature 1, no stop token, log-probs returned."""

    name: str
    model: ModelShape
    batch: int
    new_tokens: int
    prompt_tokens: int = 4

    def flops(self) -> float:
        context = self.prompt_tokens + self.new_tokens
        return self.batch * self.model.forward_flops(context, context)


SMALL_MODEL = ModelShape(hidden=128, vocab=512)
LARGE_MODEL = ModelShape(hidden=256, vocab=2048)
GRPO = {
    "small": GRPOWork("small", SMALL_MODEL, prompts=4, samples=4, new_tokens=16),
    "large": GRPOWork("large", LARGE_MODEL, prompts=8, samples=4, new_tokens=32),
}
DECODE = {
    "small": DecodeWork("small", SMALL_MODEL, batch=16, new_tokens=16),
    "large": DecodeWork("large", SMALL_MODEL, batch=64, new_tokens=128),
}
# Tests only: rlaxkit's half on tiny shapes, so the drivers cannot rot.
TINY_MODEL = ModelShape(hidden=32, vocab=64, layers=1)
TINY_GRPO = GRPOWork("tiny", TINY_MODEL, prompts=2, samples=2, new_tokens=4, prompt_tokens=4)
TINY_DECODE = DecodeWork("tiny", TINY_MODEL, batch=2, new_tokens=4)


def grpo_work(name: str) -> GRPOWork:
    return TINY_GRPO if name == "tiny" else GRPO[name]


def decode_work(name: str) -> DecodeWork:
    return TINY_DECODE if name == "tiny" else DECODE[name]


def prompt_ids(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids: ``BOS_ID`` then ids in ``[3, vocab)``."""
    rng = np.random.RandomState(seed)
    body = rng.randint(FIRST_WORD_ID, vocab, size=(count, length - 1))
    return [[BOS_ID, *row.tolist()] for row in body]


def reward(completion_ids) -> float:
    """Fraction of the completion's tokens with an even id (0 for an empty one)."""
    ids = np.asarray(completion_ids).reshape(-1)
    return float(np.mean(ids % 2 == 0)) if ids.size else 0.0
