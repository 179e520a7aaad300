"""A run counts every reward failure by reason (summary, step metrics, trace), and a run
whose rewards all fail says so, with the first failure, instead of blaming the policy."""

import json
import math
import zlib

import pytest

from rlaxkit.config.run import small_run_config
from rlaxkit.observe.metrics import read_metrics
from rlaxkit.rules.trace import read_trace
from rlaxkit.runtime import Experiment
from rlaxkit.tasks import (
    ArithmeticConfig,
    ArithmeticTask,
    RewardResult,
    register_task,
    unregister_task,
)


class HalfNaN(ArithmeticTask):
    """Arithmetic whose reward is NaN for every second problem (an invalid reward)."""

    name = "arithmetic_half_nan"

    def score(self, problem, completion) -> RewardResult:
        if zlib.crc32(problem.id.encode()) % 2:
            return RewardResult(math.nan)
        return super().score(problem, completion)


class Raises(ArithmeticTask):
    """Arithmetic whose reward always raises."""

    name = "arithmetic_raises"

    def score(self, problem, completion) -> RewardResult:
        raise KeyError("the grader's answer table has no entry")


@pytest.fixture(scope="module", autouse=True)
def bad_tasks():
    """The two tasks exist for this module only (other tests walk every task)."""
    for name, task in (("arithmetic_half_nan", HalfNaN), ("arithmetic_raises", Raises)):
        register_task(name, ArithmeticConfig)(task)
    yield
    for name in ("arithmetic_half_nan", "arithmetic_raises"):
        unregister_task(name)


def test_invalid_rewards_are_counted_in_summary_metrics_and_trace(cache, tmp_path):
    config = small_run_config(
        "task.name=arithmetic_half_nan", "steps=2", "sft.steps=0", "batching.equal_rewards=keep"
    )
    with Experiment(config, run_dir=tmp_path, cache_dir=cache) as exp:
        exp.run()
        summary = exp.summary()
    invalid = summary["reward_failures"]["invalid_reward"]
    assert invalid > 0 and set(summary["reward_failures"]) == {"invalid_reward"}
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[-1]["reward_failures/invalid_reward"] == invalid
    ends = [e for e in read_trace(tmp_path / "trace.jsonl") if e.kind == "generation_end"]
    failed = [e for e in ends if e.get("reward_failure") == "invalid_reward"]
    assert 0 < len(failed) <= invalid  # every scored failure; lost work is not traced
    assert json.loads(json.dumps(summary))  # plain JSON


def test_a_run_whose_rewards_all_fail_says_so_with_the_first_error(cache):
    config = small_run_config("task.name=arithmetic_raises", "steps=1", "sft.steps=0")
    failing = pytest.raises(RuntimeError, match="the reward function is failing")
    with Experiment(config, cache_dir=cache) as exp, failing as error:
        exp.run()
    assert "reward_error" in str(error.value)
    assert "the grader's answer table has no entry" in str(error.value)
