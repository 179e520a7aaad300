"""The loop of an RL run, written once: every backend is a placement of this driver.

``Experiment(config)`` builds the run's parts where ``runtime.backend`` places them
(``local``: in this process; ``ray``: Ray actors) and drives them. ``step()`` runs the
loop until the trainer has taken one step and returns its metrics; ``run(n)`` repeats.

One round of the loop (``round``):

1. faults of the plan that are due fire (only when a plan is given);
2. every live worker pulls if its ``StalenessPolicy`` says it lags too far;
3. the controller issues prompts in worker order while the policy admits more
   (``accepted + running < (η + published + 1) · batch``; re-issued prompts are
   already counted running and need no new room);
4. every live worker starts its prompts and decodes one chunk; finished, scored
   rollouts go to the buffer in worker order.

When the buffer yields a batch (oldest first, stale groups dropped) the trainer steps,
pushes per the ``WeightSyncPolicy`` and the run checkpoints per the
``CheckpointPolicy``. In ``deterministic`` mode the order of everything is fixed, so a
seed fixes every metric except wall-clock timings (``time/*``, ``throughput/*``), on
either backend. The fault clock is logical there: ``rounds · runtime.round_s``.

Preemption tolerance: with a ``run_dir`` the run checkpoints its train state and books
(``rlaxkit.runtime.state``); a new ``Experiment`` on that directory resumes from the
newest checkpoint, and in deterministic mode the resumed run is the uninterrupted one,
bit for bit. ``faults=`` replays a ``FaultPlan`` (``rlaxkit.runtime.faults``) on either
backend; on Ray a preemption kills the actor for real.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from rlaxkit.api import SyncReply, Work
from rlaxkit.batch import collate
from rlaxkit.buffer import RolloutBuffer
from rlaxkit.config import RunConfig
from rlaxkit.controller import Issue, PromptController
from rlaxkit.evaluation import EvalReport, evaluate_policy
from rlaxkit.faults import FaultPlan
from rlaxkit.inference import make_text_generate
from rlaxkit.metrics import MetricsLogger
from rlaxkit.rollout import Rollout, RolloutGroup
from rlaxkit.runtime import state as codec
from rlaxkit.runtime.books import RunBooks, Window
from rlaxkit.runtime.common import TRAIN_BUCKETS, RunTrace, batch_metrics
from rlaxkit.runtime.concurrent import check_supported
from rlaxkit.runtime.faults import FaultInjector, load_plan
from rlaxkit.runtime.placement import start_placement
from rlaxkit.validation import is_int

SYNC_ATTEMPTS = 10  # syncs per round before a worker is left to retry next round


class Experiment:
    """An RL run you can step through, on the backend ``config.runtime.backend`` names.

    >>> exp = Experiment(RunConfig(steps=3))  # doctest: +SKIP
    >>> metrics = exp.step()                   # doctest: +SKIP
    >>> exp.last_batch["groups"]               # doctest: +SKIP

    Args:
        config: the run configuration.
        run_dir: config.yaml, metrics.jsonl, trace.jsonl, checkpoints and the warm-start
            cache; ``None`` keeps everything in memory. On a multi-host Ray cluster it
            must be a directory every host sees.
        progress: show progress bars.
        cache_dir: where the warm-start cache lives (default: ``run_dir``).
        faults: a ``FaultPlan`` (or a path to one, or a list of fault mappings).
        resume: continue from the newest checkpoint in ``run_dir`` if there is one
            (``resumed_from`` is its step); ``False`` starts afresh (local) or refuses a
            directory that holds a run (Ray).
        ray_config: Ray placement (default: ``config.ray``).

    Raises:
        ValueError: a bad config or fault plan, a ``preempt_trainer`` fault without a
            ``run_dir``, or a checkpoint written for another config, model or plan.
    """

    def __init__(
        self,
        config: RunConfig,
        run_dir: str | Path | None = None,
        progress: bool = False,
        cache_dir: str | Path | None = None,
        faults: FaultPlan | str | Path | list | None = None,
        resume: bool = True,
        ray_config: Any = None,
    ):
        self.config = config
        plan = load_plan(faults)
        self.faults = FaultInjector.for_plan(plan, config)
        if config.runtime.mode == "concurrent":
            check_supported(config)
        self.run_dir = Path(run_dir).absolute() if run_dir else None
        if self.run_dir is None and any(f.kind == "preempt_trainer" for f in plan):
            raise ValueError(
                "faults: preempt_trainer restores the last checkpoint; give the Experiment "
                "a run_dir to write checkpoints to"
            )
        point = codec.find_resume_point(self.run_dir, config, plan, resume)
        if self.run_dir:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            config.save(self.run_dir / "config.yaml")
        trace_path = self.run_dir / "trace.jsonl" if self.run_dir else None
        # A resumed run cuts its files back to the checkpoint: it takes the steps after it
        # again, and the stopped run's events of those steps would count twice.
        resumed = codec.continue_files(self.run_dir, point) if point else None
        self._t0 = time.perf_counter()
        self.lock = threading.RLock()  # concurrent mode's worker threads take it
        self.trace = RunTrace(trace_path, resumed["events"] if resumed else 0, self.lock)
        if resumed is None:
            self.trace.record(0.0, "run_start", "controller", None, config=config.to_dict())
        else:
            self.trace.offset_s = resumed["offset_s"]
        self.books = RunBooks(
            lost_steps=resumed["lost_steps"] if resumed else 0,
            lost_train_s=resumed["lost_train_s"] if resumed else 0.0,
        )
        try:
            self.parts = start_placement(
                config,
                trace=self.trace,
                clock=self.clock,
                books=self.books,
                faults=self.faults,
                run_dir=self.run_dir,
                cache_dir=Path(cache_dir).absolute() if cache_dir else self.run_dir,
                ray_config=ray_config,
                worker_ids=[w["worker_id"] for w in point.items["workers"]] if point else None,
            )
        except BaseException:
            self.trace.close()
            raise
        self.fleet, self.trainer = self.parts.fleet, self.parts.trainer
        self.problems = self.parts.task.problems("train", config.task.num_train)
        self.controller = PromptController(len(self.problems), seed=config.seed)
        self.buffer = RolloutBuffer(config.staleness, group_size=config.group_size)
        self.published = 0  # the newest version the trainer published
        self.last_batch: dict[str, Any] | None = None
        self.closed = False
        try:
            if point is not None:
                self.trace.record(
                    0.0,
                    "restart",
                    "trainer",
                    point.step,
                    lost_steps=self.books.lost_steps,
                    resumed_from=point.step,
                )
                self._resume(point)
            else:
                self.published = self.trainer.publish(0)
                if self.run_dir and (
                    config.checkpoint.every_steps or config.checkpoint.every_s or len(plan)
                ):
                    self.save_checkpoint()  # step 0: what a restore falls back to
        except BaseException:
            self.parts.close()
            self.trace.close()
            raise
        self.logger = MetricsLogger(
            self.run_dir / "metrics.jsonl" if self.run_dir else None,
            total_steps=config.steps,
            progress=progress,
        )
        self.window = Window(self.clock(), self.fleet.generated_tokens())

    # -- names a notebook reaches for --------------------------------------------------
    @property
    def version(self) -> int:
        """The trainer's weight version (train steps kept)."""
        return self.books.version

    @property
    def history(self) -> list[dict[str, Any]]:
        """Every step's metrics."""
        return self.books.history

    @property
    def extra(self) -> dict[str, Any]:
        """The caller's JSON, saved with every checkpoint."""
        return self.books.extra

    @property
    def resumed_from(self) -> int | None:
        return self.books.resumed_from

    @property
    def task(self) -> Any:
        return self.parts.task

    @property
    def tokenizer(self) -> Any:
        return self.parts.tokenizer

    @property
    def warm_start(self) -> dict[str, Any]:
        return self.parts.warm_start

    @property
    def workers(self) -> list[Any]:
        """The fleet's workers (in-process ``InferenceWorker``\\ s or Ray worker slots)."""
        return self.fleet.workers

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
            reason = self.buffer.add(rollout, self.version)
            self.window.samples += 1
            if reason is not None:
                self.drop_event(rollout.group_id, reason, rollout.first_version)

    def drop_event(self, group_id: int, reason: str, version: int | None = None) -> None:
        self.trace.record(self.clock(), "drop", "buffer", version, reason=reason, rollout=group_id)

    def requeue(self, lost: list[Issue]) -> None:
        """Prompts a worker lost go back to the controller (same ids and seeds)."""
        for issue in lost:
            self.buffer.reset_group(issue.group_id)
        self.controller.requeue(lost)

    def round(self) -> bool:
        """One round over the fleet; returns whether anything moved. ``step`` repeats it
        until a batch is ready; call it directly to stop mid-generation."""
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
                self.published = self.trainer.publish(self.version)  # heals a dead trainer
            self.ensure_published()
            rooms |= self.fleet.sync(retry)
        self._requeue_dead()
        return {w: rooms[w] for w in self.fleet.worker_ids() if w in rooms}

    def _requeue_dead(self) -> None:
        for worker_id, lost in self.fleet.take_lost():
            self.requeue(lost)
            self.trace.record(
                self.clock(),
                "preemption",
                worker_id,
                None,
                reason="actor_died",
                reissued=len(lost),
            )

    def ensure_published(self) -> int | None:
        """The published version; has the trainer publish again if the store lost it
        (a parameter server restarted empty)."""
        latest = self.parts.store.latest_version()
        if self.faults.trainer_down() or (latest is not None and latest >= self.published):
            return latest
        self.trace.record(self.clock(), "restart", "param_server", latest)
        return self.trainer.publish(self.version)

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
            check_drops(self, dropped_before)
            waiting = self.faults.waiting()
            idle_rounds = 0 if progressed or waiting else idle_rounds + 1
            if idle_rounds > 2:
                raise stalled(self)

    def step(self) -> dict[str, Any]:
        """Runs until the trainer has taken one step; returns its metrics."""
        t_start = self.clock()
        groups = self.collect_batch()
        t_gen = self.clock()
        samples = [r for g in groups for r in g.rollouts]
        batch = collate(samples, bucket=TRAIN_BUCKETS, pad_token_id=self.tokenizer.pad_id)
        step = self.version + 1
        due = self.faults.due_step(step)
        push = self.config.weight_sync.should_push(step)
        result = self.trainer.train(batch, step, push and not due)
        self.books.record_step(groups, result.duration_s)
        t_train = self.clock()
        for fault in due:  # after the step, before its push or save
            self.faults.apply(self, fault)
        trainer_up = not self.faults.trainer_down()
        if push and trainer_up:
            self.published = self.trainer.publish(step) if due else step
        if self.parts.collector is not None:
            self.parts.collector.wake()  # more admission room, newer weights to pull
        with self.lock:
            metrics = {
                **batch_metrics(step, groups, samples, self.buffer.counts(), result.metrics),
                "time/generate_s": t_gen - t_start,
                "time/train_s": t_train - t_gen,
                **self.window.close(t_train, self.fleet.generated_tokens()),
            }
        self.trace.record(
            self.clock(),
            "train_step",
            "trainer",
            step,
            step=step,
            samples=len(samples),
            # tokens: every real token the step processed (prompt + completion), as
            # the simulator counts them; completion_tokens: the ones trained on.
            tokens=int(np.asarray(batch.attention_mask).sum()),
            completion_tokens=int(np.asarray(batch.loss_mask).sum()),
            duration_s=result.duration_s,
            staleness=[step - 1 - g.first_version for g in groups],
        )
        self.last_batch = {"groups": groups, "batch": batch, "metrics": metrics}
        self.books.history.append(metrics)
        self.logger.log(metrics)
        if (workers := self.parts.schedule(step)) is not None:
            self.scale_workers(workers)  # ray.worker_schedule: an elastic fleet
        policy = self.config.checkpoint
        if trainer_up and policy.should_save(
            step, self.fault_now(), self.books.last_save_step, self.books.last_save_s
        ):
            self.save_checkpoint(wait=False)
        return metrics

    def run(self, steps: int | None = None) -> list[dict[str, Any]]:
        """Steps until the version is ``steps`` more than now (default: until it reaches
        ``config.steps``); returns every step's metrics. A trainer restore sets the
        version back, so this may take more than ``steps`` steps."""
        target = self.config.steps if steps is None else self.version + steps
        out = []
        while self.version < target:
            out.append(self.step())
        return out

    def scale_workers(self, n: int) -> Any:
        """Grows or shrinks the fleet to ``n`` workers now (a removed worker's prompts are
        re-issued to the others); returns the newest worker (``None``: none left)."""
        if not is_int(n) or n < 0:
            raise ValueError(f"scale_workers: n must be an int >= 0, got {n!r}")
        with self.lock:
            for worker_id, lost in self.fleet.scale(n):
                self.requeue(lost)
                self.trace.record(
                    self.clock(),
                    "preemption",
                    worker_id,
                    None,
                    reason="scaled_down",
                    reissued=len(lost),
                )
        return self.workers[-1] if self.workers else None

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

    # -- checkpoints -----------------------------------------------------------------
    def save_checkpoint(self, wait: bool = True) -> bool:
        """Saves the run as checkpoint ``version`` (what SIGTERM handling calls); False
        without a run_dir, when it exists, while the trainer is down (its last
        checkpoint stands), or in concurrent mode (no replay log can resume it)."""
        if (
            self.run_dir is None
            or self.faults.trainer_down()
            or self.config.runtime.mode == "concurrent"
            or self.version in self.trainer.saved_steps()
        ):
            return False
        fleet = self.fleet.checkpoint()
        weights = dict(fleet.weights)
        if self.published not in weights and self.published != self.version:
            weights[self.published] = self.parts.published_weights(self.published)
        weights |= self.faults.held_weights()
        weights.pop(self.version, None)  # the train state's own params
        items, arrays = codec.encode(
            config=self.config,
            books=self.books,
            controller=self.controller,
            buffer=self.buffer,
            fleet=fleet,
            faults=self.faults.state_dict(),
            published=self.published,
            weights=weights,
            shapes=self.parts.shapes,
            clock_s=self.trace.offset_s + self.clock(),
            trace_events=self.trace.written,
        )
        saved = self.trainer.save(self.version, items, arrays, wait=wait)  # traced there
        self.books.saved(self.fault_now())
        return saved

    def _resume(self, point: codec.ResumePoint) -> None:
        """Loads checkpoint ``point`` into this freshly built run: afterwards it goes on
        exactly as the saved one would have (deterministic mode)."""
        meta, items, step = point.meta, point.items, point.step
        codec.check_compatible(meta, str(point.directory), self.config.to_dict(), self.parts.shapes)
        weights = codec.read_weights(point, self.parts.template)
        published = meta["published_version"]
        restored = self.trainer.restore(
            step, (published, weights[published]) if published != step else None
        )
        if restored != step:
            raise RuntimeError(f"the trainer restored step {restored}, not the checkpoint's {step}")
        self.books.load_state_dict(meta, items["history"], items["extra"])
        self.controller.load_state_dict(items["controller"])
        self.buffer.load_state_dict(items["buffer"])
        self.published = self.trainer.publish(step, reset=True)
        self.faults.load_state_dict(items["faults"], weights)

        def weights_for(version: int) -> Any:
            if version not in weights:  # the train state's own
                weights[version] = self.trainer.host_params(version)
            return weights[version]

        def work_for(group_id: int) -> Work:
            issue = self.controller.issue_for(group_id)
            return Work(issue, self.problems[issue.problem_index])

        self.fleet.restore(items["workers"], items["fleet"], weights_for, work_for)

    # -- results -----------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Goodput (useful trainer compute ÷ wall time), lost steps, fault counters.

        In deterministic mode downtimes pass on the logical fault clock and cost no wall
        time, so wall goodput shows the compute faults waste (lost steps, restores,
        regenerated prompts, checkpoint writes); ``rounds`` shows what downtimes cost."""
        with self.lock:
            wall = self.trace.offset_s + self.clock()
            useful = sum(self.books.useful_train_s)
            restarts: dict[str, int] = {}
            for event in self.trace.memory.events:
                if event.kind == "restart":
                    actor = "worker" if event.actor.startswith("worker-") else event.actor
                    restarts[actor] = restarts.get(actor, 0) + 1
            return {
                "backend": self.config.runtime.backend,
                "goodput": useful / max(wall, 1e-9),
                "useful_train_s": useful,
                "lost_train_s": self.books.lost_train_s,
                "lost_steps": self.books.lost_steps,
                "wall_s": wall,
                "steps": self.version,
                "rounds": self.books.rounds,
                "accepted_lost": len(self.buffer.accepted_lost()),
                "failed_pulls": self.fleet.failed_pulls(),
                "reward_failures": {
                    k: v for k, v in self.fleet.reward_counters().items() if k.startswith("reward_")
                },
                "workers": len(self.fleet.worker_ids()),
                "worker_replacements": self.fleet.replacements(),
                "restarts": restarts,
                "buffer": self.buffer.counts(),
                "resumed_from": self.resumed_from,
            }

    def params(self) -> Any:
        """The trainer's current params, in this process."""
        return self.trainer.host_params(self.version)

    def current_model(self) -> nnx.Module:
        """The trainer's current policy as a model in this process."""
        return nnx.merge(self.parts.graphdef, self.params())

    def evaluate(
        self, num_problems: int | None = None, samples: int | None = None, seed: int = 1234
    ) -> EvalReport:
        """Held-out pass@1 (and pass@k) at the training temperature on the test split."""
        cfg = self.config.eval
        n = samples or cfg.samples
        params = jax.tree.map(lambda x: x.copy(), self.params())
        generate = make_text_generate(
            (self.parts.graphdef, params), self.tokenizer, self.config.sampling
        )
        problems = self.task.problems("test", num_problems or cfg.num_problems)
        return evaluate_policy(
            self.task,
            generate,
            problems=problems,
            n=n,
            ks=sorted({1, n}),
            seed=seed,
            runner=self.parts.scorer,
        )

    def close(self) -> None:
        """Records goodput, stops workers and actors, waits for checkpoint writes and
        closes the files (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self.parts.collector is not None:
            self.parts.collector.close()
        summary = self.summary()
        self.trace.record(
            self.clock(),
            "run_end",
            "controller",
            self.version,
            **{k: summary[k] for k in ("goodput", "useful_train_s", "lost_train_s", "wall_s")},
            lost_steps=summary["lost_steps"],
        )
        self.parts.close()
        self.logger.close()
        self.trace.close()

    def __enter__(self) -> Experiment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_drops(exp: Experiment, dropped_before: int) -> None:
    """Raises when more than 50 batches' worth of groups in a row were dropped."""
    patience = 50 * exp.config.staleness.batch_size
    if len(exp.buffer.dropped) - dropped_before > patience:
        raise RuntimeError(
            f"{patience} prompt groups in a row were dropped "
            f"({exp.buffer.counts()['dropped_by_reason']}) without one batch: with "
            "'filtered', the policy always or never solves the task; warm start longer "
            "(sft.steps), pick an easier task, or lower η for 'stale'"
        )


def stalled(exp: Experiment) -> RuntimeError:
    """The error of a loop that can never yield a batch."""
    return RuntimeError(
        "the loop stalled: no prompt is in flight and no batch is ready "
        f"(buffer {exp.buffer.counts()}); check staleness.batch_size against "
        "runtime.num_workers * slots_per_worker / sampling.n"
    )
