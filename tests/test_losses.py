"""The unified objective: hand-derived values of every slot, and properties over presets."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlaxkit.algorithms import (
    KL_ESTIMATORS,
    PRESETS,
    SURROGATES,
    LossConfig,
    LossInputs,
    aggregation_weights,
    algorithm,
    behaviour_weights,
    clipped_value_loss,
    combine_metrics,
    importance_ratio,
    loglinear_proximal_logprobs,
    rl_loss,
)

ONE = jnp.ones((1, 1))


def surrogate(name, ratio, advantage, **cfg):
    """Objective, clip flag and d objective / d log π of one token."""
    config = LossConfig(surrogate=name, **cfg)

    def objective(log_ratio):
        log_ratio = jnp.reshape(log_ratio, (1, 1))
        value, clipped = SURROGATES.get(name)(
            jnp.exp(log_ratio), log_ratio, advantage * ONE, config
        )
        return value[0, 0], clipped[0, 0]

    (value, clipped), grad = jax.value_and_grad(objective, has_aux=True)(math.log(ratio))
    return float(value), bool(clipped), float(grad)


@pytest.mark.parametrize(
    "ratio, advantage, expected, clipped",
    [
        (1.5, 2.0, 2.4, True),  # min(1.5 * 2, 1.2 * 2) = 2.4: clipped above
        (0.5, 2.0, 1.0, False),  # min(0.5 * 2, 0.8 * 2) = 1.0
        (0.5, -1.0, -0.8, True),  # min(-0.5, 0.8 * -1) = -0.8: clipped below
        (1.5, -1.0, -1.5, False),  # min(-1.5, -1.2) = -1.5: a bad token is never clipped
    ],
)
def test_ppo_clip_by_hand(ratio, advantage, expected, clipped):
    value, was_clipped, grad = surrogate("ppo_clip", ratio, advantage)
    assert value == pytest.approx(expected, rel=1e-6)
    assert was_clipped == clipped
    # d(r A)/d log π = r A where unclipped; zero where clipped.
    assert grad == pytest.approx(0.0 if clipped else ratio * advantage, rel=1e-6)


def test_dapo_clip_higher_by_hand():
    # ε_high = 0.28: min(1.5 * 2, 1.28 * 2) = 2.56; below, ε_low = 0.2 still holds.
    assert surrogate("ppo_clip", 1.5, 2.0, clip_eps_high=0.28)[0] == pytest.approx(2.56)
    assert surrogate("ppo_clip", 0.5, -1.0, clip_eps_high=0.28)[0] == pytest.approx(-0.8)


def test_dual_clip_by_hand():
    # r = 4, A = -1: PPO gives min(-4, -1.2) = -4; dual clip max(-4, 3 * -1) = -3, no grad.
    value, clipped, grad = surrogate("dual_clip", 4.0, -1.0, dual_clip_c=3.0)
    assert (value, clipped, grad) == (pytest.approx(-3.0), True, 0.0)
    # r = 2, A = -1: -2 > -3, so dual clip leaves PPO's -2 (gradient r A = -2).
    assert surrogate("dual_clip", 2.0, -1.0)[::2] == (pytest.approx(-2.0), pytest.approx(-2.0))


def test_cispo_by_hand():
    # ε_low = 1 (no floor), ε_high = 0.28: value sg(min(r, 1.28)) A, gradient the same
    # weight times A: r = 1.5, A = 2 gives 2.56 and gradient 2.56 (PPO would give 0).
    value, clipped, grad = surrogate("cispo", 1.5, 2.0, clip_eps_low=1.0, clip_eps_high=0.28)
    assert (value, clipped, grad) == (pytest.approx(2.56), True, pytest.approx(2.56))
    value, clipped, grad = surrogate("cispo", 0.5, -1.0, clip_eps_low=1.0, clip_eps_high=0.28)
    assert (value, clipped, grad) == (pytest.approx(-0.5), False, pytest.approx(-0.5))


def test_plain_surrogate_by_hand():
    assert surrogate("none", 3.0, 2.0) == (pytest.approx(6.0), False, pytest.approx(6.0))


def test_kl_estimators_by_hand():
    # π_θ = 0.5, π_ref = 0.25, δ = log(π_ref/π_θ) = -log 2:
    # k1 = log 2 = 0.693147, k2 = (log 2)^2 / 2 = 0.240227, k3 = 0.5 - 1 + log 2 = 0.193147.
    logp, ref = jnp.log(0.5), jnp.log(0.25)
    got = {name: float(KL_ESTIMATORS.get(name)(logp, ref)) for name in KL_ESTIMATORS}
    ln2 = math.log(2)
    k3 = ln2 - 0.5
    expected = {"k1": ln2, "k2": ln2**2 / 2, "k3": k3, "k1+": ln2, "k3+": k3}
    assert got == pytest.approx(expected, rel=1e-6)
    # The straight-through estimators take k2's gradient d/d log π_θ = log π_θ - log π_ref
    # = log 2, where k1's is 1 and k3's is 1 - π_ref/π_θ = 0.5.
    grads = {name: float(jax.grad(KL_ESTIMATORS.get(name))(logp, ref)) for name in KL_ESTIMATORS}
    assert grads == pytest.approx({"k1": 1, "k2": ln2, "k3": 0.5, "k1+": ln2, "k3+": ln2})


MASK = jnp.array([[0, 1, 1, 0, 0], [0, 1, 1, 1, 0]], jnp.float32)
PER_TOKEN = jnp.array([[0, 1, 3, 0, 0], [0, 2, 4, 6, 0]], jnp.float32)


@pytest.mark.parametrize(
    "aggregation, fixed_length, expected",
    [
        ("sequence_mean", None, 3.0),  # (mean(1, 3) + mean(2, 4, 6)) / 2 = (2 + 4) / 2
        ("token_mean", None, 3.2),  # (1 + 3 + 2 + 4 + 6) / 5 = 16 / 5
        ("fixed_length", 4, 2.0),  # 16 / (G L) = 16 / (2 * 4)
        ("token_sum", None, 16.0),  # 1 + 3 + 2 + 4 + 6, no normaliser
    ],
)
def test_aggregation_by_hand(aggregation, fixed_length, expected):
    weights = aggregation_weights(MASK, aggregation, fixed_length)
    assert float(jnp.sum(weights * PER_TOKEN)) == pytest.approx(expected, rel=1e-6)
    # Through the whole loss: plain surrogate on-policy (r = 1) with A = -ℓ gives loss ℓ.
    cfg = LossConfig(surrogate="none", aggregation=aggregation, fixed_length=fixed_length)
    logp = -jnp.ones_like(MASK)
    loss, _ = rl_loss(LossInputs(logp, logp, -PER_TOKEN, MASK), cfg)
    assert float(loss) == pytest.approx(expected, rel=1e-6)


def test_gspo_sequence_ratio_by_hand():
    # log ratios 0.2, -0.1, 0.5 -> mean 0.2 -> s = e^0.2 = 1.2214028 on every token.
    log_ratio = jnp.array([[0.0, 0.2, -0.1, 0.5]])
    mask = jnp.array([[0.0, 1, 1, 1]])
    ratio, _ = importance_ratio(log_ratio, jnp.zeros_like(log_ratio), mask, "sequence")
    np.testing.assert_allclose(ratio, [[1.0, *[math.exp(0.2)] * 3]], rtol=1e-6)
    # GSPO clip [1 - 3e-4, 1 + 4e-4] with A = 1: the loss is -min(s, 1.0004) = -1.0004.
    cfg = algorithm("gspo").loss
    loss, metrics = rl_loss(LossInputs(log_ratio, jnp.zeros_like(log_ratio), mask, mask), cfg)
    assert float(loss) == pytest.approx(-1.0004, rel=1e-6)
    assert float(metrics["clip_fraction"]) == 1.0


def test_decoupled_ppo_by_hand():
    # π_b = 0.2, π_prox = 0.3, π_θ = 0.33: r = 0.33 / 0.3 = 1.1 (inside the clip),
    # w = 0.3 / 0.2 = 1.5, A = 2: loss = -w r A = -1.5 * 1.1 * 2 = -3.3.
    logp, behaviour, proximal = (jnp.log(jnp.array([[p]])) for p in (0.33, 0.2, 0.3))
    inputs = LossInputs(logp, behaviour, 2.0 * ONE, ONE, proximal_logprobs=proximal)
    cfg = algorithm("decoupled_ppo").loss
    loss, metrics = rl_loss(inputs, cfg)
    assert float(loss) == pytest.approx(-3.3, rel=1e-5)
    assert float(metrics["behaviour_weight_mean"]) == pytest.approx(1.5, rel=1e-5)
    # Truncated IS caps w at 1.2: -1.2 * 2.2 = -2.64. Masked IS drops the token: 0.
    truncated = dataclasses.replace(cfg, behaviour_weight="truncate", behaviour_weight_cap=1.2)
    assert float(rl_loss(inputs, truncated)[0]) == pytest.approx(-2.64, rel=1e-5)
    masked = dataclasses.replace(cfg, behaviour_weight="mask", behaviour_weight_cap=1.2)
    loss, metrics = rl_loss(inputs, masked)
    assert float(loss) == 0.0 and float(metrics["behaviour_weight_dropped"]) == 1.0


def test_sequence_level_behaviour_weight_by_hand():
    # token log weights 0.1 and 0.2 -> one sequence weight e^0.3 = 1.3498588 on both.
    proximal, behaviour = jnp.array([[0.1, 0.2, 9.0]]), jnp.zeros((1, 3))
    mask = jnp.array([[1.0, 1.0, 0.0]])
    weights, _ = behaviour_weights(
        proximal, behaviour, mask, mode="full", cap=2.0, level="sequence"
    )
    np.testing.assert_allclose(weights, [[math.exp(0.3), math.exp(0.3), 0.0]], rtol=1e-6)


def test_loglinear_proximal_by_hand():
    # v_prox = 5. Token 0 sampled by version 3: α = (5 - 3) / (6 - 3) = 2/3, so
    # log π_prox = -1 + 2/3 * (-0.4 + 1) = -0.6. Token 1 sampled by version 5: α = 0.
    out = loglinear_proximal_logprobs(
        jnp.array([-1.0, -2.0]), jnp.array([-0.4, -1.0]), jnp.array([3, 5]), 5
    )
    np.testing.assert_allclose(out, [-0.6, -2.0], rtol=1e-6)


def test_clipped_value_loss_by_hand():
    # V = 1, V_old = 0.5, R = 2, ε = 0.2: clipped V = 0.7; max(1, 1.69) / 2 = 0.845.
    # V = 0.6 (inside the clip), R = 0: 0.36 / 2 = 0.18.
    out = clipped_value_loss(jnp.array([1.0, 0.6]), jnp.array([0.5, 0.5]), jnp.array([2.0, 0]), 0.2)
    np.testing.assert_allclose(out, [0.845, 0.18], rtol=1e-6)


def test_micro_batch_metrics_add_up():
    first = {"clip_fraction": jnp.array(0.25), "ratio_max": jnp.array(1.5)}
    second = {"clip_fraction": jnp.array(0.5), "ratio_max": jnp.array(1.2)}
    assert combine_metrics(first, second) == {"clip_fraction": 0.75, "ratio_max": 1.5}


def random_inputs(seed=0, b=4, t=6, on_policy=False):
    """Every optional field filled, so any preset finds what it reads."""
    rng = np.random.RandomState(seed)
    mask = np.zeros((b, t), np.float32)
    for i in range(b):
        mask[i, 2 : 2 + rng.randint(1, t - 2)] = 1.0
    logp = jnp.asarray(-rng.rand(b, t) - 0.1, jnp.float32)
    noisy = lambda: logp if on_policy else logp + jnp.asarray(0.1 * rng.randn(b, t), jnp.float32)
    return LossInputs(
        logprobs=logp,
        behaviour_logprobs=noisy(),
        advantages=jnp.asarray(rng.randn(b, t) * mask, jnp.float32),
        loss_mask=jnp.asarray(mask),
        proximal_logprobs=noisy(),
        versions=jnp.full((b, t), 3 if on_policy else 1, jnp.int32),
        proximal_version=jnp.asarray(3, jnp.int32),
        ref_logprobs=noisy(),
        entropy=jnp.asarray(rng.rand(b, t), jnp.float32),
        values=jnp.asarray(rng.randn(b, t), jnp.float32),
        old_values=jnp.asarray(rng.randn(b, t), jnp.float32),
        returns=jnp.asarray(rng.randn(b, t), jnp.float32),
    )


def pg_only(cfg):
    """The preset's loss with the extra terms switched off (policy gradient alone)."""
    return dataclasses.replace(cfg.loss, kl_coef=0.0, entropy_coef=0.0, value_coef=0.0)


def logp_grad(inputs, cfg):
    def loss_of(logp):
        return rl_loss(dataclasses.replace(inputs, logprobs=logp), cfg)

    return jax.grad(loss_of, has_aux=True)(inputs.logprobs)


@pytest.mark.parametrize("name", PRESETS.names())
def test_every_preset_gives_finite_loss_and_metrics(name):
    inputs = random_inputs()
    cfg = algorithm(name).loss
    loss, metrics = jax.jit(rl_loss, static_argnums=1)(inputs, cfg)
    assert loss.shape == () and np.isfinite(loss)
    for key, value in metrics.items():
        assert value.shape == () and np.isfinite(value), key
    grads, _ = logp_grad(inputs, cfg)
    assert grads.shape == inputs.logprobs.shape and np.all(np.isfinite(grads))
    np.testing.assert_array_equal(np.asarray(grads)[np.asarray(inputs.loss_mask) == 0], 0)


@pytest.mark.parametrize("name", PRESETS.names())
def test_zero_advantage_gives_zero_policy_gradient(name):
    inputs = dataclasses.replace(random_inputs(seed=1), advantages=jnp.zeros((4, 6)))
    grads, metrics = logp_grad(inputs, pg_only(algorithm(name)))
    np.testing.assert_array_equal(grads, 0.0)
    assert float(metrics["pg_loss"]) == 0.0


@pytest.mark.parametrize("name", PRESETS.names())
def test_on_policy_every_ratio_is_one_and_the_gradient_is_the_policy_gradient(name):
    # behaviour = proximal = current log-probs; versions = the trainer's version. One
    # advantage per sequence (as group estimators give), so that GSPO's sequence ratio
    # has the same gradient as the token-level policy gradient.
    inputs = random_inputs(seed=2, on_policy=True)
    per_row = inputs.advantages[:, 2:3] * inputs.loss_mask
    inputs = dataclasses.replace(inputs, advantages=per_row)
    cfg = pg_only(algorithm(name))
    grads, metrics = logp_grad(inputs, cfg)
    assert float(metrics["ratio_mean"]) == 1.0 and float(metrics["ratio_max"]) == 1.0
    assert float(metrics["clip_fraction"]) == 0.0
    # Plain policy gradient: loss = -Σ Agg A log π, so d loss / d log π = -Agg A.
    weights = aggregation_weights(inputs.loss_mask, cfg.aggregation, cfg.fixed_length)
    np.testing.assert_allclose(grads, -weights * inputs.advantages, rtol=1e-6, atol=1e-9)


def test_missing_inputs_fail_loudly():
    inputs = random_inputs()
    bare = LossInputs(
        inputs.logprobs, inputs.behaviour_logprobs, inputs.advantages, inputs.loss_mask
    )
    with pytest.raises(ValueError, match="ref_logprobs"):
        rl_loss(bare, algorithm("grpo").loss)
    with pytest.raises(ValueError, match="proximal_logprobs"):
        rl_loss(bare, algorithm("decoupled_ppo").loss)
    with pytest.raises(ValueError, match="versions"):
        rl_loss(bare, algorithm("decoupled_ppo", loss={"proximal": "loglinear"}).loss)
    with pytest.raises(ValueError, match="old_values"):
        rl_loss(bare, algorithm("ppo").loss)
