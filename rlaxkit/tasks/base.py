"""The task contract: problems, reward results, prompt formatting and train/test splits.

A *problem* is one question with a stable id, a prompt (plain text or chat messages), a
reference answer and free-form metadata. A *task* produces problems for a split, turns a
problem into the prompt string a model sees, and scores a completion into a
``RewardResult`` whose ``score`` lies in ``[0, 1]``.

Splits of the built-in generators are decided by a hash of the problem's content, not by
the seed, so no seed's training stream ever contains a problem of any seed's test split.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol, get_args, runtime_checkable

from rlaxkit.rules.validation import is_number

Split = Literal["train", "test"]
RewardExecution = Literal["inline", "pool"]

# Failure reasons recorded in ``RewardResult.reason``: a small closed vocabulary so that
# runs can count them. ``None`` means the completion was judged (correct or not).
NO_ANSWER: Final = "no_answer"  # nothing parseable where the answer should be
WRONG_ANSWER: Final = "wrong_answer"  # parsed, but not equal to the reference
INVALID_EXPRESSION: Final = "invalid_expression"  # countdown: not a plain arithmetic expression
NUMBER_MISUSE: Final = "number_misuse"  # countdown: a number not given, or used twice
TESTS_FAILED: Final = "tests_failed"  # code: ran, but some test printed the wrong output
RUNTIME_ERROR: Final = "runtime_error"  # code: the program raised or exited non-zero
WALL_TIMEOUT: Final = "wall_timeout"  # code: ran past the wall-clock limit
CPU_TIME_LIMIT: Final = "cpu_time_limit"  # code: ran past the CPU-time limit
MEMORY_LIMIT: Final = "memory_limit"  # code: hit the address-space limit
OUTPUT_LIMIT: Final = "output_limit"  # code: printed more than the output cap
FORBIDDEN_OPERATION: Final = "forbidden_operation"  # code: tried to fork, exec or signal
REWARD_ERROR: Final = "reward_error"  # the reward function raised
REWARD_TIMEOUT: Final = "reward_timeout"  # the reward function ran past its timeout
REWARD_CRASHED: Final = "reward_crashed"  # the worker process running the reward died
INVALID_REWARD: Final = "invalid_reward"  # the reward returned NaN, a wrong type or out of range
# The reasons that mean the reward itself failed (not the completion): a run counts them.
REWARD_FAILURES: Final = (REWARD_ERROR, REWARD_TIMEOUT, REWARD_CRASHED, INVALID_REWARD)


@dataclass(frozen=True)
class Problem:
    """One question of a task.

    Attributes:
      id: stable identifier (same content, same id, across runs and machines).
      prompt: the question as plain text; ``None`` when only ``messages`` are given.
      answer: the reference answer (a number or string; test cases for code).
      messages: chat messages (``{"role", "content"}`` dicts) instead of ``prompt``.
      metadata: anything else (difficulty, source, time, a known solution, ...).
    """

    id: str
    prompt: str | None
    answer: Any
    messages: tuple[Mapping[str, str], ...] | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``datasets.load_problems`` reads it back with default fields."""
        return {
            "id": self.id,
            "prompt": self.prompt,
            "messages": None if self.messages is None else [dict(m) for m in self.messages],
            "answer": self.answer,
            "metadata": dict(self.metadata),
        }

    def text(self) -> str:
        """The prompt text, or the chat messages' contents joined (for dedup and hashing)."""
        if self.prompt is not None:
            return self.prompt
        return "\n".join(m["content"] for m in self.messages or ())


@dataclass(frozen=True)
class RewardResult:
    """The verdict on one completion.

    Attributes:
      score: reward in ``[0, 1]``; 1 means fully correct.
      parsed: the answer as read from the completion (``None`` when none was found).
      reason: ``None`` when the completion was judged, else one of the failure codes of
        this module (``WRONG_ANSWER``, ``REWARD_TIMEOUT``, ...).
      detail: free text for humans (an exception message, the failing test).
    """

    score: float
    parsed: str | None = None
    reason: str | None = None
    detail: str | None = None

    @property
    def correct(self) -> bool:
        """Whether the completion earned the full reward (what pass@k counts)."""
        return self.score >= 1.0


@dataclass(frozen=True)
class SkippedRow:
    """A dataset row ``on_error="skip"`` left out (``rlaxkit.tasks.datasets``): its file,
    row (1-based), field and why. A task names them in ``Task.skipped_rows``."""

    file: str
    row: int
    field: str
    reason: str


@runtime_checkable
class ChatTemplate(Protocol):
    """Anything that renders chat messages to a prompt string (tokenizers do)."""

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Renders ``messages`` as one prompt string."""
        ...


@runtime_checkable
class Task(Protocol):
    """What the rollout workers, curation and evaluation need of a task."""

    name: str
    reward_execution: RewardExecution  # "inline" for cheap pure rewards, else "pool"
    # Dataset file -> the rows skipped as malformed when it was read (on_error=skip).
    skipped_rows: dict[str, tuple[SkippedRow, ...]]

    def problems(self, split: Split, n: int | None = None) -> list[Problem]:
        """The first ``n`` problems of ``split`` (all of them for finite datasets)."""
        ...

    def format_prompt(self, problem: Problem, chat: ChatTemplate | None = None) -> str:
        """The prompt string a model is given for ``problem``."""
        ...

    def score(self, problem: Problem, completion: str) -> RewardResult:
        """Judges ``completion`` against ``problem.answer``."""
        ...


@dataclass(frozen=True, kw_only=True)
class PromptConfig:
    """How a problem becomes a prompt string.

    Attributes:
      template: wraps the problem text; ``{prompt}`` is replaced by it (other braces are
        kept as written, so ``\\boxed{}`` needs no escaping).
      system: a system message, used only with a chat template.
    """

    template: str = "{prompt}"
    system: str | None = None

    def __post_init__(self):
        if "{prompt}" not in self.template:
            raise ValueError(f"template must contain '{{prompt}}', got {self.template!r}")


def format_prompt(problem: Problem, config: PromptConfig, chat: ChatTemplate | None = None) -> str:
    """Renders ``problem`` as a plain template, or through ``chat.apply_chat_template``.

    Without ``chat`` the result is ``config.template`` with the problem text filled in.
    With ``chat`` the messages are the problem's own (or one user message holding the
    templated text), preceded by ``config.system`` when set.
    """
    if chat is None:
        if problem.prompt is None:
            raise ValueError(
                f"problem {problem.id} has chat messages only; pass an object with "
                "apply_chat_template to format it"
            )
        return config.template.replace("{prompt}", problem.prompt)
    if problem.messages is not None:
        messages = [dict(m) for m in problem.messages]
    else:
        text = config.template.replace("{prompt}", problem.text())
        messages = [{"role": "user", "content": text}]
    if config.system is not None and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": config.system})
    return chat.apply_chat_template(messages, add_generation_prompt=True)


def demonstrations(
    task: Task, problems: Sequence[Problem], chat: ChatTemplate | None = None
) -> list[tuple[str, str]]:
    """``(prompt, ideal completion)`` pairs for a supervised warm start.

    The completion carries no end token: append the tokenizer's ``eos`` when encoding.
    Works for tasks with a ``demonstration(problem)`` method (all built-in tasks; code and
    countdown problems from user files need a known solution in their metadata).

    >>> from rlaxkit.tasks import make_task
    >>> task = make_task("arithmetic")
    >>> prompt, completion = demonstrations(task, task.problems("train", 1))[0]
    >>> task.score(task.problems("train", 1)[0], completion).score
    1.0
    """
    demonstrate = getattr(task, "demonstration", None)  # optional part of the protocol
    if demonstrate is None:
        raise TypeError(f"task {task.name!r} has no demonstration method")
    return [(task.format_prompt(p, chat), demonstrate(p)) for p in problems]


def stable_id(prefix: str, key: str) -> str:
    """``prefix-<12 hex digits>`` from a BLAKE2b hash of ``key`` (content-addressed ids)."""
    return f"{prefix}-{hashlib.blake2b(key.encode(), digest_size=6).hexdigest()}"


def split_of(key: str, test_fraction: float) -> Split:
    """The split a problem belongs to, from a hash of ``key``: uniform in [0, 1) < fraction."""
    digest = hashlib.blake2b(b"split:" + key.encode(), digest_size=8).digest()
    return "test" if int.from_bytes(digest, "big") / 2.0**64 < test_fraction else "train"


class SeededProblems:
    """``problems`` for a task whose problems come from a seeded stream of draws: its
    ``_draw(rng)`` (see :func:`generate_split`) and its config's ``seed`` and
    ``test_fraction``."""

    name: str
    config: Any

    def _draw(self, rng: random.Random) -> tuple[str, Problem] | None:
        raise NotImplementedError

    def problems(self, split: Split, n: int | None = None) -> list[Problem]:
        """The first ``n`` (default 1000) distinct problems of ``split``."""
        c = self.config
        return generate_split(
            self._draw,
            split=split,
            n=1000 if n is None else n,
            seed=c.seed,
            test_fraction=c.test_fraction,
            task_name=self.name,
        )


def generate_split(
    draw: Callable[[random.Random], tuple[str, Problem] | None],
    *,
    split: Split,
    n: int,
    seed: int,
    test_fraction: float,
    task_name: str,
) -> list[Problem]:
    """The first ``n`` distinct problems of ``split`` from a seeded stream of draws.

    ``draw(rng)`` returns ``(content_key, problem)`` or ``None`` to reject a draw. Draws
    whose key hashes to the other split are skipped, as are repeats, so the result for
    ``n`` is a prefix of the result for any larger ``n``.
    """
    check_choice("split", split, Split)
    rng = random.Random(f"{task_name}:{seed}:{split}")
    problems: list[Problem] = []
    seen: set[str] = set()
    # The space is taken as exhausted after this many draws in a row bring nothing new
    # (a small space, e.g. one-digit sums, answers in milliseconds instead of scanning).
    patience = 20_000
    since_new = 0
    while since_new < patience and len(problems) < n:
        since_new += 1
        drawn = draw(rng)
        if drawn is None:
            continue
        key, problem = drawn
        if key in seen:
            continue
        seen.add(key)
        if split_of(key, test_fraction) != split:
            continue
        problems.append(problem)
        since_new = 0
    if len(problems) == n:
        return problems
    raise ValueError(
        f"{task_name}: found only {len(problems)} distinct {split} problems ({patience} "
        f"draws in a row found no new one), asked for {n}; widen the generator settings "
        "or ask for fewer"
    )


def check_choice(name: str, value: object, choices: object) -> None:
    """Raises ``ValueError`` naming ``name`` unless ``value`` is one of a ``Literal``'s args."""
    allowed = get_args(choices)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def check_choices(name: str, values: Sequence[object], choices: object) -> None:
    """Like ``check_choice`` for every element of a non-empty tuple."""
    if not isinstance(values, tuple) or not values:
        raise ValueError(f"{name} must be a non-empty tuple, got {values!r}")
    for value in values:
        check_choice(name, value, choices)


def check_range(name: str, value: float, low: float, high: float) -> None:
    """Raises ``ValueError`` naming ``name`` unless ``value`` is a number (not a ``bool``)
    with ``low <= value <= high``."""
    if not is_number(value):
        raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value!r}")


def check_split_fraction(name: str, value: float) -> None:
    """``check_range(name, value, 0, 1)`` without the ends, for a generator's split: its
    problems are split by a hash of their content, so 0 leaves the test split empty
    and 1 the train split."""
    check_range(name, value, 0.0, 1.0)
    if value in (0.0, 1.0):
        empty = "train" if value == 1.0 else "test"
        raise ValueError(
            f"{name} must be strictly between 0 and 1, got {value!r}: the {empty} split "
            "would hold no problem"
        )


def cut_at_stop(completion: str, stop: str | None) -> str:
    """The completion up to (not including) the first ``stop`` string, stripped."""
    if stop:
        completion = completion.split(stop, 1)[0]
    return completion.strip()
