"""The simulated parameter server: versioned weights, pushes, bandwidth-shared pulls.

The trainer pushes ``(version)``; workers pull the newest. Concurrent pulls share the
store's egress as a fluid (processor sharing): each of ``n`` active pulls moves
``min(link, total / n)`` bytes per second, recomputed whenever a pull starts or ends.
The store never waits on a reader. Killing it aborts the pulls in flight (they start
over when it is back) and holds pushes; its versions survive (RLAX backs the store with
TensorStore, ``docs/papers.md`` [R4]).

**Delta publication** (``ParamServerSpec.delta_changed_fraction = f``), as
``rlaxkit.param_server.DeltaParameterServer`` does it: a push moves the ``f ·
weight_bytes`` that changed, except every ``snapshot_every``-th push (counting the
initial weights as one, and after a rollback) moves every byte. A pull moves the bytes
that differ from what the worker holds, wherever they were last written, so snapshots
cost pushes only: a worker ``s`` versions behind moves ``(1 - (1 - f)^s) ·
weight_bytes`` (each version changes an independent ``f`` of the chunks); a worker that
holds nothing, or weights of a rolled-back lineage, moves every byte.

**Adapter publication** (``ParamServerSpec.adapter_fraction = a``, a LoRA run), as
``rlaxkit.param_server.AdapterParameterServer`` does it: the initial weights are the
base record (base and adapters), every push moves the adapters, ``a · weight_bytes``,
except the first after a rollback (the restored trainer writes a new base record:
``(1 + a) · weight_bytes``). A worker holding a version of this lineage moves the
newest adapters, however far behind it is; one holding nothing, or weights of a
rolled-back lineage, reads the base record: ``(1 + a) · weight_bytes``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, NamedTuple

import simpy
from simpy.events import ProcessGenerator

if TYPE_CHECKING:
    from sim.entities.context import SimContext

__all__ = ["SimParameterServer", "SimPull"]

# A pull counts as done when this fraction of its bytes is left (float round-off).
_DONE_FRACTION = 1e-9


class SimPull(NamedTuple):
    """What a pull delivered: the version, its lineage and the bytes it moved."""

    version: int
    lineage: int
    bytes: float


class _Transfer:
    __slots__ = ("remaining", "event")

    def __init__(self, remaining: float, event: simpy.Event) -> None:
        self.remaining = remaining
        self.event = event


class SimParameterServer:
    """Versioned weight store shared by the trainer and the workers.

    Attributes:
        latest: Newest published version (0, the initial weights, at start).
        lineage: Number of restores so far; weights pulled before a restore that are
            newer than the restored step belong to a discarded branch.
        up: False while killed.
    """

    name = "param_server"

    def __init__(self, sim: SimContext) -> None:
        self.sim = sim
        self.env = sim.env
        self.spec = sim.scenario.param_server
        self.latest = 0
        self.lineage = 0
        self.up = True
        self._kills = 0
        self._down_until = 0.0
        self._up_event = self.env.event()
        self._transfers: list[_Transfer] = []
        self._last_update = 0.0
        self._timer_token = 0
        self.failing_pulls: Counter[str] = Counter()
        self._pushes_since_snapshot: int | None = 0  # None: the next push is a snapshot

    # --- availability ----------------------------------------------------------------

    def kill(self, down_s: float) -> None:
        """Make the store unreachable for ``down_s`` seconds, aborting pulls in flight."""
        self._kills += 1
        if self.up:
            self.up = False
            for transfer in self._transfers:
                transfer.event.succeed(False)
            self._transfers.clear()
        self._down_until = max(self._down_until, self.env.now + down_s)
        self.env.process(self._restart())

    def _restart(self):
        while self.env.now < self._down_until:
            yield self.env.timeout(self._down_until - self.env.now)
        if not self.up:
            self.up = True
            self._last_update = self.env.now
            self.sim.record(self.name, "restart", self.latest)
            event, self._up_event = self._up_event, self.env.event()
            event.succeed()

    def wait_up(self) -> simpy.Event:
        """Event that fires when the store is back (already triggered state is not kept)."""
        return self._up_event

    # --- trainer side ----------------------------------------------------------------

    def push(self, version: int) -> ProcessGenerator:
        """Process body: the trainer transfers ``version``; then it is published.

        Takes ``latency_s + bytes / push_bytes_per_s`` while the store is up (``bytes``:
        see :meth:`push_bytes`); a kill during the transfer restarts it.
        """
        start = self.env.now
        nbytes, snapshot = self.push_bytes()
        while True:
            while not self.up:
                yield self._up_event
            kills = self._kills
            yield self.env.timeout(self.spec.push_s(nbytes))
            if kills == self._kills:
                break
        if self.spec.delta_changed_fraction is not None or self.spec.adapter_fraction is not None:
            since = self._pushes_since_snapshot
            self._pushes_since_snapshot = 0 if snapshot or since is None else since + 1
        self.sim.record("trainer", "push", version, duration_s=self.env.now - start, bytes=nbytes)
        self.publish(version)

    def push_bytes(self) -> tuple[float, bool]:
        """``(bytes, full snapshot)`` of the next push (see the module docstring)."""
        f, every = self.spec.delta_changed_fraction, self.spec.snapshot_every
        since = self._pushes_since_snapshot
        a = self.spec.adapter_fraction
        if a is not None:  # a base record after a rollback, else the adapters
            return ((1.0 + a) if since is None else a) * self.spec.weight_bytes, since is None
        if f is None or since is None or since + 1 >= every:
            return float(self.spec.weight_bytes), True
        return f * self.spec.weight_bytes, False

    def pull_bytes(self, held: tuple[int | None, int] | None) -> float:
        """Bytes a pull of the newest version moves to a worker holding ``held``
        (``(version, lineage)``; see the module docstring)."""
        f, a = self.spec.delta_changed_fraction, self.spec.adapter_fraction
        stranger = held is None or held[0] is None or held[1] != self.lineage
        if a is not None:  # the base record, or the newest adapters
            if stranger:
                return (1.0 + a) * self.spec.weight_bytes
            assert held is not None and held[0] is not None
            return a * self.spec.weight_bytes if self.latest > held[0] else 0.0
        if f is None or stranger:
            return float(self.spec.weight_bytes)
        assert held is not None and held[0] is not None
        behind = self.latest - held[0]
        return (1.0 - (1.0 - f) ** behind) * self.spec.weight_bytes if behind > 0 else 0.0

    def publish(self, version: int) -> None:
        """Make ``version`` the newest and tell the buffer and the workers."""
        self.latest = version
        self.sim.buffer.on_publish(version)
        for worker in self.sim.workers:
            worker.on_publish()

    def rollback(self, version: int) -> None:
        """Start a new lineage at ``version`` (the trainer restored an older checkpoint)."""
        self.lineage += 1
        self.latest = version
        self._pushes_since_snapshot = None  # the restored trainer publishes a snapshot
        for worker in self.sim.workers:
            worker.on_rollback(version)

    # --- worker side -----------------------------------------------------------------

    def pull(
        self, worker_name: str, held: tuple[int | None, int] | None = None
    ) -> Generator[simpy.Event, Any, SimPull]:
        """Process body returning what arrived once the newest weights are in.

        Waits while the store is down, pays ``latency_s``, then moves the bytes that
        differ from ``held`` (the worker's ``(version, lineage)``; all of them without
        deltas or weights, :meth:`pull_bytes`) at the shared rate. A fault-injected
        failure costs the transfer and a retry after the fleet's ``pull_retry_s``.
        """
        while True:
            while not self.up:
                yield self._up_event
            if self.spec.latency_s:
                yield self.env.timeout(self.spec.latency_s)
                if self._is_down():
                    continue
            version, lineage = self.latest, self.lineage
            nbytes = self.pull_bytes(held)
            transfer = self._start_transfer(nbytes)
            try:
                ok = yield transfer
            except BaseException:
                self._cancel_transfer(transfer)  # the puller was preempted
                raise
            if not ok:
                continue
            key = worker_name if self.failing_pulls[worker_name] else "*"
            if self.failing_pulls[key] > 0:
                self.failing_pulls[key] -= 1
                self.sim.record(worker_name, "fault", version, fault="fail_pull")
                yield self.env.timeout(self.sim.scenario.fleet.pull_retry_s)
                continue
            return SimPull(version, lineage, nbytes)

    def _is_down(self) -> bool:
        """Whether the store is down now. A call rather than ``not self.up`` after a
        ``yield``: the type checker would carry the test of ``up`` made before the
        ``yield`` past it, though another process may have killed the store meanwhile."""
        return not self.up

    def _rate(self) -> float:
        return self.spec.pull_rate(len(self._transfers))

    def _start_transfer(self, nbytes: float) -> simpy.Event:
        self._advance()
        event = self.env.event()
        if nbytes <= 0:
            event.succeed(True)
            return event
        self._transfers.append(_Transfer(float(nbytes), event))
        self._schedule_next()
        return event

    def _cancel_transfer(self, event: simpy.Event) -> None:
        if any(t.event is event for t in self._transfers):
            self._advance()
            self._transfers = [t for t in self._transfers if t.event is not event]
            self._schedule_next()

    def _advance(self) -> None:
        """Move every active pull forward to now and finish those that are done."""
        now = self.env.now
        elapsed = now - self._last_update
        self._last_update = now
        if not self._transfers:
            return
        rate = self._rate()
        if elapsed > 0:
            for transfer in self._transfers:
                transfer.remaining -= rate * elapsed
        threshold = self.spec.weight_bytes * _DONE_FRACTION

        def done(transfer: _Transfer) -> bool:
            # Also done when the time it still needs is below the clock's resolution
            # now: a timer that far ahead fires at ``now`` again, and a fast pull's
            # last bytes would be rescheduled for ever.
            return transfer.remaining <= threshold or now + transfer.remaining / rate <= now

        finished = [t for t in self._transfers if done(t)]
        if finished:
            self._transfers = [t for t in self._transfers if t not in finished]
            for transfer in finished:
                transfer.event.succeed(True)

    def _schedule_next(self) -> None:
        if not self._transfers:
            return
        self._timer_token += 1
        token = self._timer_token
        delay = min(t.remaining for t in self._transfers) / self._rate()
        timer = self.env.timeout(delay)
        timer.callbacks.append(lambda _event: self._on_timer(token))

    def _on_timer(self, token: int) -> None:
        if token != self._timer_token or not self.up:
            return
        self._advance()
        self._schedule_next()
