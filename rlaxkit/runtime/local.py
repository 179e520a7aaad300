"""The local backend: the whole RLAX/AReaL loop in one process; the notebook API.

``Experiment(config)`` builds the parts; ``exp.step()`` runs the loop until the trainer
has taken one step and returns that step's metrics; ``exp.run(n)`` repeats it. In
``deterministic`` mode the loop interleaves, in a fixed order, one chunk of decoding on
each worker and a trainer step whenever the buffer holds a full batch, so a seed fixes
every metric except wall-clock timings (keys under ``time/`` and ``throughput/``).

One iteration of the loop:

1. the controller issues prompts while the ``StalenessPolicy`` admits more
   (``accepted + running < (η + version + 1) · batch``) and a worker has room;
2. each worker pulls if it lags the parameter server too far, then decodes one chunk;
   finished prompts are scored and their rollouts go to the buffer;
3. when the buffer yields a batch of admitted groups (oldest first, stale ones dropped),
   the trainer takes a step and pushes the new version per the ``WeightSyncPolicy``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from rlaxkit.algorithms import algorithm
from rlaxkit.batch import BucketSpec, TrainBatch, collate
from rlaxkit.buffer import RolloutBuffer
from rlaxkit.config import RunConfig
from rlaxkit.controller import PromptController
from rlaxkit.evaluation import EvalReport, evaluate_policy
from rlaxkit.inference import make_text_generate
from rlaxkit.metrics import MetricsLogger
from rlaxkit.param_server import InProcessParameterServer
from rlaxkit.rollout import RolloutGroup
from rlaxkit.runtime.build import build_policy, build_task, warm_start
from rlaxkit.tasks import RewardRunner
from rlaxkit.trace import JsonlTraceWriter, MemoryTrace
from rlaxkit.trainer import TrainConfig, create_train_state, make_train_step
from rlaxkit.worker import InferenceWorker

_BUCKETS = BucketSpec(lengths=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096))


class _Tee:
    """Records every event in memory and, with a run directory, in trace.jsonl."""

    def __init__(self, path: Path | None):
        self.memory = MemoryTrace()
        self.file = JsonlTraceWriter(path, append=True) if path else None

    def record(self, t, kind, actor, version=None, **fields):
        self.memory.record(t, kind, actor, version, **fields)
        if self.file:
            self.file.emit(self.memory.events[-1])

    def close(self):
        if self.file:
            self.file.close()


class Experiment:
    """An RL run you can step through.

    >>> exp = Experiment(RunConfig(steps=3))  # doctest: +SKIP
    >>> metrics = exp.step()                   # doctest: +SKIP
    >>> exp.last_batch.rewards                 # doctest: +SKIP

    Args:
        config: the run configuration.
        run_dir: where to write config.yaml, metrics.jsonl, trace.jsonl and the warm
            start cache; ``None`` keeps everything in memory.
        progress: show progress bars.
        cache_dir: where the warm-start cache lives (default: ``run_dir``); runs that
            share a model, task and SFT config share the warm start.
    """

    def __init__(
        self,
        config: RunConfig,
        run_dir: str | Path | None = None,
        progress: bool = False,
        cache_dir: str | Path | None = None,
    ):
        if config.runtime.backend != "local":
            raise ValueError(
                f"runtime.backend is {config.runtime.backend!r}; Experiment runs the local "
                "backend (use rlaxkit.runtime.ray_backend for ray)"
            )
        if config.runtime.mode != "deterministic":
            raise ValueError(
                f"runtime.mode {config.runtime.mode!r} is not available in this version; "
                "use runtime.mode=deterministic"
            )
        self.config = config
        self.run_dir = Path(run_dir) if run_dir else None
        if self.run_dir:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            config.save(self.run_dir / "config.yaml")
        self._t0 = time.perf_counter()
        self.trace = _Tee(self.run_dir / "trace.jsonl" if self.run_dir else None)
        self.trace.record(0.0, "run_start", "controller", None, config=config.to_dict())
        self.task = build_task(config)
        model, self.tokenizer = build_policy(config, self.task)
        self.model, self.warm_start = warm_start(
            config, self.task, model, self.tokenizer, Path(cache_dir) if cache_dir else self.run_dir
        )
        self.graphdef, params = nnx.split(self.model)
        algo = algorithm(
            config.algorithm.preset,
            **{
                k: v
                for k, v in (
                    ("advantage", config.algorithm.advantage),
                    ("loss", config.algorithm.loss),
                )
                if v
            },
        )
        self.train_config = TrainConfig(
            algorithm=algo,
            optimizer=config.optimizer,
            micro_batches=config.trainer.micro_batches,
            mini_batches=config.trainer.mini_batches,
            epochs=config.trainer.epochs,
            temperature=config.sampling.temperature or 1.0,
        )
        ref = params if algo.needs_reference else None
        self.state = create_train_state(self.train_config, params, seed=config.seed, ref_params=ref)
        self._train_step = make_train_step(self.train_config, self.graphdef)
        self.param_server = InProcessParameterServer(
            keep=config.runtime.keep_versions,
            copy_on_push=True,
            on_event=self._on_transfer,
        )
        self.param_server.push(0, self.state.params)
        self.problems = self.task.problems("train", config.task.num_train)
        self.controller = PromptController(len(self.problems), seed=config.seed)
        self.buffer = RolloutBuffer(config.staleness, group_size=config.group_size)
        self.scorer = RewardRunner.for_task(self.task).start()
        self.workers = [
            InferenceWorker(
                f"worker-{i}",
                self.graphdef,
                config.sampling,
                task=self.task,
                tokenizer=self.tokenizer,
                scorer=self.scorer,
                param_server=self.param_server,
                staleness=config.staleness,
                weight_sync=config.weight_sync,
                trace=self.trace,
                clock=self.clock,
                num_slots=config.runtime.slots_per_worker,
                chunk_steps=config.runtime.chunk_steps,
                max_prompt_tokens=config.runtime.max_prompt_tokens,
            )
            for i in range(config.runtime.num_workers)
        ]
        self.version = 0
        self.last_batch: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []
        self.logger = MetricsLogger(
            self.run_dir / "metrics.jsonl" if self.run_dir else None,
            total_steps=config.steps,
            progress=progress,
        )
        self._since = {"t": self.clock(), "tokens": 0, "samples": 0, "train_s": 0.0}

    # -- time and events ---------------------------------------------------------------
    def clock(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self._t0

    def _on_transfer(self, kind: str, version: int, **fields: Any) -> None:
        if kind == "push":
            self.trace.record(
                self.clock(),
                "push",
                "trainer",
                version,
                duration_s=fields.get("duration_s", 0.0),
                bytes=fields.get("bytes", 0),
            )

    # -- the loop ----------------------------------------------------------------------
    def _issue(self) -> int:
        """Hands prompts to workers with room while the staleness policy admits more."""
        policy = self.config.staleness
        # Admission counts from the newest *published* version: with pushes every k
        # steps, counting from the trainer's step would start generations on weights
        # already too old to be accepted.
        published = self.param_server.latest_version()
        issued = 0
        for worker in self.workers:
            room = min(
                worker.free,
                policy.capacity(self.buffer.accepted, self.buffer.in_flight, published),
            )
            for issue in self.controller.next_issues(room) if room > 0 else []:
                problem = self.problems[issue.problem_index]
                self.buffer.issue(issue.group_id, problem.id)
                worker.submit(issue, problem)
                issued += 1
        return issued

    def _collect_batch(self) -> list[RolloutGroup]:
        idle_rounds = 0
        dropped_before = len(self.buffer.dropped)
        patience = 50 * self.config.staleness.batch_size
        while True:
            batch = self.buffer.take_batch(self.version)
            if batch is not None:
                return batch
            for worker in self.workers:
                worker.sync_weights()
            progressed = self._issue() > 0
            for worker in self.workers:
                rollouts = worker.step()
                progressed |= bool(rollouts) or bool(worker.requests)
                for rollout in rollouts:
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
            if len(self.buffer.dropped) - dropped_before > patience:
                raise RuntimeError(
                    f"{patience} prompt groups in a row were dropped "
                    f"({self.buffer.counts()['dropped_by_reason']}) without one batch: with "
                    "'filtered', the policy always or never solves the task; warm start "
                    "longer (sft.steps), pick an easier task, or lower η for 'stale'"
                )
            idle_rounds = 0 if progressed else idle_rounds + 1
            if idle_rounds > 2:
                raise RuntimeError(
                    "the loop stalled: no prompt is in flight and no batch is ready "
                    f"(buffer {self.buffer.counts()}); check staleness.batch_size against "
                    "runtime.num_workers * slots_per_worker / sampling.n"
                )

    def step(self) -> dict[str, Any]:
        """Runs until the trainer has taken one step; returns its metrics."""
        t_start = self.clock()
        groups = self._collect_batch()
        t_gen = self.clock()
        samples = [r for g in groups for r in g.rollouts]
        batch = collate(samples, bucket=_BUCKETS, pad_token_id=self.tokenizer.pad_id)
        self.state, train_metrics = self._train_step(self.state, batch)
        train_metrics = {k: float(v) for k, v in jax.device_get(train_metrics).items()}
        self.version += 1
        t_train = self.clock()
        if self.config.weight_sync.should_push(self.version):
            self.param_server.push(self.version, self.state.params)
        metrics = self._metrics(groups, samples, batch, train_metrics, t_start, t_gen, t_train)
        self.trace.record(
            self.clock(),
            "train_step",
            "trainer",
            self.version,
            step=self.version,
            samples=len(samples),
            tokens=int(batch.loss_mask.sum()),
            duration_s=t_train - t_gen,
            staleness=[self.version - 1 - g.first_version for g in groups],
        )
        self.last_batch = {"groups": groups, "batch": batch, "metrics": metrics}
        self.history.append(metrics)
        self.logger.log(metrics)
        return metrics

    def _metrics(
        self, groups, samples, batch: TrainBatch, train_metrics, t_start, t_gen, t_train
    ) -> dict[str, Any]:
        rewards = np.array([s.reward for s in samples])
        staleness = np.array([self.version - 1 - g.first_version for g in groups])
        correct = np.array([s.reward_info["correct"] for s in samples])
        tokens = sum(w.generated_tokens for w in self.workers)
        elapsed = max(t_train - self._since["t"], 1e-9)
        counts = self.buffer.counts()
        out = {
            "step": self.version,
            "reward/mean": float(rewards.mean()),
            "reward/pass_rate": float(correct.mean()),
            "staleness/mean": float(staleness.mean()),
            "staleness/max": int(staleness.max()),
            "completion/mean_tokens": float(np.mean([s.num_tokens for s in samples])),
            "buffer/in_flight": counts["in_flight"],
            "buffer/buffered": counts["buffered"],
            "buffer/trained": counts["trained"],
            "buffer/dropped": counts["dropped"],
            **{f"dropped/{k}": v for k, v in counts["dropped_by_reason"].items()},
            **{f"train/{k}": v for k, v in train_metrics.items()},
            "time/generate_s": t_gen - t_start,
            "time/train_s": t_train - t_gen,
            "throughput/tokens_per_s": (tokens - self._since["tokens"]) / elapsed,
            "throughput/samples_per_s": self._since["samples"] / elapsed,
        }
        self._since = {"t": t_train, "tokens": tokens, "samples": 0, "train_s": 0.0}
        return out

    def run(self, steps: int | None = None) -> list[dict[str, Any]]:
        """Takes ``steps`` trainer steps (default: the config's) and returns their metrics."""
        return [self.step() for _ in range(self.config.steps if steps is None else steps)]

    def check_accounting(self) -> None:
        """Asserts that every issued prompt is in flight, buffered, trained or dropped."""
        self.buffer.check(self.controller.next_group_id)

    # -- evaluation and teardown -------------------------------------------------------
    def current_model(self) -> nnx.Module:
        """The trainer's current policy as a model (shares the train state's arrays)."""
        return nnx.merge(self.graphdef, self.state.params)

    def evaluate(
        self, num_problems: int | None = None, samples: int | None = None, seed: int = 1234
    ) -> EvalReport:
        """Held-out pass@1 (and pass@k) at the training temperature on the test split."""
        cfg = self.config.eval
        n = samples or cfg.samples
        params = jax.tree.map(lambda x: x.copy(), self.state.params)
        generate = make_text_generate((self.graphdef, params), self.tokenizer, self.config.sampling)
        problems = self.task.problems("test", num_problems or cfg.num_problems)
        return evaluate_policy(
            self.task,
            generate,
            problems=problems,
            n=n,
            ks=sorted({1, n}),
            seed=seed,
            runner=self.scorer,
        )

    def close(self) -> None:
        """Stops the reward pool and closes the metrics and trace files."""
        self.scorer.close()
        self.logger.close()
        self.trace.close()

    def __enter__(self) -> Experiment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
