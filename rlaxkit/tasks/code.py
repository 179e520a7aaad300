"""Programming problems: a Python program is run on stdin/stdout test cases in the sandbox.

A problem's ``answer`` is its list of test cases, ``[{"input": str, "output": str}, ...]``.
The program is the last fenced code block of the completion (or the whole completion when
it has none). Outputs are compared after trimming trailing whitespace of every line and
trailing blank lines.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from rlaxkit.rules.validation import check_int, is_number
from rlaxkit.tasks.base import (
    NO_ANSWER,
    TESTS_FAILED,
    WALL_TIMEOUT,
    ChatTemplate,
    Problem,
    PromptConfig,
    RewardExecution,
    RewardResult,
    SkippedRow,
    Split,
    check_choice,
    check_range,
    format_prompt,
    generate_split,
    split_of,
    stable_id,
)
from rlaxkit.tasks.datasets import (
    FieldMapping,
    OnError,
    check_train_split,
    load_problems,
)
from rlaxkit.tasks.registry import register_task
from rlaxkit.tasks.sandbox import SandboxLimits, run_python

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str | None:
    """The last fenced code block of ``completion``, else the whole completion; ``None``
    when that is blank."""
    blocks = _FENCE.findall(completion)
    code = blocks[-1] if blocks else completion
    return code if code.strip() else None


def outputs_match(expected: str, actual: str) -> bool:
    """Equality up to trailing whitespace on each line and trailing blank lines."""

    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]

    return lines(expected) == lines(actual)


def check_test_cases(problem_id: str, answer: object) -> list[dict[str, str]]:
    """``answer`` as a list of ``{"input", "output"}`` string dicts, or ``ValueError``."""
    if not isinstance(answer, list) or not answer:
        raise ValueError(f"problem {problem_id}: answer must be a non-empty list of test cases")
    for i, case in enumerate(answer):
        if not (
            isinstance(case, dict)
            and isinstance(case.get("input"), str)
            and isinstance(case.get("output"), str)
        ):
            raise ValueError(
                f"problem {problem_id}: test case {i} must be an object with string "
                "'input' and 'output'"
            )
    return answer


@dataclass(frozen=True, kw_only=True)
class CodeConfig:
    """Settings of the code task.

    Attributes:
      train_path: JSONL/Parquet of problems (answer: test cases); ``None`` uses the
        built-in synthetic problems (small stdin/stdout exercises).
      test_path: held-out file; ``None`` splits ``train_path`` by a hash of the id.
      fields: the field mapping for the files.
      on_error: what a malformed row does: ``"raise"`` or ``"skip"`` (and count).
      limits: sandbox limits for each test-case run.
      max_total_s: no further test starts once this much time has passed on a problem
        (the problem then fails with ``wall_timeout``); keep
        ``max_total_s + limits.wall_time_s`` below the reward runner's ``timeout_s``.
      partial_credit: reward the fraction of tests passed instead of all-or-nothing.
      test_fraction: held-out share when one file (or the generator) is split.
      seed: seeds the synthetic generator.
      prompt: how problem text becomes the model's prompt (template or chat).
    """

    train_path: str | None = None
    test_path: str | None = None
    fields: FieldMapping = FieldMapping()
    on_error: OnError = "raise"
    limits: SandboxLimits = SandboxLimits()
    max_total_s: float = 20.0
    partial_credit: bool = False
    test_fraction: float = 0.1
    seed: int = 0
    prompt: PromptConfig = PromptConfig(
        template="{prompt}\nRead from standard input and write to standard output. "
        "Answer with one Python program in a ```python code block."
    )

    def __post_init__(self):
        check_choice("on_error", self.on_error, OnError)
        check_range("test_fraction", self.test_fraction, 0.0, 1.0)
        if not (is_number(self.max_total_s) and self.max_total_s > 0):
            raise ValueError(
                f"max_total_s: must be a number > 0 (seconds), got {self.max_total_s!r}"
            )
        check_int("seed", self.seed)
        if self.test_path is not None and self.train_path is None:
            raise ValueError("test_path needs a train_path as well")


@register_task("code", CodeConfig)
class CodeTask:
    """Programs judged by running them on test cases in ``sandbox.run_python``.

    Each test case is a child process with time, memory, process and output limits; the
    reward runner's pool runs several problems at once and bounds a whole problem with
    its per-item timeout (``reward_execution = "pool"``).
    """

    name = "code"
    reward_execution: RewardExecution = "pool"

    def __init__(self, config: CodeConfig | None = None):
        self.config = config or CodeConfig()
        # Dataset file -> rows skipped as malformed when it was last read
        # (``on_error="skip"``), for a run's summary.
        self.skipped_rows: dict[str, tuple[SkippedRow, ...]] = {}

    def problems(self, split: Split, n: int | None = None) -> list[Problem]:
        """Problems of ``split`` (the first ``n``; all of a file's when ``n`` is ``None``)."""
        c = self.config
        check_choice("split", split, Split)
        if c.train_path is None:
            return generate_split(
                _draw_synthetic,
                split=split,
                n=100 if n is None else n,
                seed=c.seed,
                test_fraction=c.test_fraction,
                task_name=self.name,
            )
        path = c.train_path if c.test_path is None or split == "train" else c.test_path
        problems = load_problems(path, c.fields, on_error=c.on_error, id_prefix=self.name)
        self.skipped_rows[path] = problems.skipped_rows
        selected = [
            p
            for p in problems.problems
            if c.test_path is not None or split_of(p.id, c.test_fraction) == split
        ]
        if split == "train":
            check_train_split(path, len(selected), len(problems.problems), c.test_fraction)
        for problem in selected:
            check_test_cases(problem.id, problem.answer)
        return selected if n is None else selected[:n]

    def format_prompt(self, problem: Problem, chat: ChatTemplate | None = None) -> str:
        """The prompt string for ``problem``."""
        return format_prompt(problem, self.config.prompt, chat)

    def demonstration(self, problem: Problem) -> str:
        """A reference solution in a fenced block (synthetic problems carry one)."""
        return f"```python\n{problem.metadata['solution']}```"

    def score(self, problem: Problem, completion: str) -> RewardResult:
        """Runs the program on each test case; stops at the first failure unless
        ``partial_credit`` is set. The reason is the first failure's."""
        code = extract_code(completion)
        if code is None:
            return RewardResult(0.0, None, NO_ANSWER)
        cases = check_test_cases(problem.id, problem.answer)
        passed, failure, detail = 0, None, None
        deadline = time.monotonic() + self.config.max_total_s
        for i, case in enumerate(cases):
            if time.monotonic() > deadline:
                failure = failure or WALL_TIMEOUT
                detail = detail or f"max_total_s reached before test {i}"
                break
            result = run_python(code, case["input"], self.config.limits)
            if result.status == "ok" and outputs_match(case["output"], result.stdout):
                passed += 1
                continue
            if failure is None:
                failure = TESTS_FAILED if result.status == "ok" else result.status
                detail = f"test {i}: {result.stderr[-300:]}" if result.stderr else f"test {i}"
            if not self.config.partial_credit:
                break
        score = passed / len(cases) if self.config.partial_credit else float(failure is None)
        return RewardResult(score, None, failure, detail)


# Synthetic problems: (statement with a constant, reference function, reference source).
_FAMILIES: tuple[tuple[str, Callable[[str, int], str], str], ...] = (
    (
        "Read integers separated by spaces on one line; print their sum plus {c}.",
        lambda text, c: str(sum(map(int, text.split())) + c),
        "print(sum(map(int, input().split())) + {c})\n",
    ),
    (
        "Read integers separated by spaces on one line; print the largest times {c}.",
        lambda text, c: str(max(map(int, text.split())) * c),
        "print(max(map(int, input().split())) * {c})\n",
    ),
    (
        "Read an integer n; print the first n multiples of {c} (starting at {c}), "
        "separated by spaces.",
        lambda text, c: " ".join(str(c * k) for k in range(1, int(text) + 1)),
        "n = int(input())\nprint(' '.join(str({c} * k) for k in range(1, n + 1)))\n",
    ),
    (
        "Read a line of lowercase letters; print it reversed, repeated {c} times.",
        lambda text, c: text.strip()[::-1] * c,
        "print(input().strip()[::-1] * {c})\n",
    ),
)


def _draw_synthetic(rng: random.Random) -> tuple[str, Problem] | None:
    family = rng.randrange(len(_FAMILIES))
    statement, reference, solution = _FAMILIES[family]
    c = rng.randint(2, 500)
    inputs = []
    for _ in range(3):
        if family == 2:
            inputs.append(str(rng.randint(1, 8)))
        elif family == 3:
            inputs.append("".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 6))))
        else:
            inputs.append(" ".join(str(rng.randint(-50, 50)) for _ in range(rng.randint(1, 6))))
    question = statement.format(c=c)
    tests = [{"input": x + "\n", "output": reference(x, c) + "\n"} for x in inputs]
    problem = Problem(
        id=stable_id("code", question),
        prompt=question,
        answer=tests,
        metadata={"solution": solution.format(c=c)},
    )
    return question, problem
