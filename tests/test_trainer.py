"""The train step: micro-batching, on-policy identity, critic, decoupled PPO, compilation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rlaxkit.algorithms import ValueModel, aggregation_weights, algorithm
from rlaxkit.data.batch import BucketSpec, Sample, collate
from rlaxkit.models import ModelConfig, Transformer, positions_from_mask
from rlaxkit.trainer.config import OptimizerConfig, TrainConfig
from rlaxkit.trainer.logprobs import token_logprobs
from rlaxkit.trainer.state import (
    TrainState,
    create_train_state,
    learning_rate_schedule,
    make_optimizer,
)
from rlaxkit.trainer.step import make_gradient_fn, make_train_step
from rlaxkit.util.jaxutil import count_compilations

CONFIG = ModelConfig(
    family="qwen3",
    vocab_size=48,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
)
BUCKET = BucketSpec(lengths=(16,), batch_sizes=(8,))
OPTIMIZER = OptimizerConfig(learning_rate=1e-2, weight_decay=0.0)


def model_parts(seed=0):
    return nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(seed)))


def random_samples(seed, rows=7, logprobs=None):
    """Rows of 2-5 prompt and 1-8 completion tokens in groups of 4 (the last one short)."""
    rng = np.random.RandomState(seed)
    samples = []
    for i in range(rows):
        prompt = rng.randint(1, 48, rng.randint(2, 6)).tolist()
        completion = rng.randint(1, 48, rng.randint(1, 9)).tolist()
        behaviour = (-rng.rand(len(completion)) * 4).tolist() if logprobs is None else None
        samples.append(
            Sample(
                prompt_tokens=prompt,
                completion_tokens=completion,
                behaviour_logprobs=behaviour or [0.0] * len(completion),
                versions=0,
                reward=float(rng.randint(0, 2)),
                group_id=i // 4,
            )
        )
    return samples


def batch_of(seed, rows=7):
    return collate(random_samples(seed, rows), bucket=BUCKET)


@jax.jit
def _current_logprobs(graphdef, params, tokens, mask):
    model = nnx.merge(graphdef, params)
    return token_logprobs(model, tokens, positions_from_mask(mask), mask)


def on_policy(batch, graphdef, params):
    """The batch with behaviour log-probs equal to the current policy's."""
    logp = _current_logprobs(
        graphdef, params, jnp.asarray(batch.tokens), jnp.asarray(batch.attention_mask)
    )
    return batch.replace(behaviour_logprobs=np.asarray(logp) * batch.loss_mask)


def relative_error(a, b):
    diff = optax.global_norm(jax.tree.map(jnp.subtract, a, b))
    return float(diff / optax.global_norm(b))


def test_accumulated_micro_batches_equal_the_full_batch():
    # GRPO: sequence-mean aggregation, k3 KL to a reference, clipping active (the random
    # behaviour log-probs are far from the policy's).
    graphdef, params = model_parts()
    cfg = TrainConfig(algorithm=algorithm("grpo"), optimizer=OPTIMIZER)
    state = create_train_state(cfg, params, ref_params=model_parts(seed=1)[1])
    batch = batch_of(seed=0)
    full, full_metrics = make_gradient_fn(cfg, graphdef)(state, batch)
    micro_cfg = dataclasses.replace(cfg, micro_batches=4)
    accumulated, micro_metrics = make_gradient_fn(micro_cfg, graphdef)(state, batch)
    assert relative_error(accumulated, full) <= 1e-6
    assert float(full_metrics["clip_fraction"]) > 0.1
    for key in ("loss", "pg_loss", "kl_ref", "clip_fraction", "ratio_mean", "entropy"):
        np.testing.assert_allclose(micro_metrics[key], full_metrics[key], rtol=1e-6, err_msg=key)
    assert float(micro_metrics["ratio_max"]) == pytest.approx(float(full_metrics["ratio_max"]))


def test_on_policy_ratios_are_one_and_the_gradient_is_the_policy_gradient():
    graphdef, params = model_parts()
    cfg = TrainConfig(algorithm=algorithm("dapo"), optimizer=OPTIMIZER, micro_batches=2)
    state = create_train_state(cfg, params)
    batch = on_policy(batch_of(seed=1), graphdef, params)
    rng = np.random.RandomState(0)
    advantages = (rng.randn(8, 1) * batch.loss_mask).astype(np.float32)
    grads, metrics = make_gradient_fn(cfg, graphdef)(state, batch.replace(advantages=advantages))
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0, abs=1e-6)
    assert float(metrics["ratio_max"]) == pytest.approx(1.0, abs=1e-6)
    assert float(metrics["clip_fraction"]) == 0.0

    # REINFORCE with DAPO's token-mean weights: -Σ Agg A log π(θ).
    weights = aggregation_weights(jnp.asarray(batch.loss_mask), "token_mean")

    def policy_gradient_loss(p):
        logp = _current_logprobs(graphdef, p, batch.tokens, batch.attention_mask)
        return -jnp.sum(weights * advantages * logp)

    expected = jax.grad(policy_gradient_loss)(params)
    assert relative_error(grads[0], expected) <= 1e-5


def test_second_step_with_the_same_bucket_does_not_recompile():
    graphdef, params = model_parts()
    cfg = TrainConfig(
        algorithm=algorithm("dapo"),
        optimizer=OPTIMIZER,
        micro_batches=2,
        mini_batches=2,
        epochs=2,
        shuffle=True,
    )
    step = make_train_step(cfg, graphdef)
    state = create_train_state(cfg, params)
    state, first = step(state, batch_of(seed=2))
    with count_compilations() as compiles:
        state, second = step(state, batch_of(seed=3, rows=5))  # other rows, same bucket
        jax.block_until_ready(state)
    assert compiles.count == 0
    assert int(state.step) == 2
    # 2 steps x 2 epochs x 2 mini-batches optimizer updates.
    assert int(state.opt_state[1].count) == 8
    for metrics in (first, second):
        assert all(np.isfinite(v) for v in metrics.values())
    assert float(second["staleness_mean"]) == 1.0  # version-0 samples, trainer at 1
    assert float(first["tokens"]) == float(np.sum(batch_of(seed=2).loss_mask))


def test_tiered_train_step_runs_quick_then_optimised_and_is_reproducible():
    # First call: the -O0 executable; every later call: the optimised one (compiled in the
    # background). The same calls give the same numbers in two runs, and close to the
    # plain jitted step's.
    graphdef, params = model_parts()
    cfg = TrainConfig(algorithm=algorithm("grpo", loss={"kl_coef": 0.0}), optimizer=OPTIMIZER)
    batches = [batch_of(seed=s) for s in (4, 5, 6)]

    def run(step):
        state, losses = create_train_state(cfg, jax.tree.map(jnp.copy, params)), []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        return jax.device_get(state.params), losses

    tiered = make_train_step(cfg, graphdef, tiered=True)
    tiered_params, tiered_losses = run(tiered)
    tiered.wait()
    assert tiered.jitted.quick._cache_size() == 1 and tiered.jitted.optimised._cache_size() == 1
    again_params, again_losses = run(make_train_step(cfg, graphdef, tiered=True))
    assert again_losses == tiered_losses
    assert relative_error(again_params, tiered_params) == 0.0
    plain_params, plain_losses = run(make_train_step(cfg, graphdef))
    np.testing.assert_allclose(tiered_losses, plain_losses, rtol=1e-5, atol=1e-6)
    assert relative_error(tiered_params, plain_params) <= 1e-5


def test_keep_params_leaves_the_input_weights_valid_and_changes_no_number():
    # What the local runtime's zero-copy store relies on: the pushed weights are the
    # step's input params, so the step must not donate them; everything else still is.
    graphdef, params = model_parts()
    cfg = TrainConfig(algorithm=algorithm("grpo", loss={"kl_coef": 0.0}), optimizer=OPTIMIZER)
    batches = [batch_of(seed=s) for s in (4, 5)]

    def run(step):
        state, inputs, losses = create_train_state(cfg, jax.tree.map(jnp.copy, params)), [], []
        for batch in batches:
            inputs.append(state)
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        return state, inputs, losses

    kept, kept_inputs, kept_losses = run(make_train_step(cfg, graphdef, keep_params=True))
    donated, donated_inputs, donated_losses = run(make_train_step(cfg, graphdef))
    assert kept_losses == donated_losses
    assert relative_error(jax.device_get(kept.params), jax.device_get(donated.params)) == 0.0
    for state in kept_inputs:  # every input's weights are still readable
        assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state.params))
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state.opt_state))
    assert relative_error(jax.device_get(kept_inputs[0].params), jax.device_get(params)) == 0.0
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(donated_inputs[0].params))


def test_ppo_trains_policy_and_critic():
    graphdef, params = model_parts()
    value_graphdef, value_params = nnx.split(ValueModel(CONFIG, rngs=nnx.Rngs(3)))
    cfg = TrainConfig(algorithm=algorithm("ppo"), optimizer=OPTIMIZER, micro_batches=2)
    step = make_train_step(cfg, graphdef, value_graphdef=value_graphdef)
    before = jax.tree.map(np.array, (params, value_params))
    state = create_train_state(cfg, params, value_params=value_params)
    state, metrics = step(state, batch_of(seed=4))
    assert float(metrics["value_loss"]) > 0 and np.isfinite(float(metrics["loss"]))
    assert relative_error(state.params, before[0]) > 1e-4
    assert relative_error(state.value_params, before[1]) > 1e-4


def test_decoupled_ppo_centres_on_the_recomputed_policy():
    graphdef, params = model_parts()
    cfg = TrainConfig(algorithm=algorithm("decoupled_ppo"), optimizer=OPTIMIZER)
    state = create_train_state(cfg, params)
    batch = batch_of(seed=5)
    current = on_policy(batch, graphdef, params).behaviour_logprobs
    _, metrics = make_gradient_fn(cfg, graphdef)(state, batch)
    # The proximal policy is the current one, so r = π_θ/π_prox = 1 and the behaviour
    # weight is π_θ/π_behaviour, averaged over completion tokens.
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0, abs=1e-5)
    mask = batch.loss_mask > 0
    weight = np.exp(current[mask] - batch.behaviour_logprobs[mask]).mean()
    assert float(metrics["behaviour_weight_mean"]) == pytest.approx(weight, rel=1e-5)


def test_bfloat16_compute_path_traces_to_float32_master_weights():
    bf16 = CONFIG.replace(param_dtype="bfloat16")
    graphdef, params = nnx.split(Transformer(bf16, rngs=nnx.Rngs(0)))
    params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    cfg = TrainConfig(algorithm=algorithm("dapo"), compute_dtype="bfloat16")
    state = create_train_state(cfg, params)
    new_state, metrics = jax.eval_shape(make_train_step(cfg, graphdef), state, batch_of(seed=6))
    assert {x.dtype for x in jax.tree.leaves(new_state.params)} == {jnp.dtype("float32")}
    assert metrics["loss"].dtype == jnp.float32


def test_missing_reference_and_bad_batch_sizes_fail_loudly():
    graphdef, params = model_parts()
    cfg = TrainConfig(algorithm=algorithm("grpo"), micro_batches=3)
    state = create_train_state(cfg, params)
    with pytest.raises(ValueError, match="mini_batches·micro_batches = 3"):
        make_train_step(cfg, graphdef)(state, batch_of(seed=7))
    cfg = dataclasses.replace(cfg, micro_batches=1)
    with pytest.raises(ValueError, match="needs reference log-probs"):
        make_train_step(cfg, graphdef)(state, batch_of(seed=7))
    with pytest.raises(ValueError, match="value_graphdef"):
        make_train_step(TrainConfig(algorithm=algorithm("ppo")), graphdef)
    with pytest.raises(ValueError, match="value_params"):
        create_train_state(TrainConfig(algorithm=algorithm("ppo")), params)


def test_learning_rate_schedule_by_hand():
    # warmup 4: (n + 1) / 4 of the peak; then cosine over 10 updates from 1 to 0.1:
    # n = 9 is halfway, 0.1 + 0.9 * 0.5 = 0.55; from n = 14 on it stays at 0.1.
    schedule = learning_rate_schedule(
        OptimizerConfig(learning_rate=1.0, warmup_steps=4, decay_steps=10, end_lr_ratio=0.1)
    )
    got = [float(schedule(n)) for n in (0, 3, 4, 9, 14, 20)]
    np.testing.assert_allclose(got, [0.25, 1.0, 1.0, 0.55, 0.1, 0.1], rtol=1e-6)
    constant = learning_rate_schedule(OptimizerConfig(learning_rate=0.5))
    assert float(constant(0)) == float(constant(1000)) == 0.5


def test_weight_decay_skips_vectors_and_clipping_bounds_the_update():
    tx = make_optimizer(OptimizerConfig(learning_rate=0.1, weight_decay=0.5, max_grad_norm=1.0))
    params = {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_allclose(updates["kernel"], -0.1 * 0.5)  # decayed: -lr * wd * w
    np.testing.assert_array_equal(updates["bias"], 0.0)  # never decayed


def test_a_step_without_the_update_norm_trains_the_same_weights():
    # ``update_norm=False`` drops one metric and nothing else: every other metric and
    # every trained number is that of the step that reports the norm.
    graphdef, params = model_parts()
    batches = [batch_of(seed=s) for s in (4, 5)]

    def run(update_norm):
        cfg = TrainConfig(
            algorithm=algorithm("grpo", loss={"kl_coef": 0.0}),
            optimizer=OPTIMIZER,
            update_norm=update_norm,
        )
        state, history = create_train_state(cfg, jax.tree.map(jnp.copy, params)), []
        step = make_train_step(cfg, graphdef)
        for batch in batches:
            state, metrics = step(state, batch)
            history.append({k: float(v) for k, v in metrics.items()})
        return jax.device_get(state.params), jax.device_get(state.opt_state), history

    with_norm, without = run(True), run(False)
    assert all(np.isfinite(m["update_norm"]) and m["update_norm"] > 0 for m in with_norm[2])
    assert [{k: v for k, v in m.items() if k != "update_norm"} for m in with_norm[2]] == without[2]
    assert relative_error(with_norm[0], without[0]) == 0.0
    assert relative_error(with_norm[1], without[1]) == 0.0


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: OptimizerConfig(learning_rate=0.0), "learning_rate"),
        (lambda: OptimizerConfig(warmup_steps=-1), "warmup_steps"),
        (lambda: OptimizerConfig(b2=1.5), "b2"),
        (lambda: OptimizerConfig(max_grad_norm=0.0), "max_grad_norm"),
        (lambda: TrainConfig(algorithm=algorithm("dapo"), micro_batches=0), "micro_batches"),
        (lambda: TrainConfig(algorithm=algorithm("dapo"), temperature=0.0), "temperature"),
        (lambda: TrainConfig(algorithm=algorithm("dapo"), compute_dtype="fp8"), "compute_dtype"),
        (lambda: TrainConfig(algorithm=algorithm("dapo"), update_norm=1), "update_norm"),
    ],
)
def test_configs_name_the_bad_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_a_tree_rebuilt_from_a_packed_packs_back_to_it_without_a_flatten():
    # A trainer publishes ``state.params`` (rebuilt from the step's packed state) and
    # every worker's engine packs it again: while the tree lives, that is the Packed it
    # came from, with the same leaves a flatten gives.
    import gc

    from rlaxkit.param_server.base import tree_nbytes
    from rlaxkit.util.jaxutil import _BUILT, Packed, tree_leaves

    _, params = model_parts()
    source = Packed.of(params)
    tree = source.tree()
    assert Packed.of(tree) is source
    assert all(a is b for a, b in zip(tree_leaves(tree), source.leaves, strict=True))
    assert tree_nbytes(tree) == tree_nbytes(params) == sum(x.nbytes for x in source.leaves)
    again = Packed.of(jax.tree.map(lambda x: x, tree))  # an equal tree, not that one
    assert again is not source and again.structure is source.structure
    assert all(a is b for a, b in zip(again.leaves, source.leaves, strict=True))
    assert Packed.of(params) is not source  # a tree the Packed was made from: flattened
    held = len(_BUILT)
    del tree
    gc.collect()
    assert len(_BUILT) == held - 1  # forgotten with the tree
    plain = Packed.of({"w": jnp.zeros(2)})
    assert Packed.of(plain.tree()) is not plain  # dicts take no weak references


def test_a_returned_state_is_plain_and_the_next_step_takes_it_packed():
    # The step hands back a plain state; it remembers that state's packed fields, so
    # the next step takes it without a flatten, and its params pack back to what the
    # step returned. A state made otherwise (a tree map, replace, pickling) is packed
    # anew, and every form of one state gives the same next step.
    import pickle

    from rlaxkit.util.jaxutil import Packed

    graphdef, params = model_parts()
    cfg = TrainConfig(algorithm=algorithm("grpo", loss={"kl_coef": 0.0}), optimizer=OPTIMIZER)
    step = make_train_step(cfg, graphdef, donate=False)
    start = create_train_state(cfg, params)
    state, _ = step(start, batch_of(seed=4))
    assert type(state) is TrainState and int(state.step) == 1
    assert set(vars(state)) == {f.name for f in dataclasses.fields(TrainState)}
    assert jax.tree.structure(state) == jax.tree.structure(start)
    remembered = step._arguments(state)
    assert step._arguments(state)[0] is remembered[0]  # no flatten: the step's own
    assert Packed.of(state.params) is remembered[0]
    assert Packed.of(state.params).structure is Packed.of(start.params).structure

    eager = jax.tree.map(lambda x: x, state)  # a new tree of the same arrays
    assert step._arguments(eager)[0] is not remembered[0]
    bumped = state.replace(rng=jnp.zeros_like(start.rng))
    assert type(bumped) is TrainState and int(bumped.step) == 1
    assert np.array_equal(bumped.rng, np.zeros_like(start.rng))
    restored = pickle.loads(pickle.dumps(state))
    assert type(restored) is TrainState
    with pytest.raises(TypeError, match="steps"):
        state.replace(steps=2)
    with pytest.raises(AttributeError, match="'value_param'"):
        _ = state.value_param

    with count_compilations() as compiles:
        outputs = [step(s, batch_of(seed=5)) for s in (state, eager, bumped, restored)]
    assert compiles.count == 0  # one structure, however the state was made
    packed_params = jax.device_get(outputs[0][0].params)
    for other, _ in (outputs[1], outputs[3]):  # bumped's rng differs: it shuffles otherwise
        assert relative_error(jax.device_get(other.params), packed_params) == 0.0
