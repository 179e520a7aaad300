"""The reward runner: rewards that raise, hang, crash or return garbage give 0, a reason
and a counter; hung workers are killed and replaced; the batch always completes."""

import math
import os
import threading
import time

import numpy as np
import pytest

from rlaxkit.tasks import (
    INVALID_REWARD,
    REWARD_CRASHED,
    REWARD_ERROR,
    REWARD_TIMEOUT,
    Problem,
    RewardResult,
    RewardRunner,
    RewardRunnerConfig,
    SandboxLimits,
    make_task,
    validate_reward,
)

# The reward functions live at module level so spawned workers can import them.


def unruly_reward(problem: Problem, completion: str):
    """Behaves as ``completion`` says: a score, or one way of failing."""
    if completion == "raise":
        raise RuntimeError("reward exploded")
    if completion == "hang":
        time.sleep(3600)
    if completion == "exit":
        os._exit(3)
    if completion == "nan":
        return float("nan")
    if completion == "string":
        return "1.0"
    if completion == "none":
        return None
    if completion == "too_big":
        return RewardResult(1.5)
    if completion == "negative":
        return -0.25
    if completion == "nan_result":
        return RewardResult(math.nan)
    if completion == "numpy":
        return np.float32(0.5)
    return RewardResult(float(completion), completion)


PROBLEM = Problem(id="p", prompt="", answer=None)
EXPECTED = {
    "1": (1.0, None),
    "0.25": (0.25, None),
    "numpy": (0.5, None),
    "raise": (0.0, REWARD_ERROR),
    "nan": (0.0, INVALID_REWARD),
    "string": (0.0, INVALID_REWARD),
    "none": (0.0, INVALID_REWARD),
    "too_big": (0.0, INVALID_REWARD),
    "negative": (0.0, INVALID_REWARD),
    "nan_result": (0.0, INVALID_REWARD),
}


@pytest.fixture(scope="module")
def pool():
    config = RewardRunnerConfig(mode="pool", num_workers=2, timeout_s=1.0)
    with RewardRunner(unruly_reward, config) as runner:
        yield runner.start()


def test_validate_reward():
    assert validate_reward(RewardResult(0.5, "x")) == RewardResult(0.5, "x")
    assert validate_reward(1) == RewardResult(1.0)
    assert validate_reward(math.inf).reason == INVALID_REWARD
    assert validate_reward(RewardResult("1")).reason == INVALID_REWARD  # type: ignore[arg-type]


def test_inline_mode_survives_raising_and_garbage():
    runner = RewardRunner(unruly_reward, RewardRunnerConfig(mode="inline"))
    completions = list(EXPECTED)
    results = runner.score([PROBLEM] * len(completions), completions)
    assert [(r.score, r.reason) for r in results] == list(EXPECTED.values())
    assert results[completions.index("raise")].detail == "RuntimeError: reward exploded"
    assert runner.counters[REWARD_ERROR] == 1
    assert runner.counters[INVALID_REWARD] == 6
    assert runner.counters["scored"] == len(completions)


def test_pool_survives_every_kind_of_failure(pool):
    completions = ["1", "raise", "hang", "0.25", "exit", "nan", "string", "numpy", "hang", "1"]
    pids_before = set(pool.worker_pids())
    start = time.monotonic()
    results = pool.score([PROBLEM] * len(completions), completions)
    elapsed = time.monotonic() - start
    expected = {**EXPECTED, "hang": (0.0, REWARD_TIMEOUT), "exit": (0.0, REWARD_CRASHED)}
    assert [(r.score, r.reason) for r in results] == [expected[c] for c in completions]
    assert pool.counters[REWARD_TIMEOUT] == 2
    assert pool.counters[REWARD_CRASHED] == 1
    assert pool.counters["workers_replaced"] == 3
    # Hung and crashed workers are gone, replaced by as many new ones.
    pids_after = pool.worker_pids()
    assert len(pids_after) == 2
    assert len(pids_before - set(pids_after)) >= 1
    for pid in pids_before - set(pids_after):
        assert not _alive(pid)
    # Two timeouts of 1 s each (in parallel at best) plus restarts, not an hour.
    assert elapsed < 15


def test_pool_keeps_order_and_counts_across_batches(pool):
    completions = [str(i / 10) for i in range(11)]
    before = pool.counters["scored"]
    results = pool.score([PROBLEM] * 11, completions)
    assert [r.score for r in results] == [i / 10 for i in range(11)]
    assert pool.counters["scored"] == before + 11
    assert pool.score([], []) == []


def test_unpicklable_inputs_and_mismatched_lengths(pool):
    bad = Problem(id="bad", prompt="", answer=lambda: 1)
    results = pool.score([bad, PROBLEM], ["1", "1"])
    assert results[0].reason == REWARD_ERROR and results[1].score == 1.0
    with pytest.raises(ValueError, match="2 problems and 1 completions"):
        pool.score([PROBLEM, PROBLEM], ["1"])


def test_close_stops_workers():
    runner = RewardRunner(unruly_reward, RewardRunnerConfig(mode="pool", num_workers=1))
    runner.score([PROBLEM], ["1"])
    (pid,) = runner.worker_pids()
    runner.close()
    runner.close()
    assert runner.worker_pids() == []
    assert not _alive(pid)


def test_lambdas_are_refused_for_the_pool_with_a_clear_error():
    runner = RewardRunner(lambda p, c: 1.0, RewardRunnerConfig(mode="pool", num_workers=1))
    with pytest.raises(TypeError, match="picklable reward function"):
        runner.score([PROBLEM], ["x"])
    runner.close()


def test_modes_follow_the_task():
    assert RewardRunner.for_task(make_task("arithmetic")).mode == "inline"
    assert RewardRunner.for_task(make_task("countdown")).mode == "inline"
    assert RewardRunner.for_task(make_task("math")).mode == "pool"
    assert RewardRunner.for_task(make_task("code")).mode == "pool"
    assert RewardRunner.for_task(make_task("arithmetic"), "pool").mode == "pool"
    with pytest.raises(ValueError, match=r"mode must be one of \['auto', 'inline', 'pool'\]"):
        RewardRunnerConfig(mode="threads")


def test_task_rewards_through_the_pool():
    task = make_task("countdown")
    problems = task.problems("test", 4)
    completions = [task.demonstration(p) for p in problems[:2]] + ["2 ** 99", "oops"]
    with RewardRunner.for_task(task, "pool") as runner:
        results = runner.score(problems, completions)
    assert [r.score for r in results] == [1.0, 1.0, 0.0, 0.0]
    assert runner.counters["invalid_expression"] == 2


def test_killing_a_hung_code_reward_leaks_no_sandboxed_program(tmp_path):
    # Limits only: the program writes its pid outside its directory, which namespaces
    # forbid (test_sandbox_isolation covers the namespaces case).
    limits = SandboxLimits(wall_time_s=60, cpu_time_s=60, isolation="limits-only")
    task = make_task("code", limits=limits)
    pid_file = tmp_path / "pid"
    program = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
    program += "time.sleep(60)\n"
    problem = Problem(id="hang", prompt="", answer=[{"input": "", "output": ""}])
    config = RewardRunnerConfig(mode="pool", num_workers=1, timeout_s=1.0)
    with RewardRunner.for_task(task, config) as runner:
        (result,) = runner.score([problem], [program])
    assert result.reason == REWARD_TIMEOUT
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _sleeps_forever(problem, completion):
    if completion == "hang":
        time.sleep(3600)
    if completion == "spin":
        while True:
            pass
    return 1.0


@pytest.mark.parametrize("where", ["main thread", "worker thread"])
def test_inline_rewards_are_held_to_their_timeout(where):
    """A reward that never returns, scored in this process, times out like one in the
    pool: the batch goes on and the item is reward_timeout."""
    problems = [Problem(id=str(i), prompt="", answer="") for i in range(4)]
    config = RewardRunnerConfig(mode="inline", timeout_s=0.2)
    runner = RewardRunner(_sleeps_forever, config, execution="inline")
    out: list = []

    # A spinning reward is interrupted on the main thread; on another thread it would be
    # abandoned still spinning (a busy core for the rest of the session), so it sleeps.
    last = "spin" if where == "main thread" else "hang"

    def score():
        out.extend(runner.score(problems, ["ok", "hang", "ok", last]))

    start = time.monotonic()
    if where == "main thread":
        score()
    else:
        thread = threading.Thread(target=score)
        thread.start()
        thread.join(30)
    assert [r.reason for r in out] == [None, REWARD_TIMEOUT, None, REWARD_TIMEOUT]
    assert [r.score for r in out] == [1.0, 0.0, 1.0, 0.0]
    assert time.monotonic() - start < 5
    if where == "worker thread":
        assert runner.counters["abandoned_reward_threads"] == 2
