"""Code with test feedback: scripted attempts get the failing tests back as the
observation, the last attempt's pass is the reward, sandbox failures are counted
observations, and the environment runs in ``run_episodes`` on a tiny random model."""

import string

import numpy as np
import pytest
from flax import nnx

from rlaxkit.inference import InferenceEngine, SamplingConfig
from rlaxkit.models import CharTokenizer, ModelConfig, Transformer
from rlaxkit.tasks import (
    CodeConfig,
    CodeToolsConfig,
    CodeToolsEnvironment,
    CodeToolsTask,
    Problem,
    PromptConfig,
    SandboxLimits,
    SandboxSetupError,
    code_tool_metrics,
    code_tools,
    make_task,
    task_names,
)
from rlaxkit.tasks.code_tools import NO_PROGRAM_TEXT
from rlaxkit.tasks.episodes import Action, EpisodeConfig, episode_sampling, run_episodes

# Doubles its input; the second test is named, the third is not.
DOUBLE = Problem(
    id="double",
    prompt="Read n; print 2*n.",
    answer=[
        {"input": "1\n", "output": "2\n"},
        {"name": "three", "input": "3\n", "output": "6\n"},
        {"input": "5\n", "output": "10\n"},
    ],
)
RIGHT = "```python\nprint(2 * int(input()))\n```"
PLUS_ONE = "```python\nprint(int(input()) + 1)\n```"  # right for n = 1 only
# A runaway ends on its 1 s of CPU; the wall limit leaves room for the interpreter's and
# the sandbox's start, which took 2 s once in a loaded test run (tests/test_tasks_code.py).
SHORT_LIMITS = SandboxLimits(wall_time_s=6.0, cpu_time_s=1)


def environment(**options):
    code = options.pop("code", CodeConfig(limits=SHORT_LIMITS))
    env = CodeToolsEnvironment(CodeToolsTask(CodeToolsConfig(code=code, **options)))
    env.reset(DOUBLE)
    return env


def act(env, text):
    return env.step(Action(text, (), "stop"))


def test_failing_tests_come_back_and_a_fixed_program_passes():
    env = environment(max_attempts=3)
    first = act(env, "I think this works:\n" + PLUS_ONE)
    assert (first.done, first.reward) == (False, 0.0)
    assert first.observation == (
        "Tests failed: 1 of 3 passed.\n"
        "three: input '3\\n' expected '6\\n' got '4\\n'\n"
        "test 2: input '5\\n' expected '10\\n' got '6\\n'\n"
        "Try again.\n"
    )
    assert first.info["attempt"] == 1 and first.info["passed"] == 1
    second = act(env, RIGHT)
    assert (second.done, second.reward) == (True, 1.0)
    assert second.info.items() >= {"attempt": 2, "final": True, "correct": True}.items()


def test_the_last_attempt_ends_the_episode_and_its_pass_is_the_reward():
    env = environment(max_attempts=2, max_failures_shown=1)
    first = act(env, PLUS_ONE)
    assert "(1 more failing)" in first.observation and "test 2" not in first.observation
    last = act(env, PLUS_ONE)
    assert (last.done, last.reward, last.info["final"], last.info["correct"]) == (
        True,
        0.0,
        True,
        False,
    )
    # With partial credit the reward is the last attempt's share; earlier ones earn 0.
    partial = CodeConfig(limits=SHORT_LIMITS, partial_credit=True)
    env = environment(max_attempts=2, code=partial)
    assert act(env, "```python\nprint(2)\n```").reward == 0.0  # 1 of 3, not final
    assert act(env, PLUS_ONE).reward == pytest.approx(1 / 3)


def test_sandbox_failures_are_counted_observations():
    env = environment(max_attempts=3)
    crash = act(env, "```python\nraise ValueError('boom')\n```")
    assert crash.info["sandbox_errors"] == 3 and not crash.done
    assert "test 0: input '1\\n' runtime_error: ValueError: boom" in crash.observation
    hang = act(env, "```python\nwhile True:\n    pass\n```")
    assert hang.info["sandbox_errors"] == 3
    assert hang.observation.count("cpu_time_limit") + hang.observation.count("wall_timeout") == 2
    nothing = act(env, "   ")
    assert nothing.done and nothing.reward == 0.0 and nothing.info["program"] is False
    env = environment()
    assert act(env, "").observation == NO_PROGRAM_TEXT
    assert env.error_observation("timeout", "slow") == "The tests took too long. Try again.\n"
    assert env.error_observation("error", "x") == "The tests could not run. Try again.\n"


def test_a_sandbox_that_cannot_start_raises_for_run_episodes_to_count(monkeypatch):
    def refuse(*args, **kwargs):
        raise SandboxSetupError("namespaces unavailable")

    monkeypatch.setattr(code_tools, "run_python", refuse)
    with pytest.raises(SandboxSetupError):  # run_episodes: an "error" step, counted
        act(environment(), RIGHT)


def test_long_outputs_are_cut_and_carry_no_code_fence():
    env = environment(max_field_chars=12)
    result = act(env, "```python\nprint(chr(96) * 3 + 'x' * 500)\n```")
    line = result.observation.splitlines()[1]
    # repr gives '```xxx...' and the fence becomes three quotes: 12 characters shown.
    assert line == "test 0: input '1\\n' expected '2\\n' got " + "'" * 4 + "xxxxx..."
    assert "```" not in result.observation


def test_registered_with_config_errors_that_name_the_field():
    assert "code_tools" in task_names()
    task = make_task("code_tools", max_attempts=2, code={"partial_credit": True})
    assert task.config.max_attempts == 2 and task.config.code.partial_credit
    for option in ("max_attempts", "max_failures_shown", "max_field_chars"):
        with pytest.raises(ValueError, match=option):
            make_task("code_tools", **{option: 0})
    problem = task.problems("train", 1)[0]
    # Single-turn scoring reads the transcript's last program, like the code task.
    assert task.score(problem, PLUS_ONE + "\nfeedback\n" + task.demonstration(problem)).score == 1


def test_metrics():
    env = environment(max_attempts=3)
    steps = [act(env, PLUS_ONE), act(env, RIGHT)]

    class Ended:  # the two fields of an Episode the metrics read
        def __init__(self, infos):
            self.steps = [type("Step", (), {"info": info})() for info in infos]

        def failures(self, outcome):
            return 1 if outcome == "error" else 0

    metrics = code_tool_metrics([Ended([s.info for s in steps]), Ended([steps[0].info])])
    assert metrics == {
        "pass_rate": 0.5,
        "fixed_after_feedback_rate": 0.5,
        "sandbox_error_rate": 0.0,
        "step_failure_rate": 2 / 3,
        "attempts_per_episode": 1.5,
    }


def test_episodes_on_a_tiny_random_model(monkeypatch):
    """The environment plugs into ``run_episodes``: a random model's programs fail, the
    failures are appended as token ids, and the trained ids are the sampled ids plus
    those observations."""
    tokenizer = CharTokenizer(string.printable)
    task = CodeToolsTask(
        CodeToolsConfig(
            code=CodeConfig(limits=SHORT_LIMITS, prompt=PromptConfig()),
            max_attempts=2,
            max_failures_shown=1,
            max_field_chars=16,
        )
    )
    config = ModelConfig(
        family="qwen3",
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
    )
    model = Transformer(config, rngs=nnx.Rngs(0))
    sampling = episode_sampling(SamplingConfig(max_new_tokens=8), tokenizer, ())
    engine = InferenceEngine(model, sampling, num_slots=2, max_prompt_len=320, chunk_steps=8)
    problems = task.problems("train", 2)
    episode_config = EpisodeConfig(samples_per_problem=2, max_turns=2, max_episode_tokens=192)
    episodes = run_episodes(
        engine, lambda: CodeToolsEnvironment(task), problems, tokenizer, episode_config, seed=0
    )
    assert len(episodes) == 4
    for episode in episodes:
        assert episode.finish_reason == "stop" and episode.turns == 2
        first, last = episode.steps
        assert first.info["attempt"] == 1 and last.info["final"] is True
        assert episode.reward == 0.0  # random characters are no program that passes
        shown = tokenizer.decode(first.observation_ids)
        assert shown.startswith("Tests failed: 0 of 3 passed.\n") or shown == NO_PROGRAM_TEXT
        expected = [*first.action.token_ids, *first.observation_ids, *last.action.token_ids]
        rollout = episode.to_rollout(group_id=0)
        assert rollout.completion_tokens.tolist() == expected
        mask = [True] * len(first.action.token_ids) + [False] * len(first.observation_ids)
        mask += [True] * len(last.action.token_ids)
        assert rollout.policy_mask.tolist() == mask
        np.testing.assert_array_equal(rollout.versions[~rollout.policy_mask], -1)
    assert code_tool_metrics(episodes)["attempts_per_episode"] == 2.0

    # A sandbox that cannot start: every step raises, and each is a counted error
    # observation in the environment's words.
    def refuse(*args, **kwargs):
        raise SandboxSetupError("namespaces unavailable")

    monkeypatch.setattr(code_tools, "run_python", refuse)
    broken = run_episodes(
        engine, lambda: CodeToolsEnvironment(task), problems, tokenizer, episode_config, seed=0
    )
    for episode in broken:
        assert episode.finish_reason == "max_turns" and episode.failures("error") == 2
        assert tokenizer.decode(episode.steps[0].observation_ids) == (
            "The tests could not run. Try again.\n"
        )
        assert "SandboxSetupError" in episode.steps[0].info["error"]
    assert code_tool_metrics(broken)["step_failure_rate"] == 1.0


def test_a_local_run_trains_on_attempts_and_their_test_feedback(tmp_path):
    """In the runtime's worker, each attempt ends at the end token and parks no row: the
    next attempt is a request of the whole context (prompt, attempts, feedback). The
    trained rows are the sampled ids plus the feedback's ids, and the books balance."""
    from rlaxkit.config.run import RunConfig
    from rlaxkit.runtime import Experiment

    config = RunConfig.from_overrides(
        [
            "steps=2",
            "model.config.hidden_size=32",
            "model.config.intermediate_size=64",
            "model.config.num_layers=1",
            "model.config.max_position_embeddings=512",
            "model.config.vocab_size=100",  # printable characters
            "task.name=code_tools",
            "task.options.max_attempts=2",
            "task.options.max_failures_shown=1",
            "task.options.max_field_chars=16",
            "sft.steps=0",
            "sampling.n=2",
            "sampling.max_new_tokens=8",
            "staleness.batch_size=2",
            "runtime.num_workers=1",
            "runtime.slots_per_worker=4",
            "runtime.max_prompt_tokens=256",
            "episodes.max_turns=2",
            "episodes.max_episode_tokens=160",
            "batching.equal_rewards=keep",
            "eval.num_problems=1",
            "eval.samples=1",
            "eval.every_steps=0",
        ]
    )
    with Experiment(config, run_dir=tmp_path) as exp:
        exp.run()
        exp.check_accounting()
        rollouts = [r for g in exp.last_batch["groups"] for r in g.rollouts]
        tokenizer = exp.tokenizer
    for rollout in rollouts:
        assert rollout.reward_info["turns"] == 2  # a random model's first attempt fails
        mask = rollout.policy_mask
        feedback = rollout.completion_tokens[~mask].tolist()
        shown = tokenizer.decode(feedback)
        assert shown.startswith("Tests failed: 0 of") or shown == NO_PROGRAM_TEXT
        assert mask[:1].all() and mask[-1:].all()  # attempt, feedback, attempt
