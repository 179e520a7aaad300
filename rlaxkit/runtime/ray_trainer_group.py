"""The Ray backend's trainer as one actor or as a multi-process (multi-host) group.

``RayConfig.trainer_processes = 1`` (the default) is one ``TrainerHost``, which Ray
restarts when it dies. With ``N > 1`` the trainer is ``N``
:class:`TrainerProcessActor`\\ s, usually one per host, forming one ``jax.distributed``
process group (``rlaxkit.trainer.distributed``): SPMD, every process runs the same jitted train
step on the same batch over a ``(data, fsdp, model)`` mesh of all their devices, with
the parameters and optimizer state sharded over it. The driver keeps talking to "the
trainer" through :class:`TrainerGroup`, which sends every call to all processes and
answers with process 0's reply:

- **batches**: the driver ``ray.put``\\ s each batch once and every process reads it.
- **weights**: before a push every process takes part in gathering the sharded weights
  into full host arrays; process 0 alone pushes them to the parameter server (and alone
  keeps the copy it may publish again).
- **checkpoints**: the driver decides when (one clock) and sends every process the
  same driver books; every process calls Orbax's save and restore (each writes and
  reads its own shards of the train state, process 0 alone the books' weights and JSON;
  Orbax coordinates them), so ``run_dir`` must be on storage every trainer host sees.
  A resumed run's group restores the newest checkpoint like a restarted one.
- **the warm start** runs in process 0 only; the others receive its weights by
  broadcast.
- **faults**: a ``jax.distributed`` group cannot take in a lone new member, so when any
  process dies the driver stops them all and starts a new group (a new coordinator),
  which restores the newest checkpoint while the driver replays the batches since, as
  for one trainer (``RayConfig.trainer_max_restarts`` bounds these group restarts).

Placement: the processes go into a Ray placement group (one bundle of
``RayConfig.trainer`` resources each, strategy ``RayConfig.trainer_placement``; use
``STRICT_SPREAD`` for one process per host). Process 0's actor picks the coordinator
address: its node's IP and ``RayConfig.trainer_coordinator_port`` (or a free port).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import socket
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ray
from flax import nnx
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlaxkit.api import PublishReply
from rlaxkit.config.ray import RayConfig
from rlaxkit.config.run import RunConfig
from rlaxkit.data.batch import TrainBatch
from rlaxkit.runtime.build import warm_start
from rlaxkit.runtime.hosts import WeightStore, configure_jax
from rlaxkit.trainer import distributed
from rlaxkit.trainer.host import TrainerHost


@functools.cache
def remote(cls):
    """``ray.remote(cls)``, made once per class."""
    return ray.remote(cls)


def stop_actor(handle: Any, timeout_s: float = 30.0) -> None:
    """Asks an actor to ``close`` (release its pools and files), then kills it."""
    with contextlib.suppress(RayActorError, ray.exceptions.GetTimeoutError):
        ray.get(handle.close.remote(), timeout=timeout_s)
    ray.kill(handle)


_PLACEMENT_WAIT_S = 300.0  # How long the trainer's placement group may take to fit.
_GRACE_S = 10.0  # After one process fails a call, how long the others may take to answer.


@dataclasses.dataclass(frozen=True)
class TrainerProcess:
    """One trainer actor's place in a multi-process trainer.

    Attributes:
        process_id: its rank; 0 hosts the coordinator, pushes and reports.
        num_processes: processes in the group.
        mesh_shape: ``(data, fsdp, model)`` over every process's devices (one ``-1``
            allowed: see ``rlaxkit.trainer.distributed.resolve_mesh_shape``).
        coordinator_port: the coordinator's port on process 0's host (``None``: free).
    """

    process_id: int
    num_processes: int
    mesh_shape: tuple[int, int, int]
    coordinator_port: int | None = None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class TrainerProcessActor(TrainerHost):
    """One process of a multi-process trainer: a ``TrainerHost`` whose arrays live on
    the group's global mesh.

    Construction touches no JAX device (``jax.distributed`` must come first): the
    driver asks process 0 for :meth:`coordinator_address`, then every process
    :meth:`join`\\ s, all at once. Every method that ``TrainerHost`` has must then be
    called on all processes, in the same order (they run collectives);
    :class:`TrainerGroup` does that.

    Args:
        config, store, cache_dir, checkpoint_dir, clock, jax_options: as for
            ``TrainerHost``.
        process: this process's place in the group.
    """

    def __init__(
        self,
        config: RunConfig,
        store: WeightStore,
        cache_dir: str | None,
        checkpoint_dir: str | None,
        clock: Callable[[], float],
        jax_options: Mapping[str, object],
        process: TrainerProcess,
    ):
        configure_jax(jax_options)
        self.process = process
        self.pushes = process.process_id == 0
        self._arguments = (config, store, cache_dir, checkpoint_dir, clock)

    def coordinator_address(self) -> str:
        """``host:port`` for the group's coordinator, on this (process 0's) host."""
        host = ray.util.get_node_ip_address()
        host = f"[{host}]" if ":" in host else host  # IPv6
        return f"{host}:{self.process.coordinator_port or _free_port()}"

    def join(self, coordinator_address: str) -> dict[str, object]:
        """Joins the process group, then builds the trainer on the global mesh.

        Returns ``process_id``, ``devices`` (global), ``local_devices`` and ``mesh``
        (axis sizes).
        """
        distributed.initialize(
            distributed.DistributedConfig(
                coordinator_address=coordinator_address,
                num_processes=self.process.num_processes,
                process_id=self.process.process_id,
            )
        )
        self.mesh = distributed.global_mesh(self.process.mesh_shape)
        self._setup(*self._arguments)
        return {
            "process_id": jax.process_index(),
            "devices": jax.device_count(),
            "local_devices": jax.local_device_count(),
            "mesh": dict(self.mesh.shape),
        }

    # -- where arrays live -------------------------------------------------------------
    def _warm_start(self, config, task, model, tokenizer, cache_dir):
        info: dict[str, object] = {}
        if self.pushes:
            model, info = warm_start(config, task, model, tokenizer, cache_dir)
        graphdef, params = nnx.split(model)
        params = distributed.broadcast_from_process_0(params)
        return nnx.merge(graphdef, jax.tree.map(jnp.asarray, params)), info

    def _place_state(self, state):
        return distributed.place_train_state(state, self.mesh)

    def _place_batch(self, batch: TrainBatch) -> TrainBatch:
        return distributed.place_batch(batch, self.mesh)

    def _host(self, tree):
        return distributed.gather_to_host(tree)

    _for_push = _host

    def _publishable(self, params):
        gathered = distributed.gather_to_host(params)
        return gathered if self.pushes else None

    # -- what only process 0 does --------------------------------------------------------
    def publish(self, step: int, reset: bool = False) -> PublishReply:
        """Process 0 publishes (see ``TrainerHost.publish``); the others only check
        that they are at ``step``."""
        if self.pushes:
            return super().publish(step, reset)
        self._expect(step)
        return PublishReply(None, self._drain())

    def host_params(self, step: int) -> object:
        """The full params on process 0 (``None`` elsewhere: one copy is enough)."""
        params = super().host_params(step)
        return params if self.pushes else None


class TrainerGroup:
    """The driver's handle on the trainer: one ``TrainerHost`` (``trainer_processes
    = 1``; Ray restarts it) or a group of :class:`TrainerProcessActor`\\ s that the
    driver restarts together.

    Args:
        ray_config: resources, ``trainer_processes``, ``trainer_mesh``,
            ``trainer_placement``, ``trainer_coordinator_port``, ``trainer_max_restarts``.
        arguments: ``TrainerHost``'s constructor arguments.
    """

    def __init__(self, ray_config: RayConfig, arguments: tuple):
        self.ray_config, self.arguments = ray_config, arguments
        self.size = ray_config.trainer_processes
        self.restarts = 0  # group restarts (one trainer: Ray's restarts, not counted here)
        self.handles: list[Any] = []
        self.joined: list[dict[str, object]] = []  # each process's ``join`` reply
        self._placement: object = None
        self._joining: list[Any] = []
        self._start()

    @property
    def leader(self) -> Any:
        """Process 0's actor handle."""
        return self.handles[0]

    def _start(self) -> None:
        rc = self.ray_config
        options = {**rc.trainer.options(), "max_task_retries": 0}  # the driver replays
        if self.size == 1:
            actor = remote(TrainerHost)
            options["max_restarts"] = rc.trainer_max_restarts
            self.handles = [actor.options(**options).remote(*self.arguments)]
            return
        strategies = self._place()
        actor = remote(TrainerProcessActor)
        options["max_restarts"] = 0  # a lone restarted process could not rejoin
        self.handles = [
            actor.options(**options, **strategies[rank]).remote(
                *self.arguments,
                TrainerProcess(rank, self.size, rc.trainer_mesh, rc.trainer_coordinator_port),
            )
            for rank in range(self.size)
        ]
        (address,) = self._gather([self.leader.coordinator_address.remote()])
        # Every process blocks in ``join`` until all have joined; the first call waits.
        self._joining = [handle.join.remote(address) for handle in self.handles]

    def _place(self) -> list[dict[str, object]]:
        """A placement group with one bundle per process; its scheduling options."""
        rc = self.ray_config
        bundle = {
            k: v
            for k, v in {
                "CPU": rc.trainer.num_cpus,
                "GPU": rc.trainer.num_gpus,
                **rc.trainer.resources,
            }.items()
            if v > 0
        }
        if not bundle:  # nothing requested: nothing to place
            return [{} for _ in range(self.size)]
        group = self._placement = placement_group(
            [bundle] * self.size, strategy=rc.trainer_placement
        )
        ready, _ = ray.wait([group.ready()], timeout=_PLACEMENT_WAIT_S)
        if not ready:
            remove_placement_group(self._placement)
            self._placement = None
            raise RuntimeError(
                f"trainer_processes: {self.size} trainer processes of {bundle} each "
                f"(trainer_placement={rc.trainer_placement}) found no room in the cluster "
                f"within {_PLACEMENT_WAIT_S:.0f} s: add hosts, lower RayConfig.trainer's "
                "resources, or (on one machine) use trainer_placement=SPREAD or PACK"
            )
        return [
            {
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank
                )
            }
            for rank in range(self.size)
        ]

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Every reply, in order. If a process dies, the group is stopped at once: the
        others may be stuck in a collective, and the driver restarts the whole group
        anyway. If a process raises, the others may still be stuck: they get
        ``_GRACE_S`` to answer, else the group is stopped. Then the first error is
        raised (``RayActorError`` if a process died)."""
        index = {ref: i for i, ref in enumerate(refs)}
        replies: dict[int, object] = {}
        pending, died = list(refs), False
        error: BaseException | None = None
        while pending:
            done, pending = ray.wait(
                pending, num_returns=1, timeout=None if error is None else _GRACE_S
            )
            if not done:
                break
            try:
                replies[index[done[0]]] = ray.get(done[0])
            except RayActorError as failure:
                error, died = error or failure, True
                break  # waiting for the others would only delay the kill below
            except Exception as failure:  # noqa: BLE001 - re-raised below, after cleanup
                error = error or failure
        if error is None:
            return [replies[i] for i in range(len(refs))]
        if died or pending:
            self.kill()
        raise error

    def call(self, method: str, *args: object) -> Any:
        """Calls ``method`` on every process; returns process 0's reply.

        Raises:
            RayActorError: a process died (with several, the group is then stopped and
                the driver restarts it with :meth:`restart`).
        """
        return self.start(method, *args)()

    def start(self, method: str, *args: object) -> Callable[[], Any]:
        """Starts ``method`` on every process; returns the wait for its reply
        (:meth:`call`'s)."""
        if self.size == 1:
            ref = getattr(self.leader, method).remote(*args)
            return lambda: ray.get(ref)
        if self._joining:
            joining, self._joining = self._joining, []
            try:
                self.joined = self._gather(joining)
            except BaseException:
                self.kill()  # A group that did not form is of no use.
                raise
        # Large arguments (batches) go into the object store once, for every process.
        args = tuple(
            a if isinstance(a, int | float | str | bool | type(None)) else ray.put(a) for a in args
        )
        refs = [getattr(h, method).remote(*args) for h in self.handles]
        return lambda: self._gather(refs)[0]

    def restart(self) -> None:
        """Stops every process and starts a new group (several processes only; one
        trainer is restarted by Ray).

        Raises:
            RuntimeError: more than ``trainer_max_restarts`` group restarts.
        """
        if self.size == 1:
            return
        self.restarts += 1
        if self.restarts > self.ray_config.trainer_max_restarts:
            self.kill()
            raise RuntimeError(
                f"the trainer's {self.size} processes were restarted {self.restarts - 1} "
                "times (RayConfig.trainer_max_restarts); see their logs"
            )
        self.kill()
        self._start()

    def preempt(self) -> None:
        """A real preemption: one trainer is killed and Ray restarts it; a group is
        killed and :meth:`restart` starts it anew."""
        if self.size == 1:
            ray.kill(self.leader, no_restart=False)
        else:
            self.kill()

    def kill(self) -> None:
        """Kills every process at once and frees their placement group."""
        for handle in self.handles:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
        self._joining = []
        if self._placement is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self._placement)
            self._placement = None

    def stop(self, timeout_s: float = 60.0) -> None:
        """Asks every process to ``close`` (all at once: closing synchronises them),
        then kills them."""
        closing = []
        for handle in self.handles:
            with contextlib.suppress(Exception):
                closing.append(handle.close.remote())
        if closing:
            with contextlib.suppress(Exception):
                ray.wait(closing, num_returns=len(closing), timeout=timeout_s)
        self.kill()
