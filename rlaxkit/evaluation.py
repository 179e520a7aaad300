"""Held-out evaluation: unbiased pass@k, mean@k and maj@k from ``n`` samples per problem.

pass@k follows Chen et al. 2021 ("Evaluating Large Language Models Trained on Code"):
with ``n`` samples of which ``c`` are correct, the chance that at least one of ``k``
samples drawn without replacement is correct is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i),

the product form avoiding huge binomials. Averaged over problems it is an unbiased
estimate of the policy's pass@k, with far less variance than drawing only ``k`` samples.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlaxkit.tasks import ChatTemplate, Problem, RewardRunner, Split, Task, TextPolicy
from rlaxkit.tasks.policy import sample_and_score


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``c`` correct of ``n`` samples (Chen et al. 2021, product form).

    >>> pass_at_k(n=4, c=1, k=2)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    0.5
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_at_k(scores: Sequence[float], k: int) -> float:
    """Expected mean score of ``k`` samples drawn without replacement from ``scores``.

    Every sample is equally likely to be drawn, so this is the mean of all ``n`` scores
    for any ``k <= n``; ``k`` is checked, not used.
    """
    if not 1 <= k <= len(scores):
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={len(scores)}")
    return sum(scores) / len(scores)


def maj_at_k(
    answers: Sequence[str | None],
    correct: Sequence[bool],
    k: int,
    *,
    max_subsets: int = 10_000,
    seed: int = 0,
) -> float:
    """Chance that the majority answer of ``k`` of the ``n`` samples is correct.

    A vote counts the parsed answers (``None`` abstains); ties go to the answer sampled
    first. The expectation is exact over all ``C(n, k)`` subsets when there are at most
    ``max_subsets`` of them, else a mean over ``max_subsets`` seeded random subsets.
    """
    n = len(answers)
    if len(correct) != n or not 1 <= k <= n:
        raise ValueError(f"need equal lengths and 1 <= k <= n, got k={k}, n={n}")
    answer_correct: dict[str, bool] = {}
    for answer, ok in zip(answers, correct, strict=True):
        if answer is not None:
            answer_correct.setdefault(answer, bool(ok))

    def vote(subset: Sequence[int]) -> bool:
        votes = Counter(answers[i] for i in subset if answers[i] is not None)
        if not votes:
            return False
        top = max(votes.values())
        sampled = [answers[i] for i in subset]
        winner = next(a for a in sampled if a is not None and votes[a] == top)
        return answer_correct[winner]

    if math.comb(n, k) <= max_subsets:
        subsets: Any = itertools.combinations(range(n), k)
        total = math.comb(n, k)
    else:
        rng = random.Random(seed)
        subsets = (sorted(rng.sample(range(n), k)) for _ in range(max_subsets))
        total = max_subsets
    return sum(vote(s) for s in subsets) / total


@dataclass(frozen=True)
class EvalReport:
    """Evaluation results.

    Attributes:
      task: the task's name.
      num_problems: problems evaluated.
      samples: ``n``, samples per problem.
      rows: one dict per ``k``: ``{"k", "pass@k", "maj@k", "mean@k"}``, averaged over
        problems; ``maj@k`` is NaN for tasks whose rewards parse no answer (code).
      per_problem: one dict per problem: ``{"id", "correct", "mean_score"}``.
      reasons: how often each failure reason occurred.
    """

    task: str
    num_problems: int
    samples: int
    rows: list[dict[str, float]]
    per_problem: list[dict[str, Any]] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)

    def table(self) -> str:
        """The rows as an aligned text table with a one-line header."""
        lines = [f"{self.task}: {self.num_problems} problems, {self.samples} samples each"]
        lines.append(f"{'k':>4}  {'pass@k':>7}  {'maj@k':>7}  {'mean@k':>7}")
        for row in self.rows:
            lines.append(
                f"{row['k']:>4}  {row['pass@k']:>7.3f}  {row['maj@k']:>7.3f}  {row['mean@k']:>7.3f}"
            )
        if self.reasons:
            lines.append(
                "failures: " + ", ".join(f"{k}={v}" for k, v in sorted(self.reasons.items()))
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def evaluate_policy(
    task: Task,
    generate: TextPolicy,
    *,
    problems: Sequence[Problem] | None = None,
    split: Split = "test",
    num_problems: int | None = None,
    n: int = 8,
    ks: Sequence[int] = (1, 8),
    seed: int = 0,
    runner: RewardRunner | None = None,
    chat: ChatTemplate | None = None,
) -> EvalReport:
    """Samples ``n`` completions per problem and reports pass@k, maj@k, mean@k.

    Args:
      task: supplies prompts, problems (when ``problems`` is ``None``) and rewards.
      generate: the policy, ``generate(prompts, n, seed) -> completions``.
      problems: the problems to evaluate; default ``task.problems(split, num_problems)``.
      split: which split to draw from when ``problems`` is ``None``.
      num_problems: how many problems to draw when ``problems`` is ``None``.
      n: samples per problem.
      ks: the ``k`` values reported; each must be ``<= n``.
      seed: passed to ``generate``.
      runner: scores completions (default: one for the task).
      chat: renders prompts through a chat template when given.
    """
    ks = sorted(set(ks))
    if not ks or ks[0] < 1 or ks[-1] > n:
        raise ValueError(f"ks must be in [1, n={n}], got {list(ks)}")
    if problems is None:
        problems = task.problems(split, num_problems)
    _, results = sample_and_score(
        task, problems, generate, n=n, seed=seed, runner=runner, chat=chat
    )
    # Tasks whose rewards parse no answer (code) have nothing to vote on: maj@k is NaN.
    has_answers = any(r.parsed is not None for group in results for r in group)
    rows = []
    for k in ks:
        per_k = [
            (
                pass_at_k(n, sum(r.correct for r in group), k),
                maj_at_k(
                    [_vote_key(r.parsed) for r in group], [r.correct for r in group], k, seed=seed
                )
                if has_answers
                else math.nan,
                mean_at_k([r.score for r in group], k),
            )
            for group in results
        ]
        count = max(len(per_k), 1)
        rows.append(
            {
                "k": k,
                "pass@k": sum(x[0] for x in per_k) / count,
                "maj@k": sum(x[1] for x in per_k) / count,
                "mean@k": sum(x[2] for x in per_k) / count,
            }
        )
    per_problem = [
        {
            "id": p.id,
            "correct": sum(r.correct for r in group),
            "mean_score": sum(r.score for r in group) / n,
        }
        for p, group in zip(problems, results, strict=True)
    ]
    reasons = Counter(r.reason for group in results for r in group if r.reason is not None)
    return EvalReport(task.name, len(problems), n, rows, per_problem, dict(reasons))


def _vote_key(parsed: str | None) -> str | None:
    """Votes are grouped by the parsed answer with whitespace removed."""
    return None if parsed is None else "".join(parsed.split())
