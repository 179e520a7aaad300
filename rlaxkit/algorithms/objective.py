"""The unified policy objective and its interchangeable parts.

RLAX (arXiv 2512.06392; ``docs/papers.md``, "The unified objective") writes its algorithms
as one objective

    L(θ) = - Σ_{i,t} sg[Agg_{i,t} · IS_{i,t}] · (sg[A_{i,t}] · GradTerm1_{i,t} + GradTerm2_{i,t})

``rl_loss`` implements it with named slots: the aggregation weight ``Agg``
(``aggregation_weights``), the ratio against the trust-region centre
(``importance_ratio``: token or GSPO sequence level), the clipped surrogate that
produces ``GradTerm1`` (``SURROGATES``: PPO, DAPO clip-higher, dual clip, CISPO, none),
the behaviour correction ``IS`` (``off_policy.behaviour_weights``: AReaL decoupled PPO,
truncated or masked IS) and the extra terms ``GradTerm2`` (KL to a reference with a
``KL_ESTIMATORS`` entry, entropy bonus, clipped value loss).

Every token term is multiplied by a weight from the *whole* (mini-)batch, so the loss of
a batch is the sum of the losses of its micro-batches; metrics are built the same way
(weighted sums, or maxima for keys ending in ``_max``) so they too add up
(``combine_metrics``).

**Extreme ratios.** A log-ratio beyond ``±LOG_RATIO_BOUND`` (20, as verl clamps it) is
clamped before ``exp``: its ratio is ``e^±20`` (4.9e8 or 2.1e-9) and, the clamp having
zero derivative there, the token contributes **no gradient** under every surrogate,
sequence level included (CISPO, which otherwise never drops a token's gradient, too).
Such a token is one that the policy and its trust-region centre disagree about by a
factor of half a billion; without the bound, ``exp`` overflows float32 past 88.7 and
an overflowing branch that the clip discards still sends ``inf · 0 = NaN`` into the
gradient. Masked positions are replaced by 0 before any subtraction reaches ``exp``, so
a ``-inf`` log-prob there is harmless.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from rlaxkit.algorithms.off_policy import (
    LOG_RATIO_BOUND,
    behaviour_weights,
    loglinear_proximal_logprobs,
    rejection_mask,
)
from rlaxkit.algorithms.registry import Registry

if TYPE_CHECKING:
    from rlaxkit.algorithms.config import LossConfig

sg = jax.lax.stop_gradient


@dataclass(frozen=True)
class SurrogateContext:
    """What a surrogate may read besides the ratio and the advantage.

    Attributes:
        logprobs: ``[B, T]`` log π_θ, stop-gradient, 0 off the mask.
        loss_mask: ``[B, T]`` the tokens in the loss (after rejection).
        key: a PRNG key for surrogates that pick tokens at random (Clip-Cov).
    """

    logprobs: jax.Array
    loss_mask: jax.Array
    key: jax.Array


# ``fn(ratio, log_ratio, advantages, cfg, context=None) -> (objective, active)``.
SurrogateFn = Callable[..., tuple[jax.Array, jax.Array]]
SURROGATES: Registry[SurrogateFn] = Registry("surrogate")
KL_ESTIMATORS: Registry[Callable[[jax.Array, jax.Array], jax.Array]] = Registry("KL estimator")


def aggregation_weights(
    loss_mask: jax.Array, aggregation: str, fixed_length: int | None = None
) -> jax.Array:
    """The per-token weight ``Agg_{i,t}`` (zero off the mask), ``[B, T]``.

    With ``G`` the number of rows that have completion tokens and ``|o_i|`` the
    completion length of row ``i``: ``sequence_mean`` gives ``1 / (G |o_i|)`` (GRPO's
    mean of per-sequence means), ``token_mean`` gives ``1 / Σ_i |o_i|`` (DAPO's token-level
    mean), ``fixed_length`` gives ``1 / (G · L)`` (Dr.GRPO's constant normaliser) and
    ``token_sum`` gives 1 (no normaliser: the loss is the sum over the batch's tokens, so
    its scale grows with the token count; verl's ``token-sum``, used with a learning rate
    sized for it).
    """
    mask = loss_mask.astype(jnp.float32)
    lengths = jnp.sum(mask, axis=1, keepdims=True)
    groups = jnp.maximum(jnp.sum(lengths > 0), 1).astype(jnp.float32)
    if aggregation == "sequence_mean":
        return mask / (jnp.maximum(lengths, 1.0) * groups)
    if aggregation == "token_mean":
        return mask / jnp.maximum(jnp.sum(mask), 1.0)
    if aggregation == "fixed_length":
        if fixed_length is None:
            raise ValueError("fixed_length: aggregation 'fixed_length' needs a token budget")
        return mask / (groups * fixed_length)
    if aggregation == "token_sum":
        return mask
    raise ValueError(
        "aggregation: must be one of ('sequence_mean', 'token_mean', 'fixed_length', "
        f"'token_sum'), got {aggregation!r}"
    )


def importance_ratio(
    logprobs: jax.Array, old_logprobs: jax.Array, loss_mask: jax.Array, level: str = "token"
) -> tuple[jax.Array, jax.Array]:
    """``(ratio, log_ratio)`` of ``π_θ`` to the trust-region centre, ``[B, T]``.

    ``token``: ``r_t = exp(log π_θ(t) - log π_old(t))``. ``sequence`` (GSPO, Zheng et al.
    2025, arXiv 2507.18071): ``s_i = exp((1/|o_i|) Σ_t (log π_θ(t) - log π_old(t)))`` on
    every token of row ``i``, so gradients flow through the length-normalised sum.

    Every token's log-ratio is clamped to ``±LOG_RATIO_BOUND`` (so the sequence mean is
    within it too), so ``ratio = exp(log_ratio)`` is finite and a token beyond the bound has no
    gradient; off the mask both are exactly ``(1, 0)`` whatever the log-probs hold there
    (``-inf`` included: they never reach a subtraction that is kept).

    >>> r, lr = importance_ratio(jnp.array([[-1.0, 0.0]]), jnp.array([[-91.0, -jnp.inf]]),
    ...                          jnp.array([[1.0, 0.0]]))
    >>> lr.tolist(), bool(jnp.isfinite(r).all())
    ([[20.0, 0.0]], True)
    """
    mask = loss_mask.astype(jnp.float32)
    on = mask > 0
    # ``where`` before the clamp: a masked ``-inf - -inf = nan`` is computed but never
    # selected, and its cotangent is 0, so it reaches neither the value nor the gradient.
    log_ratio = jnp.where(on, logprobs - sg(old_logprobs), 0.0)
    log_ratio = jnp.clip(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if level == "sequence":
        lengths = jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1.0)
        row = jnp.sum(log_ratio, axis=1, keepdims=True) / lengths
        log_ratio = jnp.where(on, row, 0.0)
    elif level != "token":
        raise ValueError(f"ratio_level: must be one of ('token', 'sequence'), got {level!r}")
    return jnp.exp(log_ratio), log_ratio


@SURROGATES.register("ppo_clip")
def ppo_clip_surrogate(ratio, log_ratio, advantages, cfg, context=None):
    """``min(r A, clip(r, 1-ε_low, 1+ε_high) A)`` (Schulman et al. 2017, PPO).

    ``ε_high > ε_low`` is DAPO's clip-higher (Yu et al. 2025, arXiv 2503.14476).
    Returns the per-token objective (to maximise) and where clipping is active.
    """
    clipped_ratio = jnp.clip(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    objective = jnp.minimum(ratio * advantages, clipped_ratio * advantages)
    active = ((advantages > 0) & (ratio > 1.0 + cfg.clip_eps_high)) | (
        (advantages < 0) & (ratio < 1.0 - cfg.clip_eps_low)
    )
    return objective, active


@SURROGATES.register("dual_clip")
def dual_clip_surrogate(ratio, log_ratio, advantages, cfg, context=None):
    """PPO clip, and for ``A < 0`` at least ``c·A`` (Ye et al. 2020, arXiv 1912.09729).

    ``max(min(r A, clip(r) A), c A)`` when ``A < 0``: a token whose ratio exploded can
    contribute at most ``-c A`` to the loss, and no gradient.
    """
    objective, active = ppo_clip_surrogate(ratio, log_ratio, advantages, cfg)
    floor = cfg.dual_clip_c * advantages
    negative = advantages < 0
    objective = jnp.where(negative, jnp.maximum(objective, floor), objective)
    return objective, active | (negative & (ratio > cfg.dual_clip_c))


@SURROGATES.register("cispo")
def cispo_surrogate(ratio, log_ratio, advantages, cfg, context=None):
    """CISPO: ``sg(clip(r, 1-ε_low, 1+ε_high)) · A · log π_θ`` (MiniMax-M1, arXiv 2506.13585).

    The clipped ratio only weights the gradient; no token is excluded from it, except
    one whose log-ratio is past ``±LOG_RATIO_BOUND`` (see the module docstring).
    Written as ``sg(r̂) · exp(log r - sg(log r)) · A``, whose value is ``r̂ A`` and whose
    gradient is ``r̂ A ∇ log π_θ`` (``∇ log r = ∇ log π_θ``).
    """
    low, high = 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high
    weight = sg(jnp.clip(ratio, low, high))
    objective = weight * jnp.exp(log_ratio - sg(log_ratio)) * advantages
    return objective, (ratio > high) | (ratio < low)


@SURROGATES.register("none")
def plain_surrogate(ratio, log_ratio, advantages, cfg, context=None):
    """``r A``: importance-weighted REINFORCE, no trust region (RLOO, REINFORCE)."""
    return ratio * advantages, jnp.zeros(ratio.shape, bool)


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """``log π_θ - log π_ref`` (unbiased, high variance; Schulman 2020)."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """``(log π_θ - log π_ref)² / 2`` (biased, low variance)."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """``exp(δ) - 1 - δ`` with ``δ = log π_ref - log π_θ`` (unbiased, ≥ 0; GRPO's choice).

    ``δ`` is clamped to ``±LOG_RATIO_BOUND`` before ``exp`` (no gradient beyond it).
    """
    delta = jnp.clip(ref_logprobs - logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return jnp.exp(delta) - 1.0 - delta


def _straight_through(value: jax.Array, logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """``value``'s value with ``k2``'s gradient: ``k2 - sg(k2) + sg(value)``."""
    k2 = kl_k2(logprobs, ref_logprobs)
    return k2 - sg(k2) + sg(value)


@KL_ESTIMATORS.register("k1+")
def kl_k1_straight_through(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """``k1``'s value, ``k2``'s gradient ``(log π_θ - log π_ref) ∇ log π_θ``.

    The expectations of ``k1`` and ``k3`` under ``π_θ`` are the KL, but the expectations of
    their gradients (taken on samples of ``π_θ``, as a loss does) are not its gradient;
    ``k2``'s is: ``E_π[(log π_θ - log π_ref) ∇ log π_θ] = ∇ KL(π_θ || π_ref)`` (Schulman
    2020, "Approximating KL divergence"). Straight-through keeps the reported estimate and
    takes that gradient (verl's ``k1+``/``k3+``).
    """
    return _straight_through(kl_k1(logprobs, ref_logprobs), logprobs, ref_logprobs)


@KL_ESTIMATORS.register("k3+")
def kl_k3_straight_through(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """``k3``'s value (≥ 0, low variance), ``k2``'s gradient (see ``k1+``)."""
    return _straight_through(kl_k3(logprobs, ref_logprobs), logprobs, ref_logprobs)


def clipped_value_loss(
    values: jax.Array, old_values: jax.Array, returns: jax.Array, clip_eps: float
) -> jax.Array:
    """``½ max((V - R)², (V_old + clip(V - V_old, ±ε) - R)²)`` per token (PPO critic)."""
    clipped = old_values + jnp.clip(values - old_values, -clip_eps, clip_eps)
    return 0.5 * jnp.maximum((values - returns) ** 2, (clipped - returns) ** 2)


@jax.tree_util.register_dataclass
@dataclass
class LossInputs:
    """Everything ``rl_loss`` reads; ``[B, T]`` arrays aligned like ``token_logprobs``.

    Attributes:
        logprobs: log π_θ of the taken tokens (differentiated).
        behaviour_logprobs: log π_behaviour, recorded by the sampler.
        advantages: per-token advantages (treated as constants).
        loss_mask: 1 on completion tokens.
        token_weights: ``Agg`` from the whole mini-batch; ``None``: computed from this
            batch with ``cfg.aggregation``.
        metric_weights: weights that turn per-token metrics into mini-batch means;
            ``None``: ``loss_mask / Σ loss_mask`` of this batch.
        proximal_logprobs: log π_prox, for ``proximal`` in ``('recompute', 'batch')``.
        versions: int32 version per token, for ``proximal='loglinear'``.
        proximal_version: the trainer's version before the update (``loglinear``).
        ref_logprobs: log π_ref, for the KL term and the ``kl_ref`` metric.
        entropy: per-token entropy of π_θ, for the bonus and the ``entropy`` metric.
        values, old_values, returns: critic outputs now and before the update, and
            targets, for the value loss.
    """

    logprobs: jax.Array
    behaviour_logprobs: jax.Array
    advantages: jax.Array
    loss_mask: jax.Array
    token_weights: jax.Array | None = None
    metric_weights: jax.Array | None = None
    proximal_logprobs: jax.Array | None = None
    versions: jax.Array | None = None
    proximal_version: jax.Array | None = None
    ref_logprobs: jax.Array | None = None
    entropy: jax.Array | None = None
    values: jax.Array | None = None
    old_values: jax.Array | None = None
    returns: jax.Array | None = None


def trust_region_centre(inputs: LossInputs, cfg: LossConfig) -> jax.Array:
    """``log π_old`` per ``cfg.proximal`` (stop-gradient)."""
    if cfg.proximal == "behaviour":
        return sg(inputs.behaviour_logprobs)
    if cfg.proximal == "loglinear":
        if inputs.versions is None or inputs.proximal_version is None:
            raise ValueError("proximal 'loglinear' needs versions and proximal_version")
        return sg(
            loglinear_proximal_logprobs(
                inputs.behaviour_logprobs,
                sg(inputs.logprobs),
                inputs.versions,
                inputs.proximal_version,
            )
        )
    if inputs.proximal_logprobs is None:
        raise ValueError(f"proximal {cfg.proximal!r} needs proximal_logprobs")
    return sg(inputs.proximal_logprobs)


def rl_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The unified objective; returns ``(loss, metrics)`` for ``value_and_grad``.

    ``loss = Σ_{i,t} Agg_{i,t} · (-w_{i,t} · f(r_{i,t}, A_{i,t}) + β KL_{i,t} - c_H H_{i,t}
    + c_V · Lv_{i,t})`` with ``r`` the ratio to the trust-region centre, ``f`` the
    surrogate, ``w`` the behaviour weight, ``KL`` the chosen estimator against the
    reference, ``H`` the entropy and ``Lv`` the clipped value loss. The sum runs over the
    tokens the rollout rejection mask (``cfg.rejection``) keeps, and ``Agg`` is computed
    over them: a rejected token leaves the normaliser too. ``token_weights`` given by the
    caller must already exclude rejected tokens (the trainer's do).
    """
    mask = inputs.loss_mask.astype(jnp.float32)
    centre = trust_region_centre(inputs, cfg)
    accepted = rejection_mask(
        centre,
        inputs.behaviour_logprobs,
        mask,
        cfg.rejection,
        cfg.rejection_low,
        cfg.rejection_high,
    )
    rejected = mask - accepted
    mask = accepted
    on = mask > 0
    weights = inputs.token_weights
    if weights is None:
        weights = aggregation_weights(mask, cfg.aggregation, cfg.fixed_length)
    metric_weights = inputs.metric_weights
    if metric_weights is None:
        metric_weights = mask / jnp.maximum(jnp.sum(mask), 1.0)
    weights, metric_weights = sg(weights) * mask, sg(metric_weights)
    mean = lambda x: jnp.sum(metric_weights * sg(jnp.where(on, x, 0.0)))

    ratio, log_ratio = importance_ratio(inputs.logprobs, centre, mask, cfg.ratio_level)
    advantages = jnp.where(on, sg(inputs.advantages), 0.0)
    context = SurrogateContext(
        logprobs=sg(jnp.where(on, inputs.logprobs, 0.0)), loss_mask=mask, key=_batch_key(inputs)
    )
    objective, clipped = SURROGATES.get(cfg.surrogate)(ratio, log_ratio, advantages, cfg, context)
    is_weights, kept = behaviour_weights(
        centre,
        inputs.behaviour_logprobs,
        mask,
        mode=cfg.behaviour_weight,
        cap=cfg.behaviour_weight_cap,
        level=cfg.behaviour_weight_level,
    )
    pg_loss = -jnp.sum(weights * is_weights * objective)
    loss = pg_loss
    _, token_log_ratio = importance_ratio(inputs.logprobs, centre, mask, "token")
    metrics = {
        "pg_loss": sg(pg_loss),
        "clip_fraction": mean(clipped.astype(jnp.float32)),
        "ratio_mean": mean(ratio),
        "ratio_max": sg(jnp.max(jnp.where(on, ratio, 0.0))),
        # k3 of π_old against π_θ: exp(-log r) - 1 + log r, from the clamped log-ratio.
        "kl_old": mean(jnp.exp(-token_log_ratio) - 1.0 + token_log_ratio),
        "advantage_mean": mean(advantages),
    }
    if cfg.rejection != "none":
        # Share of the given tokens the mask rejected (the trainer reports its own,
        # taken before the loss: it hands the loss the kept tokens only).
        given = inputs.loss_mask.astype(jnp.float32)
        metrics["rejected_fraction"] = jnp.sum(rejected) / jnp.maximum(jnp.sum(given), 1.0)
    if cfg.behaviour_weight != "none":
        metrics["behaviour_weight_mean"] = mean(is_weights)
        metrics["behaviour_weight_dropped"] = mean(1.0 - kept)
    if cfg.kl_coef > 0 and inputs.ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (train with a reference model)")
    if inputs.ref_logprobs is not None:
        kl = KL_ESTIMATORS.get(cfg.kl_estimator)(
            jnp.where(on, inputs.logprobs, 0.0), jnp.where(on, sg(inputs.ref_logprobs), 0.0)
        )
        metrics["kl_ref"] = mean(kl)
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * jnp.sum(weights * kl)
    if cfg.entropy_coef > 0 and inputs.entropy is None:
        raise ValueError("entropy_coef > 0 needs the per-token entropy")
    if inputs.entropy is not None:
        metrics["entropy"] = mean(inputs.entropy)
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * jnp.sum(weights * inputs.entropy)
    if cfg.value_coef > 0:
        if inputs.values is None or inputs.old_values is None or inputs.returns is None:
            raise ValueError("value_coef > 0 needs values, old_values and returns")
        per_token = clipped_value_loss(
            inputs.values, sg(inputs.old_values), sg(inputs.returns), cfg.value_clip_eps
        )
        value_loss = jnp.sum(weights * per_token)
        metrics["value_loss"] = sg(value_loss)
        loss = loss + cfg.value_coef * value_loss
    metrics["loss"] = sg(loss)
    return loss, metrics


def _batch_key(inputs: LossInputs) -> jax.Array:
    """A PRNG key drawn from the batch itself (the bits of its masked behaviour log-probs):
    the loss stays a pure function of its inputs, reproducible on a rerun, and a random
    pick differs from batch to batch and micro-batch to micro-batch."""
    on = inputs.loss_mask > 0
    total = jnp.sum(jnp.where(on, inputs.behaviour_logprobs, 0.0).astype(jnp.float32))
    bits = jax.lax.bitcast_convert_type(total, jnp.uint32)
    return jax.random.fold_in(jax.random.key(0), bits)


def combine_metrics(
    first: dict[str, jax.Array], second: dict[str, jax.Array]
) -> dict[str, jax.Array]:
    """Merges metrics of two micro-batches: keys ending in ``_max`` by max, others by sum."""
    return {
        key: jnp.maximum(value, second[key]) if key.endswith("_max") else value + second[key]
        for key, value in first.items()
    }
