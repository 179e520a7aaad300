"""Held-out evaluation: unbiased pass@k, mean@k and maj@k from ``n`` samples per problem.

pass@k follows Chen et al. 2021 ("Evaluating Large Language Models Trained on Code"):
with ``n`` samples of which ``c`` are correct, the chance that at least one of ``k``
samples drawn without replacement is correct is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i),

the product form avoiding huge binomials. Averaged over problems it is an unbiased
estimate of the policy's pass@k, with far less variance than drawing only ``k`` samples.

``evaluate_policy`` samples single-turn completions; ``evaluate_episodes`` runs a
multi-turn task's episodes with their tools (``rlaxkit.tasks.episodes.run_episodes``) and
counts each episode's final verdict, adding the task's own episode metrics (the
calculator's ``tool_use_rate``).
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from rlaxkit.tasks import ChatTemplate, Problem, RewardRunner, Split, Task, TextPolicy
from rlaxkit.tasks.episodes import (
    Episode,
    EpisodeConfig,
    EpisodicTask,
    episode_sampling,
    run_episodes,
)
from rlaxkit.tasks.policy import sample_and_score

if TYPE_CHECKING:  # JAX waits for an engine: ``import rlaxkit.evaluation`` stays light
    from rlaxkit.config.run import RunConfig
    from rlaxkit.inference import InferenceEngine, SamplingConfig
    from rlaxkit.inference.results import ModelLike
    from rlaxkit.models.tokenizer import Tokenizer


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
      metrics: the task's own measures over every sample (episodes: the calculator's
        ``tool_use_rate``, ``tool_call_rate``, ...); empty for single-turn evaluation.
    """

    task: str
    num_problems: int
    samples: int
    rows: list[dict[str, float]]
    per_problem: list[dict[str, Any]] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

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
        if self.metrics:
            lines.append(", ".join(f"{k} {v:.3f}" for k, v in self.metrics.items()))
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
    verdicts = [[_Verdict(r.correct, r.parsed, r.score, r.reason) for r in g] for g in results]
    return _report(task.name, problems, verdicts, n, ks, seed)


class _Verdict(NamedTuple):
    """What evaluation reads of one sample (a completion's or an episode's)."""

    correct: bool
    parsed: str | None
    score: float
    reason: str | None


def _report(
    name: str,
    problems: Sequence[Problem],
    results: list[list[_Verdict]],
    n: int,
    ks: Sequence[int],
    seed: int,
    metrics: dict[str, float] | None = None,
) -> EvalReport:
    """pass@k, maj@k and mean@k per ``k`` from ``n`` verdicts per problem."""
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
    return EvalReport(name, len(problems), n, rows, per_problem, dict(reasons), metrics or {})


@runtime_checkable
class EpisodeMetricsTask(Protocol):
    """An episodic task with measures of its own over a set of episodes (the
    calculator's tool use); ``evaluate_episodes`` puts them in ``EvalReport.metrics``."""

    def episode_metrics(self, episodes: Sequence[Episode]) -> dict[str, float]:
        """Shares or means over ``episodes``."""
        ...


def make_episode_engine(
    model: ModelLike,
    task: EpisodicTask,
    tokenizer: Tokenizer,
    sampling: SamplingConfig,
    episodes: EpisodeConfig,
    *,
    max_prompt_tokens: int,
    num_slots: int,
    chunk_steps: int,
) -> InferenceEngine:
    """An engine ``run_episodes`` can drive for ``task``: one sample per request,
    stopping at the end token and the environment's tool stops, wide enough for a
    prompt of ``max_prompt_tokens`` plus ``episodes.max_episode_tokens`` (a turn after a
    tool call that does not resume its row is a request of the whole context)."""
    from rlaxkit.inference import InferenceEngine

    tool_stops = task.make_environment().tool_stops
    return InferenceEngine(
        model,
        episode_sampling(sampling, tokenizer, tool_stops),
        num_slots=num_slots,
        max_prompt_len=max_prompt_tokens + episodes.max_episode_tokens,
        chunk_steps=chunk_steps,
    )


def evaluate_episodes(
    task: Task,
    engine: InferenceEngine,
    tokenizer: Tokenizer,
    config: EpisodeConfig,
    *,
    problems: Sequence[Problem] | None = None,
    split: Split = "test",
    num_problems: int | None = None,
    n: int = 8,
    ks: Sequence[int] = (1, 8),
    seed: int = 0,
) -> EvalReport:
    """Runs ``n`` episodes per problem and reports pass@k, maj@k, mean@k over them.

    An episode is correct when its last step's ``info["correct"]`` is true (the
    environment's verdict on the final answer; an episode whose turns or tokens ran out
    is wrong); its answer for the vote is that step's ``info["parsed"]``, its score the
    episode's reward, its failure reason ``info["reason"]`` or how it ended
    (``max_turns``, ``length``). A task with ``episode_metrics`` adds them over all
    episodes.

    Args:
      task: an ``EpisodicTask`` (its environments run the episodes).
      engine: an idle engine built for episodes (``make_episode_engine``), holding the
        policy's weights.
      tokenizer: encodes observations and decodes turns.
      config: turns, token budget, step timeout; its ``samples_per_problem`` is ``n``.
      problems, split, num_problems, n, ks: as in ``evaluate_policy``.
      seed: the episodes' sampling seed (``run_episodes``).
    """
    if not isinstance(task, EpisodicTask):
        raise ValueError(f"task {task.name!r} has no environments; use evaluate_policy")
    ks = sorted(set(ks))
    if not ks or ks[0] < 1 or ks[-1] > n:
        raise ValueError(f"ks must be in [1, n={n}], got {list(ks)}")
    if problems is None:
        problems = task.problems(split, num_problems)
    config = replace(config, samples_per_problem=n)
    episodes = run_episodes(engine, task.make_environment, problems, tokenizer, config, seed=seed)
    verdicts = [_episode_verdict(e) for e in episodes]
    groups = [verdicts[i * n : (i + 1) * n] for i in range(len(problems))]
    metrics = task.episode_metrics(episodes) if isinstance(task, EpisodeMetricsTask) else None
    return _report(task.name, problems, groups, n, ks, seed, metrics)


def _episode_verdict(episode: Episode) -> _Verdict:
    last = episode.steps[-1].info if episode.steps else {}
    correct = bool(last.get("correct", False))
    reason = None
    if not correct:
        reason = last.get("reason") if episode.finish_reason == "stop" else episode.finish_reason
    parsed = last.get("parsed") if episode.finish_reason == "stop" else None
    return _Verdict(correct, parsed, float(episode.reward), reason)


def _vote_key(parsed: str | None) -> str | None:
    """Votes are grouped by the parsed answer with whitespace removed."""
    return None if parsed is None else "".join(parsed.split())


def evaluate_model(
    config: RunConfig,
    task: Task,
    model: ModelLike,
    tokenizer: Tokenizer,
    *,
    problems: Sequence[Problem],
    n: int,
    seed: int,
    runner: RewardRunner | None = None,
    progress: bool | None = None,
) -> EvalReport:
    """pass@1 and pass@n of ``model`` on ``problems`` at ``config.sampling``: single-turn
    completions (``evaluate_policy``), or for a multi-turn task whole episodes with its
    tools (``evaluate_episodes``; turns and budgets from ``config.episodes``, an engine
    of ``runtime.slots_per_worker`` rows).

    Single-turn completions are sampled in batches of ``eval_batch_prompts`` problems, with
    a progress bar when ``progress`` (``None``: when stderr is a terminal); the report is
    that of one batch (``make_text_generate``: each prompt keeps its key)."""
    if isinstance(task, EpisodicTask):
        runtime = config.runtime
        # Parked rows keep their caches through a tool call, as the worker's do.
        episodes = replace(config.episodes, keep_cache=True)
        engine = make_episode_engine(
            model,
            task,
            tokenizer,
            config.sampling,
            episodes,
            max_prompt_tokens=runtime.max_prompt_tokens,
            num_slots=runtime.slots_per_worker,
            chunk_steps=runtime.chunk_steps,
        )
        return evaluate_episodes(
            task, engine, tokenizer, episodes, problems=problems, n=n, ks=sorted({1, n}), seed=seed
        )
    from tqdm.auto import tqdm

    from rlaxkit.inference import make_text_generate

    disable = None if progress is None else not progress  # tqdm's None: off unless a TTY
    bar = tqdm(total=len(problems), desc="eval", unit="problem", disable=disable, leave=False)
    generate = make_text_generate(
        model,
        tokenizer,
        config.sampling,
        batch_prompts=eval_batch_prompts(len(problems), n),
        on_batch=bar.update,
    )
    with bar:
        return evaluate_policy(
            task, generate, problems=problems, n=n, ks=sorted({1, n}), seed=seed, runner=runner
        )


EVAL_BATCHES = 8  # progress-bar steps of an evaluation, about
MIN_EVAL_BATCH_ROWS = 128  # fewer rows a call would leave an accelerator mostly idle


def eval_batch_prompts(num_problems: int, n: int) -> int:
    """Problems per ``generate`` call of an evaluation: about ``EVAL_BATCHES`` calls, of a
    power of two rows each (what ``generate`` pads a batch to), at least
    ``MIN_EVAL_BATCH_ROWS`` rows.

    >>> eval_batch_prompts(200, 4)  # 800 rows: 7 calls of 32 problems (128 rows)
    32
    >>> eval_batch_prompts(8, 2)  # 16 rows: one call
    64
    """
    rows_per_call = -(-num_problems * n // EVAL_BATCHES)
    rows = max(MIN_EVAL_BATCH_ROWS, 1 << (rows_per_call - 1).bit_length())
    return max(1, rows // n)
