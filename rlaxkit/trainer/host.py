"""The trainer host: the train state and its jitted step, pushes and checkpoints, in
this process or as a Ray actor (``rlaxkit.runtime.hosts``)."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import jax
from flax import nnx

from rlaxkit.api import PublishReply, SaveReply, TrainResult
from rlaxkit.config.run import RunConfig
from rlaxkit.data.batch import Sample, TrainBatch, collate
from rlaxkit.models.lora import LoraConfig
from rlaxkit.models.tokenizer import Tokenizer
from rlaxkit.param_server.adapters import AdapterParameterServer
from rlaxkit.rules.trace import MemoryTrace, TraceEvent, TraceSink
from rlaxkit.runtime.build import (
    build_policy,
    build_task,
    cached_warm_start,
    train_config_for,
    warm_start,
)
from rlaxkit.runtime.common import TRAIN_BUCKETS
from rlaxkit.runtime.hosts import TrainerRestartedError, WeightStore, configure_jax, drain
from rlaxkit.tasks.base import Task
from rlaxkit.tasks.episodes import EpisodicTask
from rlaxkit.trainer.checkpoint import (
    CheckpointManager,
    abstract_tree,
    restore_train_state,
    save_train_state,
)
from rlaxkit.trainer.state import TrainState
from rlaxkit.trainer.step import make_train_step
from rlaxkit.trainer.teacher import initial_train_state
from rlaxkit.util.jaxutil import host_arrays

T = TypeVar("T")


def check_finite(step: int, metrics: dict[str, float]) -> None:
    """Raises ``FloatingPointError`` when train step ``step``'s loss, gradient norm or
    update norm is not finite: the step found the weights non-finite, or its update
    overflows them or the next forward pass (the update's norm overflows from entries of
    about 1e19, where float32 squares do; products of such weights overflow too), and
    every later step would train and publish NaN. The runtime calls it before the step's
    push, so such weights never reach a worker."""
    keys = ("loss", "grad_norm", "update_norm")
    bad = {k: metrics[k] for k in keys if not math.isfinite(metrics.get(k, 0.0))}
    if bad:
        raise FloatingPointError(
            f"train step {step}: {', '.join(f'{k} is {v}' for k, v in bad.items())}; the "
            "weights are, or this update makes them, no longer finite (an update too large "
            "for them: check optimizer.learning_rate and max_grad_norm). The run stops "
            "before publishing them; it resumes from its last checkpoint"
        )


def first_batch(config: RunConfig, task: Task, tokenizer: Tokenizer) -> TrainBatch | None:
    """A batch shaped as the run's first one most likely is (``None``: no guess, for an
    episodic task): ``staleness.batch_size`` groups of ``group_size`` samples, each the
    longest training prompt (at most ``runtime.max_prompt_tokens``) and
    ``sampling.max_new_tokens`` completion tokens, collated as the driver does (a
    fresh policy rarely stops early, and bucketing absorbs the rest)."""
    if isinstance(task, EpisodicTask):
        return None
    problems = task.problems("train", config.task.num_train)
    problems = problems[:: max(1, len(problems) // 4096)]  # a sample of a large set
    longest = max(len(tokenizer.encode(task.format_prompt(p))) for p in problems)
    prompt = [tokenizer.pad_id] * min(longest, config.runtime.max_prompt_tokens)
    new = config.sampling.max_new_tokens
    sample = Sample(
        prompt_tokens=prompt,
        completion_tokens=[tokenizer.pad_id] * new,
        behaviour_logprobs=[0.0] * new,
        versions=0,
        reward=0.0,
        group_id=0,
    )
    rows = config.staleness.batch_size * config.group_size
    return collate([sample] * rows, bucket=TRAIN_BUCKETS, pad_token_id=tokenizer.pad_id)


def compile_first_step(host: TrainerHost, config: RunConfig, task: Task) -> threading.Thread:
    """Compiles ``host``'s train step for ``first_batch`` on a background thread, so that
    it compiles while the workers compile and generate the first batch (XLA compiles
    without the GIL) and the first step waits for the longer of the two, not their sum.
    The call that finds the program is the same as without it. A guess that misses costs
    one compile on the side; the step compiles its own shape."""
    step: Any = host.train_step  # jax.jit's, or make_train_step's keep-params wrapper
    state = abstract_tree(host.state)  # the committed state's shardings key the program

    def compile_step() -> None:
        with contextlib.suppress(Exception):  # a failing compile fails at the step itself
            batch = first_batch(config, task, host.tokenizer)
            if batch is not None:
                step.lower(state, abstract_tree(batch)).compile()

    thread = threading.Thread(target=compile_step, name="compile-train-step", daemon=True)
    thread.start()
    return thread


class Pending(NamedTuple):
    """A version to publish when the store lacks it (``merged``: a LoRA run's full weights)."""

    version: int
    params: object
    merged: bool = False


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
        checkpoint_dir: where train-state checkpoints go (``None``: a restart replays
            from step 0).
        clock: the run's clock (``WallClock`` in an actor).
        jax_options: ``jax.config`` values to apply first.
        trace: where events go (default: in memory, handed back with each reply).
    """

    # One process: no mesh (its default device), and it pushes to the parameter server.
    # ``TrainerProcessActor`` (``ray_trainer_group``) sets both per process of a group.
    mesh: Any = None
    pushes: bool = True

    def __init__(
        self,
        config: RunConfig,
        store: WeightStore,
        cache_dir: str | None,
        checkpoint_dir: str | None,
        clock: Callable[[], float],
        jax_options: Mapping[str, object],
        trace: TraceSink | None = None,
    ):
        configure_jax(jax_options)
        self._setup(config, store, cache_dir, checkpoint_dir, clock, trace)

    def _setup(
        self,
        config: RunConfig,
        store: WeightStore,
        cache_dir: str | None,
        checkpoint_dir: str | None,
        clock: Callable[[], float],
        trace: TraceSink | None = None,
    ) -> None:
        self.config, self.clock = config, clock
        self.trace = trace or MemoryTrace()
        self.task = task = build_task(config)
        cache = Path(cache_dir) if cache_dir else None
        # A cached warm start replaces the fresh weights: do not initialise them (a
        # trainer group's processes need real ones to broadcast into).
        abstract = self.mesh is None and cached_warm_start(config, cache) is not None
        model, self.tokenizer = build_policy(config, task, abstract=abstract)
        model, self.warm_start = self._warm_start(config, task, model, self.tokenizer, cache)
        self.graphdef, params = nnx.split(model)
        train_config = train_config_for(config)
        state = initial_train_state(config, train_config, params, model.config.vocab_size)
        self.state = self._place_state(state)
        self._version = 0
        # In this process the step keeps its parameters (it donates every other buffer),
        # so the in-process store holds each pushed version without a copy.
        self.train_step = make_train_step(
            train_config, self.graphdef, mesh=self.mesh, keep_params=store.in_process
        )
        # A trainer group's step compiles at its first batch (its shardings are the
        # mesh's); one process compiles it now, while the workers start.
        self.compiling = None if self.mesh else compile_first_step(self, config, task)
        self.store_kind = store.kind
        # Every process of a trainer group gathers the base (a collective).
        base = None if self.lora is None else self._host(self.state.base_params)
        self.param_server = None
        self._rollback = False  # the store starts new lineages (a fault plan's, in process)
        if self.pushes:
            server = store.connect(on_event=self._on_transfer, publication=config.param_server)
            self._rollback = hasattr(server, "rollback")
            if self.lora is not None:
                server = AdapterParameterServer(server, lora=self.lora)
                server.publish_base(base)
            self.param_server = self.train_step.drift.reader = server  # drift: versions
        self.checkpoints = None
        if checkpoint_dir is not None:
            keep, background = config.checkpoint.keep, self.in_process
            self.checkpoints = CheckpointManager(
                checkpoint_dir, max_to_keep=keep, async_save=background, clock=clock
            )
        self._to_publish: Pending | None = self._newest()

    @property
    def in_process(self) -> bool:
        """The store lives in this process (the step keeps its parameters for it)."""
        return self.store_kind == "inprocess"

    @property
    def lora(self) -> LoraConfig | None:
        """A LoRA run publishes its frozen base once, then its adapters alone."""
        return self.config.trainer.lora

    # -- where arrays live (overridden by a multi-process trainer) -------------------
    def _warm_start(self, config, task, model, tokenizer, cache_dir):
        return warm_start(config, task, model, tokenizer, cache_dir)

    def _place_state(self, state: TrainState) -> TrainState:
        # Committed to the device like a state restored by Orbax, so that a restore
        # does not recompile the train step (committed arrays key another program).
        return jax.device_put(state, jax.devices()[0])

    def _place_batch(self, batch: TrainBatch) -> TrainBatch:
        return batch

    def _host(self, tree: T) -> T:
        """Full host copies of ``tree`` (a collective with several processes)."""
        return host_arrays(tree)

    def _for_push(self, params: object) -> object:
        """What ``push`` is given: device arrays here (the store copies them)."""
        return params

    def _publishable(self, params: object) -> object:
        """What :meth:`publish` may push later: a host copy, or in this process the
        kept parameters themselves (adapters are copied: the step donates them)."""
        return params if self.in_process and self.lora is None else self._host(params)

    def _published(self) -> object:
        """What a push publishes: the params, or a LoRA run's adapters."""
        return self.state.params if self.lora is None else self.state.adapters

    def _newest(self) -> Pending:
        return Pending(self.version, self._publishable(self._published()))

    def _on_transfer(self, kind: str, version: int | None, **fields: object) -> None:
        if kind == "push":
            self.trace.record(self.clock(), "push", "trainer", version, **fields)
        elif kind == "restart":  # found by a push before a round of the driver's did
            self.trace.record(self.clock(), "restart", "param_server", None)

    def _drain(self) -> list[TraceEvent]:
        for write in self.checkpoints.finished_writes() if self.checkpoints else ():
            # Stamped now, when it is known (the trace stays in time order).
            duration_s, step = write.written_s - write.returned_s, write.step
            self.trace.record(
                self.clock(),
                "checkpoint_write",
                "trainer",
                step,
                step=step,
                duration_s=duration_s,
                written_s=write.written_s,
            )
        return drain(self.trace)

    @property
    def version(self) -> int:
        """The state's step, kept on the host (reading ``state.step`` waits on the device)."""
        return self._version

    def _expect(self, step: int) -> None:
        if self.version != step:
            raise TrainerRestartedError(
                f"the trainer is at step {self.version}, the driver at step {step}: restore it"
            )

    # -- checkpoints -----------------------------------------------------------------
    def _timed(
        self, kind: str, start: float, end: float | None = None, step: int | None = None
    ) -> None:
        end, step = self.clock() if end is None else end, self.version if step is None else step
        self.trace.record(end, kind, "trainer", step, step=step, duration_s=end - start)

    def _save(
        self, json: Mapping[str, object] | None, weights: Mapping[str, object] | None, wait: bool
    ) -> int:
        start = self.clock()
        # Numpy leaves (the weights) are written by process 0 alone; every process
        # writes its shards of the train state. One Orbax step: all items or none.
        pytrees = {"weights": weights} if weights else None
        assert self.checkpoints is not None  # save_checkpoint checks it
        save_train_state(self.checkpoints, self.state, json=json, pytrees=pytrees, force=True)
        if wait:
            self.checkpoints.wait()
        self._timed("checkpoint_save", start)
        return self.version

    def restore(self, max_step: int, published: tuple[int, object] | None = None) -> int:
        """Loads the newest checkpoint at or below ``max_step`` (the fresh step-0 state
        when there is none); returns its step.

        Args:
            max_step: the newest step the driver knows was taken.
            published: ``(version, host params)`` for :meth:`publish` to push next when
                a resumed run's newest published version is older than its checkpoint
                (``None``: the restored state's params).
        """
        if self.checkpoints:
            self.checkpoints.wait()  # a save still being written in the background
        kept = self.checkpoints.all_steps() if self.checkpoints else ()
        steps = [s for s in kept if s <= max_step]
        if steps and self.checkpoints:
            start = self.clock()
            self.state = restore_train_state(self.checkpoints, self.state, step=max(steps))
            self._version = int(self.state.step)
            self._timed("checkpoint_restore", start)
        if published is not None and published[0] != self.version:
            # A LoRA run's checkpoint holds full weights, not adapters.
            self._to_publish = Pending(*published, self.lora is not None) if self.pushes else None
        else:
            self._to_publish = self._newest()
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
        if self.compiling is not None:  # the first step's program, compiled ahead
            self.compiling.join()
            self.compiling = None
        # On the run's clock, as every other duration in the trace (a calibration
        # recorded on the CPU clock compares them with the run's windows).
        start = self.clock()
        self.state, step_metrics = self.train_step(self.state, self._place_batch(batch))
        self._version = step
        metrics = {k: float(v) for k, v in self._host(step_metrics).items()}
        check_finite(step, metrics)
        duration_s = self.clock() - start
        if self.config.weight_sync.should_push(self.version):
            if push:
                params = self._for_push(self._published())
                if self.param_server is not None:  # process 0 of a trainer group pushes
                    self.param_server.push(self.version, params)
                self._to_publish = None
            else:
                self._to_publish = self._newest()
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
        store: Any = self.param_server  # object-store pushes take reset= and republish
        latest = store.latest_version()
        if self._to_publish is not None and (
            reset or latest is None or latest < self._to_publish[0]
        ):
            version, params, merged = self._to_publish
            if merged:  # a LoRA run resumed at a version older than its state
                store.push_merged(
                    version, params, reset=reset and self.store_kind == "object_store"
                )
            elif self.store_kind == "object_store":
                store.push(version, params, reset=reset)
            elif self.store_kind == "inprocess" and reset and self._rollback:
                store.rollback(version, params)  # a fault plan's store: a new lineage
            elif latest is None or latest < version:
                store.push(version, params)
            self._to_publish = None
        elif self.store_kind == "object_store" and (latest is None or reset):
            store.republish()
        return PublishReply(store.latest_version(), self._drain())

    def warm_start_info(self) -> dict[str, object]:
        """What the warm start did, as ``rlaxkit.runtime.build.warm_start`` reports it."""
        return self.warm_start

    def save_checkpoint(
        self,
        step: int,
        json: Mapping[str, object] | None = None,
        weights: Mapping[str, object] | None = None,
        wait: bool = True,
    ) -> SaveReply:
        """Saves the state as checkpoint ``step`` with the driver's items, unless that
        checkpoint exists.

        Args:
            step: the step the state must be at.
            json: JSON items (name -> value) saved with the train state.
            weights: the ``weights`` item (``{"v<N>": host params}``), or ``None``.
            wait: block until it is written (an actor always waits).

        Raises:
            TrainerRestartedError: the state is not at ``step``.
        """
        self._expect(step)
        saved = self.checkpoints is not None and step not in self.checkpoints.all_steps()
        if saved:
            self._save(json, weights, wait or not self.in_process)
        return SaveReply(saved, self._drain())

    def host_params(self, step: int) -> object:
        """The params at ``step`` for the driver (a host copy from an actor)."""
        self._expect(step)
        return self.state.params if self.in_process else self._host(self.state.params)

    def close(self) -> None:
        if self.compiling is not None:
            self.compiling.join()
        if self.checkpoints is not None:
            self.checkpoints.close()
