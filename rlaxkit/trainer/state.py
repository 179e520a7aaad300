"""The trainer's state, ``TrainState``: parameters, optimizer state and the frozen
reference, critic and teacher, as one plain frozen pytree the step donates; and the
optimizer it is built with (AdamW with warm-up and cosine or constant decay). How a step
carries it across ``jax.jit`` is the step's own business (``rlaxkit.trainer.packed``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax

from rlaxkit.models import is_stacked
from rlaxkit.models.lora import init_adapters
from rlaxkit.trainer.config import OptimizerConfig, TrainConfig


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
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


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
