"""InferenceWorker: pull the newest weights, generate, score, emit ``Rollout``s.

A worker wraps one continuous-batching ``InferenceEngine``. Between chunks of decode
steps it asks the ``StalenessPolicy`` whether it lags the parameter server too far; if
so it pulls — at once, recomputing the running rows' KV caches (``in_flight``, AReaL's
interruptible generation), or after its running prompts finish (``between_requests``,
RLAX: every rollout from one version). When all ``n`` samples of a prompt are done it
scores them with the task's verifiable reward and hands back ``Rollout``s.

A task with environments (``rlaxkit.tasks.episodes.EpisodicTask``, e.g. the calculator) makes
every sample an episode (``rlaxkit.worker.multi_turn.EpisodeTurns``): a turn that ends at a
tool call parks its row while its environment steps in a thread, and the row resumes
after the observation's ids, until the environment ends the episode or its turns or
tokens run out. Steps are resolved before each chunk: all of them in deterministic mode,
those that are done in a free-running one (``free_running``), where a slow tool holds
up its own episode only. A finished episode is one ``Rollout`` whose trained tokens are
the sampled ids followed by the observation ids (``policy_mask`` marks the sampled
ones); GRPO groups the ``n`` episodes of a prompt. The environment's reward is the
rollout's: the scorer is not called.

Checkpoints (``snapshot`` / ``restore``): the engine's partly generated sequences and KV
caches are not saved. The worker records what it does to its engine in a
``rlaxkit.worker.replay_log.ReplayLog`` and a restored worker replays that log on a fresh
engine, which regenerates its in-flight prompts bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flax import nnx

from rlaxkit.data.rollout import Rollout
from rlaxkit.inference import InferenceConfig, InferenceEngine, SamplingConfig
from rlaxkit.inference.results import Completion
from rlaxkit.models.tokenizer import Tokenizer
from rlaxkit.param_server import ParameterServer
from rlaxkit.rules.controller import Issue
from rlaxkit.rules.policies import StalenessPolicy, WeightSyncPolicy
from rlaxkit.rules.trace import TraceSink
from rlaxkit.tasks import Problem, RewardRunner, Task
from rlaxkit.tasks.episodes import EpisodeConfig
from rlaxkit.worker.replay_log import ReplayLog, parse_ops, replay_ops
from rlaxkit.worker.samples import WorkerSamples, worker_samples


@dataclass
class _Request:
    issue: Issue
    problem: Problem
    prompt_tokens: list[int]
    issued_s: float
    chunks: int = 0  # decode chunks run since it was submitted


@dataclass(frozen=True)
class _Launched:
    """A launched chunk's books, kept until ``fetch``."""

    rows: int  # rows decoding
    started: int  # rows of prompts that had not run a chunk yet
    chunks_before: dict[int, int]  # group id -> chunks its prompt had run before
    launch_s: float
    preempted: int = 0  # rows a paged engine sent back to its queue for want of pages


@dataclass(frozen=True)
class EngineSettings:
    """What a worker builds its engine with at each pull (see ``InferenceWorker``)."""

    num_slots: int
    chunk_steps: int
    max_prompt_tokens: int
    cache_views: bool
    inference: InferenceConfig


class InferenceWorker:
    """One inference worker of the fleet.

    Args:
        worker_id: name used in the trace (``worker-0``).
        graphdef: the policy's NNX graph (weights come from the parameter server).
        sampling: sampling settings; ``n`` samples per prompt.
        task: formats prompts and supplies problems' rewards.
        tokenizer: encodes prompts, decodes completions.
        scorer: scores completions (inline or in a process pool, per task).
        param_server: where weights are pulled from.
        staleness: decides when this worker must pull.
        weight_sync: pull mode (between requests or in flight).
        trace: event sink.
        clock: seconds since run start.
        num_slots: decode rows; the worker runs ``num_slots // n`` prompts at once.
        chunk_steps: decode steps per ``step()``.
        max_prompt_tokens: longest prompt accepted.
        episodes: turns, token budget and step timeout of a multi-turn task's episodes
            (default ``EpisodeConfig()``; its ``samples_per_problem`` and ``keep_cache``
            are not used: a group is ``sampling.n`` episodes and a parked row keeps its
            cache unless ``release_after_s`` frees it; ``tool_workers`` threads run the
            steps). Ignored for a single-turn task.
        free_running: resolve the tool steps that are done and leave the others parked
            (``runtime.mode=concurrent``); otherwise every step is resolved before the
            next chunk, in order, so the run is reproducible and its replay log exact.
        cache_views: the engine decodes on cache views (``InferenceEngine``'s
            ``cache_views``; ``runtime.cache_views``).
        inference: the engine's KV cache, dense or paged (``inference`` of the run
            config); default dense.
    """

    def __init__(
        self,
        worker_id: str,
        graphdef: nnx.GraphDef,
        sampling: SamplingConfig,
        *,
        task: Task,
        tokenizer: Tokenizer,
        scorer: RewardRunner,
        param_server: ParameterServer,
        staleness: StalenessPolicy,
        weight_sync: WeightSyncPolicy,
        trace: TraceSink,
        clock: Callable[[], float],
        num_slots: int,
        chunk_steps: int,
        max_prompt_tokens: int,
        episodes: EpisodeConfig | None = None,
        free_running: bool = False,
        cache_views: bool = True,
        inference: InferenceConfig | None = None,
    ):
        stop = tuple(dict.fromkeys((*sampling.stop_tokens, tokenizer.eos_id)))
        self.samples: WorkerSamples = worker_samples(  # a single- or multi-turn task's
            worker_id,
            task,
            tokenizer,
            dataclasses.replace(sampling, stop_tokens=stop),
            episodes=episodes,
            max_prompt_tokens=max_prompt_tokens,
            num_slots=num_slots,
            trace=trace,
            clock=clock,
            free_running=free_running,
        )
        self.sampling = self.samples.sampling
        self.worker_id = worker_id
        self.graphdef = graphdef
        self.scorer = scorer  # concurrent mode shares one under a lock
        self.param_server = param_server
        self.staleness, self.weight_sync = staleness, weight_sync
        self.trace, self.clock = trace, clock
        self.settings = EngineSettings(
            num_slots, chunk_steps, max_prompt_tokens, cache_views, inference or InferenceConfig()
        )
        self.engine: InferenceEngine | None = None
        self.version: int | None = None
        self.draining = False
        self.requests: dict[int, _Request] = {}
        self.generated_tokens = 0
        self.failed_pulls = 0
        self.replay_log = ReplayLog()
        self._launched: _Launched | None = None
        self._ended: list[_Request] = []  # prompts whose episodes ended before a chunk

    # -- weights ---------------------------------------------------------------------
    def sync_weights(self) -> bool:
        """Pulls when the policy says this worker lags too far; returns True if it did.

        In ``between_requests`` mode a worker with running prompts only stops taking new
        ones (``draining``) and pulls once they are done.
        """
        busy, latest = bool(self.requests), self.param_server.latest_version()
        action = self.weight_sync.sync_action(self.staleness, self.version, latest, busy=busy)
        if action != "pull":
            self.draining = self.draining or action == "drain"
            return False
        start = self.clock()
        try:
            version, params = self.param_server.pull()
        except (ConnectionError, TimeoutError) as error:
            # The store is down or the transfer failed: counted, retried next round.
            self.failed_pulls += 1
            self.trace.record(
                self.clock(),
                "fault",
                self.worker_id,
                self.version,
                fault=getattr(error, "fault", "fail_pull"),
                error=str(error)[:200],
            )
            return False
        rebuilt = {"rebuilt": n} if self.requests and (n := self._engine.num_held) else {}
        if self.requests:  # in flight: the running rows' caches are rebuilt
            self._take_weights(version, params, recompute_cache=True)
        else:  # an idle engine, or none: a new replay log starts from these weights
            if self.engine is None:
                self.engine = self._new_engine(params, version)
            else:
                self.engine.update_weights(params, version)
            self.replay_log.reset(version, params)
        self.version, self.draining = version, False
        took = self.clock() - start
        self.trace.record(self.clock(), "pull", self.worker_id, version, duration_s=took, **rebuilt)
        return True

    @property
    def _engine(self) -> InferenceEngine:
        """The engine, which exists from the first pull until a preemption."""
        if self.engine is None:
            raise RuntimeError(f"{self.worker_id}: no inference engine before the first pull")
        return self.engine

    def _new_engine(self, params: nnx.State, version: int) -> InferenceEngine:
        return InferenceEngine(
            (self.graphdef, params),
            self.sampling,
            num_slots=self.settings.num_slots,
            max_prompt_len=self.samples.max_prompt_len,
            max_context_len=self.samples.max_context_len,
            version=version,
            chunk_steps=self.settings.chunk_steps,
            cache_views=self.settings.cache_views,
            kv_cache=self.settings.inference.kv_cache,
            page_size=self.settings.inference.page_size,
            num_pages=self.settings.inference.num_pages,
            attention_block=self.settings.inference.attention_block,
            compile_rebuild=self.weight_sync.interrupts_generation,  # now, not mid-run
        )

    def _take_weights(self, version: int, params: nnx.State, *, recompute_cache: bool) -> None:
        self._engine.update_weights(params, version, recompute_cache=recompute_cache)
        self.replay_log.updated(version, params, recompute_cache=recompute_cache)
        self.version = version

    # -- prompts ---------------------------------------------------------------------
    @property
    def free(self) -> int:
        """How many more prompts this worker takes now (``WorkerSamples.free``): none
        while it drains or before its first pull."""
        if self.draining or self.engine is None:
            return 0
        return self.samples.free(self.engine, len(self.requests))

    def submit(self, issue: Issue, problem: Problem) -> None:
        """Starts generating the ``n`` samples (or episodes) of one issued prompt."""
        prompt = self.samples.prompt(problem)
        if len(prompt) > self.settings.max_prompt_tokens:
            raise ValueError(
                f"problem {problem.id}: prompt of {len(prompt)} tokens exceeds "
                f"runtime.max_prompt_tokens={self.settings.max_prompt_tokens}; raise it"
            )
        now = self.clock()
        self._start(issue, problem, prompt, now)
        record, group_id, length = self.trace.record, issue.group_id, len(prompt)
        for j in range(self.sampling.n):
            record(
                now,
                "generation_start",
                self.worker_id,
                self.version,
                sample=f"{group_id}:{j}",
                rollout=group_id,
                prompt_tokens=length,
            )

    def _start(self, issue: Issue, problem: Problem, prompt: list[int], now: float) -> None:
        engine = self._engine
        request = _Request(issue, problem, prompt, now)
        self.requests[issue.group_id] = request
        self.samples.start(engine, issue, problem, prompt)
        self.replay_log.submitted(issue.group_id)

    # -- generation ------------------------------------------------------------------
    def step(self) -> list[Rollout]:
        """One chunk of decoding; returns the scored rollouts of prompts that finished.

        Records a ``decode`` event for the chunk (``rlaxkit.rules.trace``): its wall time
        (prefill of the prompts it starts, the decode steps, fetching finished rows;
        not scoring, which the ``reward`` event times) and how many rows it ran.
        ``launch``, ``fetch`` and ``score`` are its three parts, for a caller that runs
        another worker's chunk while this one's prompts are scored.
        """
        self.launch()
        return self.score(self.fetch())

    def advance(self) -> None:
        """Resolves what waits between turns (a multi-turn task's tool steps due); the
        prompts that ended so wait for ``fetch``."""
        if self.engine is not None:
            for group_id in self.samples.advance(self.engine, self.replay_log):
                self._ended.append(self.requests.pop(group_id))

    def launch(self, *, advanced: bool = False) -> None:
        """Resolves the episodes' tool steps due (unless the caller did: ``advanced``),
        then dispatches one chunk; ``fetch`` waits for it. With asynchronous dispatch
        this returns before the chunk has run; XLA:CPU under ``rlaxkit.util.hostmem`` runs it
        on this thread first."""
        self._launched = None
        if self.engine is None:
            return
        if not advanced:
            self.advance()
        if not self.requests:
            return
        started = sum(self.sampling.n for r in self.requests.values() if r.chunks == 0)
        chunks_before = {g: r.chunks for g, r in self.requests.items()}
        start, preempted = self.clock(), self.engine.preemptions
        if self.engine.launch():  # none while every row waits for a tool
            rows = self.engine.num_running
            preempted = self.engine.preemptions - preempted
            self._launched = _Launched(
                rows, started, chunks_before, self.clock() - start, preempted
            )

    def fetch(self, *, pipelined: bool = False, waited_s: float | None = None) -> list[_Request]:
        """Waits for the launched chunk, records its ``decode`` event and returns the
        prompts it completed (for ``score``).

        The event's ``duration_s`` is the caller's time on the chunk: the launch plus
        the wait and fetch. ``pipelined``: the caller did other work (it scored another
        worker's prompts, or decoded another worker's chunk) while the chunk ran; the
        event says so, for its duration is then less than the chunk's cost.
        ``waited_s``: the launch ran on another thread, and the caller waited this long
        for it; it replaces the launch's time in the event.
        """
        launched, self._launched = self._launched, None
        ended, self._ended = self._ended, []
        if launched is None:
            if ended and not self.requests:  # the engine drained
                self.replay_log.reset(self.version, self._engine.params)
            return ended
        start = self.clock()
        complete, finished = self._decode()
        end = self.clock()
        if self._engine.num_running:  # rows still decoding: the chunk ran all its steps
            steps = self.settings.chunk_steps
        else:  # it stopped when its longest row did
            steps = max(
                (  # a resumed turn counts from its resume: at least 0
                    max(
                        0,
                        c.num_tokens
                        - self.settings.chunk_steps * launched.chunks_before[c.request_id],
                    )
                    for c in finished
                ),
                default=0,
            )
        self.trace.record(
            end,
            "decode",
            self.worker_id,
            self.version,
            duration_s=(launched.launch_s if waited_s is None else waited_s) + end - start,
            rows=launched.rows,
            started=launched.started,
            finished=len(finished),
            steps=int(steps),
            **({"pipelined": True} if pipelined else {}),
            **({"preempted": launched.preempted} if launched.preempted else {}),
        )
        if not self.requests:  # the engine drained: a fresh one would be the same
            self.replay_log.reset(self.version, self._engine.params)
        return ended + complete

    def _decode(self) -> tuple[list[_Request], list[Completion]]:
        """Finishes the engine's launched chunk; returns the prompts it completed and the
        rows it finished."""
        finished = self._engine.finish()
        self.replay_log.decoded()
        for request in self.requests.values():
            request.chunks += 1
        complete = []
        for completion in finished:
            self.generated_tokens += completion.num_tokens
            if self.samples.take(completion, self.version):
                complete.append(self.requests.pop(completion.request_id))
        return complete, finished

    def score(self, requests: list[_Request]) -> list[Rollout]:
        """Scores the prompts ``fetch`` returned; their rollouts, in order."""
        if not requests:
            return []
        return self.samples.rollouts(requests, self.scorer)

    # -- faults ----------------------------------------------------------------------
    def preempt(self) -> list[Issue]:
        """Loses everything in flight (engine, weights); returns the issues to re-issue."""
        lost = [r.issue for r in self.requests.values()]
        if self.engine is not None:
            self.engine.abort()
        self.samples.drop()
        self.requests.clear()
        self._ended = []
        self.engine, self.version, self.draining = None, None, False
        self.replay_log.reset(None)
        return lost

    # -- checkpoints -----------------------------------------------------------------
    def replay_weights(self) -> dict[int, Any]:
        """``version -> params`` the replay log needs (save them with the snapshot)."""
        return self.replay_log.weights()

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state: weight version, draining flag, counters and the replay log.

        The weights named by ``replay_weights()`` are not included; a checkpoint stores
        them once for all workers.
        """
        return {
            "worker_id": self.worker_id,
            "version": self.version,
            "draining": self.draining,
            "generated_tokens": self.generated_tokens,
            "failed_pulls": self.failed_pulls,
            **self.replay_log.state_dict(),  # base_version, ops
            "in_flight": {str(g): r.issued_s for g, r in sorted(self.requests.items())},
        }

    def restore(
        self,
        snapshot: dict[str, Any],
        *,
        issue_for: Callable[[int], Issue],
        problem_for: Callable[[Issue], Problem],
        weights_for: Callable[[int], Any],
    ) -> None:
        """Rebuilds the state saved by ``snapshot`` by replaying its log on a new engine.

        Args:
            snapshot: from ``snapshot()`` (possibly of another process).
            issue_for: the controller's ``issue_for`` (group id -> the same issue).
            problem_for: the problem of an issue.
            weights_for: ``version -> params`` for every version of ``replay_weights()``.

        Raises:
            ValueError: the snapshot belongs to another worker, or the replay does not
                end with the saved in-flight prompts (the run's code or config changed).
        """
        if snapshot["worker_id"] != self.worker_id:
            raise ValueError(f"snapshot of {snapshot['worker_id']} cannot restore {self.worker_id}")
        ops = parse_ops(snapshot["ops"])
        self.preempt()
        base = snapshot["base_version"]
        if base is not None:
            params = weights_for(base)
            self.engine = self._new_engine(params, base)
            self.replay_log.reset(base, params)
            self.version = base
            issued = {int(g): t for g, t in snapshot["in_flight"].items()}

            def submit(group_id: int) -> None:
                issue = issue_for(group_id)
                problem = problem_for(issue)
                prompt = self.samples.prompt(problem)
                self._start(issue, problem, prompt, issued.get(group_id, 0.0))

            def decode() -> None:  # the steps the worker resolved before the chunk, too
                self.advance()
                self._engine.launch()
                self._decode()

            def update(version: int, recompute_cache: bool) -> None:
                self._take_weights(version, weights_for(version), recompute_cache=recompute_cache)

            replay_ops(ops, submit=submit, decode=decode, update_weights=update)
            self._ended = []  # handed back before the checkpoint
            replayed = [op.to_json() for op in self.replay_log.ops]
            self.samples.check_replay(replayed, [op.to_json() for op in ops], self.worker_id)
            if sorted(self.requests) != sorted(issued):
                raise ValueError(
                    f"{self.worker_id}: replaying the checkpoint's log left prompts "
                    f"{sorted(self.requests)} in flight, the checkpoint had {sorted(issued)}"
                )
        self.version = snapshot["version"]
        self.draining = snapshot["draining"]
        self.generated_tokens = snapshot["generated_tokens"]
        self.failed_pulls = snapshot["failed_pulls"]

    def close(self) -> None:
        """Stops the tool-step threads (a multi-turn task's)."""
        self.samples.close()
