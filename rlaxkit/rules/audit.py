"""The distribution audit: is the trained data the sampled data?

Asynchronous RL decides, rollout by rollout, what reaches the trainer: staleness drops,
preemptions that lose work, re-issues and resumes each favour whatever finishes first,
which is usually the short and the easy. This module compares two distributions over
the run (and over one step) and flags a difference:

- **completion length**, per rollout (policy and environment tokens after the prompt);
- **pass rate**, per prompt group (the share of its samples that are correct: the
  prompt's difficulty as the policy sees it).

For each it reports the means and the two-sample Kolmogorov-Smirnov statistic
``D = max_x |F_sampled(x) − F_trained(x)|``: how far the trained distribution is from the
sampled one. The trained rollouts are part of the sampled ones, so ``D`` is at most the
share left out and says little about whether leaving them out was chance; the flag asks
that of the rollouts left out (``dropped``) against the trained ones, two disjoint sets:
their KS statistic above ``max(MIN_DISTANCE, c · sqrt((n + m) / (n · m)))``, the KS
test's critical value at level α (``c = 1.95``: α = 0.001, a selection blind to length
and difficulty is flagged once in a thousand runs) with a floor, so that a run of many
thousands of samples is not flagged for a difference too small to matter.

"Sampled" is every finished rollout of a group the run has settled (trained, or dropped
for a reason other than dynamic filtering, ``filtered``: that filter removes
equal-reward groups on purpose, and its share is reported apart). Work lost before it
finished has no length; its count is reported as ``lost``.

Plain Python (no NumPy, no JAX): the runtime's loop and the simulator call the same
``audit_distributions``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Protocol

from rlaxkit.rules.ledger import GroupLedger

__all__ = ["AuditBook", "AuditRecord", "audit_distributions", "ks_statistic", "step_audit"]

KS_C = 1.95  # the KS critical value's coefficient at α = 0.001
MIN_DISTANCE = 0.1  # the smallest KS statistic worth flagging


class ScoredRollout(Protocol):
    """What an audit record reads of a scored ``rlaxkit.data.rollout.Rollout``."""

    @property
    def group_id(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def reward_info(self) -> Mapping[str, object]: ...


class RestoredBuffer(Protocol):
    """What a resumed audit reads of a ``rlaxkit.data.buffer.RolloutBuffer``."""

    @property
    def ledger(self) -> GroupLedger: ...
    @property
    def dropped(self) -> Sized: ...


@dataclass(frozen=True)
class AuditRecord:
    """One finished rollout: its group, its completion length and whether it is correct."""

    group_id: int
    tokens: int
    correct: bool

    @classmethod
    def of(cls, rollout: ScoredRollout) -> AuditRecord:
        """The record of a scored ``rlaxkit.data.rollout.Rollout`` (read, not imported)."""
        correct = bool(rollout.reward_info.get("correct", False))
        return cls(rollout.group_id, rollout.num_tokens, correct)


def ks_statistic(a: Sequence[float], b: Sequence[float]) -> float:
    """The two-sample Kolmogorov-Smirnov statistic ``max_x |F_a(x) − F_b(x)|`` (0 when
    either is empty).

    >>> ks_statistic([1, 2, 3, 4], [1, 2, 3, 4]), ks_statistic([1, 2], [3, 4])
    (0.0, 1.0)
    >>> ks_statistic([1, 2, 3, 4], [1, 2])
    0.5
    """
    if not a or not b:
        return 0.0
    sa, sb = sorted(a), sorted(b)
    return max(
        abs(bisect.bisect_right(sa, x) / len(sa) - bisect.bisect_right(sb, x) / len(sb))
        for x in set(sa) | set(sb)
    )


def pass_rates(records: Iterable[AuditRecord]) -> list[float]:
    """Per group (in order of first appearance), the share of its records that are correct."""
    counts: dict[int, list[int]] = {}
    for r in records:
        entry = counts.setdefault(r.group_id, [0, 0])
        entry[0] += int(r.correct)
        entry[1] += 1
    return [right / total for right, total in counts.values()]


def _compare(
    sampled: Sequence[float], trained: Sequence[float], dropped: Sequence[float]
) -> dict[str, float | bool]:
    n, m = len(dropped), len(trained)
    gap = ks_statistic(dropped, trained)
    threshold = max(MIN_DISTANCE, KS_C * math.sqrt((n + m) / (n * m))) if n and m else 1.0
    return {
        "sampled_mean": sum(sampled) / len(sampled) if sampled else 0.0,
        "trained_mean": sum(trained) / m if m else 0.0,
        "dropped_mean": sum(dropped) / n if n else 0.0,
        "ks": ks_statistic(sampled, trained),
        "dropped_ks": gap,
        "threshold": threshold,
        "flagged": gap > threshold,
    }


def audit_distributions(
    sampled: Sequence[AuditRecord], trained: Sequence[AuditRecord]
) -> dict[str, object]:
    """Sampled against trained (``trained`` is part of ``sampled``; the rest, by group,
    is ``dropped``): ``length`` and ``pass_rate``, each with ``sampled_mean``,
    ``trained_mean``, ``dropped_mean``, ``ks`` (sampled against trained), ``dropped_ks``
    (dropped against trained), ``threshold`` and ``flagged`` (``dropped_ks`` above the
    threshold); ``sampled``/``trained`` (rollouts) and ``passed`` (nothing flagged).

    >>> short = [AuditRecord(g, 10, True) for g in range(40)]
    >>> long = [AuditRecord(40 + g, 90, False) for g in range(40)]
    >>> audit = audit_distributions(short + long, short)
    >>> audit["length"]["ks"], audit["length"]["dropped_ks"], audit["passed"]
    (0.5, 1.0, False)
    >>> audit_distributions(short + long, short + long)["passed"]
    True
    """
    kept = {r.group_id for r in trained}
    dropped = [r for r in sampled if r.group_id not in kept]
    length = _compare(
        [r.tokens for r in sampled], [r.tokens for r in trained], [r.tokens for r in dropped]
    )
    difficulty = _compare(pass_rates(sampled), pass_rates(trained), pass_rates(dropped))
    return {
        "length": length,
        "pass_rate": difficulty,
        "sampled": len(sampled),
        "trained": len(trained),
        "passed": not (length["flagged"] or difficulty["flagged"]),
    }


def step_audit(sampled: Sequence[AuditRecord], trained: Sequence[AuditRecord]) -> dict[str, float]:
    """One step's audit as flat metrics: ``audit/<length|pass_rate>_<sampled_mean|
    trained_mean|ks>``."""
    audit = audit_distributions(sampled, trained)
    out = {}
    for name in ("length", "pass_rate"):
        part = audit[name]
        assert isinstance(part, dict)
        for key in ("sampled_mean", "trained_mean", "ks"):
            out[f"audit/{name}_{key}"] = float(part[key])
    return out


class AuditBook:
    """The run's records: every finished rollout by group, and how each group settled
    (trained, or dropped with a reason).

    >>> book = AuditBook()
    >>> for g, tokens in ((0, 5), (0, 7), (1, 30), (1, 34)):
    ...     book.finished(AuditRecord(g, tokens, tokens < 10))
    >>> step = book.take_step([0], dropped={1: "stale"})
    >>> step["audit/length_sampled_mean"], step["audit/length_trained_mean"]
    (19.0, 6.0)
    >>> audit = book.audit(dropped={1: "stale"})
    >>> audit["sampled"], audit["trained"], audit["length"]["flagged"]
    (4, 2, False)
    """

    def __init__(self) -> None:
        self.groups: dict[int, list[AuditRecord]] = {}
        self.trained_ids: set[int] = set()
        self._seen_drops = 0  # drops already counted in a step (the ledger only grows)

    def finished(self, record: AuditRecord) -> None:
        """A rollout finished (scored), whatever happens to it next."""
        self.groups.setdefault(record.group_id, []).append(record)

    def resumed(self, buffer: RestoredBuffer) -> None:
        """A run resumed from a checkpoint into ``buffer`` (a ``RolloutBuffer``): the
        finished groups it restored are books' records again, and its drops so far are
        counted as seen, so the steps after go on as the uninterrupted run's do."""
        for group in buffer.ledger.ready.values():
            for rollout in group.payload.rollouts:
                self.finished(AuditRecord.of(rollout))
        self._seen_drops = len(buffer.dropped)

    def trained(self, group_ids: Iterable[int]) -> None:
        """These groups went to the trainer (the simulator's books; the runtime's loop
        books them with ``take_step``)."""
        self.trained_ids.update(group_ids)

    def _settled(self, group_ids: Iterable[int], dropped: Mapping[int, str]) -> list[int]:
        return [
            g
            for g in group_ids
            if g in self.groups and (g in self.trained_ids or dropped.get(g) != "filtered")
        ]

    def take_step(self, trained_ids: Iterable[int], dropped: Mapping[int, str]) -> dict[str, float]:
        """One step's audit (``step_audit``): the groups it trained against those it
        settled (trained, or dropped since the last step, dynamic filtering aside)."""
        ids = list(trained_ids)
        self.trained(ids)
        drops = list(dropped)  # insertion order: the newest last
        new_drops, self._seen_drops = drops[self._seen_drops :], len(drops)
        settled = ids + self._settled(new_drops, dropped)
        sampled = [r for g in settled for r in self.groups.get(g, ())]
        trained = [r for g in ids for r in self.groups.get(g, ())]
        return step_audit(sampled, trained)

    def audit(self, dropped: Mapping[int, str]) -> dict[str, object]:
        """The run's audit (``audit_distributions``) over the settled groups, with
        ``filtered`` (groups dynamic filtering dropped) and ``lost`` (groups dropped
        before any of their rollouts finished: no length to count)."""
        settled = self._settled(list(self.trained_ids) + list(dropped), dropped)
        sampled = [r for g in dict.fromkeys(settled) for r in self.groups[g]]
        trained = [r for g in self.trained_ids if g in self.groups for r in self.groups[g]]
        filtered = sum(1 for reason in dropped.values() if reason == "filtered")
        lost = sum(1 for g in dropped if g not in self.groups)
        return {**audit_distributions(sampled, trained), "filtered": filtered, "lost": lost}
