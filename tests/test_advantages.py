"""Advantage estimators: hand-derived values and properties over the registry."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlaxkit.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageInputs,
    compute_advantages,
    gae_advantages,
    group_statistics,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    terminal_rewards,
)

# Two groups and one padding row: group 0 = rows 0-2 (rewards 1, 0, 2), group 1 = rows
# 3-4 (rewards 3, 5), row 5 is padding (its reward 7 must be ignored).
REWARDS = jnp.array([1.0, 0.0, 2.0, 3.0, 5.0, 7.0])
GROUPS = jnp.array([0, 0, 0, 1, 1, 5], jnp.int32)
VALID = jnp.array([1, 1, 1, 1, 1, 0], bool)


def test_group_statistics_by_hand():
    # group 0: mean 1, squared deviations 0 + 1 + 1 = 2, Bessel variance 2 / 2 = 1.
    # group 1: mean 4, squared deviations 1 + 1 = 2, variance 2 / 1 = 2, std sqrt(2).
    mean, std, count = group_statistics(REWARDS, GROUPS, VALID)
    np.testing.assert_allclose(mean[:5], [1, 1, 1, 4, 4])
    np.testing.assert_allclose(std[:5], [1, 1, 1, math.sqrt(2), math.sqrt(2)], rtol=1e-6)
    np.testing.assert_array_equal(count[:5], [3, 3, 3, 2, 2])


def test_grpo_with_std_by_hand():
    # (r - mean) / (std + 1e-6): group 0 -> 0, -1, 1; group 1 -> -1/sqrt 2, 1/sqrt 2.
    out = grpo_advantages(REWARDS, GROUPS, VALID)
    inv = 1 / math.sqrt(2)
    np.testing.assert_allclose(out, [0, -1, 1, -inv, inv, 0], rtol=2e-6, atol=1e-7)


def test_grpo_without_std_and_dr_grpo_by_hand():
    # Only centred: group 0 -> 0, -1, 1; group 1 -> -1, 1; padding 0.
    out = grpo_advantages(REWARDS, GROUPS, VALID, scale_by_std=False)
    np.testing.assert_array_equal(out, [0, -1, 1, -1, 1, 0])
    inputs = AdvantageInputs(REWARDS, GROUPS, VALID, jnp.ones((6, 2)) * VALID[:, None])
    dr, _ = compute_advantages(inputs, AdvantageConfig(estimator="dr_grpo"))
    np.testing.assert_array_equal(dr[:, 0], [0, -1, 1, -1, 1, 0])


def test_rloo_by_hand():
    # row 0: 1 - (0 + 2)/2 = 0; row 1: 0 - (1 + 2)/2 = -1.5; row 2: 2 - (1 + 0)/2 = 1.5;
    # row 3: 3 - 5 = -2; row 4: 5 - 3 = 2.
    out = rloo_advantages(REWARDS, GROUPS, VALID)
    np.testing.assert_allclose(out, [0, -1.5, 1.5, -2, 2, 0], rtol=1e-6)


def test_singleton_groups_get_no_signal():
    rewards, groups, valid = jnp.array([3.0, 1.0]), jnp.array([0, 1]), jnp.array([True, True])
    np.testing.assert_array_equal(grpo_advantages(rewards, groups, valid), [0, 0])
    np.testing.assert_array_equal(rloo_advantages(rewards, groups, valid), [0, 0])


def test_terminal_rewards_land_on_the_last_completion_token():
    mask = jnp.array([[0, 1, 1, 0], [0, 0, 0, 0]], jnp.float32)
    out = terminal_rewards(jnp.array([2.0, 5.0]), mask)
    np.testing.assert_array_equal(out, [[0, 0, 2, 0], [0, 0, 0, 0]])


MASK = jnp.array([[0, 1, 1, 0], [0, 1, 1, 1]], jnp.float32)


def test_reinforce_pp_by_hand():
    # Returns: row 0 -> 1, 1; row 1 -> 0, 0, 0. Over the 5 tokens: mean 0.4, population
    # variance (2 * 0.6^2 + 3 * 0.4^2) / 5 = 0.24, std 0.4898979.
    out = reinforce_pp_advantages(jnp.array([1.0, 0.0]), MASK)
    std = math.sqrt(0.24)
    expected = [[0, 0.6 / std, 0.6 / std, 0], [0, -0.4 / std, -0.4 / std, -0.4 / std]]
    np.testing.assert_allclose(out, expected, rtol=1e-5)


def test_reinforce_pp_with_kl_reward_by_hand():
    # β = 0.5, row-0 KL 0.2, 0.4: token rewards -0.1, 1 - 0.2 = 0.8; returns 0.7, 0.8.
    # Values 0.7, 0.8, 0, 0, 0: mean 0.3, variance (0.16 + 0.25 + 3 * 0.09) / 5 = 0.136.
    kl = jnp.array([[0, 0.2, 0.4, 0], [0, 0, 0, 0]])
    out = reinforce_pp_advantages(jnp.array([1.0, 0.0]), MASK, token_kl=kl, kl_coef=0.5)
    std = math.sqrt(0.136)
    expected = [[0, 0.4 / std, 0.5 / std, 0], [0, -0.3 / std, -0.3 / std, -0.3 / std]]
    np.testing.assert_allclose(out, expected, rtol=1e-5)


def test_gae_by_hand():
    # mask 0,1,1,1; reward 1 on the last token; V = (9, 0.5, 0.6, 0.8); γ = 1, λ = 0.5:
    # δ1 = 0.6 - 0.5 = 0.1, δ2 = 0.8 - 0.6 = 0.2, δ3 = 1 - 0.8 = 0.2;
    # A3 = 0.2, A2 = 0.2 + 0.5 * 0.2 = 0.3, A1 = 0.1 + 0.5 * 0.3 = 0.25; R = A + V.
    mask = jnp.array([[0, 1, 1, 1]], jnp.float32)
    values = jnp.array([[9.0, 0.5, 0.6, 0.8]])
    rewards = terminal_rewards(jnp.array([1.0]), mask)
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    np.testing.assert_allclose(adv, [[0, 0.25, 0.3, 0.2]], rtol=1e-6)
    np.testing.assert_allclose(ret, [[0, 0.75, 0.9, 1.0]], rtol=1e-6)
    # γ = 0.9, λ = 1 is the discounted return minus V: A1 = 0.9^2 - 0.5 = 0.31.
    adv, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=1.0)
    np.testing.assert_allclose(adv, [[0, 0.31, 0.3, 0.2]], rtol=1e-5)


def test_gae_steps_over_an_observation_by_hand():
    # The row of test_gae_by_hand with two tool tokens (values 7, 7: ignored) after the
    # first policy token: mask 0,1,0,0,1,1. The first token bootstraps from V = 0.6 at the
    # next policy token, so every advantage is the contiguous row's.
    mask = jnp.array([[0, 1, 0, 0, 1, 1]], jnp.float32)
    values = jnp.array([[9.0, 0.5, 7.0, 7.0, 0.6, 0.8]])
    rewards = terminal_rewards(jnp.array([1.0]), mask)
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    np.testing.assert_allclose(adv, [[0, 0.25, 0, 0, 0.3, 0.2]], rtol=1e-6)
    np.testing.assert_allclose(ret, [[0, 0.75, 0, 0, 0.9, 1.0]], rtol=1e-6)


ROW_WIDTH = 40  # at least the longest row drawn: 3 prompt + 8 policy + 8 * 3 observed + 3
jitted_gae = jax.jit(gae_advantages, static_argnames=("gamma", "lam"))


@st.composite
def rows_with_observations(draw):
    """A row (prompt, policy tokens, padding) and the same row with observations (runs
    of environment tokens) inserted between or after its policy tokens."""
    prompt = draw(st.integers(0, 3))
    policy = draw(st.integers(1, 8))
    padding = draw(st.integers(0, 3))
    # After policy token i (0-based), runs[i] environment tokens; none before the first.
    runs = draw(st.lists(st.integers(0, 3), min_size=policy, max_size=policy))
    floats = st.floats(-2.0, 2.0, allow_nan=False, width=32)
    length = prompt + policy + sum(runs) + padding
    values = draw(st.lists(floats, min_size=length, max_size=length))
    reward = draw(floats)
    gamma = draw(st.sampled_from([1.0, 0.9]))
    lam = draw(st.sampled_from([1.0, 0.95, 0.5, 0.0]))
    return prompt, policy, padding, runs, values, reward, gamma, lam


@settings(max_examples=60, deadline=None)
@given(rows_with_observations())
def test_gae_at_policy_tokens_does_not_see_the_observations(case):
    prompt, policy, padding, runs, values, reward, gamma, lam = case
    # The row with observations: 1 marks a policy token, 0 a prompt, tool or padding one.
    mask = [0] * prompt
    for run in runs:
        mask += [1] + [0] * run
    mask += [0] * padding
    mask_with = np.asarray(mask, np.float32)
    keep = np.concatenate([np.arange(prompt), np.flatnonzero(mask_with)])
    # The row without them: the prompt and policy tokens with their own values.
    mask_without = mask_with[keep]
    values_with = np.asarray(values, np.float32)
    values_without = values_with[keep]

    def gae(m, v):
        # Padded to one width (more trailing padding, which the property covers) and
        # jitted, so the examples share one program per (gamma, lam): called eagerly,
        # the scan compiles again on every call.
        n = len(m)
        m, v = (jnp.asarray(np.pad(x, (0, ROW_WIDTH - n))[None]) for x in (m, v))
        rewards = terminal_rewards(jnp.array([reward], jnp.float32), m)
        adv, ret = jitted_gae(rewards, v, m, gamma=gamma, lam=lam)
        return np.asarray(adv[0, :n]), np.asarray(ret[0, :n])

    adv_with, ret_with = gae(mask_with, values_with)
    adv_without, ret_without = gae(mask_without, values_without)
    policy_at = np.flatnonzero(mask_with)
    np.testing.assert_allclose(adv_with[policy_at], adv_without[prompt:], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ret_with[policy_at], ret_without[prompt:], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(adv_with[mask_with == 0], 0.0)
    np.testing.assert_array_equal(ret_with[mask_with == 0], 0.0)


def _inputs(rewards, with_values=True):
    rng = np.random.RandomState(0)
    b, t = rewards.shape[0], 7
    lengths = rng.randint(1, 5, b)
    mask = np.zeros((b, t), np.float32)
    for i, n in enumerate(lengths):
        mask[i, 2 : 2 + n] = 1.0
    mask[-1] = 0.0  # a padding row
    valid = np.ones(b, bool)
    valid[-1] = False
    return AdvantageInputs(
        rewards=jnp.asarray(rewards, jnp.float32),
        group_ids=jnp.asarray(np.arange(b) // 3, jnp.int32),
        sequence_mask=jnp.asarray(valid),
        loss_mask=jnp.asarray(mask),
        values=jnp.asarray(rng.randn(b, t), jnp.float32) if with_values else None,
        token_kl=jnp.asarray(rng.rand(b, t) * mask, jnp.float32),
    )


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS.names())
def test_every_estimator_is_finite_shaped_and_masked(estimator):
    inputs = _inputs(np.random.RandomState(1).randn(7))
    adv, returns = compute_advantages(inputs, AdvantageConfig(estimator=estimator))
    assert adv.shape == inputs.loss_mask.shape
    assert np.all(np.isfinite(adv))
    np.testing.assert_array_equal(np.asarray(adv)[np.asarray(inputs.loss_mask) == 0], 0)
    assert (returns is not None) == (estimator == "gae")


@pytest.mark.parametrize("estimator", sorted(set(ADVANTAGE_ESTIMATORS.names()) - {"gae"}))
def test_equal_rewards_give_zero_advantage(estimator):
    inputs = _inputs(np.full(7, 0.7), with_values=False)
    adv, _ = compute_advantages(inputs, AdvantageConfig(estimator=estimator))
    np.testing.assert_allclose(adv, 0.0, atol=1e-6)


def test_whitening_gives_zero_mean_unit_std_over_tokens():
    inputs = _inputs(np.random.RandomState(2).randn(7))
    adv, _ = compute_advantages(inputs, AdvantageConfig(estimator="gae", whiten=True))
    picked = np.asarray(adv)[np.asarray(inputs.loss_mask) > 0]
    np.testing.assert_allclose([picked.mean(), picked.std()], [0.0, 1.0], atol=1e-5)


def test_gae_without_values_fails_loudly():
    with pytest.raises(ValueError, match="value model"):
        compute_advantages(_inputs(np.ones(7), with_values=False), AdvantageConfig(estimator="gae"))
