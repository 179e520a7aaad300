"""The multi-turn episodes of an inference worker, turn by turn.

``EpisodeTurns`` keeps the ``n`` episodes of every issued prompt of a multi-turn task
(``rlaxkit.tasks.episodes.EpisodicTask``) and their environments. The prompt's samples are
submitted with ``hold=True``; a turn that ends at a tool call parks its row. Every
finished turn submits its environment step to a thread pool (``take``) and its row
stays parked while the engine decodes the other rows; ``advance``, called before each
chunk, resolves the steps: the row resumes after the observation's ids, or the episode
ends (the environment ended it, or its turns or tokens ran out). A task whose
environment has no tool stops (code with test feedback: each attempt ends at the end
token) parks no row; its next turn is a request of the whole context.

Two ways to resolve, set by the worker's mode:

- deterministic (``free_running=False``): every step submitted in chunk ``c`` is
  resolved, waiting for it if need be, before chunk ``c + 1``, in (group, sample)
  order. The same seed gives the same episodes, and a replayed log resumes and releases
  the same rows (``rlaxkit.worker.replay_log``).
- free-running: only the steps that ended or ran past ``step_timeout_s`` are resolved;
  the others stay parked while the other rows decode, so one slow tool call holds up
  its episode only. With ``EpisodeConfig.release_after_s`` a row whose tool has run
  that long is released to other requests; when the tool answers, the turn goes on as
  a request of its whole context (``InferenceEngine.submit(..., sample_index=j)``: the
  tokens the parked row would have sampled under the same weights). When every row
  waits for a tool, ``advance`` waits a little for one to answer instead of spinning.
  Releases and resubmissions are not written to the replay log: the free-running mode
  takes no checkpoint it could resume from.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import numpy as np

from rlaxkit.data.rollout import Rollout
from rlaxkit.inference import InferenceEngine, SamplingConfig
from rlaxkit.inference.config import bucket_length
from rlaxkit.inference.results import Completion
from rlaxkit.models.tokenizer import Tokenizer
from rlaxkit.rules.controller import Issue
from rlaxkit.rules.trace import TraceSink
from rlaxkit.tasks import Problem
from rlaxkit.tasks.episodes import (
    Action,
    Environment,
    Episode,
    EpisodeConfig,
    EpisodicTask,
    PendingStep,
    advance_episode,
    collect_step,
    encode_observation,
    record_tool_call,
    submit_step,
)
from rlaxkit.worker.replay_log import ReplayLog
from rlaxkit.worker.single_turn import IssuedPrompt, prompts_at_once, record_generation_end

__all__ = ["EpisodeTurns"]

# Turn k >= 1 of a sample samples from fold_in(fold_in(key(seed), _TURN_DOMAIN), k) (and
# the sample index, as the engine folds it): a stream apart from the first turn's keys.
_TURN_DOMAIN = 0x7475726E  # "turn"

# The longest wait (seconds) for a tool to answer while every row waits for one: short,
# so that the worker still pulls weights and takes prompts.
_IDLE_WAIT_S = 0.05


@dataclass
class _Group:
    """The ``n`` episodes of one issued prompt and their environments."""

    seed: int
    episodes: list[Episode]
    environments: list[Environment]
    finished: int = 0  # episodes that ended


@dataclass
class _Waiting:
    """A turn whose environment step is in flight. ``step.parked``: the engine still
    holds the row (a released row's turn is resubmitted)."""

    group_id: int
    step: PendingStep  # ``step.index`` is the sample index
    turn_parked: bool  # the turn ended at a tool call: another turn may follow
    version: int | None  # of the turn's last token, for the tool_call event
    since_s: float  # time.monotonic() when the step was submitted


class EpisodeTurns:
    """The episodes of one worker's issued prompts (``rlaxkit.worker.samples.WorkerSamples``).

    Args:
        worker_id: the worker's name (the trace's actor, the step threads' prefix).
        task: builds one environment per episode.
        tokenizer: encodes observations, decodes actions.
        config: turns, token budget, step timeout, tool threads, ``release_after_s``.
        sampling: the worker's sampling settings; ``self.sampling`` adds the tool stops.
        max_prompt_tokens: the longest prompt the worker accepts.
        rows: the engine's rows (step threads by default: ``EpisodeConfig.tool_workers``).
        trace: where ``tool_call`` events go.
        clock: seconds since the run's start (event times).
        free_running: resolve only the steps that are done (see the module docstring).

    Attributes:
        sampling: the engine's sampling settings (stopping at the tool stops too).
        max_prompt_len, max_context_len: the engine's prompt width and row length:
            room for the prompt and the episode's tokens in one row, and with
            ``release_after_s`` for a resubmitted turn's whole context as a prompt.

    Raises:
        ValueError: ``release_after_s`` is set in deterministic mode.
    """

    def __init__(
        self,
        worker_id: str,
        task: EpisodicTask,
        tokenizer: Tokenizer,
        config: EpisodeConfig,
        *,
        sampling: SamplingConfig,
        max_prompt_tokens: int,
        rows: int,
        trace: TraceSink,
        clock: Callable[[], float],
        free_running: bool,
    ):
        if config.release_after_s is not None and not free_running:
            raise ValueError(
                f"episodes.release_after_s={config.release_after_s}: releasing a slow "
                "tool's row depends on wall-clock timing, which runtime.mode=deterministic "
                "cannot replay; use runtime.mode=concurrent or unset release_after_s"
            )
        tool_stops = task.make_environment().tool_stops
        sequences = tuple(tuple(tokenizer.encode(text)) for text in tool_stops)
        self.sampling = dataclasses.replace(
            sampling, stop_sequences=tuple(dict.fromkeys((*sampling.stop_sequences, *sequences)))
        )
        # Rows park at tool stops; a task without them (each turn ends at the end token)
        # and a released row go on as a request of the whole context.
        self.hold = bool(tool_stops)
        self.resubmits = config.release_after_s is not None or not self.hold
        self.max_new_tokens = sampling.max_new_tokens
        self.max_prompt_len = max_prompt_tokens
        episode_tokens = max(config.max_episode_tokens, self.max_new_tokens)
        if self.resubmits:  # a later turn may prefill its whole context
            self.max_prompt_len += config.max_episode_tokens
            episode_tokens = self.max_new_tokens
        self.max_context_len = bucket_length(self.max_prompt_len) + episode_tokens
        self.worker_id, self.task, self.tokenizer, self.config = worker_id, task, tokenizer, config
        self.trace, self.clock, self.free_running = trace, clock, free_running
        self.rows = rows
        self.groups: dict[int, _Group] = {}
        self.waiting: dict[tuple[int, int], _Waiting] = {}  # (group, sample) -> step
        self.released_rows = 0  # rows given up to other requests while a tool ran
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._running: set[concurrent.futures.Future] = set()  # steps not yet returned

    def prompt(self, problem: Problem) -> list[int]:
        """The environment's prompt of ``problem`` as token ids."""
        observation = self.task.make_environment().reset(problem)
        return encode_observation(observation, self.tokenizer).tolist()

    def free(self, engine: InferenceEngine, prompts_held: int) -> int:
        """``num_slots // n`` prompts at once, or with ``release_after_s`` as many as the
        engine's free rows hold (a row released from a slow tool takes a new prompt; the
        episode's next turn waits in the engine's queue for a row)."""
        n = self.sampling.n
        if self.config.release_after_s is None:
            return prompts_at_once(self.rows, n) - prompts_held
        busy = engine.num_running + engine.num_parked + engine.num_queued
        return max(0, (self.rows - busy) // n)

    def start(
        self, engine: InferenceEngine, issue: Issue, problem: Problem, prompt: list[int]
    ) -> None:
        """Starts the ``n`` episodes of ``issue``: one environment each, one held request."""
        array = np.asarray(prompt, np.int32)
        environments = [self.task.make_environment() for _ in range(self.sampling.n)]
        for environment in environments:
            environment.reset(problem)
        episodes = [Episode(problem, j, array) for j in range(len(environments))]
        self.groups[issue.group_id] = _Group(issue.seed, episodes, environments)
        budget = min(self.max_new_tokens, self.config.max_episode_tokens)
        engine.submit(
            prompt,
            rng=issue.seed,
            request_id=issue.group_id,
            max_new_tokens=budget,
            hold=self.hold,
        )

    def take(self, completion: Completion, version: int | None) -> bool:
        """Records a finished turn on its episode and starts its environment step; the
        row stays parked until ``advance`` resolves the step. No prompt ends here: an
        episode ends, or not, when its step resolves (False)."""
        group_id, j = completion.request_id, completion.sample_index
        group = self.groups[group_id]
        group.episodes[j].add_policy_tokens(completion)
        ids = completion.tokens.tolist()
        action = Action(self.tokenizer.decode(ids), tuple(ids), completion.finish_reason)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.config.tool_workers or self.rows, f"{self.worker_id}-step"
            )
        step = submit_step(
            self._pool,
            group.environments[j],
            action,
            index=j,
            parked=completion.parked,
            clock=time.monotonic,  # durations only; events are timed on the run's clock
            timeout_s=self.config.step_timeout_s,
        )
        self._running.add(step.future)
        step.future.add_done_callback(self._running.discard)
        last = int(completion.versions[-1]) if completion.num_tokens else version
        self.waiting[group_id, j] = _Waiting(
            group_id, step, completion.parked, last, time.monotonic()
        )
        return False

    # -- resolving steps ----------------------------------------------------------------
    def advance(self, engine: InferenceEngine, log: ReplayLog) -> list[int]:
        """Resolves the steps due (all of them in deterministic mode), in (group, sample)
        order: resumes, resubmits or ends their episodes. Returns the groups whose ``n``
        episodes all ended, in order."""
        if not self.waiting:
            return []
        if self.free_running:
            if engine.idle:  # every row waits for a tool: wait for one, without spinning
                self._wait_for_any()
            keys = [k for k in sorted(self.waiting) if self.waiting[k].step.due()]
        else:
            keys = sorted(self.waiting)
        ended = [g for key in keys if (g := self._resolve(engine, log, key)) is not None]
        if self.config.release_after_s is not None:
            self._release_slow(engine, log)
        return ended

    def _wait_for_any(self) -> None:
        now = time.monotonic()
        wake = [w.step.deadline_s for w in self.waiting.values()]
        if self.config.release_after_s is not None:
            wake += [
                w.since_s + self.config.release_after_s
                for w in self.waiting.values()
                if w.step.parked
            ]
        timeout_s = min(_IDLE_WAIT_S, max(0.0, min(wake) - now))
        futures = [w.step.future for w in self.waiting.values()]
        concurrent.futures.wait(futures, timeout_s, concurrent.futures.FIRST_COMPLETED)

    def _release_slow(self, engine: InferenceEngine, log: ReplayLog) -> None:
        """Frees the rows of tools that have run ``release_after_s`` seconds, each
        recorded in ``log`` as the row of an ended episode is (a timing, not an
        environment's answer, decided it, so no replay could redo it unrecorded)."""
        assert self.config.release_after_s is not None
        now = time.monotonic()
        for (group_id, j), waiting in sorted(self.waiting.items()):
            if waiting.step.parked and now - waiting.since_s >= self.config.release_after_s:
                engine.release(group_id, j)
                log.released(group_id, j)
                waiting.step.parked = False
                self.released_rows += 1

    def _resolve(self, engine: InferenceEngine, log: ReplayLog, key: tuple[int, int]) -> int | None:
        """Resolves one step; returns its group's id when that ended the group's last
        episode. A turn that did not park (the end token, the turn's budget, or a row
        without room for an observation) goes on as a request of its whole context when
        the engine has room for one (``self.resubmits``); otherwise an episode the
        environment would continue ends there as ``"length"``."""
        waiting = self.waiting.pop(key)
        group_id, j = key
        group = self.groups[group_id]
        episode, step = group.episodes[j], waiting.step
        record = collect_step(
            step, group.environments[j], self.tokenizer, episode, time.monotonic()
        )
        record_tool_call(  # for sim.calibrate's turn fit
            self.trace,
            self.clock(),
            self.worker_id,
            waiting.version,
            sample=f"{group_id}:{j}",
            turn=episode.turns - 1,
            record=record,
        )
        if not waiting.turn_parked and not record.done and not self.resubmits:
            episode.finish_reason = "length"
        elif advance_episode(episode, record, self.config):
            budget = min(self.max_new_tokens, self.config.max_episode_tokens - len(episode.tokens))
            turn_key = jax.random.fold_in(
                jax.random.fold_in(jax.random.key(group.seed), _TURN_DOMAIN), episode.turns
            )
            if step.parked:
                engine.resume(
                    group_id,
                    record.observation_ids,
                    turn_key,
                    sample_index=j,
                    max_new_tokens=budget,
                )
                log.resumed(group_id, j, record.observation_ids)
            else:  # no row holds it: the whole context is prefilled again
                context = episode.prompt_tokens.tolist() + episode.tokens
                engine.submit(
                    context,
                    turn_key,
                    request_id=group_id,
                    sample_index=j,
                    max_new_tokens=budget,
                    hold=self.hold,
                )
            return None
        elif step.parked:
            engine.release(group_id, j)
            log.released(group_id, j)
        group.finished += 1
        return group_id if group.finished == len(group.episodes) else None

    # -- ending -------------------------------------------------------------------------
    def rollouts(self, prompts: Sequence[IssuedPrompt], scorer: object = None) -> list[Rollout]:
        """Forgets the ended groups of ``prompts``; their episodes as rollouts rewarded
        by their environments (not ``scorer``), in order, each with its
        ``generation_end`` event (with the policy tokens of every turn, ``turn_tokens``)."""
        now = self.clock()
        return [
            rollout
            for prompt in prompts
            for rollout in self._finish(prompt, {"issued_s": prompt.issued_s, "finished_s": now})
        ]

    def _finish(self, prompt: IssuedPrompt, timings: dict[str, float]) -> list[Rollout]:
        group_id = prompt.issue.group_id
        group = self.groups.pop(group_id)
        out = []
        for episode in group.episodes:
            rollout = episode.to_rollout(group_id, worker_id=self.worker_id, timings=timings)
            final = episode.steps[-1].info if episode.steps else {}
            rollout.reward_info.update(
                {
                    "parsed": final.get("parsed"),
                    "reason": final.get("reason"),
                    # Turns the environment answered with an observation: tool calls.
                    "tool_calls": sum(not step.done for step in episode.steps),
                }
            )
            turns = [len(step.action.token_ids) for step in episode.steps]
            record_generation_end(
                self.trace, self.worker_id, timings["finished_s"], rollout, turn_tokens=turns
            )
            out.append(rollout)
        return out

    def check_replay(
        self, replayed: Sequence[object], saved: Sequence[object], worker_id: str
    ) -> None:
        """A restore's replay must redo the saved log op for op: a mid-episode restore
        needs environments that answer the same action the same way."""
        if list(replayed) != list(saved):
            raise ValueError(
                f"{worker_id}: replaying the checkpoint's log did not redo its multi-turn "
                "ops: an environment answered a step differently, or a tool step timed out "
                "in one run only (a mid-episode restore needs environments that answer the "
                "same action the same way)"
            )

    def drop(self) -> None:
        """Forgets every episode (the engine was lost); steps still running are left to
        end in their threads, their answers unread."""
        for waiting in self.waiting.values():
            waiting.step.future.cancel()
        self.groups.clear()
        self.waiting.clear()

    def close(self) -> None:
        """Stops the step threads: joins them, unless a step still runs (one that timed
        out may never return), so that no thread outlives the worker for long."""
        if self._pool is not None:
            for future in list(self._running):  # those not started yet end here
                future.cancel()
            self._pool.shutdown(wait=not self._running, cancel_futures=True)
            self._pool = None
