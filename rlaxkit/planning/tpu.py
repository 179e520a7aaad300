"""TPU topologies on a machine without TPUs: compile-only devices and meshes.

``libtpu`` (the ``rlaxkit[tpu]`` extra) compiles for a TPU slice it does not have:
``jax.experimental.topologies.get_topology_desc`` returns the slice's devices, and a
program lowered with shardings on a mesh of them compiles with XLA:TPU, whose
``memory_analysis()`` and ``cost_analysis()`` are the TPU program's. No TPU runtime is
started and nothing is allocated. This module turns a topology's name into those
devices and a mesh, with errors that name what is wrong (never libtpu's own):

>>> parse_topology("v5p-128").name, parse_topology("v5p-128").chips
('v5p:4x4x4', 64)
>>> parse_topology("v6e:16x16").chips
256

``tpu_mesh("v5p:2x2x1", (1, 2, 2))`` is a ``(data, fsdp, model)`` mesh of its devices;
``jax.jit(f).lower(*specs).compile()`` with shardings on it is the XLA:TPU compile.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlaxkit.planning.chips import CHIPS, ChipSpec

__all__ = [
    "GENERATIONS",
    "Topology",
    "check_shardable",
    "parse_topology",
    "require_libtpu",
    "topology_for",
    "tpu_devices",
    "tpu_mesh",
]


@dataclass(frozen=True, kw_only=True)
class Generation:
    """What a topology name needs to know of one TPU generation.

    Attributes:
        name: ``v4``, ``v5e``, ``v5p`` or ``v6e`` (libtpu's spelling).
        dims: 3 for the 3-D torus generations (v4, v5p), 2 for the 2-D ones.
        cores_per_chip: TensorCores per chip: the ``-N`` of ``v5p-128`` counts cores.
        devices_per_chip: JAX devices per chip in libtpu 0.0.42's compile-only
            descriptor (v4 lists each core as a device; v5p joins its two as one).
        chip: the chip's memory and speed (``rlaxkit.planning.CHIPS``).
    """

    name: str
    dims: int
    cores_per_chip: int
    devices_per_chip: int
    chip: ChipSpec


GENERATIONS: dict[str, Generation] = {
    "v4": Generation(name="v4", dims=3, cores_per_chip=2, devices_per_chip=2, chip=CHIPS["v4"]),
    "v5e": Generation(name="v5e", dims=2, cores_per_chip=1, devices_per_chip=1, chip=CHIPS["v5e"]),
    "v5p": Generation(name="v5p", dims=3, cores_per_chip=2, devices_per_chip=1, chip=CHIPS["v5p"]),
    "v6e": Generation(name="v6e", dims=2, cores_per_chip=1, devices_per_chip=1, chip=CHIPS["v6e"]),
}
_ALIASES = {"v5litepod": "v5e", "v6litepod": "v6e"}
_MIN_CHIPS = 4  # one host's 2x2(x1) chips: libtpu rejects smaller slices
_COLON = re.compile(r"^(v[0-9a-z]+):([0-9]+(?:x[0-9]+)+)$")
_DASH = re.compile(r"^(v[0-9a-z]+)-([0-9]+)$")
_HELP = (
    "known generations: v4, v5e, v5p, v6e, named like 'v5p:4x4x4' (chips per axis) or "
    "'v5p-128' (TensorCores; chips for v5e and v6e)"
)
_EXTRA = "pip install 'rlaxkit[tpu]' (installs libtpu matched to jax)"


@dataclass(frozen=True, kw_only=True)
class Topology:
    """A TPU slice: its generation and chips per axis.

    Attributes:
        generation: the ``GENERATIONS`` entry.
        shape: chips along each axis (``(4, 4, 4)`` for ``v5p:4x4x4``).
    """

    generation: Generation
    shape: tuple[int, ...]

    @property
    def name(self) -> str:
        """libtpu's name of the slice, ``v5p:4x4x4``."""
        return f"{self.generation.name}:{'x'.join(map(str, self.shape))}"

    @property
    def chips(self) -> int:
        """Chips of the slice."""
        return math.prod(self.shape)

    @property
    def devices(self) -> int:
        """JAX devices of the slice (``chips × devices_per_chip``)."""
        return self.chips * self.generation.devices_per_chip

    @property
    def device_hbm_bytes(self) -> float:
        """HBM of one device."""
        return self.generation.chip.hbm_bytes / self.generation.devices_per_chip

    @property
    def device_peak_flops(self) -> float:
        """Peak dense bf16 FLOP/s of one device."""
        return self.generation.chip.peak_flops / self.generation.devices_per_chip


def _generation(name: str, topology: str) -> Generation:
    key = _ALIASES.get(name, name)
    if key not in GENERATIONS:
        raise ValueError(f"unknown TPU topology {topology!r}: {_HELP}")
    return GENERATIONS[key]


def topology_for(generation: str, chips: int) -> Topology:
    """The usual slice of ``chips`` chips of ``generation``: as square (cubic) as powers
    of two allow, at least one host's four chips.

    >>> topology_for("v5p", 1024).name, topology_for("v5e", 32).name
    ('v5p:8x8x16', 'v5e:4x8')
    """
    gen = _generation(generation, f"{generation}-{chips}")
    if chips < _MIN_CHIPS or chips & (chips - 1):
        raise ValueError(
            f"a {gen.name} slice of {chips} chips is not a topology libtpu knows: use a "
            f"power of two of at least {_MIN_CHIPS} chips, or name the shape ('{gen.name}:"
            + ("2x2x1" if gen.dims == 3 else "2x2")
            + "')"
        )
    shape = [1] * gen.dims
    for _ in range(int(math.log2(chips))):
        shape[shape.index(min(shape))] *= 2
    if gen.dims == 3 and chips == _MIN_CHIPS:
        return Topology(generation=gen, shape=(2, 2, 1))
    return Topology(generation=gen, shape=tuple(sorted(shape)))


def parse_topology(topology: str | Topology) -> Topology:
    """``v5p:4x4x4`` (chips per axis) or ``v5p-128`` (TensorCores for v4 and v5p,
    chips for v5e and v6e) as a ``Topology``.

    Raises:
        ValueError: the name is neither spelling, or names an unknown generation (the
            message lists the known ones).
    """
    if isinstance(topology, Topology):
        return topology
    text = str(topology).strip().lower()
    if match := _COLON.match(text):
        gen = _generation(match.group(1), topology)
        shape = tuple(int(n) for n in match.group(2).split("x"))
        if len(shape) != gen.dims or min(shape) < 1:
            raise ValueError(
                f"TPU topology {topology!r}: a {gen.name} slice has {gen.dims} axes, like "
                + ("'v5p:4x4x4'" if gen.dims == 3 else "'v5e:4x4'")
            )
        return Topology(generation=gen, shape=shape)
    if match := _DASH.match(text):
        gen = _generation(match.group(1), topology)
        cores = int(match.group(2))
        if cores % gen.cores_per_chip:
            raise ValueError(
                f"TPU topology {topology!r}: {gen.name}-N counts TensorCores, "
                f"{gen.cores_per_chip} per chip; N must be a multiple of {gen.cores_per_chip}"
            )
        return topology_for(gen.name, cores // gen.cores_per_chip)
    raise ValueError(f"unknown TPU topology {topology!r}: {_HELP}")


def require_libtpu() -> None:
    """Raises ``ImportError`` naming the ``rlaxkit[tpu]`` extra when libtpu is absent."""
    try:
        import libtpu  # type: ignore[import-untyped]  # noqa: F401
    except ImportError as err:
        raise ImportError(f"compiling for a TPU needs libtpu: {_EXTRA}") from err


@functools.cache
def _devices(name: str) -> tuple[Any, ...]:
    require_libtpu()
    # libtpu asks the cloud metadata server who it is unless told not to; compile-only
    # descriptors need no TPU runtime, so JAX must not start one either.
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # A compile-only libtpu holds no chip, so several processes (pytest's workers, a plan's
    # child) may load it at once; without this the second one fails on libtpu's lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        description = topologies.get_topology_desc(platform="tpu", topology_name=name)
    except Exception as err:  # libtpu's errors are long and name its own internals
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"libtpu cannot describe the TPU topology {name!r} ({first}); {_HELP}"
        ) from None
    return tuple(description.devices)


def tpu_devices(topology: str | Topology) -> list[Any]:
    """The compile-only devices of ``topology`` (cached per name)."""
    return list(_devices(parse_topology(topology).name))


def tpu_mesh(
    topology: str | Topology,
    sizes: Sequence[int],
    axes: Sequence[str] = ("data", "fsdp", "model"),
    devices: int | None = None,
) -> Any:
    """A mesh of ``topology``'s devices with ``axes`` of ``sizes``.

    Args:
        topology: a name (``v5p:2x2x1``, ``v5e-256``) or a ``Topology``.
        sizes: devices along each axis; their product must be the slice's devices, or
            ``devices`` when given.
        axes: the axis names (the trainer's ``(data, fsdp, model)`` by default).
        devices: use only the slice's first ``devices`` devices (a worker's few chips
            inside a larger slice).

    Raises:
        ValueError: the sizes do not multiply to the devices used (both numbers named).
    """
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    top = parse_topology(topology)
    if len(sizes) != len(axes):
        raise ValueError(f"mesh: {len(axes)} sizes {tuple(axes)} needed, got {tuple(sizes)}")
    want = top.devices if devices is None else devices
    if math.prod(sizes) != want or want > top.devices:
        raise ValueError(
            f"mesh {tuple(sizes)} has {math.prod(sizes)} devices but the TPU topology "
            f"{top.name} has {top.devices}"
            + (f" (using {want})" if devices is not None else "")
            + "; make the mesh sizes multiply to that"
        )
    chosen = tpu_devices(top)[:want]
    types = (AxisType.Auto,) * len(axes)
    try:  # places the axes on the torus (ICI rings) where jax knows how
        return jax.make_mesh(tuple(sizes), tuple(axes), axis_types=types, devices=chosen)
    except (AssertionError, ValueError, NotImplementedError):
        # v4's descriptor lists each TensorCore, which make_mesh refuses; and a few
        # chips of a slice may not form a torus: devices in their listed order.
        grid = np.array(chosen, dtype=object).reshape(tuple(sizes))
        return Mesh(grid, tuple(axes), axis_types=types)


def check_shardable(model: Any, mesh: Any) -> None:
    """Raises ``ValueError`` naming the model dimension and mesh axis that do not divide.

    The trainer's sharding (``param_partition_spec``) leaves an indivisible dimension
    unsharded, which silently replicates it; a plan would then report memory the user
    did not mean. Heads and widths split over ``model``; the hidden size over ``fsdp``.
    ``mesh`` is a ``Mesh`` or a ``{axis: size}`` dict.
    """
    if isinstance(mesh, dict):
        sizes = dict(mesh)
    else:
        sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    checks = [
        ("num_heads", model.num_heads, "model"),
        ("num_kv_heads", model.num_kv_heads, "model"),
        ("intermediate_size", model.intermediate_size, "model"),
        ("hidden_size", model.hidden_size, "fsdp"),
    ]
    for field, value, axis in checks:
        size = sizes.get(axis, 1)
        if value % size:
            raise ValueError(
                f"model {field} = {value} does not split over the mesh axis {axis!r} of "
                f"size {size}; choose a {axis} size that divides {value}"
            )
