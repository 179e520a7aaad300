"""Dataset curation: dedup, a held-out split, pass-rate filtering and a curriculum.

The pipeline (``curate``) runs in this order, each step counted in the manifest:

1. **dedup** (exact, or normalised text) — before the split, so a question and its copy
   cannot land on both sides of it;
2. **held-out split** by a hash of the id, or by a time field (problems at or after a
   cutoff are held out: RLAX evaluated on problems newer than the model's data cutoff);
3. **pass-rate estimation** on the training side: ``k`` samples per prompt from a given
   policy, pass rate = correct / k;
4. **band filter**: keep ``low <= pass rate <= high``. AReaL drops questions its model
   always or never solves (0.05 and 0.95 over 16 samples); such prompts give a group of
   equal rewards, hence zero group-relative advantage and no gradient;
5. **curriculum**: order by pass rate (easy first by default).

The curated set is written as JSONL plus a ``manifest.json`` (source, settings, counts,
seed) by ``write_curated``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import unicodedata
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from rlaxkit.rules.validation import is_number
from rlaxkit.tasks.base import ChatTemplate, Problem, Task, check_choice, check_range, split_of
from rlaxkit.tasks.datasets import write_problems
from rlaxkit.tasks.policy import TextPolicy, sample_and_score
from rlaxkit.tasks.runner import RewardRunner

DedupMode = Literal["none", "exact", "normalised"]
HoldoutBy = Literal["none", "id", "time"]
CurriculumOrder = Literal["none", "easy_first", "hard_first"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurationConfig:
    """Settings of ``curate``.

    Attributes:
      samples_per_prompt: ``k``, completions sampled per problem to estimate its pass rate.
      min_pass_rate: lowest pass rate kept (inclusive).
      max_pass_rate: highest pass rate kept (inclusive).
      dedup: ``"none"``, ``"exact"`` (same text) or ``"normalised"`` (see ``normalise_text``).
      holdout_by: ``"none"``, ``"id"`` (hash of the id) or ``"time"`` (a metadata field).
      holdout_fraction: held-out share for ``holdout_by="id"``.
      time_field: metadata field holding an ISO-8601 time or a Unix timestamp.
      time_cutoff: ISO-8601 time; problems at or after it are held out (naive means UTC).
      curriculum: ``"easy_first"``, ``"hard_first"`` or ``"none"`` (keep input order).
      seed: passed to the policy when sampling.
    """

    samples_per_prompt: int = 16
    min_pass_rate: float = 0.05
    max_pass_rate: float = 0.95
    dedup: DedupMode = "normalised"
    holdout_by: HoldoutBy = "none"
    holdout_fraction: float = 0.1
    time_field: str = "time"
    time_cutoff: str | None = None
    curriculum: CurriculumOrder = "easy_first"
    seed: int = 0

    def __post_init__(self):
        if self.samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {self.samples_per_prompt}")
        check_range("min_pass_rate", self.min_pass_rate, 0.0, 1.0)
        check_range("max_pass_rate", self.max_pass_rate, self.min_pass_rate, 1.0)
        check_choice("dedup", self.dedup, DedupMode)
        check_choice("holdout_by", self.holdout_by, HoldoutBy)
        check_choice("curriculum", self.curriculum, CurriculumOrder)
        check_range("holdout_fraction", self.holdout_fraction, 0.0, 1.0)
        if self.holdout_by == "time":
            if self.time_cutoff is None:
                raise ValueError("time_cutoff must be set when holdout_by is 'time'")
            parse_time(self.time_cutoff)


@dataclasses.dataclass(frozen=True)
class PassRate:
    """How often a policy solved one problem: ``correct`` of ``samples``."""

    problem_id: str
    samples: int
    correct: int
    mean_score: float

    @property
    def pass_rate(self) -> float:
        """``correct / samples``."""
        return self.correct / self.samples


@dataclasses.dataclass(frozen=True)
class CurationResult:
    """Curated training problems (``pass_rate`` in metadata), held-out problems, manifest."""

    train: list[Problem]
    heldout: list[Problem]
    pass_rates: dict[str, PassRate]
    manifest: dict[str, Any]


def estimate_pass_rates(
    task: Task,
    problems: Sequence[Problem],
    generate: TextPolicy,
    *,
    samples_per_prompt: int = 16,
    seed: int = 0,
    runner: RewardRunner | None = None,
    chat: ChatTemplate | None = None,
) -> dict[str, PassRate]:
    """Pass rate of every problem under ``generate``, from ``samples_per_prompt`` samples."""
    _, results = sample_and_score(
        task, problems, generate, n=samples_per_prompt, seed=seed, runner=runner, chat=chat
    )
    return {
        p.id: PassRate(
            p.id,
            samples_per_prompt,
            sum(r.correct for r in group),
            sum(r.score for r in group) / samples_per_prompt,
        )
        for p, group in zip(problems, results, strict=True)
    }


def filter_by_pass_rate(
    problems: Sequence[Problem], pass_rates: dict[str, PassRate], low: float, high: float
) -> tuple[list[Problem], list[Problem], list[Problem]]:
    """Splits problems into ``(kept, too_easy, too_hard)`` by ``low <= rate <= high``."""
    kept: list[Problem] = []
    too_easy: list[Problem] = []
    too_hard: list[Problem] = []
    for problem in problems:
        rate = pass_rates[problem.id].pass_rate
        (too_easy if rate > high else too_hard if rate < low else kept).append(problem)
    return kept, too_easy, too_hard


def normalise_text(text: str) -> str:
    """Text for near-duplicate detection: NFKC, case-folded, all whitespace removed and
    trailing ``.``/``?``/``!`` dropped (so ``"What is 2 + 2?"`` == ``"what is 2+2"``)."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return re.sub(r"\s+", "", text).rstrip(".?!")


def dedup(problems: Sequence[Problem], mode: DedupMode = "normalised") -> list[Problem]:
    """The problems with repeated prompts removed (first occurrence kept, order kept)."""
    check_choice("dedup", mode, DedupMode)
    if mode == "none":
        return list(problems)
    seen: set[str] = set()
    kept = []
    for problem in problems:
        key = problem.text() if mode == "exact" else normalise_text(problem.text())
        if key not in seen:
            seen.add(key)
            kept.append(problem)
    return kept


def holdout_split(
    problems: Sequence[Problem], config: CurationConfig
) -> tuple[list[Problem], list[Problem]]:
    """``(train, heldout)`` by ``config.holdout_by``; order is kept on both sides."""
    if config.holdout_by == "none":
        return list(problems), []
    if config.holdout_by == "id":
        held = [split_of(p.id, config.holdout_fraction) == "test" for p in problems]
    else:
        assert config.time_cutoff is not None  # the config requires it for "time"
        cutoff = parse_time(config.time_cutoff)
        held = []
        for problem in problems:
            if config.time_field not in problem.metadata:
                raise ValueError(
                    f"problem {problem.id} has no metadata field {config.time_field!r} "
                    "(time_field) for the time split"
                )
            held.append(parse_time(problem.metadata[config.time_field]) >= cutoff)
    train = [p for p, h in zip(problems, held, strict=True) if not h]
    heldout = [p for p, h in zip(problems, held, strict=True) if h]
    return train, heldout


def order_by_difficulty(
    problems: Sequence[Problem], pass_rates: dict[str, PassRate], order: CurriculumOrder
) -> list[Problem]:
    """Problems sorted by pass rate (``easy_first``: highest first); ties by id."""
    check_choice("curriculum", order, CurriculumOrder)
    if order == "none":
        return list(problems)
    sign = -1 if order == "easy_first" else 1
    return sorted(problems, key=lambda p: (sign * pass_rates[p.id].pass_rate, p.id))


def curate(
    task: Task,
    problems: Sequence[Problem],
    generate: TextPolicy,
    config: CurationConfig | None = None,
    *,
    source: str,
    runner: RewardRunner | None = None,
    chat: ChatTemplate | None = None,
) -> CurationResult:
    """Runs dedup, held-out split, pass-rate estimation, band filter and curriculum.

    Args:
      task: formats prompts and scores completions.
      problems: the candidate problems.
      generate: the policy whose pass rates decide difficulty.
      config: curation settings.
      source: where the problems came from (a path or a task spec), for the manifest.
      runner: scores completions (default: one for the task).
      chat: renders prompts through a chat template when given.
    """
    config = config or CurationConfig()
    unique = dedup(problems, config.dedup)
    train, heldout = holdout_split(unique, config)
    pass_rates = estimate_pass_rates(
        task,
        train,
        generate,
        samples_per_prompt=config.samples_per_prompt,
        seed=config.seed,
        runner=runner,
        chat=chat,
    )
    kept, too_easy, too_hard = filter_by_pass_rate(
        train, pass_rates, config.min_pass_rate, config.max_pass_rate
    )
    ordered = order_by_difficulty(kept, pass_rates, config.curriculum)
    curated = [
        dataclasses.replace(p, metadata={**p.metadata, "pass_rate": pass_rates[p.id].pass_rate})
        for p in ordered
    ]
    rates = [r.pass_rate for r in pass_rates.values()]
    manifest = {
        "source": source,
        "task": task.name,
        "seed": config.seed,
        "settings": dataclasses.asdict(config),
        "counts": {
            "input": len(problems),
            "duplicates_removed": len(problems) - len(unique),
            "held_out": len(heldout),
            "scored": len(train),
            "too_easy": len(too_easy),
            "too_hard": len(too_hard),
            "kept": len(curated),
        },
        "mean_pass_rate": sum(rates) / len(rates) if rates else None,
    }
    return CurationResult(curated, heldout, pass_rates, manifest)


def write_curated(directory: str | Path, result: CurationResult) -> dict[str, Path]:
    """Writes ``train.jsonl``, ``heldout.jsonl`` and ``manifest.json`` into ``directory``.

    Returns the three paths by name (``"train"``, ``"heldout"``, ``"manifest"``).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {
        "train": directory / "train.jsonl",
        "heldout": directory / "heldout.jsonl",
        "manifest": directory / "manifest.json",
    }
    write_problems(paths["train"], result.train)
    write_problems(paths["heldout"], result.heldout)
    manifest = {
        **result.manifest,
        "files": {k: v.name for k, v in paths.items() if k != "manifest"},
    }
    paths["manifest"].write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return paths


def parse_time(value: str | int | float) -> datetime:
    """An aware UTC datetime from an ISO-8601 string (naive means UTC) or Unix seconds."""
    if is_number(value):
        return datetime.fromtimestamp(value, tz=UTC)
    if not isinstance(value, str):
        raise ValueError(f"time must be an ISO-8601 string or Unix seconds, got {value!r}")
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"time {value!r} is not ISO-8601") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
