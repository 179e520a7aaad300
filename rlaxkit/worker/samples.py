"""What an inference worker asks of its samples, whatever the task: ``WorkerSamples``.

A single-turn task's samples are ``rlaxkit.worker.single_turn.VerifiedSamples`` (each
prompt's ``n`` completions, scored by the task's verifier once all are done); a
multi-turn task's are ``rlaxkit.worker.multi_turn.EpisodeTurns`` (``n`` episodes a
prompt, each turn's environment step resolved between chunks, rewarded by the
environment). ``worker_samples`` picks one by the task; the worker
(``rlaxkit.worker.worker.InferenceWorker``) calls the protocol only, in this order: a
prompt is ``start``\\ ed; each finished row the engine returns is ``take``\\ n; before
each chunk ``advance`` resolves what waits between turns and says which prompts ended
there; the prompts done are turned into ``rollouts``; a lost engine ``drop``\\ s them all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from rlaxkit.data.rollout import Rollout
from rlaxkit.inference import InferenceEngine, SamplingConfig
from rlaxkit.inference.results import Completion
from rlaxkit.models.tokenizer import Tokenizer
from rlaxkit.rules.controller import Issue
from rlaxkit.rules.trace import TraceSink
from rlaxkit.tasks import Problem, RewardRunner, Task
from rlaxkit.tasks.episodes import EpisodeConfig, EpisodicTask
from rlaxkit.worker.multi_turn import EpisodeTurns
from rlaxkit.worker.replay_log import ReplayLog
from rlaxkit.worker.single_turn import IssuedPrompt, VerifiedSamples


class WorkerSamples(Protocol):
    """The samples of one worker's issued prompts, from start to rollouts.

    Attributes:
        sampling: the engine's sampling settings (the samples may add stops).
        max_prompt_len, max_context_len: the engine's prompt width and row length
            (``None``: the engine's default).
    """

    @property
    def sampling(self) -> SamplingConfig: ...

    @property
    def max_prompt_len(self) -> int: ...

    @property
    def max_context_len(self) -> int | None: ...

    def prompt(self, problem: Problem) -> list[int]:
        """The prompt of ``problem`` as token ids."""
        ...

    def free(self, engine: InferenceEngine, prompts_held: int) -> int:
        """How many more prompts the worker takes now, holding ``prompts_held``."""
        ...

    def start(
        self, engine: InferenceEngine, issue: Issue, problem: Problem, prompt: list[int]
    ) -> None:
        """Submits the ``n`` samples of ``issue`` to ``engine``."""
        ...

    def take(self, completion: Completion, version: int | None) -> bool:
        """Books a row the engine finished; whether that completed its prompt."""
        ...

    def advance(self, engine: InferenceEngine, log: ReplayLog) -> list[int]:
        """Resolves what waits between turns; the group ids of prompts that ended so."""
        ...

    def rollouts(self, prompts: Sequence[IssuedPrompt], scorer: RewardRunner) -> list[Rollout]:
        """The rewarded rollouts of ``prompts`` (all done), in order, a single-turn
        task's scored by ``scorer`` (the worker's, which concurrent mode shares under a
        lock); forgets them."""
        ...

    def check_replay(
        self, replayed: Sequence[object], saved: Sequence[object], worker_id: str
    ) -> None:
        """Raises ``ValueError`` when a restore's replay must have redone the saved log
        op for op and did not."""
        ...

    def drop(self) -> None:
        """Forgets every prompt (the engine was lost)."""
        ...

    def close(self) -> None:
        """Stops what runs beside the worker (tool-step threads)."""
        ...


def worker_samples(
    worker_id: str,
    task: Task,
    tokenizer: Tokenizer,
    sampling: SamplingConfig,
    *,
    episodes: EpisodeConfig | None,
    max_prompt_tokens: int,
    num_slots: int,
    trace: TraceSink,
    clock: Callable[[], float],
    free_running: bool,
) -> WorkerSamples:
    """A worker's samples: episodes for an ``EpisodicTask``, verified samples otherwise."""
    if isinstance(task, EpisodicTask):
        return EpisodeTurns(
            worker_id,
            task,
            tokenizer,
            episodes or EpisodeConfig(),
            sampling=sampling,
            max_prompt_tokens=max_prompt_tokens,
            rows=num_slots,
            trace=trace,
            clock=clock,
            free_running=free_running,
        )
    return VerifiedSamples(
        worker_id,
        task,
        tokenizer,
        sampling,
        max_prompt_tokens=max_prompt_tokens,
        num_slots=num_slots,
        trace=trace,
        clock=clock,
    )
