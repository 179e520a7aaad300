"""Small JAX helpers shared across rlaxkit: compilation counting, tiered compilation and
matmul peak."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_compiles = 0
_listening = False


def _on_duration(event: str, duration_secs: float, **_: str | int) -> None:
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

    >>> f = jax.jit(lambda x: x + 1)
    >>> _ = f(1.0)  # compiles, unless JAX's persistent compilation cache holds it
    >>> with count_compilations() as c:
    ...     _ = f(2.0)
    >>> c.count  # same shapes and dtypes: the compiled program is reused
    0
    """
    _ensure_listener()
    counter = CompileCounter()
    try:
        yield counter
    finally:
        counter.stop = _compiles


def matmul_peak_flops(size: int = 2048, repeats: int = 5, dtype: DTypeLike = jnp.float32) -> float:
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


# LLVM at -O0: on a 2-core CPU a GRPO train step compiles in ~0.6x the CPU time and runs
# ~1.7x slower (measured on the small model of ``benchmarks/grpo_step.py``).
QUICK_COMPILER_OPTIONS: dict[str, str] = {"xla_backend_optimization_level": "0"}


class TieredJit:
    """``jax.jit(fun)`` whose first call per input shape runs a quickly compiled executable.

    The first call with a new signature (tree structure, shapes, dtypes, shardings)
    compiles ``fun`` with ``QUICK_COMPILER_OPTIONS`` and runs that; as it returns, the
    fully optimised executable starts compiling on a background thread. Every later
    call with that signature runs the optimised one, waiting for its compile if need
    be. So the first step of a loop costs about half the compile time, and which
    executable ran a call depends only on the call's position, not on timing: two runs
    with one seed still agree bit for bit (the two executables may differ from each
    other in the last bits, as any two compilations of one program may).

    ``lower`` lowers the quick version (to precompile the first call on a thread);
    ``optimised`` is the plain ``jax.jit`` function.
    """

    def __init__(self, fun: Callable, **jit_kwargs: Any):
        self.optimised = jax.jit(fun, **jit_kwargs)
        self.quick = jax.jit(fun, compiler_options=QUICK_COMPILER_OPTIONS, **jit_kwargs)
        self._compiling: dict[Any, threading.Thread] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _abstract(args: tuple) -> tuple:
        def spec(x):
            sharding = getattr(x, "sharding", None)
            return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=sharding)

        return jax.tree.map(spec, args)

    @staticmethod
    def _signature(abstract: tuple) -> Any:
        leaves, tree = jax.tree.flatten(abstract)
        return tree, tuple((x.shape, x.dtype, x.sharding) for x in leaves)

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """``jax.jit(fun, compiler_options=QUICK_COMPILER_OPTIONS).lower(*args)``."""
        return self.quick.lower(*args)

    def __call__(self, *args: Any) -> Any:
        abstract = self._abstract(args)  # before the call: inputs may be donated
        key = self._signature(abstract)
        with self._lock:
            compiling = self._compiling.get(key)
        if compiling is not None:
            compiling.join()  # returns at once when the optimised compile is done
            return self.optimised(*args)
        out = self.quick(*args)
        thread = threading.Thread(
            target=lambda: self.optimised.lower(*abstract).compile(),
            name="optimised-compile",
            daemon=True,
        )
        with self._lock:
            self._compiling[key] = thread
        thread.start()
        return out

    def wait(self) -> None:
        """Blocks until every optimised compile started so far is done."""
        with self._lock:
            threads = list(self._compiling.values())
        for thread in threads:
            thread.join()
