"""The fleet of inference workers, one ``WorkerHost`` each, on every placement.

The fleet knows which prompts each worker holds (``WorkerSlot.in_flight``), so losing a
worker costs nothing accepted: its prompts go back to the driver (same ids and seeds).
How the fleet reaches its hosts is its transport: ``rlaxkit.runtime.local.InProcess``
calls them in this process (the busy workers' chunks of a round decode at once, each on
a thread of its own, with ``runtime.threaded_chunks``);
the Ray placement's transport calls actors, all at once, and finds a dead one when a
call fails, after which the worker leaves the fleet (``take_lost``) and a new actor
takes its place (``RayConfig.replace_dead_workers``). A preemption from a fault plan
discards the worker's host (on Ray: kills the actor for real); after the downtime a new
host with the same id starts empty and pulls before its first prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlaxkit.api import ChunkReply, FleetCheckpoint, SyncReply, Work
from rlaxkit.rules.controller import Issue
from rlaxkit.runtime.common import RunTrace

_GATHER_ATTEMPTS = 3  # Worker deaths while a checkpoint gathers their state.

Calls = list[tuple[Any, str, tuple]]  # (slot, method, arguments)


class Transport(Protocol):
    """How a fleet reaches its hosts."""

    def call(self, calls: Calls) -> tuple[dict[str, Any], list[Any]]:
        """Makes the calls (at once where it can); returns replies by worker id and the
        slots whose host died."""
        ...

    def step(self, calls: Calls) -> tuple[dict[str, Any], list[Any]]:
        """``submit_and_step`` calls (``(work, decode)`` each), as :meth:`call` does."""
        ...

    def kill(self, handle: object) -> None: ...

    def stop(self, handle: object) -> None: ...

    def start_seconds(self, handle: object) -> float | None:
        """Seconds the host behind ``handle`` took to start, once known (``None``: not
        known yet, told already, or started in no time worth a trace event)."""
        ...


@dataclass
class WorkerSlot:
    """The driver's view of one worker actor (``handle`` is ``None`` while it is down)."""

    worker_id: str
    handle: Any
    in_flight: dict[int, Issue] = field(default_factory=dict)
    version: int | None = None
    generated_tokens: int = 0
    failed_pulls: int = 0
    reward_counters: dict[str, int] = field(default_factory=dict)


class WorkerFleet:
    """Inference workers behind a transport (``rlaxkit.api.Fleet``).

    Args:
        start_host: starts the worker host of a given id; returns its handle.
        transport: how the hosts are called (``InProcess`` or Ray's).
        trace: the run trace (the workers' events are written to it in worker order).
        clock: the run's clock.
        replace_dead: start a new worker when one dies.
        max_replacements: how many dead workers to replace before giving up.
        scorer: the reward runner the hosts share in this process (``None``: each host
            has its own and reports its counters with every reply).
    """

    def __init__(
        self,
        start_host: Callable[[str], object],
        transport: Transport,
        trace: RunTrace,
        clock: Callable[[], float],
        replace_dead: bool,
        max_replacements: int,
        scorer: Any = None,
    ):
        self.start_host, self.transport, self.scorer = start_host, transport, scorer
        self.trace, self.clock = trace, clock
        self.replace_dead, self.max_replacements = replace_dead, max_replacements
        self.workers: list[WorkerSlot] = []
        self.books: dict[str, Any] = {
            "next_worker": 0,
            "replacements": 0,
            "retired_tokens": 0,
            "retired_failed_pulls": 0,
            "retired_reward_counters": {},
        }
        self._lost: list[tuple[str, list[Issue]]] = []

    # -- membership ------------------------------------------------------------------
    def add(self, worker_id: str | None = None) -> WorkerSlot:
        """Starts a worker actor named ``worker_id`` (default: the next free name)."""
        if worker_id is None:
            worker_id = f"worker-{self.books['next_worker']}"
            self.books["next_worker"] += 1
        slot = WorkerSlot(worker_id, self.start_host(worker_id))
        self.workers.append(slot)
        return slot

    def _retire(self, slot: WorkerSlot) -> list[Issue]:
        """Stops counting ``slot``'s actor; returns the prompts it held."""
        lost = sorted(slot.in_flight.values(), key=lambda issue: issue.group_id)
        books = self.books
        books["retired_tokens"] += slot.generated_tokens
        books["retired_failed_pulls"] += slot.failed_pulls
        retired = books["retired_reward_counters"]
        for key, count in slot.reward_counters.items():
            retired[key] = retired.get(key, 0) + count
        slot.in_flight, slot.version = {}, None
        slot.generated_tokens = slot.failed_pulls = 0
        slot.reward_counters = {}
        return lost

    def _died(self, slot: WorkerSlot) -> None:
        self._lost.append((slot.worker_id, self._retire(slot)))
        self.workers.remove(slot)
        self.transport.kill(slot.handle)
        if not self.replace_dead:
            return
        self.books["replacements"] += 1
        if self.books["replacements"] > self.max_replacements:
            raise RuntimeError(
                f"{self.books['replacements']} worker actors died; giving up (raise "
                "RayConfig.max_worker_replacements if the cluster is really that "
                "unreliable, else look at the workers' logs)"
            )
        new = self.add()
        self.trace.record(self.clock(), "restart", new.worker_id, None, replaces=slot.worker_id)

    def _call(self, method: str, args: Mapping[str, tuple], only: Sequence[str]) -> dict:
        """Calls ``method`` on the live workers named in ``only`` at once; replies by
        worker id (a worker that died is taken out of the fleet)."""
        calls = [
            (slot, method, args.get(slot.worker_id, ()))
            for slot in list(self.workers)
            if slot.handle is not None and slot.worker_id in only
        ]
        step = self.transport.step if method == "submit_and_step" else self.transport.call
        replies, dead = step(calls)
        for slot in dead:
            self._died(slot)
        return replies

    # -- the round -------------------------------------------------------------------
    def worker_ids(self) -> list[str]:
        return [slot.worker_id for slot in self.workers]

    def sync(self, live: Sequence[str]) -> dict[str, SyncReply]:
        replies = self._call("sync", {}, live)
        for slot in self.workers:
            reply = replies.get(slot.worker_id)
            started_s = self.transport.start_seconds(slot.handle)
            if started_s is not None:  # the simulator's host.worker_start_s
                self.trace.record(
                    self.clock(), "worker_start", slot.worker_id, None, duration_s=started_s
                )
            if reply is not None:
                self.trace.extend(reply.events)
                slot.version, slot.failed_pulls = reply.version, reply.failed_pulls
        return replies

    def step(
        self, work: Mapping[str, Sequence[Work]], chunked: Sequence[str]
    ) -> list[tuple[str, ChunkReply]]:
        for slot in self.workers:
            for item in work.get(slot.worker_id, ()):
                slot.in_flight[item.issue.group_id] = item.issue
        args = {w: (list(items), w in chunked) for w, items in work.items()}
        replies = self._call("submit_and_step", args, list(work))
        out = []
        for slot in self.workers:
            reply = replies.get(slot.worker_id)
            if reply is None:
                continue
            self.trace.extend(reply.events)
            slot.generated_tokens = reply.generated_tokens
            slot.reward_counters = dict(reply.reward_counters)
            for rollout in reply.rollouts:
                slot.in_flight.pop(rollout.group_id, None)
            out.append((slot.worker_id, reply))
        return out

    def _slot(self, worker_id: str) -> WorkerSlot:
        return next(slot for slot in self.workers if slot.worker_id == worker_id)

    def preempt(self, worker_id: str) -> list[Issue]:
        """Kills the worker's actor (a real preemption); returns its prompts."""
        slot = self._slot(worker_id)
        if slot.handle is not None:
            self.transport.kill(slot.handle)
            slot.handle = None
        return self._retire(slot)

    def drop_weights(self, worker_id: str) -> list[Issue]:
        """The worker drops its weights and its prompts (they came from a discarded
        branch of the run) and keeps its host; returns the prompts."""
        slot = self._slot(worker_id)
        if slot.handle is not None:
            self._call("drop_weights", {}, [worker_id])
        lost = sorted(slot.in_flight.values(), key=lambda issue: issue.group_id)
        slot.in_flight, slot.version = {}, None
        return lost

    def restart(self, worker_id: str) -> None:
        """A new actor for a preempted worker; it pulls before it takes work."""
        slot = self._slot(worker_id)
        if slot.handle is None:
            slot.handle = self.start_host(worker_id)

    def take_lost(self) -> list[tuple[str, list[Issue]]]:
        lost, self._lost = self._lost, []
        return lost

    def scale(self, n: int) -> list[tuple[str, list[Issue]]]:
        """Grows or shrinks the fleet to ``n`` worker actors (the newest leave first);
        returns the removed workers' prompts."""
        removed = []
        while len(self.workers) < n:
            self.add()
        while len(self.workers) > n:
            slot = self.workers.pop()
            removed.append((slot.worker_id, self._retire(slot)))
            if slot.handle is not None:
                self.transport.stop(slot.handle)
        return removed

    # -- counters --------------------------------------------------------------------
    def versions(self) -> dict[str, int | None]:
        return {slot.worker_id: slot.version for slot in self.workers}

    def in_flight(self) -> dict[str, list[int]]:
        return {slot.worker_id: list(slot.in_flight) for slot in self.workers}

    def generated_tokens(self) -> int:
        return self.books["retired_tokens"] + sum(s.generated_tokens for s in self.workers)

    def failed_pulls(self) -> int:
        return self.books["retired_failed_pulls"] + sum(s.failed_pulls for s in self.workers)

    def reward_counters(self) -> dict[str, int]:
        if self.scorer is not None:
            return dict(self.scorer.counters)
        out = dict(self.books["retired_reward_counters"])
        for slot in self.workers:
            for key, count in slot.reward_counters.items():
                out[key] = out.get(key, 0) + count
        return out

    def replacements(self) -> int:
        return self.books["replacements"]

    # -- checkpoints -----------------------------------------------------------------
    def checkpoint(self) -> FleetCheckpoint:
        """Every worker's replay log and the host weights those logs need; a worker
        that dies meanwhile is replaced (its prompts wait in ``take_lost``) and the
        gathering starts again."""
        for _ in range(_GATHER_ATTEMPTS):
            gathered = self._gather()
            if gathered is not None:
                return gathered
        raise RuntimeError(
            f"worker actors died {_GATHER_ATTEMPTS} times while a checkpoint gathered "
            "their state; see their logs"
        )

    def _gather(self) -> FleetCheckpoint | None:
        live = [s.worker_id for s in self.workers if s.handle is not None]
        replies = self._call("checkpoint", {}, live)
        if any(w not in replies for w in live):
            return None
        wanted: dict[str, list[int]] = {}  # worker -> versions it is asked for
        seen: set[int] = set()
        for worker_id in live:
            for version in replies[worker_id]["versions"]:
                if version not in seen:
                    seen.add(version)
                    wanted.setdefault(worker_id, []).append(version)
        fetched = self._call("replay_weights", {w: (v,) for w, v in wanted.items()}, list(wanted))
        if any(w not in fetched for w in wanted):
            return None
        weights = {v: params for reply in fetched.values() for v, params in reply.items()}
        workers = [
            {
                "worker_id": slot.worker_id,
                "in_flight": sorted(slot.in_flight),
                "snapshot": replies[slot.worker_id]["snapshot"] if slot.handle else None,
                "generated_tokens": slot.generated_tokens,
                "failed_pulls": slot.failed_pulls,
                "reward_counters": slot.reward_counters,
            }
            for slot in self.workers
        ]
        books = dict(self.books)
        if self.scorer is not None:
            books["scorer"] = {
                "counters": dict(self.scorer.counters),
                "hangs_pending": self.scorer.hangs_pending,
            }
        return FleetCheckpoint(workers, books, weights)

    def restore(
        self,
        workers: list[dict[str, Any]],
        books: dict[str, Any],
        weights_for: Callable[[int], object],
        work_for: Callable[[int], Work],
    ) -> None:
        """Has every saved worker (started with its saved id) replay its log."""
        self.books = {k: v for k, v in books.items() if k != "scorer"}
        if self.scorer is not None:
            self.scorer.counters.update(books["scorer"]["counters"])
            self.scorer.hangs_pending = books["scorer"]["hangs_pending"]
        work: dict[str, tuple] = {}
        for slot, saved in zip(self.workers, workers, strict=True):
            assert slot.worker_id == saved["worker_id"], (slot.worker_id, saved["worker_id"])
            slot.in_flight = {g: work_for(g).issue for g in saved["in_flight"]}
            slot.generated_tokens = saved["generated_tokens"]
            slot.failed_pulls = saved["failed_pulls"]
            slot.reward_counters = dict(saved["reward_counters"])
            snapshot = saved["snapshot"]
            if snapshot is None:  # down at the checkpoint: it starts empty
                continue
            slot.version = snapshot["version"]
            ops = snapshot["ops"]
            issues = {op[1]: work_for(op[1]) for op in ops if op[0] == "s"}
            versions = {op[1] for op in ops if op[0] == "u"}
            if snapshot["base_version"] is not None:
                versions.add(snapshot["base_version"])
            weights = {v: weights_for(v) for v in versions}
            work[slot.worker_id] = (snapshot, issues, weights)
        replies = self._call("restore", work, list(work))
        for slot in self.workers:
            if slot.worker_id in replies:
                self.trace.extend(replies[slot.worker_id])

    def close(self) -> None:
        for slot in self.workers:
            if slot.handle is not None:
                self.transport.stop(slot.handle)
        self.workers = []
