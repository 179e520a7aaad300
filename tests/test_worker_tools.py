"""Tool steps that do not block the worker: in a free-running worker a slow tool holds up
its own episode only, a row whose tool runs past ``release_after_s`` goes to other work
and its turn comes back as a request of the whole context (the engine samples what the
parked row would have), and a concurrent local run of calculator episodes keeps its
books with trained ids that are the sampled ids plus the environment's answers."""

import dataclasses
import threading
import time

import pytest
from flax import nnx
from test_engine import assert_same, peaked_model
from test_engine_multiturn import GREEDY, OBSERVATION, engine_for, tool_call
from test_worker_multiturn import CONFIG, PROBLEMS, TASK, Clock, issue

from rlaxkit.config.run import RunConfig
from rlaxkit.param_server import InProcessParameterServer
from rlaxkit.rules.policies import StalenessPolicy, WeightSyncPolicy
from rlaxkit.rules.trace import MemoryTrace
from rlaxkit.runtime import Experiment
from rlaxkit.runtime.build import build_policy, warm_start
from rlaxkit.tasks import RewardRunner
from rlaxkit.tasks.episodes import Action, DelayedEnvironment, EpisodeConfig, encode_observation
from rlaxkit.worker.multi_turn import EpisodeTurns
from rlaxkit.worker.worker import InferenceWorker


@pytest.fixture(scope="module")
def policy(cache):
    model, tokenizer = build_policy(CONFIG, TASK)
    model, _ = warm_start(CONFIG, TASK, model, tokenizer, cache)
    graphdef, params = nnx.split(model)
    return graphdef, params, tokenizer


class GatedEnvironment(DelayedEnvironment):
    """A calculator episode whose steps on ``PROBLEMS[0]`` wait for ``gate`` (at most
    20 s) and whose other steps sleep ``delay_s``."""

    def __init__(self, gate: threading.Event, delay_s: float):
        super().__init__(TASK.make_environment(), self.latency_s)
        self.gate, self.delay_s, self.problem_id = gate, delay_s, None

    def reset(self, problem):
        self.problem_id = problem.id
        return super().reset(problem)

    def latency_s(self) -> float:
        if self.problem_id == PROBLEMS[0].id:
            self.gate.wait(20.0)
        return self.delay_s


class GatedTask:
    """The calculator task with ``GatedEnvironment``s."""

    def __init__(self, delay_s: float = 0.0):
        self.gate, self.delay_s = threading.Event(), delay_s

    def __getattr__(self, name):
        return getattr(TASK, name)

    def make_environment(self):
        return GatedEnvironment(self.gate, self.delay_s)


def free_running_worker(policy, task, episodes: EpisodeConfig, free_running=True):
    graphdef, params, tokenizer = policy
    server = InProcessParameterServer()
    server.push(0, params)
    worker = InferenceWorker(
        "worker-0",
        graphdef,
        CONFIG.sampling,
        task=task,
        tokenizer=tokenizer,
        scorer=RewardRunner.for_task(TASK, "inline"),
        param_server=server,
        staleness=StalenessPolicy(batch_size=2),
        weight_sync=WeightSyncPolicy(pull_mode="in_flight"),
        trace=MemoryTrace(),
        clock=Clock(),
        num_slots=8,
        chunk_steps=4,
        max_prompt_tokens=8,
        episodes=episodes,
        free_running=free_running,
    )
    assert worker.sync_weights()
    return worker


def test_a_slow_tool_holds_up_its_own_episodes_only(policy):
    task = GatedTask()
    # A thread per row by default: steps that wait do not hold up the others' in the
    # pool's queue.
    assert CONFIG.episodes.tool_workers is None
    episodes = dataclasses.replace(CONFIG.episodes, step_timeout_s=30.0)
    worker = free_running_worker(policy, task, episodes)
    worker.submit(issue(0), PROBLEMS[0])  # its first steps wait for the gate
    worker.submit(issue(1), PROBLEMS[1])
    rollouts = []
    try:
        began = time.monotonic()
        while not rollouts:
            assert time.monotonic() - began < 15.0, "group 1 never finished"
            rollouts += worker.step()
        # Group 1 ended while group 0's four episodes wait for their first steps.
        assert {r.group_id for r in rollouts} == {1} and list(worker.requests) == [0]
        assert isinstance(worker.samples, EpisodeTurns) and sorted(worker.samples.waiting) == [
            (0, j) for j in range(4)
        ]
    finally:
        task.gate.set()
    while worker.requests:
        rollouts += worker.step()
    assert [r.sample_id for r in rollouts] == [f"{g}:{j}" for g in (1, 0) for j in range(4)]
    assert all(r.reward_info["tool_timeouts"] == 0 for r in rollouts)
    worker.close()


def test_release_after_s_is_refused_in_deterministic_mode(policy):
    episodes = dataclasses.replace(CONFIG.episodes, release_after_s=1.0)
    with pytest.raises(ValueError, match="release_after_s=1.0.*runtime.mode=concurrent"):
        free_running_worker(policy, TASK, episodes, free_running=False)
    with pytest.raises(ValueError, match="release_after_s: must be a number >= 0"):
        EpisodeConfig(release_after_s=-1.0)


def test_a_released_row_goes_on_as_a_request_of_its_whole_context(policy):
    # Every step sleeps 50 ms and rows are released at once: most turns after the
    # first are prefilled again from their whole context.
    episodes = dataclasses.replace(CONFIG.episodes, release_after_s=0.0)
    task = GatedTask(delay_s=0.05)
    task.gate.set()
    worker = free_running_worker(policy, task, episodes)
    engine, tokenizer = worker.engine, policy[2]
    assert engine is not None
    pieces: dict[tuple[int, int], list[tuple[str, list[int]]]] = {}
    prompts = {}
    finish, submit, resume = engine.finish, engine.submit, engine.resume

    def noted_finish():
        completions = finish()
        for c in completions:
            pieces.setdefault((c.request_id, c.sample_index), []).append(
                ("policy", c.tokens.tolist())
            )
        return completions

    def noted_submit(prompt, rng, *, sample_index=None, request_id=None, **kwargs):
        if sample_index is None:
            prompts[request_id] = list(prompt)
        else:  # the context: the prompt, every turn so far, then the new observation
            so_far = prompts[request_id] + [
                t for _, ids in pieces[request_id, sample_index] for t in ids
            ]
            assert list(prompt[: len(so_far)]) == so_far
            observation = list(prompt[len(so_far) :])
            pieces[request_id, sample_index].append(("environment", observation))
        return submit(prompt, rng, sample_index=sample_index, request_id=request_id, **kwargs)

    def noted_resume(request_id, observation, rng, *, sample_index=0, **kwargs):
        pieces[request_id, sample_index].append(("environment", list(observation)))
        return resume(request_id, observation, rng, sample_index=sample_index, **kwargs)

    engine.finish, engine.submit, engine.resume = noted_finish, noted_submit, noted_resume
    worker.submit(issue(1), PROBLEMS[1])
    worker.submit(issue(2), PROBLEMS[2])
    rollouts = []
    for _ in range(400):
        if not worker.requests:
            break
        rollouts += worker.step()
    assert not worker.requests
    assert isinstance(worker.samples, EpisodeTurns) and worker.samples.released_rows >= 4
    called = 0
    for rollout in rollouts:
        turns = pieces[rollout.group_id, rollout.sample_index]
        assert rollout.completion_tokens.tolist() == [t for _, ids in turns for t in ids]
        assert rollout.policy_mask.tolist() == [who == "policy" for who, ids in turns for _ in ids]
        called += any(who == "environment" for who, _ in turns)
        # Each observation is the calculator's answer to the turn before it.
        environment = TASK.make_environment()
        environment.reset(PROBLEMS[rollout.group_id])
        for (who, ids), (_, observation) in zip(turns, turns[1:], strict=False):
            if who == "policy":
                answer = environment.step(Action(tokenizer.decode(ids), tuple(ids), "stop"))
                assert encode_observation(answer.observation, tokenizer).tolist() == observation
    assert called >= 4  # most episodes call the calculator, so most were resubmitted
    worker.close()


def test_a_row_released_past_release_after_s_reaches_the_replay_log(policy):
    # Every row is released as soon as its tool runs: each engine.release is a Release
    # op of the worker's replay log, in order, across the log's resets on a drain.
    episodes = dataclasses.replace(CONFIG.episodes, release_after_s=0.0)
    task = GatedTask(delay_s=0.05)
    task.gate.set()
    worker = free_running_worker(policy, task, episodes)
    engine, log = worker.engine, worker.replay_log
    assert engine is not None
    freed: list[list] = []
    logged: list[list] = []
    release, reset = engine.release, log.reset

    def noted_release(group_id, sample_index=None):
        freed.append(["x", group_id, sample_index])
        return release(group_id, sample_index)

    def noted_reset(*args, **kwargs):
        logged.extend(op.to_json() for op in log.ops if op.to_json()[0] == "x")
        return reset(*args, **kwargs)

    engine.release, log.reset = noted_release, noted_reset
    worker.submit(issue(1), PROBLEMS[1])
    for _ in range(400):
        if not worker.requests:
            break
        worker.step()
    assert not worker.requests
    logged.extend(op.to_json() for op in log.ops if op.to_json()[0] == "x")
    assert isinstance(worker.samples, EpisodeTurns) and worker.samples.released_rows >= 2
    assert len(freed) >= worker.samples.released_rows
    assert logged == freed
    worker.close()


def test_a_released_sample_resubmitted_alone_samples_what_its_resume_would():
    model, prompt = peaked_model(0), [5, 17, 2, 40, 33]
    config = dataclasses.replace(GREEDY, n=2)
    pair = tool_call(model, prompt, config)
    engines = [engine_for(model, pair, config) for _ in range(2)]
    for engine in engines:
        engine.submit(prompt, 0, request_id=3, hold=True)
    first = engines[0].run()
    assert [c.parked for c in first] == [True, True]
    engines[1].run()
    for engine in engines:
        engine.resume(3, OBSERVATION, 5, sample_index=0)
    engines[0].resume(3, OBSERVATION, 5, sample_index=1)
    engines[1].release(3, 1)  # sample 1 goes on as a prompt of its whole context
    context = [*prompt, *first[1].tokens.tolist(), *OBSERVATION]
    assert engines[1].submit(context, 5, request_id=3, sample_index=1) == 3
    with pytest.raises(ValueError, match="request 3 sample 1 is already queued"):
        engines[1].submit(context, 5, request_id=3, sample_index=1)
    with pytest.raises(ValueError, match="sample_index=2 needs a request_id"):
        engines[1].submit(context, 5, request_id=3, sample_index=2)
    resumed, resubmitted = (sorted(e.run(), key=lambda c: c.sample_index) for e in engines)
    for a, b in zip(resumed, resubmitted, strict=True):
        assert_same(a, b)
    assert engines[1].idle and engines[1].submit(prompt, 0, request_id=3) == 3  # id free


def observations_answer_the_calls(rollouts, problems, tokenizer):
    """Every rollout's environment tokens are the calculator's answers to its turns."""
    for rollout in rollouts:
        tokens, mask = rollout.completion_tokens.tolist(), rollout.policy_mask.tolist()
        runs, start = [], 0
        for i in range(1, len(tokens) + 1):
            if i == len(tokens) or mask[i] != mask[start]:
                runs.append((mask[start], tokens[start:i]))
                start = i
        environment = TASK.make_environment()
        environment.reset(problems[rollout.problem_id])
        assert all(mine == (i % 2 == 0) for i, (mine, _) in enumerate(runs))
        for (_, ids), (_, observation) in zip(runs[0::2], runs[1::2], strict=False):
            answer = environment.step(Action(tokenizer.decode(ids), tuple(ids), "stop"))
            assert encode_observation(answer.observation, tokenizer).tolist() == observation


def test_a_concurrent_run_of_episodes_keeps_its_books(cache):
    overrides = ["runtime.mode=concurrent", "episodes.release_after_s=0.0"]
    config = RunConfig.from_overrides(overrides, base=CONFIG)
    with Experiment(config, cache_dir=cache) as exp:
        exp.run(3)
        exp.check_accounting()
        rollouts = [r for g in exp.last_batch["groups"] for r in g.rollouts]
        problems = {p.id: p for p in exp.problems}
        tokenizer = exp.parts.tokenizer
    exp.check_accounting()
    assert any(not r.policy_mask.all() for r in rollouts)  # observations were trained on
    observations_answer_the_calls(rollouts, problems, tokenizer)
    assert {r.finish_reason for r in rollouts} <= {"stop", "max_turns", "length"}
