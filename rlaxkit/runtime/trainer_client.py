"""The driver's client of the trainer, in this process or on Ray."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from rlaxkit.api import TrainResult
from rlaxkit.param_server.base import tree_nbytes
from rlaxkit.rules.books import RunBooks
from rlaxkit.runtime.common import RunTrace
from rlaxkit.runtime.hosts import TrainerRestartedError
from rlaxkit.trainer.host import TrainerHost

_RECOVERY_WAIT_S = 120.0  # How long a restarting actor may take to answer again.
logger = logging.getLogger(__name__)

T = TypeVar("T")


def beside(
    main: Callable[[], T], side: Callable[[threading.Event], None], stop: threading.Event
) -> T:
    """``main()`` on this thread while ``side(stop)`` runs on a helper thread; returns
    ``main``'s result once both are done. If ``main`` raises, ``stop`` is set (``side``
    returns early) and the error is raised after the helper is joined; an error of
    ``side`` is raised after ``main`` has returned."""
    errors: list[BaseException] = []

    def run_side() -> None:
        try:
            side(stop)
        except BaseException as error:  # raised on the calling thread
            errors.append(error)

    helper = threading.Thread(target=run_side, name="rounds-ahead", daemon=True)
    helper.start()
    try:
        result = main()
    except BaseException:
        stop.set()
        raise
    finally:
        helper.join()
    if errors:
        raise errors[0]
    return result


class InProcessTrainer:
    """A ``TrainerHost`` in this process, called like Ray's ``TrainerGroup``."""

    size = 1

    def __init__(self, host: TrainerHost):
        self.leader = host

    def call(self, method: str, *args: object) -> Any:
        return getattr(self.leader, method)(*args)

    def preempt(self) -> None:
        """Nothing dies in this process: the state is void until the restore."""

    restart = preempt

    def stop(self, timeout_s: float = 0.0) -> None:
        self.leader.close()


class HealingTrainerClient:
    """The driver's client of the trainer host(s) (``rlaxkit.api.TrainerClient``).

    A trainer that dies on its own (Ray restarts one actor; the client restarts a
    group) is healed without changing the run: it restores its newest checkpoint at or
    below the driver's step and the batches trained since (kept until a checkpoint
    covers them) are replayed, so the state is the one lost and no trained group is
    undone; the first run of each replayed step becomes lost compute. A trainer in
    this process does not die on its own.

    Args:
        group: the trainer host in this process (``InProcessTrainer``) or Ray's
            ``TrainerGroup``.
        trace: the run trace (the trainer's events are written to it).
        books: the run's books (a replayed step is booked as lost compute).
        clock: the run's clock.
        max_restarts: heals in a row before the client gives up.
        died: the errors that mean the trainer died (Ray's ``RayActorError``).
        replay_limit_mb: megabytes of batches kept for a heal
            (``RuntimeConfig.trainer_replay_mb``); past it the oldest are let go.
            ``None``: no bound.
    """

    def __init__(
        self,
        group: Any,
        trace: RunTrace,
        books: RunBooks,
        clock: Callable[[], float],
        max_restarts: int = 0,
        died: tuple[type[BaseException], ...] = (),
        replay_limit_mb: float | None = None,
    ):
        self.group, self.max_restarts = group, max_restarts
        self.heals = bool(died)  # a trainer in this process does not die on its own
        self.died: tuple[type[BaseException], ...] = (*died, TrainerRestartedError)
        self.trace, self.books, self.clock = trace, books, clock
        self.replay: list[tuple[int, object]] = []  # (step, batch) since the last checkpoint
        self.replay_limit_mb = replay_limit_mb
        self._kept_bytes = 0  # of the batches in ``replay``
        self.let_go_through = 0  # the newest step whose batch was let go at the bound
        self.saved: set[int] = set()
        self.killed = False

    def _call_restarting(self, method: str, *args: object) -> Any:
        """Calls the trainer once, waiting while Ray restarts it (a group of trainer
        processes was restarted already)."""
        if self.group.size > 1:
            return self.group.call(method, *args)
        deadline = time.perf_counter() + _RECOVERY_WAIT_S
        while True:
            try:
                return self.group.call(method, *args)
            except self.died as error:
                if time.perf_counter() > deadline or "max_restarts" in str(error):
                    raise RuntimeError(
                        f"the trainer actor is gone ({type(error).__name__}); it may have "
                        "used up RayConfig.trainer_max_restarts: see its log"
                    ) from error
                time.sleep(0.2)

    def call(self, method: str, *args: object) -> Any:
        """Calls the trainer; if it died or came back with a fresh state, heals it
        (:meth:`_recover`) and calls again."""
        for _ in range(self.max_restarts + 1):
            try:
                return self.group.call(method, *args)
            except self.died:
                self._recover()
        raise RuntimeError(
            f"the trainer failed {self.max_restarts + 1} times in a row "
            f"at step {self.books.version}; see its log"
        )

    def _recover(self) -> None:
        """Restores the restarted trainer and replays the batches since its checkpoint,
        so its state is the one it lost; then it publishes again."""
        version = self.books.version
        self.books.preemptions["trainer"] += 1  # no plan killed it: it died
        self.trace.record(self.clock(), "preemption", "trainer", version)
        self.group.restart()  # A group starts anew; one trainer Ray restarts.
        restored = self._call_restarting("restore", version)
        if restored < self.let_go_through:
            kept = len(self.replay)
            raise RuntimeError(
                f"the trainer died at step {version} and restored step {restored}, but the "
                f"batches of steps {restored + 1}..{self.let_go_through} were let go: "
                f"runtime.trainer_replay_mb={self.replay_limit_mb} held {kept} steps of "
                f"this run. Save checkpoints within that (checkpoint.every_steps <= "
                f"{max(1, kept)}) or raise runtime.trainer_replay_mb"
            )
        replay = [(s, b) for s, b in self.replay if restored < s <= version]
        if [s for s, _ in replay] != list(range(restored + 1, version + 1)):
            raise RuntimeError(
                f"the trainer restored step {restored} but the driver holds the batches of "
                f"steps {[s for s, _ in self.replay]}, not all of {restored + 1}..{version}"
            )
        for step, batch in replay:
            result = self._call_restarting("train", batch, step, False)
            self.trace.extend(result.events)
            self.books.redo_step(step, result.duration_s)
        reply = self._call_restarting("publish", version, True)
        self.trace.extend(reply.events)
        self.trace.record(
            self.clock(), "restart", "trainer", version, lost_steps=version - restored
        )

    # -- the client ------------------------------------------------------------------
    def train(
        self,
        batch: object,
        step: int,
        push: bool,
        during: Callable[[threading.Event], None] | None = None,
    ) -> TrainResult:
        if self.heals:
            self._keep(step, batch)  # until a checkpoint covers it
        if during is None:
            result = self.call("train", batch, step, push)
        else:
            result = self._train_during(batch, step, push, during)
        self.trace.extend(result.events)  # after ``during``'s events, in every run
        return result

    def _train_during(
        self, batch: object, step: int, push: bool, during: Callable[[threading.Event], None]
    ) -> TrainResult:
        """The step with ``during`` beside it. A trainer in this process steps on this
        thread (XLA:CPU's buffers stay in the main heap, ``rlaxkit.util.hostmem``) and
        ``during`` runs on a helper thread; a Ray trainer steps in its own process(es)
        while ``during`` runs here. Either way ``during`` has returned, and the step
        too, before this returns or raises."""
        stop = threading.Event()
        start = getattr(self.group, "start", None)
        if start is None:
            return beside(lambda: self.call("train", batch, step, push), during, stop)
        wait: Callable[[], TrainResult] | None = None
        with contextlib.suppress(*self.died):  # a dead trainer is healed after ``during``
            wait = start("train", batch, step, push)
        result: TrainResult | None = None
        try:
            during(stop)
        finally:
            if wait is not None:  # a failure in ``during`` waits for the step, too
                with contextlib.suppress(*self.died):
                    result = wait()
        if result is None:  # the trainer died: heal it and take the step again
            self._recover()
            return self.call("train", batch, step, push)
        return result

    def _keep(self, step: int, batch: object) -> None:
        """Keeps ``batch`` for a heal; past ``replay_limit_mb`` lets the oldest go (the
        newest batch is always kept)."""
        self.replay.append((step, batch))
        self._kept_bytes += tree_nbytes(batch)
        if self.replay_limit_mb is None:
            return
        limit = self.replay_limit_mb * 1e6
        while len(self.replay) > 1 and self._kept_bytes > limit:
            gone, oldest = self.replay.pop(0)
            self._kept_bytes -= tree_nbytes(oldest)
            if self.let_go_through == 0:
                logger.warning(
                    "the trainer's batches reached runtime.trainer_replay_mb=%s at step %d "
                    "with no checkpoint since step %d: a trainer process that dies now "
                    "stops the run. Set checkpoint.every_steps to heal it instead",
                    self.replay_limit_mb,
                    step,
                    gone - 1,
                )
            self.let_go_through = gone

    def _forget(self, keep: Callable[[int], bool]) -> None:
        """Forgets the kept batches of the steps ``keep`` refuses."""
        self.replay = [(s, b) for s, b in self.replay if keep(s)]
        self._kept_bytes = sum(tree_nbytes(b) for _, b in self.replay)

    def publish(self, step: int, reset: bool = False) -> int | None:
        reply = self.call("publish", step, reset)
        self.trace.extend(reply.events)
        return reply.version

    def host_params(self, step: int) -> object:
        return self.call("host_params", step)

    def kill(self) -> None:
        """A real preemption: the trainer's state is void (an actor is killed: Ray
        restarts one trainer; :meth:`restore` starts a group anew)."""
        self.killed = True
        self.group.preempt()

    def saved_steps(self) -> set[int]:
        return self.saved

    def save(
        self,
        step: int,
        json: Mapping[str, object],
        weights: Mapping[str, object] | None,
        wait: bool = True,
    ) -> bool:
        reply = self.call("save_checkpoint", step, json, weights, wait)
        self.trace.extend(reply.events)
        self._forget(lambda s: s > step)
        self.let_go_through = 0  # a death restores this checkpoint or a newer one
        self.saved.add(step)
        return reply.saved

    def restore(self, max_step: int, published: tuple[int, object] | None = None) -> int:
        if self.killed:
            self.killed = False
            self.group.restart()  # a group starts anew; one trainer Ray restarts
        step = self._call_restarting("restore", max_step, published)
        self._forget(lambda s: s <= step)
        self.let_go_through = 0  # a death restores this step's checkpoint or a newer one
        self.saved.add(step)
        return step

    def close(self) -> None:
        self.group.stop(timeout_s=60.0)
