"""Clip-Cov, KL-Cov, rollout rejection masks, REINFORCE++ with γ and verl's conventions,
each against values worked out by hand in the comments."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlaxkit.algorithms import (
    AdvantageConfig,
    AdvantageInputs,
    LossConfig,
    LossInputs,
    compute_advantages,
    grpo_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    rejection_mask,
    rl_loss,
    rloo_advantages,
    token_covariance,
)

# One row of four tokens. log π_θ = [-1, -3, -3, -1] (mean -2, centred [1, -1, -1, 1]);
# A = [3, -1, 1, -3] (mean 0): cov_t = [3, 1, -1, -3].
LOGP = jnp.array([[-1.0, -3.0, -3.0, -1.0]])
ADV = jnp.array([[3.0, -1.0, 1.0, -3.0]])
MASK = jnp.ones((1, 4))


def grads_of(inputs, cfg):
    def loss_of(logp):
        return rl_loss(dataclasses.replace(inputs, logprobs=logp), cfg)

    (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(inputs.logprobs)
    return float(loss), metrics, np.asarray(grads)[0]


def test_token_covariance_by_hand():
    np.testing.assert_allclose(token_covariance(LOGP, ADV, MASK), [[3, 1, -1, -3]])
    # Off the mask: 0, and the means run over the masked tokens only.
    masked = token_covariance(LOGP, ADV, jnp.array([[1.0, 1.0, 0.0, 0.0]]))
    np.testing.assert_allclose(masked, [[2.0, 2.0, 0.0, 0.0]])  # (±1)·(±2)


def test_clip_cov_by_hand():
    # On-policy (r = 1, nothing clipped), token mean 1/4, r = 0.25: n = max(1, ⌊0.25·4⌋)
    # = 1 token, drawn among 1 < cov < 5: only token 0 (cov 3). It keeps its value and
    # loses its gradient; the others keep -A/4: [0, 0.25, -0.25, 0.75].
    inputs = LossInputs(LOGP, LOGP, ADV, MASK)
    cfg = LossConfig(surrogate="clip_cov", cov_fraction=0.25)
    loss, metrics, grads = grads_of(inputs, cfg)
    assert loss == pytest.approx(0.0, abs=1e-6)  # -(3 - 1 + 1 - 3) / 4
    np.testing.assert_allclose(grads, [0.0, 0.25, -0.25, 0.75], rtol=1e-6)
    assert float(metrics["clip_fraction"]) == 0.25
    # A band 0 < cov < 5 holds tokens 0 and 1: exactly one of them is drawn.
    _, _, grads = grads_of(inputs, dataclasses.replace(cfg, clip_cov_low=0.0))
    assert sorted(np.flatnonzero(grads[:2] == 0.0).tolist()) in ([0], [1])
    np.testing.assert_allclose(grads[2:], [-0.25, 0.75], rtol=1e-6)


def test_kl_cov_by_hand():
    # log r = [0.1, 0, 0, 0]. n = 1: the largest cov is token 0's (3), which gets
    # r A - β|log r| = 3 e^0.1 - 0.1 and gradient (3 e^0.1 - 1) per unit log π; the others
    # keep r A = A. Loss = -(3 e^0.1 - 0.1 - 1 + 1 - 3) / 4 = -(3 e^0.1 - 3.1) / 4.
    old = LOGP - jnp.array([[0.1, 0.0, 0.0, 0.0]])
    cfg = LossConfig(surrogate="kl_cov", cov_fraction=0.25, kl_cov_coef=1.0)
    loss, metrics, grads = grads_of(LossInputs(LOGP, old, ADV, MASK), cfg)
    e = math.exp(0.1)
    assert loss == pytest.approx(-(3 * e - 3.1) / 4, rel=1e-5)
    np.testing.assert_allclose(grads, [-(3 * e - 1) / 4, 0.25, -0.25, 0.75], rtol=1e-5)
    assert float(metrics["clip_fraction"]) == 0.25  # the penalised share


# π_prox / π_b per token: row 0 [3, 1, 1], row 1 [0.9, 0.1, 0.9].
RATIOS = np.array([[3.0, 1.0, 1.0], [0.9, 0.1, 0.9]], np.float32)
BEHAVIOUR = jnp.full((2, 3), -1.0)
PROXIMAL = BEHAVIOUR + jnp.log(jnp.asarray(RATIOS))


@pytest.mark.parametrize(
    "level, low, high, expected",
    [
        # IcePop's two-sided band [0.5, 2]: 3 is above it, 0.1 below it.
        ("token", 0.5, 2.0, [[0, 1, 1], [1, 0, 1]]),
        # Products 3 (inside [0.5, 4]) and 0.9 · 0.1 · 0.9 = 0.081 (below it).
        ("sequence", 0.5, 4.0, [[1, 1, 1], [0, 0, 0]]),
        # Geometric means 3^(1/3) = 1.442 and 0.081^(1/3) = 0.4327: with [0.45, 1.5] row 1
        # is out; with [0.4, 1.4] row 0 is out instead.
        ("geometric", 0.45, 1.5, [[1, 1, 1], [0, 0, 0]]),
        ("geometric", 0.4, 1.4, [[0, 0, 0], [1, 1, 1]]),
        ("none", 0.5, 2.0, [[1, 1, 1], [1, 1, 1]]),
    ],
)
def test_rejection_masks_by_hand(level, low, high, expected):
    kept = rejection_mask(PROXIMAL, BEHAVIOUR, jnp.ones((2, 3)), level, low, high)
    np.testing.assert_array_equal(kept, expected)


def test_rejected_tokens_leave_the_loss_and_its_normaliser():
    # Plain surrogate on the proximal policy (r = 1), A = -ℓ: the loss is the token mean of
    # ℓ over the kept tokens. ℓ = [[10, 1, 2], [3, 4, 5]]; the token band [0.5, 2] keeps
    # 1, 2, 3, 5: (1 + 2 + 3 + 5) / 4 = 2.75 (all six tokens would give 25 / 6).
    per_token = jnp.array([[10.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
    inputs = LossInputs(
        PROXIMAL, BEHAVIOUR, -per_token, jnp.ones((2, 3)), proximal_logprobs=PROXIMAL
    )
    cfg = LossConfig(surrogate="none", proximal="batch", rejection="token")
    loss, metrics, grads = grads_of(inputs, cfg)
    assert loss == pytest.approx(2.75, rel=1e-6)
    assert float(metrics["rejected_fraction"]) == pytest.approx(2 / 6)
    # The rejected tokens get no gradient; the kept ones -A/4 = ℓ/4.
    np.testing.assert_allclose(grads, [0.0, 0.25, 0.5], rtol=1e-6)
    no_rejection = dataclasses.replace(cfg, rejection="none")
    assert grads_of(inputs, no_rejection)[0] == pytest.approx(25 / 6, rel=1e-6)


def test_reinforce_pp_discounts_per_policy_token_by_hand():
    # Row 0: reward 1 on its last of three tokens, γ = 0.5: returns [0.25, 0.5, 1].
    # Row 1: two tokens, reward 0: returns [0, 0]. Over the five tokens: mean 0.35,
    # deviations [-0.1, 0.15, 0.65, -0.35, -0.35], Σ squares 0.7: population std
    # sqrt(0.14) = 0.374166, Bessel-corrected sqrt(0.175) = 0.418330.
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards = jnp.array([1.0, 0.0])
    deviations = np.array([[-0.1, 0.15, 0.65], [-0.35, -0.35, 0.0]])
    ours = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    np.testing.assert_allclose(ours, deviations / (math.sqrt(0.14) + 1e-6), rtol=1e-5)
    verl = reinforce_pp_advantages(rewards, mask, gamma=0.5, convention="verl")
    np.testing.assert_allclose(verl, deviations / math.sqrt(0.175 + 1e-8), rtol=1e-5)
    # A tool's observation (mask 0) between two policy tokens is stepped over: the first
    # policy token's return is γ · 1 = 0.5, not γ² · 1.
    gapped = jnp.array([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    returns = jnp.array([[0.5, 0.0, 1.0], [0.0, 0.0, 0.0]])
    np.testing.assert_allclose(
        reinforce_pp_advantages(rewards, gapped, gamma=0.5),
        masked_whiten(returns, gapped),
        rtol=1e-6,
    )


def test_whitening_conventions_by_hand():
    # [1, 2, 3, 4]: mean 2.5, population std sqrt(1.25) = 1.118034, Bessel-corrected
    # sqrt(5/3) = 1.290994.
    values, mask = jnp.array([[1.0, 2.0, 3.0, 4.0]]), jnp.ones((1, 4))
    centred = np.array([[-1.5, -0.5, 0.5, 1.5]])
    np.testing.assert_allclose(masked_whiten(values, mask), centred / 1.118034, rtol=1e-5)
    verl = masked_whiten(values, mask, convention="verl")
    np.testing.assert_allclose(verl, centred / 1.290994, rtol=1e-5)


def test_groups_of_one_and_verl_convention_by_hand():
    # Group 0 = rewards [1, 0] (mean 0.5, Bessel std 0.707107), group 1 = [2] alone.
    rewards, groups, valid = jnp.array([1.0, 0.0, 2.0]), jnp.array([0, 0, 1]), jnp.ones(3)
    pair = 0.5 / (math.sqrt(0.5) + 1e-6)
    np.testing.assert_allclose(
        grpo_advantages(rewards, groups, valid), [pair, -pair, 0.0], rtol=1e-6
    )
    # verl's baseline for a prompt sampled once: mean 0, std 1, so A = 2 / (1 + eps).
    np.testing.assert_allclose(
        grpo_advantages(rewards, groups, valid, group_of_one="reward"),
        [pair, -pair, 2.0 / (1 + 1e-6)],
        rtol=1e-6,
    )
    # RLOO: 2 / (2 - 1) · (±0.5) = ±1; the lone prompt 0, or its reward.
    np.testing.assert_allclose(rloo_advantages(rewards, groups, valid), [1, -1, 0])
    np.testing.assert_allclose(
        rloo_advantages(rewards, groups, valid, group_of_one="reward"), [1, -1, 2]
    )
    # A group whose rewards differ by float noise: 0 under rlaxkit's rule; verl divides
    # the noise (about ±1e-7 around the mean, std about 1.7e-7) by std + eps: about ±0.1.
    noisy = jnp.array([0.3, 0.3000002])
    ours = grpo_advantages(noisy, jnp.array([0, 0]), jnp.ones(2))
    verl = grpo_advantages(noisy, jnp.array([0, 0]), jnp.ones(2), convention="verl")
    np.testing.assert_array_equal(ours, 0.0)
    assert 0.05 < float(verl[1]) < 0.2 and float(verl[0]) == pytest.approx(-float(verl[1]))


def test_the_config_reaches_the_estimators():
    mask = jnp.ones((3, 1))
    inputs = AdvantageInputs(
        rewards=jnp.array([1.0, 0.0, 2.0]),
        group_ids=jnp.array([0, 0, 1]),
        sequence_mask=jnp.ones(3),
        loss_mask=mask,
    )
    cfg = AdvantageConfig(estimator="dr_grpo", group_of_one="reward")
    advantages, _ = compute_advantages(inputs, cfg)
    np.testing.assert_allclose(advantages[:, 0], [0.5, -0.5, 2.0])


def test_the_trainer_drops_rejected_tokens_from_the_loss_and_the_normaliser():
    # Rejection in the train step = training on the kept tokens only: the gradient equals
    # the gradient of the same algorithm without rejection on the batch whose loss mask
    # holds the kept tokens (kept by hand: π_θ, the recomputed proximal policy, over the
    # random behaviour log-probs inside [0.5, 2]).
    from flax import nnx

    from rlaxkit.algorithms import algorithm
    from rlaxkit.data.batch import BucketSpec, Sample, collate
    from rlaxkit.models import ModelConfig, Transformer, positions_from_mask
    from rlaxkit.trainer.config import TrainConfig
    from rlaxkit.trainer.logprobs import token_logprobs
    from rlaxkit.trainer.state import create_train_state
    from rlaxkit.trainer.step import make_gradient_fn

    config = ModelConfig(
        family="qwen3", vocab_size=16, hidden_size=16, intermediate_size=32,
        num_layers=1, num_heads=2, num_kv_heads=1,
    )  # fmt: skip
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    rng = np.random.RandomState(0)
    samples = [
        Sample(
            prompt_tokens=rng.randint(1, 16, 3).tolist(),
            completion_tokens=rng.randint(1, 16, 6).tolist(),
            behaviour_logprobs=(-rng.rand(6) * 5).tolist(),
            versions=0,
            reward=float(i % 2),
            group_id=i // 2,
        )
        for i in range(4)
    ]
    batch = collate(samples, bucket=BucketSpec(lengths=(12,), batch_sizes=(4,)))
    model = nnx.merge(graphdef, params)
    tokens, attention = jnp.asarray(batch.tokens), jnp.asarray(batch.attention_mask)
    current = token_logprobs(model, tokens, positions_from_mask(attention), attention)
    ratio = np.exp(np.asarray(current) - batch.behaviour_logprobs)
    kept = batch.loss_mask * ((ratio >= 0.5) & (ratio <= 2.0))
    assert 0 < kept.sum() < batch.loss_mask.sum()  # some of each

    base = algorithm("decoupled_ppo")
    rejecting = base.replace(loss={"rejection": "token"})
    state = create_train_state(TrainConfig(algorithm=rejecting), params)
    grads, metrics = make_gradient_fn(TrainConfig(algorithm=rejecting), graphdef)(state, batch)
    expected, _ = make_gradient_fn(TrainConfig(algorithm=base), graphdef)(
        state, batch.replace(loss_mask=kept.astype(batch.loss_mask.dtype))
    )
    rejected = 1 - kept.sum() / batch.loss_mask.sum()
    assert float(metrics["rejected_fraction"]) == pytest.approx(rejected, rel=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
