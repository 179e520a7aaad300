"""The trainer: ``TrainState``, AdamW, and one jitted, sharded RL train step.

``make_train_step(cfg, graphdef)`` returns ``train_step(state, batch) -> (state, metrics)``.
One call consumes one ``TrainBatch`` (one weight version):

1. **Before any update** (no gradients), in micro-batch chunks: reference log-probs
   (when a KL needs them), proximal log-probs (``proximal='recompute'``, AReaL's
   decoupled PPO; with a single update per step, ``epochs = mini_batches = 1``, they
   are taken from the update's own forward pass instead, which runs under the same
   weights) and critic values (GAE); then advantages over the *whole* batch. The
   result is a ``PreparedBatch`` (``make_prepare_fn`` returns it).
2. **Updates**: ``epochs`` passes; each splits the rows into ``mini_batches`` optimizer
   steps, and each mini-batch into ``micro_batches`` whose gradients are summed with
   ``lax.scan``. Loss weights are normalised over the mini-batch, so the summed
   gradient equals the mini-batch gradient. Mini-batch ``m`` / micro-batch ``u`` takes
   the rows ``r`` with ``r mod (mini_batches·micro_batches) = m·micro_batches + u``
   (strided, so every device keeps an equal share of every micro-batch).

The state is donated; the weight version is ``state.step`` (train steps done). With a
``Mesh`` (axes ``data``, ``fsdp``, ``model``) rows are split over ``data × fsdp``,
parameters are sharded by ``param_partition_spec`` and the step pins its output state to
the same layout, so step ``n + 1`` reuses step ``n``'s program.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rlaxkit.algorithms import (
    AdvantageInputs,
    AlgorithmConfig,
    DistillConfig,
    LossInputs,
    aggregation_weights,
    compute_advantages,
    distillation_advantages,
    rejection_mask,
    rl_loss,
)
from rlaxkit.data.batch import TrainBatch
from rlaxkit.models import (
    REMAT_POLICIES,
    RematPolicy,
    abstract_model,
    is_stacked,
    positions_from_mask,
)
from rlaxkit.models.lora import LoraConfig, init_adapters, merge_adapters
from rlaxkit.observe.drift import DriftProbe
from rlaxkit.rules.validation import check_int, check_number, is_number
from rlaxkit.trainer.logprobs import logprobs_and_entropy
from rlaxkit.util.jaxutil import Packed, TieredJit

MESH_AXES = ("data", "fsdp", "model")
BATCH_AXES = ("data", "fsdp")
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
_ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW with global-norm clipping and a linear-warmup + cosine schedule.

    ``lr(n) = lr · (n + 1) / warmup_steps`` for ``n < warmup_steps``, then cosine from
    ``lr`` to ``lr · end_lr_ratio`` over ``decay_steps`` updates (constant when 0). ``n``
    counts optimizer updates (mini-batches), not train steps.
    """

    learning_rate: float = 1e-6
    warmup_steps: int = 0
    decay_steps: int = 0
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        for name in ("learning_rate", "eps"):
            value = getattr(self, name)
            if not (is_number(value) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
        for name in ("warmup_steps", "decay_steps"):
            check_int(name, getattr(self, name), minimum=0)
        check_number("end_lr_ratio", self.end_lr_ratio, minimum=0, maximum=1)
        for name in ("b1", "b2"):
            # Adam divides by 1 - b^t: a decay of 1 makes every update NaN.
            value = getattr(self, name)
            if not (is_number(value) and 0 <= value < 1):
                raise ValueError(f"{name}: must be in [0, 1), got {value!r}")
        check_number("weight_decay", self.weight_decay, minimum=0, allowed="a finite number >= 0")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm: must be > 0 or None, got {self.max_grad_norm!r}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything ``make_train_step`` needs besides the model.

    Attributes:
        algorithm: advantage estimator and loss (``rlaxkit.algorithms.algorithm(name)``).
        optimizer: AdamW settings.
        micro_batches: gradient-accumulation chunks per mini-batch.
        mini_batches: optimizer updates per pass over the batch.
        epochs: passes over the batch (PPO epochs).
        shuffle: permute rows (with ``state.rng``) before each pass.
        temperature: the sampler's temperature, so log-probs match the behaviour's.
        compute_dtype: cast parameters to this dtype for the forward pass (build the
            graphdef with the same ``param_dtype``; master weights stay as given). ``None``
            computes in the parameters' dtype. bfloat16 is for accelerators.
        remat: activation checkpointing of the policy's blocks in the backward pass:
            ``none`` keeps every activation, ``dots`` keeps the weight matmuls' outputs
            and recomputes the rest (attention scores included), ``full`` keeps only
            each block's input. Memory for time; the numbers do not change.
        lora: train low-rank adapters on these projections instead of every weight
            (``rlaxkit.models.lora``): the optimizer holds state for the adapters only,
            the base weights stay frozen in ``TrainState.base_params``, and
            ``TrainState.params`` is the merged policy the trainer samples, pushes and
            evaluates. ``None`` trains every weight.
        update_norm: report the global norm of the optimizer's update (metric
            ``update_norm``), which ``check_finite`` reads to stop a run before it
            publishes weights that an update overflowed. Off, the step skips that pass
            over every parameter (1.5 ms of a 23 ms train call of the 1M-parameter
            benchmark model, docs/performance.md), and such an update shows only in the
            next step's loss, after its weights were published. The runtime keeps it on.
        distill: on-policy distillation (``rlaxkit.algorithms.distill``): the teacher in
            ``TrainState.teacher_params`` scores the batch's tokens before the updates and
            its per-token reward enters the advantages. ``None``: no teacher.
        drift_every: every this many steps the step splits its batch's drift into
            staleness and engine mismatch first (``rlaxkit.observe.drift``, ``drift/*`` metrics;
            it reads old versions from ``PackedTrainStep.drift.reader``, a parameter
            server, and runs without a mesh only). 0: never.
    """

    algorithm: AlgorithmConfig
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    micro_batches: int = 1
    mini_batches: int = 1
    epochs: int = 1
    shuffle: bool = False
    temperature: float = 1.0
    compute_dtype: Literal["float32", "bfloat16"] | None = None
    remat: RematPolicy = "none"
    lora: LoraConfig | None = None
    update_norm: bool = True
    distill: DistillConfig | None = None
    drift_every: int = 0

    def __post_init__(self) -> None:
        if self.distill is not None and not isinstance(self.distill, DistillConfig):
            raise ValueError(f"distill: must be a DistillConfig or None, got {self.distill!r}")
        check_int("drift_every", self.drift_every, minimum=0)
        if not isinstance(self.update_norm, bool):
            raise ValueError(f"update_norm: must be true or false, got {self.update_norm!r}")
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise ValueError(f"lora: must be a LoraConfig or None, got {self.lora!r}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat: must be one of {REMAT_POLICIES}, got {self.remat!r}")
        for name in ("micro_batches", "mini_batches", "epochs"):
            check_int(name, getattr(self, name), minimum=1)
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature: must be a positive number, got {self.temperature!r}")
        if self.compute_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(
                "compute_dtype: must be one of (None, 'float32', 'bfloat16'), got "
                f"{self.compute_dtype!r}"
            )


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TrainState:
    """Immutable training state; ``step`` is the number of train steps (weight version).

    Attributes:
        step: int32 scalar.
        params: policy parameters (an ``nnx.State`` from ``nnx.split(model)``).
        opt_state: optax state of ``(params, value_params)``.
        rng: uint32 ``[2]`` PRNG key data (mini-batch shuffling).
        value_params: critic parameters, or ``None``.
        ref_params: frozen reference policy, or ``None``.
        adapters: with ``TrainConfig.lora``, the trained LoRA adapters (``params`` is
            then ``base_params`` merged with them); else ``None``.
        base_params: with ``TrainConfig.lora``, the frozen base weights; else ``None``.
        teacher_params: with ``TrainConfig.distill``, the frozen teacher (its graph is
            ``distill.teacher_model``'s, or the policy's); else ``None``.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    value_params: Any = None
    ref_params: Any = None
    adapters: Any = None
    base_params: Any = None
    teacher_params: Any = None

    def replace(self, **changes: Any) -> TrainState:
        """A copy with ``changes`` applied (a packed state stays packed)."""
        packed = self.__dict__.get("_packed")
        if packed is None:
            return dataclasses.replace(self, **changes)
        fields = list(packed)
        for name, value in changes.items():
            if name not in _FIELD_INDEX:
                raise TypeError(f"TrainState has no field {name!r}")
            fields[_FIELD_INDEX[name]] = Packed.of(value)
        return TrainState.unpack(tuple(fields))

    # A train step's state crosses ``jax.jit`` packed: each field flattened once, its
    # structure interned (``rlaxkit.util.jaxutil.Packed``). A state a step returns is built
    # lazily: a field is rebuilt from its leaves when first read, so a loop that reads
    # ``step`` and ``params`` never rebuilds the optimizer state's Variables, and passing
    # the state to the next step flattens nothing. The fields' trees must not be changed
    # in place (``replace`` makes a new state), as a packed field would not see it.

    def pack(self) -> tuple[Packed, ...]:
        """Each field's tree as a ``Packed``, in field order (computed once per state)."""
        packed = self.__dict__.get("_packed")
        if packed is None:
            packed = tuple(Packed.of(getattr(self, name)) for name in _FIELD_INDEX)
            object.__setattr__(self, "_packed", packed)
        return packed

    def packed(self, name: str) -> Packed:
        """Field ``name`` as a ``Packed``, without rebuilding its tree: e.g.
        ``generate((graphdef, state.packed("params")), ...)`` after a train step."""
        return self.pack()[_FIELD_INDEX[name]]

    @classmethod
    def unpack(cls, packed: Sequence[Packed]) -> TrainState:
        """The state whose fields are ``packed`` (``pack``'s), each rebuilt when read."""
        state = object.__new__(cls)
        object.__setattr__(state, "_packed", tuple(packed))
        return state

    if not TYPE_CHECKING:  # a type checker still sees the fields alone

        def __getattr__(self, name: str) -> Any:
            # Reached only for a field not yet rebuilt from the packed state.
            packed = self.__dict__.get("_packed")
            index = _FIELD_INDEX.get(name)
            if packed is None or index is None:
                raise AttributeError(f"'TrainState' object has no attribute {name!r}")
            value = packed[index].tree()
            object.__setattr__(self, name, value)
            return value

    def __reduce__(self) -> tuple[Any, ...]:
        return (TrainState, tuple(getattr(self, name) for name in _FIELD_INDEX))


_FIELD_INDEX = {f.name: i for i, f in enumerate(dataclasses.fields(TrainState))}
# The defaults live in the generated ``__init__``; as class attributes they would answer
# for a packed state's fields before ``__getattr__`` could rebuild them.
for _name in _FIELD_INDEX:
    if _name in TrainState.__dict__:
        delattr(TrainState, _name)


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """Linear warmup to ``cfg.learning_rate``, then cosine decay (see ``OptimizerConfig``)."""
    peak, end = cfg.learning_rate, cfg.learning_rate * cfg.end_lr_ratio

    def schedule(count: jax.Array) -> jax.Array:
        n = jnp.asarray(count, jnp.float32)
        warm = peak * jnp.minimum((n + 1.0) / max(cfg.warmup_steps, 1), 1.0)
        progress = jnp.clip((n - cfg.warmup_steps) / max(cfg.decay_steps, 1), 0.0, 1.0)
        if cfg.decay_steps == 0:
            progress = jnp.zeros_like(progress)
        cosine = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(n < cfg.warmup_steps, warm, cosine)

    return schedule


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW; no weight decay on vectors (norms, biases), also
    when layers are stacked (``ModelConfig.scan_layers``: the layer axis is not counted)."""
    # ``mask`` must be static: inject_hyperparams would call a callable mask as a schedule.
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=learning_rate_schedule(cfg),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=lambda tree: jax.tree_util.tree_map_with_path(
            lambda path, x: jnp.ndim(x) - is_stacked(path) >= 2, tree
        ),
    )
    clip = optax.clip_by_global_norm(cfg.max_grad_norm) if cfg.max_grad_norm else optax.identity()
    return optax.chain(clip, adamw)


def create_train_state(
    cfg: TrainConfig,
    params: Any,
    *,
    seed: int = 0,
    value_params: Any = None,
    ref_params: Any = None,
    teacher_params: Any = None,
) -> TrainState:
    """A step-0 state: optimizer initialised on ``(params, value_params)``.

    ``ref_params`` are copied, so the initial ``params`` can serve as the reference:
    the step donates and overwrites the policy's buffers.
    """
    if cfg.algorithm.needs_value_model and value_params is None:
        raise ValueError(f"algorithm {cfg.algorithm.name!r} trains a critic: pass value_params")
    if ref_params is not None:
        ref_params = jax.tree.map(jnp.copy, ref_params)
    adapters = base_params = None
    trained = params
    if cfg.lora is not None:
        # B starts at zero, so the merged policy is the base one, bit for bit; the base
        # is copied, as the step donates and overwrites the policy's buffers.
        lora = cfg.lora
        key = jax.random.fold_in(jax.random.key(seed), 1)
        # One compiled program instead of an eager dispatch per kernel shape.
        adapters = jax.jit(lambda p, k: init_adapters(p, lora, k))(params, key)
        base_params = jax.tree.map(jnp.copy, params)
        trained = adapters
    # One compiled program: eagerly, every schedule term and zeros_like is a compile.
    opt_state = jax.jit(make_optimizer(cfg.optimizer).init)((trained, value_params))
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=opt_state,
        rng=jax.random.PRNGKey(seed),
        value_params=value_params,
        ref_params=ref_params,
        adapters=adapters,
        base_params=base_params,
        teacher_params=teacher_params,
    )


def make_mesh(
    data: int = 1, fsdp: int = 1, model: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ``(data, fsdp, model)`` mesh with automatic (GSPMD) sharding propagation."""
    devices = list(devices if devices is not None else jax.devices())[: data * fsdp * model]
    return jax.make_mesh(
        (data, fsdp, model), MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices
    )


def _path_names(path: Sequence[Any]) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def param_partition_spec(path: Sequence[Any], shape: tuple[int, ...], mesh: Mesh) -> P:
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


def state_shardings(tree: Any, mesh: Mesh) -> Any:
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


def _split_rows(x: jax.Array, *counts: int) -> jax.Array:
    """``[B, ...] -> [*counts, B / prod(counts), ...]``, strided (see module docstring)."""
    rows = x.shape[0] // math.prod(counts)
    return jnp.moveaxis(x.reshape((rows, *counts) + x.shape[1:]), 0, len(counts))


def _merge_rows(x: jax.Array) -> jax.Array:
    """Inverse of ``_split_rows`` with one count."""
    return jnp.swapaxes(x, 0, 1).reshape((-1,) + x.shape[2:])


def _reduce_metrics(
    metrics: dict[str, jax.Array], how: Literal["sum", "mean"]
) -> dict[str, jax.Array]:
    """Reduces stacked metrics over axis 0: ``*_max`` by max, others by ``how``."""
    reduce = jnp.sum if how == "sum" else jnp.mean
    return {k: jnp.max(v, 0) if k.endswith("_max") else reduce(v, 0) for k, v in metrics.items()}


@jax.tree_util.register_dataclass
@dataclass(frozen=True, kw_only=True)
class PreparedBatch:
    """What the updates train on: a ``TrainBatch`` with everything computed before them.

    Leaves are ``[B, T]``, or ``[*chunks, B / prod(chunks), T]`` once split into
    mini- and micro-batches. ``None`` fields are empty subtrees, so ``jax.tree.map`` and
    ``lax.scan`` pass over them.

    Attributes:
        tokens, attention_mask, behaviour_logprobs, versions: the batch's.
        positions: ``positions_from_mask(attention_mask)``.
        loss_mask: the batch's, as float32, less the tokens a rollout rejection mask
            (``loss.rejection``) dropped.
        advantages: the batch's, or the advantage estimator's over the whole batch.
        returns: value targets (GAE), or ``None`` without a critic.
        old_values: critic values before any update, or ``None`` without a critic.
        ref_logprobs: the batch's, else the reference policy's when the algorithm needs
            them, else ``None``.
        proximal_logprobs: recomputed under the pre-update weights (``proximal='recompute'``
            with more than one update per step), else the batch's, else ``None``.
        token_weights: aggregation weights ``Agg`` over the mini-batch; ``None`` until
            the mini-batch's gradient sets them.
        metric_weights: ``loss_mask / Σ loss_mask`` over the mini-batch; set with
            ``token_weights``.
    """

    tokens: jax.Array
    positions: jax.Array
    attention_mask: jax.Array
    loss_mask: jax.Array
    behaviour_logprobs: jax.Array
    versions: jax.Array
    advantages: jax.Array
    returns: jax.Array | None = None
    old_values: jax.Array | None = None
    ref_logprobs: jax.Array | None = None
    proximal_logprobs: jax.Array | None = None
    token_weights: jax.Array | None = None
    metric_weights: jax.Array | None = None

    def replace(self, **changes: Any) -> PreparedBatch:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


_Prepare: TypeAlias = Callable[[TrainState, TrainBatch], tuple[PreparedBatch, dict[str, jax.Array]]]
# What ``_build`` returns: ``prepare``, ``minibatch_gradients``, ``update``, the optax
# transformation and ``policy_of`` (the policy from the trained tree and the base);
# ``minibatch_gradients`` and ``update`` close over traced pytrees and are left untyped.
_StepParts: TypeAlias = tuple[
    _Prepare, Callable[..., Any], Callable[..., Any], Any, Callable[[Any, Any], Any]
]


def _build(
    cfg: TrainConfig,
    graphdef: nnx.GraphDef,
    value_graphdef: nnx.GraphDef | None,
    mesh: Mesh | None,
    keep_logprobs: bool = False,
) -> _StepParts:
    """The pieces of a train step, closed over the static configuration; with
    ``keep_logprobs`` ``minibatch_gradients`` also returns each micro-batch's policy
    log-probs (``[micro, rows, T]``, no gradient), else ``None`` in their place."""
    loss_cfg, adv_cfg = cfg.algorithm.loss, cfg.algorithm.advantage
    tx = make_optimizer(cfg.optimizer)
    # With one update per step every micro-batch's forward pass runs under the weights
    # the proximal log-probs would be recomputed with, so they are that pass's own
    # (stop-gradient) log-probs: one forward pass fewer, the same numbers.
    # A rollout rejection mask needs them before the updates (it sets the normaliser).
    fused_proximal = (
        loss_cfg.proximal == "recompute"
        and cfg.epochs == cfg.mini_batches == 1
        and loss_cfg.rejection == "none"
    )
    chunks = cfg.mini_batches * cfg.micro_batches
    cast = lambda tree: tree
    if cfg.compute_dtype is not None:
        dtype = jnp.dtype(cfg.compute_dtype)
        cast = lambda tree: jax.tree.map(
            lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
        )

    def constrain_rows(tree: Any, leading: int = 0) -> Any:
        """Rows (after ``leading`` chunk axes) split over ``data × fsdp``."""
        if mesh is None:
            return tree
        spec = P(*([None] * leading), BATCH_AXES)
        return jax.lax.with_sharding_constraint(tree, NamedSharding(mesh, spec))

    def policy_forward(params, tokens, positions, attention_mask, graph=graphdef):
        model = nnx.merge(graph, cast(params))
        # The last position predicts nothing in the batch: no logits for it.
        hidden = model.hidden_states(tokens, positions, attention_mask, remat=cfg.remat)[:, :-1]
        logp, entropy = logprobs_and_entropy(model.unembed(hidden), tokens[:, 1:], cfg.temperature)
        return jnp.pad(logp, ((0, 0), (1, 0))), jnp.pad(entropy, ((0, 0), (1, 0)))

    # The distillation teacher's graph: its own architecture, or the policy's.
    teacher_graphdef = graphdef
    if cfg.distill is not None and cfg.distill.teacher_model is not None:
        teacher_graphdef = nnx.split(abstract_model(cfg.distill.teacher_model))[0]

    def teacher_forward(teacher_params, tokens, positions, attention_mask):
        return policy_forward(teacher_params, tokens, positions, attention_mask, teacher_graphdef)[
            0
        ]

    def value_forward(value_params, tokens, positions, attention_mask):
        if value_graphdef is None:
            raise ValueError(
                f"algorithm {cfg.algorithm.name!r} trains a critic: pass value_graphdef"
            )
        return nnx.merge(value_graphdef, cast(value_params))(tokens, positions, attention_mask)

    def chunked(fn, params, inputs):
        """``fn(params, tokens, positions, attention_mask)`` over the batch in
        micro-batch-sized chunks, without gradients; ``inputs`` are those three arrays."""
        split = [constrain_rows(_split_rows(x, chunks), leading=1) for x in inputs]
        out = jax.lax.map(lambda xs: fn(jax.lax.stop_gradient(params), *xs), split)
        return _merge_rows(out)

    def prepare(state: TrainState, batch: TrainBatch) -> tuple[PreparedBatch, dict[str, jax.Array]]:
        rows = batch.tokens.shape[0]
        if rows % chunks or (mesh is not None and (rows // chunks) % _batch_shards(mesh)):
            raise ValueError(
                f"batch size {rows} must split into mini_batches·micro_batches = {chunks} "
                "chunks of a size divisible by the data·fsdp devices; choose bucket sizes so"
            )
        placed = jax.tree.map(lambda x: constrain_rows(jnp.asarray(x)), batch)
        tokens, attention_mask = placed.tokens, placed.attention_mask
        loss_mask = placed.loss_mask.astype(jnp.float32)
        positions = positions_from_mask(attention_mask)
        inputs = (tokens, positions, attention_mask)
        ref_logprobs = placed.ref_logprobs
        if cfg.algorithm.needs_reference and ref_logprobs is None:
            if state.ref_params is None:
                raise ValueError(
                    f"algorithm {cfg.algorithm.name!r} needs reference log-probs: give the "
                    "state ref_params or the batch ref_logprobs"
                )
            ref_logprobs = chunked(lambda p, *x: policy_forward(p, *x)[0], state.ref_params, inputs)
        proximal_logprobs = placed.proximal_logprobs
        if loss_cfg.proximal == "recompute" and not fused_proximal:
            proximal_logprobs = chunked(
                lambda p, *x: policy_forward(p, *x)[0], state.params, inputs
            )
        elif loss_cfg.proximal == "batch" and proximal_logprobs is None:
            raise ValueError("proximal 'batch' needs batch.proximal_logprobs")
        advantages, returns, old_values = placed.advantages, None, None
        if advantages is None:
            if cfg.algorithm.needs_value_model:
                old_values = chunked(value_forward, state.value_params, inputs)
            token_kl = None
            if adv_cfg.kl_in_reward_coef > 0:
                token_kl = (placed.behaviour_logprobs - ref_logprobs) * loss_mask
            advantage_inputs = AdvantageInputs(
                rewards=placed.rewards.astype(jnp.float32),
                group_ids=placed.group_ids,
                sequence_mask=placed.sequence_mask,
                loss_mask=loss_mask,
                values=old_values,
                token_kl=token_kl,
            )
            advantages, returns = compute_advantages(advantage_inputs, adv_cfg)
        if returns is None and cfg.algorithm.needs_value_model:
            raise ValueError("a critic needs returns: let the trainer compute GAE advantages")
        distill_stats: dict[str, jax.Array] = {}
        if cfg.distill is not None:
            if state.teacher_params is None:
                raise ValueError("distill is set: give the state teacher_params")
            teacher_logprobs = chunked(teacher_forward, state.teacher_params, inputs)
            advantages, distill_stats = distillation_advantages(
                advantages, teacher_logprobs, placed.behaviour_logprobs, loss_mask, cfg.distill
            )
        valid = placed.sequence_mask.astype(jnp.float32)
        lag = (state.step - placed.versions).astype(jnp.float32) * loss_mask
        stats = {
            "tokens": jnp.sum(loss_mask),
            "sequences": jnp.sum(valid),
            "reward_mean": jnp.sum(placed.rewards * valid) / jnp.maximum(jnp.sum(valid), 1.0),
            "staleness_mean": jnp.sum(lag) / jnp.maximum(jnp.sum(loss_mask), 1.0),
            "staleness_max": jnp.max(lag),
            **distill_stats,
        }
        if loss_cfg.rejection != "none":
            # Rejected tokens leave the loss and the mini-batch normaliser, which is
            # computed from this mask; the advantages above saw every sampled token.
            kept = rejection_mask(
                proximal_logprobs,
                placed.behaviour_logprobs,
                loss_mask,
                loss_cfg.rejection,
                loss_cfg.rejection_low,
                loss_cfg.rejection_high,
            )
            stats["rejected_fraction"] = 1.0 - jnp.sum(kept) / jnp.maximum(jnp.sum(loss_mask), 1.0)
            loss_mask = kept
        prepared = PreparedBatch(
            tokens=tokens,
            positions=positions,
            attention_mask=attention_mask,
            loss_mask=loss_mask,
            behaviour_logprobs=placed.behaviour_logprobs,
            versions=placed.versions,
            advantages=advantages,
            returns=returns,
            old_values=old_values,
            ref_logprobs=ref_logprobs,
            proximal_logprobs=proximal_logprobs,
        )
        return prepared, stats

    def policy_of(trained, base):
        """The policy's parameters: the trained ones, or the base merged with the
        trained adapters (``cfg.lora``)."""
        return trained if cfg.lora is None else merge_adapters(base, trained, cfg.lora)

    def micro_loss(trainable, micro, version, base):
        trained, value_params = trainable
        params = policy_of(trained, base)
        logp, entropy = policy_forward(params, micro.tokens, micro.positions, micro.attention_mask)
        values = None
        if value_params is not None:
            values = value_forward(
                value_params, micro.tokens, micro.positions, micro.attention_mask
            )
        inputs = LossInputs(
            logprobs=logp,
            behaviour_logprobs=micro.behaviour_logprobs,
            advantages=micro.advantages,
            loss_mask=micro.loss_mask,
            token_weights=micro.token_weights,
            metric_weights=micro.metric_weights,
            proximal_logprobs=(
                jax.lax.stop_gradient(logp) if fused_proximal else micro.proximal_logprobs
            ),
            versions=micro.versions,
            proximal_version=version,
            ref_logprobs=micro.ref_logprobs,
            entropy=entropy if loss_cfg.entropy_coef > 0 else jax.lax.stop_gradient(entropy),
            values=values,
            old_values=micro.old_values,
            returns=micro.returns,
        )
        loss, metrics = rl_loss(inputs, loss_cfg)
        return loss, (metrics, jax.lax.stop_gradient(logp) if keep_logprobs else None)

    def minibatch_gradients(trainable, minibatch, version, base=None):
        """Summed gradients over the micro-batches (leaves ``[micro, rows, ...]``)."""
        mask = minibatch.loss_mask
        flat = mask.reshape((-1,) + mask.shape[2:])
        weights = aggregation_weights(flat, loss_cfg.aggregation, loss_cfg.fixed_length)
        minibatch = minibatch.replace(
            token_weights=weights.reshape(mask.shape),
            metric_weights=mask / jnp.maximum(jnp.sum(mask), 1.0),
        )

        def body(grads, micro):
            micro = constrain_rows(micro)
            (_, aux), micro_grads = jax.value_and_grad(micro_loss, has_aux=True)(
                trainable, micro, version, base
            )
            return jax.tree.map(jnp.add, grads, micro_grads), aux

        zeros = jax.tree.map(jnp.zeros_like, trainable)
        grads, (metrics, logprobs) = jax.lax.scan(body, zeros, minibatch)
        return grads, _reduce_metrics(metrics, "sum"), logprobs

    def update(carry, minibatch, version, base=None):
        trainable, opt_state = carry
        grads, metrics, logprobs = minibatch_gradients(trainable, minibatch, version, base)
        metrics["grad_norm"] = optax.global_norm(grads)
        metrics["learning_rate"] = opt_state[1].hyperparams["learning_rate"]
        updates, opt_state = tx.update(grads, opt_state, trainable)
        # An update that overflows the weights (or the next forward pass) leaves this step's
        # loss and gradients, taken before it, finite: ``check_finite`` reads this norm.
        if cfg.update_norm:
            metrics["update_norm"] = optax.global_norm(updates)
        return (optax.apply_updates(trainable, updates), opt_state), (metrics, logprobs)

    return prepare, minibatch_gradients, update, tx, policy_of


def _batch_shards(mesh: Mesh) -> int:
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    return math.prod(sizes.get(a, 1) for a in BATCH_AXES)


def check_finite(step: int, metrics: dict[str, float]) -> None:
    """Raises ``FloatingPointError`` when train step ``step``'s loss, gradient norm or
    update norm is not finite: the step found the weights non-finite, or its update
    overflows them or the next forward pass (the update's norm overflows from entries of
    about 1e19, where float32 squares do; products of such weights overflow too), and
    every later step would train and publish NaN. The runtime calls it before the step's
    push, so such weights never reach a worker."""
    keys = ("loss", "grad_norm", "update_norm")
    bad = {k: metrics[k] for k in keys if not math.isfinite(metrics.get(k, 0.0))}
    if bad:
        raise FloatingPointError(
            f"train step {step}: {', '.join(f'{k} is {v}' for k, v in bad.items())}; the "
            "weights are, or this update makes them, no longer finite (an update too large "
            "for them: check optimizer.learning_rate and max_grad_norm). The run stops "
            "before publishing them; it resumes from its last checkpoint"
        )


def make_train_step(
    cfg: TrainConfig,
    graphdef: nnx.GraphDef,
    *,
    value_graphdef: nnx.GraphDef | None = None,
    mesh: Mesh | None = None,
    donate: bool = True,
    keep_params: bool = False,
    tiered: bool = False,
) -> PackedTrainStep:
    """The jitted ``train_step(state, batch) -> (state, metrics)``.

    Args:
        cfg: the training configuration.
        graphdef: policy graph (``graphdef, params = nnx.split(model)``); the reference
            policy, if any, shares it.
        value_graphdef: critic graph (``rlaxkit.algorithms.ValueModel``) for GAE.
        mesh: shard over this mesh (place inputs with ``shard_train_state`` and
            ``shard_batch``); ``None`` runs where the inputs live.
        donate: donate the input state's buffers to the output state.
        keep_params: with ``donate``, donate every buffer but the policy parameters, so
            the input state's ``params`` stay valid after the step. An in-process
            parameter server that holds the pushed arrays (zero copy) needs this; the
            alternative, copying every pushed version, costs a separate dispatch that
            lands just after the step, as XLA frees the step's scratch memory.
        tiered: compile in two tiers (``rlaxkit.util.jaxutil.TieredJit``): the first step of
            each batch shape runs a quickly compiled executable while the optimised one
            compiles in the background for the steps after it.

    Metrics (scalars): ``loss``, ``pg_loss``, ``clip_fraction``, ``ratio_mean``,
    ``ratio_max``, ``kl_old`` (to the trust-region centre), ``kl_ref`` (when a reference
    is used), ``entropy``, ``grad_norm``, ``update_norm`` (the optimizer's update, the
    global norm; with ``cfg.update_norm``), ``learning_rate``, ``tokens``, ``sequences``,
    ``reward_mean``, ``staleness_mean``/``_max``, ``distill_reward_mean`` and
    ``distill_reverse_kl`` (with ``cfg.distill``) and the loss's extras. Per-update
    metrics are averaged over the updates of the step (maxima for ``*_max``).
    """
    if cfg.algorithm.needs_value_model and value_graphdef is None:
        raise ValueError(f"algorithm {cfg.algorithm.name!r} trains a critic: pass value_graphdef")
    # Drift attribution runs beside the jitted step, in this process: not over a mesh.
    drift = DriftProbe(cfg, graphdef, cfg.drift_every if mesh is None else 0, reader=None)
    # The step's own log π_θ under the weights it starts from, for the attribution: the
    # forward pass of its one update, or the recomputed proximal log-probs.
    one_update = cfg.epochs == cfg.mini_batches == 1
    recomputed = drift.every > 0 and cfg.algorithm.loss.proximal == "recompute" and not one_update
    keep_logprobs = drift.every > 0 and one_update
    prepare, _, update, _, policy_of = _build(
        cfg, graphdef, value_graphdef, mesh, keep_logprobs=keep_logprobs
    )

    def train_step(
        state: TrainState, batch: TrainBatch
    ) -> tuple[TrainState, dict[str, jax.Array], jax.Array | None]:
        prepared, stats = prepare(state, batch)
        rng, shuffle_rng = jax.random.split(state.rng)

        def epoch(carry, key):
            rows = prepared
            if cfg.shuffle:
                order = jax.random.permutation(key, prepared.tokens.shape[0])
                rows = jax.tree.map(lambda x: x[order], prepared)
            minibatches = jax.tree.map(
                lambda x: _split_rows(x, cfg.mini_batches, cfg.micro_batches), rows
            )
            return jax.lax.scan(
                lambda c, mb: update(c, mb, state.step, state.base_params), carry, minibatches
            )

        trained = state.params if cfg.lora is None else state.adapters
        carry = ((trained, state.value_params), state.opt_state)
        keys = jax.random.split(shuffle_rng, cfg.epochs)
        ((trained, value_params), opt_state), (metrics, logprobs) = jax.lax.scan(epoch, carry, keys)
        log_theta = None
        if keep_logprobs:  # [1, 1, micro, rows, T]: the one update's micro-batches
            log_theta = _merge_rows(logprobs[0, 0])
            if cfg.shuffle:  # its rows were taken in this order
                order = jax.random.permutation(keys[0], prepared.tokens.shape[0])
                log_theta = jnp.zeros_like(log_theta).at[order].set(log_theta)
        elif recomputed:
            log_theta = prepared.proximal_logprobs
        params = policy_of(trained, state.base_params)
        metrics = _reduce_metrics(jax.tree.map(lambda x: x.reshape(-1), metrics), "mean")
        new_state = state.replace(
            step=state.step + 1,
            params=params,
            value_params=value_params,
            opt_state=opt_state,
            rng=rng,
            adapters=None if cfg.lora is None else trained,
        )
        if mesh is not None:
            new_state = jax.lax.with_sharding_constraint(
                new_state, state_shardings(new_state, mesh)
            )
        return new_state, {**metrics, **stats}, log_theta

    return PackedTrainStep(
        train_step,
        donate=donate,
        keep_params=keep_params,
        tiered=tiered,
        drift=drift,
        step_logprobs=keep_logprobs or recomputed,
    )


_PARAMS = _FIELD_INDEX["params"]


class PackedTrainStep:
    """``make_train_step``'s jitted ``train_step(state, batch) -> (state, metrics)``.

    The state crosses the jitted function packed (``TrainState.pack``), parameters apart
    from the other fields, so that ``keep_params`` donates every buffer but theirs; the
    returned state is packed too, and the next call passes it on without a flatten.
    ``jitted`` is the ``jax.jit`` (or ``TieredJit``) function of the packed arguments.
    ``drift`` attributes the drift of the batches it is due on, under the weights the
    step starts from, and adds its ``drift/*`` metrics (floats) to the step's; it reads
    old versions from ``drift.reader``, which the caller sets. ``train_step`` returns
    ``(state, metrics, log_theta)``: with ``step_logprobs``, ``log_theta`` is the batch's
    ``[B, T]`` log-probs under the weights it starts from (its one update's forward pass,
    or the recomputed proximal log-probs), which the attribution then takes after the
    step instead of its own forward pass before it; otherwise ``None``.
    """

    def __init__(
        self,
        train_step: Callable[
            [TrainState, TrainBatch], tuple[TrainState, dict[str, jax.Array], jax.Array | None]
        ],
        *,
        donate: bool,
        keep_params: bool,
        tiered: bool,
        drift: DriftProbe | None = None,
        step_logprobs: bool = False,
    ):
        self.drift = drift or DriftProbe.off()
        self.step_logprobs = step_logprobs

        def packed_step(
            params: Packed, rest: tuple[Packed, ...], batch: TrainBatch
        ) -> tuple[tuple[Packed, ...], dict[str, jax.Array], jax.Array | None]:
            fields = (*rest[:_PARAMS], params, *rest[_PARAMS:])
            state, metrics, log_theta = train_step(TrainState.unpack(fields), batch)
            return state.pack(), metrics, log_theta

        donate_argnums = ((1,) if keep_params else (0, 1)) if donate else ()
        jit = TieredJit if tiered else jax.jit
        self.jitted = jit(packed_step, donate_argnums=donate_argnums)

    @staticmethod
    def _arguments(state: TrainState) -> tuple[Packed, tuple[Packed, ...]]:
        fields = state.pack()
        return fields[_PARAMS], fields[:_PARAMS] + fields[_PARAMS + 1 :]

    def __call__(
        self, state: TrainState, batch: TrainBatch
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        version = int(state.step) if self.step_logprobs else None
        if version is None or not self.drift.due(version + 1):
            drift = self.drift.attribute(state.params, batch, state.step)
            fields, metrics, _ = self.jitted(*self._arguments(state), batch)
            return TrainState.unpack(fields), metrics | drift
        # The step may donate the state's buffers: the layout and the version only.
        layout = state.packed("params")
        fields, metrics, log_theta = self.jitted(*self._arguments(state), batch)
        jax.block_until_ready(log_theta)  # the step's time, not the attribution's
        drift = self.drift.attribute(layout, batch, version, log_theta=log_theta)
        return TrainState.unpack(fields), metrics | drift

    def lower(self, state: TrainState, batch: TrainBatch) -> jax.stages.Lowered:
        """Lowers the jitted step for these arguments (``jax.jit(...).lower``)."""
        return self.jitted.lower(*self._arguments(state), batch)

    def wait(self) -> None:
        """Tiered: blocks until the optimised compiles started so far are done
        (``TieredJit.wait``); otherwise returns at once."""
        if isinstance(self.jitted, TieredJit):
            self.jitted.wait()


def make_gradient_fn(
    cfg: TrainConfig,
    graphdef: nnx.GraphDef,
    *,
    value_graphdef: nnx.GraphDef | None = None,
    mesh: Mesh | None = None,
) -> Callable[[TrainState, TrainBatch], tuple[Any, dict[str, jax.Array]]]:
    """Jitted ``(state, batch) -> (grads, metrics)``: the gradient of the whole batch as
    one mini-batch, accumulated over ``cfg.micro_batches`` exactly as ``train_step`` does
    (for checks and debugging; ``grads`` is ``(policy_grads, value_grads)``)."""
    cfg = dataclasses.replace(cfg, mini_batches=1, epochs=1)
    prepare, minibatch_gradients, _, _, _ = _build(cfg, graphdef, value_graphdef, mesh)

    def gradients(state: TrainState, batch: TrainBatch) -> tuple[Any, dict[str, jax.Array]]:
        prepared, stats = prepare(state, batch)
        minibatch = jax.tree.map(lambda x: _split_rows(x, cfg.micro_batches), prepared)
        trained = state.params if cfg.lora is None else state.adapters
        grads, metrics, _ = minibatch_gradients(
            (trained, state.value_params), minibatch, state.step, state.base_params
        )
        return grads, {**metrics, **stats}

    return jax.jit(gradients)


def make_prepare_fn(
    cfg: TrainConfig,
    graphdef: nnx.GraphDef,
    *,
    value_graphdef: nnx.GraphDef | None = None,
    mesh: Mesh | None = None,
) -> Callable[[TrainState, TrainBatch], tuple[PreparedBatch, dict[str, jax.Array]]]:
    """Jitted ``(state, batch) -> (prepared, stats)``: what ``train_step`` computes before
    its updates (reference, proximal and critic forward passes, advantages) and the
    batch statistics it reports (for checks and debugging)."""
    prepare, _, _, _, _ = _build(cfg, graphdef, value_graphdef, mesh)
    return jax.jit(prepare)
