"""Final-answer math (GSM8K / MATH style): extract the answer, judge it with math-verify.

The answer is the last ``\\boxed{...}`` (or ``\\fbox{...}``) of a completion, else what
follows the last GSM8K ``#### `` marker. Equivalence (fractions vs decimals, LaTeX,
units, percentages, ...) is decided by the ``math-verify`` package, which parses both
sides to sympy; we only extract and hand over.
"""

from __future__ import annotations

import random
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
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
from rlaxkit.tasks.expressions import render
from rlaxkit.tasks.registry import register_task

AnswerFallback = Literal["none", "last_number"]
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_GSM8K_MARKER = re.compile(r"####\s*(.+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def extract_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` / ``\\fbox{...}``, braces balanced.

    >>> extract_boxed(r"so $x = \\boxed{\\frac{1}{2}}$.")
    '\\\\frac{1}{2}'
    """
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[brace + 1 : i].strip() or None
    return None  # unbalanced: the completion was cut off inside the box


def extract_answer(completion: str, fallback: AnswerFallback = "none") -> str | None:
    """The final answer of a completion: boxed, else after ``####``, else (optionally) the
    last number. GSM8K answers lose thousands separators and a leading ``$``."""
    boxed = extract_boxed(completion)
    if boxed is not None:
        return boxed
    markers = _GSM8K_MARKER.findall(completion)
    if markers:
        return markers[-1].strip().lstrip("$").replace(",", "").rstrip(".").strip() or None
    if fallback == "last_number":
        numbers = _NUMBER.findall(completion)
        return numbers[-1].replace(",", "") if numbers else None
    return None


def answers_match(reference: str, predicted: str, timeout_s: int | None = 5) -> bool:
    """Whether two answers are mathematically equal, as judged by math-verify.

    Both sides are parsed as the contents of a ``\\boxed{}``, which gives math-verify's
    LaTeX extraction the right anchor for bare numbers and expressions alike. The
    timeouts use ``SIGALRM``, so they only apply on the main thread.
    """
    import math_verify  # imported on first use: loading sympy costs about a second

    if threading.current_thread() is not threading.main_thread():
        timeout_s = None
    gold = math_verify.parse(f"\\boxed{{{reference}}}", parsing_timeout=timeout_s)
    answer = math_verify.parse(f"\\boxed{{{predicted}}}", parsing_timeout=timeout_s)
    if not gold or not answer:
        return False
    return bool(math_verify.verify(gold, answer, timeout_seconds=timeout_s))


@dataclass(frozen=True, kw_only=True)
class MathConfig:
    """Settings of the math-answer task.

    Attributes:
      train_path: JSONL/Parquet of problems; ``None`` uses the built-in synthetic set
        (fraction sums, percentages, linear equations).
      test_path: held-out file; ``None`` splits ``train_path`` by a hash of the id.
      fields: the field mapping for the files.
      on_error: what a malformed row does: ``"raise"`` or ``"skip"`` (and count).
      answer_fallback: ``"last_number"`` also accepts the last number of an unboxed
        completion; ``"none"`` demands a box or ``####``.
      verify_timeout_s: math-verify's parse and verify timeouts (main thread only).
      test_fraction: held-out share when one file (or the generator) is split.
      seed: seeds the synthetic generator.
      prompt: how problem text becomes the model's prompt (template or chat).
    """

    train_path: str | None = None
    test_path: str | None = None
    fields: FieldMapping = FieldMapping()
    on_error: OnError = "raise"
    answer_fallback: AnswerFallback = "none"
    verify_timeout_s: int | None = 5
    test_fraction: float = 0.1
    seed: int = 0
    prompt: PromptConfig = PromptConfig(template="{prompt}\nPut the final answer in \\boxed{}.")

    def __post_init__(self):
        check_choice("on_error", self.on_error, OnError)
        check_choice("answer_fallback", self.answer_fallback, AnswerFallback)
        check_range("test_fraction", self.test_fraction, 0.0, 1.0)
        if self.verify_timeout_s is not None:
            check_int(
                "verify_timeout_s",
                self.verify_timeout_s,
                minimum=1,
                allowed="an integer >= 1 (seconds) or null",
            )
        check_int("seed", self.seed)
        if self.test_path is not None and self.train_path is None:
            raise ValueError("test_path needs a train_path as well")


@register_task("math", MathConfig)
class MathTask:
    """Final-answer math judged by math-verify.

    math-verify parses with sympy, which can take seconds (or hang) on adversarial input,
    so scoring runs in the reward runner's process pool (``reward_execution = "pool"``),
    where a per-item timeout kills a stuck worker.
    """

    name = "math"
    reward_execution: RewardExecution = "pool"

    def __init__(self, config: MathConfig | None = None):
        self.config = config or MathConfig()
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
                n=200 if n is None else n,
                seed=c.seed,
                test_fraction=c.test_fraction,
                task_name=self.name,
            )
        if c.test_path is not None:
            path = c.train_path if split == "train" else c.test_path
            problems = self._load(path)
        else:
            loaded = self._load(c.train_path)
            problems = [p for p in loaded if split_of(p.id, c.test_fraction) == split]
            if split == "train":
                check_train_split(c.train_path, len(problems), len(loaded), c.test_fraction)
        return problems if n is None else problems[:n]

    def format_prompt(self, problem: Problem, chat: ChatTemplate | None = None) -> str:
        """The prompt string for ``problem``."""
        return format_prompt(problem, self.config.prompt, chat)

    def demonstration(self, problem: Problem) -> str:
        """A minimal ideal completion: the boxed reference answer."""
        return f"\\boxed{{{problem.answer}}}"

    def score(self, problem: Problem, completion: str) -> RewardResult:
        """1 when the extracted answer equals the reference according to math-verify."""
        predicted = extract_answer(completion, self.config.answer_fallback)
        if predicted is None:
            return RewardResult(0.0, None, NO_ANSWER)
        reference = extract_answer(str(problem.answer)) or str(problem.answer)
        if answers_match(reference, predicted, self.config.verify_timeout_s):
            return RewardResult(1.0, predicted)
        return RewardResult(0.0, predicted, WRONG_ANSWER)

    def warmup(self) -> None:
        """Imports math-verify and sympy once (the reward runner calls this in new workers,
        so the import does not count against the first item's timeout)."""
        answers_match("1", "1", self.config.verify_timeout_s)

    def _load(self, path: str) -> list[Problem]:
        c = self.config
        loaded = load_problems(path, c.fields, on_error=c.on_error, id_prefix=self.name)
        self.skipped_rows[path] = loaded.skipped_rows
        return loaded.problems


def _draw_synthetic(rng: random.Random) -> tuple[str, Problem] | None:
    kind = rng.choice(("fractions", "percent", "linear"))
    if kind == "fractions":
        a = Fraction(rng.randint(1, 9), rng.randint(2, 12))
        b = Fraction(rng.randint(1, 9), rng.randint(2, 12))
        op = rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        question = f"What is {a} {op} {b}? Give the answer as a fraction in lowest terms."
    elif kind == "percent":
        percent, base = rng.choice((5, 10, 15, 20, 25, 40, 50, 75)), rng.randint(1, 40) * 20
        value = Fraction(percent * base, 100)
        question = f"What is {percent}% of {base}?"
    else:
        x, slope, offset = rng.randint(-20, 20), rng.randint(2, 9), rng.randint(1, 50)
        question = f"Solve for x: {slope}x + {offset} = {slope * x + offset}."
        value = Fraction(x)
    answer = render(value)
    problem = Problem(
        id=stable_id("math", question),
        prompt=question,
        answer=answer,
        metadata={"kind": kind},
    )
    return question, problem
