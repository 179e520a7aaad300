"""Integer arithmetic problems, short enough for a character-level model on a CPU.

By default a problem is ``"12+7="`` and the ideal completion is ``"19"`` (the caller
appends its tokenizer's end token). Digits, operators, the number of operands, the
question template and the answer format are all configurable.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Literal

from rlaxkit.rules.validation import check_int
from rlaxkit.tasks.base import (
    NO_ANSWER,
    WRONG_ANSWER,
    ChatTemplate,
    Problem,
    PromptConfig,
    RewardExecution,
    RewardResult,
    SeededProblems,
    SkippedRow,
    check_choices,
    check_split_fraction,
    cut_at_stop,
    format_prompt,
    stable_id,
)
from rlaxkit.tasks.expressions import ExpressionError, evaluate_expression
from rlaxkit.tasks.registry import register_task

Operator = Literal["+", "-", "*", "/"]
_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True, kw_only=True)
class ArithmeticConfig:
    """Settings of the arithmetic generator and its reward.

    Attributes:
      min_digits: fewest digits of an operand.
      max_digits: most digits of an operand.
      operators: operators to draw from; ``/`` only where the quotient is an integer.
      num_operands: operands per problem (usual precedence: ``*`` and ``/`` bind first).
      allow_negative: whether results below zero may be drawn.
      question_template: the problem text; ``{expression}`` is e.g. ``12+7``.
      answer_format: the ideal completion; ``{answer}`` is the integer result.
      stop: the completion is read up to this string (``None``: the whole completion).
      test_fraction: share of all possible problems that belongs to the test split.
      seed: seeds the stream of drawn problems.
      prompt: how problem text becomes the model's prompt (template or chat).
    """

    min_digits: int = 1
    max_digits: int = 2
    operators: tuple[Operator, ...] = ("+", "-")
    num_operands: int = 2
    allow_negative: bool = False
    question_template: str = "{expression}="
    answer_format: str = "{answer}"
    stop: str | None = "\n"
    test_fraction: float = 0.1
    seed: int = 0
    prompt: PromptConfig = PromptConfig()

    def __post_init__(self):
        check_int("min_digits", self.min_digits, minimum=1, maximum=18)
        check_int("max_digits", self.max_digits, minimum=1, maximum=18)
        if self.min_digits > self.max_digits:
            raise ValueError(
                "min_digits and max_digits must satisfy 1 <= min_digits <= max_digits <= 18, "
                f"got {self.min_digits} and {self.max_digits}"
            )
        check_choices("operators", self.operators, Operator)
        check_int("num_operands", self.num_operands, minimum=2)
        check_int("seed", self.seed)
        if "{expression}" not in self.question_template:
            raise ValueError("question_template must contain '{expression}'")
        if "{answer}" not in self.answer_format:
            raise ValueError("answer_format must contain '{answer}'")
        check_split_fraction("test_fraction", self.test_fraction)


@register_task("arithmetic", ArithmeticConfig)
class ArithmeticTask(SeededProblems):
    """Exact-match integer arithmetic; reward 1 for the right integer, else 0.

    The reward is a regex and an integer comparison, pure and bounded, so it runs
    in-process (``reward_execution = "inline"``): a process pool's per-item round trip
    would cost far more than the check itself.

    >>> task = ArithmeticTask(ArithmeticConfig(seed=0))
    >>> problem = task.problems("train", 1)[0]
    >>> task.score(problem, task.demonstration(problem)).score
    1.0
    """

    name = "arithmetic"
    reward_execution: RewardExecution = "inline"
    skipped_rows: dict[str, tuple[SkippedRow, ...]] = {}  # generated: no file, no row to skip

    def __init__(self, config: ArithmeticConfig | None = None):
        self.config = config or ArithmeticConfig()
        prefix, _, suffix = self.config.answer_format.partition("{answer}")
        # What an answer must start and end with (the frozen config's, read once).
        self._prefix, self._suffix = prefix.strip(), suffix.strip()

    def format_prompt(self, problem: Problem, chat: ChatTemplate | None = None) -> str:
        """The prompt string for ``problem`` (by default just ``"12+7="``)."""
        return format_prompt(problem, self.config.prompt, chat)

    def demonstration(self, problem: Problem) -> str:
        """The ideal completion of ``problem``, without an end token (for a supervised start)."""
        return self.config.answer_format.format(answer=problem.answer)

    def score(self, problem: Problem, completion: str) -> RewardResult:
        """1 when the completion, read up to ``stop``, is exactly the answer's format."""
        text = cut_at_stop(completion, self.config.stop)
        prefix, suffix = self._prefix, self._suffix
        if not (text.startswith(prefix) and text.endswith(suffix)):
            return RewardResult(0.0, None, NO_ANSWER)
        core = text[len(prefix) : len(text) - len(suffix)].strip()
        if not _INTEGER.fullmatch(core):
            return RewardResult(0.0, None, NO_ANSWER)
        # No answer has more digits than all operands together; int() of thousands of
        # digits would be slow, then refused.
        max_chars = self.config.max_digits * self.config.num_operands + 1
        if len(core) > max_chars:
            return RewardResult(0.0, core[:max_chars] + "...", WRONG_ANSWER)
        if int(core) == int(problem.answer):
            return RewardResult(1.0, core)
        return RewardResult(0.0, core, WRONG_ANSWER)

    def alphabet(self) -> str:
        """Every character a prompt or an ideal completion can hold (for a char tokenizer)."""
        c = self.config
        chars = set("0123456789-") | set(c.operators)
        chars |= set(c.question_template.replace("{expression}", ""))
        chars |= set(c.answer_format.replace("{answer}", ""))
        chars |= set(c.prompt.template.replace("{prompt}", ""))
        return "".join(sorted(chars))

    def _draw(self, rng: random.Random) -> tuple[str, Problem] | None:
        c = self.config
        operands = [_draw_operand(rng, c.min_digits, c.max_digits) for _ in range(c.num_operands)]
        ops = [rng.choice(c.operators) for _ in range(c.num_operands - 1)]
        expression = str(operands[0]) + "".join(
            f"{o}{x}" for o, x in zip(ops, operands[1:], strict=True)
        )
        try:
            value, _ = evaluate_expression(expression)
        except ExpressionError:  # division by zero
            return None
        if value.denominator != 1 or (value < 0 and not c.allow_negative):
            return None
        answer = value.numerator
        problem = Problem(
            id=stable_id(self.name, expression),
            prompt=c.question_template.format(expression=expression),
            answer=answer,
            metadata={"expression": expression},
        )
        return expression, problem


def _draw_operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)
