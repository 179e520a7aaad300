"""The loop of an RL run, written once for every placement (``Loop``; the run itself is
``rlaxkit.runtime.driver.Experiment``; docs/architecture.md walks one step through it).

One round (``round``): due faults fire; every live worker pulls if its
``StalenessPolicy`` says it lags too far; the controller issues prompts in worker order
while the policy admits more (re-issued prompts need no new room); every live worker
starts its prompts and decodes one chunk, and finished, scored rollouts go to the
buffer in worker order. When the buffer yields a batch the trainer steps, pushes per
the ``WeightSyncPolicy`` and the run checkpoints per the ``CheckpointPolicy``. In
``deterministic`` mode the order of everything is fixed, so a seed fixes every metric
but wall-clock timings, on either placement; the fault clock is then logical
(``rounds · runtime.round_s``).

With ``runtime.overlap_training`` the rounds of the next batch run while the trainer
takes a step (``Loop.run_ahead``), on the weights published before it, and the step's
push waits for them; their number is set by the buffer, never the clock.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlaxkit.api import Fleet, SyncReply, TrainerClient, Work
from rlaxkit.config.run import RunConfig
from rlaxkit.data.batch import collate
from rlaxkit.data.buffer import RolloutBuffer
from rlaxkit.data.rollout import Rollout, RolloutGroup
from rlaxkit.observe.tracking import Trackers
from rlaxkit.rules.audit import AuditBook, AuditRecord
from rlaxkit.rules.books import RunBooks
from rlaxkit.rules.controller import Issue, PromptController
from rlaxkit.rules.stalls import drop_patience, drops_error, stall_error
from rlaxkit.rules.validation import is_int
from rlaxkit.runtime.common import TRAIN_BUCKETS, RunTrace
from rlaxkit.runtime.faults import NoFaults
from rlaxkit.runtime.hooks import Hook, StepDone, own_hooks
from rlaxkit.runtime.parts import Parts
from rlaxkit.tasks import REWARD_FAILURES, Problem

SYNC_ATTEMPTS = 10  # syncs per round before a worker is left to retry next round


class Loop(abc.ABC):
    """The loop over a placement's parts, and the state it keeps between steps.

    ``Experiment`` builds the parts (the fleet and trainer client among them), the
    books, the trace (its lock is ``lock``, which concurrent mode's threads take), the
    fault injector, problems, controller, buffer, audit and trackers, and hands them
    over with ``t0``, when the run's clock started; the loop adds what it owns: the
    newest published version, the last batch and the hooks after a step
    (``rlaxkit.runtime.hooks``). How a run is saved is the subclass's
    (``save_checkpoint``).
    """

    def __init__(
        self,
        config: RunConfig,
        *,
        run_dir: Path | None,
        lock: threading.RLock,
        trace: RunTrace,
        books: RunBooks,
        faults: NoFaults,
        parts: Parts,
        problems: list[Problem],
        controller: PromptController,
        buffer: RolloutBuffer,
        audit: AuditBook,
        logger: Trackers,
        t0: float,
    ):
        self.config, self.run_dir, self.lock, self._t0 = config, run_dir, lock, t0
        self.trace, self.books, self.faults, self.parts = trace, books, faults, parts
        self.fleet: Fleet = parts.fleet
        self.trainer: TrainerClient = parts.trainer
        self.problems, self.controller, self.buffer = problems, controller, buffer
        self.buffer.ledger.on_drop = self.drop_event
        self.audit, self.logger = audit, logger
        self.published = 0  # the newest version the trainer published
        self.last_batch: dict[str, object] | None = None
        self.hooks: list[Hook] = own_hooks(self)  # after each step; ``add_hook`` adds more

    @property
    def version(self) -> int:
        """The trainer's weight version (train steps kept)."""
        return self.books.version

    @abc.abstractmethod
    def save_checkpoint(self, wait: bool = True) -> bool:
        """Saves the run as checkpoint ``version``; whether it did."""

    def clock(self) -> float:
        """Wall seconds since this process started the run."""
        return time.perf_counter() - self._t0

    def fault_now(self) -> float:
        """The fault clock: ``rounds · runtime.round_s`` (logical) in deterministic mode."""
        return self.books.rounds * self.config.runtime.round_s

    # -- the loop ----------------------------------------------------------------------
    def issue(self, rooms: dict[str, int], published: int | None) -> dict[str, list[Work]]:
        """Prompts per worker, in worker order, while the staleness policy admits more."""
        policy, work = self.config.staleness, {}
        for worker_id, free in rooms.items():
            # Re-issued prompts are already counted in flight: they need no new room.
            capacity = policy.capacity(self.buffer.accepted, self.buffer.in_flight, published or 0)
            room = min(free, capacity + len(self.controller.reissue))
            items = []
            for issue in self.controller.next_issues(room) if room > 0 else []:
                problem = self.problems[issue.problem_index]
                if not self.buffer.is_in_flight(issue.group_id):  # else: a re-issue
                    self.buffer.issue(issue.group_id, problem.id)
                items.append(Work(issue, problem))
            work[worker_id] = items
        return work

    def admit(self, rollouts: list[Rollout]) -> None:
        """Books finished rollouts in the buffer (a drop is traced with its reason)."""
        for rollout in rollouts:
            self.buffer.add(rollout, self.version)  # a drop is traced by drop_event
            self.audit.finished(AuditRecord.of(rollout))
            self.books.window.samples += 1
            reason = rollout.reward_info["reason"]
            if reason in REWARD_FAILURES and self.books.first_reward_error is None:
                detail = rollout.reward_info.get("detail")
                self.books.first_reward_error = f"{reason}: {detail}" if detail else reason

    def drop_event(self, group_id: int, reason: str, version: int | None = None) -> None:
        """Traces a drop (the buffer's books call it for every one)."""
        self.trace.record(self.clock(), "drop", "buffer", version, reason=reason, rollout=group_id)

    def requeue(self, lost: list[Issue], reason: str = "preempted") -> None:
        """Prompts a worker lost go back to the controller (same ids and seeds), or are
        dropped with ``reason``, as ``RecoveryPolicy.worker_lost`` says."""
        again = set(self.buffer.lose([issue.group_id for issue in lost], reason))
        self.books.reissued += len(again)
        self.controller.requeue([issue for issue in lost if issue.group_id in again])

    def round(self) -> bool:
        """One round over the fleet; whether anything moved (``step`` repeats it)."""
        now = self.fault_now()
        self.faults.before_round(self, now)
        published = self.ensure_published()
        live = self.faults.live(self.fleet.worker_ids())
        rooms = self.sync(live)
        work = self.issue({w: reply.free for w, reply in rooms.items()}, published)
        progressed = any(work.values())
        chunked = self.faults.chunked(list(rooms), now)
        replies = self.fleet.step(work, chunked)
        self._requeue_dead()
        for _, reply in replies:
            progressed |= bool(reply.rollouts) or reply.busy
            self.admit(list(reply.rollouts))
        self.books.rounds += 1
        return progressed

    def sync(self, live: list[str]) -> dict[str, SyncReply]:
        """Every live worker pulls if it must. A worker whose sync could not do what the
        deterministic loop would (``SyncReply.retry``: weights lost with a dead trainer,
        an empty store while the parameter server restarts) changed nothing: the trainer
        publishes again and the worker syncs again, so the round stays the same."""
        rooms = self.fleet.sync(live)
        for _ in range(SYNC_ATTEMPTS):
            retry = [w for w, reply in rooms.items() if reply.retry]
            if not retry or self.faults.trainer_down():
                break
            if any(rooms[w].weights_lost for w in retry):
                self.note_published(self.trainer.publish(self.version))  # heals a dead trainer
            self.ensure_published()
            rooms |= self.fleet.sync(retry)
        self._requeue_dead()
        return {w: rooms[w] for w in self.fleet.worker_ids() if w in rooms}

    def _requeue_dead(self) -> None:
        for worker_id, lost in self.fleet.take_lost():
            self.books.preemptions["worker"] += 1  # no plan killed it: it died
            self.lose_worker(worker_id, lost, reason="actor_died")

    def roll_back(self, step: int) -> None:
        """The trainer restored checkpoint ``step``: the steps after it leave the books,
        metrics.jsonl and the history (each step stays once, as a resumed run leaves
        them; ``Trackers.roll_back`` says what external trackers keep) and their
        ``train_step`` events are marked ``discarded``; their groups go back to the
        buffer or are dropped (``RecoveryPolicy.trainer_lost``), and so does the work
        of workers holding weights of the discarded branch."""
        discarded = set(range(step + 1, self.version + 1))
        self.books.roll_back(step)
        self.logger.roll_back(step, self.books.history)
        self.trace.discard_steps(discarded)
        self.buffer.rollback(step)
        void = [  # sampled from weights of the discarded branch
            issue
            for worker_id, version in self.fleet.versions().items()
            if version is not None and version > step
            for issue in self.fleet.drop_weights(worker_id)
        ]
        # In id order, as the simulator requeues them (``SimBuffer.on_restore``, sim/entities).
        self.requeue(sorted(void, key=lambda issue: issue.group_id), reason="rolled_back")

    def lose_worker(self, worker_id: str, lost: list[Issue], **fields: object) -> None:
        """A worker left the fleet or went down: its prompts are re-issued (or dropped,
        per ``RecoveryPolicy.worker_lost``), and the trace records a ``preemption`` with
        ``fields`` (its reason, downtime)."""
        self.requeue(lost)
        self.trace.record(self.clock(), "preemption", worker_id, None, reissued=len(lost), **fields)

    def note_published(self, version: int | None) -> None:
        """The store holds ``version`` now (``None``: nothing yet; the next round's
        :meth:`ensure_published` publishes again)."""
        if version is not None:
            self.published = version

    def ensure_published(self) -> int | None:
        """The published version; has the trainer publish again if the store lost it
        (a parameter server restarted empty). While an injected outage holds a push back,
        the store is behind but has lost nothing: it publishes the push when it is back."""
        latest = self.parts.store.latest_version()
        if self.faults.trainer_down() or self.faults.store_down():
            return latest
        if latest is not None and latest >= self.published:
            self.note_published(latest)  # a push an outage held back, published since
            return latest
        self.trace.record(self.clock(), "restart", "param_server", latest)
        version = self.trainer.publish(self.version)
        self.note_published(version)
        return version

    def collect_batch(self) -> list[RolloutGroup]:
        """Rounds until the buffer yields a batch for the trainer's version.

        Raises:
            RuntimeError: the loop stalled (nothing in flight, no batch), or too many
                groups in a row were dropped.
        """
        if self.parts.collector is not None:  # concurrent mode: threads run the rounds
            return self.parts.collector.collect(self)
        idle_rounds, dropped_before = 0, len(self.buffer.dropped)
        while True:
            self.faults.restore_trainer_if_due(self)
            if not self.faults.trainer_down():
                batch = self.buffer.take_batch(self.version)
                if batch is not None:
                    return batch
            progressed = self.round()
            self.check_drops(dropped_before)
            waiting = self.faults.waiting()
            idle_rounds = 0 if progressed or waiting else idle_rounds + 1
            if idle_rounds > 2:
                raise stall_error(self.buffer.counts())

    def run_ahead(self, step: int, stop: threading.Event) -> int:
        """With ``runtime.overlap_training``: the rounds that run while the trainer takes
        ``step``, on the weights published before it (the step's push waits for them),
        until the buffer holds the batch of step ``step + 1``, a round moves nothing, a
        fault is due or something is down (faults fire between steps), or ``stop`` is set
        (the step failed). A count ends them, never the clock. Returns how many ran."""
        rounds = 0
        while (
            not stop.is_set()
            and not self.buffer.batch_ready(step)
            and self.faults.quiet(self.fault_now())
        ):
            rounds += 1
            if not self.round():
                break
        return rounds

    def step(self) -> dict[str, Any]:
        """Runs until the trainer has taken one step; returns its metrics.

        collect → collate → train → faults → push → hooks (``rlaxkit.runtime.hooks``)."""
        t_start = self.clock()
        groups = self.collect_batch()
        t_gen = self.clock()
        samples = [r for g in groups for r in g.rollouts]
        batch = collate(samples, bucket=TRAIN_BUCKETS, pad_token_id=self.parts.tokenizer.pad_id)
        step = self.version + 1
        due = self.faults.due_step(step)
        push = self.config.weight_sync.should_push(step)
        ahead = []  # rounds run while the trainer took the step
        during = None
        if self.config.runtime.overlap_training and not due and self.parts.collector is None:
            during = lambda stop: ahead.append(self.run_ahead(step, stop))  # noqa: E731
        # Held back while rounds run beside the step: they sample the weights before it.
        held = bool(due) or during is not None
        t_call = self.clock()
        result = self.trainer.train(batch, step, push and not held, during)
        self.books.record_step(result.duration_s)
        t_train = self.clock()
        for fault in due:  # after the step, before its push or save
            self.faults.apply(self, fault)
        trainer_up = not self.faults.trainer_down()
        if push and trainer_up:
            if held:
                self.note_published(self.trainer.publish(step))
            elif not self.faults.store_down():  # else an injected outage holds it back
                self.note_published(step)
        if self.parts.collector is not None:
            self.parts.collector.wake()  # more admission room, newer weights to pull
        times = (t_start, t_gen, t_call, t_train)
        done = StepDone(
            step, groups, samples, batch, result, times, ahead[0] if ahead else None, trainer_up
        )
        for hook in self.hooks:
            if hook.due(step):
                hook.call(done)
        return done.metrics

    def add_hook(self, call: Callable[[StepDone], object], every: int = 1, name: str = "") -> Hook:
        """Calls ``call(done)`` (a ``StepDone``) after every ``every``-th step, after the
        run's own hooks; returns the ``Hook`` (``hooks.remove`` takes it out)."""
        hook = Hook(name or getattr(call, "__name__", "hook"), call, every)
        self.hooks.append(hook)
        return hook

    def run(self, steps: int | None = None) -> list[dict[str, Any]]:
        """Steps until the version is ``steps`` more than now (default: until it reaches
        ``config.steps``); returns every step's metrics. A trainer restore sets the
        version back, so this may take more than ``steps`` steps."""
        target = self.config.steps if steps is None else self.version + steps
        out = []
        while self.more_steps(target):
            out.append(self.step())
        return out

    def more_steps(self, target: int) -> bool:
        """Whether the run has fewer than ``target`` kept steps, once a trainer a fault
        took down has restored (``wait_for_trainer``): a preemption after the last step
        loses the steps since the checkpoint like any other, and they are done again."""
        self.wait_for_trainer()
        return self.version < target

    def wait_for_trainer(self) -> None:
        """Rounds (the fleet generates on, the fault clock moves) until a trainer that a
        fault took down has restored its checkpoint; nothing while it is up."""
        idle_rounds = 0
        while True:
            self.faults.restore_trainer_if_due(self)
            if not self.faults.trainer_down():
                return
            progressed = self.round()
            idle_rounds = 0 if progressed or self.faults.waiting() else idle_rounds + 1
            if idle_rounds > 2:
                raise stall_error(self.buffer.counts())

    def check_drops(self, dropped_before: int) -> None:
        """Raises when more groups in a row than ``drop_patience`` were dropped."""
        in_a_row = len(self.buffer.dropped) - dropped_before
        if in_a_row > drop_patience(self.config.staleness.batch_size):
            raise drops_error(
                list(self.buffer.dropped.values())[dropped_before:],
                failures=self.reward_failures(),
                scored=self.fleet.reward_counters().get("scored", 0),
                first_reward_error=self.books.first_reward_error,
                last_step=self.books.history[-1] if self.books.history else None,
            )

    def reward_failures(self) -> dict[str, int]:
        """Scored samples whose reward failed so far, by reason (``REWARD_FAILURES``)."""
        counters = self.fleet.reward_counters()
        return {reason: counters[reason] for reason in REWARD_FAILURES if counters.get(reason)}

    def scale_workers(self, n: int) -> object:
        """Grows or shrinks the fleet to ``n`` workers now (a removed worker's prompts are
        re-issued to the others); returns the newest worker (``None``: none left)."""
        if not is_int(n) or n < 0:
            raise ValueError(f"scale_workers: n must be an int >= 0, got {n!r}")
        with self.lock:
            for worker_id, lost in self.fleet.scale(n):
                self.lose_worker(worker_id, lost, reason="scaled_down")
        return self.fleet.workers[-1] if self.fleet.workers else None

    def check_accounting(self) -> None:
        """Asserts that every issued prompt is in flight, buffered, trained or dropped,
        that no admitted group was lost, and (deterministic mode) that every prompt in
        flight is held by exactly one worker or queued to be issued again."""
        with self.lock:
            self.buffer.check(self.controller.next_group_id)
            if self.parts.collector is not None:
                return  # worker threads finish prompts outside the lock: no snapshot
            held = [g for groups in self.fleet.in_flight().values() for g in groups]
            queued = [i.group_id for i in self.controller.reissue]
            together = held + queued
            if len(together) != len(set(together)) or len(together) != self.buffer.in_flight:
                raise AssertionError(
                    f"accounting broken: buffer has {self.buffer.in_flight} prompts in "
                    f"flight, workers hold {sorted(held)[:10]}..., re-issue queue "
                    f"{queued[:10]}"
                )
