"""XLA:CPU's temporary buffers without a page fault on every call.

Each call of a compiled program on XLA:CPU allocates the program's temporary buffer,
runs, and frees it: 208 MB for the peer benchmark's large GRPO train step. glibc's
``malloc`` serves a block that large with a fresh ``mmap`` and returns it with
``munmap``, so every call touches every page of it anew: about 53 000 page faults a
large step, and 225 ms for its train call where the same program takes 185 ms once its
memory stays mapped (``docs/performance.md``, "Host memory").

:func:`keep` makes freed host memory stay in the process for the next call:

* glibc's ``mallopt``: ``M_MMAP_MAX = 0`` (the main heap serves large blocks too),
  ``M_TRIM_THRESHOLD`` at its largest (freed memory at the heap's top is kept, up to
  2 GiB of it) and ``M_MXFAST = 0`` (no fast bins: a freed small block joins its free
  neighbours at once, not in one sweep at a later large ``malloc``, which took 30-40 ms
  of one small GRPO step in ten);
* ``jax_cpu_enable_async_dispatch = False``: XLA:CPU runs a program on the thread that
  calls it. With asynchronous dispatch it runs on a pool thread, whose glibc arena maps
  large blocks with ``mmap`` whatever ``M_MMAP_MAX`` says; only the main heap keeps them.

What it costs: the process's heap stays at its high-water mark (freed memory is reused,
not handed back to the system), host code after a CPU call no longer runs while the
call does, and each free of a small block merges it with its neighbours then (no step
measured slower for it: ``docs/performance.md``, "glibc's fast bins").

It applies only where it helps: Linux with glibc, JAX on its CPU backend (no
accelerator platform asked for or installed), and before JAX has created its backends,
since the dispatch mode is fixed then. rlaxkit calls :func:`keep` when
``rlaxkit.models`` or ``rlaxkit.util.jaxutil`` is first imported; set
``RLAXKIT_HOST_MEMORY=default`` before that to leave all of them alone.

:class:`FreezeAfterFullCollection` keeps Python's full garbage collections off a run's
long-lived objects, and its young collections rarer, while the run's loop runs (the
driver of ``rlaxkit.runtime`` uses one).
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import importlib.util
import os
import platform

ENV = "RLAXKIT_HOST_MEMORY"
CHOICES = ("keep", "default")
# glibc's mallopt parameters (malloc.h).
_M_MXFAST = 1
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# Where JAX finds GPU plugins (jax-cuda12-plugin, ...) and the TPU runtime.
_ACCELERATOR_MODULES = ("jax_plugins", "libtpu")


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """What :func:`keep` did: ``kept`` is whether its settings apply in this process,
    ``reason`` says why or why not."""

    kept: bool
    reason: str


_STATE: HostMemory | None = None


def status() -> HostMemory | None:
    """What :func:`keep` did in this process, or ``None`` before it ran."""
    return _STATE


def keep() -> HostMemory:
    """Keep freed host memory for XLA:CPU's next call, where that helps (module
    docstring); the first call decides, later calls return its result."""
    global _STATE
    if _STATE is None:
        _STATE = _decide()
    return _STATE


def _decide() -> HostMemory:
    choice = os.environ.get(ENV, "keep")
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r}: choose one of {', '.join(CHOICES)}")
    if choice == "default":
        return HostMemory(False, f"{ENV}=default")
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return HostMemory(False, "not Linux with glibc")
    import jax
    from jax._src import xla_bridge

    platforms = getattr(jax.config, "jax_platforms", None)
    if platforms:
        if platforms.split(",")[0].strip() != "cpu":
            return HostMemory(False, f"JAX runs on {platforms}")
    elif _accelerator_installed():
        return HostMemory(False, "an accelerator plugin for JAX is installed")
    if xla_bridge.backends_are_initialized():
        return HostMemory(
            False, "JAX created its backends before rlaxkit was imported; import rlaxkit first"
        )
    libc = ctypes.CDLL(None)
    if not (
        libc.mallopt(_M_MMAP_MAX, 0)
        and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
        and libc.mallopt(_M_MXFAST, 0)
    ):
        return HostMemory(False, "glibc refused mallopt")
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return HostMemory(
        True, "large blocks from the main heap, no fast bins, calls on the calling thread"
    )


def _accelerator_installed() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in _ACCELERATOR_MODULES)


class FreezeAfterFullCollection:
    """Python's full garbage collections, kept off the objects a running loop holds.

    Once a run's programs have compiled, its process holds about 250 000 objects that
    Python's collector tracks (JAX's and Flax's, the model's graph, compiled
    functions), and each full collection walks every one: about 0.1 s, once every 30 or
    so steps of the demo run, 3.6 ms a step on average. Inside ``with freezer:`` (the
    loop running), the first :meth:`step_done` after a full collection moves every
    object then tracked to the collector's permanent generation (``gc.freeze``), which
    later collections skip; leaving the block moves them back (``gc.unfreeze``), and the
    next block waits for a new full collection. A frozen object is still freed when its
    last reference goes; a reference cycle among frozen objects waits for the block's
    end, so nothing a notebook drops between two runs stays frozen. The collector's
    callback holds this object, never the run.

    Inside the block the collector's youngest generation also waits for
    :data:`YOUNG_THRESHOLD` new objects instead of Python's 700. A demo step makes some
    ten thousand (a sample's completion, rollout, trace events and their dicts), most of
    them gone by the step's end: with the default, about 30 young and 3 middle
    collections a step walk them and move the survivors on, 0.8-0.9 ms a step; with
    10 000, 0.2 ms. An object in a reference cycle, and what it holds, waits that
    much longer to be freed. The threshold goes back when the last open block closes
    (a threshold of 0, collection switched off, is left alone).
    """

    def __init__(self) -> None:
        self.full_collections = 0
        self.frozen = False
        self._depth = 0
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2:
            self.full_collections += 1

    def __enter__(self) -> FreezeAfterFullCollection:
        if not self._depth:
            _young_threshold(+1)
        self._depth += 1
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._depth -= 1
        if not self._depth:
            self._thaw()
            _young_threshold(-1)

    def step_done(self, done: object = None) -> None:
        """A loop step ended (``done``: the step, as a hook after it is given it, unused):
        inside the block, freezes what is tracked, once a full collection has run
        (everything older than it was then still reachable)."""
        if self._depth and self.full_collections and not self.frozen:
            self._unhook()
            gc.freeze()
            self.frozen = True

    def close(self) -> None:
        """Unfreezes, puts the young threshold back and lets go of the collector's
        callback (idempotent)."""
        if self._depth:
            _young_threshold(-1)
        self._depth = 0
        self._thaw()
        self._unhook()

    def _thaw(self) -> None:
        if self.frozen:
            self.frozen = False
            gc.unfreeze()
            self.full_collections = 0
            gc.callbacks.append(self._on_collection)

    def _unhook(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)


# The youngest generation's threshold while a loop runs (FreezeAfterFullCollection).
YOUNG_THRESHOLD = 10_000
_young = {"open": 0, "saved": 0}


def _young_threshold(change: int) -> None:
    """Counts the open loop blocks of every freezer: the first raises the young
    generation's threshold to :data:`YOUNG_THRESHOLD`, the last puts back what it found."""
    first, last = _young["open"] == 0, _young["open"] + change == 0
    _young["open"] += change
    current = gc.get_threshold()
    if change > 0 and first:
        _young["saved"] = current[0]
        if current[0]:
            gc.set_threshold(max(current[0], YOUNG_THRESHOLD), *current[1:])
    elif change < 0 and last and current[0]:
        gc.set_threshold(_young["saved"], *current[1:])
