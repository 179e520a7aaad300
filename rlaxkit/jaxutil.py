"""Small JAX helpers shared across rlaxkit: compilation counting and matmul peak."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_compiles = 0
_listening = False


def _on_duration(event: str, duration_s: float, **_: object) -> None:
    global _compiles
    if event == _COMPILE_EVENT:
        with _lock:
            _compiles += 1


def _ensure_listener() -> None:
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _listening = True


class CompileCounter:
    """Counts XLA backend compilations while active (see ``count_compilations``)."""

    def __init__(self) -> None:
        self.start = _compiles
        self.stop: int | None = None

    @property
    def count(self) -> int:
        """Compilations since the counter started (until it stopped)."""
        return (_compiles if self.stop is None else self.stop) - self.start


@contextlib.contextmanager
def count_compilations() -> Iterator[CompileCounter]:
    """Counts the XLA compilations that happen inside the ``with`` block.

    >>> with count_compilations() as c:
    ...     _ = jax.jit(lambda x: x + 1)(1.0)
    >>> c.count
    1
    """
    _ensure_listener()
    counter = CompileCounter()
    try:
        yield counter
    finally:
        counter.stop = _compiles


def matmul_peak_flops(size: int = 2048, repeats: int = 5, dtype=jnp.float32) -> float:
    """Measured FLOP/s of a square matmul on the default device (best of ``repeats``).

    Benchmarks divide their achieved FLOP/s by this figure, measured in the same run, to
    report model FLOP utilisation (MFU) on whatever machine they run on.
    """
    a = jnp.ones((size, size), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best
