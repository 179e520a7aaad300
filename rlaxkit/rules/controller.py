"""The controller's deterministic state: the prompt cursor and the RNG streams.

As in RLAX's controller, everything random about *what* is generated derives from the
run seed and an issue counter, never from wall-clock order: prompt ``g`` (the ``g``-th
issued) is the same problem with the same sampling seed whichever worker takes it and
whenever, so a run restored from a checkpoint regenerates in-flight work exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

_MASK64 = 2**64 - 1


def _mix64(x: int) -> int:
    """SplitMix64's output function of ``x + golden gamma``: a bijection of 64-bit
    integers whose outputs of consecutive inputs look independent. Deriving a prompt's
    seed with it takes about 1 us; seeding a NumPy generator to draw one took 14 us."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True)
class Issue:
    """One prompt handed to a worker: its group id, problem index and sampling seed."""

    group_id: int
    problem_index: int
    seed: int


class PromptController:
    """Walks a dataset in seeded, per-epoch shuffled order and numbers every issue.

    >>> c = PromptController(num_problems=3, seed=0)
    >>> [i.group_id for i in c.next_issues(4)]
    [0, 1, 2, 3]
    >>> sorted(i.problem_index for i in PromptController(3, seed=0).next_issues(3))
    [0, 1, 2]

    Args:
        num_problems: size of the training split.
        seed: the run seed.
        shuffle: visit problems in a fresh seeded permutation each epoch.
    """

    def __init__(self, num_problems: int, seed: int, shuffle: bool = True):
        if num_problems < 1:
            raise ValueError("the training split is empty: num_problems must be >= 1")
        self.num_problems = num_problems
        self.seed = seed
        self.shuffle = shuffle
        self.next_group_id = 0
        self.reissue: list[Issue] = []
        self._epoch_order: tuple[int, np.ndarray] | None = None  # the last epoch's order

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_problems)
        # Kept for the epoch's next issue: drawing the permutation costs more than the
        # rest of an issue.
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            order = np.random.default_rng([self.seed, epoch, 0x5EED]).permutation(self.num_problems)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def issue_for(self, group_id: int) -> Issue:
        """The issue numbered ``group_id`` (pure function of seed and id)."""
        epoch, offset = divmod(group_id, self.num_problems)
        problem = int(self._order(epoch)[offset])
        seed = _mix64((_mix64(self.seed & _MASK64) + group_id) & _MASK64) % (2**31 - 1)
        return Issue(group_id, problem, seed)

    def next_issues(self, count: int) -> list[Issue]:
        """The next ``count`` issues: re-issues first (lost work), then fresh prompts."""
        out = self.reissue[:count]
        self.reissue = self.reissue[count:]
        while len(out) < count:
            out.append(self.issue_for(self.next_group_id))
            self.next_group_id += 1
        return out

    def requeue(self, issues: Sequence[Issue]) -> None:
        """Queues lost in-flight issues to be generated again, same ids and seeds."""
        self.reissue = sorted([*self.reissue, *issues], key=lambda i: i.group_id)

    @property
    def epoch(self) -> int:
        return self.next_group_id // self.num_problems

    def state_dict(self) -> dict[str, object]:
        return {
            "next_group_id": self.next_group_id,
            "reissue": [i.group_id for i in self.reissue],
            "seed": self.seed,
            "num_problems": self.num_problems,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed or state["num_problems"] != self.num_problems:
            raise ValueError(
                "checkpoint was written for another dataset or seed "
                f"(seed {state['seed']}, {state['num_problems']} problems); "
                f"this run has seed {self.seed} and {self.num_problems} problems"
            )
        self.next_group_id = state["next_group_id"]
        self.reissue = [self.issue_for(g) for g in state["reissue"]]
