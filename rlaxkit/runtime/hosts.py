"""The trainer and the inference workers as hosts: plain classes that every placement
runs, in this process (``runtime.backend=local``) or as Ray actors (``ray``).

``TrainerHost`` holds the ``TrainState`` and the jitted ``make_train_step``, pushes to
the parameter server and checkpoints; ``WorkerHost`` holds one
``rlaxkit.worker.InferenceWorker`` and its reward runner. Both record trace events in
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
from pathlib import Path
from typing import Any, Literal

import jax
from flax import nnx

from rlaxkit.api import ChunkReply, PublishReply, SaveReply, SyncReply, TrainResult, Work
from rlaxkit.batch import TrainBatch
from rlaxkit.checkpoint import CheckpointManager, restore_train_state, save_train_state
from rlaxkit.config import RunConfig
from rlaxkit.param_server import ParameterServer, TensorStoreParameterServer
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


def drain(trace: Any) -> list[TraceEvent]:
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
    template: Any = None
    durable: bool = True
    server: Any = None

    @property
    def in_process(self) -> bool:
        return self.kind == "inprocess"

    def connect(self, on_event=None, pull_timeout_s: float | None = None) -> ParameterServer:
        """A client of this store for the calling process; ``pull_timeout_s`` bounds a
        pull that gives no timeout of its own (object store only)."""
        if self.kind == "inprocess":
            return self.server
        if self.kind == "object_store":
            import ray

            from rlaxkit.param_server.ray_store import RayObjectStoreParameterServer

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


class TrainerHost:
    """The trainer: owns the train state, steps on batches, pushes, checkpoints.

    The driver decides when to checkpoint (``CheckpointPolicy``) and calls
    :meth:`save_checkpoint` with its own books, which go into the same Orbax step
    directory as the train state (``rlaxkit.runtime.state``). After Ray restarts
    the actor, the driver calls :meth:`restore` with the newest step it knows was
    taken, replays the batches since with ``push=False`` and calls :meth:`publish`
    with ``reset=True``; the trainer's state then equals the state it had before it
    died (same batches, same jitted step). A resumed or rolled-back run calls
    :meth:`restore` (with the checkpoint's published version), then :meth:`publish`.

    Args:
        config: the run configuration.
        store: the parameter server.
        cache_dir: where the warm start is cached (shared with the driver's host).
        checkpoint_dir: where train-state checkpoints go (``None``: none; a restart then
            replays from step 0).
        clock: the run's clock (``WallClock`` in an actor).
        jax_options: ``jax.config`` values to apply first.
        trace: where events go (default: kept in memory and handed back with each
            reply; in this process, the run's trace itself).
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
        clock: Any,
        jax_options: dict[str, Any],
        trace: Any = None,
    ):
        _configure_jax(jax_options)
        self._setup(config, store, cache_dir, checkpoint_dir, clock, trace)

    def _setup(
        self,
        config: RunConfig,
        store: WeightStore,
        cache_dir: str | None,
        checkpoint_dir: str | None,
        clock: Any,
        trace: Any = None,
    ) -> None:
        self.config, self.clock = config, clock
        self.in_process = store.in_process
        self.trace = trace or MemoryTrace()
        self.task = task = build_task(config)
        model, self.tokenizer = build_policy(config, task)
        model, self.warm_start = self._warm_start(
            config, task, model, self.tokenizer, Path(cache_dir) if cache_dir else None
        )
        graphdef, params = nnx.split(model)
        self.graphdef = graphdef
        train_config = train_config_for(config)
        ref = params if train_config.algorithm.needs_reference else None
        state = create_train_state(train_config, params, seed=config.seed, ref_params=ref)
        self.state = self._place_state(state)
        # In this process the step keeps its parameters (it donates every other buffer),
        # so the in-process store holds each pushed version without a copy.
        self.train_step = make_train_step(
            train_config, graphdef, mesh=self.mesh, keep_params=self.in_process
        )
        self.store_kind = store.kind
        self.param_server = store.connect(on_event=self._on_transfer) if self.pushes else None
        self.checkpoints = None
        if checkpoint_dir is not None:
            self.checkpoints = CheckpointManager(
                checkpoint_dir, max_to_keep=config.checkpoint.keep, async_save=self.in_process
            )
        # (version, host params) to publish when the store lacks the newest version.
        self._to_publish: tuple[int, Any] | None = (0, self._publishable(self.state.params))

    # -- where arrays live (overridden by a multi-process trainer) -------------------
    def _warm_start(self, config, task, model, tokenizer, cache_dir):
        return warm_start(config, task, model, tokenizer, cache_dir)

    def _place_state(self, state: Any) -> Any:
        # Committed to the device like a state restored by Orbax, so that a restore
        # does not recompile the train step (committed arrays key another program).
        return jax.device_put(state, jax.devices()[0])

    def _place_batch(self, batch: TrainBatch) -> TrainBatch:
        return batch

    def _host(self, tree: Any) -> Any:
        """Full host copies of ``tree`` (a collective with several processes)."""
        return jax.device_get(tree)

    def _for_push(self, params: Any) -> Any:
        """What ``push`` is given: device arrays here (the store copies them)."""
        return params

    def _publishable(self, params: Any) -> Any:
        """What :meth:`publish` may push later: a host copy, or in this process the
        kept parameters themselves."""
        return params if self.in_process else self._host(params)

    def _on_transfer(self, kind: str, version: int, **fields: Any) -> None:
        if kind == "push":
            self.trace.record(self.clock(), "push", "trainer", version, **fields)

    def _drain(self) -> list[TraceEvent]:
        return drain(self.trace)

    @property
    def version(self) -> int:
        return int(self.state.step)

    def _expect(self, step: int) -> None:
        if self.version != step:
            raise TrainerRestartedError(
                f"the trainer is at step {self.version}, the driver at step {step}: restore it"
            )

    # -- checkpoints -----------------------------------------------------------------
    def _save(self, json: dict[str, Any] | None, weights: dict[str, Any] | None, wait: bool) -> int:
        start = self.clock()
        # Numpy leaves (the weights) are written by process 0 alone; every process
        # writes its shards of the train state. One Orbax step: all items or none.
        pytrees = {"weights": weights} if weights else None
        save_train_state(self.checkpoints, self.state, json=json, pytrees=pytrees, force=True)
        if wait:
            self.checkpoints.wait()
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
        if self.checkpoints:
            self.checkpoints.wait()  # a save still being written in the background
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
        self.state, metrics = self.train_step(self.state, self._place_batch(batch))
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
            elif self.store_kind == "inprocess" and reset and hasattr(store, "rollback"):
                store.rollback(version, params)  # a fault plan's store: a new lineage
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
        wait: bool = True,
    ) -> SaveReply:
        """Saves the state as checkpoint ``step`` with the driver's items, unless that
        checkpoint exists.

        Args:
            step: the step the state must be at.
            json: JSON items (name -> value) saved with the train state.
            weights: the ``weights`` item (``{"v<N>": host params}``), or ``None``.
            wait: block until it is written (in this process saves go on in the
                background otherwise; an actor always waits).

        Raises:
            TrainerRestartedError: the state is not at ``step``.
        """
        self._expect(step)
        saved = self.checkpoints is not None and step not in self.checkpoints.all_steps()
        if saved:
            self._save(json, weights, wait or not self.in_process)
        return SaveReply(saved, self._drain())

    def host_params(self, step: int) -> Any:
        """The params at ``step`` for the driver (a host copy from an actor)."""
        self._expect(step)
        return self.state.params if self.in_process else self._host(self.state.params)

    def close(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.close()


def _weights_lost() -> tuple[type[BaseException], ...]:
    """The error of a pull whose weights died with their owner (Ray's object store)."""
    try:
        from rlaxkit.param_server.ray_store import WeightsLostError
    except ModuleNotFoundError:  # no Ray: no object store
        return ()
    return (WeightsLostError,)


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


class WorkerHost:
    """One inference worker: an ``InferenceWorker`` and its reward runner.

    The fleet calls :meth:`sync` (pull if the staleness policy says so; report free
    room) and then :meth:`submit_and_step` (start the prompts it was given, decode one
    chunk, return finished rollouts), every worker once per round. In this process the
    fleet calls its three parts (:meth:`launch`, :meth:`fetch`, :meth:`score`) so that a
    worker's chunk decodes while the previous worker's results are scored.

    Args:
        worker_id: the worker's name in the trace.
        config: the run configuration.
        graphdef: the policy's graph (weights come from the parameter server).
        tokenizer: the run's tokenizer.
        store: the parameter server.
        clock: the run's clock (``WallClock`` in an actor).
        jax_options: ``jax.config`` values to apply first.
        task, scorer: shared by the workers of one process (default: their own).
        trace: where events go (default: kept in memory and handed back with each
            reply; in this process, the run's trace itself).
    """

    def __init__(
        self,
        worker_id: str,
        config: RunConfig,
        graphdef: Any,
        tokenizer: Any,
        store: WeightStore,
        clock: Any,
        jax_options: dict[str, Any],
        task: Any = None,
        scorer: Any = None,
        trace: Any = None,
    ):
        _configure_jax(jax_options)
        self.clock = clock
        self.trace = trace or MemoryTrace()
        task = task or build_task(config)
        self.own_scorer = scorer is None
        self.scorer = scorer or RewardRunner.for_task(task).start()
        self.lost_weights = 0
        self.in_process = store.in_process
        server = store.connect(pull_timeout_s=_WORKER_PULL_TIMEOUT_S)
        if hasattr(server, "view"):  # a fault plan's store: failing pulls per worker
            server = server.view(worker_id)
        self.store = _Observed(server)
        self._decoding, self._complete = False, []
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

    def _drain(self) -> list[TraceEvent]:
        return drain(self.trace)

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
        except _weights_lost() as error:
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
        self.launch(work, decode)
        self.fetch()
        return self.score()

    def launch(self, work: list[Work], decode: bool = True) -> None:
        """Starts ``work`` and dispatches one chunk without waiting for it."""
        for issue, problem in work:
            self.worker.submit(issue, problem)
        self._decoding = decode
        if decode:
            self.worker.launch()

    def fetch(self, pipelined: bool = False) -> None:
        """Waits for the launched chunk (``pipelined``: another worker's results were
        scored meanwhile)."""
        self._complete = self.worker.fetch(pipelined=pipelined) if self._decoding else []

    def score(self) -> ChunkReply:
        """Scores the fetched chunk's finished prompts; replies with their rollouts."""
        rollouts = self.worker.score(self._complete) if self._decoding else []
        self._complete = []
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
        """The weights of ``versions`` (each one the replay log needs; host copies from
        an actor)."""
        held = self.worker.replay_weights()
        if self.in_process:
            return {version: held[version] for version in versions}
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
        if self.own_scorer:
            self.scorer.close()
