"""One jitted, sharded RL train step over a ``TrainState`` (``rlaxkit.trainer.state``).

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
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from rlaxkit.algorithms import (
    AdvantageInputs,
    LossInputs,
    aggregation_weights,
    compute_advantages,
    distillation_advantages,
    full_distillation_loss,
    rejection_mask,
    reverse_kl,
    rl_loss,
)
from rlaxkit.data.batch import TrainBatch
from rlaxkit.models import abstract_model, positions_from_mask
from rlaxkit.models.lora import merge_adapters
from rlaxkit.observe.drift import DriftProbe
from rlaxkit.trainer import sharding
from rlaxkit.trainer.config import TrainConfig
from rlaxkit.trainer.logprobs import logprobs_and_entropy
from rlaxkit.trainer.packed import PackedTrainStep
from rlaxkit.trainer.prepared import PreparedBatch
from rlaxkit.trainer.state import TrainState, make_optimizer


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


_Prepare: TypeAlias = Callable[[TrainState, TrainBatch], tuple[PreparedBatch, dict[str, jax.Array]]]


class StepParts(NamedTuple):
    """The pieces of a train step (``_build``), closed over the static configuration.

    ``minibatch_gradients(trainable, minibatch, version, frozen)`` gives the summed
    gradients of a mini-batch's micro-batches, their metrics and (with ``keep_logprobs``)
    each micro-batch's policy log-probs; ``update(carry, minibatch, version, frozen)``
    applies them to ``carry = (trainable, opt_state)``. ``trainable`` is ``(trained,
    value_params)``, ``frozen`` is ``(base_params, teacher_params)``; ``policy_of(trained,
    base)`` is the policy's parameters (the trained tree, or the base merged with the
    trained adapters).
    """

    prepare: _Prepare
    minibatch_gradients: Callable[..., tuple[object, dict[str, jax.Array], jax.Array | None]]
    update: Callable[..., tuple[tuple[object, object], tuple[dict[str, jax.Array], object]]]
    optimizer: optax.GradientTransformation
    policy_of: Callable[[object, object], object]


def _build(
    cfg: TrainConfig,
    graphdef: nnx.GraphDef,
    value_graphdef: nnx.GraphDef | None,
    mesh: Mesh | None,
    keep_logprobs: bool = False,
) -> StepParts:
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

    constrain_rows = lambda tree, leading=0: sharding.constrain_rows(tree, mesh, leading)
    stream = lambda x: sharding.constrain_stream(x, mesh)  # between blocks

    def policy_forward(params, tokens, positions, attention_mask, *, graph=graphdef):
        """``(logp, entropy)`` ``[rows, T]`` and the logits ``[rows, T - 1, vocab]``."""
        model = nnx.merge(graph, cast(params))
        # The last position predicts nothing in the batch: no logits for it.
        h = model.hidden_states(tokens, positions, attention_mask, remat=cfg.remat, stream=stream)
        logits = sharding.constrain_logits(model.unembed(constrain_rows(h[:, :-1])), mesh)
        logp, entropy = logprobs_and_entropy(logits, tokens[:, 1:], cfg.temperature)
        return jnp.pad(logp, ((0, 0), (1, 0))), jnp.pad(entropy, ((0, 0), (1, 0))), logits

    logprobs_of = lambda p, *x: policy_forward(p, *x)[0]
    # The distillation teacher's graph: its own architecture, or the policy's.
    teacher_graphdef, distill = graphdef, cfg.distill
    if distill is not None and distill.teacher_model is not None:
        teacher_graphdef = nnx.split(abstract_model(distill.teacher_model))[0]
    full_kl = distill if distill is not None and distill.estimator == "full" else None

    def teacher_scores(pair, *inputs):
        """The teacher's log-probs of the tokens and the exact KL(student ‖ teacher)."""
        student = policy_forward(pair[0], *inputs)[2]
        logp, _, teacher = policy_forward(pair[1], *inputs, graph=teacher_graphdef)
        return logp, jnp.pad(reverse_kl(student, teacher, cfg.temperature), ((0, 0), (1, 0)))

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
        return jax.tree.map(_merge_rows, out)

    def prepare(state: TrainState, batch: TrainBatch) -> tuple[PreparedBatch, dict[str, jax.Array]]:
        rows = batch.tokens.shape[0]
        if rows % chunks or (mesh is not None and (rows // chunks) % sharding.batch_shards(mesh)):
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
            ref_logprobs = chunked(logprobs_of, state.ref_params, inputs)
        proximal_logprobs = placed.proximal_logprobs
        if loss_cfg.proximal == "recompute" and not fused_proximal:
            proximal_logprobs = chunked(logprobs_of, state.params, inputs)
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
        if distill is not None and state.teacher_params is None:
            raise ValueError("distill is set: give the state teacher_params")
        if full_kl is not None and not full_kl.task_reward:  # the KL term in the loss alone
            advantages = jnp.zeros_like(advantages)
        elif distill is not None and full_kl is None:
            t_logp, kl = chunked(teacher_scores, (state.params, state.teacher_params), inputs)
            advantages, distill_stats = distillation_advantages(
                advantages, t_logp, placed.behaviour_logprobs, loss_mask, distill, kl
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

    def micro_loss(trainable, micro, version, frozen):
        (trained, value_params), (base, teacher) = trainable, frozen
        xs = (micro.tokens, micro.positions, micro.attention_mask)
        logp, entropy, logits = policy_forward(policy_of(trained, base), *xs)
        values = None if value_params is None else value_forward(value_params, *xs)
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
        if full_kl is not None:  # GKD: the exact reverse KL to the teacher, on own samples
            t_logits = policy_forward(teacher, *xs, graph=teacher_graphdef)[2]
            w = (micro.token_weights, micro.metric_weights)
            term, kl_stats = full_distillation_loss(logits, t_logits, *w, full_kl, cfg.temperature)
            loss = loss + term
            metrics = {**metrics, **kl_stats, "loss": jax.lax.stop_gradient(loss)}
        return loss, (metrics, jax.lax.stop_gradient(logp) if keep_logprobs else None)

    def minibatch_gradients(trainable, minibatch, version, frozen=(None, None)):
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
                trainable, micro, version, frozen
            )
            return jax.tree.map(jnp.add, grads, micro_grads), aux

        zeros = jax.tree.map(jnp.zeros_like, trainable)
        grads, (metrics, logprobs) = jax.lax.scan(body, zeros, minibatch)
        return grads, _reduce_metrics(metrics, "sum"), logprobs

    def update(carry, minibatch, version, frozen=(None, None)):
        trainable, opt_state = carry
        grads, metrics, logprobs = minibatch_gradients(trainable, minibatch, version, frozen)
        metrics["grad_norm"] = optax.global_norm(grads)
        metrics["learning_rate"] = opt_state[1].hyperparams["learning_rate"]
        updates, opt_state = tx.update(grads, opt_state, trainable)
        # An update that overflows the weights (or the next forward pass) leaves this step's
        # loss and gradients, taken before it, finite: ``check_finite`` reads this norm.
        if cfg.update_norm:
            metrics["update_norm"] = optax.global_norm(updates)
        return (optax.apply_updates(trainable, updates), opt_state), (metrics, logprobs)

    return StepParts(prepare, minibatch_gradients, update, tx, policy_of)


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
    ``reward_mean``, ``staleness_mean``/``_max``, ``distill_reverse_kl`` (with
    ``cfg.distill``: the exact KL per completion token, of the batch before the updates
    with the ``sampled`` estimator, a per-update metric with ``full``) and
    ``distill_reward_mean`` (``sampled``), and the loss's extras. Per-update metrics are
    averaged over the updates of the step (maxima for ``*_max``).
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
    parts = _build(cfg, graphdef, value_graphdef, mesh, keep_logprobs=keep_logprobs)
    prepare, update, policy_of = parts.prepare, parts.update, parts.policy_of

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
            return jax.lax.scan(lambda c, mb: update(c, mb, state.step, frozen), carry, minibatches)

        trained = state.params if cfg.lora is None else state.adapters
        carry = ((trained, state.value_params), state.opt_state)
        frozen = (state.base_params, state.teacher_params)
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
                new_state, sharding.state_shardings(new_state, mesh)
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
    parts = _build(cfg, graphdef, value_graphdef, mesh)
    prepare, minibatch_gradients = parts.prepare, parts.minibatch_gradients

    def gradients(state: TrainState, batch: TrainBatch) -> tuple[Any, dict[str, jax.Array]]:
        prepared, stats = prepare(state, batch)
        minibatch = jax.tree.map(lambda x: _split_rows(x, cfg.micro_batches), prepared)
        trained = state.params if cfg.lora is None else state.adapters
        frozen = (state.base_params, state.teacher_params)
        grads, metrics, _ = minibatch_gradients(
            (trained, state.value_params), minibatch, state.step, frozen
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
    return jax.jit(_build(cfg, graphdef, value_graphdef, mesh).prepare)
