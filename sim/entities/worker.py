"""The simulated inference worker: continuous batching over a fixed number of slots.

Each slot is a SimPy process that loops: take the next queued sample (or ask the buffer
to admit a new prompt group, whose ``group_size`` samples join the worker's queue),
decode it in one timeout (prefill plus ``tokens × per-token time`` at the occupancy it
starts with), and hand it to the verifier. Modelling one timeout per sequence instead
of one per token is what keeps a 1024-chip, 13-hour run fast.

Weights follow the shared policies:

- ``between_requests``: when ``StalenessPolicy.must_pull`` says so, the worker stops
  starting new groups, lets the sequences it started finish, then pulls (every group
  then comes from a single version, as in RLAX);
- ``in_flight``: on a new version the worker interrupts its decoding slots
  (``simpy.Interrupt``), keeps the tokens already decoded, pulls, recomputes their KV
  cache (a prefill over prompt + decoded tokens) and goes on (AReaL interruptible
  rollout), so a group may span versions.

**Multi-turn episodes** (``WorkloadSpec.turns``): a slot decodes a policy turn, then
waits for the episode's tool while holding its row and KV cache (the engine's
``submit(hold=True)``; the held row counts in the occupancy, as a parked row of the
engine's static batch does), prefills the observation and decodes the next turn. A tool
slower than ``FleetSpec.release_after_s`` has the slot released to other work at that
point; when it answers, the episode waits ahead of new samples for a free slot and
prefills its whole context again. So does a held episode whose worker pulled new
weights meanwhile. Every turn notes the version it decodes with, so staleness counts
from the oldest policy token. A released episode is not waited for by a
``between_requests`` pull: its later turns may use newer weights.

A preemption interrupts every slot: the groups not fully decoded are lost (re-issued
with the same ids, or dropped as ``preempted``, per the ``RecoveryPolicy``), finished
samples awaiting their reward are kept, and the worker pulls weights again after its
restart delay. A trainer restore that voids the weights a worker holds loses its groups
the same way (reason ``rolled_back``), without the downtime.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, cast

import simpy
from simpy.events import ProcessGenerator

from sim.entities.groups import Group, SimSample
from sim.entities.worker_state import Health, SlotWaits, WorkerMode
from sim.scenario import paged_rows

if TYPE_CHECKING:
    from rlaxkit.rules.policies import StalenessPolicy
    from sim.entities.context import SimContext
    from sim.specs import FleetSpec

__all__ = ["HOST_BUSY", "PREEMPTED", "WEIGHT_UPDATE", "SimWorker"]

PREEMPTED = "preempted"
WEIGHT_UPDATE = "weight_update"
HOST_BUSY = "host_busy"
_PAUSES = (WEIGHT_UPDATE, HOST_BUSY)


class SimWorker:
    """One inference worker with ``slots_per_worker`` concurrent sequences."""

    def __init__(self, sim: SimContext, index: int) -> None:
        self.sim = sim
        spec = sim.scenario.fleet
        self.name = f"worker-{index}"
        self.slice_name = f"slice-{index // spec.workers_per_slice}"
        self.version: int | None = None
        self.lineage = 0
        self.up = True
        self.pulling = False
        self.paused = False
        self.active = 0
        self.epoch = 0
        self.queue: deque[SimSample] = deque()
        self.returned: deque[SimSample] = deque()  # back from a tool that took their slot
        self.groups: set[Group] = set()
        self._decoding: dict[simpy.Process, float] = {}
        self._waits = SlotWaits(resumed=sim.env.event())
        self._health = Health()
        self._mode = WorkerMode(
            host_scope=spec.occupancy_scope == "host",
            interrupting=sim.scenario.weight_sync.interrupts_generation,
            releases=sim.scenario.workload.multi_turn and spec.release_after_s is not None,
        )
        self._pull_proc: simpy.Process | None = None
        self.rows = paged_rows(sim.scenario) if spec.kv_pool_tokens else spec.slots_per_worker
        self.slots = [self.env.process(self._slot()) for _ in range(self.rows)]

    @property
    def env(self) -> simpy.Environment:
        return self.sim.env

    @property
    def spec(self) -> FleetSpec:
        return self.sim.scenario.fleet

    @property
    def policy(self) -> StalenessPolicy:
        return self.sim.scenario.staleness

    # --- slot processes --------------------------------------------------------------

    def _slot(self):
        while True:
            try:
                sample = yield from self._next_sample()
                yield from self._generate(sample)
            except simpy.Interrupt:
                # Preempted: the worker has already dropped its work and reset its
                # state, so look for work again. (Pauses are handled in _generate.)
                continue

    def _next_sample(self):
        """Wait until this slot may decode, and return the sample to decode.

        Idle slots wait in a FIFO and are woken one at a time (a broadcast would wake
        every idle slot of the worker for each new group). At most one slot at a time
        waits for the buffer to admit a new group.
        """
        while True:
            if not self.up or self.pulling or self.paused:
                yield self._idle_wait()
                continue
            if self._pull_due() and (
                self._mode.interrupting
                or self.version is None
                or not (self.returned or (self.queue and self.queue[0].group.started))
            ):
                self._maybe_pull()
                yield self._idle_wait()
                continue
            if self.returned:  # episodes back from a slow tool go first
                sample = self.returned.popleft()
                if self._waits.idle and (self.returned or self.queue or not self._waits.requesting):
                    self._waits.idle.popleft().succeed()
                return sample
            if self.queue:
                sample = self.queue.popleft()
                if self._waits.idle and (self.queue or not self._waits.requesting):
                    self._waits.idle.popleft().succeed()
                return sample
            if self._waits.requesting:
                yield self._idle_wait()
                continue
            buffer = self.sim.buffer
            group = buffer.try_start(self.name)
            if group is None:
                self._waits.requesting = True
                request = buffer.wait_start(self.name)
                # With released slots an episode may come back from its tool while this
                # slot waits for admission: it must not wait behind it (admission may
                # wait for that very episode's group).
                wake = self._waits.wake_request = self.env.event() if self._mode.releases else None
                try:
                    if wake is None:
                        group = yield request
                    else:
                        yield request | wake
                        if not request.triggered:
                            buffer.cancel(request)
                            continue
                        group = cast(Group, request.value)
                except simpy.Interrupt:
                    buffer.cancel(request)
                    raise
                finally:
                    self._waits.requesting = False
                    self._waits.wake_request = None
            self.groups.add(group)
            self.queue.extend(group.samples)

    def _idle_wait(self):
        event = self.env.event()
        self._waits.idle.append(event)
        return event

    def _generate(self, sample: SimSample) -> ProcessGenerator:
        """Decode ``sample`` turn by turn, each turn in one timeout re-timed after each
        in-flight weight update or host pause; between turns its tool runs
        (:meth:`_call_tool`)."""
        env, spec, counters = self.env, self.spec, self.sim.counters
        proc = env.active_process
        if proc is None:
            raise RuntimeError(f"{self.name}: decoding outside a SimPy process")
        epoch = self.epoch
        group = sample.group
        if sample.turn == 0:
            group.started = True
            sample.first_version = self._held_version()
            prefill_tokens = sample.prompt_tokens
        else:  # back from a tool in a new slot: prefill everything so far
            prefill_tokens = sample.context_tokens(sample.turn)
        group.note_version(self._held_version(), self.lineage)
        self._add_active(1)
        if sample.turn == 0 and self.sim.trace is not None:
            occupancy = self.sim.host_active if self._mode.host_scope else self.active
            self.sim.record_start(self.name, self.version, sample, occupancy)
        last = len(sample.turn_tokens) - 1
        while True:
            turn = sample.turn
            remaining = sample.turn_tokens[turn]
            while True:
                per_token = self._per_token_s()
                prefill_s = prefill_tokens / spec.prefill_tokens_per_s
                start = env.now
                self._decoding[proc] = start
                try:
                    yield env.timeout(prefill_s + remaining * per_token)
                    del self._decoding[proc]
                    counters.slot_busy_s += env.now - start
                    break
                except simpy.Interrupt as interrupt:
                    cause = interrupt.cause
                    if cause not in _PAUSES or epoch != self.epoch:
                        raise
                    del self._decoding[proc]
                    counters.slot_busy_s += env.now - start
                    decoded = (env.now - start - prefill_s) / per_token
                    remaining -= min(remaining, max(0, int(decoded + 1e-9)))
                version = self.version
                if self.pulling or self.paused:
                    yield from self._wait_resumed(epoch)
                group.note_version(self._held_version(), self.lineage)
                if remaining == 0:
                    break
                if decoded < 0 or self.version != version or cause == WEIGHT_UPDATE:
                    # New weights (or a prefill cut short): recompute the KV cache of
                    # the context and of the tokens decoded so far.
                    done = sample.turn_tokens[turn] - remaining
                    prefill_tokens = sample.context_tokens(turn) + done
                else:
                    prefill_tokens = 0  # a host pause keeps the KV cache
            if turn == last:
                break
            prefill_tokens = yield from self._call_tool(sample, turn, epoch)
            if prefill_tokens < 0:
                return  # the slot was released while the tool runs
        self._finish(sample)

    def _call_tool(self, sample: SimSample, turn: int, epoch: int) -> ProcessGenerator:
        """The tool call after policy turn ``turn``: the slot holds the row and KV cache
        while it runs, or, past ``release_after_s``, gives the slot up. Returns the
        tokens the next turn prefills (the observation, or the whole context after new
        weights), or -1 when the slot was released."""
        tool_s = sample.tool_s[turn]
        release_after_s = self.spec.release_after_s
        version = self.version
        sample.turn = turn + 1
        self.sim.counters.tool_calls += 1
        if release_after_s is not None and tool_s > release_after_s:
            yield from self._sleep(release_after_s, epoch)
            self._release(sample, turn, tool_s - release_after_s, epoch)
            return -1
        yield from self._sleep(tool_s, epoch)
        self.sim.counters.tool_hold_s += tool_s
        self.sim.record_tool_call(self.name, self.version, sample, turn, released=False)
        yield from self._wait_resumed(epoch)
        sample.group.note_version(self._held_version(), self.lineage)
        if self.version == version:
            return sample.observations[turn]  # the row kept its cache
        return sample.context_tokens(turn + 1)  # new weights: recompute the context

    def _wait_resumed(self, epoch: int) -> ProcessGenerator:
        """Wait while the worker pulls or the host is paused."""
        while self.pulling or self.paused:
            try:
                yield self._waits.resumed
            except simpy.Interrupt as again:
                # A pull and a host pause can both interrupt a decode in the same
                # instant; the second finds this slot already paused.
                if again.cause not in _PAUSES or epoch != self.epoch:
                    raise

    def _sleep(self, seconds: float, epoch: int) -> ProcessGenerator:
        """Wait ``seconds`` (a tool call) through pause interrupts; a preemption ends it."""
        end = self.env.now + seconds
        while True:
            try:
                yield self.env.timeout(max(0.0, end - self.env.now))
                return
            except simpy.Interrupt as interrupt:
                if interrupt.cause not in _PAUSES or epoch != self.epoch:
                    raise

    def _release(self, sample: SimSample, turn: int, rest_s: float, epoch: int) -> None:
        """The slot gives up ``sample``, whose tool runs ``rest_s`` more seconds; then the
        episode waits in ``returned``, ahead of new samples, for the next free slot."""
        self.sim.counters.slots_released += 1
        self.sim.counters.tool_hold_s += self.spec.release_after_s or 0.0
        self._add_active(-1)
        timer = self.env.timeout(rest_s)
        timer.callbacks.append(lambda _event: self._tool_returned(sample, turn, epoch))
        if self.active == 0:
            self._maybe_pull()

    def _tool_returned(self, sample: SimSample, turn: int, epoch: int) -> None:
        if epoch != self.epoch or sample.group.void:
            return  # the worker lost the episode meanwhile
        self.sim.record_tool_call(self.name, self.version, sample, turn, released=True)
        self.returned.append(sample)
        if self._waits.idle:
            self._waits.idle.popleft().succeed()
        elif self._waits.wake_request is not None and not self._waits.wake_request.triggered:
            self._waits.wake_request.succeed()  # a slot waiting for admission takes it instead

    def _finish(self, sample: SimSample) -> None:
        self._add_active(-1)
        counters = self.sim.counters
        counters.samples_generated += 1
        counters.tokens_generated += sample.policy_tokens
        group = sample.group
        group.tokens += sample.prompt_tokens + sample.tokens
        group.unfinished -= 1
        if group.unfinished == 0:
            self.groups.discard(group)
        first_version = sample.first_version
        if first_version is None:
            raise RuntimeError(f"{self.name}: sample {sample.sample_id} finished unstarted")
        self.sim.record_end(self.name, self.version, sample, first_version)
        self.sim.verifier.submit(sample)
        if self.active == 0:
            self._maybe_pull()

    def _held_version(self) -> int:
        """The version of the weights held; a slot decodes only with some (it waits for
        a pull first, and a preemption ends its decode)."""
        if self.version is None:
            raise RuntimeError(f"{self.name}: decoding without weights")
        return self.version

    def _add_active(self, delta: int) -> None:
        self.active += delta
        self.sim.host_active += delta

    def _per_token_s(self) -> float:
        occupancy = self.sim.host_active if self._mode.host_scope else self.active
        return self.spec.per_token_s(occupancy) * self._health.slow_factor

    def _notify(self) -> None:
        """The worker's state changed (restart, new weights): resume paused decodes and
        wake one idle slot, which wakes the next as long as there is work (a chain)."""
        event, self._waits.resumed = self._waits.resumed, self.env.event()
        event.succeed()
        if self._waits.idle:
            self._waits.idle.popleft().succeed()

    # --- weights ---------------------------------------------------------------------

    def _sync_action(self, busy: bool) -> str:
        """Keep, drain or pull (``WeightSyncPolicy.sync_action``, as the runtime's workers)."""
        ws, latest = self.sim.scenario.weight_sync, self.sim.ps.latest
        return ws.sync_action(self.policy, self.version, latest, busy=busy)

    def _pull_due(self) -> bool:
        return self._sync_action(busy=False) == "pull"

    def _maybe_pull(self) -> None:
        """Start a pull if one is due now (between requests, a busy worker drains first)."""
        if not self.up or self.pulling or self._sync_action(busy=self.active > 0) != "pull":
            return
        self.pulling = True
        self._pull_proc = self.env.process(self._pull())

    def _pull(self):
        env = self.env
        start = env.now
        from_version = self.version
        if self._mode.interrupting:
            for proc in list(self._decoding):
                proc.interrupt(WEIGHT_UPDATE)
        try:
            version, lineage, nbytes = yield from self.sim.ps.pull(
                self.name, (self.version, self.lineage)
            )
        except simpy.Interrupt:
            return  # preempted mid-pull; preempt() has reset this worker
        self.version = version
        self.lineage = lineage
        self.pulling = False
        self.sim.record(
            self.name,
            "pull",
            version,
            duration_s=env.now - start,
            from_version=from_version,
            bytes=nbytes,
        )
        self._notify()
        self._maybe_pull()

    def on_publish(self) -> None:
        """A new version was published; in-flight mode reloads at once if it must."""
        if self._mode.interrupting and self.version is not None:
            self._maybe_pull()

    def on_rollback(self, version: int) -> None:
        """The trainer restored ``version``: weights newer than it are void. As the
        runtime's worker does, this one drops them and its prompts (lost work, per the
        ``RecoveryPolicy``) and pulls again before it takes more."""
        if self.up and self.version is not None and self.version > version:
            self._drop_work("rolled_back")
            self._notify()

    # --- a shared host --------------------------------------------------------------

    def pause(self) -> None:
        """The host is busy with a train step: decoding stops, KV caches are kept."""
        self.paused = True
        for proc in list(self._decoding):
            proc.interrupt(HOST_BUSY)

    def resume(self) -> None:
        """The train step is over: paused sequences go on where they stopped."""
        if self.paused:
            self.paused = False
            self._notify()

    # --- faults ----------------------------------------------------------------------

    def preempt(self, down_s: float) -> None:
        """Lose the accelerators for ``down_s`` seconds (extends an ongoing downtime)."""
        env = self.env
        self._health.down_until = max(self._health.down_until, env.now + down_s)
        self.sim.counters.preemptions["worker"] += 1
        self.sim.record(self.name, "preemption", self.version, down_s=down_s)
        if not self.up:
            return
        self.up = False
        self._drop_work("preempted")
        env.process(self._restart())

    def _drop_work(self, reason: str) -> None:
        """Loses every group not fully decoded (the buffer re-issues or drops them) and
        the weights; the slots start over (looking for work, pulling first)."""
        env, counters = self.env, self.sim.counters
        self.epoch += 1
        for start in self._decoding.values():
            counters.slot_busy_s += env.now - start
        lost = sorted(self.groups, key=lambda g: g.group_id)
        self.groups.clear()
        self.queue.clear()
        self.returned.clear()
        self._decoding.clear()
        self._add_active(-self.active)
        self.version = None
        self.pulling = False
        self._waits.requesting = False
        self._waits.idle.clear()
        for proc in self.slots:
            proc.interrupt(PREEMPTED)
        if self._pull_proc is not None and self._pull_proc.is_alive:
            self._pull_proc.interrupt(PREEMPTED)
        self.sim.buffer.lose(lost, reason)

    def _restart(self):
        while self.env.now < self._health.down_until:
            yield self.env.timeout(self._health.down_until - self.env.now)
        if not self.up:
            self.up = True
            self.sim.record(self.name, "restart", None)
            self._notify()

    def slow(self, factor: float, duration_s: float) -> None:
        """Decode ``factor`` times slower for sequences starting in the next
        ``duration_s`` seconds."""
        self._health.slow_factor = factor
        self._health.slow_token += 1
        token = self._health.slow_token
        timer = self.env.timeout(duration_s)
        timer.callbacks.append(lambda _event: self._end_slow(token))

    def _end_slow(self, token: int) -> None:
        if token == self._health.slow_token:
            self._health.slow_factor = 1.0
