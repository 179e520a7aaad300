"""An RL run you can step through: ``Experiment(config)`` builds the run's parts where
``runtime.backend`` places them (``local``: in this process; ``ray``: Ray actors) and
drives them with the one loop (``rlaxkit.runtime.loop``). ``step()`` runs the loop until
the trainer has taken one step and returns its metrics; ``run(n)`` repeats.

Preemption tolerance: with a ``run_dir`` the run checkpoints its train state and books
(``rlaxkit.runtime.state``); a new ``Experiment`` on that directory resumes from the
newest checkpoint, and in deterministic mode the resumed run is the uninterrupted one,
bit for bit. ``faults=`` replays a ``FaultPlan`` (``rlaxkit.runtime.faults``) on either
backend; on Ray a preemption kills the actor for real.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from rlaxkit.api import Work
from rlaxkit.config.run import RunConfig
from rlaxkit.data.buffer import RolloutBuffer
from rlaxkit.evaluation import EvalReport, evaluate_model
from rlaxkit.models import Transformer
from rlaxkit.models.tokenizer import Tokenizer
from rlaxkit.observe.tracking import check_run_dir, open_trackers
from rlaxkit.rules.audit import AuditBook
from rlaxkit.rules.books import RunBooks, Window
from rlaxkit.rules.controller import PromptController
from rlaxkit.rules.fault_plan import FaultPlan
from rlaxkit.runtime import state as codec
from rlaxkit.runtime.build import check_inputs
from rlaxkit.runtime.common import RunTrace
from rlaxkit.runtime.concurrent import check_supported
from rlaxkit.runtime.faults import NO_FAULTS, FaultInjector, load_plan
from rlaxkit.runtime.hooks import Hook
from rlaxkit.runtime.loop import Loop
from rlaxkit.runtime.placement import start_placement
from rlaxkit.tasks import CodeTask, Task, isolation_mode
from rlaxkit.tasks.datasets import write_run_skipped_rows
from rlaxkit.util.hostmem import FreezeAfterFullCollection

_LOGGER = logging.getLogger(__name__)


class Experiment(Loop):
    """An RL run you can step through, on the backend ``config.runtime.backend`` names.

    Step through it: ``exp = Experiment(RunConfig(steps=3)); metrics = exp.step()``.

    Args:
        config: the run configuration.
        run_dir: config.yaml, metrics.jsonl, trace.jsonl, checkpoints and the warm-start
            cache; ``None`` keeps everything in memory. On a multi-host Ray cluster it
            must be a directory every host sees.
        progress: show progress bars.
        cache_dir: where the warm-start cache lives (default: ``run_dir``).
        faults: a ``FaultPlan`` (or a path to one, or a list of fault mappings).
        resume: continue from the newest checkpoint in ``run_dir`` if there is one
            (``resumed_from`` is its step); ``False`` refuses a directory that holds
            a run.
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
        ray_config: object = None,
    ):
        plan = load_plan(faults)
        run_path = Path(run_dir).absolute() if run_dir else None
        injector = FaultInjector.for_plan(plan, config, run_path)
        check_supported(config)
        check_run_dir(config.tracking, run_path)
        check_inputs(config)  # bad data or checkpoint files fail before any work
        point = codec.find_resume_point(run_path, config, plan, resume)
        if run_path:
            run_path.mkdir(parents=True, exist_ok=True)
            config.save(run_path / "config.yaml")
        trace_path = run_path / "trace.jsonl" if run_path else None
        # A resumed run cuts its files back to the checkpoint (it takes the steps after it again).
        resumed = codec.continue_files(run_path, point) if point and run_path else None
        self._t0 = t0 = time.perf_counter()  # the clock start_placement's parts read
        lock = threading.RLock()  # concurrent mode's worker threads take it
        books = RunBooks(
            lost_steps=resumed["lost_steps"] if resumed else 0,
            lost_train_s=resumed["lost_train_s"] if resumed else 0.0,
        )
        events, limit = (resumed["events"] if resumed else 0), config.runtime.trace_memory
        trace = RunTrace(trace_path, events, lock, restarts=books.restarts, memory_limit=limit)
        if resumed is None:
            trace.record(0.0, "run_start", "controller", None, config=config.to_dict())
        else:
            trace.offset_s = resumed["offset_s"]
        parts = logger = None  # what a failed start closes
        try:
            parts = start_placement(
                config,
                trace=trace,
                clock=self.clock,
                books=books,
                faults=injector,
                run_dir=run_path,
                cache_dir=Path(cache_dir).absolute() if cache_dir else run_path,
                ray_config=ray_config,
                worker_ids=[w["worker_id"] for w in point.items["workers"]] if point else None,
            )
            problems = parts.task.problems("train", config.task.num_train)
            write_run_skipped_rows(parts.task.skipped_rows, run_path)
            saves = bool(config.checkpoint.every_steps or config.checkpoint.every_s or len(plan))
            logger = open_trackers(
                config.tracking,
                run_path,
                config=config.to_dict(),
                resumed_from=point.step if point is not None else None,
                total_steps=config.steps,
                progress=progress,
                # A run that can go back to a checkpoint: W&B and MLflow get committed steps.
                hold=config.runtime.mode != "concurrent" and saves,
            )
            super().__init__(
                config,
                run_dir=run_path,
                lock=lock,
                trace=trace,
                books=books,
                faults=injector,
                parts=parts,
                problems=problems,
                controller=PromptController(len(problems), seed=config.seed),
                # Only a fault plan restores the trainer in the run: without one, trained
                # groups are not kept for a roll-back.
                buffer=RolloutBuffer(
                    config.staleness,
                    config.group_size,
                    config.batching,
                    config.recovery,
                    restorable=injector is not NO_FAULTS,
                ),
                audit=AuditBook(),  # sampled against trained
                logger=logger,
                t0=t0,
            )
            self.closed = False
            if point is not None:
                lost, step = books.lost_steps, point.step
                trace.record(0.0, "restart", "trainer", step, lost_steps=lost, resumed_from=step)
                self._resume(point)
            else:
                self.note_published(self.trainer.publish(0))
                if run_path and saves:
                    self.save_checkpoint()  # step 0: what a restore falls back to
        except BaseException:
            if logger is not None:
                logger.close(failed=True)
            if parts is not None:
                parts.close()
            trace.close()
            raise
        self.books.window = Window(self.clock(), self.fleet.generated_tokens())
        self.collections = FreezeAfterFullCollection()
        self.hooks.append(Hook("collections", self.collections.step_done))  # after a step

    def run(self, steps: int | None = None) -> list[dict[str, Any]]:
        """``Loop.run``; while it runs, Python's full collections leave the objects the
        run holds alone from the first step after one of them on
        (``rlaxkit.util.hostmem.FreezeAfterFullCollection``, its ``collections`` hook)."""
        with self.collections:
            return super().run(steps)

    # -- names a notebook reaches for --------------------------------------------------
    @property
    def history(self) -> list[dict[str, object]]:
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
    def task(self) -> Task:
        return self.parts.task

    @property
    def tokenizer(self) -> Tokenizer:
        return self.parts.tokenizer

    @property
    def warm_start(self) -> dict[str, object]:
        return self.parts.warm_start

    @property
    def workers(self) -> list[object]:
        """The fleet's workers (``WorkerSlot``: id, host handle, prompts in flight)."""
        return self.fleet.workers

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
        self._requeue_dead()  # a worker that died while its fleet was gathered
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
        self.buffer.saved(self.version)
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
        self.audit.resumed(self.buffer)
        self.note_published(self.trainer.publish(step, reset=True))

        def weights_for(version: int) -> object:
            if version not in weights:  # the train state's own
                weights[version] = self.trainer.host_params(version)
            return weights[version]

        # A push an outage holds back may be the train state's own version.
        self.faults.load_state_dict(items["faults"], weights_for)

        def work_for(group_id: int) -> Work:
            issue = self.controller.issue_for(group_id)
            return Work(issue, self.problems[issue.problem_index])

        self.fleet.restore(items["workers"], items["fleet"], weights_for, work_for)

    # -- results -----------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Goodput (useful trainer compute ÷ wall time), lost steps, fault counters. In
        deterministic mode downtimes pass on the logical fault clock and cost no wall
        time: goodput shows the compute faults waste, ``rounds`` what downtimes cost."""
        with self.lock:
            wall = self.trace.offset_s + self.clock()
            useful = sum(self.books.useful_train_s)
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
                "reward_failures": self.reward_failures(),
                "workers": len(self.fleet.worker_ids()),
                "worker_replacements": self.fleet.replacements(),
                "preemptions": dict(self.books.preemptions),
                "restarts": dict(self.books.restarts),
                "reissued_prompts": self.books.reissued,
                "faults": self.faults.report(self.fault_now(), self.version),  # fired or not
                "buffer": self.buffer.counts(),
                "dataset_skipped_rows": {  # by file; each named in skipped_rows.jsonl
                    path: len(rows) for path, rows in self.task.skipped_rows.items()
                },
                # How generated programs are contained, for tasks that run them (this
                # process's sandbox; reward workers on other hosts may differ).
                "sandbox_isolation": isolation_mode() if isinstance(self.task, CodeTask) else None,
                "resumed_from": self.resumed_from,
                "audit": self.audit.audit(self.buffer.dropped),  # sampled against trained
            }

    def params(self) -> object:
        """The trainer's current params, in this process."""
        return self.trainer.host_params(self.version)

    def current_model(self) -> Transformer:
        """The trainer's current policy as a model in this process."""
        model: Transformer = nnx.merge(self.parts.graphdef, self.params())
        return model

    def evaluate(
        self,
        num_problems: int | None = None,
        samples: int | None = None,
        seed: int = 1234,
        progress: bool = False,
    ) -> EvalReport:
        """Held-out pass@1 (and pass@k) at the training temperature on the test split, to
        the trackers as ``eval/pass_at_<k>``, with a progress bar if ``progress``. A multi-turn
        task is evaluated on whole episodes with its tools; their metrics go as
        ``eval/<name>`` (``tool_use_rate``)."""
        cfg, params = self.config.eval, jax.tree.map(lambda x: x.copy(), self.params())
        problems = self.task.problems("test", num_problems or cfg.num_problems)
        report = evaluate_model(
            self.config, self.task, (self.parts.graphdef, params), self.tokenizer,
            problems=problems, n=samples or cfg.samples, seed=seed, runner=self.parts.scorer,
            progress=progress,
        )  # fmt: skip
        metrics = {f"eval/pass_at_{r['k']}": r["pass@k"] for r in report.rows}
        self.logger.log_eval(
            self.version, metrics | {f"eval/{k}": v for k, v in report.metrics.items()}
        )
        return report

    def close(self, failed: bool = False) -> None:
        """Records goodput, stops workers and actors, waits for checkpoint writes and
        closes the files (idempotent); ``failed``: the run crashed, and every tracker
        marks its run failed."""
        if self.closed:
            return
        self.closed = True
        self.collections.close()
        if self.parts.collector is not None:
            self.parts.collector.close()
        summary = self.summary()
        write_run_skipped_rows(self.task.skipped_rows, self.run_dir)  # evaluate()'s too
        unfired = summary["faults"]["not_fired"]
        for fault in unfired:
            _LOGGER.warning("fault plan: faults[%d] (%s) never fired: %s", fault["index"],
                            fault["kind"], fault["why"])  # fmt: skip
        self.trace.record(
            self.clock(),
            "run_end",
            "controller",
            self.version,
            **{k: summary[k] for k in ("goodput", "useful_train_s", "lost_train_s", "wall_s")},
            lost_steps=summary["lost_steps"],
            # Plan indices of faults that never fired (the summary says why).
            **({"faults_not_fired": [f["index"] for f in unfired]} if unfired else {}),
        )
        self.parts.close()
        self.logger.log_summary(summary)
        self.logger.commit(self.books.last_save_step)  # a checkpoint the caller took
        finished = self.version >= self.config.steps and not self.faults.trainer_down()
        self.logger.close(finished=finished, failed=failed)
        self.trace.close()

    def __enter__(self) -> Experiment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(failed=exc[0] is not None)
