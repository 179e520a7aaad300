"""On-policy distillation: the per-token reverse-KL reward (``sampled``), the exact
reverse KL in the loss (``full``), the teacher in the train step, and the run config's
``distill`` section."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlaxkit.algorithms import (
    DistillConfig,
    algorithm,
    distillation_advantages,
    distillation_rewards,
    full_distillation_loss,
    reverse_kl,
)
from rlaxkit.config.run import small_run_config
from rlaxkit.data.batch import BucketSpec, Sample, collate
from rlaxkit.models import ModelConfig, Transformer, positions_from_mask, save_hf_checkpoint
from rlaxkit.runtime import Experiment
from rlaxkit.runtime.build import build_task, char_tokenizer, check_inputs
from rlaxkit.trainer.config import OptimizerConfig, TrainConfig
from rlaxkit.trainer.logprobs import token_logprobs
from rlaxkit.trainer.state import create_train_state
from rlaxkit.trainer.step import make_gradient_fn, make_prepare_fn, make_train_step
from rlaxkit.trainer.teacher import distill_config, initial_train_state

CONFIG = ModelConfig(
    family="qwen3",
    vocab_size=48,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
)

# A teacher of another size (two layers, twice as wide) with the student's vocabulary.
TEACHER = dataclasses.replace(CONFIG, hidden_size=64, intermediate_size=128, num_layers=2)


@jax.jit
def _current_logprobs(graphdef, params, tokens, mask):
    return token_logprobs(nnx.merge(graphdef, params), tokens, positions_from_mask(mask), mask)


def on_policy_batch(seed, graphdef, params, rows=8):
    """Rows of 2-5 prompt and 1-8 completion tokens in groups of 4, random rewards, with
    the policy's own log-probs as behaviour log-probs."""
    rng = np.random.RandomState(seed)
    samples = []
    for i in range(rows):
        completion = rng.randint(1, 48, rng.randint(1, 9)).tolist()
        samples.append(
            Sample(
                prompt_tokens=rng.randint(1, 48, rng.randint(2, 6)).tolist(),
                completion_tokens=completion,
                behaviour_logprobs=[0.0] * len(completion),
                versions=0,
                reward=float(rng.randint(0, 2)),
                group_id=i // 4,
            )
        )
    batch = collate(samples, bucket=BucketSpec(lengths=(16,), batch_sizes=(8,)))
    logp = _current_logprobs(
        graphdef, params, jnp.asarray(batch.tokens), jnp.asarray(batch.attention_mask)
    )
    return batch.replace(behaviour_logprobs=np.asarray(logp) * batch.loss_mask)


def batch_of_zeros():
    sample = Sample(
        prompt_tokens=[1, 2],
        completion_tokens=[3],
        behaviour_logprobs=[0.0],
        versions=0,
        reward=0.0,
        group_id=0,
    )
    return collate([sample] * 8, bucket=BucketSpec(lengths=(16,), batch_sizes=(8,)))


def test_rewards_by_hand_and_masked_positions_give_zero():
    # Row 0: teacher p = (0.5, 0.1), student p = (0.25, 0.4), both tokens in the mask:
    # r = ln(0.5 / 0.25) = ln 2 = 0.693147, ln(0.1 / 0.4) = -ln 4 = -1.386294.
    # Row 1: the second token is masked and its teacher log-prob is -inf: r = 0 there.
    teacher = jnp.log(jnp.array([[0.5, 0.1], [0.2, 0.0]]))
    student = jnp.log(jnp.array([[0.25, 0.4], [0.2, 0.3]]))
    mask = jnp.array([[1.0, 1.0], [1.0, 0.0]])
    rewards = distillation_rewards(teacher, student, mask)
    np.testing.assert_allclose(rewards, [[0.693147, -1.386294], [0.0, 0.0]], atol=1e-6)
    # A = A_task + 2 r with the task; 2 r alone without. The batch's mean r over the three
    # completion tokens is (ln 2 - ln 4 + 0) / 3 = -ln 2 / 3 = -0.231049; the exact KL
    # given per position is averaged over the same tokens: (0.3 + 0.6 + 0.9) / 3.
    task = jnp.array([[1.0, 1.0], [-1.0, 0.0]])
    token_kl = jnp.array([[0.3, 0.6], [0.9, jnp.nan]])
    with_task, stats = distillation_advantages(
        task, teacher, student, mask, DistillConfig(weight=2), token_kl
    )
    np.testing.assert_allclose(with_task, [[2.386294, -1.772589], [-1.0, 0.0]], atol=1e-6)
    np.testing.assert_allclose(stats["distill_reward_mean"], -0.231049, atol=1e-6)
    np.testing.assert_allclose(stats["distill_reverse_kl"], 0.6, atol=1e-6)
    alone, _ = distillation_advantages(
        task, teacher, student, mask, DistillConfig(weight=2, task_reward=False)
    )
    np.testing.assert_allclose(alone, 2 * rewards, atol=1e-6)


def _train_config(
    weight=1.0, task_reward=True, learning_rate=1e-2, teacher_model=None, estimator="sampled"
):
    return TrainConfig(
        algorithm=algorithm("grpo", loss={"kl_coef": 0.0}),
        optimizer=OptimizerConfig(learning_rate=learning_rate, weight_decay=0.0),
        distill=DistillConfig(
            weight=weight, task_reward=task_reward, teacher_model=teacher_model, estimator=estimator
        ),
    )


def exact_kl(graphdef, params, teacher_graphdef, teacher, batch):
    """The batch's mean KL(student ‖ teacher) per completion token, over the vocabulary."""
    tokens, mask = jnp.asarray(batch.tokens), jnp.asarray(batch.attention_mask)
    positions = positions_from_mask(mask)
    student = nnx.merge(graphdef, params)(tokens, positions, mask)[:, :-1]
    teacher = nnx.merge(teacher_graphdef, teacher)(tokens, positions, mask)[:, :-1]
    loss_mask = jnp.asarray(batch.loss_mask, jnp.float32)[:, 1:]
    return float(jnp.sum(reverse_kl(student, teacher) * loss_mask) / jnp.sum(loss_mask))


def test_the_full_kl_and_its_gradient_by_hand():
    # Vocabulary of 3, three tokens: the logits at positions 0 and 1 give the
    # distributions of tokens 1 and 2 (token 0 has none).
    # Token 1: student (1/2, 1/4, 1/4), teacher (1/4, 1/2, 1/4):
    #   KL = ½ ln 2 + ¼ ln ½ + 0 = ¼ ln 2.
    # Token 2: student (0.8, 0.1, 0.1), teacher (0.4, 0.2, 0.4):
    #   KL = 0.8 ln 2 + 0.1 ln ½ + 0.1 ln ¼ = ½ ln 2.
    ln2 = float(np.log(2.0))
    student = jnp.log(jnp.array([[[0.5, 0.25, 0.25], [0.8, 0.1, 0.1]]]))
    teacher = jnp.log(jnp.array([[[0.25, 0.5, 0.25], [0.4, 0.2, 0.4]]]))
    np.testing.assert_allclose(reverse_kl(student, teacher), [[ln2 / 4, ln2 / 2]], atol=1e-6)
    # Token weights (0, ¼, ½) and weight 2: 2 (¼ · ¼ + ½ · ½) ln 2 = ⅝ ln 2; the metric
    # weights (0, ½, ½) give the mean KL, ⅜ ln 2.
    weights, metric = jnp.array([[0.0, 0.25, 0.5]]), jnp.array([[0.0, 0.5, 0.5]])
    cfg = DistillConfig(weight=2.0, estimator="full")

    def term(s, t):
        return full_distillation_loss(s, t, weights, metric, cfg)

    (loss, stats), (grad_s, grad_t) = jax.value_and_grad(term, argnums=(0, 1), has_aux=True)(
        student, teacher
    )
    np.testing.assert_allclose(loss, 0.625 * ln2, atol=1e-6)
    np.testing.assert_allclose(stats["distill_reverse_kl"], 0.375 * ln2, atol=1e-6)
    # d KL / d z_v = p_S(v) (log p_S(v) - log p_T(v) - KL), scaled by weight · w_t; the
    # teacher is a constant.
    p_s, p_t = jnp.exp(student[0]), jnp.exp(teacher[0])
    kl = jnp.array([ln2 / 4, ln2 / 2])[:, None]
    expected = 2.0 * weights[0, 1:, None] * p_s * (jnp.log(p_s) - jnp.log(p_t) - kl)
    np.testing.assert_allclose(grad_s[0], expected, atol=1e-6)
    np.testing.assert_array_equal(grad_t, jnp.zeros_like(grad_t))
    # A position of weight 0 adds nothing, whatever its logits (here a KL of NaN).
    wild = student.at[0, 0].set(jnp.array([0.0, -jnp.inf, 0.0]))
    assert np.isnan(reverse_kl(wild, teacher)[0, 0])
    masked = full_distillation_loss(wild, teacher, weights.at[0, 1].set(0.0), metric, cfg)[0]
    np.testing.assert_allclose(masked, 2 * 0.5 * ln2 / 2, atol=1e-6)


def test_a_teacher_equal_to_the_student_gives_zero_reward_and_the_task_advantage():
    graphdef, params = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))
    batch = on_policy_batch(1, graphdef, params)
    cfg = _train_config()
    state = create_train_state(cfg, params, teacher_params=params)
    prepared, stats = make_prepare_fn(cfg, graphdef)(state, batch)
    plain = dataclasses.replace(cfg, distill=None)
    expected, _ = make_prepare_fn(plain, graphdef)(create_train_state(plain, params), batch)
    assert abs(float(stats["distill_reward_mean"])) < 1e-6
    np.testing.assert_allclose(prepared.advantages, expected.advantages, atol=1e-5)


def test_full_with_a_teacher_equal_to_the_student_gives_zero_kl_and_the_task_gradient():
    graphdef, params = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))
    batch = on_policy_batch(1, graphdef, params)
    cfg = dataclasses.replace(_train_config(estimator="full"), micro_batches=2)
    state = create_train_state(cfg, params, teacher_params=params)
    grads, metrics = make_gradient_fn(cfg, graphdef)(state, batch)
    plain = dataclasses.replace(cfg, distill=None)
    expected, plain_metrics = make_gradient_fn(plain, graphdef)(
        create_train_state(plain, params), batch
    )
    assert abs(float(metrics["distill_reverse_kl"])) < 1e-6
    np.testing.assert_allclose(metrics["loss"], plain_metrics["loss"], atol=1e-6)
    assert "distill_reward_mean" not in metrics  # no per-token reward with "full"
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    # Without the task reward nothing is left to learn from such a teacher.
    alone = dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, task_reward=False))
    grads, _ = make_gradient_fn(alone, graphdef)(state, batch)
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads)) < 1e-6


@pytest.mark.parametrize("estimator", ["sampled", "full"])
def test_distill_reverse_kl_is_the_exact_kl_of_the_batch(estimator):
    graphdef, params = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))
    teacher_graphdef, teacher = nnx.split(Transformer(TEACHER, rngs=nnx.Rngs(7)))
    batch = on_policy_batch(3, graphdef, params)
    cfg = _train_config(teacher_model=TEACHER, estimator=estimator)
    state = create_train_state(cfg, params, teacher_params=teacher)
    _, metrics = make_gradient_fn(cfg, graphdef)(state, batch)
    want = exact_kl(graphdef, params, teacher_graphdef, teacher, batch)
    np.testing.assert_allclose(metrics["distill_reverse_kl"], want, rtol=1e-5)


def test_full_steps_on_a_fixed_batch_lower_the_exact_kl_to_a_larger_teacher():
    graphdef, params = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))
    teacher_graphdef, teacher = nnx.split(Transformer(TEACHER, rngs=nnx.Rngs(7)))
    batch = on_policy_batch(2, graphdef, params)
    cfg = _train_config(
        task_reward=False, learning_rate=1e-3, teacher_model=TEACHER, estimator="full"
    )
    state = create_train_state(cfg, params, teacher_params=teacher)
    step = make_train_step(cfg, graphdef, donate=False)  # the teacher is read after
    kls = [exact_kl(graphdef, params, teacher_graphdef, teacher, batch)]
    for _ in range(5):
        state, metrics = step(state, batch)
        # The step's metric is the KL under the weights it started from.
        np.testing.assert_allclose(metrics["distill_reverse_kl"], kls[-1], rtol=1e-5)
        kls.append(exact_kl(graphdef, state.params, teacher_graphdef, teacher, batch))
    assert all(after < before for before, after in zip(kls, kls[1:], strict=False)), kls
    assert kls[-1] < 0.9 * kls[0], kls


def test_one_step_is_finite_and_moves_the_student_toward_a_larger_teacher():
    graphdef, params = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))
    teacher_graphdef, teacher = nnx.split(Transformer(TEACHER, rngs=nnx.Rngs(7)))
    batch = on_policy_batch(2, graphdef, params)
    tokens, mask = jnp.asarray(batch.tokens), jnp.asarray(batch.attention_mask)
    loss_mask = jnp.asarray(batch.loss_mask)
    teacher_logp = _current_logprobs(teacher_graphdef, teacher, tokens, mask)

    def squared_gap(p):
        # On the sampled tokens, A_t = log π_T - log π_S makes the policy gradient the
        # descent direction of ½ Σ (log π_T - log π_S)²: one small step lowers it.
        student = _current_logprobs(graphdef, p, tokens, mask)
        return float(jnp.sum(loss_mask * (teacher_logp - student) ** 2))

    before = squared_gap(params)
    cfg = _train_config(task_reward=False, learning_rate=1e-3, teacher_model=TEACHER)
    state = create_train_state(cfg, params, teacher_params=teacher)
    step = make_train_step(cfg, graphdef)
    state, metrics = step(state, batch)
    assert all(np.isfinite(float(v)) for v in metrics.values())
    assert float(metrics["distill_reverse_kl"]) > 0  # a random teacher disagrees
    after = squared_gap(state.params)
    assert after < 0.98 * before, (before, after)


def test_a_state_without_the_teacher_is_refused():
    graphdef, params = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))
    cfg = _train_config()
    with pytest.raises(ValueError, match="give the state teacher_params"):
        make_prepare_fn(cfg, graphdef)(create_train_state(cfg, params), batch_of_zeros())


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["distill.weight=1.0"], r"config\.distill: teacher: missing .* set distill\.teacher"),
        (["distill.teacher=t", "distill.weight=0"], r"config\.distill: weight: must be"),
        (
            ["distill.teacher=t", "distill.estimator=topk"],
            r"config\.distill\.estimator: must be one of \['sampled', 'full'\], got 'topk'",
        ),
        (
            ["distill.teacher=t", "distill.task_reward=false"],
            r"set batching\.equal_rewards=keep",
        ),
    ],
)
def test_config_errors_name_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        small_run_config(*overrides)


def test_distill_config_names_the_estimator_field():
    with pytest.raises(ValueError, match=r"estimator: must be one of \('sampled', 'full'\)"):
        DistillConfig(estimator="topk")


def test_the_run_checks_the_teacher_directory_and_its_vocabulary(tmp_path):
    config = small_run_config(f"distill.teacher={tmp_path / 'none'}")
    with pytest.raises(ValueError, match=r"distill\.teacher: .* has no config\.json"):
        check_inputs(config)
    vocab = char_tokenizer(config, build_task(config)).vocab_size
    small = dataclasses.replace(TEACHER, num_layers=1, hidden_size=32, intermediate_size=64)
    for name, size in (("wrong", vocab + 1), ("right", vocab)):
        model = Transformer(dataclasses.replace(small, vocab_size=size), rngs=nnx.Rngs(0))
        save_hf_checkpoint(model, tmp_path / name)
    wrong = small_run_config(f"distill.teacher={tmp_path / 'wrong'}")
    with pytest.raises(ValueError, match=rf"vocabulary of {vocab + 1} tokens, the student {vocab}"):
        check_inputs(wrong)
    right = small_run_config(f"distill.teacher={tmp_path / 'right'}")
    check_inputs(right)
    # The run's trainer reads the teacher's architecture and weights from there.
    model = Transformer(dataclasses.replace(small, vocab_size=vocab), rngs=nnx.Rngs(1))
    train_config = dataclasses.replace(_train_config(), distill=distill_config(right.distill))
    assert train_config.distill.teacher_model == model.config
    state = initial_train_state(right, train_config, nnx.split(model)[1], vocab)
    saved = nnx.split(Transformer(model.config, rngs=nnx.Rngs(0)))[1]
    leaves = zip(jax.tree.leaves(state.teacher_params), jax.tree.leaves(saved), strict=True)
    for loaded, written in leaves:
        np.testing.assert_array_equal(loaded, written)


def test_a_run_with_a_teacher_of_another_size_trains_on_its_reward(tmp_path):
    # The runtime's wiring: the trainer reads the teacher from the checkpoint directory
    # and the step reports the distillation reward of the fleet's samples.
    config = small_run_config("sft.steps=0", "steps=1", "batching.equal_rewards=keep")
    vocab = char_tokenizer(config, build_task(config)).vocab_size
    teacher = dataclasses.replace(TEACHER, vocab_size=vocab, num_layers=1)
    save_hf_checkpoint(Transformer(teacher, rngs=nnx.Rngs(3)), tmp_path / "teacher")
    config = small_run_config(
        "sft.steps=0",
        "batching.equal_rewards=keep",
        f"distill.teacher={tmp_path / 'teacher'}",
        "distill.task_reward=false",
    )
    with Experiment(config) as exp:
        metrics = exp.step()
    assert np.isfinite(metrics["train/distill_reverse_kl"]) and np.isfinite(metrics["train/loss"])
    # Two untrained models disagree: the student's samples are unlikely under the teacher.
    assert metrics["train/distill_reverse_kl"] > 0
