"""What runs after a trainer step: hooks, each due every ``every`` steps.

``Loop.step`` reads collect → collate → train → faults → push → hooks. The run's own
hooks (``own_hooks``) book the step's metrics, trace it, log it, scale an elastic fleet
and checkpoint it, in that order (``Experiment`` adds Python's collector freeze after
them); a caller's hooks (``Loop.add_hook``, e.g. the evaluation of ``rlaxkit train``'s
``eval.every_steps``) run after those. A hook sees the step as a ``StepDone`` and the
run through ``StepTarget``; the metrics hook fills ``metrics``, which ``step`` returns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from rlaxkit.api import Fleet, TrainResult
from rlaxkit.config.run import RunConfig
from rlaxkit.data.batch import TrainBatch
from rlaxkit.data.buffer import RolloutBuffer
from rlaxkit.data.rollout import Rollout, RolloutGroup
from rlaxkit.observe.tracking import Trackers
from rlaxkit.rules.audit import AuditBook
from rlaxkit.rules.books import RunBooks
from rlaxkit.rules.validation import is_int
from rlaxkit.runtime.common import RunTrace, batch_metrics
from rlaxkit.runtime.parts import Parts


@dataclass
class StepDone:
    """One trainer step, as the hooks after it see it.

    Attributes:
        step: the weight version the step made (``Loop.version`` once kept).
        groups, samples, batch: what it trained on (rollout groups, their samples, the
            collated batch).
        result: the trainer's reply (its metrics and compute seconds).
        times: the loop's clock (``Loop.clock``) at the step's start, when the batch was
            collected, when the train call was made and when it returned.
        ahead: rounds run beside the step (``runtime.overlap_training``), else ``None``.
        trainer_up: whether the trainer is up after the step's faults.
        metrics: the step's metrics, filled by the metrics hook.
    """

    step: int
    groups: list[RolloutGroup]
    samples: list[Rollout]
    batch: TrainBatch
    result: TrainResult
    times: tuple[float, float, float, float]
    ahead: int | None
    trainer_up: bool
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def staleness(self) -> list[int]:
        """Each trained group's staleness: ``step - 1 - first_version``."""
        return [self.step - 1 - g.first_version for g in self.groups]


@dataclass(frozen=True)
class Hook:
    """``call(done)`` after every ``every``-th step (0: never); ``name`` says what it is."""

    name: str
    call: Callable[[StepDone], object]
    every: int = 1

    def __post_init__(self) -> None:
        if not is_int(self.every) or self.every < 0:
            raise ValueError(f"hook {self.name!r}: every must be an int >= 0, got {self.every!r}")
        if not callable(self.call):
            raise TypeError(f"hook {self.name!r}: call must be callable, got {self.call!r}")

    def due(self, step: int) -> bool:
        """Whether the hook runs after the step that made version ``step``."""
        return self.every > 0 and step % self.every == 0


class StepTarget(Protocol):
    """What the run's own hooks touch of the run (``rlaxkit.runtime.loop.Loop`` is one):
    its config, lock, books, audit, buffer, fleet, parts, trace and trackers, its
    clocks, and the loop's checkpoint, fleet scaling and reward-failure count."""

    config: RunConfig
    lock: threading.RLock
    books: RunBooks
    audit: AuditBook
    buffer: RolloutBuffer
    fleet: Fleet
    parts: Parts
    trace: RunTrace
    logger: Trackers
    last_batch: dict[str, object] | None

    def clock(self) -> float: ...

    def fault_now(self) -> float: ...

    def save_checkpoint(self, wait: bool = True) -> bool: ...

    def scale_workers(self, n: int) -> object: ...

    def reward_failures(self) -> dict[str, int]: ...


def own_hooks(run: StepTarget) -> list[Hook]:
    """The hooks every run has, in order: metrics, trace, log, elastic fleet, checkpoint."""
    return [
        Hook("metrics", lambda done: book_metrics(run, done)),
        Hook("trace", lambda done: trace_step(run, done)),
        Hook(
            "log",
            lambda done: run.logger.log(done.metrics, histograms={"staleness": done.staleness}),
        ),
        Hook("elastic_fleet", lambda done: scale_on_schedule(run, done)),
        Hook("checkpoint", lambda done: checkpoint_if_due(run, done)),
    ]


def book_metrics(run: StepTarget, done: StepDone) -> None:
    """The step's metrics (``done.metrics``), into the books' history and ``last_batch``."""
    t_start, t_gen, _, t_train = done.times
    groups, samples, buffer = done.groups, done.samples, run.buffer
    with run.lock:
        done.metrics = {
            **batch_metrics(done.step, groups, samples, buffer.counts(), done.result.metrics),
            "time/generate_s": t_gen - t_start,
            "time/train_s": t_train - t_gen,
            **run.books.window.close(t_train, run.fleet.generated_tokens()),
            **run.books.counters(),
            **{f"reward_failures/{k}": n for k, n in run.reward_failures().items()},
            **({"rounds/ahead": done.ahead} if done.ahead is not None else {}),
            **run.audit.take_step([g.group_id for g in groups], buffer.dropped),
        }
    run.last_batch = {"groups": groups, "batch": done.batch, "metrics": done.metrics}
    run.books.history.append(done.metrics)


def trace_step(run: StepTarget, done: StepDone) -> None:
    """The step's ``train_step`` trace event."""
    now, duration_s = run.clock(), done.result.duration_s
    after = {}
    if done.ahead is not None:
        # Beside rounds the event comes after them, the push and the books: how long
        # after the compute's end (``rlaxkit.rules.trace.step_span``).
        after = {"after_s": max(0.0, now - done.times[2] - duration_s)}
    run.trace.record(
        now,
        "train_step",
        "trainer",
        done.step,
        step=done.step,
        samples=len(done.samples),
        # tokens: every real token the step processed (prompt + completion), as the
        # simulator counts them; completion_tokens: the ones trained on.
        tokens=int(np.asarray(done.batch.attention_mask).sum()),
        completion_tokens=int(np.asarray(done.batch.loss_mask).sum()),
        duration_s=duration_s,
        staleness=done.staleness,
        **after,
    )


def log_step(run: StepTarget, done: StepDone) -> None:
    """The step's metrics, and its staleness as a histogram, to the trackers."""
    run.logger.log(done.metrics, histograms={"staleness": done.staleness})


def scale_on_schedule(run: StepTarget, done: StepDone) -> None:
    """``ray.worker_schedule``: an elastic fleet grows or shrinks after the step."""
    if run.parts.schedule and (workers := run.parts.schedule(done.step)) is not None:
        run.scale_workers(workers)


def checkpoint_if_due(run: StepTarget, done: StepDone) -> None:
    """Saves a checkpoint when the ``CheckpointPolicy`` says so and the trainer is up."""
    books = run.books
    if done.trainer_up and run.config.checkpoint.should_save(
        done.step, run.fault_now(), books.last_save_step, books.last_save_s
    ):
        run.save_checkpoint(wait=False)
        run.logger.commit(books.last_save_step)  # W&B and MLflow get the steps
