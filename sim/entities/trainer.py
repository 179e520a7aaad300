"""The simulated trainer: batches in, steps, pushes, checkpoints, preemptions.

One process loops: wait for a full batch (on a serial host, run the host's rounds
until there is one: :mod:`sim.entities.host`), compute for ``TrainerCostSpec.step_s(tokens)``,
bump the version, push when ``WeightSyncPolicy.should_push`` says so (the push blocks
the trainer for its transfer), save when ``CheckpointPolicy.should_save`` says so (the
save blocks it for ``save_s``, then its background write slows the work beside it:
:class:`CheckpointWrites`).

A preemption is a ``simpy.Interrupt`` of that process: the steps since the last
checkpoint are lost (their compute counts against goodput; the batch being computed is
one of them), the trainer is down for ``restart_s``, restores for ``restore_s``, hands
the lost steps' groups back to the buffer (``RecoveryPolicy.trainer_lost``, as the
runtime does), pushes the restored weights as a new lineage and goes on. What the
checkpoint holds is kept; a preemption during the restore starts the recovery over.

On a serial host nothing interrupts the trainer: the host fires faults between its
rounds and after a step's compute, as the deterministic runtime does (:mod:`sim.entities.host`).
A preempted trainer keeps its steps until its restart time on the logical clock has
come, then restores (:meth:`Trainer.restore_serial`) and loses them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import simpy
from simpy.events import ProcessGenerator

from rlaxkit.rules.trace import TraceEvent

if TYPE_CHECKING:
    from sim.entities.context import SimContext

__all__ = ["CheckpointWrites", "Trainer"]

PREEMPTED = "preempted"


class CheckpointWrites:
    """The background write of the trainer's newest save, beside the host's work.

    A write takes the share ``s = background_s / write_s`` of the trainer host's time
    for ``write_s`` seconds (:class:`sim.specs.CheckpointSpec`): work that starts in
    that span runs at ``1 - s`` of its speed until the write ends (:meth:`dilate`).
    The trainer's compute is slowed so, and on a serial host every cost of the host
    (its one thread carries all of them, as the process's CPU clock adds up every
    thread's time). The write is assumed to keep its share to its end, whether the
    host works or waits meanwhile.

    >>> from sim import presets
    >>> from sim.engine import Simulation
    >>> from sim.specs import CheckpointSpec
    >>> scenario = presets.toy(checkpoint=CheckpointSpec(background_s=1.0, write_s=4.0))
    >>> writes = Simulation(scenario).trainer.writes
    >>> writes.start()  # at 0 s: a quarter of the host's time until 4 s
    4.0
    >>> writes.dilate(1.5), writes.dilate(6.0)  # 3 s of work fit in the span
    (2.0, 7.0)
    """

    def __init__(self, sim: SimContext) -> None:
        self.env = sim.env
        self.spec = sim.scenario.checkpoint
        self.until_s = float("-inf")  # when the newest write ends

    def start(self) -> float:
        """Starts a write now (a share below 1); returns when it ends."""
        self.until_s = self.env.now + self.spec.write_s
        return self.until_s

    def dilate(self, seconds: float) -> float:
        """Seconds that ``seconds`` of the host's work starting now takes."""
        now, until = self.env.now, self.until_s
        if seconds <= 0 or now >= until:
            return seconds
        speed = 1.0 - self.spec.write_share
        fits = (until - now) * speed  # work done before the write ends
        return seconds / speed if seconds <= fits else until - now + seconds - fits


class Trainer:
    """The master trainer; ``version`` counts its surviving steps."""

    name = "trainer"

    def __init__(self, sim: SimContext) -> None:
        self.sim = sim
        self.env = sim.env
        self.spec = sim.scenario.trainer
        self.version = 0
        self.last_save_step = 0
        self.last_save_s = 0.0
        self.up = True
        self._recovering = False
        self._down_until = 0.0
        self.writes = CheckpointWrites(sim)
        self.done = self.env.event()
        self.process = self.env.process(self._run())

    def _run(self):
        target = self.sim.scenario.target_steps
        host = self.sim.host
        # A trainer preempted after the last step restores and redoes its lost steps, as
        # the runtime's does (``Loop.more_steps``).
        while target is None or self.version < target or (host is not None and host.trainer_down):
            try:
                if self._recovering:
                    yield from self._recover()
                else:
                    yield from self._step()
            except simpy.Interrupt:
                self._lose_progress()
        self.done.succeed()

    def _step(self):
        env = self.env
        sim = self.sim
        buffer = sim.buffer
        host = sim.host
        if host is not None:  # one thread: the trainer's wait is the host's rounds
            batch = yield from host.collect_batch()
        else:
            batch = buffer.take_batch()
            while batch is None:
                yield buffer.wait_batch()
                batch = buffer.take_batch()
        tokens = sum(group.tokens for group in batch)
        samples = sum(len(group.samples) for group in batch)
        compute_s = self.writes.dilate(self.spec.step_s(tokens))
        faults = None if host is None else host.faults
        computed_at = None  # with rounds beside the compute: when it ended
        if (
            host is not None
            and host.spec.overlap_training
            and (faults is None or not faults.step_pending(self.version + 1))
        ):
            # The next batch's rounds beside the compute (``Loop.run_ahead``); the
            # version moves, and the push goes, once both are done.
            computed = env.timeout(compute_s)
            computed_at = env.now + compute_s
            yield from host.run_ahead(self.version + 1)
            yield computed
        elif self.spec.pauses_fleet:
            for worker in sim.workers:
                worker.pause()
            try:
                yield env.timeout(compute_s)
            finally:
                for worker in sim.workers:
                    worker.resume()
        else:
            yield env.timeout(compute_s)
        if host is not None:
            host.note_step()
            if host.spec.step_s:
                yield env.timeout(self.writes.dilate(host.spec.step_s))
        self.version += 1
        staleness = [self.version - 1 - group.versions[0] for group in batch]
        sim.counters.record_step((compute_s, samples, tokens, env.now), staleness)
        sim.record(
            self.name,
            "train_step",
            self.version,
            step=self.version,
            samples=samples,
            groups=len(batch),
            tokens=tokens,
            duration_s=compute_s,
            staleness=staleness,
            **({} if computed_at is None else {"after_s": env.now - computed_at}),
        )
        buffer.on_step(self.version)
        up = True
        now_s = env.now
        if host is not None:  # faults of this step fire before its push or save
            up = host.after_step(self.version)
            now_s = host.now_s  # checkpoint intervals run on the logical clock there
        else:
            sim.injector.on_step(self.version)
        if up and sim.scenario.weight_sync.should_push(self.version):
            yield from sim.ps.push(self.version)
        policy = sim.scenario.checkpointing
        if up and policy.should_save(self.version, now_s, self.last_save_step, self.last_save_s):
            yield from self._save(now_s)

    def _save(self, now_s: float) -> ProcessGenerator:
        """Process body: a save's blocking part (after the previous write, as Orbax's
        save waits for it), after which the checkpoint counts, then its background
        write (:class:`CheckpointWrites`; with a share of 1 the trainer waits it)."""
        env, sim, spec = self.env, self.sim, self.sim.scenario.checkpoint
        start = env.now
        if self.writes.until_s > env.now:
            yield env.timeout(self.writes.until_s - env.now)
        yield env.timeout(spec.save_s)
        self.last_save_step = self.version
        self.last_save_s = now_s
        sim.buffer.on_save(self.version)
        step = self.version
        sim.record(self.name, "checkpoint_save", step, step=step, duration_s=env.now - start)
        if not spec.background_s:
            return
        if spec.write_share < 1.0:
            env.process(self._written(step, env.now, self.writes.start()))
        else:
            yield env.timeout(spec.background_s)
            sim.record(self.name, "checkpoint_write", step, step=step, duration_s=spec.background_s)

    def _written(self, step: int, returned_s: float, until_s: float) -> ProcessGenerator:
        """Process body: the ``checkpoint_write`` event at the write's end."""
        yield self.env.timeout(until_s - self.env.now)
        duration_s = until_s - returned_s
        self.sim.record(self.name, "checkpoint_write", step, step=step, duration_s=duration_s)

    def _lose_progress(self) -> None:
        """Drop the steps after the last checkpoint (called on a preemption)."""
        lost = self.version - self.last_save_step
        self.sim.counters.rollback(self.last_save_step)
        self.version = self.last_save_step
        self._recovering = True
        self.sim.record(self.name, "preemption", self.version, lost_steps=lost)

    def _recover(self):
        env = self.env
        sim = self.sim
        while env.now < self._down_until:
            yield env.timeout(self._down_until - env.now)
        self.up = True
        sim.record(self.name, "restart", self.version)
        start = env.now
        yield env.timeout(sim.scenario.checkpoint.restore_s)
        sim.record(
            self.name,
            "checkpoint_restore",
            self.version,
            step=self.version,
            duration_s=env.now - start,
        )
        self._recovering = False
        sim.buffer.on_restore(self.version)
        sim.ps.rollback(self.version)
        yield from sim.ps.push(self.version)

    def restore_serial(self):
        """Process body (serial host): the trainer is back after its downtime and
        restores its last checkpoint; the steps since are lost (their compute counts
        against goodput), their groups go back to the buffer, workers holding newer
        weights drop them and their groups, and the restored version is pushed as a new
        lineage (the runtime's ``restore_trainer_if_due``)."""
        env, sim = self.env, self.sim
        host = sim.host
        assert host is not None
        sim.record(self.name, "restart", self.version)
        start = env.now
        yield env.timeout(sim.scenario.checkpoint.restore_s)
        step = self.last_save_step
        _discard_steps(sim, set(range(step + 1, self.version + 1)))
        sim.counters.rollback(step)
        self.version = step
        sim.record(self.name, "checkpoint_restore", step, step=step, duration_s=env.now - start)
        host.on_restore(step)
        sim.ps.rollback(step)
        yield from sim.ps.push(step)

    def preempt(self, down_s: float) -> None:
        """Take the trainer down for ``down_s`` seconds; it loses unsaved steps."""
        self._down_until = max(self._down_until, self.env.now + down_s)
        self.sim.counters.preemptions["trainer"] += 1
        if self.process.is_alive:
            self.up = False
            self.process.interrupt(PREEMPTED)


def _discard_steps(sim: SimContext, steps: set[int]) -> None:
    """Marks the ``train_step`` events of ``steps`` ``discarded`` (a restore went back
    over them), as the runtime marks its own, so that summaries of the trace count only
    kept steps. Only a trace kept in memory can be marked; a file's stays as written."""
    events = getattr(sim.trace, "events", None)
    if not isinstance(events, list) or not steps:
        return
    for i, event in enumerate(events):
        if event.kind == "train_step" and not event.discarded and event.get("step") in steps:
            events[i] = TraceEvent(
                event.t, event.kind, event.actor, event.version, {**event.fields, "discarded": True}
            )
