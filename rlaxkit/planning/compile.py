"""Compiles a plan's programs from abstract shapes and reads XLA's analyses.

Runs in a process of its own whose host platform was started with as many devices as
the largest mesh (``--xla_force_host_platform_device_count``; ``rlaxkit.planning.plan``
starts it): ``python -m rlaxkit.planning.compile < plan.json`` prints one JSON line of
``ProgramCost`` records. Nothing here allocates a weight: parameters, optimizer state,
batches and caches are ``jax.ShapeDtypeStruct``\\ s with their shardings.

Programs, each the one rlaxkit runs:

* ``train``: ``rlaxkit.trainer.step.make_train_step`` on the trainer's mesh;
* ``prefill``: ``rlaxkit.inference.programs.start_rows`` (prefill ``slots /
  samples_per_prompt`` prompts, start ``slots`` rows) on one worker's chips;
* ``decode``: ``rlaxkit.inference.programs.decode_steps`` (its loop body is one
  decode step for ``slots`` rows);
* ``publish``: the trainer's parameters cast to the compute dtype and laid out as a
  worker of ``sampler_chips`` holds them (split over ``model`` only), on the trainer's
  chips: what a push gathers before the bytes leave the slice.

With stacked blocks (``scan_layers``) prefill and decode scan the layers over a stacked
dense KV cache, as an engine with a dense cache then does (a paged cache keeps one pool
per layer), and their FLOPs and time come from probes like the train step's (below).

With ``plan.target`` the devices are a TPU topology's compile-only devices
(``rlaxkit.planning.tpu``) and XLA:TPU compiles; its cost analysis adds
``optimal_seconds``, the compiler's time estimate, read like the FLOPs (the train step's
from the probes, with the plan's remat so that recomputation is timed too).

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
import re
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rlaxkit.algorithms import algorithm
from rlaxkit.config.io import from_dict, to_dict
from rlaxkit.data.batch import TrainBatch
from rlaxkit.inference.config import SamplingConfig
from rlaxkit.inference.programs import (
    _decode_steps,
    extend_rows,
    init_state,
    recompute_cache,
    start_rows,
    step_config,
)
from rlaxkit.inference.results import StaticGraph
from rlaxkit.models import ModelConfig, abstract_model
from rlaxkit.models.lora import LoraConfig
from rlaxkit.planning.costs import ProgramCost
from rlaxkit.planning.specs import PlanConfig, Remat
from rlaxkit.planning.tpu import parse_topology, topology_for, tpu_mesh
from rlaxkit.trainer.config import TrainConfig
from rlaxkit.trainer.sharding import BATCH_AXES, make_mesh, state_shardings
from rlaxkit.trainer.state import create_train_state
from rlaxkit.trainer.step import make_train_step


def _with_shardings(tree: object, shardings: object) -> Any:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


_BYTES = re.compile(r"([0-9.]+)([KMGT])\b")
_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def _out_of_memory(name: str, devices: int, err: Exception, seconds: float) -> ProgramCost:
    """XLA:TPU refuses a program that needs more than the chip's HBM: its message says
    how much (``... HLO temporaries (61.32G) exceeds available HBM (15.75G)``)."""
    text = str(err)
    sizes = [float(n) * _UNITS[u] for n, u in _BYTES.findall(text)]
    return ProgramCost(
        name=name,
        devices=devices,
        argument_bytes=0,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=int(sizes[0]) if sizes else 0,
        flops=0.0,
        bytes_accessed=0.0,
        compile_s=seconds,
        compiled=False,
        refusal=text.strip().splitlines()[0][:400],
    )


def _measure(name: str, lowered_fn: Any, devices: int) -> ProgramCost:
    start, start_cpu = time.perf_counter(), time.process_time()
    lowered = lowered_fn()
    try:
        compiled = lowered.compile()
    except Exception as err:  # XLA:TPU's "does not fit": a verdict, not a failure
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        return _out_of_memory(name, devices, err, time.perf_counter() - start)
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
        # XLA:TPU says -1 where it has no model of an op (LoRA's small matmuls): unknown.
        optimal_s=max(float(cost.get("optimal_seconds", 0.0)), 0.0),
        compile_s=compile_s,
        compile_cpu_s=compile_cpu_s,
    )


def _train_parts(
    plan: PlanConfig,
    model: ModelConfig,
    mesh: Mesh,
    rows: int,
    micro: int,
    lora: LoraConfig | None = None,
) -> Any:
    """``(train_step, abstract state, abstract batch)`` for ``model`` on ``mesh``."""
    graphdef = nnx.graphdef(abstract_model(model.replace(param_dtype=plan.compute_dtype)))
    params = nnx.state(abstract_model(model))
    cfg = TrainConfig(
        algorithm=algorithm("grpo", loss={"kl_coef": 0.1 if plan.reference else 0.0}),
        micro_batches=micro,
        remat=plan.remat,
        compute_dtype=plan.compute_dtype,
        lora=lora,
    )

    def create(params: object) -> Any:
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


def trainer_mesh(plan: PlanConfig) -> Mesh:
    """The trainer's ``(data, fsdp, model)`` mesh: the target's devices, or the host's."""
    if plan.target:
        return tpu_mesh(plan.target, plan.mesh)
    return make_mesh(*plan.mesh)


def worker_mesh(plan: PlanConfig) -> Mesh:
    """One worker's ``(1, 1, sampler_chips)`` mesh: the first devices of the smallest
    slice of the target's generation that holds them, or the host's."""
    if plan.target:
        gen = parse_topology(plan.target).generation
        chips = -(-plan.sampler_chips // gen.devices_per_chip)
        slice_chips = max(4, 1 << (chips - 1).bit_length())
        top = topology_for(gen.name, slice_chips)
        return tpu_mesh(top, (1, 1, plan.sampler_chips), devices=plan.sampler_chips)
    return make_mesh(1, 1, plan.sampler_chips, devices=jax.devices()[: plan.sampler_chips])


def _scaled(first: float, second: float, layers: int, micro: int) -> float:
    """A whole step from probes of one and two layers: ``micro · (f₁ + (L − 1)(f₂ − f₁))``."""
    return micro * (first + (layers - 1) * (second - first))


def _timed(one: ProgramCost, two: ProgramCost) -> bool:
    """Both probes have XLA:TPU's time: one without (0, from a refusal or an estimate this
    libtpu does not give) would scale to a wrong or negative time, so it stays unknown."""
    return one.compiled and two.compiled and one.optimal_s > 0 and two.optimal_s > 0


def _probes(plan: PlanConfig, mesh: Mesh, remat: Remat) -> tuple[ProgramCost, ProgramCost]:
    model = plan.model_config()
    probe_plan = dataclasses.replace(plan, remat=remat)
    out = []
    for layers in (1, 2):
        probe = model.replace(num_layers=layers, scan_layers=False)
        rows = plan.rows // plan.micro_batches
        p_step, p_state, p_batch = _train_parts(probe_plan, probe, mesh, rows, 1)
        out.append(_measure(f"train_probe_{layers}", partial(p_step.lower, p_state, p_batch), 0))
    return out[0], out[1]


def compile_train(plan: PlanConfig) -> list[ProgramCost]:
    """The train step's memory (the real program) and FLOPs and time (probes, see above;
    none when XLA:TPU refuses the real program as not fitting: a time for a step that
    cannot run is no plan, and the probes cost as much to compile as the step)."""
    model = plan.model_config()
    mesh = trainer_mesh(plan)
    step, state, batch = _train_parts(plan, model, mesh, plan.rows, plan.micro_batches)
    real = _measure("train", lambda: step.lower(state, batch), plan.trainer_chips)
    if not real.compiled:  # refused as not fitting: no time to estimate, probes skipped
        return [real]
    one, two = _probes(plan, mesh, "none")
    layers, micro = model.num_layers, plan.micro_batches
    # A probe XLA:TPU refused (without remat, a layer's activations at the plan's length
    # may not fit) has no figures: 0, unknown, rather than a difference with nothing.
    total = _scaled(one.flops, two.flops, layers, micro) if one.compiled and two.compiled else 0.0
    # Recomputation takes time, not model FLOPs: probes with the plan's remat time it,
    # unless both probes compiled and this libtpu gave neither a time (its v5e and v6e
    # train steps): those two compiles would say nothing.
    untimed = one.compiled and two.compiled and not _timed(one, two)
    if plan.remat != "none" and plan.target and not untimed:
        one, two = _probes(plan, mesh, plan.remat)
    seconds = _scaled(one.optimal_s, two.optimal_s, layers, micro) if _timed(one, two) else 0.0
    return [
        dataclasses.replace(
            real,
            flops=total,
            loop_flops=real.flops,
            optimal_s=seconds,
            loop_optimal_s=real.optimal_s,
        )
    ]


def compile_publish(plan: PlanConfig) -> list[ProgramCost]:
    """The trainer's parameters in the compute dtype, split as a worker holds them."""
    lower = publish_lowering(
        plan.model_config(), trainer_mesh(plan), plan.sampler_chips, plan.compute_dtype
    )
    return [_measure("publish", lower, plan.trainer_chips)]


def sampler_lowerings(
    model: ModelConfig,
    mesh: Mesh,
    *,
    rows: int,
    prompt_tokens: int,
    completion_tokens: int,
    samples_per_prompt: int,
    view: int | None = None,
) -> dict[str, Callable[[], Any]]:
    """The worker's programs for ``rows`` slots on ``mesh``, each a thunk that lowers it.

    ``prefill`` (``start_rows``), ``decode`` (``decode_steps`` on the whole cache),
    ``decode_view`` (on its first ``view`` slots, the engine's cache views), ``extend``
    (a multi-turn row's next observation, ``extend_rows``) and ``recompute`` (the cache
    rebuilt under new weights when generation resumes, ``recompute_cache``). ``model``'s
    ``param_dtype`` is the worker's weights' and cache's.
    """
    graphdef, params = nnx.split(abstract_model(model))
    params = _with_shardings(params, state_shardings(params, mesh))
    static = StaticGraph(graphdef)
    sampling = SamplingConfig(max_new_tokens=completion_tokens, n=samples_per_prompt)
    width = prompt_tokens
    state = jax.eval_shape(lambda: init_state(model, sampling, rows, width))
    model_size = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True)).get("model", 1)
    kv = "model" if model.num_kv_heads % model_size == 0 else None

    def state_sharding(path: Any, leaf: Any) -> NamedSharding:
        # KV caches [rows, kv_heads, slots, head_dim] (stacked: [layers, rows, ...]) split
        # their heads over the worker's chips, as its attention heads are; everything
        # else is small and replicated.
        names = {str(getattr(k, "name", getattr(k, "key", k))) for k in path}
        if "cache" in names and names & {"k", "v"} and leaf.ndim in (4, 5):
            return NamedSharding(mesh, P(*[None] * (leaf.ndim - 3), kv))
        return NamedSharding(mesh, P())

    state = _with_shardings(state, jax.tree_util.tree_map_with_path(state_sharding, state))
    replicated = NamedSharding(mesh, P())

    def spec(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=replicated)

    prompts = rows // samples_per_prompt
    key_shape = jax.random.key_data(jax.random.key(0)).shape
    row_ints = spec((rows,), jnp.int32)
    keys = spec((rows, *key_shape), jnp.uint32)
    scalar = spec((), jnp.int32)
    decode = partial(_decode_steps.lower, static, params, state, scalar, scalar, scalar)
    step_cfg = step_config(sampling)
    return {
        "prefill": lambda: start_rows.lower(
            static,
            params,
            state,
            spec((prompts, width), jnp.int32),
            spec((prompts,), jnp.int32),
            row_ints,
            row_ints,
            keys,
            row_ints,
            row_ints,
        ),
        "decode": lambda: decode(config=step_cfg, view=None),
        "decode_view": lambda: decode(config=step_cfg, view=view or max(1, width // 2)),
        "extend": lambda: extend_rows.lower(
            static,
            params,
            state,
            spec((rows, width), jnp.int32),
            row_ints,
            row_ints,
            keys,
            row_ints,
            row_ints,
        ),
        "recompute": lambda: recompute_cache.lower(static, params, state),
    }


def compile_sampler(plan: PlanConfig) -> list[ProgramCost]:
    """Prefill and one decode step of a worker with ``slots`` rows of ``length`` slots.

    Stacked blocks prefill and decode in a layer scan whose body XLA counts once: memory
    is the real program's, FLOPs and time come from probes of one and two per-layer
    blocks (the same programs, unrolled), scaled to the depth as the train step's are."""
    model = plan.model_config().replace(param_dtype=plan.compute_dtype)
    mesh = worker_mesh(plan)

    def lowerings(model: ModelConfig) -> dict[str, Callable[[], object]]:
        return sampler_lowerings(
            model,
            mesh,
            rows=plan.slots,
            prompt_tokens=plan.prompt_tokens,
            completion_tokens=plan.completion_tokens,
            samples_per_prompt=plan.samples_per_prompt,
        )

    names = [name for name in ("prefill", "decode") if name in plan.programs]
    real = lowerings(model)
    out = [_measure(name, real[name], plan.sampler_chips) for name in names]
    if not model.scan_layers or model.num_layers == 1:
        return out
    probes = [lowerings(model.replace(num_layers=n, scan_layers=False)) for n in (1, 2)]
    layers = model.num_layers
    for i, cost in enumerate(out):
        if not cost.compiled:
            continue
        one, two = (_measure(f"{cost.name}_probe", p[cost.name], 0) for p in probes)
        out[i] = dataclasses.replace(
            cost,
            flops=_scaled(one.flops, two.flops, layers, 1),
            bytes_accessed=_scaled(one.bytes_accessed, two.bytes_accessed, layers, 1),
            loop_flops=cost.flops,
            optimal_s=_scaled(one.optimal_s, two.optimal_s, layers, 1) if _timed(one, two) else 0.0,
            loop_optimal_s=cost.optimal_s,
        )
    return out


def publish_lowering(model: ModelConfig, mesh: Mesh, sampler_chips: int, dtype: str) -> Any:
    """A thunk lowering the publish program: ``model``'s parameters, sharded as the
    trainer holds them on ``mesh``, cast to ``dtype`` and split over ``model`` only in
    groups of ``sampler_chips`` devices (a worker's layout, one copy per group)."""
    params = nnx.state(abstract_model(model))
    params = _with_shardings(params, state_shardings(params, mesh))
    devices = mesh.devices.size
    if devices % sampler_chips:
        raise ValueError(
            f"sampler_chips: {sampler_chips} must divide the trainer's {devices} devices "
            "to plan the publish program"
        )
    grid = mesh.devices.reshape(devices // sampler_chips, 1, sampler_chips)
    worker_layout = state_shardings(params, Mesh(grid, mesh.axis_names))
    cast_to = jnp.dtype(dtype)
    cast = jax.jit(
        lambda p: jax.tree.map(lambda x: x.astype(cast_to), p), out_shardings=worker_layout
    )
    return lambda: cast.lower(params)


def compile_programs(plan: PlanConfig) -> list[ProgramCost]:
    """Every program ``plan.programs`` names, compiled for this process's devices."""
    if not plan.target and jax.device_count() < plan.devices:
        raise ValueError(
            f"the plan needs {plan.devices} devices, this process has {jax.device_count()}: "
            "run it through rlaxkit.planning.plan, which starts a process with enough"
        )
    out = compile_train(plan) if "train" in plan.programs else []
    if {"prefill", "decode"} & set(plan.programs):
        out += compile_sampler(plan)
    if "publish" in plan.programs:
        out += compile_publish(plan)
    return out


def main() -> int:
    plan = from_dict(PlanConfig, json.loads(sys.stdin.read()))
    try:
        costs = compile_programs(plan)
    except (ValueError, ImportError) as err:  # one line for the parent to raise again
        print(f"rlaxkit-plan-error: {err}", file=sys.stderr)
        return 2
    print(json.dumps([to_dict(c) for c in costs]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
