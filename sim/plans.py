"""A compiled plan's costs as a scenario's overrides.

``rlaxkit plan`` compiles a run's programs and summarises what follows for the simulator
(``Plan.sim_overrides()``: dotted paths such as ``"trainer.flops_per_token_factor"``).
This module checks those paths against the fields a plan may set and reads a stored
plan's summary back. It deals in plain dicts and knows nothing of a ``Scenario``: the
scenario's ``plan:`` key (``sim.scenario.with_plan``) and the presets
(``sim.presets.planned``, ``from_plan``) apply what it returns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["PLANNED_FIELDS", "check_planned", "plan_overrides", "read_plan_summary"]

# The fields a plan may set: trainer throughput, worker shape and decode cost, push size.
PLANNED_FIELDS = frozenset(
    {
        "trainer.chips",
        "trainer.model_params",
        "trainer.chip_flops",
        "trainer.mfu",
        "trainer.flops_per_token_factor",
        "fleet.chips_per_worker",
        "fleet.slots_per_worker",
        "fleet.decode_s_per_token",
        "fleet.decode_s_per_token_per_seq",
        "fleet.prefill_tokens_per_s",
        "fleet.num_workers",
        "param_server.weight_bytes",
    }
)


def check_planned(compiled: Mapping[str, object]) -> dict[str, object]:
    """``compiled`` (``Plan.sim_overrides()``) as overrides, every key a plan output.

    >>> check_planned({"trainer.mfu": 0.5})
    {'trainer.mfu': 0.5}

    Raises:
        ValueError: a key that is not one of ``PLANNED_FIELDS``.
    """
    unknown = sorted(set(compiled) - PLANNED_FIELDS)
    if unknown:
        raise ValueError(
            f"compiled: {unknown} are not plan outputs; allowed: {sorted(PLANNED_FIELDS)}"
        )
    return dict(compiled)


def plan_overrides(plan: str | Path | Mapping[str, object]) -> tuple[dict[str, object], str]:
    """A plan's checked overrides and its compiler: ``"tpu"`` for an XLA:TPU plan (the
    TPU compiler's estimates), ``"cpu"`` for an XLA:CPU one (the labelled fallback).

    ``plan`` is as :func:`read_plan_summary` takes it.

    Raises:
        ValueError: as :func:`read_plan_summary`, a summary without ``sim_overrides``, or
            an override that is not a plan output.
    """
    summary = read_plan_summary(plan)
    if "sim_overrides" not in summary:
        raise ValueError("plan: not a plan summary (no 'sim_overrides'); use rlaxkit plan --json")
    compiled = check_planned(summary["sim_overrides"])
    compiler = str(summary.get("compiler", "XLA:CPU estimate"))
    return compiled, "tpu" if compiler.startswith("XLA:TPU") else "cpu"


def read_plan_summary(plan: str | Path | Mapping[str, object]) -> Mapping[str, Any]:
    """A plan's summary: ``plan`` itself (``rlaxkit plan --json``, ``Plan.summary()``), the
    path of one stored as JSON, or the path of a plan YAML whose ``.plan.json`` sits
    beside it. Reading a stored plan compiles nothing.

    Raises:
        ValueError: a YAML whose plan was never stored (the message gives the command),
            a missing file, or a file that does not hold a summary.
    """
    if isinstance(plan, Mapping):
        return plan
    path = Path(plan)
    if path.suffix in (".yaml", ".yml"):
        stored = path.with_name(path.name.rsplit(".", 1)[0] + ".plan.json")
        if not stored.is_file():
            raise ValueError(
                f"plan: {path} has no stored result {stored.name}; compile it once with "
                f"`rlaxkit plan {path} --json > {stored}`"
            )
        path = stored
    if not path.is_file():
        raise ValueError(f"plan: no such file {path}")
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, Mapping):
        raise ValueError(f"plan: {path} does not hold a plan summary")
    return data
