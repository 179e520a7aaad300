"""Scores batches of completions, surviving rewards that raise, hang, crash or misbehave.

Two execution modes, chosen per task (``Task.reward_execution``) unless forced:

* ``"inline"``: the reward is called in this process. For cheap, pure, bounded rewards
  (arithmetic, countdown) the pipe round trip and pickling dominate: in-process scoring
  of arithmetic is about 20x faster than a two-worker pool (``benchmarks/rewards.py``)
  and needs no worker start-up. Exceptions and garbage are still caught, and the
  per-item timeout holds: on the main thread a timer signal interrupts the reward; on
  another thread the items run in a helper thread and one that overruns is abandoned
  (its thread stays busy until the reward returns; ``abandoned_reward_threads``).
  Rewards that may hang belong in the pool, where an overrun kills the process.
* ``"pool"``: the reward runs in worker processes (started with ``spawn``, never
  ``fork``: the parent may hold JAX threads). Each item has a timeout; a worker that
  overruns it, or dies, is SIGKILLed and replaced, and the batch goes on.

Every failure gives reward 0 with a reason code (``REWARD_ERROR``, ``REWARD_TIMEOUT``,
``REWARD_CRASHED``, ``INVALID_REWARD``) and is counted in ``RewardRunner.counters``.
The runner is not thread-safe: call it from one thread.

Fault injection (``inject_hang``): the next items hang. In the pool the worker really
blocks and the per-item timeout kills it; inline there is no timeout to wait for, so an
injected hang resolves at once as the timeout would (reward 0, ``REWARD_TIMEOUT``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing
import multiprocessing.connection
import numbers
import pickle
import queue
import signal
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Sequence, Set
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any, Literal

from rlaxkit.rules.validation import check_int
from rlaxkit.tasks.base import (
    INVALID_REWARD,
    REWARD_CRASHED,
    REWARD_ERROR,
    REWARD_TIMEOUT,
    Problem,
    RewardExecution,
    RewardResult,
    Task,
    check_choice,
)

logger = logging.getLogger(__name__)

RunnerMode = Literal["auto", "inline", "pool"]
StartMethod = Literal["spawn", "forkserver"]
RewardFn = Callable[[Problem, str], Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardRunnerConfig:
    """How rewards are executed.

    Attributes:
      mode: ``"auto"`` follows the task's ``reward_execution``; or force one mode.
      num_workers: pool size.
      timeout_s: per-item limit, in either mode (a code problem runs all its tests in it).
      startup_timeout_s: limit for a worker to start and warm up.
      start_method: ``"spawn"`` or ``"forkserver"`` (never ``"fork"``).
    """

    mode: RunnerMode = "auto"
    num_workers: int = 2
    timeout_s: float = 30.0
    startup_timeout_s: float = 120.0
    start_method: StartMethod = "spawn"

    def __post_init__(self):
        check_choice("mode", self.mode, RunnerMode)
        check_choice("start_method", self.start_method, StartMethod)
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.timeout_s <= 0 or self.startup_timeout_s <= 0:
            raise ValueError("timeout_s and startup_timeout_s must be > 0")


def validate_reward(value: object) -> RewardResult:
    """``value`` as a ``RewardResult`` with a finite score in [0, 1], else reward 0 with
    reason ``INVALID_REWARD``. Plain real numbers are accepted as scores."""
    if type(value) is RewardResult and type(value.score) is float and 0.0 <= value.score <= 1.0:
        return value  # the common case, already valid (NaN fails the range test)
    score: object  # user code may put anything in a RewardResult
    if isinstance(value, RewardResult):
        score, result = value.score, value
    elif isinstance(value, numbers.Real):
        score, result = value, RewardResult(0.0)
    else:
        return RewardResult(0.0, None, INVALID_REWARD, f"reward returned {type(value).__name__}")
    if not isinstance(score, numbers.Real):
        return RewardResult(0.0, None, INVALID_REWARD, f"score is {type(score).__name__}")
    score = float(score)
    if not (math.isfinite(score) and 0.0 <= score <= 1.0):
        return RewardResult(0.0, None, INVALID_REWARD, f"score {score!r} is not in [0, 1]")
    return dataclasses.replace(result, score=score)


class RewardRunner:
    """Scores ``(problem, completion)`` pairs with a reward function, inline or in a pool.

    >>> from rlaxkit.tasks import make_task
    >>> task = make_task("arithmetic")
    >>> problem = task.problems("test", 1)[0]
    >>> with RewardRunner.for_task(task) as runner:
    ...     [r.score for r in runner.score([problem], [task.demonstration(problem)])]
    [1.0]
    """

    def __init__(
        self,
        reward_fn: RewardFn,
        config: RewardRunnerConfig | None = None,
        *,
        execution: RewardExecution = "pool",
        warmup: Callable[[], object] | None = None,
    ):
        """Args:
        reward_fn: ``(problem, completion) -> RewardResult``; picklable for the pool (a
          module-level function or a task's bound ``score``).
        config: runner settings.
        execution: the mode ``config.mode="auto"`` resolves to.
        warmup: called once in each new worker before it takes items (slow imports).
        """
        self.config = config or RewardRunnerConfig()
        self.reward_fn = reward_fn
        self.warmup = warmup
        self.mode: RewardExecution = execution if self.config.mode == "auto" else self.config.mode
        self.counters: Counter[str] = Counter()
        self.hangs_pending = 0
        self._helper: _HelperThread | None = None  # inline scoring off the main thread
        self._workers: list[_Worker] = []
        self._context: SpawnContext | ForkServerContext
        if self.config.start_method == "spawn":
            self._context = multiprocessing.get_context("spawn")
        else:
            self._context = multiprocessing.get_context("forkserver")
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)

    @classmethod
    def for_task(
        cls, task: Task, config: RunnerMode | RewardRunnerConfig | None = None
    ) -> RewardRunner:
        """A runner for ``task.score`` in the task's preferred mode."""
        if isinstance(config, str):
            config = RewardRunnerConfig(mode=config)
        return cls(
            task.score,
            config,
            execution=task.reward_execution,
            warmup=getattr(task, "warmup", None),  # optional: only some tasks warm up
        )

    def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[RewardResult]:
        """One validated ``RewardResult`` per pair, in order; never raises for a reward's fault."""
        if len(problems) != len(completions):
            raise ValueError(
                f"got {len(problems)} problems and {len(completions)} completions; "
                "repeat each problem once per completion"
            )
        hung = self._take_hangs(len(problems))
        if self.mode == "inline":
            results = self._score_inline_batch(problems, completions, hung)
        else:
            results = self._score_pool(problems, completions, hung)
        self.counters["scored"] += len(results)
        self.counters.update(r.reason for r in results if r.reason is not None)
        return results

    def inject_hang(self, count: int = 1) -> None:
        """Makes the next ``count`` scored items hang until the reward timeout (counted
        as ``injected_hang`` and ``REWARD_TIMEOUT``)."""
        self.hangs_pending += check_int("count", count, minimum=1)

    def _take_hangs(self, size: int) -> set[int]:
        hung = set(range(min(self.hangs_pending, size)))
        self.hangs_pending -= len(hung)
        self.counters["injected_hang"] += len(hung)
        return hung

    def start(self) -> RewardRunner:
        """Starts the pool workers now rather than on the first ``score`` call, and waits
        until they are ready (no-op inline). Returns ``self``."""
        if self.mode == "pool":
            self._score_pool([], [])
        return self

    def worker_pids(self) -> list[int]:
        """Process ids of the live pool workers."""
        return [
            w.process.pid
            for w in self._workers
            if w.process.is_alive() and w.process.pid is not None  # None: never started
        ]

    def close(self) -> None:
        """Stops the pool workers and the inline helper thread (idempotent)."""
        self._finalizer()
        if self._helper is not None:
            self._helper.stop()
            self._helper = None

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _score_inline_batch(
        self, problems: Sequence[Problem], completions: Sequence[str], hung: Set[int]
    ) -> list[RewardResult]:
        """Inline scoring with the per-item timeout enforced: on the main thread by a
        timer signal that interrupts the reward; elsewhere (worker threads) the items run
        in a helper thread, and one past its time is abandoned there (it keeps the thread
        until it returns) while the batch goes on."""
        items = list(zip(problems, completions, strict=True))
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
            previous = signal.signal(signal.SIGALRM, _raise_timed_out)
            try:
                return [
                    _INLINE_HANG if i in hung else self._score_inline(p, c, alarm=True)
                    for i, (p, c) in enumerate(items)
                ]
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
        results: list[RewardResult] = []
        while len(results) < len(items):
            if self._helper is None:
                self._helper = _HelperThread(self._score_inline)
            start, done = len(results), threading.Event()
            progress: list[RewardResult] = []
            rest = [(i in hung, p, c) for i, (p, c) in enumerate(items) if i >= start]
            self._helper.jobs.put((rest, progress, done))
            seen = -1
            while not done.wait(self.config.timeout_s) and len(progress) != seen:
                seen = len(progress)  # an item finished within timeout_s: wait on
            results += list(progress)  # a snapshot: an item finishing late is not kept
            if len(results) < len(items):  # the current item is stuck: leave it there
                self._helper.abandoned = True
                self._helper = None
                self.counters["abandoned_reward_threads"] += 1
                results.append(_timed_out(self.config.timeout_s))
        return results

    def _score_inline(self, problem: Problem, completion: str, alarm: bool = False) -> RewardResult:
        try:
            if alarm:
                signal.setitimer(signal.ITIMER_REAL, self.config.timeout_s)
            try:
                value = self.reward_fn(problem, completion)
            finally:
                if alarm:
                    signal.setitimer(signal.ITIMER_REAL, 0)
        except _RewardTimedOut:
            return _timed_out(self.config.timeout_s)
        except Exception as error:
            logger.warning("reward raised on problem %s: %r", problem.id, error)
            return RewardResult(0.0, None, REWARD_ERROR, _describe(error))
        return validate_reward(value)

    def _score_pool(
        self, problems: Sequence[Problem], completions: Sequence[str], hung: Set[int] = frozenset()
    ) -> list[RewardResult]:
        for index, worker in enumerate(self._workers):
            if worker.item is not None:  # left busy by an interrupted call: its answer is stale
                self._replace(index)
        while len(self._workers) < self.config.num_workers:
            self._workers.append(self._start_worker())
        results: list[RewardResult | None] = [None] * len(problems)
        queue = deque(range(len(problems)))
        while (
            queue
            or any(w.item is not None for w in self._workers)
            or (not problems and not all(w.ready for w in self._workers))
        ):
            for worker in self._workers:
                while worker.ready and worker.item is None and queue:
                    item = queue.popleft()
                    try:
                        worker.conn.send((item, problems[item], completions[item], item in hung))
                    except Exception as error:  # unpicklable input: the pipe is untouched
                        results[item] = RewardResult(0.0, None, REWARD_ERROR, _describe(error))
                        continue
                    worker.item, worker.since = item, time.monotonic()
            waitables = [w.conn for w in self._workers] + [w.sentinel for w in self._workers]
            multiprocessing.connection.wait(waitables, timeout=self._next_deadline())
            for index, worker in enumerate(self._workers):
                if not self._receive(worker, results):
                    self._replace(index)
            now = time.monotonic()
            for index, worker in enumerate(self._workers):
                if worker.item is not None and now - worker.since > self.config.timeout_s:
                    logger.warning(
                        "reward timed out after %.1f s; killing worker", now - worker.since
                    )
                    results[worker.item] = RewardResult(
                        0.0, None, REWARD_TIMEOUT, f"no result within {self.config.timeout_s} s"
                    )
                    self._replace(index)
                elif not worker.ready and now - worker.since > self.config.startup_timeout_s:
                    raise RuntimeError(
                        f"a reward worker did not start within {self.config.startup_timeout_s} s"
                    )
        return results  # type: ignore[return-value]

    def _receive(self, worker: _Worker, results: list[RewardResult | None]) -> bool:
        """Reads what ``worker`` sent; returns ``False`` when it has died."""
        try:
            while worker.conn.poll():
                message = worker.conn.recv()
                if message[0] == "ready":
                    worker.ready, worker.since = True, time.monotonic()
                    continue
                item, outcome, payload = message
                if outcome == "ok":
                    results[item] = validate_reward(payload)
                else:
                    results[item] = RewardResult(0.0, None, REWARD_ERROR, payload)
                worker.item = None
        except (EOFError, OSError):
            pass  # the worker is gone; handled below
        except Exception as error:  # a result that cannot be unpickled here
            if worker.item is not None:
                results[worker.item] = RewardResult(0.0, None, INVALID_REWARD, _describe(error))
                worker.item = None
        if worker.process.is_alive():
            return True
        if not worker.ready:
            raise RuntimeError(
                f"a reward worker exited with status {worker.process.exitcode} while starting"
            )
        if worker.item is not None:
            logger.warning("reward worker died (exit status %s)", worker.process.exitcode)
            results[worker.item] = RewardResult(
                0.0, None, REWARD_CRASHED, f"worker exit status {worker.process.exitcode}"
            )
        return False

    def _next_deadline(self) -> float:
        """Seconds until the earliest item or startup deadline (at least 1 ms)."""
        now, deadlines = time.monotonic(), []
        for worker in self._workers:
            if worker.item is not None:
                deadlines.append(worker.since + self.config.timeout_s)
            elif not worker.ready:
                deadlines.append(worker.since + self.config.startup_timeout_s)
        return max(min(deadlines, default=now + 1.0) - now, 0.001)

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._context.Pipe()
        process = self._context.Process(
            target=_worker_main,
            args=(child_conn, self.reward_fn, self.warmup),
            daemon=True,
            name="rlaxkit-reward-worker",
        )
        try:
            process.start()
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            raise TypeError(
                "pool mode needs a picklable reward function (a module-level function or a "
                f"task's bound score method): {_describe(error)}"
            ) from error
        finally:
            child_conn.close()
        return _Worker(process, parent_conn)

    def _replace(self, index: int) -> None:
        _stop(self._workers[index])
        self._workers[index] = self._start_worker()
        self.counters["workers_replaced"] += 1


class _Worker:
    """A pool process, its pipe, and the item it is working on since ``since``."""

    def __init__(self, process: BaseProcess, conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self.sentinel = process.sentinel
        self.ready = False
        self.item: int | None = None
        self.since = time.monotonic()


def _worker_main(
    conn: Connection, reward_fn: RewardFn, warmup: Callable[[], object] | None
) -> None:
    """Worker loop: receive ``(item, problem, completion)``, send ``(item, outcome, payload)``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if warmup is not None:
        warmup()
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        item, problem, completion, hang = message
        while hang:  # injected fault: block until the parent's timeout kills this process
            time.sleep(3600)
        try:
            outcome = ("ok", reward_fn(problem, completion))
        except BaseException as error:  # a reward calling sys.exit is still the reward's fault
            outcome = ("error", _describe(error))
        try:
            conn.send((item, *outcome))
        except Exception as error:  # an unpicklable result
            conn.send((item, "error", f"result could not be sent: {_describe(error)}"))


class _HelperThread:
    """A daemon thread that scores inline items for callers off the main thread, so a
    caller can stop waiting for one that overruns (and leave this thread with it)."""

    def __init__(self, score: Callable[[Problem, str], RewardResult]) -> None:
        self.score = score
        self.jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.abandoned = False
        self.thread = threading.Thread(target=self._loop, name="rlaxkit-inline-reward", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            items, out, done = job
            for hang, problem, completion in items:
                if self.abandoned:
                    return  # its caller went on without it
                out.append(_INLINE_HANG if hang else self.score(problem, completion))
            done.set()

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=5)


class _RewardTimedOut(BaseException):
    """Raised into an inline reward by the timer signal (a BaseException, so the reward's
    own ``except Exception`` cannot swallow it)."""


def _raise_timed_out(signum: int, frame: object) -> None:
    raise _RewardTimedOut


def _timed_out(timeout_s: float) -> RewardResult:
    return RewardResult(
        0.0, None, REWARD_TIMEOUT, f"the reward ran past timeout_s={timeout_s:g} in this process"
    )


_INLINE_HANG = RewardResult(
    0.0, None, REWARD_TIMEOUT, "injected hang (inline rewards resolve it at once as a timeout)"
)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:500]


def _stop(worker: _Worker) -> None:
    if worker.process.is_alive():
        worker.process.kill()
    worker.process.join(timeout=5)
    worker.conn.close()


def _shutdown(workers: list[_Worker]) -> None:
    for worker in workers:
        _stop(worker)
    workers.clear()
