"""Countdown: reach a target number from given numbers with ``+ - * /`` and parentheses.

The answer is checked by parsing it with ``ast`` (``tasks.expressions``), never ``eval``:
only integer literals, the four operators and parentheses pass; each given number may be
used at most once; arithmetic is exact on fractions, so ``7/2*2`` equals ``7``.
"""

from __future__ import annotations

import operator
import random
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

from rlaxkit.rules.validation import check_int
from rlaxkit.tasks.base import (
    INVALID_EXPRESSION,
    NO_ANSWER,
    NUMBER_MISUSE,
    WRONG_ANSWER,
    ChatTemplate,
    Problem,
    PromptConfig,
    RewardExecution,
    RewardResult,
    SeededProblems,
    SkippedRow,
    check_split_fraction,
    cut_at_stop,
    format_prompt,
    stable_id,
)
from rlaxkit.tasks.expressions import ExpressionError, evaluate_expression, render
from rlaxkit.tasks.registry import register_task

_OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass(frozen=True, kw_only=True)
class CountdownConfig:
    """Settings of the countdown generator and its verifier.

    Attributes:
      min_numbers: fewest numbers given.
      max_numbers: most numbers given.
      max_number: numbers are drawn from ``1..max_number``.
      max_target: targets are whole numbers in ``1..max_target``.
      question_template: problem text; ``{numbers}`` (comma separated) and ``{target}``.
      stop: a completion without ``<answer>`` tags is read up to this string.
      test_fraction: share of all possible problems that belongs to the test split.
      seed: seeds the stream of drawn problems.
      prompt: how problem text becomes the model's prompt (template or chat).
    """

    min_numbers: int = 3
    max_numbers: int = 4
    max_number: int = 99
    max_target: int = 999
    question_template: str = "{numbers}->{target}:"
    stop: str | None = "\n"
    test_fraction: float = 0.1
    seed: int = 0
    prompt: PromptConfig = PromptConfig()

    def __post_init__(self):
        check_int("min_numbers", self.min_numbers, minimum=2, maximum=8)
        check_int("max_numbers", self.max_numbers, minimum=2, maximum=8)
        if self.min_numbers > self.max_numbers:
            raise ValueError(
                "min_numbers and max_numbers must satisfy 2 <= min_numbers <= max_numbers <= 8, "
                f"got {self.min_numbers} and {self.max_numbers}"
            )
        check_int("max_number", self.max_number, minimum=2)
        check_int("max_target", self.max_target, minimum=1)
        check_int("seed", self.seed)
        for name in ("{numbers}", "{target}"):
            if name not in self.question_template:
                raise ValueError(f"question_template must contain '{name}'")
        check_split_fraction("test_fraction", self.test_fraction)


def extract_expression(completion: str, stop: str | None = "\n") -> str | None:
    """The proposed expression: the last ``<answer>...</answer>``, else the text up to
    ``stop``; a trailing ``= target`` is dropped. ``None`` when nothing is left."""
    tagged = _ANSWER_TAG.findall(completion)
    text = tagged[-1].strip() if tagged else cut_at_stop(completion, stop)
    text = text.split("=", 1)[0].strip()
    return text or None


def check_solution(expression: str, numbers: list[int], target: int) -> RewardResult:
    """Reward 1 when ``expression`` uses each of ``numbers`` at most once and equals ``target``.

    >>> check_solution("(6 - 2) * 25", [2, 6, 25, 7], 100).score
    1.0
    >>> check_solution("2 ** 10", [2, 10], 1024).reason
    'invalid_expression'
    """
    try:
        value, used = evaluate_expression(expression)
    except ExpressionError as error:
        return RewardResult(0.0, expression, INVALID_EXPRESSION, str(error))
    extra = Counter(used) - Counter(numbers)
    if extra:
        return RewardResult(
            0.0, expression, NUMBER_MISUSE, f"not available (or reused): {sorted(extra)}"
        )
    if value != target:
        return RewardResult(0.0, expression, WRONG_ANSWER, f"value {render(value)}")
    return RewardResult(1.0, expression)


@register_task("countdown", CountdownConfig)
class CountdownTask(SeededProblems):
    """Countdown problems with an exact, ``ast``-based verifier.

    The verifier parses at most ``MAX_EXPRESSION_CHARS`` characters and does exact
    arithmetic on a handful of small numbers (no ``**``, so no huge values), so it is
    pure and bounded and runs in-process (``reward_execution = "inline"``).
    """

    name = "countdown"
    reward_execution: RewardExecution = "inline"
    skipped_rows: dict[str, tuple[SkippedRow, ...]] = {}  # generated: no file, no row to skip

    def __init__(self, config: CountdownConfig | None = None):
        self.config = config or CountdownConfig()

    def format_prompt(self, problem: Problem, chat: ChatTemplate | None = None) -> str:
        """The prompt string for ``problem`` (by default ``"3,7,25->100:"``)."""
        return format_prompt(problem, self.config.prompt, chat)

    def demonstration(self, problem: Problem) -> str:
        """A known solution (the expression the target was built from)."""
        return problem.metadata["solution"]

    def score(self, problem: Problem, completion: str) -> RewardResult:
        """Parses the proposed expression and checks it (see ``check_solution``)."""
        expression = extract_expression(completion, self.config.stop)
        if expression is None:
            return RewardResult(0.0, None, NO_ANSWER)
        return check_solution(expression, list(problem.metadata["numbers"]), problem.answer)

    def _draw(self, rng: random.Random) -> tuple[str, Problem] | None:
        c = self.config
        count = rng.randint(c.min_numbers, c.max_numbers)
        numbers = [rng.randint(1, c.max_number) for _ in range(count)]
        # Build the target from a random expression over a random subset of the numbers
        # (at least two), so every problem has a known solution.
        used = rng.sample(numbers, rng.randint(2, count))
        terms = [(Fraction(x), str(x)) for x in used]
        while len(terms) > 1:
            i, j = sorted(rng.sample(range(len(terms)), 2))
            (a, text_a), (b, text_b) = terms[i], terms.pop(j)
            op = rng.choice("+-*/")
            if op == "/" and b == 0:
                return None
            value = _OPERATIONS[op](a, b)
            terms[i] = (value, f"({text_a}{op}{text_b})")
        value, solution = terms[0]
        if value.denominator != 1 or not 1 <= value <= c.max_target:
            return None
        target = value.numerator
        solution = solution[1:-1] if solution.startswith("(") else solution
        key = f"{sorted(numbers)}->{target}"
        problem = Problem(
            id=stable_id(self.name, key),
            prompt=c.question_template.format(numbers=",".join(map(str, numbers)), target=target),
            answer=target,
            metadata={"numbers": numbers, "solution": solution},
        )
        return key, problem
