"""The Ray backend's actors: the trainer and the inference workers.

Each actor is a plain class (so it can be read and tested without Ray) that the driver
starts with ``ray.remote(cls).options(...)``. They wrap the very objects the local
backend runs: an inference worker actor holds one ``rlaxkit.worker.InferenceWorker``;
the trainer actor holds the ``TrainState`` and the jitted ``make_train_step``. Both
record trace events in memory and hand them to the driver with each reply, so the
driver writes one trace with the local backend's schema.

Clocks: every actor measures seconds since the driver's ``t0_wall`` (``time.time()``
at run start), so events from different processes share one time axis (across hosts up
to their clock skew).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Literal

import jax
import ray
from flax import nnx

from rlaxkit.api import ChunkReply, PublishReply, SaveReply, SyncReply, TrainResult, Work
from rlaxkit.batch import TrainBatch
from rlaxkit.checkpoint import CheckpointManager, restore_train_state, save_train_state
from rlaxkit.config import RunConfig
from rlaxkit.param_server import ParameterServer, TensorStoreParameterServer
from rlaxkit.param_server.ray_store import RayObjectStoreParameterServer, WeightsLostError
from rlaxkit.runtime.build import build_policy, build_task, train_config_for, warm_start
from rlaxkit.tasks import RewardRunner
from rlaxkit.trace import MemoryTrace, TraceEvent
from rlaxkit.trainer import create_train_state, make_train_step
from rlaxkit.worker import InferenceWorker

# jax.config options copied from the driver into every actor (same platform, same
# persistent compilation cache: a restarted actor does not compile again).
JAX_OPTIONS = (
    "jax_platforms",
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
)


def driver_jax_options() -> dict[str, Any]:
    """The driver's values of :data:`JAX_OPTIONS` that are set."""
    out = {}
    for name in JAX_OPTIONS:
        value = getattr(jax.config, name, None)
        if value not in (None, ""):
            out[name] = value
    return out


def _configure_jax(options: dict[str, Any]) -> None:
    for name, value in options.items():
        jax.config.update(name, value)


class TrainerRestartedError(RuntimeError):
    """The trainer's state is not at the step the driver expects: Ray restarted the
    actor (fresh state) and the driver has not restored it yet."""


@dataclasses.dataclass(frozen=True)
class WeightStore:
    """How every actor reaches the parameter server (picklable, sent to each actor).

    The parameter-server actor is found by name rather than by a handle in the
    arguments: Ray keeps actor-handle arguments in the object store, tying a restarted
    actor's arguments to references the driver holds.

    Attributes:
        kind: ``object_store`` (via ``actor_name``) or ``tensorstore`` (via
            ``directory``).
        actor_name: the ``ParameterServerActor``'s name (in the job's namespace).
        directory: the TensorStore snapshot directory, seen by every host.
        keep: versions retained (TensorStore; the actor was started with its own).
        template: abstract params (``ShapeDtypeStruct`` leaves) giving TensorStore
            pulls the ``nnx.State`` structure.
        durable: fsync TensorStore snapshots before publishing.
    """

    kind: Literal["object_store", "tensorstore"]
    actor_name: str | None = None
    directory: str | None = None
    keep: int = 2
    template: Any = None
    durable: bool = True

    def connect(self, on_event=None, pull_timeout_s: float | None = None) -> ParameterServer:
        """A client of this store for the calling process; ``pull_timeout_s`` bounds a
        pull that gives no timeout of its own (object store only)."""
        if self.kind == "object_store":
            actor = ray.get_actor(self.actor_name)
            return RayObjectStoreParameterServer(
                actor, on_event=on_event, default_timeout_s=pull_timeout_s
            )
        return TensorStoreParameterServer(
            self.directory,
            keep=self.keep,
            template=self.template,
            durable=self.durable,
            on_event=on_event,
        )


class TrainerActor:
    """The trainer: owns the train state, steps on batches, pushes, checkpoints.

    The driver decides when to checkpoint (``CheckpointPolicy``) and calls
    :meth:`save_checkpoint` with its own books, which go into the same Orbax step
    directory as the train state (``rlaxkit.runtime.state``). After Ray restarts
    the actor, the driver calls :meth:`restore` with the newest step it knows was
    taken, replays the batches since with ``push=False`` and calls :meth:`publish`
    with ``reset=True``; the trainer's state then equals the state it had before it
    died (same batches, same jitted step). A resumed run calls :meth:`restore` with
    the checkpoint's published version, then :meth:`publish`.

    Args:
        config: the run configuration.
        store: the parameter server.
        cache_dir: where the warm start is cached (shared with the driver's host).
        checkpoint_dir: where train-state checkpoints go (``None``: none; a restart then
            replays from step 0).
        t0_wall: the driver's ``time.time()`` at run start.
        jax_options: ``jax.config`` values to apply first.
    """

    # A one-process trainer: no mesh, arrays on this process's default device, and
    # this process pushes. ``TrainerProcessActor`` (``ray_trainer_group``) overrides
    # these for one process of a multi-process trainer.
    mesh: Any = None
    pushes: bool = True  # This process talks to the parameter server.

    def __init__(
        self,
        config: RunConfig,
        store: WeightStore,
        cache_dir: str | None,
        checkpoint_dir: str | None,
        t0_wall: float,
        jax_options: dict[str, Any],
    ):
        _configure_jax(jax_options)
        self._setup(config, store, cache_dir, checkpoint_dir, t0_wall)

    def _setup(
        self,
        config: RunConfig,
        store: WeightStore,
        cache_dir: str | None,
        checkpoint_dir: str | None,
        t0_wall: float,
    ) -> None:
        self.config, self.t0_wall = config, t0_wall
        self.trace = MemoryTrace()
        task = build_task(config)
        model, tokenizer = build_policy(config, task)
        model, self.warm_start = self._warm_start(
            config, task, model, tokenizer, Path(cache_dir) if cache_dir else None
        )
        graphdef, params = nnx.split(model)
        train_config = train_config_for(config)
        ref = params if train_config.algorithm.needs_reference else None
        state = create_train_state(train_config, params, seed=config.seed, ref_params=ref)
        self.state = self._place_state(state)
        self._train_step = make_train_step(train_config, graphdef, mesh=self.mesh)
        self.store_kind = store.kind
        self.param_server = store.connect(on_event=self._on_transfer) if self.pushes else None
        self.checkpoints = None
        if checkpoint_dir is not None:
            self.checkpoints = CheckpointManager(
                checkpoint_dir, max_to_keep=config.checkpoint.keep, async_save=False
            )
        # (version, host params) to publish when the store lacks the newest version.
        self._to_publish: tuple[int, Any] | None = (0, self._publishable(self.state.params))

    # -- where arrays live (overridden by a multi-process trainer) -------------------
    def _warm_start(self, config, task, model, tokenizer, cache_dir):
        return warm_start(config, task, model, tokenizer, cache_dir)

    def _place_state(self, state: Any) -> Any:
        return state

    def _place_batch(self, batch: TrainBatch) -> TrainBatch:
        return batch

    def _host(self, tree: Any) -> Any:
        """Full host copies of ``tree`` (a collective with several processes)."""
        return jax.device_get(tree)

    def _for_push(self, params: Any) -> Any:
        """What ``push`` is given: device arrays here (the store copies them)."""
        return params

    def _publishable(self, params: Any) -> Any:
        """The host copy :meth:`publish` may push later."""
        return self._host(params)

    def clock(self) -> float:
        return time.time() - self.t0_wall

    def _on_transfer(self, kind: str, version: int, **fields: Any) -> None:
        if kind == "push":
            self.trace.record(self.clock(), "push", "trainer", version, **fields)

    def _drain(self) -> list[TraceEvent]:
        events, self.trace.events = self.trace.events, []
        return events

    @property
    def version(self) -> int:
        return int(self.state.step)

    def _expect(self, step: int) -> None:
        if self.version != step:
            raise TrainerRestartedError(
                f"the trainer is at step {self.version}, the driver at step {step}: restore it"
            )

    # -- checkpoints -----------------------------------------------------------------
    def _save(self, json: dict[str, Any] | None, weights: dict[str, Any] | None) -> int:
        start = self.clock()
        # Numpy leaves (the weights) are written by process 0 alone; every process
        # writes its shards of the train state. One Orbax step: all items or none.
        pytrees = {"weights": weights} if weights else None
        save_train_state(self.checkpoints, self.state, json=json, pytrees=pytrees, force=True)
        self.trace.record(
            self.clock(),
            "checkpoint_save",
            "trainer",
            self.version,
            step=self.version,
            duration_s=self.clock() - start,
        )
        return self.version

    def restore(self, max_step: int, published: tuple[int, Any] | None = None) -> int:
        """Loads the newest checkpoint at or below ``max_step`` (the fresh step-0 state
        when there is none); returns its step.

        Args:
            max_step: the newest step the driver knows was taken.
            published: ``(version, host params)`` that :meth:`publish` pushes next, when
                that is not the restored step's own (a resumed run whose newest
                published version is older than its checkpoint: pushes every ``k``
                steps); ``None``: the restored state's params.
        """
        steps = [
            s for s in (self.checkpoints.all_steps() if self.checkpoints else ()) if s <= max_step
        ]
        if steps:
            start = self.clock()
            self.state = restore_train_state(self.checkpoints, self.state, step=max(steps))
            self.trace.record(
                self.clock(),
                "checkpoint_restore",
                "trainer",
                self.version,
                step=self.version,
                duration_s=self.clock() - start,
            )
        if published is not None and published[0] != self.version:
            self._to_publish = published if self.pushes else None
        else:
            self._to_publish = (self.version, self._publishable(self.state.params))
        return self.version

    # -- training --------------------------------------------------------------------
    def train(self, batch: TrainBatch, step: int, push: bool = True) -> TrainResult:
        """One train step; pushes per the weight-sync policy (the driver checkpoints).

        Args:
            batch: the collated batch.
            step: the step this is (the state must be at ``step - 1``).
            push: ``False`` while replaying after a restart (the store already has, or
                will be given by :meth:`publish`, the versions these steps made).

        Raises:
            TrainerRestartedError: the state is not at ``step - 1``.
        """
        self._expect(step - 1)
        start = time.perf_counter()
        self.state, metrics = self._train_step(self.state, self._place_batch(batch))
        metrics = {k: float(v) for k, v in self._host(metrics).items()}
        duration_s = time.perf_counter() - start
        if self.config.weight_sync.should_push(self.version):
            if push:
                params = self._for_push(self.state.params)
                if self.pushes:
                    self.param_server.push(self.version, params)
                self._to_publish = None
            else:
                self._to_publish = (self.version, self._publishable(self.state.params))
        return TrainResult(metrics, duration_s, self._drain())

    def publish(self, step: int, reset: bool = False) -> PublishReply:
        """Makes sure the store holds this trainer's newest published version.

        After the parameter server restarted empty, registers the retained object again
        (no new copy). After this trainer restarted or restored (``reset``), pushes the
        newest version it should have published, forgetting references that died with
        it. Replies with what the store now holds.

        Raises:
            TrainerRestartedError: the state is not at ``step``.
        """
        self._expect(step)
        store = self.param_server
        latest = store.latest_version()
        if self._to_publish is not None and (
            reset or latest is None or latest < self._to_publish[0]
        ):
            version, params = self._to_publish
            if self.store_kind == "object_store":
                store.push(version, params, reset=reset)
            elif latest is None or latest < version:
                store.push(version, params)
            self._to_publish = None
        elif self.store_kind == "object_store" and (latest is None or reset):
            store.republish()
        return PublishReply(store.latest_version(), self._drain())

    def warm_start_info(self) -> dict[str, Any]:
        """What the warm start did: ``cached``, ``steps`` (and ``final_loss`` or
        ``path``), as ``rlaxkit.runtime.build.warm_start`` reports it."""
        return self.warm_start

    def save_checkpoint(
        self,
        step: int,
        json: dict[str, Any] | None = None,
        weights: dict[str, Any] | None = None,
    ) -> SaveReply:
        """Saves the state as checkpoint ``step`` with the driver's items, unless that
        checkpoint exists.

        Args:
            step: the step the state must be at.
            json: JSON items (name -> value) saved with the train state.
            weights: the ``weights`` item (``{"v<N>": host params}``), or ``None``.

        Raises:
            TrainerRestartedError: the state is not at ``step``.
        """
        self._expect(step)
        saved = self.checkpoints is not None and step not in self.checkpoints.all_steps()
        if saved:
            self._save(json, weights)
        return SaveReply(saved, self._drain())

    def host_params(self, step: int) -> Any:
        """The params at ``step`` copied to host memory (for evaluation in the driver)."""
        self._expect(step)
        return self._host(self.state.params)

    def close(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.close()


# A worker's pull waits this long for a version on an empty store (the parameter server
# restarting) before it fails, is counted, and the driver repairs the store.
_WORKER_PULL_TIMEOUT_S = 1.0


class _Observed:
    """A parameter-server client that remembers the latest version it last reported."""

    def __init__(self, server: ParameterServer):
        self.server = server
        self.seen: int | None = -1

    def latest_version(self) -> int | None:
        self.seen = self.server.latest_version()
        return self.seen

    def pull(self, min_version: int | None = None, timeout: float | None = None):
        return self.server.pull(min_version, timeout)

    def push(self, version: int, params: Any) -> None:
        self.server.push(version, params)


class WorkerActor:
    """One inference worker: an ``InferenceWorker`` in its own process.

    The driver calls :meth:`sync` (pull if the staleness policy says so; report free
    room) and then :meth:`submit_and_step` (start the prompts it was given, decode one
    chunk, return finished rollouts), every worker once per round, as the local loop
    does.

    Args:
        worker_id: the worker's name in the trace.
        config: the run configuration.
        graphdef: the policy's graph (weights come from the parameter server).
        tokenizer: the run's tokenizer.
        store: the parameter server.
        t0_wall: the driver's ``time.time()`` at run start.
        jax_options: ``jax.config`` values to apply first.
    """

    def __init__(
        self,
        worker_id: str,
        config: RunConfig,
        graphdef: Any,
        tokenizer: Any,
        store: WeightStore,
        t0_wall: float,
        jax_options: dict[str, Any],
    ):
        _configure_jax(jax_options)
        self.t0_wall = t0_wall
        self.trace = MemoryTrace()
        task = build_task(config)
        self.scorer = RewardRunner.for_task(task).start()
        self.lost_weights = 0
        self.store = _Observed(store.connect(pull_timeout_s=_WORKER_PULL_TIMEOUT_S))
        self.worker = InferenceWorker(
            worker_id,
            graphdef,
            config.sampling,
            task=task,
            tokenizer=tokenizer,
            scorer=self.scorer,
            param_server=self.store,
            staleness=config.staleness,
            weight_sync=config.weight_sync,
            trace=self.trace,
            clock=self.clock,
            num_slots=config.runtime.slots_per_worker,
            chunk_steps=config.runtime.chunk_steps,
            max_prompt_tokens=config.runtime.max_prompt_tokens,
        )

    def clock(self) -> float:
        return time.time() - self.t0_wall

    def _drain(self) -> list[TraceEvent]:
        events, self.trace.events = self.trace.events, []
        return events

    def sync(self) -> SyncReply:
        """Pulls if this worker lags too far; ``retry`` when the sync may not have done
        what the deterministic loop would (weights lost, a failed pull, or an empty store,
        as while the parameter server restarts): nothing changed, and the driver repairs
        the store and asks again."""
        lost = False
        failed_before = self.worker.failed_pulls
        self.store.seen = -1
        try:
            self.worker.sync_weights()
        except WeightsLostError as error:
            self.lost_weights += 1
            lost = True
            self.trace.record(
                self.clock(),
                "fault",
                self.worker.worker_id,
                self.worker.version,
                fault="weights_lost",
                error=str(error)[:200],
            )
        failed = self.worker.failed_pulls > failed_before
        return SyncReply(
            self.worker.free,
            self.worker.version,
            self.worker.failed_pulls,
            retry=lost or failed or self.store.seen is None,
            weights_lost=lost,
            events=self._drain(),
        )

    def submit_and_step(self, work: list[Work], decode: bool = True) -> ChunkReply:
        """Starts ``work`` and (unless ``decode`` is False: a slowed worker's round)
        decodes one chunk; replies with the finished, scored rollouts."""
        for issue, problem in work:
            self.worker.submit(issue, problem)
        rollouts = self.worker.step() if decode else []
        return ChunkReply(
            rollouts,
            bool(self.worker.requests),
            self.worker.generated_tokens,
            self._drain(),
            dict(self.scorer.counters),
        )

    # -- checkpoints (rlaxkit.runtime.state) --------------------------------------------
    def checkpoint(self) -> dict[str, Any]:
        """``snapshot`` (``InferenceWorker.snapshot``: the replay log of the prompts in
        flight) and ``versions``: the weight versions that log starts from or pulled."""
        return {
            "snapshot": self.worker.snapshot(),
            "versions": sorted(self.worker.replay_weights()),
        }

    def replay_weights(self, versions: list[int]) -> dict[int, Any]:
        """Host copies of the weights of ``versions`` (each one the replay log needs)."""
        held = self.worker.replay_weights()
        return {version: jax.device_get(held[version]) for version in versions}

    def restore(
        self,
        snapshot: dict[str, Any],
        issues: dict[int, Work],
        weights: dict[int, Any],
    ) -> list[TraceEvent]:
        """Rebuilds a saved worker by replaying its log (``InferenceWorker.restore``):
        its prompts in flight are generated again, same ids and seeds, up to the chunk
        where the checkpoint found them.

        Args:
            snapshot: the worker's ``snapshot`` from the checkpoint.
            issues: ``group id -> (issue, problem)`` of every prompt the log submits.
            weights: ``version -> host params`` of every version the log needs.

        Returns the trace events of the replay.
        """
        placed = {version: jax.device_put(params) for version, params in weights.items()}
        self.worker.restore(
            snapshot,
            issue_for=lambda group_id: issues[group_id][0],
            problem_for=lambda issue: issues[issue.group_id][1],
            weights_for=placed.__getitem__,
        )
        return self._drain()

    def stats(self) -> dict[str, Any]:
        """Counters for tests and dashboards."""
        return {"version": self.worker.version, "lost_weights": self.lost_weights}

    def close(self) -> None:
        self.scorer.close()
