"""Supervised warm start: teach a policy the answer format from task demonstrations.

RL from verifiable rewards needs a policy that is sometimes right: a group whose samples
all fail carries no GRPO signal. A short supervised phase on (prompt, ideal completion)
pairs gets a tiny model to partial accuracy; RL then takes it further. The loss is the
mean negative log-likelihood of the completion tokens (end token included):

    L = -(1 / #completion tokens) * sum_{t in completion} log p(x_t | x_<t)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rlaxkit.models.tokenizer import Tokenizer
from rlaxkit.models.transformer import Transformer
from rlaxkit.rules.validation import check_number, is_number
from rlaxkit.trainer.logprobs import logprobs_from_logits


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """Supervised warm-start settings.

    Attributes:
        steps: optimizer steps (0 skips the warm start).
        batch_size: demonstrations per step.
        learning_rate: AdamW peak learning rate (linear warmup, then constant).
        warmup_steps: linear warmup length.
        weight_decay: AdamW weight decay.
        seed: seeds batch order.
    """

    steps: int = 700
    batch_size: int = 64
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        lr = self.learning_rate
        if not (is_number(lr) and lr > 0 and math.isfinite(lr)):
            raise ValueError(f"learning_rate must be a finite number > 0, got {lr}")
        check_number("weight_decay", self.weight_decay, minimum=0, allowed="a finite number >= 0")


def encode_demonstrations(
    tokenizer: Tokenizer, pairs: Sequence[tuple[str, str]], multiple: int = 8
) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded token matrix of ``prompt + completion + <eos>`` and the mask of the
    tokens the loss covers (completion and end token), width rounded up to ``multiple``.
    """
    rows = []
    for prompt, completion in pairs:
        p = tokenizer.encode(prompt)
        c = [*tokenizer.encode(completion), tokenizer.eos_id]
        rows.append((p, c))
    width = max(len(p) + len(c) for p, c in rows)
    width = multiple * math.ceil(width / multiple)
    tokens = np.full((len(rows), width), tokenizer.pad_id, np.int32)
    loss_mask = np.zeros((len(rows), width), np.float32)
    for i, (p, c) in enumerate(rows):
        tokens[i, : len(p) + len(c)] = p + c
        loss_mask[i, len(p) : len(p) + len(c)] = 1.0
    return tokens, loss_mask


def _nll(model: Transformer, tokens: jax.Array, loss_mask: jax.Array) -> jax.Array:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits = model(tokens[:, :-1], positions[:, :-1])
    logp = logprobs_from_logits(logits, tokens[:, 1:])
    mask = loss_mask[:, 1:]
    return -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def supervised_warm_start(
    model: Transformer,
    tokenizer: Tokenizer,
    demonstrations: Sequence[tuple[str, str]],
    config: SFTConfig,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Trains ``model`` in place on demonstrations; returns the loss of every step.

    Args:
        model: the policy; its parameters are updated in place.
        tokenizer: encodes prompts and completions.
        demonstrations: ``(prompt, ideal completion)`` pairs (no end token).
        config: steps, batch size, learning rate.
        on_step: called with ``(step, loss)`` after each step (progress bars).
    """
    if config.steps == 0:
        return []
    tokens, loss_mask = encode_demonstrations(tokenizer, demonstrations)
    schedule = optax.linear_schedule(0.0, config.learning_rate, max(config.warmup_steps, 1))
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, weight_decay=config.weight_decay),
    )
    # One state per filter; flax types the states after the first as a variadic tuple.
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
    opt_state = tx.init(params)

    def _step(params, opt_state, tokens, loss_mask):
        def loss_fn(p):
            return _nll(nnx.merge(graphdef, p, rest), tokens, loss_mask)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # The model's arrays are donated: the model is only valid again after the update below.
    step = jax.jit(_step, donate_argnums=(0, 1))
    rng = np.random.default_rng(config.seed)
    losses = []
    n = len(tokens)
    order = rng.permutation(n)
    cursor = 0
    for i in range(config.steps):
        if cursor + config.batch_size > n:
            order, cursor = rng.permutation(n), 0
        idx = order[cursor : cursor + config.batch_size]
        cursor += config.batch_size
        params, opt_state, loss = step(params, opt_state, tokens[idx], loss_mask[idx])
        losses.append(loss)
        if on_step is not None:
            on_step(i, float(loss))
    nnx.update(model, params)
    return [float(x) for x in jax.device_get(losses)]
