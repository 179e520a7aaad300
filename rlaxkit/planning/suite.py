"""Every program rlaxkit runs, compiled by XLA:TPU for a topology: the check that the
runtime's programs compile for a TPU at all, shared by the test suite and
``benchmarks/plan.py``.

For a small model, on a slice's devices as ``(1, devices / 2, 2)`` for the trainer and a
two-device worker, with the shardings the runtime and the planner use:

* ``train``, ``train_scan_remat``, ``train_lora``: ``make_train_step`` unrolled, scanned
  over layers with ``remat="full"``, and training LoRA adapters;
* ``prefill``, ``decode_view``, ``extend``, ``recompute``: the worker's ``start_rows``,
  ``decode_steps`` on a cache view, a multi-turn row's next observation
  (``extend_rows``) and the cache rebuilt when generation resumes under new weights
  (``recompute_cache``);
* ``publish``: the trainer's weights cast and laid out as a worker holds them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from rlaxkit.models import ModelConfig
from rlaxkit.models.lora import LoraConfig
from rlaxkit.planning.compile import _measure, _train_parts, publish_lowering, sampler_lowerings
from rlaxkit.planning.costs import ProgramCost
from rlaxkit.planning.specs import PlanConfig
from rlaxkit.planning.tpu import parse_topology, tpu_mesh

__all__ = ["RUNTIME_PROGRAMS", "compile_runtime_programs", "runtime_lowerings"]

RUNTIME_PROGRAMS = (
    "train",
    "train_scan_remat",
    "train_lora",
    "prefill",
    "decode_view",
    "extend",
    "recompute",
    "publish",
)


def runtime_lowerings(
    topology: str, model: ModelConfig, *, rows: int = 4, prompt_tokens: int = 8
) -> dict[str, Callable[[], Any]]:
    """``RUNTIME_PROGRAMS`` for ``model`` on ``topology``, each a thunk that lowers it.

    Sequences are ``2 · prompt_tokens`` long; the worker has ``rows`` slots (two
    samples per prompt) and its cache view is ``prompt_tokens`` slots.
    """
    top = parse_topology(topology)
    trainer = tpu_mesh(top, (1, top.devices // 2, 2))
    worker = tpu_mesh(top, (1, 1, 2), devices=2)
    plan = PlanConfig(
        mesh=(1, top.devices // 2, 2),
        rows=rows * top.devices // 2,
        prompt_tokens=prompt_tokens,
        completion_tokens=prompt_tokens,
    )
    plain = model.replace(scan_layers=False, param_dtype="float32")
    scanned = model.replace(scan_layers=True, param_dtype="float32")
    remat = dataclasses.replace(plan, remat="full")
    lora = LoraConfig(rank=4)

    def train(p: PlanConfig, m: ModelConfig, adapters: LoraConfig | None = None) -> Any:
        step, state, batch = _train_parts(p, m, trainer, p.rows, 1, lora=adapters)
        return lambda: step.lower(state, batch)

    sampler = sampler_lowerings(
        model.replace(param_dtype="bfloat16"),
        worker,
        rows=rows,
        prompt_tokens=prompt_tokens,
        completion_tokens=prompt_tokens,
        samples_per_prompt=2,
        view=prompt_tokens,
    )
    return {
        "train": train(plan, plain),
        "train_scan_remat": train(remat, scanned),
        "train_lora": train(plan, plain, lora),
        "prefill": sampler["prefill"],
        "decode_view": sampler["decode_view"],
        "extend": sampler["extend"],
        "recompute": sampler["recompute"],
        "publish": publish_lowering(scanned, trainer, 2, "bfloat16"),
    }


def compile_runtime_programs(
    topology: str, model: ModelConfig, names: tuple[str, ...] = RUNTIME_PROGRAMS
) -> dict[str, ProgramCost]:
    """``names`` of ``RUNTIME_PROGRAMS`` compiled for ``topology``: XLA:TPU's analyses."""
    lowerings = runtime_lowerings(topology, model)
    return {name: _measure(name, lowerings[name], 0) for name in names}
