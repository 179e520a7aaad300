"""The Ray placement: the trainer, the parameter server and each worker as Ray actors.

``start_ray`` starts (or joins, per ``RayConfig.address``) a Ray cluster and places the
parts with the resources ``config.ray`` asks for: a ``TrainerGroup`` (one
``TrainerHost`` actor, or ``trainer_processes`` of them training one sharded model), a
``ParameterServerActor`` over Ray's object store or a TensorStore directory, and a
``WorkerFleet`` of ``WorkerHost`` actors. The driver (``rlaxkit.runtime.driver``) keeps the books,
so the accounting survives any actor's death.

The hosts are those of the local placement (``rlaxkit.runtime.hosts``), in actors; the
fleet (``rlaxkit.runtime.fleet``) and the trainer client
(``rlaxkit.runtime.trainer_client``, which heals a trainer that dies on its own) are
too. A trainer preempted by a fault plan is killed for real, and the driver rolls the
run back to the checkpoint as on every placement (``rlaxkit.runtime.faults``).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import ray
from flax import nnx
from ray.exceptions import RayActorError

from rlaxkit.config.ray import RayConfig, infeasible_requests, scheduled_workers
from rlaxkit.config.run import RunConfig
from rlaxkit.param_server import layout
from rlaxkit.param_server.ray_store import RAY_SYSTEM_CONFIG, parameter_server_actor
from rlaxkit.rules.books import RunBooks
from rlaxkit.runtime.build import build_policy, build_task
from rlaxkit.runtime.common import RunTrace
from rlaxkit.runtime.fleet import WorkerFleet
from rlaxkit.runtime.hosts import WallClock, WeightStore, driver_jax_options, published_params
from rlaxkit.runtime.parts import Parts
from rlaxkit.runtime.ray_trainer_group import TrainerGroup, remote, stop_actor
from rlaxkit.runtime.state import checkpoint_dir, param_shapes
from rlaxkit.runtime.trainer_client import HealingTrainerClient
from rlaxkit.tasks import RewardRunner
from rlaxkit.tasks.base import Task
from rlaxkit.trainer.checkpoint import abstract_tree
from rlaxkit.worker.host import WorkerHost


class RayTransport:
    """Worker actors, called all at once; a dead one is found when its call fails.

    A new worker actor is waited for at its first ``sync`` for up to ``start_wait_s``
    from that ``sync`` (Ray places it and runs its constructor; the first fleet starts
    while the trainer warm-starts). One that is still not up then (a replacement for a
    worker lost with its node, waiting for a host with its resources to join) sits out
    the rounds: its ``sync`` is not sent, so it gets no work and the round goes on with
    the rest of the fleet; once it is up it syncs and takes work like any other. A round
    in which no worker is up waits up to ``start_wait_s`` more for the first to come up,
    so a fleet still starting is not taken for a stalled loop. Other calls wait for it
    (a checkpoint gathers every worker's state).
    """

    def __init__(self, start_wait_s: float) -> None:
        self.start_wait_s = start_wait_s
        # Per new worker actor, by handle id: the handle, its ``__ray_ready__`` and the
        # monotonic time until which a ``sync`` waits for it (set by the first ``sync``).
        self._starting: dict[int, tuple[Any, Any, float | None]] = {}
        # Per new worker actor, by handle id: seconds from its start to its constructor's
        # end, written by Ray's thread when the actor is up (``start_seconds``).
        self._start_s: dict[int, float] = {}

    def started(self, handle: Any) -> Any:
        """Notes a new worker actor; returns its handle."""
        begin = time.monotonic()
        ready = handle.__ray_ready__.remote()
        self._starting[id(handle)] = (handle, ready, None)
        key = id(handle)

        def note(future: Any) -> None:
            if future.exception() is None:
                self._start_s[key] = time.monotonic() - begin

        ready.future().add_done_callback(note)
        return handle

    def start_seconds(self, handle: object) -> float | None:
        """Seconds the actor behind ``handle`` took from its start to being up (process,
        imports, constructor), once, when it is known; else ``None``."""
        return self._start_s.pop(id(handle), None)

    def up(self, handle: object) -> bool:
        """Whether the actor behind ``handle`` is up (or has failed to start: its next
        call finds out); waits for a new one until its deadline."""
        starting = self._starting.get(id(handle))
        if starting is None:
            return True
        _, ready, deadline = starting
        if deadline is None:  # the first round that wants it: the warm start may be long
            deadline = time.monotonic() + self.start_wait_s
            self._starting[id(handle)] = (starting[0], ready, deadline)
        done, _ = ray.wait([ready], timeout=max(0.0, deadline - time.monotonic()))
        if done:
            del self._starting[id(handle)]
        return bool(done)

    def call(self, calls: list) -> tuple[dict[str, Any], list[Any]]:
        sent = [c for c in calls if c[1] != "sync" or self.up(c[0].handle)]
        if self._starting and not any(c[1] == "sync" for c in sent) and sent != calls:
            # Every worker of the round is still starting (the first round on a loaded
            # machine, say): wait up to ``start_wait_s`` more for the first of them, so
            # that the loop does not call a fleet that is coming up stalled.
            ray.wait([r for _, r, _ in self._starting.values()], timeout=self.start_wait_s)
            sent = [c for c in calls if c[1] != "sync" or self.up(c[0].handle)]
        calls = sent
        refs = [(slot, getattr(slot.handle, m).remote(*args)) for slot, m, args in calls]
        replies, dead = {}, []
        for slot, ref in refs:
            try:
                replies[slot.worker_id] = ray.get(ref)
            except RayActorError:
                dead.append(slot)
        return replies, dead

    step = call

    def kill(self, handle: Any) -> None:
        self._starting.pop(id(handle), None)
        self._start_s.pop(id(handle), None)
        with contextlib.suppress(Exception):
            ray.kill(handle)

    def stop(self, handle: object) -> None:
        self._starting.pop(id(handle), None)
        self._start_s.pop(id(handle), None)
        stop_actor(handle)


def clear_weight_store(directory: Path) -> None:
    """Removes a TensorStore store's versions: a resumed run publishes from its
    checkpoint, and versions of the steps after it must not shadow that."""
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        name = entry.name
        if name == layout.POINTER:
            entry.unlink()
        elif layout.parse_dirname(name) is not None or name.startswith(
            (layout.TMP_PREFIX, layout.SPARE_PREFIX)
        ):
            shutil.rmtree(entry, ignore_errors=True)


def start_ray(
    config: RunConfig,
    trace: RunTrace,
    clock: Callable[[], float],
    books: RunBooks,
    run_dir: Path | None,
    cache_dir: Path | None,
    ray_config: RayConfig | None,
    worker_ids: list[str] | None,
) -> Parts:
    """The Ray placement's parts, started (``worker_ids``: the saved fleet of a resumed
    run; default: ``runtime.num_workers`` new workers)."""
    if config.runtime.mode != "deterministic":
        raise ValueError(
            f"runtime.mode {config.runtime.mode!r} is not available on the ray backend; "
            "use runtime.mode=deterministic"
        )
    if config.episodes.release_after_s is not None:  # the actors' workers would refuse it
        raise ValueError(
            f"episodes.release_after_s={config.episodes.release_after_s}: releasing a slow "
            "tool's row needs runtime.mode=concurrent, which the ray backend does not run; "
            "unset release_after_s"
        )
    rc = ray_config or config.ray
    task = build_task(config)
    teardown: list[Callable[[], None]] = []  # what started so far, stopped on a failure
    if not ray.is_initialized():
        # A cluster this run starts frees evicted weight versions at once, so pushes
        # reuse warm shared memory (see rlaxkit.param_server.ray_store).
        system: dict[str, Any] = {} if rc.address else {"_system_config": RAY_SYSTEM_CONFIG}
        ray.init(address=rc.address, include_dashboard=False, **system)
        teardown.append(ray.shutdown)
    try:
        if rc.check_resources:
            nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
            if problems := infeasible_requests(rc, nodes):
                raise ValueError(
                    "; ".join(problems) + ". Lower the request, start nodes that hold it, "
                    "or set ray.check_resources=false on a cluster that adds nodes on demand"
                )
        return _place(
            task, teardown, config, rc, trace, clock, books, run_dir, cache_dir, worker_ids
        )
    except BaseException:
        while teardown:  # A failed start leaves no actors behind.
            teardown.pop()()
        raise


def _place(
    task: Task,
    teardown: list[Callable[[], None]],
    config: RunConfig,
    rc: RayConfig,
    trace: RunTrace,
    clock: Callable[[], float],
    books: RunBooks,
    run_dir: Path | None,
    cache_dir: Path | None,
    worker_ids: list[str] | None,
) -> Parts:
    # Graph and shapes only: the trainer actor builds (or loads) the weights.
    model, tokenizer = build_policy(config, task, abstract=True)
    graphdef, params = nnx.split(model)
    del model
    keep = config.runtime.keep_versions
    kill_store: Callable[[], None] = lambda: None  # noqa: E731 (a TensorStore is not killed)
    if rc.weight_store == "object_store":
        name = f"rlaxkit-parameter-server-{uuid.uuid4().hex[:12]}"
        actor = parameter_server_actor(
            keep,
            name=name,
            num_cpus=rc.param_server.num_cpus,
            resources=rc.param_server.resources,
            max_restarts=rc.param_server_max_restarts,
        )
        teardown.append(lambda: ray.kill(actor))
        kill_store = lambda: ray.kill(actor, no_restart=False)  # noqa: E731
        store = WeightStore("object_store", actor_name=name)
    else:
        if rc.weight_store_dir:
            directory = Path(rc.weight_store_dir)
        elif run_dir:
            directory = run_dir / "weights"
        else:
            directory = Path(tempfile.mkdtemp(prefix="rlaxkit-weights-"))
            teardown.append(lambda: shutil.rmtree(directory, ignore_errors=True))
        clear_weight_store(directory)  # a resumed run publishes from its checkpoint
        template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        store = WeightStore(
            "tensorstore",
            directory=str(directory.absolute()),
            keep=keep,
            template=template,
            durable=rc.tensorstore_durable,
        )
    client = store.connect()  # the driver reads the published version
    jax_options = driver_jax_options()
    # Every actor's clock is the run's (its trace's, resumed runs included).
    wall = WallClock(time.time() - clock() - trace.offset_s)
    checkpoints = str(checkpoint_dir(run_dir)) if run_dir else None
    arguments = (config, store, str(cache_dir) if cache_dir else None, checkpoints, wall)
    group = TrainerGroup(rc, (*arguments, jax_options))
    teardown.append(lambda: group.stop(timeout_s=60.0))
    trainer = HealingTrainerClient(
        group,
        trace,
        books,
        clock,
        rc.trainer_max_restarts,
        died=(RayActorError,),
        replay_limit_mb=config.runtime.trainer_replay_mb,
    )
    options = {**rc.worker.options(), "max_restarts": 0, "max_task_retries": 0}

    transport = RayTransport(rc.worker_start_wait_s)

    def start_actor(worker_id: str) -> Any:
        return transport.started(
            remote(WorkerHost)
            .options(**options)
            .remote(worker_id, config, graphdef, tokenizer, store, wall, jax_options)
        )

    fleet = WorkerFleet(
        start_actor,
        transport,
        trace,
        clock,
        rc.replace_dead_workers,
        rc.max_worker_replacements,
    )
    teardown.append(fleet.close)
    if worker_ids is None:
        fleet.scale(config.runtime.num_workers)  # they start as the trainer does
    else:
        for worker_id in worker_ids:
            fleet.add(worker_id)
        fleet.books["next_worker"] = len(worker_ids)
    warm_start = trainer.call("warm_start_info")
    scorer = RewardRunner.for_task(task).start()
    teardown.append(scorer.close)
    return Parts(
        task=task,
        tokenizer=tokenizer,
        graphdef=graphdef,
        warm_start=warm_start,
        fleet=fleet,
        trainer=trainer,
        store=client,
        scorer=scorer,
        shapes=param_shapes(params),
        template=abstract_tree(params),
        published_weights=lambda version: jax.device_get(
            published_params(client, config.trainer.lora, version)
        ),
        schedule=lambda step: scheduled_workers(rc, step),
        kill_store=kill_store,
        teardown=teardown,
    )
