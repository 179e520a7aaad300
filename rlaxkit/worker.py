"""InferenceWorker: pull the newest weights, generate, score, emit ``Rollout``s.

A worker wraps one continuous-batching ``InferenceEngine``. Between chunks of decode
steps it asks the ``StalenessPolicy`` whether it lags the parameter server too far; if
so it pulls — at once, recomputing the running rows' KV caches (``in_flight``, AReaL's
interruptible generation), or after its running prompts finish (``between_requests``,
RLAX: every rollout from one version). When all ``n`` samples of a prompt are done it
scores them with the task's verifiable reward and hands back ``Rollout``s.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rlaxkit.controller import Issue
from rlaxkit.inference import InferenceEngine, SamplingConfig
from rlaxkit.inference.results import Completion
from rlaxkit.models.tokenizer import Tokenizer
from rlaxkit.param_server import ParameterServer
from rlaxkit.policies import StalenessPolicy, WeightSyncPolicy
from rlaxkit.rollout import Rollout
from rlaxkit.tasks import Problem, RewardRunner, Task
from rlaxkit.trace import TraceSink


@dataclass
class _Request:
    issue: Issue
    problem: Problem
    prompt_tokens: list[int]
    issued_s: float
    done: list[Completion] = field(default_factory=list)


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
    """

    def __init__(
        self,
        worker_id: str,
        graphdef,
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
    ):
        stop = tuple(dict.fromkeys((*sampling.stop_tokens, tokenizer.eos_id)))
        self.sampling = dataclasses.replace(sampling, stop_tokens=stop)
        self.worker_id = worker_id
        self.graphdef = graphdef
        self.task, self.tokenizer, self.scorer = task, tokenizer, scorer
        self.param_server = param_server
        self.staleness, self.weight_sync = staleness, weight_sync
        self.trace, self.clock = trace, clock
        self.num_slots, self.chunk_steps = num_slots, chunk_steps
        self.max_prompt_tokens = max_prompt_tokens
        self.capacity = max(1, num_slots // self.sampling.n)
        self.engine: InferenceEngine | None = None
        self.version: int | None = None
        self.draining = False
        self.requests: dict[int, _Request] = {}
        self.generated_tokens = 0

    # -- weights ---------------------------------------------------------------------
    def sync_weights(self) -> bool:
        """Pulls when the policy says this worker lags too far; returns True if it did.

        In ``between_requests`` mode a worker with running prompts only stops taking new
        ones (``draining``) and pulls once they are done.
        """
        latest = self.param_server.latest_version()
        if latest is None or not self.staleness.must_pull(self.version, latest):
            return False
        if self.requests and not self.weight_sync.interrupts_generation:
            self.draining = True
            return False
        start = self.clock()
        version, params = self.param_server.pull()
        if self.engine is None:
            self.engine = InferenceEngine(
                (self.graphdef, params),
                self.sampling,
                num_slots=self.num_slots,
                max_prompt_len=self.max_prompt_tokens,
                version=version,
                chunk_steps=self.chunk_steps,
            )
        else:
            self.engine.update_weights(params, version, recompute_cache=bool(self.requests))
        self.version, self.draining = version, False
        self.trace.record(
            self.clock(), "pull", self.worker_id, version, duration_s=self.clock() - start
        )
        return True

    # -- prompts ---------------------------------------------------------------------
    @property
    def free(self) -> int:
        """How many more prompts this worker takes now."""
        if self.draining or self.engine is None:
            return 0
        return self.capacity - len(self.requests)

    def submit(self, issue: Issue, problem: Problem) -> None:
        """Starts generating the ``n`` samples of one issued prompt."""
        prompt = self.tokenizer.encode(self.task.format_prompt(problem))
        if len(prompt) > self.max_prompt_tokens:
            raise ValueError(
                f"problem {problem.id}: prompt of {len(prompt)} tokens exceeds "
                f"runtime.max_prompt_tokens={self.max_prompt_tokens}; raise it"
            )
        now = self.clock()
        self.requests[issue.group_id] = _Request(issue, problem, prompt, now)
        self.engine.submit(prompt, rng=issue.seed, request_id=issue.group_id)
        for j in range(self.sampling.n):
            self.trace.record(
                now,
                "generation_start",
                self.worker_id,
                self.version,
                sample=f"{issue.group_id}:{j}",
                rollout=issue.group_id,
                prompt_tokens=len(prompt),
            )

    # -- generation ------------------------------------------------------------------
    def step(self) -> list[Rollout]:
        """One chunk of decoding; returns the scored rollouts of prompts that finished."""
        if self.engine is None or not self.requests:
            return []
        finished = self.engine.step()
        complete = []
        for completion in finished:
            request = self.requests[completion.request_id]
            request.done.append(completion)
            self.generated_tokens += completion.num_tokens
            if len(request.done) == self.sampling.n:
                complete.append(self.requests.pop(completion.request_id))
        return self._score(complete)

    def _text(self, completion: Completion) -> str:
        tokens = completion.tokens.tolist()
        if (
            completion.finish_reason == "stop"
            and tokens
            and tokens[-1] in self.sampling.stop_tokens
        ):
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens)

    def _score(self, requests: list[_Request]) -> list[Rollout]:
        if not requests:
            return []
        pairs = [(r, c) for r in requests for c in sorted(r.done, key=lambda c: c.sample_index)]
        start = time.perf_counter()
        results = self.scorer.score(
            [r.problem for r, _ in pairs], [self._text(c) for _, c in pairs]
        )
        score_s = time.perf_counter() - start
        now = self.clock()
        rollouts = []
        for (request, completion), result in zip(pairs, results, strict=True):
            rollout = Rollout(
                group_id=request.issue.group_id,
                sample_index=completion.sample_index,
                problem_id=request.problem.id,
                prompt_tokens=np.asarray(request.prompt_tokens, np.int32),
                completion_tokens=completion.tokens,
                behaviour_logprobs=completion.logprobs,
                versions=completion.versions,
                reward=float(result.score),
                finish_reason=completion.finish_reason,
                worker_id=self.worker_id,
                reward_info={
                    "parsed": result.parsed,
                    "reason": result.reason,
                    "correct": bool(result.correct),
                },
                timings={"issued_s": request.issued_s, "finished_s": now},
            )
            self.trace.record(
                now,
                "generation_end",
                self.worker_id,
                rollout.last_version,
                sample=rollout.sample_id,
                rollout=rollout.group_id,
                tokens=rollout.num_tokens,
                first_version=rollout.first_version,
                finish=rollout.finish_reason,
            )
            rollouts.append(rollout)
        self.trace.record(
            now,
            "reward",
            "verifier",
            None,
            sample=f"{requests[0].issue.group_id}",
            duration_s=score_s,
            samples=len(pairs),
        )
        return rollouts

    # -- faults ----------------------------------------------------------------------
    def preempt(self) -> list[Issue]:
        """Loses everything in flight (engine, weights); returns the issues to re-issue."""
        lost = [r.issue for r in self.requests.values()]
        if self.engine is not None:
            self.engine.abort()
        self.requests.clear()
        self.engine, self.version, self.draining = None, None, False
        return lost
