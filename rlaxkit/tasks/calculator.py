"""Arithmetic a tool makes learnable: products too long for a tiny model to work out,
and a calculator it may call in the middle of its answer.

A problem is ``"417*38="``. The model may write ``<calc>417*38</calc>``; generation
stops there, the calculator answers ``=15846`` and a newline, and the model goes on
(``rlaxkit.tasks.episodes``). Its last turn is the answer, read like the arithmetic task's.
The calculator evaluates with ``ast`` (``calculate``), never ``eval``: numbers,
``+ - * / // %``, parentheses and unary minus, every value bounded; anything else gives
an error observation (``=error: ...``), which the model sees and may learn from.
With ``tool=False`` the same model and format run without the tool: its demonstration
is the answer alone and every call is answered ``=error: no calculator``.

>>> task = CalculatorTask(CalculatorConfig(seed=0))
>>> problem = task.problems("train", 1)[0]
>>> environment = CalculatorEnvironment(task)
>>> environment.reset(problem) == problem.prompt
True
>>> first, answer = task.demonstration_turns(problem)
>>> result = environment.step(Action(first, (), "stop"))
>>> result.observation == f"={problem.answer}\\n", result.done
(True, False)
>>> environment.step(Action(answer, (), "stop")).reward
1.0
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from rlaxkit.rules.validation import check_int
from rlaxkit.tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from rlaxkit.tasks.base import (
    ChatTemplate,
    Problem,
    PromptConfig,
    RewardExecution,
    RewardResult,
    SeededProblems,
    SkippedRow,
    check_split_fraction,
    format_prompt,
    stable_id,
)
from rlaxkit.tasks.episodes import Action, Episode, StepOutcome, StepResult
from rlaxkit.tasks.registry import register_task

MAX_CALC_CHARS: Final = 64  # longer expressions are refused before parsing
MAX_CALC_VALUE: Final = 10**18  # any literal or intermediate value beyond ± this is refused

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_DIVISIONS = (ast.Div, ast.FloorDiv, ast.Mod)


class CalcError(ValueError):
    """The calculator refuses the expression; the message is shown to the model."""


def calculate(text: str) -> int | float:
    """The value of an arithmetic expression, as Python computes it.

    >>> calculate("17*23"), calculate("-(7 // 2) % 5"), calculate("1/4")
    (391, 2, 0.25)
    >>> calculate("__import__('os')")
    Traceback (most recent call last):
    ...
    rlaxkit.tasks.calculator.CalcError: only numbers and + - * / // % are allowed

    Raises:
        CalcError: for text longer than ``MAX_CALC_CHARS``, anything but int or float
            literals, ``+ - * / // %``, parentheses and unary minus (no names, calls,
            attributes or ``**``), division by zero, and any value beyond
            ``MAX_CALC_VALUE`` in magnitude.
    """
    if len(text) > MAX_CALC_CHARS:
        raise CalcError(f"longer than {MAX_CALC_CHARS} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalcError("not an expression") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int | float:
    value = node.value if isinstance(node, ast.Constant) else None
    if isinstance(value, int | float) and not isinstance(value, bool):  # no True, no 1j
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, _DIVISIONS) and right == 0:
            raise CalcError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    raise CalcError("only numbers and + - * / // % are allowed")


def _bounded(value: int | float) -> int | float:
    # Floats are bounded too, so no inf or nan can arise (|a op b| <= MAX² stays finite).
    if not abs(value) <= MAX_CALC_VALUE:
        raise CalcError("number too large")
    return value


def render(value: int | float) -> str:
    """``"391"``; a float as an integer when it is one, else to 6 significant digits."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6g}"


@dataclass(frozen=True, kw_only=True)
class CalculatorConfig:
    """Settings of the calculator task.

    Attributes:
      first_digits: digits of the first factor (3: 100-999).
      second_digits: digits of the second factor (2: 10-99).
      call_open, call_close: the tags around a tool call; generation stops after
        ``call_close``.
      tool: whether the calculator answers calls; without it (the no-tool baseline of
        the same model) a call gets ``=error: no calculator`` and the demonstration is
        the answer alone.
      test_fraction: share of all problems in the test split.
      seed: seeds the stream of drawn problems.
      prompt: how problem text becomes the model's prompt.
    """

    first_digits: int = 3
    second_digits: int = 2
    call_open: str = "<calc>"
    call_close: str = "</calc>"
    tool: bool = True
    test_fraction: float = 0.1
    seed: int = 0
    prompt: PromptConfig = PromptConfig()

    def __post_init__(self) -> None:
        check_int("first_digits", self.first_digits, minimum=1, maximum=9)
        check_int("second_digits", self.second_digits, minimum=1, maximum=9)
        check_int("seed", self.seed)
        check_split_fraction("test_fraction", self.test_fraction)
        if not isinstance(self.tool, bool):
            raise ValueError(f"tool: must be true or false, got {self.tool!r}")
        if not self.call_open or not self.call_close or self.call_open == self.call_close:
            raise ValueError(
                f"call_open and call_close: must be distinct non-empty strings, got "
                f"{self.call_open!r} and {self.call_close!r}"
            )


@register_task("calculator", CalculatorConfig)
class CalculatorTask(SeededProblems):
    """``a*b=`` with a calculator tool; reward 1 for the right integer in the last turn.

    ``score`` reads a whole single-turn completion or transcript: the answer is what
    follows the last calculator observation, read up to a newline.
    """

    name = "calculator"
    reward_execution: RewardExecution = "inline"
    skipped_rows: dict[str, tuple[SkippedRow, ...]] = {}  # generated: no file, no row to skip

    def __init__(self, config: CalculatorConfig | None = None):
        self.config = config or CalculatorConfig()
        digits = self.config.first_digits + self.config.second_digits
        self._answers = ArithmeticTask(ArithmeticConfig(max_digits=digits, stop="\n"))
        close = re.escape(self.config.call_close)
        self._observation = re.compile(close + r"=[^\n]*\n")

    def make_environment(self) -> CalculatorEnvironment:
        """A fresh environment for one episode (``rlaxkit.tasks.episodes.EpisodicTask``)."""
        return CalculatorEnvironment(self)

    def format_prompt(self, problem: Problem, chat: ChatTemplate | None = None) -> str:
        """The prompt string (by default just ``"417*38="``)."""
        return format_prompt(problem, self.config.prompt, chat)

    def demonstration_turns(self, problem: Problem) -> tuple[str, str]:
        """The ideal two turns: the tool call, then the answer (no end token)."""
        c = self.config
        return f"{c.call_open}{problem.metadata['expression']}{c.call_close}", str(problem.answer)

    def demonstration(self, problem: Problem) -> str:
        """The ideal transcript for a supervised start: call, observation, answer; the
        answer alone without the tool."""
        call, answer = self.demonstration_turns(problem)
        if not self.config.tool:
            return answer
        return call + observation_text(render(int(problem.answer))) + answer

    def score(self, problem: Problem, completion: str) -> RewardResult:
        """Judges the text after the last calculator observation like ``arithmetic``."""
        *_, answer = self._observation.split(completion)
        return self.score_answer(problem, answer)

    def score_answer(self, problem: Problem, answer: str) -> RewardResult:
        """Judges a final turn: the integer up to the first newline."""
        return self._answers.score(problem, answer)

    def episode_metrics(self, episodes: Sequence[Episode]) -> dict[str, float]:
        """``tool_use_metrics`` (``rlaxkit.evaluation.EpisodeMetricsTask``)."""
        return tool_use_metrics(episodes)

    def alphabet(self) -> str:
        """Every character of a prompt, a tool call or an observation (char tokenizers)."""
        c = self.config
        chars = set("0123456789+-*/%()=.e\n") | set(c.call_open + c.call_close)
        chars |= set(c.prompt.template.replace("{prompt}", ""))
        chars |= set("".join(_ERROR_TEXTS))
        return "".join(sorted(chars))

    def _draw(self, rng: random.Random) -> tuple[str, Problem] | None:
        c = self.config
        a = rng.randint(10 ** (c.first_digits - 1), 10**c.first_digits - 1)
        b = rng.randint(10 ** (c.second_digits - 1), 10**c.second_digits - 1)
        expression = f"{a}*{b}"
        problem = Problem(
            id=stable_id(self.name, expression),
            prompt=f"{expression}=",
            answer=a * b,
            metadata={"expression": expression},
        )
        return expression, problem


def observation_text(result: str) -> str:
    """What the calculator shows after a call: ``=`` the result, then a newline."""
    return f"={result}\n"


# Every message an error observation may carry (``alphabet`` covers their characters).
_ERROR_TEXTS: Final = (
    "error: not an expression",
    "error: only numbers and + - * / // % are allowed",
    "error: division by zero",
    "error: number too large",
    f"error: longer than {MAX_CALC_CHARS} characters",
    "error: no call",
    "error: no calculator",
    "error: tool timed out",
    "error: tool failed",
)


class CalculatorEnvironment:
    """One calculator episode (``rlaxkit.tasks.episodes.Environment``).

    A turn that ends with ``call_close`` is a tool call: the expression after the last
    ``call_open`` is calculated and ``=value`` (or ``=error: ...``; without the tool,
    always ``=error: no calculator``) comes back. Any other turn is the final answer,
    scored with ``CalculatorTask.score_answer``.
    """

    def __init__(self, task: CalculatorTask):
        self.task = task
        self.tool_stops = (task.config.call_close,)
        self.problem: Problem | None = None

    def reset(self, problem: Problem) -> str:
        """Starts on ``problem``; returns its prompt."""
        self.problem = problem
        return self.task.format_prompt(problem)

    def step(self, action: Action) -> StepResult:
        """Answers a tool call, or scores a final answer and ends the episode."""
        if self.problem is None:
            raise RuntimeError("step before reset")
        c = self.task.config
        if not action.text.endswith(c.call_close):
            result = self.task.score_answer(self.problem, action.text)
            verdict = {
                "final": True,
                "correct": result.correct,
                "parsed": result.parsed,
                "reason": result.reason,
            }
            return StepResult(reward=result.score, done=True, info=verdict)
        body = action.text[: -len(c.call_close)]
        info: dict[str, Any] = {"tool": "calc", "ok": False}
        if not c.tool:
            return StepResult(observation_text("error: no calculator"), info=info)
        if c.call_open not in body:
            return StepResult(observation_text("error: no call"), info=info)
        expression = body.rsplit(c.call_open, 1)[1]
        info["expression"] = expression
        try:
            value = calculate(expression)
        except CalcError as error:
            return StepResult(observation_text(f"error: {error}"), info=info)
        info |= {"ok": True, "value": value}
        return StepResult(observation_text(render(value)), info=info)

    def error_observation(self, outcome: StepOutcome, detail: str) -> str:
        """``=error: tool timed out`` or ``=error: tool failed`` (no detail: the model
        reads only the calculator's own vocabulary)."""
        return observation_text(
            "error: tool timed out" if outcome == "timeout" else "error: tool failed"
        )


def tool_calls(episode: Episode) -> list[dict[str, Any]]:
    """The ``info`` of every calculator call the episode made, in order."""
    return [dict(s.info) for s in episode.steps if s.info.get("tool") == "calc"]


def called_tool_correctly(episode: Episode) -> bool:
    """Whether the episode asked the calculator for the problem's own product (and got
    its value back): the tool use the task rewards learning."""
    expected = int(episode.problem.answer)
    return any(call.get("ok") and call.get("value") == expected for call in tool_calls(episode))


def tool_use_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Shares over ``episodes``: ``tool_use_rate`` (called the tool correctly),
    ``tool_call_rate`` (called it at all), ``tool_error_rate`` (calls refused, raised or
    timed out, per call), ``pass_rate`` (final answer right); and ``calls_per_episode``."""
    count = max(len(episodes), 1)
    calls = sum(len(tool_calls(e)) for e in episodes)
    refused = sum(1 for e in episodes for call in tool_calls(e) if not call.get("ok"))
    failed = sum(e.failures("error") + e.failures("timeout") for e in episodes)
    return {
        "tool_use_rate": sum(map(called_tool_correctly, episodes)) / count,
        "tool_call_rate": sum(bool(tool_calls(e)) for e in episodes) / count,
        "tool_error_rate": (refused + failed) / max(calls + failed, 1),
        "pass_rate": sum(e.reward >= 1.0 for e in episodes) / count,
        "calls_per_episode": calls / count,
    }
