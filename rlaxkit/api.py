"""The contracts that hold a run together: what the driver asks of its parts, and the
typed messages they answer with.

One driver (``rlaxkit.runtime.driver.Driver``) runs the loop of every backend. A backend
is a *placement*: which ``Fleet`` of inference workers and which ``TrainerClient`` the
driver is given (in-process objects for ``runtime.backend=local``, Ray actors for
``ray``). The parameter server is ``rlaxkit.param_server.ParameterServer``; the trace
sink is ``rlaxkit.runtime.common.RunTrace``; tasks and tokenizers are
``rlaxkit.tasks.Task`` and ``rlaxkit.models.Tokenizer``. Messages between the driver and
its parts are the frozen dataclasses below (never string-keyed dicts), so they pickle the
same way to a Ray actor as they pass in-process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from rlaxkit.data.rollout import Rollout
from rlaxkit.models import Tokenizer
from rlaxkit.param_server import ParameterServer
from rlaxkit.rules.controller import Issue
from rlaxkit.rules.trace import TraceEvent
from rlaxkit.tasks import Problem, Task

__all__ = [
    "ChunkReply",
    "Fleet",
    "FleetCheckpoint",
    "ParameterServer",
    "PublishReply",
    "SaveReply",
    "SyncReply",
    "Task",
    "Tokenizer",
    "TrainResult",
    "TrainerClient",
    "Work",
]


class Work(NamedTuple):
    """A prompt handed to a worker: its issue (ids, seeds) and the problem."""

    issue: Issue
    problem: Problem


@dataclass(frozen=True)
class SyncReply:
    """A worker's answer to a sync (pull if its staleness policy says so).

    Attributes:
        free: prompts it can take now.
        version: the weight version it holds (``None``: none yet).
        failed_pulls: its failed pulls so far.
        retry: the sync may not have done what the deterministic loop would (a failed
            pull, an empty store while the parameter server restarts, weights lost with
            a dead trainer); nothing changed, and the fleet may repair and ask again.
        weights_lost: the newest weights died with the trainer that owned them.
        events: trace events the worker recorded.
    """

    free: int
    version: int | None
    failed_pulls: int = 0
    retry: bool = False
    weights_lost: bool = False
    events: Sequence[TraceEvent] = ()


@dataclass(frozen=True)
class ChunkReply:
    """A worker's answer to one chunk of decoding.

    Attributes:
        rollouts: finished, scored samples, in the order the worker finished them.
        busy: prompts are still running on it.
        generated_tokens: tokens it generated in all (a running total).
        events: trace events the worker recorded.
        reward_counters: its reward runner's counters (running totals).
    """

    rollouts: Sequence[Rollout]
    busy: bool
    generated_tokens: int
    events: Sequence[TraceEvent] = ()
    reward_counters: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainResult:
    """One train step: its metrics (floats), compute seconds, trace events."""

    metrics: Mapping[str, float]
    duration_s: float
    events: Sequence[TraceEvent] = ()


@dataclass(frozen=True)
class PublishReply:
    """What the store holds after a publish, and the trainer's trace events."""

    version: int | None
    events: Sequence[TraceEvent] = ()


@dataclass(frozen=True)
class SaveReply:
    """Whether a checkpoint was written, and the trainer's trace events."""

    saved: bool
    events: Sequence[TraceEvent] = ()


@dataclass
class FleetCheckpoint:
    """What a checkpoint keeps of the fleet.

    Attributes:
        workers: per worker, in fleet order: ``worker_id``, ``in_flight`` (group ids)
            and ``snapshot`` (its replay log, ``InferenceWorker.snapshot``).
        books: the fleet's own counters (JSON).
        weights: version -> params of the versions the replay logs start from or pulled.
    """

    workers: list[dict[str, object]]
    books: dict[str, object] = field(default_factory=dict)
    weights: dict[int, object] = field(default_factory=dict)


class Fleet(Protocol):
    """The inference workers, as the driver sees them (``rlaxkit.runtime.fleet.WorkerFleet``
    over an in-process or a Ray transport).

    A round is ``sync`` then ``step``: every live worker pulls if it must and reports its
    room; the driver issues prompts in worker order; every live worker starts its
    prompts and decodes one chunk; replies come back in worker order. Workers may run in
    parallel within a phase, but each one's inputs are those of the deterministic loop.
    """

    workers: list[Any]

    def worker_ids(self) -> list[str]:
        """The workers in the fleet, in order."""
        ...

    def sync(self, live: Sequence[str]) -> dict[str, SyncReply]:
        """Workers in ``live`` pull if their policy says so; replies of those that
        answered (a dead one leaves the fleet; its prompts wait in :meth:`take_lost`)."""
        ...

    def step(
        self, work: Mapping[str, Sequence[Work]], chunked: Sequence[str]
    ) -> list[tuple[str, ChunkReply]]:
        """Hands each worker its ``work``; those in ``chunked`` decode one chunk."""
        ...

    def preempt(self, worker_id: str) -> list[Issue]:
        """Discards a worker's host (on Ray: kills its actor); returns its prompts, which
        the driver re-issues."""
        ...

    def drop_weights(self, worker_id: str) -> list[Issue]:
        """The worker drops weights of a discarded branch and its prompts (returned)."""
        ...

    def restart(self, worker_id: str) -> None:
        """A new, empty host for a preempted worker."""
        ...

    def take_lost(self) -> list[tuple[str, list[Issue]]]:
        """Workers that died since the last call, with the prompts they held."""
        ...

    def scale(self, n: int) -> list[tuple[str, list[Issue]]]:
        """Grows or shrinks the fleet to ``n``; returns the removed workers' prompts."""
        ...

    def versions(self) -> dict[str, int | None]: ...

    def in_flight(self) -> dict[str, list[int]]: ...

    def generated_tokens(self) -> int: ...

    def failed_pulls(self) -> int: ...

    def reward_counters(self) -> dict[str, int]: ...

    def replacements(self) -> int: ...

    def checkpoint(self) -> FleetCheckpoint:
        """Every worker's replay log and the weights those logs need."""
        ...

    def restore(
        self,
        workers: list[dict[str, object]],
        books: dict[str, object],
        weights_for: Callable[[int], object],
        work_for: Callable[[int], Work],
    ) -> None:
        """Rebuilds every saved worker by replaying its log."""
        ...

    def close(self) -> None: ...


class TrainerClient(Protocol):
    """The trainer, as the driver sees it (``rlaxkit.runtime.trainer_client``): one host in
    this process, one actor, or a group of trainer processes."""

    def train(
        self,
        batch: object,
        step: int,
        push: bool,
        during: Callable[[threading.Event], None] | None = None,
    ) -> TrainResult:
        """Takes train step ``step`` (the state is at ``step - 1``); pushes per the
        weight-sync policy when ``push``, else holds the version for :meth:`publish`.
        ``during(stop)`` runs while the step does and has returned when this returns;
        ``stop`` is set if the step fails first."""
        ...

    def publish(self, step: int, reset: bool = False) -> int | None:
        """Makes sure the store holds the trainer's newest published version (``reset``:
        after a restore); returns the version the store holds."""
        ...

    def host_params(self, step: int) -> object:
        """The params at ``step`` (for evaluation and checkpoints)."""
        ...

    def kill(self) -> None:
        """A preemption: the state is void until :meth:`restore`."""
        ...

    def saved_steps(self) -> Container[int]:
        """The steps checkpointed so far (a container of ints)."""
        ...

    def save(
        self,
        step: int,
        json: dict[str, object],
        weights: dict[str, object] | None,
        wait: bool = True,
    ) -> bool:
        """Saves checkpoint ``step``: the train state with the driver's items."""
        ...

    def restore(self, max_step: int, published: tuple[int, object] | None = None) -> int:
        """Loads the newest checkpoint at or below ``max_step``; returns its step."""
        ...

    def close(self) -> None: ...
