"""What the driver and a placement hand each other: the placement's ``Parts``, and what a
collector (``RoundTarget``) and a fault (``FaultTarget``) touch of the run.

The placements (``rlaxkit.runtime.local``, ``rlaxkit.runtime.ray_placement``) build
``Parts``; the faults (``rlaxkit.runtime.faults``) and the collectors
(``rlaxkit.runtime.concurrent``, ``rlaxkit.serve.agents``) are handed the loop through
these protocols. This module imports none of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rlaxkit.config.run import RunConfig

if TYPE_CHECKING:
    from flax import nnx

    from rlaxkit.api import Fleet, TrainerClient, Work
    from rlaxkit.data.buffer import RolloutBuffer
    from rlaxkit.data.rollout import Rollout, RolloutGroup
    from rlaxkit.models.tokenizer import Tokenizer
    from rlaxkit.param_server.base import ParameterServer
    from rlaxkit.rules.books import RunBooks
    from rlaxkit.rules.controller import Issue
    from rlaxkit.runtime.common import RunTrace
    from rlaxkit.tasks.base import Task
    from rlaxkit.tasks.runner import RewardRunner


class Collector(Protocol):
    """What runs the rounds in concurrent mode (threads), or the agents' endpoint: the
    loop asks it for a batch instead of running rounds itself."""

    def collect(self, exp: RoundTarget) -> list[RolloutGroup]: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


@dataclass
class Parts:
    """A placement's parts, as the driver uses them, typed by the contracts of
    ``rlaxkit.api`` (each placement builds them all before it hands them over).

    Attributes:
        task, tokenizer, graphdef: the run's task, tokenizer and model graph.
        warm_start: what the warm start did (``cached``, ``steps``, ...).
        fleet, trainer: the inference workers (``rlaxkit.api.Fleet``) and the trainer
            client (``rlaxkit.api.TrainerClient``).
        store: the driver's parameter-server client (it reads ``latest_version``).
        scorer: a ``RewardRunner`` in this process (evaluation; local scoring).
        shapes: ``param_shapes`` of the params (checked against a checkpoint's).
        template: abstract params (a checkpoint's weights restore onto it).
        collector: concurrent mode's thread collector, else ``None``.
        published_weights: version -> params of a published version (checkpoints).
        schedule: step -> fleet size the placement wants after it (``None``: keep), or
            ``None`` for a placement whose fleet never changes size on its own.
        kill_store: kills the parameter server for real (Ray's ``kill_param_server``).
        teardown: stops what the placement started.
    """

    task: Task
    tokenizer: Tokenizer
    graphdef: nnx.GraphDef
    fleet: Fleet
    trainer: TrainerClient
    store: ParameterServer
    scorer: RewardRunner
    template: Any  # a pytree of abstract arrays
    warm_start: dict[str, Any] = field(default_factory=dict)
    shapes: dict[str, list] = field(default_factory=dict)
    collector: Collector | None = None
    published_weights: Callable[[int], Any] = lambda version: None
    schedule: Callable[[int], int | None] | None = None
    kill_store: Callable[[], None] = lambda: None
    teardown: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        """Runs the teardowns, newest first (each once)."""
        while self.teardown:
            self.teardown.pop()()


class RoundTarget(Protocol):
    """What a collector that runs rounds on threads touches of the run
    (``rlaxkit.runtime.loop.Loop`` is one): its config and lock, the buffer and the
    parts, the trainer's version, and the loop's issue, admit and drop check."""

    config: RunConfig
    lock: threading.RLock
    buffer: RolloutBuffer
    parts: Parts

    @property
    def version(self) -> int: ...

    def issue(self, rooms: dict[str, int], published: int | None) -> dict[str, list[Work]]: ...

    def admit(self, rollouts: list[Rollout]) -> None: ...

    def check_drops(self, dropped_before: int) -> None: ...


class FaultTarget(Protocol):
    """What a fault touches of the run (``rlaxkit.runtime.loop.Loop`` is one): the
    books, the trace and its clocks, the fleet and the trainer client, the placement's
    store and scorer, and the loop's three bookings of a loss."""

    books: RunBooks
    trace: RunTrace
    fleet: Fleet
    trainer: TrainerClient
    parts: Parts

    @property
    def version(self) -> int: ...

    def clock(self) -> float: ...

    def fault_now(self) -> float: ...

    def lose_worker(self, worker_id: str, lost: list[Issue], **fields: object) -> None: ...

    def roll_back(self, step: int) -> None: ...

    def note_published(self, version: int | None) -> None: ...
