"""The serial host: rlaxkit's deterministic local runtime, one thread for everything.

``rlaxkit.runtime.local`` in ``deterministic`` mode runs the trainer and every inference
worker in one thread, in a fixed order. Until the buffer yields a full batch it runs
*rounds*; a round is

1. every worker whose weights the ``StalenessPolicy`` calls too old pulls, or, in
   ``between_requests`` mode with sequences still running, stops taking prompts until
   they are done (it pulls in a later round);
2. prompt groups are issued worker by worker while the policy admits more and the
   worker has room (``slots_per_worker // group_size`` groups);
3. every worker with sequences decodes one chunk: ``chunk_steps`` decode steps over all
   its rows at once, fewer when every row stops earlier. The chunk prefills the
   sequences it starts and fetches those that finish; a group whose last sequence
   finished is scored at once and goes to the buffer.

Then the trainer takes its step (compute, push, bookkeeping) and the rounds go on.
One thing overlaps, as in the runtime: in step 3 the workers' chunks decode at once
(``HostSpec.threaded_chunks``, the runtime's ``runtime.threaded_chunks``: a thread and
a core each), or else each worker's chunk is dispatched as soon as the previous
worker's results are fetched, so it decodes while the host scores those; either way
the host fetches and scores the chunks in worker order. Everything else is serial,
each part costed by :class:`~sim.host_spec.HostSpec`.
A sequence of ``t`` completion tokens takes ``t`` decode steps, all rows of a worker
step together, and rows start at chunk boundaries.

This is a different machine from the parallel fleet of :mod:`sim.entities.worker` (per-token
decode, workers and trainer concurrent); it exists to calibrate on, and predict, local
runs. It writes the same trace as the runtime, ``decode`` events included, so a
simulated serial trace calibrates like a real one.

**Faults** fire as the runtime fires them, on its logical clock ``rounds · round_s``
(``rlaxkit.rules.fault_clock.FaultState``, the runtime's own): before a round, due timed
faults fire, then workers whose downtime is over restart empty (they pull before
taking prompts). A
preempted worker's groups are re-issued (the buffer's ``RecoveryPolicy``) and it sits
out the rounds until it is back; a slice takes all its workers. A slowed worker
decodes one chunk every ``factor`` rounds. A preempted trainer takes no batch until
the clock passes its restart time, while the rounds go on; then it restores its last
checkpoint (``restore_s``): the lost steps' groups go back to the buffer, workers
holding weights of the discarded branch drop them and their groups, and the restored
version is pushed. A fault of ``at_step`` fires after that step's compute, before its
push or save (:mod:`sim.entities.trainer`).
"""

from __future__ import annotations

from collections import Counter, deque
from typing import TYPE_CHECKING, TypeAlias

from simpy.events import ProcessGenerator, Timeout

from rlaxkit.rules.fault_plan import Fault
from sim.entities.groups import Group, SimSample

if TYPE_CHECKING:
    from rlaxkit.rules.fault_clock import FaultState
    from sim.entities.context import SimContext

__all__ = ["ChunkWorker", "SerialHost"]

# One chunk of a worker: (duration_s, rows, started, finished samples, decode steps).
_ChunkPlan: TypeAlias = tuple[float, int, int, list[SimSample], int]


class ChunkWorker:
    """One worker of the serial host: its prompt groups and each row's tokens to go."""

    def __init__(self, index: int, capacity: int) -> None:
        self.name = f"worker-{index}"
        self.capacity = capacity
        self.version: int | None = None
        self.lineage = 0
        self.draining = False
        self.groups: list[Group] = []
        self.left: dict[SimSample, int] = {}  # decode steps each running row still needs
        self.unstarted = 0  # sequences issued, prefilled by the next chunk
        self.rebuilt = False  # a pull in flight rebuilt its rows' cache: the next chunk waits
        self.up_at = 0.0  # simulated time at which a restarted worker is up

    @property
    def free(self) -> int:
        """Prompt groups this worker takes now (the runtime's ``InferenceWorker.free``)."""
        if self.draining or self.version is None:
            return 0
        return self.capacity - len(self.groups)


class SerialHost:
    """Runs the local runtime's rounds for the trainer, which calls :meth:`round`."""

    name = "host"

    def __init__(self, sim: SimContext) -> None:
        self.sim = sim
        self.env = sim.env
        self.spec = sim.scenario.host
        self.policy = sim.scenario.staleness
        self._interrupting = sim.scenario.weight_sync.interrupts_generation
        fleet, workload = sim.scenario.fleet, sim.scenario.workload
        capacity = max(1, fleet.slots_per_worker // workload.group_size)
        self.workers = [ChunkWorker(i, capacity) for i in range(fleet.num_workers)]
        self.rounds = 0
        self.round_s = self.spec.round_s
        self.faults: FaultState | None = None  # set by the injector when a plan is given
        self._after_step = False  # the next chunk is the first since a train step

    @property
    def worker_names(self) -> list[str]:
        return [worker.name for worker in self.workers]

    @property
    def now_s(self) -> float:
        """The fault clock: ``rounds · round_s`` (logical seconds)."""
        return self.rounds * self.round_s

    @property
    def trainer_down(self) -> bool:
        return self.faults is not None and self.faults.trainer_down

    def collect_batch(self):
        """Process body: rounds until the buffer yields a batch; returns it. A trainer
        whose downtime is over restores first; a trainer that is down takes none."""
        trainer, buffer = self.sim.trainer, self.sim.buffer
        while True:
            faults = self.faults
            until = None if faults is None else faults.trainer_down_until
            if faults is not None and until is not None and self.now_s >= until:
                faults.trainer_down_until = None
                yield from trainer.restore_serial()
            if not self.trainer_down:
                batch = buffer.take_batch()
                if batch is not None:
                    return batch
            yield from self.round()

    def after_step(self, step: int) -> bool:
        """Fires the faults of ``step`` (after its compute, before its push or save);
        returns whether the trainer is still up."""
        if self.faults is not None:
            for fault in self.faults.due_step(step):
                self.apply(fault)
        return not self.trainer_down

    def note_step(self) -> None:
        """The trainer finished a step (its next chunk starts with cold caches)."""
        self._after_step = True

    def run_ahead(self, step: int) -> ProcessGenerator:
        """Process body (``HostSpec.overlap_training``): the rounds that run while the
        trainer computes ``step``, as the runtime's ``Loop.run_ahead`` runs them: until
        the buffer holds the batch of step ``step + 1`` (``GroupLedger.batch_ready``),
        a round moves nothing, or a fault is due or active (``FaultState.quiet``).
        Returns how many ran."""
        rounds = 0
        ledger = self.sim.buffer.ledger
        while not ledger.batch_ready(step) and (
            self.faults is None or self.faults.quiet(self.now_s)
        ):
            rounds += 1
            moved = yield from self._round(self.now_s, ahead=True)
            self.rounds += 1
            if not moved:
                break
        return rounds

    def round(self):
        """Process body: one round (pulls, issues, one chunk per busy worker).

        Raises:
            RuntimeError: nothing runs and nothing may start, so no batch can ever
                form (the runtime stops with the same diagnosis). A valid scenario
                never gets there; the check stops an endless loop of empty rounds.
        """
        yield from self._round(self.now_s)
        self.rounds += 1  # the fault clock moves at the end of a round, as the runtime's

    def _round(self, now_s: float, ahead: bool = False) -> ProcessGenerator:
        """One round; returns whether it moved anything (issued or decoded). A round
        ``ahead`` of the trainer that moves nothing ends those rounds instead of
        stalling."""
        faults = self.faults
        live = self.workers
        if faults is not None:
            self._before_round(faults, now_s)
            live = [w for w in self.workers if w.name not in faults.worker_down]
        starting = max((w.up_at for w in live), default=0.0) - self.env.now
        if starting > 0:  # a restarted worker's first pull waits for it to be up
            yield self.env.timeout(starting)
        if self.spec.concurrent_chunks:  # every worker pulls in its own process
            yield self.env.all_of([self.env.process(self._sync(w)) for w in live])
        else:
            for worker in live:
                yield from self._sync(worker)
        issued = self._issue(live)
        if issued and self.spec.issue_s_per_seq:
            yield self._work(self.spec.issue_s_per_seq * issued)
        chunked = live
        if faults is not None:  # every live worker's credit moves, busy or not
            chunked = [w for w in live if faults.takes_chunk(w.name, now_s)]
        busy = [worker for worker in chunked if worker.left]
        if not busy:
            if ahead:
                return bool(issued)
            if faults is not None and (faults.waiting() or any(w.left for w in live) or issued):
                return bool(issued)  # something comes back later, or a slowed worker holds work
            raise RuntimeError(
                "the simulated local loop stalled: no sequence runs and admission lets "
                f"none start (buffer: {len(self.sim.buffer.ready)} ready groups, batch "
                f"{self.policy.batch_size}); check staleness.batch_size against "
                "fleet.num_workers * slots_per_worker / workload.group_size"
            )
        # The first chunk after a train step starts with cold caches: each worker's
        # when they decode at once, the first one's when they take turns.
        first, spec = self._after_step, self.spec
        threaded = spec.threaded_chunks
        plans = [
            self._plan_chunk(worker, first and (i == 0 or spec.concurrent_chunks or threaded))
            for i, worker in enumerate(busy)
        ]
        self._after_step = False
        if spec.concurrent_chunks:
            yield from self._concurrent_chunks(busy, plans)
            return True
        if spec.serial_chunks:  # one piece of work at a time (a CPU-time clock)
            for worker, plan in zip(busy, plans, strict=True):
                plan = self._dilated(plan)
                yield self.env.timeout(plan[0])
                self._record_chunk(worker, plan, plan[0], pipelined=False)
                yield from self._finish_chunk(worker, plan)
            return True
        # As the runtime does: threaded, every chunk starts now; else each is
        # dispatched when the previous worker's results are fetched, and decodes while
        # the host scores them.
        start = self.env.now
        plans[0] = self._dilated(plans[0])
        done = start + plans[0][0]
        for i, (worker, plan) in enumerate(zip(busy, plans, strict=True)):
            waited_from = self.env.now
            if done > self.env.now:
                yield self.env.timeout(done - self.env.now)
            self._record_chunk(worker, plan, self.env.now - waited_from, pipelined=i > 0)
            if i + 1 < len(busy):
                if not threaded:  # dispatched now: a background write slows it from now
                    plans[i + 1] = self._dilated(plans[i + 1])
                done = (start if threaded else self.env.now) + plans[i + 1][0]
            yield from self._finish_chunk(worker, plan)
        return True

    def _work(self, seconds: float) -> Timeout:
        """A timeout for ``seconds`` of the host's work, slowed by a checkpoint's
        background write (:class:`sim.entities.trainer.CheckpointWrites`)."""
        return self.env.timeout(self.sim.trainer.writes.dilate(seconds))

    def _dilated(self, plan: _ChunkPlan) -> _ChunkPlan:
        """``plan`` with its duration slowed by a background write from now."""
        return (self.sim.trainer.writes.dilate(plan[0]), *plan[1:])

    def _concurrent_chunks(
        self, busy: list[ChunkWorker], plans: list[_ChunkPlan]
    ) -> ProcessGenerator:
        """Every busy worker decodes and scores its chunk at once (the Ray placement);
        the round waits for the slowest, then the driver takes the results in turn."""

        def work(worker: ChunkWorker, plan: _ChunkPlan) -> ProcessGenerator:
            plan = self._dilated(plan)
            yield self.env.timeout(plan[0])
            self._record_chunk(worker, plan, plan[0], pipelined=False)
            done = Counter(sample.group for sample in plan[3])
            scored = sum(len(g.samples) for g, n in done.items() if g.unfinished == n)
            if scored and self.spec.score_time_s(scored):
                yield self._work(self.spec.score_time_s(scored))

        yield self.env.all_of(
            [self.env.process(work(w, p)) for w, p in zip(busy, plans, strict=True)]
        )
        for i, (worker, plan) in enumerate(zip(busy, plans, strict=True)):
            yield from self._finish_chunk(worker, plan, scoring=False, per_chunk=i == 0)

    # --- faults ----------------------------------------------------------------------

    def _before_round(self, faults: FaultState, now_s: float) -> None:
        """Fires the due timed faults, then restarts the workers that are due back."""
        for fault in faults.due_timed(now_s):
            self.apply(fault)
        for name, until in sorted(faults.worker_down.items()):
            if now_s >= until:
                del faults.worker_down[name]
                worker = next(w for w in self.workers if w.name == name)
                worker.up_at = self.env.now + self.spec.worker_start_s
                self.sim.record(name, "restart", None)

    def apply(self, fault: Fault) -> None:
        """Injects one fault of a kind the serial host replays (``SERIAL_FAULT_KINDS``)."""
        faults, sim = self.faults, self.sim
        assert faults is not None
        kind, down_s = fault.kind, faults.downtime(fault)
        if kind in ("preempt_worker", "preempt_slice"):
            sim.counters.preemptions["slice" if kind == "preempt_slice" else "worker"] += 1
            for name in faults.targets(fault):
                self._preempt_worker(name, down_s)
        elif kind == "preempt_trainer":
            sim.counters.preemptions["trainer"] += 1
            was_up = faults.preempt_trainer(self.now_s, down_s)
            trainer = sim.trainer
            lost = trainer.version - trainer.last_save_step if was_up else 0
            sim.record(trainer.name, "preemption", trainer.version, lost_steps=lost)
        elif kind == "slow_worker":
            assert fault.target and fault.factor and fault.duration_s is not None
            faults.slow[fault.target] = [fault.factor, self.now_s + fault.duration_s, 0.0]
            sim.record(fault.target, "fault", None, fault=kind, factor=fault.factor)

    def _preempt_worker(self, name: str, down_s: float) -> None:
        """The worker loses its weights and groups (re-issued, same ids) until the fault
        clock passes ``now + down_s``."""
        faults = self.faults
        assert faults is not None
        worker = next(w for w in self.workers if w.name == name)
        faults.worker_down[name] = self.now_s + down_s
        lost = self.drop(worker)
        self.lose(lost, "preempted")
        self.sim.record(name, "preemption", None, reissued=len(lost), down_s=down_s)

    @staticmethod
    def drop(worker: ChunkWorker) -> list[Group]:
        """Empties ``worker`` (no weights, no groups); returns its groups by id."""
        lost = sorted(worker.groups, key=lambda group: group.group_id)
        worker.version, worker.draining = None, False
        worker.groups, worker.left, worker.unstarted, worker.rebuilt = [], {}, 0, False
        return lost

    def lose(self, groups: list[Group], reason: str) -> None:
        """Hands lost groups to the buffer; its re-issue queue is kept in id order, as
        the runtime's controller keeps its own."""
        buffer = self.sim.buffer
        buffer.lose(groups, reason)
        buffer.reissue = deque(sorted(buffer.reissue, key=lambda group: group.group_id))

    def on_restore(self, step: int) -> None:
        """The trainer restored checkpoint ``step``: the buffer rolls its books back and
        loses the groups sampled from newer weights; workers holding such weights drop
        them (they pull the restored version before taking prompts)."""
        buffer = self.sim.buffer
        buffer.on_restore(step)
        buffer.reissue = deque(sorted(buffer.reissue, key=lambda group: group.group_id))
        for worker in self.workers:
            if worker.version is not None and worker.version > step:
                self.drop(worker)

    # --- the phases of a round ---------------------------------------------------------

    def _sync(self, worker: ChunkWorker) -> ProcessGenerator:
        ps = self.sim.ps
        weight_sync = self.sim.scenario.weight_sync
        action = weight_sync.sync_action(
            self.policy, worker.version, ps.latest, busy=bool(worker.groups)
        )
        if action != "pull":
            worker.draining = worker.draining or action == "drain"
            return
        start = self.env.now
        from_version = worker.version
        version, lineage, nbytes = yield from ps.pull(worker.name, (worker.version, worker.lineage))
        worker.version, worker.lineage, worker.draining = version, lineage, False
        for group in worker.groups:  # in flight: their next tokens come from it
            group.note_version(version, lineage)
        # In flight, the rows started so far get their cache rebuilt (the runtime's
        # ``InferenceEngine.update_weights(..., recompute_cache=True)``).
        rebuilt = len(worker.left) - worker.unstarted
        worker.rebuilt = worker.rebuilt or rebuilt > 0
        self.sim.record(
            worker.name,
            "pull",
            version,
            duration_s=self.env.now - start,
            from_version=from_version,
            bytes=nbytes,
            **({"rebuilt": rebuilt} if rebuilt > 0 else {}),
        )

    def _issue(self, live: list[ChunkWorker]) -> int:
        """Issues prompt groups to the ``live`` workers as the runtime does; returns the
        sequences issued."""
        buffer = self.sim.buffer
        issued = 0
        for worker in live:
            version = worker.version
            if version is None:
                continue  # no weights yet: it takes no prompts (``free`` is 0)
            for _ in range(worker.free):
                group = buffer.try_start(worker.name)
                if group is None:
                    return issued
                group.started = True
                group.note_version(version, worker.lineage)
                worker.groups.append(group)
                worker.unstarted += len(group.samples)
                issued += len(group.samples)
                for sample in group.samples:
                    worker.left[sample] = sample.tokens
                for sample in group.samples:
                    self.sim.record_start(worker.name, version, sample, len(worker.left))
        return issued

    def _plan_chunk(self, worker: ChunkWorker, after_step: bool) -> _ChunkPlan:
        """Advances ``worker``'s rows by one chunk; returns ``(duration, rows, started,
        finished, steps)`` of the chunk."""
        spec = self.spec
        left = worker.left
        rows, started = len(left), worker.unstarted
        steps = min(spec.chunk_steps, max(left.values()))
        finished = [sample for sample, n in left.items() if n <= steps]
        for sample in left:
            left[sample] -= steps
        for sample in finished:
            del left[sample]
        worker.unstarted = 0
        duration = spec.chunk_time_s(
            steps, started, len(finished), after_step=after_step, rebuilt=worker.rebuilt
        )
        worker.rebuilt = False
        return duration, rows, started, finished, steps

    def _record_chunk(
        self, worker: ChunkWorker, plan: _ChunkPlan, waited_s: float, pipelined: bool
    ) -> None:
        """The chunk's ``decode`` event, as the runtime writes it: a chunk dispatched
        before the host finished with the previous worker's (``pipelined``) is timed by
        the wait left."""
        duration, rows, started, finished, steps = plan
        self.sim.counters.slot_busy_s += duration * rows
        self.sim.record(
            worker.name,
            "decode",
            worker.version,
            duration_s=waited_s if pipelined else duration,
            rows=rows,
            started=started,
            finished=len(finished),
            steps=steps,
            **({"pipelined": True} if pipelined else {}),
        )

    def _finish_chunk(
        self, worker: ChunkWorker, plan: _ChunkPlan, *, scoring: bool = True, per_chunk: bool = True
    ) -> ProcessGenerator:
        """Process body: delivers what the chunk finished, scoring and buffering the
        groups it completed. ``scoring``: the host waits for the scoring here (else the
        worker scored in its own time); ``per_chunk``: the host pays ``chunk_host_s``."""
        spec, sim = self.spec, self.sim
        chunk_host_s = spec.chunk_host_s if per_chunk else 0.0
        counters = sim.counters
        finished = plan[3]
        for sample in finished:
            group = sample.group
            group.unfinished -= 1
            group.tokens += sample.prompt_tokens + sample.tokens
            counters.samples_generated += 1
            counters.tokens_generated += sample.tokens
        complete = [group for group in worker.groups if group.unfinished == 0]
        if not complete:
            if chunk_host_s:
                yield self._work(chunk_host_s)
            return
        worker.groups = [group for group in worker.groups if group.unfinished > 0]
        scored = sum(len(group.samples) for group in complete)
        score_s = spec.score_time_s(scored)
        if score_s and scoring:
            yield self._work(score_s)
        sim.record(
            "verifier",
            "reward",
            None,
            sample=str(complete[0].group_id),
            duration_s=score_s,
            samples=scored,
        )
        for group in complete:
            first_version, last_version = group.versions
            for sample in group.samples:
                sim.record_end(worker.name, last_version, sample, first_version)
        host_s = chunk_host_s + spec.sample_s * scored
        if host_s:
            yield self._work(host_s)
        for group in complete:
            group.unscored = 0
            sim.buffer.deliver(group)
