"""The code sandbox: every runaway program ends within its limit with reward 0 and the
right reason; a correct program gets 1. Limits are small so this file runs in seconds."""

import dataclasses
import time

import pytest

from rlaxkit.tasks import (
    CPU_TIME_LIMIT,
    FORBIDDEN_OPERATION,
    MEMORY_LIMIT,
    NO_ANSWER,
    OUTPUT_LIMIT,
    RUNTIME_ERROR,
    TESTS_FAILED,
    WALL_TIMEOUT,
    CodeConfig,
    CodeTask,
    Problem,
    SandboxLimits,
    extract_code,
    outputs_match,
    run_python,
)

LIMITS = SandboxLimits(
    wall_time_s=2.0, cpu_time_s=1, memory_bytes=256 * 2**20, max_output_bytes=64 * 2**10
)
TASK = CodeTask(CodeConfig(limits=LIMITS))
# The wall clock starts before the interpreter and the sandbox's setup. A runaway that
# must end for another reason gets 6 s of it: under a loaded test run a CPU-bound program
# gets less than the half core it needs to reach 1 s of CPU in 2 s, and a memory bomb's
# start alone once took 2 s (both read ``wall_timeout`` then). Only the program that
# sleeps meets the 2 s limit.
ROOMY_TASK = CodeTask(CodeConfig(limits=dataclasses.replace(LIMITS, wall_time_s=6.0)))
SUM_PROBLEM = Problem(
    id="sum",
    prompt="print the sum",
    answer=[{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6\n"}],
)


def fenced(source: str) -> str:
    return f"Here is my program:\n```python\n{source}\n```\n"


RUNAWAYS = {
    "infinite_loop": ("while True:\n    pass", CPU_TIME_LIMIT, 1.0),
    "sleep_forever": ("import time\ntime.sleep(3600)", WALL_TIMEOUT, 2.0),
    "memory_bomb": (
        "blocks = []\nwhile True:\n    blocks.append(bytearray(2**24))",
        MEMORY_LIMIT,
        0,
    ),
    "fork_bomb": ("import os\nwhile True:\n    os.fork()", FORBIDDEN_OPERATION, 0),
    "subprocess": ("import subprocess\nsubprocess.run(['true'])", FORBIDDEN_OPERATION, 0),
    "system": ("import os\nos.system('true')", FORBIDDEN_OPERATION, 0),
    "one_gigabyte": (
        "import sys\nchunk = 'x' * 2**16\nfor _ in range(2**14):\n    sys.stdout.write(chunk)",
        OUTPUT_LIMIT,
        0,
    ),
    "raises": ("raise ValueError('no')", RUNTIME_ERROR, 0),
}


@pytest.mark.parametrize("name", sorted(RUNAWAYS))
def test_runaway_programs_end_within_limits(name):
    source, reason, min_time_s = RUNAWAYS[name]
    task = TASK if reason == WALL_TIMEOUT else ROOMY_TASK
    start = time.monotonic()
    result = task.score(SUM_PROBLEM, fenced(source))
    elapsed = time.monotonic() - start
    assert (result.score, result.reason) == (0.0, reason)
    # One test case runs (the first failure stops scoring): the wall limit plus slack.
    assert min_time_s * 0.9 <= elapsed < task.config.limits.wall_time_s + 1.5


def test_correct_program_gets_one():
    result = TASK.score(SUM_PROBLEM, fenced("print(sum(map(int, input().split())))"))
    assert (result.score, result.reason) == (1.0, None)


def test_wrong_output_and_partial_credit():
    wrong = fenced("a, b = map(int, input().split())\nprint(a + b if a == 1 else 0)")
    assert TASK.score(SUM_PROBLEM, wrong).reason == TESTS_FAILED
    partial = CodeTask(CodeConfig(limits=LIMITS, partial_credit=True))
    assert partial.score(SUM_PROBLEM, wrong).score == 0.5
    assert TASK.score(SUM_PROBLEM, "```python\n\n```").reason == NO_ANSWER


def test_output_is_capped_not_buffered():
    result = run_python("print('x' * 10**7)", limits=LIMITS)
    assert result.status == OUTPUT_LIMIT
    assert len(result.stdout) <= LIMITS.max_output_bytes


def test_clean_environment_and_private_working_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("RLAXKIT_TEST_SECRET", "hunter2")
    monkeypatch.chdir(tmp_path)
    source = "import os\nprint(os.environ.get('RLAXKIT_TEST_SECRET'))\nprint(os.getcwd())"
    result = run_python(source, limits=LIMITS)
    secret, cwd = result.stdout.split()
    assert result.status == "ok"
    assert secret == "None"
    assert cwd != str(tmp_path) and "rlaxkit-sandbox-" in cwd


def test_files_written_are_capped():
    source = "open('big.bin', 'wb').write(b'x' * 2**21)"
    assert run_python(source, limits=SandboxLimits(max_file_bytes=2**20)).status != "ok"


def test_extraction_and_comparison():
    assert extract_code("```python\nprint(1)\n```") == "print(1)\n"
    assert extract_code("```\nA\n```\ntext\n```py\nB\n```") == "B\n"
    assert extract_code("print(2)") == "print(2)"
    assert extract_code("   ") is None
    assert outputs_match("1 2\n3\n", "1 2   \n3\n\n")
    assert not outputs_match("1\n2\n", "1\n")


def test_synthetic_problems_with_reference_solutions():
    task = CodeTask(CodeConfig(limits=LIMITS, seed=5))
    for problem in task.problems("train", 4):
        assert task.score(problem, task.demonstration(problem)).score == 1.0


def test_limits_validation_names_the_field():
    with pytest.raises(ValueError, match="cpu_time_s must be >= 1"):
        SandboxLimits(cpu_time_s=0)
