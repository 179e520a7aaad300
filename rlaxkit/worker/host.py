"""The worker host: one ``InferenceWorker`` and its reward runner, in this process or as
a Ray actor (``rlaxkit.runtime.hosts``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx

from rlaxkit.api import ChunkReply, SyncReply, Work
from rlaxkit.config.run import RunConfig
from rlaxkit.models.tokenizer import Tokenizer
from rlaxkit.observe.drift import sampler_config
from rlaxkit.param_server import ParameterServer
from rlaxkit.param_server.adapters import AdapterParameterServer
from rlaxkit.rules.trace import MemoryTrace, TraceEvent, TraceSink
from rlaxkit.runtime.build import build_policy, build_task
from rlaxkit.runtime.hosts import WeightStore, configure_jax, drain
from rlaxkit.tasks import RewardRunner, Task
from rlaxkit.util.jaxutil import cast_floats
from rlaxkit.worker.worker import InferenceWorker


def _weights_lost(store: WeightStore) -> tuple[type[BaseException], ...]:
    """The error of a pull whose weights died with their owner (Ray's object store)."""
    if store.kind != "object_store":
        return ()
    from rlaxkit.param_server.ray_store import WeightsLostError

    return (WeightsLostError,)


# A worker's pull waits this long for a version on an empty store (the parameter server
# restarting) before it fails, is counted, and the driver repairs the store.
_WORKER_PULL_TIMEOUT_S = 1.0


class _Observed:
    """A parameter-server client that remembers the latest version it last reported."""

    def __init__(self, server: ParameterServer, dtype: str | None = None):
        self.server = server
        self.seen: int | None = -1
        self.dtype = dtype  # ``model.sampler_dtype``

    def latest_version(self) -> int | None:
        self.seen = self.server.latest_version()
        return self.seen

    def pull(self, min_version: int | None = None, timeout: float | None = None) -> Any:
        version, params = self.server.pull(min_version, timeout)
        return version, cast_floats(params, self.dtype)

    def push(self, version: int, params: object) -> None:
        self.server.push(version, params)


def pull_path(store: WeightStore, worker_id: str, config: RunConfig) -> _Observed:
    """Worker ``worker_id``'s client of the parameter server, built in this order:

    1. the store's client (``WeightStore.connect``: in this process, Ray's object store
       or TensorStore; with ``param_server.delta``, delta records read back whole), as
       this worker reaches it (a fault plan's in-process store fails its pulls apart);
    2. with ``trainer.lora``, the base weights once, then each version's adapters
       merged into them (``AdapterParameterServer``);
    3. the weights cast to ``model.sampler_dtype``, and the newest version the store
       last reported remembered (``_Observed``).
    """
    server = store.connect(
        pull_timeout_s=_WORKER_PULL_TIMEOUT_S, publication=config.param_server, worker_id=worker_id
    )
    if config.trainer.lora is not None:
        timeout_s = _WORKER_PULL_TIMEOUT_S if store.kind == "object_store" else None
        server = AdapterParameterServer(server, default_timeout_s=timeout_s)
    return _Observed(server, config.model.sampler_dtype)


class WorkerHost:
    """One inference worker: an ``InferenceWorker`` and its reward runner.

    The fleet calls :meth:`sync` (pull if the staleness policy says so; report free
    room) and then :meth:`submit_and_step` (start the prompts it was given, decode one
    chunk, return finished rollouts), every worker once per round. In this process the
    fleet calls its three parts (:meth:`launch`, :meth:`fetch`, :meth:`score`) so that,
    with asynchronous dispatch, a worker's chunk decodes while the previous worker's
    results are scored.

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
        graphdef: nnx.GraphDef,
        tokenizer: Tokenizer,
        store: WeightStore,
        clock: Callable[[], float],
        jax_options: Mapping[str, object],
        task: Task | None = None,
        scorer: RewardRunner | None = None,
        trace: TraceSink | None = None,
    ):
        configure_jax(jax_options)
        self.clock = clock
        self.trace = trace or MemoryTrace()
        task = task or build_task(config)
        self.own_scorer = scorer is None
        self.weights_lost = _weights_lost(store)
        self.scorer = scorer or RewardRunner.for_task(task).start()
        self.in_process = store.in_process
        self.store = pull_path(store, worker_id, config)
        if config.model.sampler_dtype is not None:  # the graph in the sampler's dtype
            graphdef = nnx.graphdef(build_policy(sampler_config(config), task, abstract=True)[0])
        self._decoding, self._complete = False, list[Any]()
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
            episodes=config.episodes,
            # Concurrent mode's threads leave a slow tool's row parked and decode on.
            free_running=config.runtime.mode == "concurrent",
            cache_views=config.runtime.cache_views,
            inference=config.inference,
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
        except self.weights_lost as error:
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
        self.submit(work)
        self.launch(decode)
        self.fetch()
        return self.score()

    def submit(self, work: list[Work]) -> None:
        """Starts ``work``: its prompts join the worker's next chunk."""
        for issue, problem in work:
            self.worker.submit(issue, problem)

    def advance(self) -> None:
        """Resolves the tool steps due of a multi-turn task's episodes
        (``InferenceWorker.advance``), which :meth:`launch` does first otherwise."""
        self.worker.advance()

    def launch(self, decode: bool = True, advanced: bool = False) -> None:
        """Dispatches one chunk (none when ``decode`` is False); :meth:`fetch` waits for
        it. ``advanced``: :meth:`advance` ran since the last chunk."""
        self._decoding = decode
        if decode:
            self.worker.launch(advanced=advanced)

    def fetch(self, pipelined: bool = False, waited_s: float | None = None) -> None:
        """Waits for the launched chunk (``pipelined``, ``waited_s``: as
        ``InferenceWorker.fetch``)."""
        if not self._decoding:
            self._complete = []
            return
        self._complete = self.worker.fetch(pipelined=pipelined, waited_s=waited_s)

    def score(self) -> ChunkReply:
        """Scores the fetched chunk's finished prompts; replies with their rollouts."""
        rollouts = self.worker.score(self._complete) if self._decoding else []
        self._complete = []
        return ChunkReply(
            rollouts,
            bool(self.worker.requests),
            self.worker.generated_tokens,
            self._drain(),
            dict(self.scorer.counters) if self.own_scorer else {},  # else the fleet's
        )

    # -- checkpoints (rlaxkit.runtime.state) --------------------------------------------
    def checkpoint(self) -> dict[str, object]:
        """``snapshot`` (``InferenceWorker.snapshot``: the replay log of the prompts in
        flight) and ``versions``: the weight versions that log starts from or pulled."""
        return {
            "snapshot": self.worker.snapshot(),
            "versions": sorted(self.worker.replay_weights()),
        }

    def replay_weights(self, versions: list[int]) -> dict[int, object]:
        """The weights of ``versions`` (each one the replay log needs; host copies from
        an actor)."""
        held = self.worker.replay_weights()
        if self.in_process:
            return {version: held[version] for version in versions}
        return {version: jax.device_get(held[version]) for version in versions}

    def restore(
        self,
        snapshot: dict[str, object],
        issues: dict[int, Work],
        weights: dict[int, object],
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

    def drop_weights(self) -> None:
        """Drops the weights and every prompt in flight (the driver re-issues them)."""
        self.worker.preempt()

    def close(self) -> None:
        self.worker.close()
        if self.own_scorer:
            self.scorer.close()
