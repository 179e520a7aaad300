"""Settings of the Ray backend: where actors go, which weight store, how faults heal.

``RunConfig.ray`` holds a ``RayConfig``, so one YAML file runs on either backend
(``runtime.backend``: ``local`` or ``ray``); the local backend ignores this section.
``RayExperiment(config, ray_config=RayConfig(...))`` still takes one as an argument,
which then wins over ``config.ray``. Only placement, weight transfer and fault handling
are configured here; everything that shapes the RL run is in the rest of ``RunConfig``.

This module imports neither Ray nor JAX (``rlaxkit.config.run`` imports it).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from rlaxkit.rules.validation import check_int, check_number, is_int

WeightStoreKind = Literal["object_store", "tensorstore"]
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


@dataclass(frozen=True, kw_only=True)
class ActorResources:
    """What one actor asks Ray's scheduler for.

    Attributes:
        num_cpus: logical CPUs (fractions allowed; ``0`` places it anywhere).
        num_gpus: GPUs (fractions share one device).
        resources: custom resources, e.g. ``{"TPU": 4}`` for a TPU VM host's chips
            (Ray's TPU nodes advertise ``TPU`` and a ``TPU-<type>-head`` resource).
    """

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("num_cpus", "num_gpus"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: must be a number >= 0, got {value!r}")
        for key, value in self.resources.items():
            if not isinstance(value, int | float) or value < 0:
                raise ValueError(f"resources[{key!r}]: must be a number >= 0, got {value!r}")

    def options(self) -> dict[str, object]:
        """Keyword arguments for ``ActorClass.options``."""
        return {
            "num_cpus": self.num_cpus,
            "num_gpus": self.num_gpus,
            "resources": dict(self.resources),
        }


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    """Placement, weight transfer and fault handling of a ``RayExperiment``.

    Attributes:
        address: the cluster to join (``"auto"``: the one ``ray start`` runs on this
            host; ``"ray://host:10001"``: a remote one). ``None`` uses the Ray already
            initialised in this process, else starts a local one.
        weight_store: ``object_store`` (the trainer puts each version into Ray's shared
            memory once; workers on one host share it) or ``tensorstore`` (versioned
            snapshots in ``weight_store_dir``, for hosts without a shared object store,
            e.g. across a slow cluster network with a fast shared file system).
        weight_store_dir: the TensorStore directory; every host must see it. Default: the
            run directory's ``weights/`` (or a temporary directory without one).
        tensorstore_durable: fsync snapshots before publishing them (off: a killed writer
            never leaves a visible partial version anyway; surviving power loss is the
            checkpoint's job).
        trainer: resources of the trainer actor (of each, with several trainer processes).
        worker: resources of each inference worker actor.
        param_server: resources of the parameter-server actor (object store only).
        trainer_max_restarts: how often Ray restarts a dead trainer; it then restores
            its newest checkpoint and the driver replays the batches since. With several
            trainer processes the driver restarts the whole group instead (a
            ``jax.distributed`` group cannot take a lone new member); this bounds those
            restarts.
        trainer_processes: trainer actors forming one multi-process (SPMD) trainer, one
            per host usually (``rlaxkit.trainer.distributed``): each runs the same train step on
            the same batch, over a mesh of all their devices, with the weights sharded
            over it. 1 (the default) is one trainer process with no mesh.
        trainer_mesh: ``(data, fsdp, model)`` sizes of that mesh (several trainer
            processes only); one size may be ``-1`` for the devices left over, and the
            product must be the processes' device count.
        trainer_placement: the Ray placement-group strategy for the trainer processes:
            ``STRICT_SPREAD`` puts each on its own host (what a pod slice or GPU hosts
            want); ``SPREAD`` (the default) spreads where it can, so several also fit on
            one machine.
        trainer_coordinator_port: the port of the ``jax.distributed`` coordinator on
            trainer process 0's host; ``None`` picks a free one.
        param_server_max_restarts: how often Ray restarts a dead parameter server; the
            trainer then registers its newest version again.
        replace_dead_workers: start a new worker actor for each one that dies.
        worker_start_wait_s: how long a round waits for a new worker actor to start
            (Ray places it, its constructor runs) before it goes on without it; the
            worker then joins the first round after it is up. A replacement for a
            worker lost with its host waits so for a host with its resources to join.
        max_worker_replacements: give up (raise) after this many replacements, so a
            worker that dies on start does not loop forever.
        worker_schedule: an elastic fleet from the config: ``(step, workers)`` pairs,
            steps increasing; when the trainer finishes ``step`` the fleet is scaled to
            ``workers`` (as ``exp.scale_workers``). E.g. ``[[100, 8], [300, 4]]``;
            from the CLI ``--set 'ray.worker_schedule=[[100, 8]]'``.
        check_resources: before any actor starts, refuse a trainer, worker or
            parameter-server request that no node of the cluster can hold
            (``infeasible_requests``): Ray would keep that actor pending for ever, and
            the run would wait on it. Turn it off on a cluster that adds nodes on
            demand (an autoscaler), where such a request starts a node.
    """

    address: str | None = None
    weight_store: WeightStoreKind = "object_store"
    weight_store_dir: str | None = None
    tensorstore_durable: bool = False
    trainer: ActorResources = field(default_factory=ActorResources)
    worker: ActorResources = field(default_factory=ActorResources)
    param_server: ActorResources = field(default_factory=lambda: ActorResources(num_cpus=0))
    trainer_max_restarts: int = 3
    param_server_max_restarts: int = 3
    replace_dead_workers: bool = True
    worker_start_wait_s: float = 300.0
    max_worker_replacements: int = 16
    trainer_processes: int = 1
    trainer_mesh: tuple[int, int, int] = (1, -1, 1)
    trainer_placement: PlacementStrategy = "SPREAD"
    trainer_coordinator_port: int | None = None
    worker_schedule: tuple[tuple[int, int], ...] = ()
    check_resources: bool = True

    def __post_init__(self) -> None:
        schedule = self.worker_schedule
        pairs_ok = isinstance(schedule, tuple | list) and all(
            isinstance(p, tuple | list)
            and len(p) == 2
            and all(is_int(x) for x in p)
            and p[0] >= 1
            and p[1] >= 1
            for p in schedule
        )
        if not pairs_ok or any(a[0] >= b[0] for a, b in itertools.pairwise(schedule)):
            raise ValueError(
                "worker_schedule: must be [step, workers] pairs with step >= 1 and workers "
                f">= 1, steps increasing, e.g. [[100, 8], [300, 4]]; got {schedule!r}"
            )
        object.__setattr__(self, "worker_schedule", tuple(tuple(p) for p in schedule))
        if self.weight_store not in ("object_store", "tensorstore"):
            raise ValueError(
                f"weight_store: must be 'object_store' or 'tensorstore', got {self.weight_store!r}"
            )
        for name in ("trainer", "worker", "param_server"):
            if not isinstance(getattr(self, name), ActorResources):
                raise ValueError(f"{name}: must be an ActorResources, got {getattr(self, name)!r}")
        for name in (
            "trainer_max_restarts",
            "param_server_max_restarts",
            "max_worker_replacements",
        ):
            check_int(name, getattr(self, name), minimum=0, allowed="an int >= 0")
        check_number("worker_start_wait_s", self.worker_start_wait_s, minimum=0.0)
        processes = check_int(
            "trainer_processes",
            self.trainer_processes,
            minimum=1,
            allowed="an int >= 1 (1: one trainer process)",
        )
        mesh = tuple(self.trainer_mesh) if isinstance(self.trainer_mesh, tuple | list) else ()
        if (
            len(mesh) != 3
            or any(not is_int(s) or (s < 1 and s != -1) for s in mesh)
            or mesh.count(-1) > 1
        ):
            raise ValueError(
                "trainer_mesh: must be three sizes (data, fsdp, model), each an int >= 1, at "
                f"most one of them -1 (the devices left over), got {self.trainer_mesh!r}"
            )
        size = math.prod(mesh)
        if -1 not in mesh and size % processes:
            raise ValueError(
                f"trainer_mesh: {tuple(mesh)} has {size} devices, which {processes} trainer "
                "processes with equal devices each cannot cover: make its size a multiple of "
                "trainer_processes, or use -1 for one axis"
            )
        if self.trainer_placement not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(
                "trainer_placement: must be one of 'PACK', 'SPREAD', 'STRICT_PACK', "
                f"'STRICT_SPREAD', got {self.trainer_placement!r}"
            )
        port = self.trainer_coordinator_port
        if port is not None and (not is_int(port) or not 0 < port < 65536):
            raise ValueError(
                f"trainer_coordinator_port: must be a port in 1..65535 or None, got {port!r}"
            )


def infeasible_requests(config: RayConfig, nodes: list[dict[str, float]]) -> list[str]:
    """What no node among ``nodes`` (each node's total resources, as ``ray.nodes()``
    gives them: ``{"CPU": 8.0, "GPU": 1.0, "TPU": 4.0, ...}``) can hold: one line per
    actor kind, naming the field and what the nodes offer. Empty when every request
    fits some node, or when ``nodes`` is empty (nothing known to check against).

    >>> infeasible_requests(RayConfig(), [{"CPU": 8.0}])
    []
    >>> infeasible_requests(RayConfig(worker=ActorResources(resources={"TPU": 4})),
    ...                     [{"CPU": 8.0}])  # doctest: +ELLIPSIS
    ["ray.worker.resources: no node has 'TPU' (the nodes have ['CPU'])..."]
    """
    problems: list[str] = []
    if not nodes:
        return problems
    # The parameter server is an actor with the object store only; it asks for no GPU.
    kinds = ["trainer", "worker"]
    if config.weight_store == "object_store":
        kinds.append("param_server")
    for name in kinds:
        asked: ActorResources = getattr(config, name)
        gpus = 0.0 if name == "param_server" else asked.num_gpus
        request = {"CPU": asked.num_cpus, "GPU": gpus, **asked.resources}
        request = {key: amount for key, amount in request.items() if amount > 0}
        if not request or any(
            all(node.get(k, 0.0) >= v for k, v in request.items()) for node in nodes
        ):
            continue
        known = sorted({key for node in nodes for key in node})
        shown = [k for k in known if not k.startswith("node:") and "memory" not in k]
        missing = [key for key in request if key not in known]
        if missing:
            field_ = {"CPU": "num_cpus", "GPU": "num_gpus"}.get(missing[0], "resources")
            problems.append(
                f"ray.{name}.{field_}: no node has {missing[0]!r} (the nodes have "
                f"{shown}); Ray would keep the {name} actor pending for ever"
            )
            continue
        largest = {key: max(node.get(key, 0.0) for node in nodes) for key in request}
        problems.append(
            f"ray.{name}: one actor asks for {request}, more than any node holds (the "
            f"largest offer {largest}); Ray would keep it pending for ever"
        )
    return problems


def scheduled_workers(config: RayConfig, step: int) -> int | None:
    """The fleet size ``config.worker_schedule`` sets when the trainer finishes ``step``
    (``None``: no change at that step)."""
    return dict(config.worker_schedule).get(step)


def small_cluster_config(**changes: object) -> RayConfig:
    """A ``RayConfig`` whose actors fit a small local cluster (fractional CPUs)."""
    small = ActorResources(num_cpus=0.25)
    defaults: dict[str, Any] = {"trainer": small, "worker": small}
    return RayConfig(**{**defaults, **changes})
