"""Counters the simulated entities update, and the SimResult computed from them.

Definitions (``T`` is the simulated time at the end of the run):

- throughput: samples (tokens) of the steps that survived to the end, divided by ``T``;
  steps lost to a trainer preemption do not count. For a run stopped at its target
  step, ``T`` is the end of that step (as ``rlaxkit.rules.trace.summarize`` measures a
  trace), otherwise the horizon;
- trainer utilisation: seconds of train-step compute (lost steps included) ÷ ``T``;
- goodput: seconds of compute of the surviving steps ÷ ``T`` (useful trainer compute
  over wall time);
- worker utilisation: slot-seconds spent decoding ÷ (slots · ``T``);
- multi-turn episodes: ``tool_calls`` started, ``slots_released`` (calls that gave their
  slot up), and ``tool_hold_fraction``, slot-seconds held by episodes waiting for a
  tool ÷ (slots · ``T``);
- staleness: per trained rollout, trainer version minus the rollout's oldest version.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

__all__ = ["Counters", "SimResult"]


class Counters:
    """Mutable tallies shared by the entities of one run (plain attributes for speed)."""

    def __init__(self) -> None:
        self.samples_generated = 0
        self.tokens_generated = 0
        self.slot_busy_s = 0.0
        self.tool_calls = 0  # multi-turn episodes' tool calls started
        self.tool_hold_s = 0.0  # slot-seconds held by episodes waiting for a tool
        self.slots_released = 0  # tool calls that gave their slot up
        self.lost_steps = 0
        self.lost_compute_s = 0.0
        self.staleness: Counter[int] = Counter()
        self.drops: Counter[str] = Counter()
        self.preemptions: Counter[str] = Counter()
        # One entry per surviving step: (compute_s, samples, tokens, end_time_s), and
        # the staleness of each group it trained.
        self.steps: list[tuple[float, int, int, float]] = []
        self.step_staleness: list[list[int]] = []

    def record_step(self, entry: tuple[float, int, int, float], staleness: list[int]) -> None:
        """A step survived so far: its figures and its groups' staleness."""
        self.steps.append(entry)
        self.step_staleness.append(staleness)
        self.staleness.update(staleness)

    def rollback(self, to_step: int) -> None:
        """Forget the steps after ``to_step`` (lost to a trainer preemption): their
        compute is lost, and their groups' staleness leaves the histogram (the groups
        train again, or are dropped, and count then)."""
        lost = self.steps[to_step:]
        self.lost_steps += len(lost)
        self.lost_compute_s += sum(step[0] for step in lost)
        del self.steps[to_step:]
        for staleness in self.step_staleness[to_step:]:
            self.staleness.subtract(staleness)
        self.staleness = +self.staleness  # no zero counts left
        del self.step_staleness[to_step:]


@dataclass(frozen=True)
class SimResult:
    """What one simulated run measured (see the module docstring for definitions)."""

    scenario: str
    sim_time_s: float
    steps: int
    samples_trained: int
    tokens_trained: int
    samples_generated: int
    tokens_generated: int
    samples_per_s: float
    tokens_per_s: float
    generated_tokens_per_s: float
    trainer_utilisation: float
    goodput: float
    worker_utilisation: float
    staleness: dict[int, int]
    drops: dict[str, int]
    preemptions: dict[str, int]
    lost_steps: int
    step_end_s: tuple[float, ...] = field(repr=False)
    events: int = 0
    wall_s: float = 0.0
    tool_calls: int = 0
    slots_released: int = 0
    tool_hold_fraction: float = 0.0
    audit: dict[str, object] = field(default_factory=dict, repr=False)

    @property
    def events_per_s(self) -> float:
        """Simulation events processed per wall-clock second."""
        return self.events / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def mean_staleness(self) -> float:
        """Mean staleness over trained rollouts (0 when none)."""
        total = sum(self.staleness.values())
        return sum(k * n for k, n in self.staleness.items()) / total if total else 0.0

    @property
    def max_staleness(self) -> int:
        """Largest staleness of any trained rollout (0 when none)."""
        return max(self.staleness, default=0)

    def time_to_step(self, step: int) -> float | None:
        """Simulated seconds until the trainer reached ``step`` for good (``None``: never)."""
        return self.step_end_s[step - 1] if 0 < step <= len(self.step_end_s) else None

    def to_row(self) -> dict[str, object]:
        """Scalar metrics for a results table."""
        return {
            "scenario": self.scenario,
            "sim_time_s": round(self.sim_time_s, 3),
            "steps": self.steps,
            "samples_per_s": round(self.samples_per_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "trainer_util": round(self.trainer_utilisation, 4),
            "goodput": round(self.goodput, 4),
            "worker_util": round(self.worker_utilisation, 4),
            "mean_staleness": round(self.mean_staleness, 3),
            "max_staleness": self.max_staleness,
            "dropped": sum(self.drops.values()),
            "preemptions": sum(self.preemptions.values()),
            "lost_steps": self.lost_steps,
        }


def build_result(
    *,
    name: str,
    counters: Counters,
    sim_time_s: float,
    total_slots: int,
    events: int,
    wall_s: float,
    reached_target: bool = False,
    audit: dict[str, object] | None = None,
) -> SimResult:
    """Derive a :class:`SimResult` from a finished run's counters."""
    end = counters.steps[-1][3] if reached_target and counters.steps else sim_time_s
    duration = max(end, 1e-12)
    steps = counters.steps
    samples = sum(s[1] for s in steps)
    tokens = sum(s[2] for s in steps)
    useful = sum(s[0] for s in steps)
    return SimResult(
        scenario=name,
        sim_time_s=sim_time_s,
        steps=len(steps),
        samples_trained=samples,
        tokens_trained=tokens,
        samples_generated=counters.samples_generated,
        tokens_generated=counters.tokens_generated,
        samples_per_s=samples / duration,
        tokens_per_s=tokens / duration,
        generated_tokens_per_s=counters.tokens_generated / duration,
        trainer_utilisation=(useful + counters.lost_compute_s) / duration,
        goodput=useful / duration,
        worker_utilisation=counters.slot_busy_s / (total_slots * duration),
        staleness=dict(sorted(counters.staleness.items())),
        drops=dict(counters.drops),
        preemptions=dict(counters.preemptions),
        lost_steps=counters.lost_steps,
        step_end_s=tuple(s[3] for s in steps),
        tool_calls=counters.tool_calls,
        slots_released=counters.slots_released,
        tool_hold_fraction=counters.tool_hold_s / (total_slots * duration),
        audit=audit or {},
        events=events,
        wall_s=wall_s,
    )
