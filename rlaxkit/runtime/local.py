"""The local placement: the trainer and the fleet in this process (the embedded default).

The hosts are the ones a Ray run places in actors (``rlaxkit.runtime.hosts``), called
in this process: the driver's loop, the trainer's step and every worker's decoding are
the same code on both placements. The parameter server is an in-process store (wrapped
to inject a fault plan's outages and failing pulls when a plan is given). In concurrent
mode each worker's ``InferenceWorker`` runs in a thread of its own
(``rlaxkit.runtime.concurrent``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlaxkit.checkpoint import abstract_tree
from rlaxkit.config import RunConfig
from rlaxkit.param_server import InProcessParameterServer, ParameterServer
from rlaxkit.runtime.common import RunTrace
from rlaxkit.runtime.concurrent import ConcurrentCollector
from rlaxkit.runtime.faults import FaultInjector, NoFaults
from rlaxkit.runtime.faulty_store import UnreliableParameterServer
from rlaxkit.runtime.fleet import Fleet, InProcess
from rlaxkit.runtime.hosts import WeightStore, published_params, read_published
from rlaxkit.runtime.placement import Parts
from rlaxkit.runtime.state import checkpoint_dir, param_shapes
from rlaxkit.runtime.trainer_client import InProcessTrainer, TrainerClient
from rlaxkit.runtime.trainer_host import TrainerHost
from rlaxkit.runtime.worker_host import WorkerHost
from rlaxkit.tasks import RewardRunner


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
    trainer = TrainerClient(InProcessTrainer(host), trace, books, clock)
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

    fleet = Fleet(start_host, InProcess(), trace, clock, False, 0, scorer=scorer)
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
        teardown=[scorer.close, trainer.close, fleet.close],
    )


def lora_conversions(lora: Any) -> dict[str, Callable[[int, Any], Any]]:
    """A LoRA run (``trainer.lora``) pushes adapter records: a push held back by an
    outage is checkpointed as its full weights and restored as a record of them
    (``merged_record``)."""
    from rlaxkit.param_server.adapters import merged_record

    def weights_of(version: int, record: Any) -> Any:
        alone = InProcessParameterServer(keep=2)
        alone.push(version, record)
        return read_published(alone, lora)[1]

    return {"weights_of": weights_of, "push_of": merged_record}
