"""The serial host's costs (HostSpec): what the deterministic local runtime spends
between the workers' chunks and the trainer's steps, in one thread, and how a scenario
names them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from sim.specs import Executor, check_field


@dataclass(frozen=True, kw_only=True)
class HostSpec:
    """How the work of trainer and workers is scheduled.

    ``parallel`` (the default, a real fleet): the trainer and every worker slot are
    concurrent processes; decode time follows :class:`FleetSpec`'s per-token model and
    the other fields here are unused. ``serial``: rlaxkit's deterministic local runtime,
    where one thread runs everything in a fixed order (:mod:`sim.entities.host`): rounds in
    which every busy worker decodes one chunk of ``chunk_steps`` steps over all its
    rows, and a train step between rounds whenever a full batch is ready. A chunk's
    cost hardly depends on how many rows are occupied (the engine's shapes are
    static), so it is modelled per chunk, not per token. :func:`sim.calibrate` fits
    these costs from a local trace (:mod:`sim.calibration.host`).

    Costs, in the order the serial host pays them:

    - per round: pulls (:class:`ParamServerSpec`), then ``issue_s_per_seq`` per
      sequence issued (tokenizing, submitting, admission);
    - per chunk on the device: ``chunk_s + chunk_s_per_step · steps +
      prefill_s_per_seq · started + finish_s_per_seq · finished``, plus
      ``chunk_s_after_step`` for the first chunk after a train step (the step evicted
      the decoder's state from the caches), plus ``rebuild_s`` for a worker's first
      chunk after a pull in the middle of generation (``weight_sync.pull_mode:
      in_flight``: the runtime rebuilds the held rows' KV cache under the new weights,
      one pass over every row and slot of the engine's static shapes, and the chunk
      waits for it);
    - per chunk that completed prompt groups, scoring: ``score_s + score_s_per_seq ·
      scored``;
    - per chunk on the host: ``chunk_host_s + sample_s · scored`` (rollouts, trace
      records, the buffer, and the round's few policy checks, which a trace cannot
      tell apart from a chunk's);
    - per train step: its compute (:class:`TrainerCostSpec`), its push, and ``step_s``
      (metrics, logging).

    Attributes:
        executor: ``parallel`` or ``serial``.
        chunk_steps: Decode steps per chunk (the runtime's ``runtime.chunk_steps``); a
            chunk stops earlier when all its rows have stopped.
        chunk_s, chunk_s_per_step, prefill_s_per_seq, finish_s_per_seq,
            chunk_s_after_step, rebuild_s: Device time of a chunk (above).
        score_s, score_s_per_seq: Time of one scoring call.
        issue_s_per_seq, chunk_host_s, sample_s, step_s: Host time outside the
            device and the timed transfers (above).
        round_s: Logical seconds one round counts for on the serial host's fault
            clock (the runtime's ``runtime.round_s``): a fault plan's ``at_s`` and
            every downtime are read on ``rounds · round_s``, as the runtime reads them.
        concurrent_chunks: The rounds of the deterministic loop on the Ray placement:
            every busy worker decodes its chunk and scores it in its own process at
            the same time, and the workers pull at the same time, so a round lasts
            as long as its slowest worker; ``chunk_host_s`` is then paid once per
            round (the driver's calls and books) instead of once per chunk.
        threaded_chunks: The rounds of the deterministic loop on the local placement
            with ``runtime.threaded_chunks``: every busy worker's chunk starts
            decoding at once (each on a thread, a core each), and the host fetches and
            scores them in worker order, waiting for each that is still decoding.
            Off: each chunk is dispatched when the previous worker's results are
            fetched.
        serial_chunks: No two pieces of work overlap: each busy worker's chunk is
            dispatched when the host is done with the previous worker's, and decodes
            before the host goes on. What a run with ``runtime.threaded_chunks=false``
            timed on the process's CPU clock (``time.process_time``) measures: on
            XLA:CPU ``rlaxkit.util.hostmem`` runs a program on the calling thread, and
            on that clock seconds of different threads add up anyway. The benchmarks
            that time runs so calibrate with it (``host.serial_chunks``).
        worker_start_s: Seconds a new worker takes to be up (on Ray: a new actor's
            process, imports and constructor). A worker back from a preemption holds
            up the round in which it first pulls until then.
        overlap_training: The runtime's ``runtime.overlap_training``: while the
            trainer computes a step, the rounds of the next batch run beside it (on
            the weights before the step, until the buffer holds that batch, while no
            fault is due or active), and the step's push waits for them. The two
            share nothing in the model: a step lasts as long as the longer of its
            compute and its rounds. On shared cores each slows the other, which costs
            fitted from a serial run's trace leave out (``calibrate`` refuses an
            overlapped trace).
    """

    executor: Executor = "parallel"
    chunk_steps: int = 1
    chunk_s: float = 0.0
    chunk_s_per_step: float = 0.0
    prefill_s_per_seq: float = 0.0
    finish_s_per_seq: float = 0.0
    chunk_s_after_step: float = 0.0
    rebuild_s: float = 0.0
    score_s: float = 0.0
    score_s_per_seq: float = 0.0
    issue_s_per_seq: float = 0.0
    chunk_host_s: float = 0.0
    sample_s: float = 0.0
    step_s: float = 0.0
    round_s: float = 1.0  # logical seconds per round (RunConfig's runtime.round_s)
    concurrent_chunks: bool = False
    worker_start_s: float = 0.0
    overlap_training: bool = False
    threaded_chunks: bool = False
    serial_chunks: bool = False

    def __post_init__(self) -> None:
        if self.executor not in get_args(Executor):
            raise ValueError(
                f"executor: must be one of {get_args(Executor)}, got {self.executor!r}"
            )
        check_field("chunk_steps", self.chunk_steps, integer=True)
        for name in HOST_COSTS:
            check_field(name, getattr(self, name), strict=False)
        check_field("round_s", self.round_s)
        check_field("worker_start_s", self.worker_start_s, strict=False)
        for name in ("concurrent_chunks", "overlap_training", "threaded_chunks", "serial_chunks"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a bool, got {getattr(self, name)!r}")
        if self.serial_chunks and (self.threaded_chunks or self.concurrent_chunks):
            raise ValueError(
                "serial_chunks: no work overlaps then; unset threaded_chunks and "
                "concurrent_chunks, which decode chunks at once"
            )
        if self.threaded_chunks and self.concurrent_chunks:
            raise ValueError(
                "threaded_chunks: a setting of the local placement's rounds; "
                "concurrent_chunks (the Ray placement's) decodes every chunk at once "
                "already: unset one of them"
            )
        if self.overlap_training and not self.serial:
            raise ValueError(
                "overlap_training: a setting of the serial host (executor: serial); the "
                "parallel fleet overlaps training with generation already"
            )

    @property
    def serial(self) -> bool:
        """True for the serial host (the deterministic local runtime)."""
        return self.executor == "serial"

    def chunk_time_s(
        self,
        steps: int,
        started: int,
        finished: int,
        *,
        after_step: bool = False,
        rebuilt: bool = False,
    ) -> float:
        """Device seconds of one chunk that runs ``steps`` decode steps, starts
        ``started`` sequences and finishes ``finished``; ``rebuilt``: its worker's
        cache was rebuilt by a pull since its last chunk."""
        return (
            self.chunk_s
            + self.chunk_s_per_step * steps
            + self.prefill_s_per_seq * started
            + self.finish_s_per_seq * finished
            + (self.chunk_s_after_step if after_step else 0.0)
            + (self.rebuild_s if rebuilt else 0.0)
        )

    def score_time_s(self, sequences: int) -> float:
        """Seconds of one scoring call over ``sequences`` sequences."""
        return self.score_s + self.score_s_per_seq * sequences


# The cost fields of HostSpec (seconds), in declaration order.
HOST_COSTS: tuple[str, ...] = (
    "chunk_s",
    "chunk_s_per_step",
    "prefill_s_per_seq",
    "finish_s_per_seq",
    "chunk_s_after_step",
    "rebuild_s",
    "score_s",
    "score_s_per_seq",
    "issue_s_per_seq",
    "chunk_host_s",
    "sample_s",
    "step_s",
)
