"""The Ray placement: the trainer, the parameter server and each worker as Ray actors.

``start_ray`` starts (or joins, per ``RayConfig.address``) a Ray cluster and places the
parts with the resources ``config.ray`` asks for: a ``TrainerGroup`` (one
``TrainerActor``, or ``trainer_processes`` of them training one sharded model), a
``ParameterServerActor`` over Ray's object store or a TensorStore directory, and a
``RayFleet`` of worker actors. The driver (``rlaxkit.runtime.driver``) keeps the books,
so the accounting survives any actor's death.

``RayTrainer`` is the driver's trainer client. A trainer that dies on its own (Ray
restarts it, or the driver restarts a group) is healed without changing the run: it
restores its newest checkpoint at or below the driver's step and the driver replays
the batches trained since (kept until a checkpoint covers them), so the state is the
one lost and no trained group is undone; the first run of each replayed step becomes
lost compute. A trainer preempted by a fault plan is killed for real, and the driver
rolls the run back to the checkpoint as on every placement
(``rlaxkit.runtime.faults``).
"""

from __future__ import annotations

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

from rlaxkit.api import TrainResult
from rlaxkit.config import RunConfig
from rlaxkit.param_server import layout
from rlaxkit.param_server.ray_store import RAY_SYSTEM_CONFIG, parameter_server_actor
from rlaxkit.ray_config import RayConfig, scheduled_workers
from rlaxkit.runtime.books import RunBooks
from rlaxkit.runtime.build import build_policy, build_task
from rlaxkit.runtime.common import RunTrace
from rlaxkit.runtime.placement import Parts
from rlaxkit.runtime.ray_actors import (
    TrainerRestartedError,
    WeightStore,
    WorkerActor,
    driver_jax_options,
)
from rlaxkit.runtime.ray_fleet import RayFleet, remote
from rlaxkit.runtime.ray_trainer_group import TrainerGroup
from rlaxkit.runtime.state import checkpoint_dir, param_shapes
from rlaxkit.tasks import RewardRunner

_RECOVERY_WAIT_S = 120.0  # How long a restarting actor may take to answer again.


class RayTrainer:
    """The driver's client of the trainer actor(s) (``rlaxkit.api.TrainerClient``).

    Args:
        group: the trainer actor or process group.
        ray_config: ``trainer_max_restarts``.
        trace: the run trace (the trainer's events are written to it).
        books: the run's books (a replayed step is booked as lost compute).
        clock: the run's clock.
    """

    def __init__(
        self,
        group: TrainerGroup,
        ray_config: RayConfig,
        trace: RunTrace,
        books: RunBooks,
        clock: Callable[[], float],
    ):
        self.group, self.ray_config = group, ray_config
        self.trace, self.books, self.clock = trace, books, clock
        self.replay: list[tuple[int, Any]] = []  # (step, batch) since the last checkpoint
        self.saved: set[int] = set()
        self.killed = False

    def _call_restarting(self, method: str, *args: Any) -> Any:
        """Calls the trainer once, waiting while Ray restarts it (a group of trainer
        processes was restarted already)."""
        if self.group.size > 1:
            return self.group.call(method, *args)
        deadline = time.perf_counter() + _RECOVERY_WAIT_S
        while True:
            try:
                return self.group.call(method, *args)
            except RayActorError as error:
                if time.perf_counter() > deadline or "max_restarts" in str(error):
                    raise RuntimeError(
                        f"the trainer actor is gone ({type(error).__name__}); it may have "
                        "used up RayConfig.trainer_max_restarts: see its log"
                    ) from error
                time.sleep(0.2)

    def call(self, method: str, *args: Any) -> Any:
        """Calls the trainer; if it died or came back with a fresh state, heals it
        (:meth:`_recover`) and calls again."""
        for _ in range(self.ray_config.trainer_max_restarts + 1):
            try:
                return self.group.call(method, *args)
            except (RayActorError, TrainerRestartedError):
                self._recover()
        raise RuntimeError(
            f"the trainer failed {self.ray_config.trainer_max_restarts + 1} times in a row "
            f"at step {self.books.version}; see its log"
        )

    def _recover(self) -> None:
        """Restores the restarted trainer and replays the batches since its checkpoint,
        so its state is the one it lost; then it publishes again."""
        version = self.books.version
        self.trace.record(self.clock(), "preemption", "trainer", version)
        self.group.restart()  # A group starts anew; one trainer Ray restarts.
        restored = self._call_restarting("restore", version)
        replay = [(s, b) for s, b in self.replay if restored < s <= version]
        if [s for s, _ in replay] != list(range(restored + 1, version + 1)):
            raise RuntimeError(
                f"the trainer restored step {restored} but the driver holds the batches of "
                f"steps {[s for s, _ in self.replay]}, not all of {restored + 1}..{version}"
            )
        for step, batch in replay:
            result = self._call_restarting("train", batch, step, False)
            self.trace.extend(result.events)
            self.books.redo_step(step, result.duration_s)
        reply = self._call_restarting("publish", version, True)
        self.trace.extend(reply.events)
        self.trace.record(
            self.clock(), "restart", "trainer", version, lost_steps=version - restored
        )

    # -- the client ------------------------------------------------------------------
    def train(self, batch: Any, step: int, push: bool) -> TrainResult:
        self.replay.append((step, batch))  # until a checkpoint covers it
        result = self.call("train", batch, step, push)
        self.trace.extend(result.events)
        return result

    def publish(self, step: int, reset: bool = False) -> int | None:
        reply = self.call("publish", step, reset)
        self.trace.extend(reply.events)
        return reply.version

    def host_params(self, step: int) -> Any:
        return jax.device_put(self.call("host_params", step))

    def kill(self) -> None:
        """A real preemption: the trainer's processes die (Ray restarts one trainer;
        :meth:`restore` starts a group anew)."""
        self.killed = True
        if self.group.size > 1:
            self.group.kill()
        else:
            ray.kill(self.group.leader, no_restart=False)

    def saved_steps(self) -> set[int]:
        return self.saved

    def save(
        self, step: int, json: dict[str, Any], weights: dict[str, Any] | None, wait: bool = True
    ) -> bool:
        reply = self.call("save_checkpoint", step, json, weights)
        self.trace.extend(reply.events)
        self.replay = [(s, b) for s, b in self.replay if s > step]
        self.saved.add(step)
        return reply.saved

    def restore(self, max_step: int, published: tuple[int, Any] | None = None) -> int:
        if self.killed:
            self.killed = False
            self.group.restart()  # a group starts anew; one trainer Ray restarts
        step = self._call_restarting("restore", max_step, published)
        self.replay = [(s, b) for s, b in self.replay if s <= step]
        self.saved.add(step)
        return step

    def close(self) -> None:
        self.group.stop(timeout_s=60.0)


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
    rc = ray_config or config.ray
    parts = Parts(
        task=build_task(config),
        tokenizer=None,
        graphdef=None,
        warm_start={},
        fleet=None,
        trainer=None,
        store=None,
        scorer=None,
        shapes={},
        template=None,
    )
    if not ray.is_initialized():
        # A cluster this run starts frees evicted weight versions at once, so pushes
        # reuse warm shared memory (see rlaxkit.param_server.ray_store).
        system = {} if rc.address else {"_system_config": RAY_SYSTEM_CONFIG}
        ray.init(address=rc.address, include_dashboard=False, **system)
        parts.teardown.append(ray.shutdown)
    try:
        _place(parts, config, rc, trace, clock, books, run_dir, cache_dir, worker_ids)
    except BaseException:
        parts.close()  # A failed start leaves no actors behind.
        raise
    return parts


def _place(parts, config, rc, trace, clock, books, run_dir, cache_dir, worker_ids) -> None:
    model, parts.tokenizer = build_policy(config, parts.task)
    parts.graphdef, params = nnx.split(model)
    del model
    parts.shapes = param_shapes(params)
    parts.template = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
    )
    keep = config.runtime.keep_versions
    if rc.weight_store == "object_store":
        name = f"rlaxkit-parameter-server-{uuid.uuid4().hex[:12]}"
        actor = parameter_server_actor(
            keep,
            name=name,
            num_cpus=rc.param_server.num_cpus,
            resources=rc.param_server.resources,
            max_restarts=rc.param_server_max_restarts,
        )
        parts.teardown.append(lambda: ray.kill(actor))
        parts.kill_store = lambda: ray.kill(actor, no_restart=False)
        store = WeightStore("object_store", actor_name=name)
    else:
        if rc.weight_store_dir:
            directory = Path(rc.weight_store_dir)
        elif run_dir:
            directory = run_dir / "weights"
        else:
            directory = Path(tempfile.mkdtemp(prefix="rlaxkit-weights-"))
            parts.teardown.append(lambda: shutil.rmtree(directory, ignore_errors=True))
        clear_weight_store(directory)  # a resumed run publishes from its checkpoint
        template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        store = WeightStore(
            "tensorstore",
            directory=str(directory.absolute()),
            keep=keep,
            template=template,
            durable=rc.tensorstore_durable,
        )
    parts.store = store.connect()  # the driver reads the published version
    jax_options = driver_jax_options()
    t0_wall = time.time() - clock() - trace.offset_s  # every actor's clock is the run's
    checkpoints = str(checkpoint_dir(run_dir)) if run_dir else None
    arguments = (config, store, str(cache_dir) if cache_dir else None, checkpoints, t0_wall)
    group = TrainerGroup(rc, (*arguments, jax_options))
    parts.teardown.append(lambda: group.stop(timeout_s=60.0))
    parts.trainer = RayTrainer(group, rc, trace, books, clock)
    options = {**rc.worker.options(), "max_restarts": 0, "max_task_retries": 0}

    def start_actor(worker_id: str) -> Any:
        return (
            remote(WorkerActor)
            .options(**options)
            .remote(
                worker_id,
                config,
                parts.graphdef,
                parts.tokenizer,
                store,
                t0_wall,
                jax_options,
            )
        )

    fleet = RayFleet(start_actor, trace, clock, rc.replace_dead_workers, rc.max_worker_replacements)
    parts.teardown.append(fleet.close)
    parts.fleet = fleet
    if worker_ids is None:
        fleet.scale(config.runtime.num_workers)  # they start as the trainer does
    else:
        for worker_id in worker_ids:
            fleet.add(worker_id)
        fleet.books["next_worker"] = len(worker_ids)
    parts.warm_start = parts.trainer.call("warm_start_info")
    parts.scorer = RewardRunner.for_task(parts.task).start()
    parts.teardown.append(parts.scorer.close)
    parts.schedule = lambda step: scheduled_workers(rc, step)

    def published_weights(version: int) -> Any:
        pulled, params = parts.store.pull()
        if pulled != version:
            raise RuntimeError(
                f"the parameter server holds version {pulled}, the driver published "
                f"{version}: cannot checkpoint the published weights"
            )
        return jax.device_get(params)

    parts.published_weights = published_weights
