"""A user's agent as the producer of a run's samples, through the endpoint.

``AgentCollector`` takes the place of the workers' collector in an ``Experiment``
(``Loop.collect_batch`` asks it for batches): it serves the trainer's published weights
on a ``ChatEndpoint`` (taking each new version between decode chunks), issues prompts
from the run's controller while the staleness policy admits more (AReaL's capacity
rule, as the workers' rounds do), and runs ``AgentConfig.copies`` threads that each play
one sample at a time: open a session for ``(group, sample)``, call the user's function
with an ``openai.OpenAI`` client whose session header is set, score what it returns
with the task's reward, and report it. The reported session is a ``Rollout`` booked in
the run's buffer at the trainer's version: staleness, filtering and batches as for any
other sample. A sample whose agent raises or whose session times out is dropped, and
its group with it, with the reason counted (``agent_error``, ``timeout``).

The agent file needs nothing of rlaxkit::

    def run(client, model, prompt):
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}])
        return reply.choices[0].message.content
"""

from __future__ import annotations

import collections
import importlib.util
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rlaxkit.data.rollout import Rollout, RolloutGroup
from rlaxkit.inference.results import ModelLike
from rlaxkit.serve.config import AgentConfig, EndpointConfig
from rlaxkit.serve.server import SESSION_HEADER, ChatEndpoint
from rlaxkit.serve.sessions import Session

if TYPE_CHECKING:
    import openai

    from rlaxkit.models.tokenizer import Tokenizer
    from rlaxkit.rules.controller import PromptController
    from rlaxkit.runtime.parts import RoundTarget
    from rlaxkit.tasks import Problem, Task

    class AgentTarget(RoundTarget, Protocol):
        """What an agent collector touches of the run (``rlaxkit.runtime.Experiment`` is
        one): a collector's part (``RoundTarget``), the run folder, the problems and the
        controller that issues them, the task and the tokenizer."""

        run_dir: Path | None
        problems: list[Problem]
        controller: PromptController

        @property
        def task(self) -> Task: ...

        @property
        def tokenizer(self) -> Tokenizer: ...


__all__ = ["AgentCollector", "attach_agent", "endpoint_for_run", "load_agent"]

Agent = Callable[[Any, str, str], Any]


def load_agent(config: AgentConfig) -> Agent:
    """The agent function ``config.function`` of ``config.file``."""
    path = Path(config.file)
    if not path.is_file():
        raise FileNotFoundError(f"agent.file: no file {path} (from {Path.cwd()})")
    spec = importlib.util.spec_from_file_location(f"rlaxkit_agent_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    function = getattr(module, config.function, None)
    if not callable(function):
        raise ValueError(f"agent.function: {path} has no function {config.function!r}")
    return function


def endpoint_for_run(exp: AgentTarget, config: AgentConfig, **callbacks: Any) -> ChatEndpoint:
    """A ``ChatEndpoint`` over the run's newest published weights, sampling as the run
    does (temperature, a turn's ``max_new_tokens``, the episodes' whole context), that
    takes each new published version between decode chunks."""
    store = exp.parts.store
    version, params = store.pull()
    seen = [version]

    def weights() -> tuple[Any, int] | None:
        latest = store.latest_version()
        if latest is None or latest <= seen[0]:
            return None
        pulled, new = store.pull()
        seen[0] = pulled
        return new, pulled

    run = exp.config
    model: ModelLike = (exp.parts.graphdef, params)
    endpoint = EndpointConfig(
        host=config.host,
        port=config.port,
        model_name=config.model_name,
        temperature=run.sampling.temperature,
        max_new_tokens=run.sampling.max_new_tokens,
        max_prompt_tokens=run.runtime.max_prompt_tokens + run.episodes.max_episode_tokens,
        slots=config.slots,
        max_queued=max(4 * config.slots, config.copies),
        session_timeout_s=config.session_timeout_s,
        chunk_steps=run.runtime.chunk_steps,
        seed=run.seed,
        chat_template=config.chat_template,
        stop=config.stop,
    )
    return ChatEndpoint(
        model, exp.tokenizer, endpoint, weight_source=weights, version=version, **callbacks
    )


def attach_agent(exp: AgentTarget, config: AgentConfig | None = None) -> AgentCollector:
    """Has ``config`` (default ``exp.config.agent``) produce ``exp``'s samples from now
    on: the workers' collector, never started, is closed and replaced."""
    config = config or exp.config.agent
    if config is None:
        raise ValueError("agent: the run config has no agent section (agent.file=...)")
    if exp.parts.collector is not None:
        exp.parts.collector.close()
    collector = AgentCollector(exp, config)
    exp.parts.collector = collector
    return collector


class AgentCollector:
    """Collects batches from agent conversations (see the module docstring).

    Args:
        exp: the run (its buffer, controller, task, trainer's store, lock).
        config: the agent, its copies and the endpoint's settings.
    """

    def __init__(self, exp: AgentTarget, config: AgentConfig):
        self.exp, self.config = exp, config
        self.agent = load_agent(config)
        self.cond = threading.Condition(exp.lock)
        self.endpoint = endpoint_for_run(
            exp, config, on_rollout=self._booked, on_drop=self._dropped
        ).start()
        self.jobs: collections.deque[tuple[int, Problem, int]] = collections.deque()
        self.counts: collections.Counter[str] = collections.Counter()
        self.error: BaseException | None = None
        self._stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._play, name=f"agent-{k}", daemon=True)
            for k in range(config.copies)
        ]
        for thread in self.threads:
            thread.start()

    # -- the trainer's side ------------------------------------------------------------
    def collect(self, exp: RoundTarget) -> list[RolloutGroup]:
        """Issues prompts while admission allows and waits for a batch."""
        with self.cond:
            dropped_before = len(exp.buffer.dropped)
            while True:
                if self.error is not None:
                    raise RuntimeError(f"an agent thread failed: {self.error!r}") from self.error
                if self._stopping.is_set():
                    raise RuntimeError("the experiment was closed; build a new Experiment")
                batch = exp.buffer.take_batch(exp.version)
                if batch is not None:
                    return batch
                exp.check_drops(dropped_before)
                self._issue()
                self.cond.wait(timeout=1.0)

    def wake(self) -> None:
        """A push or a drop: more admission room."""
        with self.cond:
            self._issue()
            self.cond.notify_all()

    def close(self, timeout_s: float = 60.0) -> None:
        """Stops the agent threads and the endpoint (idempotent)."""
        with self.cond:
            if self._stopping.is_set():
                return
            self._stopping.set()
            self.jobs.clear()
            self.cond.notify_all()
        self.endpoint.stop()
        for thread in self.threads:
            thread.join(timeout_s)
        if self.exp.run_dir is not None:
            (self.exp.run_dir / "agent.json").write_text(json.dumps(self.stats(), indent=2))

    def stats(self) -> dict[str, object]:
        """The endpoint's counts, the agents' (``agent_error``, ``played``) and the
        requests answered with their mean wall time (written to ``agent.json`` in the
        run directory on ``close``)."""
        times = list(self.endpoint.request_s)
        return {
            **self.endpoint.stats(),
            **self.counts,
            "requests": len(times),
            "request_mean_s": sum(times) / max(len(times), 1),
        }

    def _issue(self) -> None:
        """Issues groups while the staleness policy has room (lock held)."""
        exp = self.exp
        published = exp.parts.store.latest_version() or 0
        room = exp.config.staleness.capacity(exp.buffer.accepted, exp.buffer.in_flight, published)
        for issue in exp.controller.next_issues(room) if room > 0 else []:
            problem = exp.problems[issue.problem_index]
            if not exp.buffer.is_in_flight(issue.group_id):
                exp.buffer.issue(issue.group_id, problem.id)
            self.jobs.extend((issue.group_id, problem, j) for j in range(exp.config.group_size))
        if self.jobs:
            self.cond.notify_all()

    # -- the agents' side ----------------------------------------------------------------
    def _play(self) -> None:
        try:
            self._play_jobs()
        except BaseException as error:  # collect() raises it in the trainer's thread
            self.error = error
            with self.cond:
                self.cond.notify_all()

    def _play_jobs(self) -> None:
        import openai  # the agents' client (the ``dev`` extra has it)

        # One client per thread; each session's is a copy carrying its header, which
        # shares the connection pool (a new ``openai.OpenAI`` builds an HTTP client and
        # an SSL context: 20-40 ms of CPU, more than the turn it serves on 2 cores).
        with openai.OpenAI(base_url=self.endpoint.url, api_key="rlaxkit", max_retries=0) as base:
            self._play_with(base)

    def _play_with(self, base: openai.OpenAI) -> None:
        while True:
            with self.cond:
                while not self.jobs and not self._stopping.is_set():
                    self.cond.wait()
                if self._stopping.is_set():
                    return
                group_id, problem, j = self.jobs.popleft()
                if not self.exp.buffer.is_in_flight(group_id):
                    continue  # a sample of the group failed: it was dropped
            sid = self.endpoint.open_session(
                group_id=group_id, sample_index=j, problem_id=problem.id
            )
            client = base.with_options(default_headers={SESSION_HEADER: sid})
            try:
                prompt = self.exp.task.format_prompt(problem)
                result = self.agent(client, self.config.model_name, prompt)
                if isinstance(result, int | float) and not isinstance(result, bool):
                    reward, info = float(result), {}
                else:
                    scored = self.exp.task.score(problem, str(result))
                    reward, info = (
                        scored.score,
                        {"correct": scored.correct, "reason": scored.reason},
                    )
                self.endpoint.report(sid, reward, info)
                with self.cond:
                    self.counts["played"] += 1
            except Exception as error:  # the agent's failure drops its sample's group
                if self._stopping.is_set():
                    return
                with self.cond:
                    self.counts["agent_error"] += 1
                self.endpoint.sessions.drop(sid, "agent_error")
                if self.counts["agent_error"] >= 50 and not self.counts["played"]:
                    self.error = error

    def _booked(self, rollout: Rollout) -> None:
        """A reported session: into the buffer at the trainer's version."""
        with self.cond:
            if self.exp.buffer.is_in_flight(rollout.group_id):
                self.exp.admit([_with_reason(rollout)])
            self.cond.notify_all()

    def _dropped(self, session: Session, reason: str) -> None:
        """A session without a reward: its group cannot fill, so it is dropped."""
        with self.cond:
            if self.exp.buffer.is_in_flight(session.group_id):
                self.exp.buffer.abandon(session.group_id, reason)
            self.cond.notify_all()


def _with_reason(rollout: Rollout) -> Rollout:
    """``Loop.admit`` reads ``reward_info["reason"]``; an agent's own reward has none."""
    rollout.reward_info.setdefault("reason", None)
    return rollout
