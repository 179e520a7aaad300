"""The local placement: the trainer and the fleet in this process (the embedded default).

The hosts are the ones a Ray run places in actors (``rlaxkit.runtime.hosts``), called
in this process: the driver's loop, the trainer's step and every worker's decoding are
the same code on both placements. The parameter server is an in-process store (wrapped
to inject a fault plan's outages and failing pulls when a plan is given). In concurrent
mode each worker's ``InferenceWorker`` runs in a thread of its own
(``rlaxkit.runtime.concurrent``). The fleet calls its hosts through ``InProcess``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from rlaxkit.config.run import RunConfig
from rlaxkit.param_server import InProcessParameterServer, ParameterServer
from rlaxkit.runtime.common import RunTrace
from rlaxkit.runtime.concurrent import ConcurrentCollector
from rlaxkit.runtime.faults import FaultInjector, NoFaults
from rlaxkit.runtime.faulty_store import UnreliableParameterServer
from rlaxkit.runtime.fleet import Calls, WorkerFleet
from rlaxkit.runtime.hosts import WeightStore, published_params, read_published
from rlaxkit.runtime.parts import Parts
from rlaxkit.runtime.state import checkpoint_dir, param_shapes
from rlaxkit.runtime.trainer_client import HealingTrainerClient, InProcessTrainer
from rlaxkit.tasks import RewardRunner
from rlaxkit.trainer.checkpoint import abstract_tree
from rlaxkit.trainer.host import TrainerHost
from rlaxkit.worker.host import WorkerHost


class InProcess:
    """Hosts in this process: calls are method calls, and no host dies on its own.

    Args:
        threaded: decode the busy workers' chunks at once, each on its own thread
            (``runtime.threaded_chunks``); else one after another.
        clock: the run's clock (it times the wait for a chunk on another thread).
    """

    def __init__(self, threaded: bool = False, clock: Callable[[], float] = time.perf_counter):
        self.threaded, self.clock = threaded, clock
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0

    def call(self, calls: Calls) -> tuple[dict[str, Any], list[Any]]:
        return {slot.worker_id: getattr(slot.handle, m)(*args) for slot, m, args in calls}, []

    def step(self, calls: Calls) -> tuple[dict[str, Any], list[Any]]:
        """Threaded: every busy worker's chunk is launched at once, the first on this
        thread and each other on a thread of its own. Else each worker's chunk is
        dispatched as soon as the previous worker's results are fetched, so that with
        asynchronous dispatch (accelerators) it decodes while the host scores them.
        Either way the results are fetched and scored on this thread, in worker order,
        so the run is the same run.

        On XLA:CPU, ``rlaxkit.util.hostmem`` runs each program on the calling thread and a
        chunk of the workers' engines runs on one core, so on a machine with a core per
        worker the threaded chunks decode side by side (docs/performance.md, "The sample
        path"). The results stay on this thread: launching the next chunk from a thread
        to score meanwhile instead was slower."""
        replies = {}
        for slot, _, (work, decode) in calls:
            slot.handle.submit(work)
            if not decode:
                slot.handle.launch(decode=False)
                replies[slot.worker_id] = slot.handle.score()
        decoding = [slot for slot, _, (_, decode) in calls if decode]
        # A multi-turn task's tool steps first, on this thread and in worker order: their
        # trace events come in the same order either way.
        for slot in decoding:
            slot.handle.advance()
        if self.threaded and len(decoding) > 1:
            self._threaded(decoding, replies)
        elif decoding:
            decoding[0].handle.launch(advanced=True)
            for i, slot in enumerate(decoding):
                slot.handle.fetch(pipelined=i > 0)
                if i + 1 < len(decoding):  # asynchronous: decodes meanwhile
                    decoding[i + 1].handle.launch(advanced=True)
                replies[slot.worker_id] = slot.handle.score()
        return {slot.worker_id: replies[slot.worker_id] for slot, _, _ in calls}, []

    def _threaded(self, decoding: list[Any], replies: dict[str, Any]) -> None:
        if self._pool_size < len(decoding) - 1:  # a thread for each worker after the first
            self.close()
            self._pool_size = len(decoding) - 1
            self._pool = ThreadPoolExecutor(self._pool_size, "rlaxkit-chunk")
        assert self._pool is not None
        launches = [self._pool.submit(slot.handle.launch, True, True) for slot in decoding[1:]]
        try:
            decoding[0].handle.launch(advanced=True)
        finally:  # the other launches end before anything else touches their workers
            wait(launches)
        for i, slot in enumerate(decoding):
            if i:
                start = self.clock()
                launches[i - 1].result()
                # The decode event times this thread's part: the wait and the fetch.
                slot.handle.fetch(pipelined=True, waited_s=self.clock() - start)
            else:
                slot.handle.fetch()
            replies[slot.worker_id] = slot.handle.score()

    def close(self) -> None:
        """Stops the chunks' threads (a later round starts new ones)."""
        if self._pool is not None:
            self._pool.shutdown()
        self._pool, self._pool_size = None, 0

    def kill(self, handle: Any) -> None:
        handle.close()

    def stop(self, handle: Any) -> None:
        handle.close()

    def start_seconds(self, handle: object) -> float | None:
        return None  # built in this process before its first round


def start_local(
    config: RunConfig,
    trace: RunTrace,
    clock: Callable[[], float],
    books: Any,
    faults: NoFaults,
    run_dir: Path | None,
    cache_dir: Path | None,
) -> Parts:
    """The local placement's parts: trainer (with its warm start), store and fleet."""

    def on_transfer(kind: str, version: int, **fields: object) -> None:
        if kind == "push":
            trace.record(
                clock(),
                "push",
                "trainer",
                version,
                duration_s=fields.get("duration_s", 0.0),
                bytes=fields.get("bytes", 0),
            )

    def new_store() -> ParameterServer:
        keep = config.runtime.keep_versions
        if config.param_server.delta:
            return config.param_server.wrap(InProcessParameterServer(keep), on_event=on_transfer)
        return InProcessParameterServer(keep=keep, on_event=on_transfer)

    store: Any = new_store()
    if isinstance(faults, FaultInjector):  # the plan's outages and failing pulls
        lora = config.trainer.lora
        conversions = lora_conversions(lora) if lora is not None else {}
        store = faults.store = UnreliableParameterServer(new_store, **conversions)
    weights = WeightStore("inprocess", server=store)
    checkpoints = str(checkpoint_dir(run_dir)) if run_dir else None
    cache = str(cache_dir) if cache_dir else None
    host = TrainerHost(config, weights, cache, checkpoints, clock, {}, trace)
    trainer = HealingTrainerClient(InProcessTrainer(host), trace, books, clock)
    scorer = RewardRunner.for_task(host.task).start()

    def start_host(worker_id: str) -> WorkerHost:
        return WorkerHost(
            worker_id,
            config,
            host.graphdef,
            host.tokenizer,
            weights,
            clock,
            {},
            task=host.task,
            scorer=scorer,
            trace=trace,
        )

    transport = InProcess(threaded=config.runtime.threaded_chunks, clock=clock)
    fleet = WorkerFleet(start_host, transport, trace, clock, False, 0, scorer=scorer)
    fleet.scale(config.runtime.num_workers)
    concurrent = config.runtime.mode == "concurrent"

    params = host.state.params
    return Parts(
        task=host.task,
        tokenizer=host.tokenizer,
        graphdef=host.graphdef,
        warm_start=host.warm_start,
        fleet=fleet,
        trainer=trainer,
        store=store,
        scorer=scorer,
        shapes=param_shapes(params),
        template=abstract_tree(params),
        collector=(
            ConcurrentCollector([slot.handle.worker for slot in fleet.workers], scorer)
            if concurrent
            else None
        ),
        published_weights=lambda version: published_params(
            store.store if isinstance(store, UnreliableParameterServer) else store,
            config.trainer.lora,
            version,
        ),
        teardown=[scorer.close, trainer.close, transport.close, fleet.close],
    )


def lora_conversions(lora: object) -> dict[str, Callable[[int, Any], Any]]:
    """A LoRA run (``trainer.lora``) pushes adapter records: a push held back by an
    outage is checkpointed as its full weights and restored as a record of them
    (``merged_record``)."""
    from rlaxkit.param_server.adapters import merged_record

    def weights_of(version: int, record: object) -> Any:
        alone = InProcessParameterServer(keep=2)
        alone.push(version, record)
        return read_published(alone, lora)[1]

    return {"weights_of": weights_of, "push_of": merged_record}
