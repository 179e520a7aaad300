"""The local backend's concurrent mode: one thread per inference worker.

The driver (``rlaxkit.runtime.driver.Experiment``) with ``runtime.mode="concurrent"``
hands its batch collection to the local placement's ``ConcurrentCollector``. Each
inference worker gets a thread that loops: pull weights when the ``StalenessPolicy``
says the worker lags too far (per the ``WeightSyncPolicy``: between requests or in
flight), take prompts while admission has room, decode one chunk, hand finished
rollouts to the buffer. The trainer stays in the
caller's thread: ``Experiment.step()`` waits on a condition until the buffer yields a
batch, trains and pushes, while the workers go on decoding.

Locking. The experiment's one lock (``Experiment.lock``, a re-entrant lock under the
collector's condition) guards all shared state: the buffer, the controller and prompt
issuing, the trace, the sample counters and the metrics read from them. Decoding, weight
pulls (with their KV-cache recompute) and training run outside it, so JAX releases the
GIL and workers overlap each other and the trainer. Each worker's engine is touched by
its own thread only. Scoring goes through a lock of its own (a reward pool is not
thread-safe; inline scoring is cheap).

Guarantees. Admission is the deterministic loop's (``Experiment.issue``, AReaL's
``accepted + running < (η + published + 1) · batch``), and ``RolloutBuffer.take_batch``
drops every group older than η under the lock with the trainer's current version, so no
trained rollout is older than η versions, and the accounting invariant holds whenever
the lock is free. What is not guaranteed: metrics differ from run to run (thread timing
decides which worker takes which prompt and with which weights).

Not supported: fault plans and RL-state checkpoints with exact resume; they rely on the
deterministic interleaving (a worker's replay log, the logical fault clock). The run
rejects them up front (``check_supported``; ``rlaxkit.runtime.faults``).

Waiting without polling. A worker with nothing to decode and no admission room marks
itself idle and waits until something that can change its answer happens (a push, a
dropped group, new rollouts, a stop): ``wake()`` clears every idle flag and notifies. The
trainer waits for rollouts; when every worker is idle, has seen the latest change and
still no batch is ready, nothing can ever change, and ``collect`` raises instead of
hanging. A worker whose episodes all wait for tool steps holds prompts, so it is busy,
never idle: its ``step`` waits a few tens of milliseconds for a step to end
(``rlaxkit.worker.multi_turn``, free-running) and comes back to pull and take prompts,
neither spinning nor counting toward a stall. An exception in a worker thread stops
all threads and is raised by ``collect`` (so by ``Experiment.step()``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from rlaxkit.data.rollout import RolloutGroup
from rlaxkit.rules.stalls import stall_error

if TYPE_CHECKING:
    from rlaxkit.config.run import RunConfig
    from rlaxkit.runtime.parts import RoundTarget
    from rlaxkit.tasks import RewardRunner
    from rlaxkit.worker.worker import InferenceWorker

__all__ = ["ConcurrentCollector", "check_supported"]


def check_supported(config: RunConfig) -> None:
    """Rejects the checkpoint settings concurrent mode cannot honour, naming the fix.

    Raises:
        ValueError: ``checkpoint.every_steps`` / ``checkpoint.every_s`` set in
            concurrent mode.
    """
    for name in ("every_steps", "every_s"):
        if config.runtime.mode == "concurrent" and getattr(config.checkpoint, name) is not None:
            raise ValueError(
                f"checkpoint.{name}: RL-state checkpoints with exact resume need the "
                "deterministic interleaving; runtime.mode=concurrent does not write them "
                f"(use runtime.mode=deterministic, or unset checkpoint.{name})"
            )


class _LockedScorer:
    """A ``RewardRunner`` shared by worker threads: one ``score`` call at a time."""

    def __init__(self, scorer: Any):
        self._scorer = scorer
        self._lock = threading.Lock()

    def score(self, problems, completions):
        with self._lock:
            return self._scorer.score(problems, completions)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scorer, name)


class _Thread:
    """One worker's thread and the flags the collector reads under the lock."""

    def __init__(self, worker: InferenceWorker, target: Callable[[_Thread], None]):
        self.worker = worker
        self.idle = False  # waiting for a change; cleared by ``wake``
        self.thread = threading.Thread(
            target=target, args=(self,), name=f"rlaxkit-{worker.worker_id}", daemon=True
        )


class ConcurrentCollector:
    """Runs a fleet's workers in threads and collects batches for the trainer.

    Threads start on the first ``collect`` and stop on ``close`` (or when one fails).

    Args:
        workers: the fleet's in-process workers.
        scorer: the reward runner they share (locked: one ``score`` call at a time).
    """

    def __init__(self, workers: list[InferenceWorker], scorer: Any):
        self.exp: RoundTarget | None = None
        self.cond: threading.Condition | None = None
        self.error: BaseException | None = None
        self.failed_worker: str | None = None
        self._stopping = False
        locked = _LockedScorer(scorer)
        for worker in workers:
            worker.scorer = cast("RewardRunner", locked)  # the same score() interface
        self.threads = [_Thread(w, self._loop) for w in workers]
        self._started = False

    # -- the trainer's side ------------------------------------------------------------
    def collect(self, exp: RoundTarget) -> list[RolloutGroup]:
        """Waits until the buffer yields a batch for the trainer's current version.

        Raises:
            RuntimeError: a worker thread failed (chained to its exception), the
                collector was closed, the loop can never yield a batch, or too many
                groups in a row were dropped.
        """
        if self.cond is None:
            self.exp, self.cond = exp, threading.Condition(exp.lock)
        with self.cond:
            dropped_before = len(exp.buffer.dropped)
            self._start()
            while True:
                self._raise_if_failed()
                dropped = len(exp.buffer.dropped)
                batch = exp.buffer.take_batch(exp.version)
                if len(exp.buffer.dropped) != dropped:  # stale groups freed admission room
                    self.wake()
                if batch is not None:
                    return batch
                exp.check_drops(dropped_before)
                if all(t.idle for t in self.threads):
                    raise stall_error(exp.buffer.counts())
                self.cond.wait()

    def wake(self) -> None:
        """Something workers wait for changed (a push, a drop, new rollouts, a stop):
        every idle worker re-evaluates. Call with or without the lock held."""
        if self.cond is None:
            return
        with self.cond:
            for t in self.threads:
                t.idle = False
            self.cond.notify_all()

    def close(self, timeout_s: float = 120.0) -> None:
        """Stops the worker threads after their current chunk and joins them
        (idempotent). In-flight prompts stay in flight in the books.

        Raises:
            RuntimeError: a thread did not stop within ``timeout_s``.
        """
        self._stopping = True
        self.wake()
        for t in self.threads:
            if t.thread.is_alive():
                t.thread.join(timeout_s)
        alive = [t.thread.name for t in self.threads if t.thread.is_alive()]
        if alive:
            raise RuntimeError(f"worker threads {alive} did not stop within {timeout_s} s")

    def _start(self) -> None:
        if self._started:
            return
        if self._stopping:
            raise RuntimeError("the experiment was closed; build a new Experiment to go on")
        self._started = True
        for t in self.threads:
            t.thread.start()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(
                f"{self.failed_worker} failed in its thread: {self.error!r}"
            ) from self.error
        if self._stopping:
            raise RuntimeError("the experiment was closed; build a new Experiment to go on")

    # -- the workers' side -------------------------------------------------------------
    def _loop(self, me: _Thread) -> None:
        assert self.cond is not None
        try:
            while self._turn(me):
                pass
        except BaseException as error:  # surfaced by ``collect`` in the trainer's thread
            with self.cond:
                if self.error is None:
                    self.error, self.failed_worker = error, me.worker.worker_id
                self._stopping = True
            self.wake()

    def _turn(self, me: _Thread) -> bool:
        """One iteration of a worker thread; False when the thread should end."""
        exp, cond, worker = self.exp, self.cond, me.worker
        assert exp is not None and cond is not None
        worker.sync_weights()  # outside the lock: a pull may recompute KV caches
        with cond:
            if self._stopping:
                return False
            latest = exp.parts.store.latest_version()  # None: nothing published yet
            if latest is not None and not exp.config.staleness.must_pull(worker.version, latest):
                work = exp.issue({worker.worker_id: worker.free}, latest)
                for issue, problem in work[worker.worker_id]:
                    worker.submit(issue, problem)
            elif not worker.requests:
                return True  # a push landed since the pull: pull again before taking prompts
            if not worker.requests:
                me.idle = True
                cond.notify_all()  # the trainer checks whether everyone is idle
                while me.idle and not self._stopping:
                    cond.wait()
                return not self._stopping
        rollouts = worker.step()  # outside the lock: decode and score
        if not rollouts:
            return True
        with cond:  # booked even when stopping: the samples are done
            exp.admit(rollouts)
            self.wake()
            return not self._stopping
