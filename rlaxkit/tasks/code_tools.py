"""Code with test feedback: the model writes a program, the sandbox runs it on the
problem's tests, the failing tests come back as the observation, and the model may try
again, up to ``max_attempts`` turns (``rlaxkit.tasks.episodes``).

Every policy turn is one attempt: the program is read from it as the code task reads a
completion (``extract_code``: the last fenced block, else the whole turn), and each test
case runs in ``sandbox.run_python`` under the code task's limits. A turn ends at the
model's end token, so the environment has no tool stop. When every test passes, or at
the last attempt, the episode ends and its reward is **that final attempt's** score: 1
or 0, or the share of tests passed with ``code.partial_credit`` (earlier attempts earn
nothing, so a pass on the second try counts as much as one on the first). Otherwise the
observation lists up to ``max_failures_shown`` failing tests, each with its name, input,
expected and actual output (or the sandbox status: ``runtime_error``, ``wall_timeout``,
...) cut to ``max_field_chars``; a program that crashed or ran past a limit is such a
failure, counted in the step's ``info["sandbox_errors"]``. A step that raises (the
sandbox could not start) or runs past ``EpisodeConfig.step_timeout_s`` becomes
``error_observation``, counted by ``Episode.failures``.

>>> task = CodeToolsTask(CodeToolsConfig(max_attempts=2))
>>> problem = task.problems("train", 1)[0]
>>> environment = CodeToolsEnvironment(task)
>>> environment.reset(problem) == task.format_prompt(problem)
True
>>> first = environment.step(Action("```python\\nprint(0)\\n```", (), "stop"))
>>> first.done, first.reward, first.observation.splitlines()[0]
(False, 0.0, 'Tests failed: 0 of 3 passed.')
>>> environment.step(Action(task.demonstration(problem), (), "stop")).reward
1.0
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from rlaxkit.rules.validation import check_int
from rlaxkit.tasks.base import (
    NO_ANSWER,
    TESTS_FAILED,
    WALL_TIMEOUT,
    ChatTemplate,
    Problem,
    RewardExecution,
    RewardResult,
    Split,
)
from rlaxkit.tasks.code import (
    CodeConfig,
    CodeTask,
    check_test_cases,
    extract_code,
    outputs_match,
)
from rlaxkit.tasks.episodes import Action, Episode, StepOutcome, StepResult
from rlaxkit.tasks.registry import register_task
from rlaxkit.tasks.sandbox import run_python

__all__ = [
    "CodeToolsConfig",
    "CodeToolsEnvironment",
    "CodeToolsTask",
    "AttemptReport",
    "code_tool_metrics",
]

NO_PROGRAM_TEXT: Final = (
    "No program found. Answer with one Python program in a ```python code block.\n"
)


@dataclass(frozen=True, kw_only=True)
class CodeToolsConfig:
    """Settings of the code task with test feedback.

    Attributes:
      code: the code task's settings: problems, sandbox limits, ``max_total_s`` per
        attempt, ``partial_credit``, prompt. An attempt takes up to about
        ``max_total_s + limits.wall_time_s``: keep ``EpisodeConfig.step_timeout_s``
        above that, or slow attempts become timeout observations.
      max_attempts: programs the model may write per episode (turns), at least 1; set
        ``EpisodeConfig.max_turns`` to at least this, since an episode cut before its
        last attempt earns nothing.
      max_failures_shown: failing tests listed in an observation, at least 1.
      max_field_chars: longest test name, input, expected or actual output (as Python
        literals, one line) or error message shown; longer ones are cut and end in
        ``...``; at least 8.
    """

    code: CodeConfig = CodeConfig()
    max_attempts: int = 3
    max_failures_shown: int = 2
    max_field_chars: int = 80

    def __post_init__(self) -> None:
        check_int("max_attempts", self.max_attempts, minimum=1)
        check_int("max_failures_shown", self.max_failures_shown, minimum=1)
        check_int("max_field_chars", self.max_field_chars, minimum=8)


@dataclass(frozen=True)
class AttemptReport:
    """One attempt's run over the tests: ``passed`` of ``total``, the failures in order
    (``name``, ``status``, ``input``, ``expected``, ``got``), and how many runs the
    sandbox stopped (crash or limit: ``sandbox_errors``)."""

    passed: int
    total: int
    failures: tuple[dict[str, str], ...]
    sandbox_errors: int

    @property
    def all_passed(self) -> bool:
        return self.passed == self.total


@register_task("code_tools", CodeToolsConfig)
class CodeToolsTask:
    """The code task's problems, scored over several attempts with test feedback.

    ``score`` reads a single completion or a whole transcript like the code task (the
    last fenced block is the final attempt); ``CodeToolsEnvironment`` runs the episodes.
    """

    name = "code_tools"
    reward_execution: RewardExecution = "pool"

    def __init__(self, config: CodeToolsConfig | None = None):
        self.config = config or CodeToolsConfig()
        self.code = CodeTask(self.config.code)
        self.skipped_rows = self.code.skipped_rows  # the same dict, filled by problems()

    def problems(self, split: Split, n: int | None = None) -> list[Problem]:
        """The code task's problems of ``split``."""
        return self.code.problems(split, n)

    def make_environment(self) -> CodeToolsEnvironment:
        """A fresh environment for one episode (``rlaxkit.tasks.episodes.EpisodicTask``)."""
        return CodeToolsEnvironment(self)

    def format_prompt(self, problem: Problem, chat: ChatTemplate | None = None) -> str:
        """The code task's prompt."""
        return self.code.format_prompt(problem, chat)

    def demonstration(self, problem: Problem) -> str:
        """A reference solution in a fenced block (one attempt that passes)."""
        return self.code.demonstration(problem)

    def score(self, problem: Problem, completion: str) -> RewardResult:
        """Judges the last program of ``completion`` on every test."""
        program = extract_code(completion)
        if program is None:
            return RewardResult(0.0, None, NO_ANSWER)
        report = self.run_tests(problem, program)
        return RewardResult(self.reward(report), None, _reason(report), _detail(report))

    def run_tests(self, problem: Problem, program: str) -> AttemptReport:
        """Runs ``program`` on each test case of ``problem`` in the sandbox, all of them
        (the feedback lists several failures) until ``code.max_total_s`` has passed."""
        c = self.config.code
        cases = check_test_cases(problem.id, problem.answer)
        deadline = time.monotonic() + c.max_total_s
        passed, sandbox_errors, failures = 0, 0, []
        for i, case in enumerate(cases):
            name = str(case.get("name", f"test {i}"))
            if time.monotonic() > deadline:
                failures.append(_failure(name, WALL_TIMEOUT, case, "(not run: out of time)"))
                continue
            result = run_python(program, case["input"], c.limits)
            if result.status == "ok" and outputs_match(case["output"], result.stdout):
                passed += 1
                continue
            if result.status == "ok":
                failures.append(_failure(name, TESTS_FAILED, case, result.stdout))
            else:
                sandbox_errors += 1
                tail = result.stderr.strip().splitlines()[-1:] or [""]
                failures.append(_failure(name, result.status, case, tail[0]))
        return AttemptReport(passed, len(cases), tuple(failures), sandbox_errors)

    def reward(self, report: AttemptReport) -> float:
        """1 or 0, or the share of tests passed with ``code.partial_credit``."""
        if self.config.code.partial_credit:
            return report.passed / report.total
        return float(report.all_passed)

    def feedback(self, report: AttemptReport) -> str:
        """The observation after a failed attempt: the count, then one line per shown
        failure, every field cut to ``max_field_chars``."""
        c = self.config
        lines = [f"Tests failed: {report.passed} of {report.total} passed."]
        for failure in report.failures[: c.max_failures_shown]:
            name = _cut(failure["name"], c.max_field_chars)
            given, expected, got = (
                _cut(repr(failure[key]), c.max_field_chars) for key in ("input", "expected", "got")
            )
            if failure["status"] == TESTS_FAILED:
                lines.append(f"{name}: input {given} expected {expected} got {got}")
            else:  # ``got`` is the program's last line of stderr, shown as it is
                message = _cut(failure["got"], c.max_field_chars)
                lines.append(f"{name}: input {given} {failure['status']}: {message}")
        hidden = len(report.failures) - c.max_failures_shown
        if hidden > 0:
            lines.append(f"({hidden} more failing)")
        lines.append("Try again.")
        return "\n".join(lines) + "\n"


class CodeToolsEnvironment:
    """One episode of code with test feedback (``rlaxkit.tasks.episodes.Environment``).

    Each ``step`` is an attempt: it is numbered when it starts (so a step cut by the
    episode's timeout still uses up its attempt) and ends the episode when all tests
    pass or it is the ``max_attempts``-th. ``info`` holds the attempt's ``attempt``,
    ``passed``, ``total``, ``score``, ``sandbox_errors`` and, on the last step,
    ``final`` and ``correct``.
    """

    tool_stops: tuple[str, ...] = ()  # an attempt ends at the end token

    def __init__(self, task: CodeToolsTask):
        self.task = task
        self.problem: Problem | None = None
        self.attempts = 0
        self._lock = threading.Lock()  # a timed-out step may still run beside the next

    def reset(self, problem: Problem) -> str:
        """Starts on ``problem``; returns its prompt."""
        self.problem, self.attempts = problem, 0
        return self.task.format_prompt(problem)

    def step(self, action: Action) -> StepResult:
        """Runs the turn's program on the tests; the failures are the observation."""
        if self.problem is None:
            raise RuntimeError("step before reset")
        with self._lock:
            self.attempts += 1
            attempt = self.attempts
        last = attempt >= self.task.config.max_attempts
        info: dict[str, Any] = {"tool": "tests", "attempt": attempt}
        program = extract_code(action.text)
        if program is None:
            total = len(check_test_cases(self.problem.id, self.problem.answer))
            report = AttemptReport(0, total, (), 0)
            observation = NO_PROGRAM_TEXT
        else:
            report = self.task.run_tests(self.problem, program)
            observation = self.task.feedback(report)
        score = self.task.reward(report)
        info |= {
            "program": program is not None,
            "passed": report.passed,
            "total": report.total,
            "score": score,
            "sandbox_errors": report.sandbox_errors,
        }
        if report.all_passed or last:
            info |= {"final": True, "correct": report.all_passed}
            return StepResult(reward=score, done=True, info=info)
        return StepResult(observation=observation, info=info)

    def error_observation(self, outcome: StepOutcome, detail: str) -> str:
        """The tests could not run (``"error"``: the sandbox failed to start) or took
        too long (``"timeout"``); the detail stays in the step's ``info``."""
        what = "took too long" if outcome == "timeout" else "could not run"
        return f"The tests {what}. Try again.\n"


def _failure(name: str, status: str, case: dict[str, str], got: str) -> dict[str, str]:
    return {
        "name": name,
        "status": status,
        "input": case["input"],
        "expected": case["output"],
        "got": got,
    }


def _cut(text: str, limit: int) -> str:
    """The first line of ``text`` cut to ``limit`` characters (ending in ``...``), with
    no code fence, so the transcript's last fenced block stays the model's."""
    shown = (text.splitlines() or [""])[0].replace("`" * 3, "'" * 3)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def _reason(report: AttemptReport) -> str | None:
    if report.all_passed:
        return None
    return report.failures[0]["status"] if report.failures else TESTS_FAILED


def _detail(report: AttemptReport) -> str | None:
    if report.all_passed:
        return None
    return f"{report.passed} of {report.total} tests passed"


def code_tool_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Shares over ``episodes``: ``pass_rate`` (final attempt passed every test),
    ``fixed_after_feedback_rate`` (passed on a later attempt after failing one),
    ``sandbox_error_rate`` (test runs the sandbox stopped, per test run),
    ``step_failure_rate`` (steps that raised or timed out, per step); and
    ``attempts_per_episode``."""
    count = max(len(episodes), 1)
    steps = [s for e in episodes for s in e.steps]
    runs = sum(int(s.info.get("total", 0)) for s in steps if s.info.get("program"))
    stopped = sum(int(s.info.get("sandbox_errors", 0)) for s in steps)
    failed = sum(e.failures("error") + e.failures("timeout") for e in episodes)

    def fixed(episode: Episode) -> bool:
        last = episode.steps[-1].info if episode.steps else {}
        return bool(last.get("correct")) and int(last.get("attempt", 1)) > 1

    return {
        "pass_rate": sum(bool(e.steps and e.steps[-1].info.get("correct")) for e in episodes)
        / count,
        "fixed_after_feedback_rate": sum(map(fixed, episodes)) / count,
        "sandbox_error_rate": stopped / max(runs, 1),
        "step_failure_rate": failed / max(len(steps), 1),
        "attempts_per_episode": len(steps) / count,
    }
