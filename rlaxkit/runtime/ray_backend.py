"""The Ray backend: the local runtime's loop with the trainer, the parameter server and
each inference worker in its own Ray actor; elastic and self-healing.

``RayExperiment(config)`` has the notebook API of ``rlaxkit.runtime.Experiment``
(``step``, ``run``, ``last_batch``, ``history``, ``trace``, ``evaluate``,
``check_accounting``, ``save_checkpoint``, ``summary``, ``close``) plus
``scale_workers(n)``; placement comes from ``config.ray`` (a ``RayConfig``) unless a
``ray_config`` argument is given. ``rlaxkit train`` runs it for ``runtime.backend=ray``.

Placement. The prompt controller and the rollout buffer stay in the driver, so the
accounting invariant is kept by one process and survives any actor's death. Workers
(``WorkerActor``, each wrapping an ``InferenceWorker``) and the trainer
(``TrainerActor``) are actors with the resources ``RayConfig`` asks for; weights go
through a ``ParameterServerActor`` over Ray's object store, or a TensorStore directory.
With ``RayConfig.trainer_processes > 1`` the trainer is a group of actors, one
``jax.distributed`` process each, training one model sharded over all their devices
(``rlaxkit.runtime.ray_trainer_group``); the driver feeds them the same batches.

The loop is the local backend's, round by round: every worker pulls if it must and
reports its room (all workers at once); the driver issues prompts in worker order under
the ``StalenessPolicy``; every worker starts its prompts and decodes one chunk (all at
once); the driver adds the finished rollouts to the buffer in worker order; when a batch
is ready the trainer steps and pushes. Workers run in parallel within a phase, but each
one's inputs are what the local loop would give it, so in deterministic mode a seed
gives the same prompts, rollouts and metrics on both backends (timings aside).

Faults (``rlaxkit.runtime.ray_recovery``): a dead worker actor is replaced and its
in-flight prompts re-issued; a restarted parameter server gets the trainer's newest
version again; a restarted trainer restores its checkpoint and the driver replays the
batches since, so the run goes on as if nothing happened.

Checkpoints and resume (``rlaxkit.runtime.ray_state``): with a run directory, each
checkpoint holds the trainer's state and the driver's books (controller, buffer, what
each worker holds in flight as its replay log, history, goodput books) in one Orbax
step; a new ``RayExperiment`` on that directory resumes from the newest one, exactly
where it was in deterministic mode. The driver is not fault tolerant while it runs (a
dead driver stops the run): run it on a machine that is not preempted, or resume it
from its last checkpoint (``rlaxkit train`` checkpoints on SIGTERM). Fault plans
(``FaultPlan``) are injected by the local backend only.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np
import ray
from flax import nnx

from rlaxkit.batch import collate
from rlaxkit.buffer import RolloutBuffer
from rlaxkit.config import RunConfig
from rlaxkit.controller import PromptController
from rlaxkit.evaluation import EvalReport, evaluate_policy
from rlaxkit.inference import make_text_generate
from rlaxkit.metrics import MetricsLogger
from rlaxkit.param_server.ray_store import RAY_SYSTEM_CONFIG, parameter_server_actor
from rlaxkit.ray_config import RayConfig, scheduled_workers
from rlaxkit.rollout import RolloutGroup
from rlaxkit.runtime.build import build_policy, build_task
from rlaxkit.runtime.common import TRAIN_BUCKETS, RunTrace, batch_metrics
from rlaxkit.runtime.ray_actors import WeightStore, driver_jax_options
from rlaxkit.runtime.ray_recovery import RayFaultHandling, WorkerSlot, stop_actor
from rlaxkit.runtime.ray_state import (
    RayCheckpointing,
    clear_weight_store,
    continue_files,
    find_resume_point,
)
from rlaxkit.runtime.ray_trainer_group import TrainerGroup
from rlaxkit.tasks import RewardRunner

__all__ = ["RayExperiment"]


class RayExperiment(RayFaultHandling, RayCheckpointing):
    """An RL run on Ray you can step through, like ``Experiment``.

    With a ``run_dir`` the run checkpoints per ``config.checkpoint`` (and at step 0):
    the trainer's state and the driver's books in one Orbax step directory under
    ``run_dir/checkpoints/trainer`` (``rlaxkit.runtime.ray_state``). A new
    ``RayExperiment`` on a run directory with checkpoints resumes from the newest one
    (``resumed_from`` is its step): the trainer (every process of a multi-process one)
    restores it, the driver its books, every worker actor replays the log of the
    prompts it had in flight (same ids and seeds), trace.jsonl and metrics.jsonl go on
    from it; in deterministic mode the run then continues exactly as the
    uninterrupted one (the same prompts, metrics and weights, bit for bit).

    Args:
        config: the run configuration (``runtime.backend`` must be ``ray``).
        run_dir: config.yaml, metrics.jsonl, trace.jsonl, checkpoints and the
            warm-start cache; on a multi-host cluster it must be a directory every
            host sees. ``None`` keeps everything in memory (a restarted trainer then
            replays every batch from step 0).
        progress: show progress bars.
        cache_dir: where the warm-start cache lives (default: ``run_dir``).
        ray_config: placement, weight store and fault handling (default:
            ``config.ray``).
        faults: must be ``None``: fault plans are injected by the local backend only
            (here, kill actors with ``ray.kill``).
        resume: continue from the newest checkpoint in ``run_dir`` if there is one;
            ``False`` refuses a ``run_dir`` that holds a run.

    Raises:
        ValueError: another backend or mode, a fault plan, a ``run_dir`` that holds a
            run it cannot resume (``resume=False``, no Ray checkpoint), or a checkpoint
            written for another config or model (naming the field that differs).
    """

    def __init__(
        self,
        config: RunConfig,
        run_dir: str | Path | None = None,
        progress: bool = False,
        cache_dir: str | Path | None = None,
        ray_config: RayConfig | None = None,
        faults: Any = None,
        resume: bool = True,
    ):
        if config.runtime.backend != "ray":
            raise ValueError(
                f"runtime.backend is {config.runtime.backend!r}; RayExperiment runs the ray "
                "backend: set runtime.backend=ray (or use rlaxkit.runtime.Experiment)"
            )
        if config.runtime.mode != "deterministic":
            raise ValueError(
                f"runtime.mode {config.runtime.mode!r} is not available on the ray backend; "
                "use runtime.mode=deterministic"
            )
        if faults:
            raise ValueError(
                "faults: fault plans are injected by the local backend only; use "
                "runtime.backend=local to inject one, or kill Ray actors with ray.kill "
                "(docs/running_at_scale.md)"
            )
        self.run_dir = Path(run_dir).absolute() if run_dir else None
        # Checked before anything starts; the files are cut back once Ray is up.
        point = find_resume_point(self.run_dir, config, resume) if self.run_dir else None
        self.config = config
        self.ray_config = ray_config or config.ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            # A cluster this run starts frees evicted weight versions at once, so pushes
            # reuse warm shared memory (see rlaxkit.param_server.ray_store).
            system = {} if self.ray_config.address else {"_system_config": RAY_SYSTEM_CONFIG}
            ray.init(address=self.ray_config.address, include_dashboard=False, **system)
        if self.run_dir:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            config.save(self.run_dir / "config.yaml")
        cache = Path(cache_dir).absolute() if cache_dir else self.run_dir
        resumed = continue_files(self.run_dir, point) if point else None
        # A resumed run's clock (every actor's too) goes on from the stopped run's.
        offset_s = resumed["offset_s"] if resumed else 0.0
        self._t0, self._t0_wall = time.perf_counter() - offset_s, time.time() - offset_s
        self.trace = RunTrace(
            self.run_dir / "trace.jsonl" if self.run_dir else None,
            written=resumed["events"] if resumed else 0,
        )
        if point is None:
            self.trace.record(0.0, "run_start", "controller", None, config=config.to_dict())
        self.task = build_task(config)
        model, self.tokenizer = build_policy(config, self.task)
        self.graphdef, params = nnx.split(model)
        del model
        # Shapes, dtypes and placement of the params: a checkpoint's weights restore onto it.
        self.param_template = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
        )
        self.problems = self.task.problems("train", config.task.num_train)
        self.controller = PromptController(len(self.problems), seed=config.seed)
        self.buffer = RolloutBuffer(config.staleness, group_size=config.group_size)
        self._jax_options = driver_jax_options()
        self._scratch: Path | None = None
        self._ps_actor = None
        self.store = self._make_store(params, resuming=point is not None)
        # The driver reads the published version from the store.
        self.param_server = self.store.connect()
        checkpoints = str(self.run_dir / "checkpoints" / "trainer") if self.run_dir else None
        trainer_arguments = (
            config,
            self.store,
            str(cache) if cache else None,
            checkpoints,
            self._t0_wall,
            self._jax_options,
        )
        self.trainer_group: TrainerGroup | None = None
        self.workers: list[WorkerSlot] = []
        self._next_worker = 0
        self._replacements = 0
        self._retired_tokens = 0
        self._retired_failed_pulls = 0
        self._replay: list[tuple[int, Any]] = []  # (step, batch) since the last checkpoint
        self.version = 0
        self.rounds = 0
        self.last_save_step: int | None = None  # the newest checkpoint's step and time
        self.last_save_s = 0.0
        self.useful_train_s: list[float] = []  # compute of each surviving step
        # Steps taken after the checkpoint a resumed run started from were lost.
        self.lost_train_s = resumed["lost_train_s"] if resumed else 0.0
        self.lost_steps = resumed["lost_steps"] if resumed else 0
        self.resumed_from: int | None = None
        self.extra: dict[str, Any] = {}  # the caller's JSON, saved with every checkpoint
        self.last_batch: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []
        self._published = 0
        try:
            # One trainer actor, or config.ray.trainer_processes of them (one SPMD trainer).
            self.trainer_group = TrainerGroup(self.ray_config, trainer_arguments)
            if point is None:
                self.scale_workers(config.runtime.num_workers)  # They start as the trainer.
            else:
                for saved in point.items["workers"]:  # The fleet as it was saved.
                    self._add_worker(saved["worker_id"])
            self.warm_start = self._trainer("warm_start_info")
            if point is None:
                reply = self._trainer("publish", 0)
                self.trace.extend(reply["events"])
                self._published = reply["version"]
            else:
                # The trainer's checkpoint_restore event follows (with publish's reply).
                self.trace.record(
                    self.clock(),
                    "restart",
                    "trainer",
                    point.step,
                    lost_steps=resumed["lost_steps"],
                    resumed_from=point.step,
                )
                self._resume(point)
            if self.run_dir and point is None:
                self.save_checkpoint()  # step 0: what a restart or a resume falls back to
        except BaseException:
            self._stop_actors()  # A failed start leaves no actors behind.
            raise
        self.logger = MetricsLogger(
            self.run_dir / "metrics.jsonl" if self.run_dir else None,
            total_steps=config.steps,
            progress=progress,
        )
        self._scorer: RewardRunner | None = None
        self._closed = False
        tokens = self._retired_tokens + sum(w.generated_tokens for w in self.workers)
        self._since = {"t": self.clock(), "tokens": tokens, "samples": 0}

    # -- construction ------------------------------------------------------------------
    def _make_store(self, params, resuming: bool = False) -> WeightStore:
        rc, keep = self.ray_config, self.config.runtime.keep_versions
        if rc.weight_store == "object_store":
            name = f"rlaxkit-parameter-server-{uuid.uuid4().hex[:12]}"
            actor = parameter_server_actor(
                keep,
                name=name,
                num_cpus=rc.param_server.num_cpus,
                resources=rc.param_server.resources,
                max_restarts=rc.param_server_max_restarts,
            )
            self._ps_actor = actor
            return WeightStore("object_store", actor_name=name)
        if rc.weight_store_dir:
            directory = Path(rc.weight_store_dir)
        elif self.run_dir:
            directory = self.run_dir / "weights"
        else:
            directory = self._scratch = Path(tempfile.mkdtemp(prefix="rlaxkit-weights-"))
        if resuming:
            clear_weight_store(directory)
        template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        return WeightStore(
            "tensorstore",
            directory=str(directory.absolute()),
            keep=keep,
            template=template,
            durable=rc.tensorstore_durable,
        )

    @property
    def trainer(self) -> Any:
        """The trainer actor's handle (process 0's, with several trainer processes;
        all of them are ``trainer_group.handles``)."""
        return self.trainer_group.leader

    @property
    def param_server_actor(self) -> Any:
        """The ``ParameterServerActor`` handle (``None`` with the TensorStore store)."""
        return self._ps_actor

    def clock(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self._t0

    # -- the loop ----------------------------------------------------------------------
    def _issue(self, rooms: dict[str, Any], published: int | None) -> dict[str, tuple]:
        """Prompts per worker, in worker order, while the staleness policy admits more."""
        policy = self.config.staleness
        work: dict[str, tuple] = {}
        for slot in self.workers:
            if slot.worker_id not in rooms:
                continue
            # Re-issued prompts are already counted in flight: they need no new capacity.
            capacity = policy.capacity(self.buffer.accepted, self.buffer.in_flight, published or 0)
            room = min(rooms[slot.worker_id]["free"], capacity + len(self.controller.reissue))
            items = []
            for issue in self.controller.next_issues(room) if room > 0 else []:
                problem = self.problems[issue.problem_index]
                if not self.buffer.is_in_flight(issue.group_id):  # else: a re-issue
                    self.buffer.issue(issue.group_id, problem.id)
                slot.in_flight[issue.group_id] = issue
                items.append((issue, problem))
            work[slot.worker_id] = (items,)
        return work

    def round(self) -> bool:
        """One round of the loop over the fleet: every worker pulls if it must, the
        driver issues prompts, every worker decodes one chunk and its finished rollouts
        go to the buffer. Returns whether anything moved. ``step`` repeats this until a
        batch is ready; call it directly to stop mid-generation (e.g. to inject a fault).
        """
        if not self.workers:
            raise RuntimeError("no inference workers are left: call scale_workers(n) with n >= 1")
        published = self._ensure_published()
        rooms = self._sync_workers()
        for slot in self.workers:
            if slot.worker_id in rooms:
                self.trace.extend(rooms[slot.worker_id]["events"])
                slot.failed_pulls = rooms[slot.worker_id]["failed_pulls"]
        work = self._issue(rooms, published)
        progressed = any(items for (items,) in work.values())
        replies = self._call_workers("submit_and_step", work)
        for slot in self.workers:
            reply = replies.get(slot.worker_id)
            if reply is None:
                continue
            self.trace.extend(reply["events"])
            slot.generated_tokens = reply["generated_tokens"]
            progressed |= bool(reply["rollouts"]) or reply["busy"]
            for rollout in reply["rollouts"]:
                slot.in_flight.pop(rollout.group_id, None)
                reason = self.buffer.add(rollout, self.version)
                self._since["samples"] += 1
                if reason is not None:
                    self.trace.record(
                        self.clock(),
                        "drop",
                        "buffer",
                        rollout.first_version,
                        reason=reason,
                        rollout=rollout.group_id,
                    )
        self.rounds += 1
        return progressed

    def _collect_batch(self) -> list[RolloutGroup]:
        idle_rounds = 0
        dropped_before = len(self.buffer.dropped)
        patience = 50 * self.config.staleness.batch_size
        while True:
            batch = self.buffer.take_batch(self.version)
            if batch is not None:
                return batch
            progressed = self.round()
            if len(self.buffer.dropped) - dropped_before > patience:
                raise RuntimeError(
                    f"{patience} prompt groups in a row were dropped "
                    f"({self.buffer.counts()['dropped_by_reason']}) without one batch; see "
                    "Experiment for the usual fixes (sft.steps, an easier task, η)"
                )
            idle_rounds = 0 if progressed else idle_rounds + 1
            if idle_rounds > 2:
                raise RuntimeError(
                    "the loop stalled: no prompt is in flight and no batch is ready "
                    f"(buffer {self.buffer.counts()}); check staleness.batch_size against "
                    "the fleet's slots (num_workers * slots_per_worker / sampling.n)"
                )

    def step(self) -> dict[str, Any]:
        """Runs until the trainer has taken one step; returns its metrics."""
        t_start = self.clock()
        groups = self._collect_batch()
        t_gen = self.clock()
        samples = [r for g in groups for r in g.rollouts]
        batch = collate(samples, bucket=TRAIN_BUCKETS, pad_token_id=self.tokenizer.pad_id)
        result = self._train(batch)
        self.trace.extend(result["events"])
        self.version += 1
        self.useful_train_s.append(result["duration_s"])
        t_train = self.clock()
        metrics = self._metrics(groups, samples, result["metrics"], t_start, t_gen, t_train)
        self.trace.record(
            self.clock(),
            "train_step",
            "trainer",
            self.version,
            step=self.version,
            samples=len(samples),
            # As the local backend: every real token processed, and the trained ones.
            tokens=int(np.asarray(batch.attention_mask).sum()),
            completion_tokens=int(np.asarray(batch.loss_mask).sum()),
            duration_s=result["duration_s"],
            staleness=[self.version - 1 - g.first_version for g in groups],
        )
        self.last_batch = {"groups": groups, "batch": batch, "metrics": metrics}
        self.history.append(metrics)
        self.logger.log(metrics)
        if (workers := scheduled_workers(self.ray_config, self.version)) is not None:
            self.scale_workers(workers)  # ray.worker_schedule: an elastic fleet
        last_step, last_s = self.last_save_step or 0, self.last_save_s
        if self.run_dir and self.config.checkpoint.should_save(
            self.version, self.clock(), last_step, last_s
        ):
            self.save_checkpoint()
        return metrics

    def _metrics(self, groups, samples, train_metrics, t_start, t_gen, t_train) -> dict[str, Any]:
        tokens = self._retired_tokens + sum(w.generated_tokens for w in self.workers)
        elapsed = max(t_train - self._since["t"], 1e-9)
        out = {
            **batch_metrics(self.version, groups, samples, self.buffer.counts(), train_metrics),
            "fleet/workers": len(self.workers),
            "time/generate_s": t_gen - t_start,
            "time/train_s": t_train - t_gen,
            "throughput/tokens_per_s": (tokens - self._since["tokens"]) / elapsed,
            "throughput/samples_per_s": self._since["samples"] / elapsed,
        }
        self._since = {"t": t_train, "tokens": tokens, "samples": 0}
        return out

    def run(self, steps: int | None = None) -> list[dict[str, Any]]:
        """Takes ``steps`` trainer steps (default: the config's) and returns their metrics."""
        return [self.step() for _ in range(self.config.steps if steps is None else steps)]

    def check_accounting(self) -> None:
        """Asserts the buffer's invariant, and that every in-flight prompt is on exactly
        one live worker or queued to be issued again."""
        self.buffer.check(self.controller.next_group_id)
        held = [g for w in self.workers for g in w.in_flight]
        queued = [i.group_id for i in self.controller.reissue]
        if len(held) + len(queued) != len(set(held) | set(queued)) or (
            len(held) + len(queued) != self.buffer.in_flight
        ):
            raise AssertionError(
                f"accounting broken: buffer has {self.buffer.in_flight} prompts in flight, "
                f"workers hold {sorted(held)[:10]}..., re-issue queue {queued[:10]}"
            )

    # -- evaluation and teardown -------------------------------------------------------
    def params(self) -> Any:
        """The trainer's current params (copied from its actor to this process)."""
        return jax.device_put(self._trainer("host_params", self.version))

    def current_model(self) -> nnx.Module:
        """The trainer's current policy as a model in this process."""
        return nnx.merge(self.graphdef, self.params())

    def evaluate(
        self, num_problems: int | None = None, samples: int | None = None, seed: int = 1234
    ) -> EvalReport:
        """Held-out pass@1 (and pass@k) of the trainer's current weights, in the driver."""
        cfg = self.config.eval
        n = samples or cfg.samples
        if self._scorer is None:
            self._scorer = RewardRunner.for_task(self.task).start()
        generate = make_text_generate(
            (self.graphdef, self.params()), self.tokenizer, self.config.sampling
        )
        problems = self.task.problems("test", num_problems or cfg.num_problems)
        return evaluate_policy(
            self.task,
            generate,
            problems=problems,
            n=n,
            ks=sorted({1, n}),
            seed=seed,
            runner=self._scorer,
        )

    def _stop_actors(self) -> None:
        for slot in self.workers:
            stop_actor(slot.handle)
        self.workers = []
        if self.trainer_group is not None:
            self.trainer_group.stop(timeout_s=60.0)
        if self._ps_actor is not None:
            ray.kill(self._ps_actor)

    def close(self) -> None:
        """Records goodput, stops the actors, closes the files, and shuts Ray down if
        this object started it (idempotent)."""
        if self._closed:
            return
        self._closed = True
        summary = self.summary()
        self.trace.record(
            self.clock(),
            "run_end",
            "controller",
            self.version,
            **{k: summary[k] for k in ("goodput", "useful_train_s", "lost_train_s", "wall_s")},
            lost_steps=summary["lost_steps"],
        )
        self._stop_actors()
        if self._scorer is not None:
            self._scorer.close()
        self.logger.close()
        self.trace.close()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> RayExperiment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
