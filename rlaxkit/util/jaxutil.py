"""Small JAX helpers shared across rlaxkit: compilation counting, tiered compilation,
reading arrays on the host and matmul peak."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray
from jax.sharding import Sharding
from jax.tree_util import PyTreeDef
from jax.typing import DTypeLike

# Before any program runs: XLA:CPU then keeps its freed buffers (``rlaxkit.util.hostmem``).
from rlaxkit.util import hostmem

T = TypeVar("T")

hostmem.keep()

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


def cast_floats(tree: T, dtype: str | None) -> T:
    """``tree`` with its floating-point leaves cast to ``dtype`` (``None``: unchanged):
    e.g. a version pulled by a worker whose sampler runs in ``model.sampler_dtype``."""
    if dtype is None:
        return tree
    target = jnp.dtype(dtype)
    return jax.tree.map(
        lambda x: x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def host_arrays(tree: object) -> Any:
    """``tree`` with every array read on the host (NumPy arrays).

    On XLA:CPU an array is host memory already, and one ``np.asarray`` a leaf reads it:
    ``jax.device_get`` would start a transfer a leaf first, about 10 us each (a worker's
    chunk of six arrays: 17 us a call against 145-150 us). Elsewhere ``jax.device_get``,
    which starts every transfer before it waits for the first.
    """
    if jax.default_backend() == "cpu":
        return jax.tree.map(np.asarray, tree)
    return jax.device_get(tree)


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


# LLVM at -O0, and XLA:CPU's loop emitters for fusions instead of its MLIR fusion
# emitters: on a 2-core CPU the small GRPO train step of ``benchmarks/grpo_step.py``
# compiles in 1.0 s instead of 2.5 s (1.5 s at -O0 alone) and runs in 56 ms instead of
# 22 ms (41 ms at -O0 alone). The quick tier runs once per shape, so compile time is
# what counts. The LLVM module is compiled whole instead of split into parts for a
# thread pool: the quick tier compiles beside other programs, where the split's parts
# only add work (the large GRPO train step: 1.23-1.25 s of CPU against 1.43-1.49 s, the
# same executable speed; that loop's first step took 4.96-5.09 s of CPU against
# 5.15-5.32 s).
QUICK_COMPILER_OPTIONS: dict[str, int | bool] = {
    "xla_backend_optimization_level": 0,
    "xla_cpu_use_fusion_emitters": False,
    "xla_cpu_parallel_codegen_split_count": 1,
}


class _Hold:
    """How many :func:`hold_background_compiles` blocks are running."""

    def __init__(self) -> None:
        self.count = 0
        self.released = threading.Condition()

    @property
    def held(self) -> bool:
        return self.count > 0

    def wait_released(self) -> None:
        with self.released:
            self.released.wait_for(lambda: self.count == 0)


_HOLD = _Hold()

# A call's signature: per argument, its name and value (static) or its name, tree
# structure and leaf signatures.
_Key = tuple[tuple[object, ...], ...]


@contextlib.contextmanager
def hold_background_compiles() -> Iterator[None]:
    """``TieredJit``'s optimised compiles wait while this block runs and start as it ends
    (process-wide: the block holds back the compiles of every thread's calls).

    For a loop's first step: its quick programs compile and run with the CPU to
    themselves, and the optimised ones compile during the next step. Calls inside the
    block run the quick executables, so which executable ran a call still depends only
    on where the call is, not on timing. On a 2-core CPU this takes the small GRPO
    loop's first step (``benchmarks/peers``) from 3.4-3.8 s to 2.6 s when its sampler is
    tiered too: the optimised sampler compiles had competed with the train step's quick
    compile, and its tracing, for the cores and the GIL.
    """
    with _HOLD.released:
        _HOLD.count += 1
    try:
        yield
    finally:
        with _HOLD.released:
            _HOLD.count -= 1
            _HOLD.released.notify_all()


def _leaf_signature(x: object) -> tuple[ShapedArray, Sharding | None]:
    """A leaf's ``(abstract value, sharding)`` as ``jax.jit`` keys it: shape, dtype and
    weak type, and the sharding of a committed array only (``None`` otherwise: an
    executable lowered for an uncommitted array's sharding is not the one ``jax.jit``
    finds for that array). A ``jax.Array`` keeps its abstract value, so reading it costs
    less than reading the shape and the dtype apart."""
    if isinstance(x, jax.Array):
        return (x.aval, x.sharding if getattr(x, "committed", True) else None)
    return (jax.typeof(x), None)


class TieredJit:
    """``jax.jit(fun)`` whose first call per input shape runs a quickly compiled executable.

    The first call with a new signature (tree structure, shapes, dtypes, shardings, and
    the values of static arguments) compiles ``fun`` with ``QUICK_COMPILER_OPTIONS`` and
    runs that; as it returns, the fully optimised executable starts compiling on a
    background thread. Every later call with that signature runs the optimised one,
    waiting for its compile if need be. So the first step of a loop costs about half the
    compile time, and which executable ran a call depends only on the call's position,
    not on timing: two runs with one seed still agree bit for bit (the two executables
    may differ from each other in the last bits, as any two compilations of one program
    may).

    ``jit_kwargs`` are ``jax.jit``'s (``static_argnames``, ``donate_argnums``, ...).
    ``lower`` lowers the quick version (to precompile the first call on a thread);
    ``optimised`` is the plain ``jax.jit`` function.
    """

    def __init__(self, fun: Callable, **jit_kwargs: Any):
        self.optimised = jax.jit(fun, **jit_kwargs)
        self.quick = jax.jit(fun, compiler_options=QUICK_COMPILER_OPTIONS, **jit_kwargs)
        self._parameters = inspect.signature(fun)
        names = list(self._parameters.parameters)
        static = set(jit_kwargs.get("static_argnames", ()))
        static |= {names[i] for i in jit_kwargs.get("static_argnums", ())}
        self._static = static
        self._compiling: dict[_Key, threading.Thread] = {}
        self._lock = threading.Lock()

    def _signature(
        self, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> tuple[inspect.BoundArguments, _Key]:
        """``(bound arguments, key)``: the key is each argument's tree structure and its
        leaves' shapes, dtypes and shardings; static arguments key by value. Built from
        the leaves' own attributes, without an abstract value per leaf: a call of a
        known signature costs one flatten of its arguments. For a train state of 150
        leaves that is 0.2 ms flattened again and again (1.1 ms with abstract values
        built), and about 1 ms as the first flatten after a train step, whose caches
        are cold (docs/performance.md)."""
        bound = self._parameters.bind(*args, **kwargs)
        key: list[tuple[object, ...]] = []
        for name, value in bound.arguments.items():
            if name in self._static:
                key.append((name, value))
                continue
            leaves, tree = jax.tree.flatten(value)
            key.append((name, tree, tuple(_leaf_signature(x) for x in leaves)))
        return bound, tuple(key)

    def _abstract(
        self, bound: inspect.BoundArguments
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        """``(args, kwargs)`` of ``bound`` with every array argument abstract."""

        def spec(x: object) -> jax.ShapeDtypeStruct:
            aval, sharding = _leaf_signature(x)
            return jax.ShapeDtypeStruct(
                aval.shape, aval.dtype, sharding=sharding, weak_type=aval.weak_type
            )

        arguments = {
            name: value if name in self._static else jax.tree.map(spec, value)
            for name, value in bound.arguments.items()
        }
        abstract = inspect.BoundArguments(self._parameters, arguments)
        return abstract.args, abstract.kwargs

    def lower(self, *args: object, **kwargs: object) -> jax.stages.Lowered:
        """``jax.jit(fun, compiler_options=QUICK_COMPILER_OPTIONS).lower(...)``."""
        return self.quick.lower(*args, **kwargs)

    def __call__(self, *args: object, **kwargs: object) -> Any:
        # Before the call: its inputs may be donated.
        bound, key = self._signature(args, kwargs)
        with self._lock:
            compiling = self._compiling.get(key)
        if compiling is not None and not _HOLD.held:
            compiling.join()  # returns at once when the optimised compile is done
            return self.optimised(*args, **kwargs)
        if compiling is not None:  # a later call inside a hold: quick again
            return self.quick(*args, **kwargs)
        abstract_args, abstract_kwargs = self._abstract(bound)
        out = self.quick(*args, **kwargs)

        def compile_optimised() -> None:
            _HOLD.wait_released()
            self.optimised.lower(*abstract_args, **abstract_kwargs).compile()

        thread = threading.Thread(target=compile_optimised, name="optimised-compile", daemon=True)
        with self._lock:
            self._compiling[key] = thread
        thread.start()
        return out

    def wait(self) -> None:
        """Blocks until every optimised compile started so far is done (not inside
        :func:`hold_background_compiles`, whose compiles wait for its end)."""
        with self._lock:
            threads = list(self._compiling.values())
        for thread in threads:
            thread.join()


class _Structure:
    """An interned tree structure: one object per distinct ``PyTreeDef``, hashed once.

    ``jax.jit`` hashes and compares the tree structure of its arguments on every call.
    For a tree of ``nnx.Variable``\\ s that calls flax's Python code once per Variable;
    as the structure of a :class:`Packed` tree it is one cached hash and an identity test.
    """

    __slots__ = ("treedef", "_hash")
    _interned: dict[PyTreeDef, _Structure] = {}

    def __init__(self, treedef: PyTreeDef):
        self.treedef = treedef
        self._hash = hash(treedef)

    @classmethod
    def of(cls, treedef: PyTreeDef) -> _Structure:
        found = cls._interned.get(treedef)
        if found is None:
            found = cls._interned.setdefault(treedef, cls(treedef))
        return found

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other  # interned: equal structures are one object

    def __reduce__(self) -> tuple[Callable[[PyTreeDef], _Structure], tuple[PyTreeDef]]:
        return (_Structure.of, (self.treedef,))


class Packed:
    """A pytree flattened once: its leaves, and its structure interned.

    As an argument of a jitted function it flattens to its leaves with one Python call
    and keys the compilation cache by an interned structure, where the tree itself (a
    train state of ``nnx.Variable``\\ s) costs a Python call per node on every call, in
    the flatten and again in the cache lookup. A jitted function that returns a
    ``Packed`` hands its outputs back the same way; :meth:`tree` rebuilds the tree.

    >>> p = Packed.of({"w": jnp.zeros(2), "b": jnp.ones(())})
    >>> len(p.leaves), sorted(p.tree())
    (2, ['b', 'w'])
    >>> Packed.of({"w": 1.0, "b": 2.0}).structure is Packed.of({"b": 0, "w": 0}).structure
    True
    """

    __slots__ = ("leaves", "structure")

    def __init__(self, leaves: list[Any], structure: _Structure):
        self.leaves = leaves
        self.structure = structure

    @classmethod
    def of(cls, tree: object) -> Packed:
        built = _built(tree)
        if built is not None:
            return built
        leaves, treedef = jax.tree.flatten(tree)
        return cls(leaves, _Structure.of(treedef))

    def tree(self) -> Any:
        """The tree, rebuilt from the leaves. While it lives, ``Packed.of`` of it is this
        ``Packed`` (no flatten): a trainer's published params reach each worker's engine
        packed. Like a ``TrainState``'s fields, such a tree must not change in place."""
        tree = self.structure.treedef.unflatten(self.leaves)
        key = id(tree)
        try:
            ref = weakref.ref(tree, functools.partial(_forget, key))
        except TypeError:  # dicts, lists, tuples: no weak references, not remembered
            return tree
        _BUILT[key] = (ref, self)
        return tree


# Trees built by ``Packed.tree``, by id while they live (the reference tells a reused id
# apart), with the ``Packed`` they came from.
_BUILT: dict[int, tuple[weakref.ref[object], Packed]] = {}


def tree_leaves(tree: object) -> list[Any]:
    """``jax.tree.leaves(tree)``; for a tree that ``Packed.tree`` built, its ``Packed``'s
    leaves, without a flatten (e.g. the size of the params a trainer publishes)."""
    built = _built(tree)
    return jax.tree.leaves(tree) if built is None else list(built.leaves)


def _built(tree: object) -> Packed | None:
    """The ``Packed`` that built ``tree`` (``Packed.tree``), while it lives, else ``None``."""
    found = _BUILT.get(id(tree))
    return found[1] if found is not None and found[0]() is tree else None


def _forget(
    key: int,
    _: weakref.ref[object],
    pop: Callable[[int, None], object] = _BUILT.pop,
) -> None:
    pop(key, None)  # bound at definition: the module's globals may be gone at exit


jax.tree_util.register_pytree_node(
    Packed,
    lambda p: (p.leaves, p.structure),
    lambda structure, leaves: Packed(leaves, structure),
)
