"""The trainer and the inference workers as hosts: plain classes that every placement
runs, in this process (``runtime.backend=local``) or as Ray actors (``ray``).

``TrainerHost`` holds the ``TrainState`` and the jitted ``make_train_step``, pushes to
the parameter server and checkpoints; ``WorkerHost`` holds one
``rlaxkit.worker.worker.InferenceWorker`` and its reward runner. Both record trace events in
memory and hand them to the driver with each reply (typed messages of
``rlaxkit.api``), so one trace with one schema comes out of every placement. Running in
this process changes only where arrays live: the local trainer's step keeps its
parameters (``make_train_step(keep_params=True)``) so the in-process store holds the
pushed version without a copy, and its checkpoints are written in the background.

Clocks: a host measures seconds on the run's clock: in this process the driver's own;
in an actor, seconds since the driver's ``t0_wall`` (``time.time()`` at run start), so
events from different processes share one time axis (across hosts up to their skew).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from functools import partial
from typing import Any, Literal

import jax

from rlaxkit.param_server import ParameterServer, ParamServerConfig, TensorStoreParameterServer
from rlaxkit.param_server.base import EventHook
from rlaxkit.param_server.delta_store import ReadableStore
from rlaxkit.rules.trace import MemoryTrace, TraceEvent
from rlaxkit.runtime.faulty_store import UnreliableParameterServer

# jax.config options copied from the driver into every actor (same platform, same
# persistent compilation cache: a restarted actor does not compile again).
JAX_OPTIONS = (
    "jax_platforms",
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
)


def driver_jax_options() -> dict[str, object]:
    """The driver's values of :data:`JAX_OPTIONS` that are set."""
    out = {}
    for name in JAX_OPTIONS:
        value = getattr(jax.config, name, None)
        if value not in (None, ""):
            out[name] = value
    return out


def configure_jax(options: Mapping[str, object]) -> None:
    for name, value in options.items():
        jax.config.update(name, value)


def drain(trace: object) -> list[TraceEvent]:
    """The events a host recorded in memory since the last reply (none when it records
    into the run's trace directly, in this process)."""
    if not isinstance(trace, MemoryTrace):
        return []
    events, trace.events = trace.events, []
    return events


class TrainerRestartedError(RuntimeError):
    """The trainer's state is not at the step the driver expects: Ray restarted the
    actor (fresh state) and the driver has not restored it yet."""


@dataclasses.dataclass(frozen=True)
class WallClock:
    """Seconds since ``t0_wall`` (``time.time()``): an actor's view of the run's clock."""

    t0_wall: float

    def __call__(self) -> float:
        return time.time() - self.t0_wall


@dataclasses.dataclass(frozen=True)
class WeightStore:
    """How every host reaches the parameter server (picklable to each actor, except the
    ``inprocess`` kind, which holds the store itself).

    The parameter-server actor is found by name rather than by a handle in the
    arguments: Ray keeps actor-handle arguments in the object store, tying a restarted
    actor's arguments to references the driver holds.

    Attributes:
        kind: ``object_store`` (via ``actor_name``), ``tensorstore`` (via
            ``directory``) or ``inprocess`` (``server``, in this process).
        actor_name: the ``ParameterServerActor``'s name (in the job's namespace).
        directory: the TensorStore snapshot directory, seen by every host.
        keep: versions retained (TensorStore; the actor was started with its own).
        template: abstract params (``ShapeDtypeStruct`` leaves) giving TensorStore
            pulls the ``nnx.State`` structure.
        durable: fsync TensorStore snapshots before publishing.
        server: the in-process store.
    """

    kind: Literal["object_store", "tensorstore", "inprocess"]
    actor_name: str | None = None
    directory: str | None = None
    keep: int = 2
    template: object = None
    durable: bool = True
    server: Any = None

    @property
    def in_process(self) -> bool:
        return self.kind == "inprocess"

    def connect(
        self,
        on_event: EventHook | None = None,
        pull_timeout_s: float | None = None,
        publication: ParamServerConfig | None = None,
        worker_id: str | None = None,
    ) -> ParameterServer:
        """A client of this store for the calling process; ``pull_timeout_s`` bounds a
        pull that gives no timeout of its own (object store only); ``publication`` (the
        run's ``param_server`` section) with ``delta`` reads and publishes through a
        ``DeltaParameterServer`` (the in-process ``server`` is given wrapped already).
        ``worker_id``: the client of that worker, which a fault plan's in-process store
        (``UnreliableParameterServer``) fails pulls of on their own."""
        if self.kind == "inprocess":
            if worker_id is not None and isinstance(self.server, UnreliableParameterServer):
                return self.server.view(worker_id)
            return self.server
        publication = publication or ParamServerConfig()
        hook = on_event
        if publication.delta and on_event is not None:  # the wrapper reports transfers
            hook = partial(_restarts_only, on_event)
        server: ReadableStore
        if self.kind == "object_store":
            import ray

            from rlaxkit.param_server.ray_store import RayObjectStoreParameterServer

            actor = ray.get_actor(str(self.actor_name))
            server = RayObjectStoreParameterServer(
                actor, on_event=hook, default_timeout_s=pull_timeout_s
            )
        else:
            server = TensorStoreParameterServer(
                str(self.directory),
                keep=self.keep,
                template=self.template,
                durable=self.durable,
                on_event=hook,
            )
        timeout_s = pull_timeout_s if self.kind == "object_store" else None  # as unwrapped
        return publication.wrap(
            server, template=self.template, default_timeout_s=timeout_s, on_event=on_event
        )


def _restarts_only(on_event: EventHook, kind: str, version: int | None, **fields: object) -> None:
    if kind == "restart":
        on_event(kind, version, **fields)


def read_published(store: ParameterServer, lora: object) -> tuple[int, Any]:
    """``(version, full weights)`` of the newest version in ``store``. A LoRA run's
    store holds a base record and adapter records (``trainer.lora``, ``lora`` here), so
    it is read through ``AdapterParameterServer``, which merges them as a worker does."""
    if lora is not None:
        from rlaxkit.param_server.adapters import AdapterParameterServer

        store = AdapterParameterServer(store)
    return store.pull()


def published_params(store: ParameterServer, lora: object, version: int) -> object:
    """The full weights of ``version``, which must be the newest in ``store`` (a
    checkpoint keeps the published version's weights)."""
    pulled, params = read_published(store, lora)
    if pulled != version:
        raise RuntimeError(
            f"the parameter server holds version {pulled}, the driver published "
            f"{version}: cannot checkpoint the published weights"
        )
    return params
