"""The local placement: the fleet and the trainer in this process (the embedded default).

``LocalFleet`` holds ``rlaxkit.worker.InferenceWorker``\\ s. In deterministic mode the
driver runs their rounds; each worker's chunk is dispatched as soon as the previous
worker's results are fetched, so it decodes while the host scores them (XLA runs one
chunk after the other either way; what the host does with the results, and in which
order, is unchanged). In concurrent mode each worker runs in a thread of its own
(``rlaxkit.runtime.concurrent``). ``LocalTrainer`` holds the train state and the jitted
step, and checkpoints it with the driver's items in ``RUN_DIR/checkpoints``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from rlaxkit.api import ChunkReply, FleetCheckpoint, SyncReply, TrainResult, Work
from rlaxkit.checkpoint import CheckpointManager, restore_train_state
from rlaxkit.config import RunConfig
from rlaxkit.controller import Issue
from rlaxkit.param_server import InProcessParameterServer
from rlaxkit.runtime.build import build_policy, build_task, train_config_for, warm_start
from rlaxkit.runtime.common import RunTrace
from rlaxkit.runtime.concurrent import ConcurrentCollector
from rlaxkit.runtime.faults import FaultInjector, NoFaults, UnreliableParameterServer
from rlaxkit.runtime.placement import Parts
from rlaxkit.runtime.state import checkpoint_dir, param_shapes
from rlaxkit.tasks import RewardRunner
from rlaxkit.trainer import create_train_state, make_train_step
from rlaxkit.worker import InferenceWorker


class LocalFleet:
    """In-process inference workers (the ``rlaxkit.api.Fleet`` of the local placement).

    Args:
        make_worker: builds the worker of a given id.
        worker_ids: the fleet's workers at the start.
        scorer: the ``RewardRunner`` the workers share.
    """

    def __init__(
        self, make_worker: Callable[[str], InferenceWorker], worker_ids: list[str], scorer: Any
    ):
        self.make_worker = make_worker
        self.workers = [make_worker(w) for w in worker_ids]
        self.scorer = scorer
        self._next = len(worker_ids)
        self._retired_tokens = self._retired_failed_pulls = 0

    def _worker(self, worker_id: str) -> InferenceWorker:
        return next(w for w in self.workers if w.worker_id == worker_id)

    def worker_ids(self) -> list[str]:
        return [w.worker_id for w in self.workers]

    def sync(self, live: Sequence[str]) -> dict[str, SyncReply]:
        out = {}
        for worker in self.workers:
            if worker.worker_id in live:
                worker.sync_weights()
                out[worker.worker_id] = SyncReply(worker.free, worker.version, worker.failed_pulls)
        return out

    def step(
        self, work: Mapping[str, Sequence[Work]], chunked: Sequence[str]
    ) -> list[tuple[str, ChunkReply]]:
        for worker in self.workers:
            for issue, problem in work.get(worker.worker_id, ()):
                worker.submit(issue, problem)
        decoding = [w for w in self.workers if w.worker_id in chunked]
        rollouts: dict[str, list] = {}
        if decoding:
            decoding[0].launch()
        for i, worker in enumerate(decoding):
            complete = worker.fetch(pipelined=i > 0)
            if i + 1 < len(decoding):
                decoding[i + 1].launch()  # decodes while the host scores this one
            rollouts[worker.worker_id] = worker.score(complete)
        return [
            (
                w.worker_id,
                ChunkReply(rollouts.get(w.worker_id, []), bool(w.requests), w.generated_tokens),
            )
            for w in self.workers
            if w.worker_id in work or w.worker_id in rollouts
        ]

    def preempt(self, worker_id: str) -> list[Issue]:
        return self._worker(worker_id).preempt()

    def restart(self, worker_id: str) -> None:
        """A preempted worker comes back empty; it pulls before it takes work."""

    def take_lost(self) -> list[tuple[str, list[Issue]]]:
        return []  # in-process workers do not die on their own

    def scale(self, n: int) -> list[tuple[str, list[Issue]]]:
        """Grows (new ids) or shrinks (newest first) the fleet to ``n`` workers; returns
        the removed workers' prompts."""
        removed = []
        while len(self.workers) < n:
            self.workers.append(self.make_worker(f"worker-{self._next}"))
            self._next += 1
        while len(self.workers) > n:
            worker = self.workers.pop()
            self._retired_tokens += worker.generated_tokens
            self._retired_failed_pulls += worker.failed_pulls
            removed.append((worker.worker_id, worker.preempt()))
        return removed

    def versions(self) -> dict[str, int | None]:
        return {w.worker_id: w.version for w in self.workers}

    def in_flight(self) -> dict[str, list[int]]:
        return {w.worker_id: list(w.requests) for w in self.workers}

    def generated_tokens(self) -> int:
        return self._retired_tokens + sum(w.generated_tokens for w in self.workers)

    def failed_pulls(self) -> int:
        return self._retired_failed_pulls + sum(w.failed_pulls for w in self.workers)

    def reward_counters(self) -> dict[str, int]:
        return dict(self.scorer.counters)

    def replacements(self) -> int:
        return 0

    def checkpoint(self) -> FleetCheckpoint:
        weights: dict[int, Any] = {}
        for worker in self.workers:
            weights |= worker.replay_weights()
        return FleetCheckpoint(
            [
                {"worker_id": w.worker_id, "in_flight": list(w.requests), "snapshot": w.snapshot()}
                for w in self.workers
            ],
            {
                "next_worker": self._next,
                "retired_tokens": self._retired_tokens,
                "retired_failed_pulls": self._retired_failed_pulls,
                "reward_counters": dict(self.scorer.counters),
                "hangs_pending": self.scorer.hangs_pending,
            },
            weights,
        )

    def restore(
        self,
        workers: list[dict[str, Any]],
        books: dict[str, Any],
        weights_for: Callable[[int], Any],
        work_for: Callable[[int], Work],
    ) -> None:
        self.workers = [self.make_worker(saved["worker_id"]) for saved in workers]
        for worker, saved in zip(self.workers, workers, strict=True):
            worker.restore(
                saved["snapshot"],
                issue_for=lambda g: work_for(g).issue,
                problem_for=lambda issue: work_for(issue.group_id).problem,
                weights_for=weights_for,
            )
        self._next = books["next_worker"]
        self._retired_tokens = books["retired_tokens"]
        self._retired_failed_pulls = books["retired_failed_pulls"]
        self.scorer.counters.update(books["reward_counters"])
        self.scorer.hangs_pending = books["hangs_pending"]

    def close(self) -> None:
        pass


class LocalTrainer:
    """The train state and its jitted step in this process (``rlaxkit.api.TrainerClient``).

    Args:
        config: the run configuration.
        graphdef, params: the policy.
        store: the parameter server it pushes to.
        checkpoints: where checkpoints go (``None``: no run directory).
        trace, clock: the run trace and clock (restores are traced).
    """

    def __init__(
        self,
        config: RunConfig,
        graphdef: Any,
        params: Any,
        store: Any,
        checkpoints: CheckpointManager | None,
        trace: RunTrace,
        clock: Callable[[], float],
    ):
        self.weight_sync, self.trace, self.clock = config.weight_sync, trace, clock
        train_config = train_config_for(config)
        ref = params if train_config.algorithm.needs_reference else None
        # Committed to the device like a state restored by Orbax, so that a restore
        # does not recompile the train step (committed arrays key another program).
        self.state = jax.device_put(
            create_train_state(train_config, params, seed=config.seed, ref_params=ref),
            jax.devices()[0],
        )
        # The step donates every buffer but the parameters, which the in-process store
        # then holds as the pushed version without a copy.
        self.train_step = make_train_step(train_config, graphdef, keep_params=True)
        self.store, self.checkpoints = store, checkpoints
        self._to_publish: tuple[int, Any] | None = (0, self.state.params)

    def train(self, batch: Any, step: int, push: bool) -> TrainResult:
        start = time.perf_counter()
        self.state, metrics = self.train_step(self.state, batch)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        duration_s = time.perf_counter() - start
        if self.weight_sync.should_push(step):
            self._to_publish = (step, self.state.params)
            if push:
                self.publish(step)
        return TrainResult(metrics, duration_s)

    def publish(self, step: int, reset: bool = False) -> int | None:
        """Pushes the newest version it should have published, if the store lacks it;
        ``reset``: the store starts a new lineage there (a restored trainer)."""
        if reset:
            version, params = self._to_publish or (step, self.state.params)
            if isinstance(self.store, UnreliableParameterServer):
                self.store.rollback(version, params)
            else:
                self.store.push(version, params)
        elif self._to_publish is not None:
            latest = self.store.latest_version()
            if latest is None or latest < self._to_publish[0]:
                self.store.push(*self._to_publish)
        self._to_publish = None
        return self.store.latest_version()

    def host_params(self, step: int) -> Any:
        return self.state.params

    def kill(self) -> None:
        """The state is void from now on; :meth:`restore` reads the checkpoint."""

    def saved_steps(self) -> tuple[int, ...]:
        return self.checkpoints.all_steps() if self.checkpoints else ()

    def save(
        self, step: int, json: dict[str, Any], weights: dict[str, Any] | None, wait: bool = True
    ) -> bool:
        pytrees = {"train_state": self.state} | ({"weights": weights} if weights else {})
        self.checkpoints.save(step, pytrees=pytrees, json=json, force=True)
        if wait:
            self.checkpoints.wait()
        return True

    def restore(self, max_step: int, published: tuple[int, Any] | None = None) -> int:
        """Loads the newest checkpoint at or below ``max_step``; returns its step."""
        self.checkpoints.wait()
        start = self.clock()
        step = max(s for s in self.checkpoints.all_steps() if s <= max_step)
        self.state = restore_train_state(self.checkpoints, self.state, step=step)
        duration_s = self.clock() - start
        self.trace.record(
            self.clock(), "checkpoint_restore", "trainer", step, step=step, duration_s=duration_s
        )
        self._to_publish = published if published and published[0] != step else None
        return step

    def close(self) -> None:
        if self.checkpoints:
            self.checkpoints.close()


def start_local(
    config: RunConfig,
    trace: RunTrace,
    clock: Callable[[], float],
    faults: NoFaults,
    run_dir: Path | None,
    cache_dir: Path | None,
) -> Parts:
    """The local placement's parts: warm start, trainer, store, fleet, in this process."""
    concurrent = config.runtime.mode == "concurrent"
    task = build_task(config)
    model, tokenizer = build_policy(config, task)
    model, warm = warm_start(config, task, model, tokenizer, cache_dir)
    graphdef, params = nnx.split(model)
    del model

    def on_transfer(kind: str, version: int, **fields: Any) -> None:
        if kind == "push":
            trace.record(
                clock(),
                "push",
                "trainer",
                version,
                duration_s=fields.get("duration_s", 0.0),
                bytes=fields.get("bytes", 0),
            )

    def new_store() -> InProcessParameterServer:
        return InProcessParameterServer(keep=config.runtime.keep_versions, on_event=on_transfer)

    store: Any = new_store()
    if isinstance(faults, FaultInjector):  # the plan's outages and failing pulls
        store = faults.store = UnreliableParameterServer(new_store)
    checkpoints = None
    if run_dir:
        checkpoints = CheckpointManager(
            checkpoint_dir(run_dir), max_to_keep=config.checkpoint.keep, async_save=True
        )
    trainer = LocalTrainer(config, graphdef, params, store, checkpoints, trace, clock)
    scorer = RewardRunner.for_task(task).start()

    def make_worker(worker_id: str) -> InferenceWorker:
        view = store.view(worker_id) if isinstance(store, UnreliableParameterServer) else store
        return InferenceWorker(
            worker_id,
            graphdef,
            config.sampling,
            task=task,
            tokenizer=tokenizer,
            scorer=scorer,
            param_server=view,
            staleness=config.staleness,
            weight_sync=config.weight_sync,
            trace=trace,
            clock=clock,
            num_slots=config.runtime.slots_per_worker,
            chunk_steps=config.runtime.chunk_steps,
            max_prompt_tokens=config.runtime.max_prompt_tokens,
        )

    fleet = LocalFleet(
        make_worker, [f"worker-{i}" for i in range(config.runtime.num_workers)], scorer
    )

    def published_weights(version: int) -> Any:
        inner = store.store if isinstance(store, UnreliableParameterServer) else store
        pulled, params = inner.pull()
        assert pulled == version, (pulled, version)
        return params

    return Parts(
        task=task,
        tokenizer=tokenizer,
        graphdef=graphdef,
        warm_start=warm,
        fleet=fleet,
        trainer=trainer,
        store=store,
        scorer=scorer,
        shapes=param_shapes(params),
        template=jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
        ),
        collector=ConcurrentCollector(fleet.workers, scorer) if concurrent else None,
        published_weights=published_weights,
        teardown=[scorer.close, trainer.close],
    )
