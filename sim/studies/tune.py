"""The tuner: which settings to run a scenario with, found by simulating them.

:func:`tune` searches the knobs a user sets before renting a fleet (the staleness bound,
the split of a chip budget between the trainer and the workers, the checkpoint interval,
how workers take new weights, and how often the trainer pushes them) for the settings
that train the most samples per second, under optional bounds on mean staleness and
goodput. Each candidate is simulated with the same seeds (common random numbers: every
candidate meets the same preemptions and lengths), so differences between candidates
are not noise between draws.

The search is coordinate ascent from the scenario's own settings: each knob in turn
takes every value of its range with the others held, the best feasible value is kept,
and passes repeat until one changes nothing. It evaluates ``passes · Σ |range|``
candidates instead of the grid's ``Π |range|``, and finds a setting no single knob can
improve (a local optimum; ``exhaustive=True`` runs the whole grid instead).

>>> from sim.presets import toy
>>> result = tune(toy(target_steps=4), TuneSpace(max_staleness=(0, 2)), seeds=(0,))
>>> sorted(result.best.settings)
['staleness.max_staleness', 'weight_sync.pull_mode', 'weight_sync.push_every_steps']
>>> result.predicted_gain >= 0
True
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sim.engine import simulate
from sim.scenario import Scenario, with_overrides

__all__ = ["RUN_CONFIG_KEYS", "TunePoint", "TuneResult", "TuneSpace", "run_overrides", "tune"]

# The fractions of a chip budget the trainer is offered when a budget is given and no
# split range is (RLAX runs its trainer on a minority of the chips; AReaL's 1:3 split of
# training to generation is in this range).
DEFAULT_TRAINER_SHARES = (0.125, 0.25, 0.375, 0.5)
# Checkpoint intervals (steps) searched when the scenario preempts its trainer.
DEFAULT_CHECKPOINT_STEPS = (5, 10, 20, 50)
# The tuner's knobs that a run config (``rlaxkit.config.RunConfig``) sets, by the run
# config's name: how tuned settings are run for real.
RUN_CONFIG_KEYS = {
    "staleness.max_staleness": "staleness.max_staleness",
    "weight_sync.push_every_steps": "weight_sync.push_every_steps",
    "weight_sync.pull_mode": "weight_sync.pull_mode",
    "checkpointing.every_steps": "checkpoint.every_steps",
}


def run_overrides(settings: Mapping[str, object]) -> tuple[str, ...]:
    """A tuned point's settings (:attr:`TunePoint.settings`) as run config overrides
    (``"section.field=value"``), to run them for real.

    >>> run_overrides({"staleness.max_staleness": 2, "checkpointing.every_steps": 10})
    ('staleness.max_staleness=2', 'checkpoint.every_steps=10')

    Raises:
        ValueError: for a knob a run config does not set (the chip split, say: a fleet's
            size is the placement's, not the run config's).
    """
    unknown = sorted(set(settings) - set(RUN_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"run_overrides: {unknown} have no run config setting; "
            f"the knobs a run config sets are {sorted(RUN_CONFIG_KEYS)}"
        )
    return tuple(f"{RUN_CONFIG_KEYS[name]}={value}" for name, value in settings.items())


@dataclass(frozen=True, kw_only=True)
class TuneSpace:
    """The values each knob may take. An empty range leaves the knob as the scenario has it.

    Attributes:
        max_staleness: ``staleness.max_staleness`` (η) values.
        push_every_steps: ``weight_sync.push_every_steps`` (the sync interval).
        pull_mode: ``weight_sync.pull_mode``: ``in_flight`` overlaps weight loading
            with decoding (AReaL's interruptible generation), ``between_requests``
            does not.
        checkpoint_every_steps: ``checkpointing.every_steps``; ``None`` (the default)
            searches ``DEFAULT_CHECKPOINT_STEPS`` when the scenario preempts its trainer
            and leaves the interval alone otherwise.
        trainer_chips: Trainer chips, the rest of the budget going to workers of
            ``fleet.chips_per_worker`` chips each; ``None`` (the default) offers
            ``DEFAULT_TRAINER_SHARES`` of the budget when :func:`tune` is given
            ``chips``, and keeps the scenario's split otherwise.
    """

    max_staleness: Sequence[int] = (0, 1, 2, 4, 8)
    push_every_steps: Sequence[int] = (1, 2, 4)
    pull_mode: Sequence[str] = ("between_requests", "in_flight")
    checkpoint_every_steps: Sequence[int] | None = None
    trainer_chips: Sequence[int] | None = None


@dataclass(frozen=True)
class TunePoint:
    """One candidate's settings and what the simulator predicts for them (means over
    seeds; ``samples_per_s_spread`` is their standard deviation, 0 for one seed)."""

    settings: dict[str, object]
    samples_per_s: float
    samples_per_s_spread: float
    goodput: float
    mean_staleness: float
    steps: int

    def row(self) -> dict[str, object]:
        """The settings and predictions as one flat dict (for a table)."""
        return {
            **self.settings,
            "samples_per_s": round(self.samples_per_s, 4),
            "spread": round(self.samples_per_s_spread, 4),
            "goodput": round(self.goodput, 4),
            "mean_staleness": round(self.mean_staleness, 3),
        }


@dataclass(frozen=True)
class TuneResult:
    """What :func:`tune` found.

    Attributes:
        best: The feasible candidate with the most trained samples per second.
        default: The scenario's own settings, simulated the same way.
        evaluated: Every candidate simulated, in the order they were.
        skipped: Candidates not simulated or not feasible, counted by reason.
        calibration_error: The relative error the caller gave for the simulator on this
            kind of run (e.g. ``abs(calibrate(...).errors()["samples_per_s"])``), or
            ``None``.
        default_breaks: The constraint the default settings break (``None``: they meet
            every one), so a negative gain buys that constraint.
    """

    best: TunePoint
    default: TunePoint
    evaluated: list[TunePoint]
    skipped: dict[str, int]
    calibration_error: float | None = None
    default_breaks: str | None = None

    @property
    def predicted_gain(self) -> float:
        """Trained samples per second of the best over the default's, minus one."""
        return self.best.samples_per_s / self.default.samples_per_s - 1

    @property
    def uncertainty(self) -> float:
        """The relative error of the predicted gain from what is known: the spread over
        seeds of both predictions, and the simulator's calibration error where given
        (added in quadrature; errors common to both settings cancel in part, so this is
        an upper estimate)."""
        parts = [
            self.best.samples_per_s_spread / self.best.samples_per_s,
            self.default.samples_per_s_spread / self.default.samples_per_s,
            self.calibration_error or 0.0,
        ]
        return math.sqrt(sum(p * p for p in parts))

    def table(self) -> str:
        """The default, the best and the change, as text."""
        from sim.studies.sweep import format_table

        label = "default" if self.default_breaks is None else "default (breaks constraint)"
        rows = [{"": label, **self.default.row()}, {"": "tuned", **self.best.row()}]
        lines = [
            format_table(rows),
            f"predicted gain in trained samples/s: {self.predicted_gain:+.1%} "
            f"(± {self.uncertainty:.1%}; {len(self.evaluated)} settings simulated)",
        ]
        if self.default_breaks is not None:
            lines.append(
                f"the default settings break {self.default_breaks}; the tuned ones meet "
                "every constraint"
            )
        if self.skipped:
            reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items()))
            lines.append(f"not taken: {reasons}")
        if self.calibration_error is None:
            lines.append(
                "how sure: the spread over seeds only; give calibration_error (from "
                "sim.calibrate on a real run of this config) to include the model's error"
            )
        return "\n".join(lines)


def tune(
    scenario: Scenario,
    space: TuneSpace | None = None,
    *,
    chips: int | None = None,
    seeds: Iterable[int] = (0, 1),
    max_mean_staleness: float | None = None,
    min_goodput: float | None = None,
    exhaustive: bool = False,
    max_passes: int = 3,
    calibration_error: float | None = None,
) -> TuneResult:
    """The settings of ``scenario`` that train the most samples per second.

    Args:
        scenario: The run to tune, with its preemptions (``preemptions`` or
            ``fault_plan``) and a stop rule (``target_steps`` or ``horizon_s``).
        space: The knobs' ranges (:class:`TuneSpace`).
        chips: A chip budget to split between the trainer and the workers (``None``:
            the scenario's split is kept unless ``space.trainer_chips`` is given; its
            total is then the budget).
        seeds: The seeds every candidate runs with; their spread is the prediction's
            noise.
        max_mean_staleness: Candidates whose mean staleness exceeds this are infeasible.
        min_goodput: Candidates whose goodput is below this are infeasible.
        exhaustive: Simulate the whole grid instead of coordinate ascent.
        max_passes: Coordinate-ascent passes at most.
        calibration_error: The simulator's relative error on this kind of run, carried
            into :attr:`TuneResult.uncertainty`.

    Returns:
        A :class:`TuneResult`.

    Raises:
        ValueError: when no candidate is feasible, naming the constraint that emptied
            the space (or the range that cannot be met).
    """
    space = space or TuneSpace()
    if max_mean_staleness is not None and not max_mean_staleness >= 0:
        raise ValueError(f"max_mean_staleness: must be >= 0, got {max_mean_staleness}")
    if min_goodput is not None and not 0 <= min_goodput <= 1:
        raise ValueError(f"min_goodput: must be in [0, 1], got {min_goodput}")
    if chips is not None and (not isinstance(chips, int) or chips < 2):
        raise ValueError(f"chips: must be an integer >= 2 (a trainer and a worker), got {chips}")
    seeds = tuple(seeds)
    if not seeds:
        raise ValueError("seeds: give at least one seed")
    ranges = _ranges(scenario, space, chips)
    evaluator = _Evaluator(scenario, seeds, chips, max_mean_staleness, min_goodput)
    start = {name: _current(scenario, name) for name in ranges}
    if "trainer.chips" in ranges and start["trainer.chips"] not in ranges["trainer.chips"]:
        start["trainer.chips"] = ranges["trainer.chips"][0]
    default = evaluator.point(_scenario_settings(scenario, ranges), as_is=True)
    if chips is not None and scenario.chips > chips:
        evaluator.mark(default, "chips")
    if exhaustive:
        names = list(ranges)
        for combination in itertools.product(*ranges.values()):
            evaluator.feasible(dict(zip(names, combination, strict=True)))
    else:
        _ascend(evaluator, start, ranges, max_passes)
    feasible = [p for p in evaluator.evaluated if evaluator.is_feasible(p)]
    if not feasible:
        raise ValueError(evaluator.why_empty())
    top = max(feasible, key=lambda p: p.samples_per_s)
    return TuneResult(
        best=top,
        default=default,
        evaluated=list(evaluator.evaluated),
        skipped=dict(evaluator.skipped),
        calibration_error=calibration_error,
        default_breaks=evaluator.violation_of(default),
    )


def _ascend(
    evaluator: _Evaluator,
    start: Mapping[str, object],
    ranges: Mapping[str, Sequence[object]],
    max_passes: int,
) -> None:
    """Coordinate ascent: each knob over its range with the others held, the best
    feasible value kept, until a pass changes nothing (or ``max_passes``)."""
    best = start
    for _ in range(max_passes):
        changed = False
        for name, values in ranges.items():
            found = []
            for value in values:
                settings = {**best, name: value}
                point = evaluator.feasible(settings)
                if point is not None:
                    found.append((point.samples_per_s, settings))
            if not found:
                continue
            top = max(found, key=lambda item: item[0])[1]
            if top != best:
                best, changed = top, True
        if not changed:
            return


def _ranges(scenario: Scenario, space: TuneSpace, chips: int | None) -> dict[str, list[object]]:
    ranges: dict[str, list[object]] = {
        "staleness.max_staleness": list(space.max_staleness),
        "weight_sync.push_every_steps": list(space.push_every_steps),
        "weight_sync.pull_mode": list(space.pull_mode),
    }
    checkpoint = space.checkpoint_every_steps
    if checkpoint is None:
        trainer_faults = scenario.preemptions.trainer_mtbf_s is not None or any(
            fault.kind == "preempt_trainer" for fault in scenario.fault_plan
        )
        checkpoint = DEFAULT_CHECKPOINT_STEPS if trainer_faults else ()
    ranges["checkpointing.every_steps"] = list(checkpoint)
    split = space.trainer_chips
    if split is None and chips is not None:
        split = sorted({max(1, round(chips * share)) for share in DEFAULT_TRAINER_SHARES})
    ranges["trainer.chips"] = list(split or ())
    for name, values in ranges.items():
        if len(values) != len(set(values)):
            raise ValueError(f"space.{name.split('.')[-1]}: values repeat, got {values}")
    return {name: values for name, values in ranges.items() if values}


def _current(scenario: Scenario, name: str) -> object:
    section, attribute = name.split(".")
    return getattr(getattr(scenario, section), attribute)


def _scenario_settings(scenario: Scenario, ranges: Mapping[str, object]) -> dict[str, object]:
    return {name: _current(scenario, name) for name in ranges}


@dataclass
class _Evaluator:
    """Simulates candidates once each (memoised) and keeps why the others fail."""

    scenario: Scenario
    seeds: tuple[int, ...]
    chips: int | None
    max_mean_staleness: float | None
    min_goodput: float | None
    evaluated: list[TunePoint] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    _memo: dict[tuple[tuple[str, object], ...], TunePoint | None] = field(default_factory=dict)
    _violations: dict[int, str] = field(default_factory=dict)  # id(point) -> constraint
    _closest: dict[str, TunePoint] = field(default_factory=dict)
    _refusals: dict[str, str] = field(default_factory=dict)  # field -> first message

    def mark(self, point: TunePoint, constraint: str) -> None:
        """Count ``point`` as breaking ``constraint`` (the default over a chip budget)."""
        self._violations[id(point)] = constraint

    def overrides(self, settings: Mapping[str, Any]) -> dict[str, object]:
        overrides = {k: v for k, v in settings.items() if k != "trainer.chips"}
        if "trainer.chips" in settings:
            trainer_chips = int(settings["trainer.chips"])
            budget = self.chips if self.chips is not None else self.scenario.chips
            per_worker = self.scenario.fleet.chips_per_worker
            workers = (budget - trainer_chips) // per_worker
            if workers < 1:
                raise ValueError(
                    f"chips: a budget of {budget} leaves no {per_worker}-chip worker beside "
                    f"a {trainer_chips}-chip trainer"
                )
            overrides["trainer.chips"] = trainer_chips
            overrides["fleet.num_workers"] = workers
        return overrides

    def point(self, settings: Mapping[str, object], *, as_is: bool = False) -> TunePoint:
        """Simulate ``settings`` with every seed (once; later calls reuse it).
        ``as_is``: the scenario's own fleet and trainer, whatever the chip budget."""
        key = (*_key(settings), ("as_is", as_is))
        known = self._memo.get(key)
        if known is not None:
            return known
        overrides = {k: v for k, v in settings.items() if k != "trainer.chips"}
        base = with_overrides(self.scenario, overrides if as_is else self.overrides(settings))
        results = [simulate(with_overrides(base, {"seed": seed})) for seed in self.seeds]
        rates = [r.samples_per_s for r in results]
        point = TunePoint(
            settings=dict(settings),
            samples_per_s=statistics.fmean(rates),
            samples_per_s_spread=statistics.stdev(rates) if len(rates) > 1 else 0.0,
            goodput=statistics.fmean(r.goodput for r in results),
            mean_staleness=statistics.fmean(r.mean_staleness for r in results),
            steps=min(r.steps for r in results),
        )
        self._memo[key] = point
        self.evaluated.append(point)
        violation = self._violation(point)
        if violation is not None:
            self._violations[id(point)] = violation
            self.skipped[f"{violation} not met"] += 1
            closest = self._closest.get(violation)
            if closest is None or _closer(violation, point, closest):
                self._closest[violation] = point
        return point

    def feasible(self, settings: Mapping[str, object]) -> TunePoint | None:
        """The candidate's prediction, or ``None`` when it cannot be run (a refused
        setting, counted by the field it names) or breaks a constraint."""
        key = (*_key(settings), ("as_is", False))
        if key in self._memo and self._memo[key] is None:
            return None
        try:
            point = self.point(settings)
        except ValueError as err:
            self._memo[key] = None
            name = str(err).split(":")[0]
            self.skipped[f"{name} refused"] += 1
            self._refusals.setdefault(name, str(err))
            return None
        return point if self.is_feasible(point) else None

    def is_feasible(self, point: TunePoint) -> bool:
        return id(point) not in self._violations

    def violation_of(self, point: TunePoint) -> str | None:
        return self._violations.get(id(point))

    def _violation(self, point: TunePoint) -> str | None:
        target = self.scenario.target_steps
        if target is not None and point.steps < target:
            return "target_steps"
        if self.max_mean_staleness is not None and point.mean_staleness > self.max_mean_staleness:
            return "max_mean_staleness"
        if self.min_goodput is not None and point.goodput < self.min_goodput:
            return "min_goodput"
        return None

    def why_empty(self) -> str:
        """Which constraint emptied the space, with the candidate that came closest."""
        if not self._closest:
            refused = "; ".join(self._refusals.values()) or "no candidate"
            return f"space: no setting could be simulated ({refused})"
        # The constraint that removed the most candidates is the one to relax.
        name = max(self._closest, key=lambda n: self.skipped[f"{n} not met"])
        closest = self._closest[name]
        if name == "max_mean_staleness":
            return (
                f"max_mean_staleness: no setting keeps mean staleness at or below "
                f"{self.max_mean_staleness}; the lowest was {closest.mean_staleness:.3g} "
                f"with {closest.settings} (raise the bound or add lower max_staleness values)"
            )
        if name == "min_goodput":
            return (
                f"min_goodput: no setting reaches goodput {self.min_goodput}; the highest "
                f"was {closest.goodput:.3g} with {closest.settings} (lower the bound, or "
                "checkpoint more often)"
            )
        return (
            f"target_steps: no setting reaches {self.scenario.target_steps} steps within "
            f"horizon_s = {self.scenario.horizon_s:g} s; the most was {closest.steps} with "
            f"{closest.settings} (raise horizon_s)"
        )


def _key(settings: Mapping[str, object]) -> tuple[tuple[str, object], ...]:
    return tuple(sorted(settings.items(), key=lambda item: item[0]))


def _closer(name: str, point: TunePoint, closest: TunePoint) -> bool:
    if name == "max_mean_staleness":
        return point.mean_staleness < closest.mean_staleness
    if name == "min_goodput":
        return point.goodput > closest.goodput
    return point.steps > closest.steps
