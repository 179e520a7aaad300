"""A trainer over several processes (hosts): ``jax.distributed`` and the global mesh.

One JAX process sees only its own host's devices. To train a model on a TPU pod slice
or on several GPU hosts, one trainer process runs per host and all of them run the same
jitted train step (SPMD, "multi-controller" JAX): the mesh spans every process's
devices, the parameters and optimizer state are sharded over it, and every process
feeds the step the same global batch. This module holds the few pieces that differ
from one process:

- :func:`initialize` joins the process group (``jax.distributed.initialize``) from a
  :class:`DistributedConfig`, given explicitly or read from the usual environment
  variables (:meth:`DistributedConfig.from_env`), with errors that name the field.
  It must run before anything touches a JAX device.
- :func:`global_mesh` builds the trainer's ``(data, fsdp, model)`` mesh over all
  processes' devices (``rlaxkit.trainer.sharding.make_mesh``).
- :func:`place_global` (and :func:`place_train_state`, :func:`place_batch`) turn a
  value every process holds in full, in host memory, into global arrays laid out on the
  mesh: each process contributes the shards its own devices hold.
- :func:`gather_to_host` is the reverse for weights to push or evaluate: full
  ``numpy`` arrays, in every process (a collective: every process must call it).

With one process every function still works (the mesh is the local devices), so the
same code runs on a laptop; the Ray placement's trainer processes
(``rlaxkit.runtime.ray_trainer_group``) use it for ``RayConfig.trainer_processes > 1``.

>>> import jax
>>> mesh = global_mesh((1, -1, 1))            # every device on fsdp
>>> dict(mesh.shape)["fsdp"] == jax.device_count()
True
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rlaxkit.data.batch import TrainBatch
from rlaxkit.rules.validation import check_int, is_int
from rlaxkit.trainer.sharding import BATCH_AXES, make_mesh, state_shardings
from rlaxkit.trainer.state import TrainState

T = TypeVar("T")

__all__ = [
    "DistributedConfig",
    "broadcast_from_process_0",
    "gather_to_host",
    "global_mesh",
    "initialize",
    "metrics_to_host",
    "place_batch",
    "place_global",
    "place_train_state",
    "resolve_mesh_shape",
    "shutdown",
]

# Environment variables read by ``DistributedConfig.from_env`` (JAX itself reads the
# first and the last; launchers and job specs commonly set all four).
ENV_VARS = {
    "coordinator_address": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
    "local_device_ids": "JAX_LOCAL_DEVICE_IDS",
}
_ADDRESS = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[^\s:\[\]]+):(?P<port>\d+)$")


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """How this process joins the trainer's process group.

    Fields left ``None`` are found by JAX's cluster detection (Cloud TPU VMs, Slurm,
    Open MPI, Kubernetes JobSets): on a TPU slice ``DistributedConfig()`` is enough.

    Attributes:
        coordinator_address: ``host:port`` of process 0's coordinator service; every
            process gives the same one. ``host`` must be reachable from every host
            (not ``localhost`` across hosts); the port must be free on process 0's host.
        num_processes: processes in the group (one per host, usually).
        process_id: this process's rank in ``[0, num_processes)``; 0 hosts the
            coordinator.
        local_device_ids: restrict this process to these local devices (GPU ids), e.g.
            one process per GPU; ``None`` uses every device the process sees.
        initialization_timeout_s: how long to wait for every process to join.
        heartbeat_timeout_s: after this long without a heartbeat a process counts as
            dead, and JAX stops the others.
        cpu_collectives: the CPU backend's collectives across processes (``gloo``:
            over TCP, no extra install); ``None`` leaves JAX's setting alone. Ignored on
            TPU and GPU, whose collectives are their own.
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    initialization_timeout_s: int = 300
    heartbeat_timeout_s: int = 100
    cpu_collectives: Literal["gloo", "mpi"] | None = "gloo"

    def __post_init__(self) -> None:
        if self.coordinator_address is not None:
            match = _ADDRESS.match(str(self.coordinator_address))
            if not match or not 0 < int(match["port"]) < 65536:
                raise ValueError(
                    "coordinator_address: must be 'host:port' with a port in 1..65535 "
                    f"(e.g. '10.0.0.1:1234'), got {self.coordinator_address!r}"
                )
        for name in ("num_processes", "initialization_timeout_s", "heartbeat_timeout_s"):
            value = getattr(self, name)
            if value is not None:
                check_int(name, value, minimum=1, numpy=True)
        if self.process_id is not None:
            check_int("process_id", self.process_id, minimum=0, numpy=True)
            if self.num_processes is not None and self.process_id >= self.num_processes:
                raise ValueError(
                    f"process_id: must be below num_processes = {self.num_processes} "
                    f"(ranks are 0..{self.num_processes - 1}), got {self.process_id}"
                )
        if self.local_device_ids is not None and any(
            not is_int(i, numpy=True) or i < 0 for i in self.local_device_ids
        ):
            raise ValueError(
                f"local_device_ids: must be integers >= 0, got {self.local_device_ids!r}"
            )
        if self.cpu_collectives not in (None, "gloo", "mpi"):
            raise ValueError(
                f"cpu_collectives: must be 'gloo', 'mpi' or None, got {self.cpu_collectives!r}"
            )

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **explicit: object
    ) -> DistributedConfig:
        """Settings from ``explicit`` keyword arguments, else the environment.

        Reads ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``
        and ``JAX_LOCAL_DEVICE_IDS`` (comma-separated) for the fields not given.

        Raises:
            ValueError: a variable that does not parse, naming it and the field.
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, var in ENV_VARS.items():
            if explicit.get(name) is not None or not environ.get(var):
                continue
            raw = environ[var].strip()
            try:
                if name == "coordinator_address":
                    values[name] = raw
                elif name == "local_device_ids":
                    values[name] = tuple(int(x) for x in raw.split(",") if x.strip())
                else:
                    values[name] = int(raw)
            except ValueError:
                kind = "integers, comma-separated" if name == "local_device_ids" else "an integer"
                raise ValueError(
                    f"{name}: environment variable {var}={raw!r} is not {kind}"
                ) from None
        return cls(**{**values, **{k: v for k, v in explicit.items() if v is not None}})


def initialize(config: DistributedConfig | None = None) -> None:
    """Joins the process group: ``jax.distributed.initialize`` with ``config``.

    ``None`` reads :meth:`DistributedConfig.from_env`. Call it first thing in each
    trainer process, before any other JAX call that touches a device (``jax.devices()``,
    creating a model, any computation). Blocks until every process has joined (up to
    ``initialization_timeout_s``). Calling it again with the same group is a no-op.

    Raises:
        RuntimeError: JAX's devices were already in use in this process, or the process
            joined another group.
        ValueError: a field neither given nor found by JAX's cluster detection, named.
    """
    config = DistributedConfig.from_env() if config is None else config
    if jax.distributed.is_initialized():
        if config.num_processes not in (None, jax.process_count()) or config.process_id not in (
            None,
            jax.process_index(),
        ):
            raise RuntimeError(
                f"this process already joined a group as process {jax.process_index()} of "
                f"{jax.process_count()}; it cannot join another (process_id="
                f"{config.process_id}, num_processes={config.num_processes}): start a new "
                "process"
            )
        return
    if config.cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", config.cpu_collectives)
    try:
        jax.distributed.initialize(
            coordinator_address=config.coordinator_address,
            num_processes=config.num_processes,
            process_id=config.process_id,
            local_device_ids=(
                list(config.local_device_ids) if config.local_device_ids is not None else None
            ),
            initialization_timeout=config.initialization_timeout_s,
            heartbeat_timeout_seconds=config.heartbeat_timeout_s,
        )
    except ValueError as error:
        raise ValueError(_explain(error)) from error
    except RuntimeError as error:
        if "must be called before" not in str(error):
            raise
        raise RuntimeError(
            "rlaxkit.trainer.distributed.initialize must run before anything touches a JAX device "
            "(jax.devices(), building a model, any computation) in this process: call it "
            "first, right after the imports"
        ) from error


def _explain(error: ValueError) -> str:
    """JAX's message about a missing setting, rewritten to name our field and its fix."""
    message = str(error)
    for needle, name in (
        ("coordinator_address", "coordinator_address"),
        ("Number of processes", "num_processes"),
        ("process id", "process_id"),
    ):
        if needle in message:
            return (
                f"{name}: not given, not in the environment ({ENV_VARS[name]}) and not "
                "found by JAX's cluster detection (TPU VMs, Slurm, Open MPI, Kubernetes): "
                f"pass DistributedConfig({name}=...) or set {ENV_VARS[name]} in every "
                f"trainer process ({message})"
            )
    return message


def shutdown() -> None:
    """Leaves the process group (every process should call it; a no-op without one)."""
    jax.distributed.shutdown()


def resolve_mesh_shape(shape: Sequence[int], device_count: int) -> tuple[int, int, int]:
    """``(data, fsdp, model)`` with a ``-1`` replaced by the devices left over.

    >>> resolve_mesh_shape((2, -1, 1), 8)
    (2, 4, 1)

    Raises:
        ValueError: not three sizes, more than one ``-1``, or sizes whose product is not
            ``device_count``.
    """
    shape = tuple(shape)
    if len(shape) != 3 or any(not is_int(s, numpy=True) or (s < 1 and s != -1) for s in shape):
        raise ValueError(
            f"trainer_mesh: must be three sizes (data, fsdp, model), each >= 1 or one of "
            f"them -1 (the devices left over), got {shape!r}"
        )
    if shape.count(-1) > 1:
        raise ValueError(f"trainer_mesh: at most one size may be -1, got {shape!r}")
    known = int(np.prod([s for s in shape if s != -1]))
    if -1 in shape:
        if device_count % known:
            raise ValueError(
                f"trainer_mesh: {shape!r} cannot cover {device_count} devices ({known} does "
                "not divide it)"
            )
        shape = tuple(device_count // known if s == -1 else s for s in shape)
    if int(np.prod(shape)) != device_count:
        raise ValueError(
            f"trainer_mesh: {shape!r} has {int(np.prod(shape))} devices but the trainer's "
            f"processes have {device_count} in all: make the product {device_count} (or use "
            "-1 for one axis)"
        )
    return shape  # type: ignore[return-value]


def global_mesh(shape: Sequence[int] = (1, -1, 1)) -> Mesh:
    """The trainer's ``(data, fsdp, model)`` mesh over every process's devices.

    Every process must build the same mesh. ``shape`` may hold one ``-1`` (see
    :func:`resolve_mesh_shape`); the product must be the global device count, so that
    every process takes part in every step.
    """
    devices = jax.devices()
    return make_mesh(*resolve_mesh_shape(shape, len(devices)), devices=devices)


def place_global(tree: T, shardings: object) -> T:
    """Global arrays from a value every process holds in full (host or local device).

    Each process hands JAX only the shards its own devices hold
    (``jax.make_array_from_callback``), so no value crosses the network here. Every
    process must pass the same values: nothing checks it, and different values make a
    silently inconsistent array.
    """

    def place(x, sharding):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(place, tree, shardings)


def place_train_state(state: TrainState, mesh: Mesh) -> TrainState:
    """``state`` laid out on ``mesh`` with ``rlaxkit.trainer.sharding.state_shardings``: the
    multi-process counterpart of ``rlaxkit.trainer.sharding.shard_train_state``."""
    return place_global(state, state_shardings(state, mesh))


def place_batch(batch: TrainBatch, mesh: Mesh) -> TrainBatch:
    """``batch`` with its rows split over ``data × fsdp``: the multi-process counterpart
    of ``rlaxkit.trainer.sharding.shard_batch``."""
    rows = NamedSharding(mesh, P(BATCH_AXES))
    return place_global(batch, jax.tree.map(lambda _: rows, batch))


def gather_to_host(tree: T) -> T:
    """Full ``numpy`` copies of (possibly sharded, multi-process) arrays, in every
    process; host values pass through.

    A collective: every process must call it, with the same tree, at the same point.
    Leaves are gathered one at a time, so a device holds at most one whole leaf beyond
    its shards at any moment.
    """

    def gather(x):
        if not isinstance(x, jax.Array):
            return np.asarray(x)
        if x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        if x.is_fully_replicated:  # Every device holds it all: no exchange needed.
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(gather, tree)


def broadcast_from_process_0(tree: T) -> T:
    """Process 0's ``tree`` (host or local arrays), as ``numpy``, in every process.

    Used where only process 0 computed something (a warm start): the others receive its
    result instead of recomputing it. A collective: every process must call it, with a
    tree of the same structure, shapes and dtypes.
    """
    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))


def metrics_to_host(metrics: Mapping[str, jax.Array]) -> dict[str, float]:
    """A train step's scalar metrics as floats (they are replicated on every device)."""
    return {k: float(v) for k, v in gather_to_host(dict(metrics)).items()}
