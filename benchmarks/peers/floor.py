"""The matmul floor of each job in ``workloads.py``: how long this machine takes for the
job's model matmuls alone, in jitted JAX programs (one per phase of the job).

A job's floor programs do every projection of the model (q, k, v, o, SwiGLU gate, up
and down, the tied unembedding) at the job's own shapes and in the job's own order,
and nothing else: no attention, norms, RoPE, softmax, sampling, loss or optimizer (a
cheap elementwise op joins the projections so that none is dead code). Both sides run
on XLA:CPU, so the floor is what either could reach if everything but the matmuls cost
nothing. ``peer time / floor`` is then the largest ratio an implementation doing the
same matmuls through XLA:CPU could show against the peer on this machine, and
``floor / time`` is how close a side is.

* A GRPO step: sampling (the prompt's prefill for every row, then one decode step per
  new token after the first, ``rows`` rows each), then the update: forward and backward
  of every row over prompt and completion (``jax.value_and_grad``, so the backward's
  matmuls and transposes are XLA's own).
* Decode: the prefill, then one decode step per new token after the first.

Prompts are the same length on both sides and in the floor (``workloads.py``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import workloads


def weights(shape: workloads.ModelShape, seed: int = 0) -> dict[str, Any]:
    """Random float32 weights of every matmul of ``shape`` (tied embedding table)."""
    h, d, mlp = shape.hidden, shape.head_dim, shape.mlp
    dims = {
        "q": (h, shape.heads * d),
        "k": (h, shape.kv_heads * d),
        "v": (h, shape.kv_heads * d),
        "o": (shape.heads * d, h),
        "gate": (h, mlp),
        "up": (h, mlp),
        "down": (mlp, h),
    }
    keys = iter(jax.random.split(jax.random.key(seed), 1 + len(dims) * shape.layers))
    layers = [
        {name: 0.02 * jax.random.normal(next(keys), dim) for name, dim in dims.items()}
        for _ in range(shape.layers)
    ]
    return {"layers": layers, "embedding": 0.02 * jax.random.normal(next(keys), (shape.vocab, h))}


def layers(w: dict[str, Any], x: jax.Array) -> jax.Array:
    """The decoder layers' projections on ``x [tokens, hidden]``."""
    for p in w["layers"]:
        q = x @ p["q"]
        kv = x @ p["k"] + x @ p["v"]
        x = x + q.at[:, : kv.shape[1]].add(kv) @ p["o"]
        x = x + (jnp.tanh(x @ p["gate"]) * (x @ p["up"])) @ p["down"]
    return x


def unembed(w: dict[str, Any], x: jax.Array) -> jax.Array:
    return x @ w["embedding"].T


def sampling(shape: workloads.ModelShape, rows: int, prompt: int, new: int) -> Callable:
    """Prefill ``rows x prompt`` tokens (logits of each row's last), then ``new - 1``
    decode steps of ``rows`` tokens each."""

    def run(w: dict[str, Any], x: jax.Array) -> jax.Array:
        hidden = layers(w, jnp.broadcast_to(x, (rows * prompt, shape.hidden)))
        logits = unembed(w, hidden[::prompt])

        def step(_: Any, logits: jax.Array) -> jax.Array:
            return unembed(w, layers(w, logits[:, : shape.hidden]))

        return jax.lax.fori_loop(0, new - 1, step, logits)

    return run


def update(shape: workloads.ModelShape, rows: int, length: int) -> Callable:
    """Forward and backward of ``rows x length`` tokens (the loss: a sum of logits)."""

    def loss(w: dict[str, Any], x: jax.Array) -> jax.Array:
        hidden = layers(w, jnp.broadcast_to(x, (rows * length, shape.hidden)))
        return jnp.sum(unembed(w, hidden))

    return jax.value_and_grad(loss)


def floor_programs(kind: str, work: Any) -> list[Callable]:
    """The jitted floor of a ``step`` (``GRPOWork``: sampling, then the update, as two
    programs, since in one XLA would run the two side by side) or ``decode``
    (``DecodeWork``) job."""
    if kind == "decode":
        return [jax.jit(sampling(work.model, work.batch, work.prompt_tokens, work.new_tokens))]
    rows = work.prompts * work.samples
    return [
        jax.jit(sampling(work.model, rows, work.prompt_tokens, work.new_tokens)),
        jax.jit(update(work.model, rows, work.prompt_tokens + work.new_tokens)),
    ]


def floor_seconds(kind: str, work: Any, repeats: int = 10) -> float:
    """Median wall time of the job's floor programs, one after the other, compiled and
    warmed first."""
    programs = floor_programs(kind, work)
    args = (weights(work.model), jnp.full((1, work.model.hidden), 0.1, jnp.float32))

    def run() -> None:
        for program in programs:
            jax.block_until_ready(program(*args))

    run()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)
