"""Multi-turn episodes with tools, token in and token out.

The model generates until a tool-call stop sequence or its end token, the environment
answers (a calculator's result, a test's failure), the answer is appended **as token
ids** and the model goes on. The trained sequence is exactly the sampled ids followed by
the observation ids; nothing is decoded and re-encoded (re-tokenising a history changes
the tokens). Each token records who wrote it, its behaviour log-prob and weight version
(policy tokens only); ``Episode.to_rollout`` gives a ``Rollout`` whose environment
tokens carry no loss.

``run_episodes`` drives episodes on an ``InferenceEngine``. A turn after a tool call
either resumes the row that waited with its KV cache (``keep_cache``: only the
observation is prefilled) or is a new request whose prompt is everything so far (under
the same weights, the same tokens). Environment steps run in threads under a timeout;
one that raises or runs past its time becomes an error observation, counted. Each step
is timed (``StepRecord.duration_s``) and, given a trace sink, written as a ``tool_call``
event (``rlaxkit.rules.trace``), from which ``sim.calibrate`` fits the simulator's tool latency
and turns per episode.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np

from rlaxkit.data.rollout import ENVIRONMENT_VERSION, Rollout
from rlaxkit.rules.validation import check_int, check_number

# Tasks import the environment contract from here: the engine, tokenizer and tasks are
# types only, and JAX waits for ``run_episodes``, so ``import rlaxkit.tasks`` stays light.
if TYPE_CHECKING:
    from rlaxkit.inference import Completion, InferenceEngine, SamplingConfig
    from rlaxkit.inference.engine import WeightSource
    from rlaxkit.models.tokenizer import Tokenizer
    from rlaxkit.rules.trace import TraceSink
    from rlaxkit.tasks.base import Problem

__all__ = [
    "Action",
    "DelayedEnvironment",
    "Environment",
    "Episode",
    "EpisodeConfig",
    "EpisodicTask",
    "Observation",
    "PendingStep",
    "StepRecord",
    "StepResult",
    "advance_episode",
    "encode_observation",
    "collect_step",
    "episode_sampling",
    "record_tool_call",
    "run_episodes",
    "submit_step",
]

Observation = str | Sequence[int]  # text (encoded with the run's tokenizer) or token ids
StepOutcome = Literal["ok", "error", "timeout"]  # the step answered, raised, ran too long
# ``stop``: the environment ended it; ``max_turns``; ``length``: its token budget ran out.
EpisodeFinish = Literal["stop", "max_turns", "length"]


@dataclass(frozen=True)
class Action:
    """One policy turn: its ids, their text (special tokens dropped) and why it ended:
    ``"stop"`` (end token or tool stop, part of the turn) or ``"length"`` (budget)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str


@dataclass(frozen=True)
class StepResult:
    """An environment's answer to one action: the ``observation`` to append (unused when
    ``done``), a ``reward`` added to the episode's, and ``info`` kept with the step."""

    observation: Observation = ()
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    """One episode's environment; ``run_episodes`` builds one per episode.

    ``tool_stops`` end a tool call (``"</calc>"``; see ``episode_sampling``). ``step``
    runs in a thread under a timeout; one that timed out runs on while the episode goes
    on, so with state, tolerate a later ``step`` starting before it returns.
    """

    tool_stops: tuple[str, ...]

    def reset(self, problem: Problem) -> Observation:
        """Starts an episode on ``problem``; returns the prompt."""
        ...

    def step(self, action: Action) -> StepResult:
        """Answers one policy turn."""
        ...

    def error_observation(self, outcome: StepOutcome, detail: str) -> Observation:
        """What the policy sees when a step raised (``"error"``, ``detail`` the exception)
        or ran past its time (``"timeout"``), in the environment's own format."""
        ...


@runtime_checkable
class EpisodicTask(Protocol):
    """A task whose samples are multi-turn episodes: the runtime's worker builds one
    environment per episode with ``make_environment`` (a single-turn task has no such
    method)."""

    def make_environment(self) -> Environment:
        """A fresh environment for one episode."""
        ...


@dataclass(frozen=True, kw_only=True)
class EpisodeConfig:
    """How episodes are run.

    Attributes:
        samples_per_problem: episodes per problem (GRPO's group).
        max_turns: policy turns per episode, at least 1.
        max_episode_tokens: the most tokens after the prompt (policy and environment's);
            the prompt plus these must fit the engine's ``max_prompt_len``.
        step_timeout_s: seconds an environment step may take (``None``: no limit).
        tool_workers: threads that run environment steps (``None``: one per engine
            row, so that every row may wait on a tool at once). A step that waits on a
            slow tool holds its thread, and the steps behind it wait in the pool's
            queue: fewer threads than rows lets one slow tool hold up other rows'
            steps.
        keep_cache: a turn ending in a tool call keeps its engine row and KV cache until
            the tool answers (``InferenceEngine.resume`` prefills only the observation);
            otherwise each turn prefills its whole context.
        release_after_s: the runtime's worker in a free-running mode (``runtime.mode=
            concurrent``) releases the row of a tool call that has run this many
            seconds to other requests; when the tool answers, the turn goes on as a
            request of the whole context (``None``: the row waits for the answer or the
            timeout). The deterministic mode refuses it (wall-clock timing would decide
            which rows go on where); ``run_episodes`` does not use it.
    """

    samples_per_problem: int = 1
    max_turns: int = 4
    max_episode_tokens: int = 256
    step_timeout_s: float | None = 5.0
    tool_workers: int | None = None
    keep_cache: bool = False
    release_after_s: float | None = None

    def __post_init__(self) -> None:
        check_int("samples_per_problem", self.samples_per_problem, minimum=1)
        check_int("max_turns", self.max_turns, minimum=1)
        check_int("max_episode_tokens", self.max_episode_tokens, minimum=1)
        if self.tool_workers is not None:
            check_int("tool_workers", self.tool_workers, minimum=1)
        if self.step_timeout_s is not None and not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s: must be > 0 or None, got {self.step_timeout_s!r}")
        if self.release_after_s is not None:
            check_number(
                "release_after_s",
                self.release_after_s,
                minimum=0.0,
                allowed="a number >= 0 (seconds) or None",
            )


class DelayedEnvironment:
    """An ``Environment`` whose every step first sleeps ``latency_s()`` seconds: a slow
    tool (a sandbox, a web call) in front of a fast one, for tests and benchmarks.

    Args:
        environment: the environment that answers.
        latency_s: draws one step's delay in seconds (called in the step's thread).
    """

    def __init__(self, environment: Environment, latency_s: Callable[[], float]):
        self.environment, self.latency_s = environment, latency_s
        self.tool_stops = environment.tool_stops

    def reset(self, problem: Problem) -> Observation:
        return self.environment.reset(problem)

    def step(self, action: Action) -> StepResult:
        time.sleep(self.latency_s())
        return self.environment.step(action)

    def error_observation(self, outcome: StepOutcome, detail: str) -> Observation:
        return self.environment.error_observation(outcome, detail)


@dataclass(frozen=True)
class StepRecord:
    """One turn of an episode: the action and the environment's answer to it as ids
    (``outcome`` says whether the step failed; then ``info["error"]`` says how), and
    ``duration_s``, the seconds the step ran (for one that timed out: until it was given
    up)."""

    action: Action
    outcome: StepOutcome
    reward: float
    done: bool
    observation_ids: tuple[int, ...]
    info: Mapping[str, Any]
    duration_s: float = 0.0


@dataclass
class Episode:
    """The token record of one episode (sample ``sample_index`` of ``problem``), filled
    in turn by turn: after the encoded prompt, every token written (``tokens``), with
    per token ``policy_mask`` (True: the policy sampled it), ``behaviour_logprobs`` and
    ``versions`` (0 and ``ENVIRONMENT_VERSION`` for environment tokens); one
    ``StepRecord`` per policy turn; the steps' summed ``reward``; ``finish_reason``
    (``None`` while it runs)."""

    problem: Problem
    sample_index: int
    prompt_tokens: np.ndarray
    tokens: list[int] = field(default_factory=list)
    policy_mask: list[bool] = field(default_factory=list)
    behaviour_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    reward: float = 0.0
    finish_reason: EpisodeFinish | None = None

    @property
    def turns(self) -> int:
        """Policy turns taken."""
        return len(self.steps)

    def failures(self, outcome: StepOutcome) -> int:
        """Steps that raised (``"error"``) or ran past their time (``"timeout"``)."""
        return sum(s.outcome == outcome for s in self.steps)

    def add_policy_tokens(self, completion: Completion) -> None:
        """Appends a turn's sampled tokens with their log-probs and versions."""
        self.tokens.extend(int(t) for t in completion.tokens)
        self.policy_mask.extend([True] * completion.num_tokens)
        self.behaviour_logprobs.extend(float(x) for x in completion.logprobs)
        self.versions.extend(int(v) for v in completion.versions)

    def add_observation(self, token_ids: Sequence[int]) -> None:
        """Appends environment tokens: no log-prob, no version, no loss."""
        self.tokens.extend(int(t) for t in token_ids)
        self.policy_mask.extend([False] * len(token_ids))
        self.behaviour_logprobs.extend([0.0] * len(token_ids))
        self.versions.extend([ENVIRONMENT_VERSION] * len(token_ids))

    def to_rollout(
        self, group_id: int, *, worker_id: str = "", timings: dict[str, float] | None = None
    ) -> Rollout:
        """The episode as one ``Rollout`` (``reward_info`` counts turns and tool failures)."""
        if self.finish_reason is None:
            raise ValueError(f"episode {group_id}:{self.sample_index} has not finished")
        last = self.steps[-1].info if self.steps else {}
        return Rollout(
            group_id=group_id,
            sample_index=self.sample_index,
            problem_id=self.problem.id,
            prompt_tokens=np.asarray(self.prompt_tokens, np.int32),
            completion_tokens=np.asarray(self.tokens, np.int32),
            behaviour_logprobs=np.asarray(self.behaviour_logprobs, np.float32),
            versions=np.asarray(self.versions, np.int32),
            reward=float(self.reward),
            finish_reason=self.finish_reason,
            worker_id=worker_id,
            reward_info={
                "correct": bool(last.get("correct", False)),
                "turns": self.turns,
                "tool_errors": self.failures("error"),
                "tool_timeouts": self.failures("timeout"),
            },
            timings=dict(timings or {}),
            policy_mask=np.asarray(self.policy_mask, bool),
        )


def episode_sampling(
    sampling: SamplingConfig, tokenizer: Tokenizer, tool_stops: Sequence[str]
) -> SamplingConfig:
    """``sampling`` for an episode engine: one sample per request, stopping at the end
    token and after each tool stop (encoded on its own: a tokenizer that merges it with
    the text before it never emits these ids, so prefer stops that encode alone)."""
    stops = tuple(tuple(tokenizer.encode(text)) for text in tool_stops)
    return dataclasses.replace(
        sampling,
        n=1,
        stop_tokens=tuple(dict.fromkeys((*sampling.stop_tokens, tokenizer.eos_id))),
        stop_sequences=tuple(dict.fromkeys((*sampling.stop_sequences, *stops))),
    )


@dataclass
class PendingStep:
    """An environment step in flight for episode ``index`` (``submit_step``)."""

    index: int
    action: Action
    parked: bool  # the engine holds the episode's row for ``resume``
    future: concurrent.futures.Future[StepResult]
    deadline_s: float  # on ``time.monotonic``
    submitted_s: float  # on the run's clock
    ran: list[float] = field(default_factory=list)  # [start_s, end_s] once the step ran

    def due(self) -> bool:
        """Whether ``collect_step`` returns at once: the step ended or its time is up."""
        return self.future.done() or time.monotonic() >= self.deadline_s


def _timed(
    step: Callable[[Action], StepResult],
    action: Action,
    clock: Callable[[], float],
    ran: list[float],
) -> StepResult:
    """Runs ``step`` in a pool thread, noting when it started and ended on ``clock``."""
    ran.append(clock())
    try:
        return step(action)
    finally:
        ran.append(clock())


def submit_step(
    pool: concurrent.futures.Executor,
    environment: Environment,
    action: Action,
    *,
    index: int,
    parked: bool,
    clock: Callable[[], float],
    timeout_s: float | None,
) -> PendingStep:
    """Starts ``environment.step(action)`` in ``pool``, to run at most ``timeout_s``
    seconds (``None``: no limit); ``collect_step`` takes its answer."""
    ran: list[float] = []
    deadline_s = time.monotonic() + (timeout_s or float("inf"))
    submitted_s = clock()
    future = pool.submit(_timed, environment.step, action, clock, ran)
    return PendingStep(index, action, parked, future, deadline_s, submitted_s, ran)


def run_episodes(
    engine: InferenceEngine,
    make_environment: Callable[[], Environment],
    problems: Sequence[Problem],
    tokenizer: Tokenizer,
    config: EpisodeConfig,
    *,
    seed: int = 0,
    weight_source: WeightSource | None = None,
    trace: TraceSink | None = None,
    clock: Callable[[], float] | None = None,
    trace_actor: str = "environment",
) -> list[Episode]:
    """Runs ``config.samples_per_problem`` episodes of every problem to their ends.

    Turn ``k`` of episode ``(i, j)`` (problem ``i``, sample ``j``) samples with key
    ``fold_in(fold_in(fold_in(key(seed), i), j), k)``; the engine's tokens depend only on
    that key: one seed, one set of episodes. The steps of turns that finish in a chunk
    run while the engine decodes the next one, then are collected.

    Args:
        engine: an idle engine that samples with ``n == 1`` and stops at the end token
            and the tool stops (``episode_sampling``); its ``max_new_tokens`` caps a turn.
        make_environment: builds one episode's environment.
        tokenizer: encodes text observations and decodes actions.
        config: turns, budgets, timeouts.
        seed: the sampling seed.
        weight_source: polled before every decode chunk, as in ``InferenceEngine.run``.
        trace: where to write one ``tool_call`` event per environment step (sample
            ``"{problem position}/{sample}"``, the turn, the step's ``duration_s``, its
            outcome, ``observation_tokens`` and ``action_tokens``), at the step's end.
        clock: seconds since the run's start, for step durations and event times
            (default: ``time.monotonic`` from this call). Step timeouts always run on
            ``time.monotonic``.
        trace_actor: the ``actor`` of the trace events.

    Returns:
        The episodes, ordered by problem and sample.
    """
    import jax  # see the imports above

    if engine.config.n != 1 or tokenizer.eos_id not in engine.config.stop_tokens:
        raise ValueError(
            f"episodes need an engine with n=1 (got {engine.config.n}) that stops at the end "
            "token: build its sampling config with episode_sampling"
        )
    if not engine.idle:  # episode i's turns are request i
        raise ValueError("the engine must be idle: episodes use request ids from 0")
    if clock is None:
        began = time.monotonic()
        clock = lambda: time.monotonic() - began  # noqa: E731
    n = config.samples_per_problem
    environments = [make_environment() for _ in range(len(problems) * n)]
    episodes: list[Episode] = []
    for index, environment in enumerate(environments):
        problem = problems[index // n]
        prompt = encode_observation(environment.reset(problem), tokenizer)
        if not len(prompt) or len(prompt) + config.max_episode_tokens > engine.prompt_width:
            raise ValueError(
                f"problem {problem.id}: a prompt of {len(prompt)} tokens plus "
                f"max_episode_tokens ({config.max_episode_tokens}) must fit the engine's "
                f"prompt width ({engine.prompt_width}) and be non-empty"
            )
        episodes.append(Episode(problem, index % n, prompt))
    fold_in, base = jax.random.fold_in, jax.random.key(seed)
    keys = [fold_in(fold_in(base, i // n), i % n) for i in range(len(episodes))]

    def start_turn(index: int, parked: bool) -> None:
        """The one place a turn starts: in its parked row after the observation, or as a
        request of the whole context (under the same weights, the same tokens)."""
        episode = episodes[index]
        budget = min(engine.config.max_new_tokens, config.max_episode_tokens - len(episode.tokens))
        key = jax.random.fold_in(keys[index], episode.turns)
        observation = episode.steps[-1].observation_ids if episode.steps else ()
        if parked and observation:
            engine.resume(index, observation, key, max_new_tokens=budget)
            return
        if parked:  # nothing to prefill into the row: start over from the context
            engine.release(index)
        context = episode.prompt_tokens.tolist() + episode.tokens
        engine.submit(context, key, max_new_tokens=budget, request_id=index, hold=config.keep_cache)

    for index in range(len(episodes)):
        start_turn(index, parked=False)
    pool = concurrent.futures.ThreadPoolExecutor(
        config.tool_workers or engine.num_slots, "environment-step"
    )
    try:
        waiting: list[PendingStep] = []
        while waiting or not engine.idle:
            if weight_source is not None and (new := weight_source()) is not None:
                engine.update_weights(*new)
            finished = engine.step()
            for pending in waiting:
                index = pending.index
                record = collect_step(
                    pending, environments[index], tokenizer, episodes[index], clock()
                )
                if trace is not None:
                    _record_tool_call(trace, trace_actor, pending, record, episodes[index], n)
                if advance_episode(episodes[index], record, config):
                    start_turn(index, pending.parked)
                elif pending.parked:
                    engine.release(index)
            waiting = []
            for completion in sorted(finished, key=lambda c: c.request_id):
                episode = episodes[completion.request_id]
                episode.add_policy_tokens(completion)
                ids = completion.tokens.tolist()
                action = Action(tokenizer.decode(ids), tuple(ids), completion.finish_reason)
                pending = submit_step(
                    pool,
                    environments[completion.request_id],
                    action,
                    index=completion.request_id,
                    parked=completion.parked,
                    clock=clock,
                    timeout_s=config.step_timeout_s,
                )
                waiting.append(pending)
    except BaseException:
        engine.abort()  # leave no turn running or parked
        raise
    finally:  # a step that ran past its time may still run: do not wait for it
        pool.shutdown(wait=False, cancel_futures=True)
    return episodes


def collect_step(
    pending: PendingStep,
    environment: Environment,
    tokenizer: Tokenizer,
    episode: Episode,
    now_s: float,
) -> StepRecord:
    """Waits for a step (up to its deadline) and records its result on the episode; a
    step that raised or timed out becomes the environment's error observation. A step
    that ran lasted from its start to its end in its thread; one that timed out, from
    its submission to the moment it was given up (``now_s`` or later)."""
    outcome: StepOutcome = "ok"
    detail, result = "", StepResult()
    try:
        timeout_s = max(0.0, pending.deadline_s - time.monotonic())
        result = pending.future.result(timeout=None if timeout_s == float("inf") else timeout_s)
    except concurrent.futures.TimeoutError:
        outcome, detail = "timeout", "the step ran past its time"
    except Exception as error:  # an environment's failure is an observation, not a crash
        outcome, detail = "error", f"{type(error).__name__}: {error}"
    if outcome != "ok":
        pending.future.cancel()
        observation = environment.error_observation(outcome, detail)
        result = StepResult(observation=observation, info={"error": detail})
    ran = list(pending.ran)  # the thread may still append to it (a timed-out step)
    if outcome != "timeout" and len(ran) == 2:
        duration_s = ran[1] - ran[0]
    else:
        duration_s = max(0.0, now_s - pending.submitted_s)
    record = StepRecord(
        action=pending.action,
        outcome=outcome,
        reward=float(result.reward),
        done=bool(result.done),
        observation_ids=tuple(encode_observation(result.observation, tokenizer).tolist()),
        info=dict(result.info),
        duration_s=duration_s,
    )
    episode.steps.append(record)
    episode.reward += record.reward
    return record


def _record_tool_call(
    trace: TraceSink,
    actor: str,
    pending: PendingStep,
    record: StepRecord,
    episode: Episode,
    samples_per_problem: int,
) -> None:
    """The ``tool_call`` event of one resolved step, timed at the step's end."""
    policy = [v for v, mine in zip(episode.versions, episode.policy_mask, strict=True) if mine]
    ran = pending.ran
    ended = len(ran) >= 2 and record.outcome != "timeout"
    record_tool_call(
        trace,
        max(0.0, ran[1] if ended else pending.submitted_s + record.duration_s),
        actor,
        policy[-1] if policy else None,
        sample=f"{pending.index // samples_per_problem}/{pending.index % samples_per_problem}",
        turn=episode.turns - 1,
        record=record,
    )


def record_tool_call(
    trace: TraceSink,
    at_s: float,
    actor: str,
    version: int | None,
    *,
    sample: str,
    turn: int,
    record: StepRecord,
) -> None:
    """Writes the ``tool_call`` event of one resolved step (the trace schema's fields:
    the step's ``duration_s`` and outcome, its action's and observation's tokens)."""
    trace.record(
        at_s,
        "tool_call",
        actor,
        version,
        sample=sample,
        turn=turn,
        duration_s=record.duration_s,
        outcome=record.outcome,
        observation_tokens=len(record.observation_ids),
        action_tokens=len(record.action.token_ids),
    )


def advance_episode(episode: Episode, record: StepRecord, config: EpisodeConfig) -> bool:
    """Ends the episode or appends the observation; whether another turn follows."""
    room = config.max_episode_tokens - len(episode.tokens) - len(record.observation_ids)
    if record.done:
        episode.finish_reason = "stop"
    elif episode.turns >= config.max_turns:
        episode.finish_reason = "max_turns"
    elif room < 1:  # the observation and at least one more sampled token must fit
        episode.finish_reason = "length"
    else:
        episode.add_observation(record.observation_ids)
        return True
    return False


def encode_observation(observation: Observation, tokenizer: Tokenizer) -> np.ndarray:
    """An observation as int32 token ids (text is encoded with ``tokenizer``)."""
    if isinstance(observation, str):
        return np.asarray(tokenizer.encode(observation), np.int32)
    return np.asarray(observation, np.int32).reshape(-1)
