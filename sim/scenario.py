"""A Scenario bundles the entity specs, the shared policies, faults and the stop rule.

Scenarios round-trip through plain dicts and YAML (``configs/sim/*.yaml``), and
:func:`with_overrides` changes fields by dotted path (``"staleness.max_staleness"``),
which is how sweeps vary them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from rlaxkit.rules.fault_plan import FaultPlan
from rlaxkit.rules.paging import rows_that_fit
from rlaxkit.rules.policies import (
    BatchPolicy,
    CheckpointPolicy,
    RecoveryPolicy,
    StalenessPolicy,
    WeightSyncPolicy,
    check_admission,
)
from rlaxkit.rules.validation import check_int
from sim.distributions import distribution_from_dict, distribution_to_dict

if TYPE_CHECKING:
    from _typeshed import DataclassInstance
from sim.host_spec import HostSpec
from sim.plans import plan_overrides
from sim.specs import (
    CheckpointSpec,
    FleetSpec,
    ParamServerSpec,
    PreemptionSpec,
    TrainerCostSpec,
    VerifierSpec,
    WorkloadSpec,
)

__all__ = [
    "MAX_EXPECTED_PREEMPTIONS",
    "Scenario",
    "load_scenario",
    "paged_rows",
    "save_scenario",
    "scenario_from_dict",
    "scenario_to_dict",
    "with_overrides",
    "with_plan",
]

# Random preemptions are drawn as a plan over the whole horizon before a run starts
# (about 6 s per million on one core, plus their events); a scenario expecting more is
# refused rather than left to run for hours.
MAX_EXPECTED_PREEMPTIONS = 1_000_000

# Fault kinds the serial host replays (sim.entities.host); the others act inside the parameter
# server or the reward runner, which it does not model.
SERIAL_FAULT_KINDS = ("preempt_worker", "preempt_slice", "preempt_trainer", "slow_worker")

_SECTIONS: dict[str, type] = {
    "trainer": TrainerCostSpec,
    "fleet": FleetSpec,
    "param_server": ParamServerSpec,
    "verifier": VerifierSpec,
    "checkpoint": CheckpointSpec,
    "workload": WorkloadSpec,
    "staleness": StalenessPolicy,
    "weight_sync": WeightSyncPolicy,
    "checkpointing": CheckpointPolicy,
    "batching": BatchPolicy,
    "recovery": RecoveryPolicy,
    "preemptions": PreemptionSpec,
    "host": HostSpec,
}
_DISTRIBUTION_FIELDS = {
    "verifier": {"latency_s"},
    "workload": {
        "prompt_tokens",
        "response_tokens",
        "turns",
        "tool_latency_s",
        "observation_tokens",
        "pass_rate",
    },
}


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """Everything one simulated run needs.

    The policies are the very objects the runtime uses. ``staleness.batch_size`` must
    equal ``workload.prompts_per_step`` (both count prompt groups per step).

    Attributes:
        name: Label used in tables and figures.
        trainer, fleet, param_server, verifier, checkpoint, workload: Entity specs.
        staleness, weight_sync, checkpointing, batching, recovery: The shared
            ``rlaxkit.rules.policies`` objects (the last two default to what the runtime does:
            oldest groups first, equal-reward groups dropped, lost work re-issued).
        preemptions: Random preemptions (turned into a FaultPlan at start).
        host: How trainer and workers are scheduled: a parallel fleet (default) or
            the serial host of the deterministic local runtime (:mod:`sim.entities.host`).
        fault_plan: Explicit faults, added to the random ones.
        target_steps: Stop when the trainer reaches this version (``None``: run to the
            horizon).
        horizon_s: Stop at this simulated time at the latest.
        seed: Seed of every random stream of the run.
    """

    name: str = "scenario"
    trainer: TrainerCostSpec
    fleet: FleetSpec
    param_server: ParamServerSpec
    verifier: VerifierSpec = field(default_factory=VerifierSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    workload: WorkloadSpec
    staleness: StalenessPolicy
    weight_sync: WeightSyncPolicy = field(default_factory=WeightSyncPolicy)
    checkpointing: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    batching: BatchPolicy = field(default_factory=BatchPolicy)
    recovery: RecoveryPolicy = field(default_factory=RecoveryPolicy)
    preemptions: PreemptionSpec = field(default_factory=PreemptionSpec)
    host: HostSpec = field(default_factory=HostSpec)
    fault_plan: FaultPlan = field(default_factory=FaultPlan)
    target_steps: int | None = None
    horizon_s: float = 30 * 24 * 3600.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("seed", self.seed, minimum=0)
        if not isinstance(self.fault_plan, FaultPlan):
            raise ValueError(
                f"fault_plan: must be a FaultPlan, got {type(self.fault_plan).__name__}; "
                "build one from a list of faults with FaultPlan.from_dicts"
            )
        if self.staleness.batch_size != self.workload.prompts_per_step:
            raise ValueError(
                "staleness.batch_size: must equal workload.prompts_per_step "
                f"({self.workload.prompts_per_step}), got {self.staleness.batch_size}"
            )
        check_admission(self.staleness, self.weight_sync)
        preempts = self.preemptions
        random_faults = (preempts.worker_mtbf_s, preempts.slice_mtbf_s, preempts.trainer_mtbf_s)
        if self.host.serial and any(random_faults):
            # Random preemptions are drawn in simulated seconds; the serial host fires
            # faults on the runtime's logical clock of rounds, where those times mean
            # nothing the runtime would do.
            raise ValueError(
                "host.executor: 'serial' (the deterministic local runtime) replays faults "
                "on its logical clock of rounds, not random preemptions in simulated "
                "seconds; give them as explicit faults in fault_plan, or use executor "
                "'parallel'"
            )
        if self.host.serial and self.workload.multi_turn:
            # The deterministic loop runs single-turn requests only (run_episodes is
            # not part of it), so there is no runtime behaviour to replay.
            raise ValueError(
                "workload.turns: host.executor 'serial' (the deterministic local runtime) "
                "simulates single-turn requests only; multi-turn episodes with tools run "
                "on executor 'parallel' (or set workload.turns to 0)"
            )
        if self.host.serial:
            # The runtime's deterministic mode fires faults on its logical clock of
            # rounds, and so does the serial host; the kinds that act inside the
            # parameter server or the reward are not modelled there.
            for index, fault in enumerate(self.fault_plan):
                if fault.kind not in SERIAL_FAULT_KINDS:
                    raise ValueError(
                        f"fault_plan[{index}].kind: host.executor 'serial' simulates "
                        f"{SERIAL_FAULT_KINDS}, not {fault.kind!r}; use executor 'parallel'"
                    )
        if self.target_steps is not None and (
            not isinstance(self.target_steps, int) or self.target_steps < 1
        ):
            raise ValueError(f"target_steps: must be an integer >= 1, got {self.target_steps!r}")
        if not (isinstance(self.horizon_s, int | float) and 0 < self.horizon_s < math.inf):
            raise ValueError(f"horizon_s: must be a finite number > 0, got {self.horizon_s!r}")
        check_int("seed", self.seed)
        self._check_expected_preemptions()

    @property
    def expected_preemptions(self) -> float:
        """Random preemptions expected over the horizon: ``horizon_s · (num_workers /
        worker_mtbf_s + num_slices / slice_mtbf_s + 1 / trainer_mtbf_s)`` (terms whose
        MTBF is ``None`` left out; the mean gap is the MTBF for either law)."""
        return self.horizon_s * sum(count / mtbf for _, count, mtbf in self._preemption_rates())

    def _preemption_rates(self) -> list[tuple[str, int, float]]:
        """(MTBF field, targets, MTBF in seconds) of each kind of random preemption on."""
        spec, fleet = self.preemptions, self.fleet
        rates = [
            ("worker_mtbf_s", fleet.num_workers, spec.worker_mtbf_s),
            ("slice_mtbf_s", fleet.num_slices, spec.slice_mtbf_s),
            ("trainer_mtbf_s", 1, spec.trainer_mtbf_s),
        ]
        return [(name, count, mtbf) for name, count, mtbf in rates if mtbf is not None]

    def _check_expected_preemptions(self) -> None:
        expected = self.expected_preemptions
        if expected <= MAX_EXPECTED_PREEMPTIONS:
            return
        name, count, mtbf = max(self._preemption_rates(), key=lambda rate: rate[1] / rate[2])
        # The MTBF at which this kind alone expects the limit over the horizon.
        floor_s = self.horizon_s * count / MAX_EXPECTED_PREEMPTIONS
        raise ValueError(
            f"preemptions.{name}: {mtbf:g} s gives about {expected:.3g} random preemptions "
            f"over horizon_s = {self.horizon_s:g} s (horizon_s · targets / MTBF for each "
            f"kind), more than the {MAX_EXPECTED_PREEMPTIONS:,} a simulation takes; raise "
            f"preemptions.{name} (above {floor_s:.3g} s for {count} target(s)) or shorten "
            "horizon_s (the plan is drawn up to horizon_s even when target_steps ends the "
            "run sooner)"
        )

    @property
    def chips(self) -> int:
        """Trainer plus inference chips."""
        return self.trainer.chips + self.fleet.chips


def _section_to_dict(name: str, obj: DataclassInstance) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name in _DISTRIBUTION_FIELDS.get(name, ()):
            value = distribution_to_dict(value)
        out[f.name] = value
    return out


def scenario_to_dict(scenario: Scenario) -> dict[str, Any]:
    """Plain nested dict (YAML-ready) of a scenario."""
    out: dict[str, Any] = {"name": scenario.name}
    for section in _SECTIONS:
        out[section] = _section_to_dict(section, getattr(scenario, section))
    out["fault_plan"] = scenario.fault_plan.to_dicts()
    out["target_steps"] = scenario.target_steps
    out["horizon_s"] = scenario.horizon_s
    out["seed"] = scenario.seed
    return out


def _section_from_dict(name: str, data: object) -> Any:  # an instance of _SECTIONS[name]
    cls = _SECTIONS[name]
    if not isinstance(data, Mapping):
        raise ValueError(f"{name}: must be a mapping, got {type(data).__name__}")
    allowed = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, value in data.items():
        if key not in allowed:
            raise ValueError(f"{name}.{key}: unknown field; allowed: {sorted(allowed)}")
        if key in _DISTRIBUTION_FIELDS.get(name, ()):
            value = distribution_from_dict(value, where=f"{name}.{key}")
        values[key] = value
    try:
        return cls(**values)
    except ValueError as error:
        raise ValueError(f"{name}.{error}") from None
    except TypeError as error:
        raise ValueError(f"{name}: {error}") from None


def scenario_from_dict(data: Mapping[str, Any]) -> Scenario:
    """Build a scenario from a nested dict; errors name the section and field.

    A ``plan`` key (a stored plan's JSON, or a plan YAML beside its ``.plan.json``)
    replaces the costs a compiled plan gives (:func:`with_plan`): the trainer's
    step time, the workers' shape and decode cost, the push bytes."""
    if "plan" in data:
        rest = {k: v for k, v in data.items() if k != "plan"}
        return with_plan(scenario_from_dict(rest), data["plan"])
    allowed = {"name", "fault_plan", "target_steps", "horizon_s", "seed", "plan", *_SECTIONS}
    for key in data:
        if key not in allowed:
            raise ValueError(f"{key}: unknown scenario key; allowed: {sorted(allowed)}")
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key in _SECTIONS:
            values[key] = _section_from_dict(key, value)
        elif key == "fault_plan":
            values[key] = FaultPlan.from_dicts(value or [])
        elif key == "horizon_s":
            values[key] = float(value)
        else:
            values[key] = value
    return Scenario(**values)


def load_scenario(path: str | os.PathLike) -> Scenario:
    """Read a scenario YAML (see ``configs/sim/``)."""
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: a scenario file must hold a mapping")
    return scenario_from_dict(data)


def save_scenario(scenario: Scenario, path: str | os.PathLike) -> None:
    """Write a scenario as YAML."""
    text = yaml.safe_dump(scenario_to_dict(scenario), sort_keys=False)
    Path(path).write_text(text, encoding="utf-8")


def with_overrides(scenario: Scenario, overrides: Mapping[str, object]) -> Scenario:
    """A copy with fields replaced by dotted path, e.g. ``{"fleet.num_workers": 8}``.

    Setting ``workload.prompts_per_step`` also sets ``staleness.batch_size`` (they
    must agree) unless the latter is overridden too.
    """
    overrides = dict(overrides)
    if "workload.prompts_per_step" in overrides and "staleness.batch_size" not in overrides:
        overrides["staleness.batch_size"] = overrides["workload.prompts_per_step"]
    sections: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for path, value in overrides.items():
        head, _, rest = path.partition(".")
        if rest:
            if head not in _SECTIONS:
                raise ValueError(f"{path}: unknown section {head!r}; allowed: {sorted(_SECTIONS)}")
            sections.setdefault(head, {})[rest] = value
        else:
            top[head] = value
    for head, fields in sections.items():
        current = getattr(scenario, head)
        allowed = {f.name for f in dataclasses.fields(current)}
        for name in fields:
            if name not in allowed:
                raise ValueError(f"{head}.{name}: unknown field; allowed: {sorted(allowed)}")
        top[head] = dataclasses.replace(current, **fields)
    return dataclasses.replace(scenario, **top)


def with_plan(base: Scenario, plan: str | Path | Mapping[str, object]) -> Scenario:
    """``base`` with the costs of a compiled plan (``sim.plans``).

    ``plan`` is a plan's summary (``rlaxkit plan --json``, ``Plan.summary()``), the path
    of one stored as JSON, or the path of a plan YAML whose ``.plan.json`` sits beside
    it. Its ``sim_overrides`` set the trainer's step time, the workers' shape, per-step
    decode time per slot and prefill rate, the push bytes and, with ``total_chips``, the
    number of workers; every other number stays ``base``'s. The name gets
    ``_planned_tpu`` (an XLA:TPU plan) or ``_planned_cpu`` (an XLA:CPU one).

    Raises:
        ValueError: a YAML whose plan was never stored (the message gives the command),
            or a summary without ``sim_overrides``.
    """
    compiled, compiler = plan_overrides(plan)
    scenario = with_overrides(base, compiled)
    return with_overrides(scenario, {"name": f"{base.name}_planned_{compiler}"})


PAGED_LENGTH_DRAWS = 4096  # rows' lengths drawn to apply the page rule (seeded)


def paged_rows(scenario: Scenario) -> int:
    """Rows a worker with a paged KV cache decodes at once: the engine's page rule
    (``rlaxkit.rules.paging.rows_that_fit``) over the workload's prompt + completion lengths
    (completions capped at ``max_response_tokens``), at most ``slots_per_worker``."""
    fleet, workload = scenario.fleet, scenario.workload
    assert fleet.kv_pool_tokens is not None
    generator = np.random.default_rng(0)
    prompts = workload.prompt_tokens.sample_many(generator, PAGED_LENGTH_DRAWS)
    responses = workload.response_tokens.sample_many(generator, PAGED_LENGTH_DRAWS)
    if workload.max_response_tokens is not None:
        responses = np.minimum(responses, workload.max_response_tokens)
    lengths = np.ceil(prompts + responses).astype(int).tolist()
    rows = rows_that_fit(
        pool_tokens=fleet.kv_pool_tokens,
        page_size=fleet.page_size,
        row_tokens=lengths,
        max_rows=fleet.slots_per_worker,
    )
    return max(1, rows)
