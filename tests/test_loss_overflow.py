"""Extreme log-ratios never reach the gradient as NaN, under every surrogate.

``exp`` overflows float32 past a log-ratio of about 88.7. Before the bound, a token with
``log π_θ - log π_old = 90`` gave a finite loss (the clip discards the overflowing branch)
and a NaN gradient (``inf · 0`` in the discarded branch's backward pass), and one NaN
poisons the whole update; a ``-inf`` log-prob at a masked position gave ``-inf · 0 = NaN``.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlaxkit.algorithms import (
    KL_ESTIMATORS,
    LOG_RATIO_BOUND,
    SURROGATES,
    LossConfig,
    LossInputs,
    behaviour_weights,
    importance_ratio,
    rl_loss,
)

LEVELS = ("token", "sequence")


def logp_grad(inputs, cfg):
    def loss_of(logp):
        return rl_loss(dataclasses.replace(inputs, logprobs=logp), cfg)

    (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(inputs.logprobs)
    return loss, metrics, grads


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("advantage", [-1.0, 1.0])
@pytest.mark.parametrize("surrogate", SURROGATES.names())
def test_the_issue_example_gives_a_zero_gradient_under_every_surrogate(surrogate, advantage, level):
    # log π_θ - log π_b = -1 - (-91) = 90 > 88.7: exp(90) overflows float32. The
    # log-ratio is clamped at 20, so the token is clipped away and has no gradient.
    inputs = LossInputs(
        logprobs=jnp.array([[-1.0]]),
        behaviour_logprobs=jnp.array([[-91.0]]),
        advantages=jnp.array([[advantage]]),
        loss_mask=jnp.array([[1.0]]),
    )
    loss, metrics, grads = logp_grad(inputs, LossConfig(surrogate=surrogate, ratio_level=level))
    assert np.isfinite(loss) and all(np.isfinite(v) for v in metrics.values())
    assert float(grads[0, 0]) == 0.0
    if surrogate == "dual_clip" and advantage < 0:
        assert float(loss) == 3.0  # the issue's value: -c·A with c = 3


def test_a_masked_minus_infinity_never_reaches_exp():
    logp = jnp.array([[-1.0, -jnp.inf, -2.0]])
    behaviour = jnp.array([[-1.5, -jnp.inf, -jnp.inf]])
    mask = jnp.array([[1.0, 0.0, 0.0]])
    for level in LEVELS:
        ratio, log_ratio = importance_ratio(logp, behaviour, mask, level)
        np.testing.assert_allclose(ratio, [[np.exp(0.5), 1.0, 1.0]], rtol=1e-6)
        np.testing.assert_array_equal(log_ratio[0, 1:], 0.0)
        ratio_sum = lambda lp, level=level: importance_ratio(lp, behaviour, mask, level)[0].sum()
        grads = jax.grad(ratio_sum)(logp)
        np.testing.assert_allclose(grads, [[np.exp(0.5), 0.0, 0.0]], rtol=1e-6)
    weights, _ = behaviour_weights(logp, behaviour, mask, mode="full", cap=2.0)
    np.testing.assert_allclose(weights, [[np.exp(0.5), 0.0, 0.0]], rtol=1e-6)


# Every term that reads a log-ratio: the surrogate, the behaviour weight, the rejection
# mask and the KL to the reference.
EXTRAS = LossConfig(
    proximal="batch",
    behaviour_weight="full",
    rejection="token",
    rejection_low=1e-30,
    rejection_high=1e30,
    kl_coef=0.1,
)
B, T = 2, 4
_grads = {}


def jitted_grads(cfg):
    if cfg not in _grads:
        _grads[cfg] = jax.jit(lambda inputs: logp_grad(inputs, cfg))
    return _grads[cfg]


log_ratios = st.one_of(
    st.floats(-200.0, 200.0, width=32), st.sampled_from([-90.0, 89.0, 90.0, 150.0, 1e4])
)


@st.composite
def extreme_batches(draw):
    """Log-probs whose log-ratios to the behaviour, proximal and reference log-probs
    reach far past float32's ``exp`` range; ``-inf`` at every masked position."""
    shape = (B, T)
    mask = np.array(draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T)), bool)
    mask = mask.reshape(shape)
    mask[0, 0] = True  # at least one token in the loss
    logp = -np.abs(np.array(draw(st.lists(log_ratios, min_size=B * T, max_size=B * T))))
    logp = logp.reshape(shape).astype(np.float32) / 4.0
    others = [
        logp - np.array(draw(st.lists(log_ratios, min_size=B * T, max_size=B * T))).reshape(shape)
        for _ in range(3)
    ]
    advantages = draw(st.lists(st.floats(-5.0, 5.0, width=32), min_size=B, max_size=B))
    masked = lambda x: jnp.asarray(np.where(mask, x, -np.inf), jnp.float32)
    return LossInputs(
        logprobs=masked(logp),
        behaviour_logprobs=masked(others[0]),
        advantages=jnp.asarray(np.array(advantages)[:, None] * mask, jnp.float32),
        loss_mask=jnp.asarray(mask, jnp.float32),
        proximal_logprobs=masked(others[1]),
        ref_logprobs=masked(others[2]),
    )


@settings(max_examples=20, deadline=None)
@given(extreme_batches())
def test_extreme_log_ratios_give_finite_losses_and_gradients_under_every_surrogate(inputs):
    mask = np.asarray(inputs.loss_mask) > 0
    logp, proximal = (np.where(mask, x, 0.0) for x in (inputs.logprobs, inputs.proximal_logprobs))
    beyond = mask & (np.abs(logp - proximal) > LOG_RATIO_BOUND)
    no_kl = dataclasses.replace(EXTRAS, kl_coef=0.0)
    configs = [
        dataclasses.replace(no_kl, surrogate=surrogate, ratio_level=level)
        for surrogate in SURROGATES.names()
        for level in LEVELS
    ]
    configs += [dataclasses.replace(EXTRAS, kl_estimator=name) for name in KL_ESTIMATORS.names()]
    configs += [
        dataclasses.replace(
            no_kl, rejection=rejection, behaviour_weight=weight, behaviour_weight_level=level
        )
        for rejection, weight, level in [
            ("sequence", "truncate", "sequence"),
            ("geometric", "mask", "sequence"),
            ("none", "mask", "token"),
        ]
    ]
    for cfg in configs:
        loss, metrics, grads = jitted_grads(cfg)(inputs)
        grads = np.asarray(grads)
        where = (cfg.surrogate, cfg.ratio_level, cfg.kl_estimator)
        assert np.isfinite(loss), where
        assert all(np.isfinite(v) for v in metrics.values()), where
        assert np.all(np.isfinite(grads)), where
        np.testing.assert_array_equal(grads[~mask], 0.0)
        if cfg.kl_coef == 0.0:
            # A token past the bound contributes no gradient through its ratio.
            np.testing.assert_array_equal(grads[beyond], 0.0)
