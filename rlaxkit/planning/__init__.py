"""Plan a run before renting it: compile the real programs for the target mesh.

With ``target="v5p:4x4x4"`` (``rlaxkit plan --target``) XLA:TPU compiles them for that
TPU slice on this machine (libtpu, the ``rlaxkit[tpu]`` extra; ``rlaxkit.planning.tpu``):
memory is the TPU program's, exact for that compiler version, and the compiler's time
estimate gives the step time and MFU. Without a target, the forced-CPU path below is the
fallback, an XLA:CPU estimate of a TPU's program.

``plan(PlanConfig(...))`` (or ``rlaxkit plan CONFIG``) builds the train step and the
sampler's prefill and decode programs from abstract shapes for the plan's meshes,
compiles them with XLA on this machine's CPU (as many forced host devices as the larger
mesh, in a fresh process), and reads XLA's memory and cost analyses: per device, what
each program needs against the chip's HBM, whether it fits and what to change if not,
the FLOPs and time of a train step at an MFU, the KV-cache and push bytes, and the
simulator's inputs (``Plan.sim_overrides``). No weight is allocated.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from rlaxkit.config.io import apply_overrides, from_dict, to_dict
from rlaxkit.planning.chips import CHIPS, ChipSpec
from rlaxkit.planning.costs import Plan, ProgramCost, kv_bytes_per_token
from rlaxkit.planning.specs import MODEL_PRESETS, PlanConfig
from rlaxkit.planning.tpu import check_shardable, parse_topology, require_libtpu, tpu_mesh

__all__ = [
    "CHIPS",
    "MODEL_PRESETS",
    "ChipSpec",
    "Plan",
    "PlanConfig",
    "ProgramCost",
    "kv_bytes_per_token",
    "load_plan_config",
    "parse_topology",
    "plan",
    "tpu_mesh",
]

_DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S+")


def plan(config: PlanConfig | None = None, *, timeout_s: float = 1800.0, **fields: Any) -> Plan:
    """Compiles ``config``'s programs in a fresh process and reads them against its chip.

    The child process gets ``--xla_force_host_platform_device_count`` for the plan's
    devices in its own environment; this process's JAX and flags are untouched.

    Args:
        config: the run to plan; ``None`` builds one from ``fields``.
        timeout_s: give up after this long.
        **fields: ``PlanConfig`` fields (with ``config``: changes to it).

    Raises:
        ValueError: a bad field, named (before anything compiles), or a model the
            target's mesh cannot split.
        ImportError: a ``target`` without libtpu (the message names ``rlaxkit[tpu]``).
        RuntimeError: the compile process failed; the message ends with its stderr.
        TimeoutError: it ran past ``timeout_s`` (the message says what to change).
    """
    if config is None:
        config = PlanConfig(**fields)
    elif fields:
        config = from_dict(PlanConfig, {**to_dict(config), **fields})
    env = dict(os.environ)
    flags = _DEVICE_FLAG.sub("", env.get("XLA_FLAGS", "")).strip()
    if config.target:
        require_libtpu()
        axes = dict(zip(("data", "fsdp", "model"), config.mesh, strict=True))
        check_shardable(config.model_config(), axes)
        check_shardable(config.model_config(), {"model": config.sampler_chips})
        env["XLA_FLAGS"] = flags
        env["TPU_SKIP_MDS_QUERY"] = "1"
        env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # compile-only: no chip to guard
    else:
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={config.devices}"
        env["XLA_FLAGS"] = env["XLA_FLAGS"].strip()
    env["JAX_PLATFORMS"] = "cpu"
    start, children = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "rlaxkit.planning.compile"],
            input=json.dumps(to_dict(config)),
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise TimeoutError(
            f"compiling {', '.join(config.programs)} took over {timeout_s:.0f} s "
            "(timeout_s): allow longer (rlaxkit plan --timeout-s) or compile fewer "
            "programs (--set 'programs=[train]')"
        ) from None
    wall_s = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
    said = [ln for ln in done.stderr.splitlines() if ln.startswith("rlaxkit-plan-error: ")]
    if done.returncode != 0 and said:
        raise ValueError(said[-1].removeprefix("rlaxkit-plan-error: "))
    if done.returncode != 0:
        raise RuntimeError(f"compiling the plan failed:\n{done.stderr[-4000:]}")
    costs = json.loads(done.stdout.strip().splitlines()[-1])
    return Plan(
        config=config,
        model=config.model_config(),
        programs=tuple(from_dict(ProgramCost, c) for c in costs),
        wall_s=wall_s,
        cpu_s=cpu_s,
    )


def load_plan_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> PlanConfig:
    """A ``PlanConfig`` from a YAML file (or the defaults) with ``key=value`` overrides.

    >>> load_plan_config(None, ["model=qwen3-8b", "mesh=[1, 8, 2]"]).trainer_chips
    16
    """
    data = yaml.safe_load(Path(path).read_text()) if path else {}
    return from_dict(PlanConfig, apply_overrides(data or {}, list(overrides or [])))
