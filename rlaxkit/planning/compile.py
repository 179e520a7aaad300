"""Compiles a plan's programs from abstract shapes and reads XLA's analyses.

Runs in a process of its own whose host platform was started with as many devices as
the largest mesh (``--xla_force_host_platform_device_count``; ``rlaxkit.planning.plan``
starts it): ``python -m rlaxkit.planning.compile < plan.json`` prints one JSON line of
``ProgramCost`` records. Nothing here allocates a weight: parameters, optimizer state,
batches and caches are ``jax.ShapeDtypeStruct``\\ s with their shardings.

Programs, each the one rlaxkit runs:

* ``train``: ``rlaxkit.trainer.make_train_step`` on the trainer's mesh;
* ``prefill``: ``rlaxkit.inference.programs.start_rows`` (prefill ``slots /
  samples_per_prompt`` prompts, start ``slots`` rows) on one worker's chips;
* ``decode``: ``rlaxkit.inference.programs.decode_steps`` (its loop body is one
  decode step for ``slots`` rows).

XLA's cost analysis counts a loop's body once, whatever its trip count, so the FLOPs of
a train step come from two small probes without loops: the same step, unscanned, with
one and with two layers, for one micro-batch and without remat; the per-layer
difference scales them to the model's depth and the micro-batch count
(``flops = micro_batches · (f₁ + (L − 1)(f₂ − f₁))``, the optimizer counted once per
micro-batch, a negligible excess). Memory is the real program's.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rlaxkit.algorithms import algorithm
from rlaxkit.batch import TrainBatch
from rlaxkit.configio import from_dict, to_dict
from rlaxkit.inference.config import SamplingConfig
from rlaxkit.inference.programs import decode_steps, init_state, start_rows
from rlaxkit.inference.results import StaticGraph
from rlaxkit.models import ModelConfig, abstract_model
from rlaxkit.planning.costs import ProgramCost
from rlaxkit.planning.specs import PlanConfig
from rlaxkit.trainer import (
    BATCH_AXES,
    TrainConfig,
    create_train_state,
    make_mesh,
    make_train_step,
    state_shardings,
)


def _with_shardings(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def _measure(name: str, lowered_fn: Any, devices: int) -> ProgramCost:
    start, start_cpu = time.perf_counter(), time.process_time()
    lowered = lowered_fn()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    compile_cpu_s = time.process_time() - start_cpu
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older JAX: one dict per computation
        cost = cost[0] if cost else {}
    return ProgramCost(
        name=name,
        devices=devices,
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        compile_s=compile_s,
        compile_cpu_s=compile_cpu_s,
    )


def _train_parts(plan: PlanConfig, model: ModelConfig, mesh: Mesh, rows: int, micro: int) -> Any:
    """``(train_step, abstract state, abstract batch)`` for ``model`` on ``mesh``."""
    graphdef = nnx.graphdef(abstract_model(model.replace(param_dtype=plan.compute_dtype)))
    params = nnx.state(abstract_model(model))
    cfg = TrainConfig(
        algorithm=algorithm("grpo", loss={"kl_coef": 0.1 if plan.reference else 0.0}),
        micro_batches=micro,
        remat=plan.remat,
        compute_dtype=plan.compute_dtype,
    )

    def create(params: Any) -> Any:
        ref = jax.tree.map(jnp.copy, params) if plan.reference else None
        return create_train_state(cfg, params, ref_params=ref)

    state = jax.eval_shape(create, params)
    state = _with_shardings(state, state_shardings(state, mesh))
    length = plan.length
    row_sharding = NamedSharding(mesh, P(BATCH_AXES))

    def spec(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=row_sharding)

    per_token = ("tokens", "attention_mask", "loss_mask", "behaviour_logprobs", "versions")
    dtypes = {"tokens": jnp.int32, "attention_mask": bool, "loss_mask": jnp.float32}
    dtypes |= {"behaviour_logprobs": jnp.float32, "versions": jnp.int32}
    dtypes |= {"rewards": jnp.float32, "group_ids": jnp.int32, "sequence_mask": bool}
    fields: dict[str, Any] = {
        name: spec((rows, length) if name in per_token else (rows,), dtype)
        for name, dtype in dtypes.items()
    }
    batch = TrainBatch(**fields)
    return make_train_step(cfg, graphdef, mesh=mesh), state, batch


def compile_train(plan: PlanConfig) -> list[ProgramCost]:
    """The train step's memory (the real program) and FLOPs (two probes, see above)."""
    model = plan.model_config()
    mesh = make_mesh(*plan.mesh)
    step, state, batch = _train_parts(plan, model, mesh, plan.rows, plan.micro_batches)
    real = _measure("train", lambda: step.lower(state, batch), plan.trainer_chips)
    probe_plan = dataclasses.replace(plan, remat="none")
    flops = []
    for layers in (1, 2):
        probe = model.replace(num_layers=layers, scan_layers=False)
        rows = plan.rows // plan.micro_batches
        p_step, p_state, p_batch = _train_parts(probe_plan, probe, mesh, rows, 1)
        cost = _measure(f"train_probe_{layers}", partial(p_step.lower, p_state, p_batch), 0)
        flops.append(cost.flops)
    per_layer = flops[1] - flops[0]
    total = plan.micro_batches * (flops[0] + (model.num_layers - 1) * per_layer)
    return [dataclasses.replace(real, flops=total, loop_flops=real.flops)]


def compile_sampler(plan: PlanConfig) -> list[ProgramCost]:
    """Prefill and one decode step of a worker with ``slots`` rows of ``length`` slots."""
    model = plan.model_config().replace(param_dtype=plan.compute_dtype)
    devices = jax.devices()[: plan.sampler_chips]
    mesh = make_mesh(1, 1, plan.sampler_chips, devices=devices)
    graphdef, params = nnx.split(abstract_model(model))
    params = _with_shardings(params, state_shardings(params, mesh))
    static = StaticGraph(graphdef)
    sampling = SamplingConfig(max_new_tokens=plan.completion_tokens, n=plan.samples_per_prompt)
    rows, width = plan.slots, plan.prompt_tokens
    state = jax.eval_shape(lambda: init_state(model, sampling, rows, width))
    kv = "model" if model.num_kv_heads % plan.sampler_chips == 0 else None

    def state_sharding(path: Any, leaf: Any) -> NamedSharding:
        # KV caches [rows, kv_heads, slots, head_dim] split their heads over the worker's
        # chips, as its attention heads are; everything else is small and replicated.
        names = {str(getattr(k, "name", getattr(k, "key", k))) for k in path}
        if "cache" in names and names & {"k", "v"} and leaf.ndim == 4:
            return NamedSharding(mesh, P(None, kv))
        return NamedSharding(mesh, P())

    state = _with_shardings(state, jax.tree_util.tree_map_with_path(state_sharding, state))
    replicated = NamedSharding(mesh, P())

    def spec(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=replicated)

    prompts = rows // plan.samples_per_prompt
    key_shape = jax.random.key_data(jax.random.key(0)).shape
    out = []
    if "prefill" in plan.programs:
        out.append(
            _measure(
                "prefill",
                lambda: start_rows.lower(
                    static,
                    params,
                    state,
                    spec((prompts, width), jnp.int32),
                    spec((prompts,), jnp.int32),
                    spec((rows,), jnp.int32),
                    spec((rows,), jnp.int32),
                    spec((rows, *key_shape), jnp.uint32),
                    spec((rows,), jnp.int32),
                    spec((rows,), jnp.int32),
                ),
                plan.sampler_chips,
            )
        )
    if "decode" in plan.programs:
        jitted = jax.jit(decode_steps, static_argnames=("graphdef", "config"), donate_argnums=2)
        scalar = spec((), jnp.int32)
        out.append(
            _measure(
                "decode",
                lambda: jitted.lower(
                    static, params, state, scalar, scalar, scalar, config=sampling
                ),
                plan.sampler_chips,
            )
        )
    return out


def compile_programs(plan: PlanConfig) -> list[ProgramCost]:
    """Every program ``plan.programs`` names, compiled for this process's devices."""
    if jax.device_count() < plan.devices:
        raise ValueError(
            f"the plan needs {plan.devices} devices, this process has {jax.device_count()}: "
            "run it through rlaxkit.planning.plan, which starts a process with enough"
        )
    out = compile_train(plan) if "train" in plan.programs else []
    if {"prefill", "decode"} & set(plan.programs):
        out += compile_sampler(plan)
    return out


def main() -> int:
    plan = from_dict(PlanConfig, json.loads(sys.stdin.read()))
    costs = compile_programs(plan)
    print(json.dumps([to_dict(c) for c in costs]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
