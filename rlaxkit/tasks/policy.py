"""The text-level policy contract used by curation and evaluation, and one sampling pass.

A policy here is any ``generate(prompts, n, seed) -> completions`` callable returning
``n`` completions per prompt; the JAX sampler is adapted to it, and tests use small
deterministic policies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from rlaxkit.tasks.base import ChatTemplate, Problem, RewardResult, Task
from rlaxkit.tasks.runner import RewardRunner


class TextPolicy(Protocol):
    """Samples ``n`` completions for each prompt, deterministically for a given seed."""

    def __call__(self, prompts: list[str], n: int, seed: int, /) -> list[list[str]]:
        """Returns ``completions[i][j]``: sample ``j`` for ``prompts[i]``."""
        ...


def sample_and_score(
    task: Task,
    problems: Sequence[Problem],
    generate: TextPolicy,
    *,
    n: int,
    seed: int,
    runner: RewardRunner | None = None,
    chat: ChatTemplate | None = None,
) -> tuple[list[list[str]], list[list[RewardResult]]]:
    """Samples ``n`` completions per problem and scores them.

    Args:
      task: formats the prompts and supplies the reward.
      problems: the problems to sample.
      generate: the policy.
      n: completions per problem.
      seed: passed to ``generate``.
      runner: scores the completions; ``None`` makes one for the task (and closes it).
      chat: renders prompts through a chat template when given.

    Returns:
      ``(completions, results)``, both indexed ``[problem][sample]``.

    Raises:
      ValueError: when ``generate`` returns the wrong number of completions.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    prompts = [task.format_prompt(p, chat) for p in problems]
    completions = generate(prompts, n, seed) if prompts else []
    if len(completions) != len(prompts) or any(len(c) != n for c in completions):
        raise ValueError(
            f"generate returned {[len(c) for c in completions]} completions for "
            f"{len(prompts)} prompts; expected {n} each"
        )
    flat_problems = [p for p in problems for _ in range(n)]
    flat_completions = [c for group in completions for c in group]
    own_runner = runner is None
    runner = runner or RewardRunner.for_task(task)
    try:
        flat_results = runner.score(flat_problems, flat_completions)
    finally:
        if own_runner:
            runner.close()
    results = [flat_results[i * n : (i + 1) * n] for i in range(len(problems))]
    return completions, results
