"""Single-turn samples as rollouts rewarded by the task's verifier.

``VerifiedSamples`` gathers the finished samples of an inference worker's issued
prompts; once all ``n`` of a prompt are done, a ``RewardRunner`` scores the completions'
text (the final stop token dropped) and ``verified_rollout`` makes each sample and its
``RewardResult`` a ``Rollout`` (``reward_info``: what the verifier parsed, why it
scored so, and the failure's detail when the reward itself failed). A multi-turn task's
episodes are rewarded by their environments instead (``rlaxkit.worker.multi_turn``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from rlaxkit.data.rollout import Rollout
from rlaxkit.inference import InferenceEngine, SamplingConfig
from rlaxkit.inference.results import Completion
from rlaxkit.models.tokenizer import Tokenizer
from rlaxkit.rules.controller import Issue
from rlaxkit.rules.trace import TraceSink
from rlaxkit.tasks import REWARD_FAILURES, Problem, RewardResult, RewardRunner, Task
from rlaxkit.worker.replay_log import ReplayLog

__all__ = [
    "IssuedPrompt",
    "VerifiedSamples",
    "completion_text",
    "prompts_at_once",
    "record_generation_end",
    "verified_rollout",
]


_sample_index = operator.attrgetter("sample_index")


class IssuedPrompt(Protocol):
    """What a worker knows of an issued prompt it generates for."""

    issue: Issue
    problem: Problem
    prompt_tokens: list[int]
    issued_s: float


def completion_text(
    completion: Completion, tokenizer: Tokenizer, stop_tokens: Sequence[int]
) -> str:
    """The text the verifier reads: the completion without the stop token it ended at."""
    tokens = completion.tokens.tolist()
    if completion.finish_reason == "stop" and tokens and tokens[-1] in stop_tokens:
        tokens = tokens[:-1]
    return tokenizer.decode(tokens)


def verified_rollout(
    prompt: IssuedPrompt,
    prompt_tokens: np.ndarray,
    completion: Completion,
    result: RewardResult,
    *,
    worker_id: str,
    finished_s: float,
) -> Rollout:
    """The ``Rollout`` of one sample of ``prompt`` (its ids ``prompt_tokens``, one array
    shared by the prompt's samples: nothing writes to it), rewarded with ``result`` and
    finished at ``finished_s``."""
    info = {"parsed": result.parsed, "reason": result.reason, "correct": bool(result.correct)}
    if result.reason in REWARD_FAILURES:
        info["detail"] = result.detail  # why the reward itself failed, for the run's error
    # Positional, in the field order (one is built a sample).
    return Rollout(
        prompt.issue.group_id,
        completion.sample_index,
        prompt.problem.id,
        prompt_tokens,
        completion.tokens,
        completion.logprobs,
        completion.versions,
        float(result.score),
        completion.finish_reason,
        worker_id,
        info,
        {"issued_s": prompt.issued_s, "finished_s": finished_s},
    )


def record_generation_end(
    trace: TraceSink, actor: str, now_s: float, rollout: Rollout, **fields: object
) -> None:
    """Writes the rollout's ``generation_end`` event (``rlaxkit.rules.trace``)."""
    trace.record(
        now_s,
        "generation_end",
        actor,
        rollout.last_version,
        sample=rollout.sample_id,
        rollout=rollout.group_id,
        tokens=rollout.num_tokens,
        first_version=rollout.first_version,
        finish=rollout.finish_reason,
        **fields,
    )


def prompts_at_once(rows: int, n: int) -> int:
    """How many prompts of ``n`` samples a worker of ``rows`` engine rows holds: at least one."""
    return max(1, rows // n)


class VerifiedSamples:
    """The single-turn samples of one worker's issued prompts, until each prompt's ``n``
    are done and scored (``rlaxkit.worker.samples.WorkerSamples``).

    Args:
        worker_id: the trace's actor.
        task: writes each problem's prompt.
        tokenizer: encodes prompts, decodes completions for the verifier.
        sampling: the worker's sampling settings (``n``; the stop tokens
            ``completion_text`` drops).
        max_prompt_tokens: the engine's prompt width.
        num_slots: the engine's rows; the worker holds ``num_slots // n`` prompts.
        trace: where ``generation_end`` and ``reward`` events go.
        clock: seconds since the run's start.
    """

    max_context_len = None  # the engine's own

    def __init__(
        self,
        worker_id: str,
        task: Task,
        tokenizer: Tokenizer,
        sampling: SamplingConfig,
        *,
        max_prompt_tokens: int,
        num_slots: int,
        trace: TraceSink,
        clock: Callable[[], float],
    ):
        self.worker_id, self.task, self.tokenizer = worker_id, task, tokenizer
        self.sampling, self.n = sampling, sampling.n
        self.max_prompt_len, self.capacity = (
            max_prompt_tokens,
            prompts_at_once(num_slots, sampling.n),
        )
        self.trace, self.clock = trace, clock
        self.done: dict[int, list[Completion]] = {}  # group id -> finished samples

    def prompt(self, problem: Problem) -> list[int]:
        """The task's prompt of ``problem``, encoded."""
        return self.tokenizer.encode(self.task.format_prompt(problem))

    def free(self, engine: InferenceEngine, prompts_held: int) -> int:
        """``num_slots // n`` prompts at once."""
        return self.capacity - prompts_held

    def start(
        self, engine: InferenceEngine, issue: Issue, problem: Problem, prompt: list[int]
    ) -> None:
        """Submits the ``n`` samples of ``issue``."""
        engine.submit(prompt, rng=issue.seed, request_id=issue.group_id)
        self.done[issue.group_id] = []

    def take(self, completion: Completion, version: int | None) -> bool:
        """Books a finished sample; whether its prompt's ``n`` are all done."""
        done = self.done[completion.request_id]
        done.append(completion)
        return len(done) == self.n

    def advance(self, engine: InferenceEngine, log: ReplayLog) -> list[int]:
        """Nothing waits between turns: no prompt ends here."""
        return []

    def rollouts(self, prompts: Sequence[IssuedPrompt], scorer: RewardRunner) -> list[Rollout]:
        """``score``."""
        return self.score(prompts, scorer)

    def check_replay(
        self, replayed: Sequence[object], saved: Sequence[object], worker_id: str
    ) -> None:
        """A replay need not redo the log op for op (a drained engine starts a new one)."""

    def drop(self) -> None:
        """Forgets every prompt's finished samples."""
        self.done.clear()

    def close(self) -> None:
        """Nothing runs beside the worker."""

    def score(self, prompts: Sequence[IssuedPrompt], scorer: RewardRunner) -> list[Rollout]:
        """Scores the samples of ``prompts`` (all done) with ``scorer`` and forgets them;
        their rollouts, in order, each with its ``generation_end`` event, and one
        ``reward`` event timing the scoring."""
        samples = []  # (prompt, its ids, completion), each prompt's in sample order
        problems, texts = [], []
        for p in prompts:
            tokens = np.asarray(p.prompt_tokens, np.int32)
            done = self.done.pop(p.issue.group_id)
            done.sort(key=_sample_index)
            for c in done:
                samples.append((p, tokens, c))
                problems.append(p.problem)
                texts.append(completion_text(c, self.tokenizer, self.sampling.stop_tokens))
        start = self.clock()
        results = scorer.score(problems, texts)
        now = self.clock()
        rollouts = []
        for (p, tokens, completion), result in zip(samples, results, strict=True):
            rollout = verified_rollout(
                p, tokens, completion, result, worker_id=self.worker_id, finished_s=now
            )
            rollouts.append(rollout)
            if result.reason in REWARD_FAILURES:
                record_generation_end(
                    self.trace, self.worker_id, now, rollout, reward_failure=result.reason
                )
            else:
                record_generation_end(self.trace, self.worker_id, now, rollout)
        self.trace.record(
            now,
            "reward",
            "verifier",
            None,
            sample=f"{prompts[0].issue.group_id}",
            duration_s=now - start,
            samples=len(rollouts),
        )
        return rollouts
