"""The trainer's state, ``TrainState``: parameters, optimizer state and the frozen
reference, critic and teacher, as one pytree the step donates; how a step carries it
across ``jax.jit`` packed (``PackedTrainStep``, which ``rlaxkit.trainer.step.
make_train_step`` returns); and the optimizer it is built with (AdamW with warm-up and
cosine or constant decay)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax

from rlaxkit.data.batch import TrainBatch
from rlaxkit.models import is_stacked
from rlaxkit.models.lora import init_adapters
from rlaxkit.observe.drift import DriftProbe
from rlaxkit.trainer.config import OptimizerConfig, TrainConfig
from rlaxkit.util.jaxutil import Packed, TieredJit


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
            if name not in FIELD_INDEX:
                raise TypeError(f"TrainState has no field {name!r}")
            fields[FIELD_INDEX[name]] = Packed.of(value)
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
            packed = tuple(Packed.of(getattr(self, name)) for name in FIELD_INDEX)
            object.__setattr__(self, "_packed", packed)
        return packed

    def packed(self, name: str) -> Packed:
        """Field ``name`` as a ``Packed``, without rebuilding its tree: e.g.
        ``generate((graphdef, state.packed("params")), ...)`` after a train step."""
        return self.pack()[FIELD_INDEX[name]]

    @classmethod
    def unpack(cls, packed: Sequence[Packed]) -> TrainState:
        """The state whose fields are ``packed`` (``pack``'s), each rebuilt when read."""
        state = object.__new__(cls)
        object.__setattr__(state, "_packed", tuple(packed))
        return state

    if not TYPE_CHECKING:  # a type checker still sees the fields alone

        def __getattr__(self, name: str) -> object:
            # Reached only for a field not yet rebuilt from the packed state.
            packed = self.__dict__.get("_packed")
            index = FIELD_INDEX.get(name)
            if packed is None or index is None:
                raise AttributeError(f"'TrainState' object has no attribute {name!r}")
            value = packed[index].tree()
            object.__setattr__(self, name, value)
            return value

    def __reduce__(self) -> tuple[object, ...]:
        return (TrainState, tuple(getattr(self, name) for name in FIELD_INDEX))


FIELD_INDEX = {f.name: i for i, f in enumerate(dataclasses.fields(TrainState))}

# The defaults live in the generated ``__init__``; as class attributes they would answer
# for a packed state's fields before ``__getattr__`` could rebuild them.
for _name in FIELD_INDEX:
    if _name in TrainState.__dict__:
        delattr(TrainState, _name)


_PARAMS = FIELD_INDEX["params"]


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
            # Attribution off (the default): the probe is not called at all.
            drift = {}
            if self.drift.every:
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
    params: object,
    *,
    seed: int = 0,
    value_params: object = None,
    ref_params: object = None,
    teacher_params: object = None,
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
