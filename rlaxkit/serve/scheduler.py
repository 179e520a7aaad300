"""One thread that owns the ``InferenceEngine``: requests from every session in one batch.

HTTP handlers ``put`` turns (a context and a budget); the thread hands the engine as
many as it has free rows, steps it chunk by chunk (continuous batching: a finished row
takes the next turn while the others decode) and completes each turn's future. The
queue in front of the engine is bounded (``QueueFull``: the server answers 429). A turn
whose client went away (its future cancelled) is taken out of the queue if it is still
there, and out of its row at the next chunk boundary if it runs
(``InferenceEngine.cancel``): the row takes the next queued turn. A turn whose client
leaves during the chunk that finishes it is dropped too, counted as ``discarded``. New
weights from ``weight_source`` are taken between chunks, as the runtime's workers do.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import threading
from dataclasses import dataclass, field

from rlaxkit.inference import Completion, InferenceEngine
from rlaxkit.inference.engine import WeightSource

__all__ = ["EngineLoop", "QueueFull", "Turn"]


class QueueFull(Exception):
    """The queue in front of the engine holds its bound of turns."""


@dataclass
class Turn:
    """One sample to draw: ``context`` ids, at most ``budget`` new tokens, key ``seed``."""

    context: list[int]
    budget: int
    seed: int
    future: concurrent.futures.Future[Completion] = field(default_factory=concurrent.futures.Future)


class EngineLoop:
    """Runs ``engine`` on its own thread until ``close``.

    Args:
        engine: an idle engine with ``n == 1``; only this thread touches it after start.
        max_queued: turns that may wait for a row; more raise ``QueueFull``.
        weight_source: polled between chunks for ``(weights, version)``.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        *,
        max_queued: int,
        weight_source: WeightSource | None = None,
    ):
        if engine.config.n != 1:
            raise ValueError(
                f"the endpoint's engine samples n=1 per request, got {engine.config.n}"
            )
        self.engine, self.max_queued, self.weight_source = engine, max_queued, weight_source
        self.queue: collections.deque[Turn] = collections.deque()
        self.running: dict[int, Turn] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        self._ids = itertools.count()
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="endpoint-engine", daemon=True)
        self._thread.start()

    def put(self, turn: Turn) -> Turn:
        """Queues ``turn``; raises ``QueueFull`` at the bound. After ``close`` the turn
        comes back cancelled."""
        with self._wake:
            if self._stop:
                turn.future.cancel()
                return turn
            if len(self.queue) >= self.max_queued:
                self.counts["refused_queue_full"] += 1
                raise QueueFull(f"{len(self.queue)} requests are waiting (the bound)")
            self.queue.append(turn)
            self._wake.notify()
        return turn

    def _count(self, key: str) -> None:
        with self._wake:
            self.counts[key] += 1

    def snapshot(self) -> dict[str, int]:
        """The counts so far: ``completed``, ``cancelled_running`` (the client went
        away while its turn ran: its row freed at the next chunk boundary),
        ``discarded`` (it went away during the chunk that finished its turn),
        ``cancelled_in_queue``, ``refused_queue_full``, ``engine_errors``."""
        with self._wake:
            return dict(self.counts)

    @property
    def rows_in_use(self) -> int:
        """Turns in the engine's rows (or about to be)."""
        return len(self.running)

    def close(self) -> None:
        """Stops the thread; turns still queued or running are cancelled now, not when
        the thread gets round to it (it may be inside a chunk or a weight pull)."""
        with self._wake:
            self._stop = True
            for turn in [*self.queue, *list(self.running.values())]:
                turn.future.cancel()
            self._wake.notify()
        self._thread.join(timeout=30)

    def _admit(self) -> None:
        """Frees the rows of running turns whose client went away, then moves queued
        turns into free rows, dropping those whose client went away."""
        with self._wake:
            for request, turn in list(self.running.items()):
                if turn.future.cancelled():
                    self.engine.cancel(request)
                    del self.running[request]
                    self.counts["cancelled_running"] += 1
            while self.queue and len(self.running) < self.engine.num_slots:
                turn = self.queue.popleft()
                if turn.future.cancelled():
                    self.counts["cancelled_in_queue"] += 1
                    continue
                request = next(self._ids)
                try:  # one sample of its own request: the engine checks the turn's budget
                    self.engine.submit(
                        turn.context,
                        turn.seed,
                        max_new_tokens=turn.budget,
                        request_id=request,
                        sample_index=0,
                    )
                except ValueError as error:  # checked before; a last guard, not a crash
                    with contextlib.suppress(concurrent.futures.InvalidStateError):
                        turn.future.set_exception(error)
                    continue
                self.running[request] = turn

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self.queue and not self.running:
                    self._wake.wait(timeout=0.5)
                if self._stop:
                    break
            try:
                if self.weight_source is not None and (new := self.weight_source()) is not None:
                    self.engine.update_weights(*new)
                self._admit()
                for completion in self.engine.step():
                    turn = self.running.pop(completion.request_id)
                    # Counted under the lock with the answer, so a snapshot taken once
                    # a client has its answer includes it (its only callbacks hand the
                    # answer to the server's event loop and take no lock).
                    with self._wake:
                        try:
                            turn.future.set_result(completion)
                            self.counts["completed"] += 1
                        except concurrent.futures.InvalidStateError:  # the client went away
                            self.counts["discarded"] += 1
            except Exception as error:  # fail the turns in flight; the loop goes on
                self.engine.abort()
                for turn in self.running.values():
                    with contextlib.suppress(concurrent.futures.InvalidStateError):
                        turn.future.set_exception(error)
                self.running.clear()
                self._count("engine_errors")
        self.engine.abort()
        for turn in [*self.queue, *self.running.values()]:
            turn.future.cancel()
        self.queue.clear()
        self.running.clear()
