"""How the trainer lays its state and batches over a mesh (axes ``data``, ``fsdp``,
``model``): parameters by name (column- and row-parallel projections), rows over
``data × fsdp``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rlaxkit.data.batch import TrainBatch
from rlaxkit.models import is_stacked
from rlaxkit.trainer.state import TrainState

MESH_AXES = ("data", "fsdp", "model")


BATCH_AXES = ("data", "fsdp")


_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")


_ROW_PARALLEL = ("o_proj", "down_proj")


def make_mesh(
    data: int = 1, fsdp: int = 1, model: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ``(data, fsdp, model)`` mesh with automatic (GSPMD) sharding propagation."""
    devices = list(devices if devices is not None else jax.devices())[: data * fsdp * model]
    return jax.make_mesh(
        (data, fsdp, model), MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices
    )


def _path_names(path: Sequence[object]) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def param_partition_spec(path: Sequence[object], shape: tuple[int, ...], mesh: Mesh) -> P:
    """Sharding of one parameter (or optimizer moment) from its path and shape.

    Column-parallel kernels ``[in, out]`` (q/k/v, gate/up, LM head) put ``fsdp`` on
    ``in`` and ``model`` on ``out``; row-parallel ones (o, down) the reverse; the
    embedding puts ``model`` on the vocabulary and ``fsdp`` on the width. Other
    matrices shard their largest dimension over ``fsdp``; vectors and scalars are
    replicated. An axis that does not divide its dimension is dropped. Stacked blocks
    (``ModelConfig.scan_layers``) keep their leading layer axis whole and shard the rest
    as one layer's parameter.
    """
    names = _path_names(path)
    if is_stacked(path) and len(shape) >= 1:
        return P(None, *_layer_partition_spec(names, tuple(shape[1:]), mesh))
    return _layer_partition_spec(names, tuple(shape), mesh)


def _layer_partition_spec(names: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    """``param_partition_spec`` of one layer's parameter (no layer axis)."""
    if len(shape) < 2:
        return P()
    axes: list[str | None]
    if any(n in _COLUMN_PARALLEL for n in names):
        axes = ["fsdp", "model"]
    elif any(n in _ROW_PARALLEL for n in names) or "embed_tokens" in names:
        axes = ["model", "fsdp"]
    else:
        axes = [None] * len(shape)
        axes[int(np.argmax(shape))] = "fsdp"
    axes += [None] * (len(shape) - len(axes))
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    return P(*(a if a and shape[i] % sizes[a] == 0 else None for i, a in enumerate(axes)))


def state_shardings(tree: object, mesh: Mesh) -> object:
    """``NamedSharding`` of every leaf of a state (or any parameter-shaped tree)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_partition_spec(path, jnp.shape(x), mesh)), tree
    )


def shard_train_state(state: TrainState, mesh: Mesh) -> TrainState:
    """Places ``state`` on ``mesh`` with ``state_shardings``."""
    return jax.device_put(state, state_shardings(state, mesh))


def shard_batch(batch: TrainBatch, mesh: Mesh) -> TrainBatch:
    """Places ``batch`` on ``mesh``, rows split over ``data × fsdp``."""
    return jax.device_put(batch, NamedSharding(mesh, P(BATCH_AXES)))


def constrain_rows(tree: object, mesh: Mesh | None, leading: int = 0) -> object:
    """Every leaf's rows (after ``leading`` chunk axes) split over ``data × fsdp``."""
    if mesh is None:
        return tree
    spec = P(*([None] * leading), BATCH_AXES)
    return jax.lax.with_sharding_constraint(tree, NamedSharding(mesh, spec))


def constrain_logits(logits: jax.Array, mesh: Mesh | None) -> jax.Array:
    """Logits ``[rows, T, vocab]`` with rows over ``data × fsdp`` and the vocabulary over
    ``model``, as the LM head's kernel splits it (``mesh`` None: unchanged).

    Unconstrained, GSPMD met the kernel's ``fsdp``-split width by gathering every row of
    a micro-batch onto each device (docs/running_at_scale.md has XLA:TPU's memory
    analysis of both).
    """
    if mesh is None:
        return logits
    vocab = "model" if logits.shape[-1] % mesh.shape.get("model", 1) == 0 else None
    return jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P(BATCH_AXES, None, vocab)))


def constrain_stream(hidden: jax.Array, mesh: Mesh | None) -> jax.Array:
    """The residual stream ``[rows, T, hidden]`` between blocks: rows over ``data ×
    fsdp`` and the tokens over ``model`` (sequence parallelism; ``mesh`` None or ``T``
    not divisible by ``model``: unchanged).

    It is what ``remat="full"`` keeps of each layer, so split only by rows every
    ``model`` device held a whole copy of it per layer. GSPMD gathers the tokens before
    attention and the MLP and scatters them after, where it would otherwise all-reduce.
    """
    model = mesh.shape.get("model", 1) if mesh is not None else 1
    if mesh is None or model == 1 or hidden.shape[1] % model:
        return hidden
    return jax.lax.with_sharding_constraint(hidden, NamedSharding(mesh, P(BATCH_AXES, "model")))


def batch_shards(mesh: Mesh) -> int:
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    return math.prod(sizes.get(a, 1) for a in BATCH_AXES)
