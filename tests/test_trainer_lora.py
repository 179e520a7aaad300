"""LoRA training: the adapters' gradient is the full gradient pulled back through
``W + s·A@B``, a step trains only the adapters, and it compiles once."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_trainer import OPTIMIZER, batch_of, model_parts, relative_error

from rlaxkit.algorithms import algorithm
from rlaxkit.models.lora import LoraConfig, adapter_nbytes, merge_adapters
from rlaxkit.trainer.config import TrainConfig
from rlaxkit.trainer.state import create_train_state
from rlaxkit.trainer.step import make_gradient_fn, make_train_step
from rlaxkit.util.jaxutil import count_compilations

LORA = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "up_proj", "down_proj"))


def lora_config(**changes):
    cfg = TrainConfig(algorithm=algorithm("dapo"), optimizer=OPTIMIZER, lora=LORA)
    return dataclasses.replace(cfg, **changes)


def _trained_adapters(state, seed=7):
    """The state's adapters with non-zero B, as after some training."""
    leaves, treedef = jax.tree.flatten(state.adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + 0.05 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
    adapters = jax.tree.unflatten(treedef, noisy)
    return state.replace(
        adapters=adapters, params=merge_adapters(state.base_params, adapters, LORA)
    )


def test_initial_lora_state_is_the_base_model_with_optimizer_state_for_adapters_only():
    _, params = model_parts()
    state = create_train_state(lora_config(), params)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    # Adam's two moments cover the adapters, not the model.
    moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if jnp.ndim(x) >= 1)
    adapter_values = sum(x.size for x in jax.tree.leaves(state.adapters))
    assert moments == 2 * adapter_values
    assert adapter_nbytes(state.adapters) < 0.5 * sum(x.nbytes for x in jax.tree.leaves(params))


def test_adapter_gradient_is_the_full_gradient_through_the_low_rank_product():
    """dL/dA = s·G @ Bᵀ and dL/dB = s·Aᵀ @ G, G the full step's gradient of the merged
    kernel: a LoRA step is the full step restricted to the adapters."""
    graphdef, params = model_parts()
    lora_state = _trained_adapters(create_train_state(lora_config(), params))
    full_cfg = dataclasses.replace(lora_config(), lora=None)
    full_state = create_train_state(full_cfg, lora_state.params)
    batch = batch_of(seed=0)
    (adapter_grads, _), lora_metrics = make_gradient_fn(lora_config(), graphdef)(lora_state, batch)
    (full_grads, _), full_metrics = make_gradient_fn(full_cfg, graphdef)(full_state, batch)
    np.testing.assert_allclose(lora_metrics["loss"], full_metrics["loss"], rtol=1e-6)
    expected, got = [], []
    for path, leaf in nnx.to_flat_state(lora_state.adapters):
        *module, which = path
        if which != "lora_a":
            continue
        a = leaf[...]
        b = _at(lora_state.adapters, (*module, "lora_b"))
        g = _at(full_grads, (*module, "kernel"))
        expected += [LORA.scale * g @ b.T, LORA.scale * a.T @ g]
        got += [_at(adapter_grads, (*module, "lora_a")), _at(adapter_grads, (*module, "lora_b"))]
    assert relative_error(got, expected) <= 1e-5


def _at(state, path):
    """The array at ``path`` of an ``nnx.State``."""
    for key in path:
        state = state[key]
    return state[...]


def test_lora_step_trains_adapters_only_and_does_not_recompile():
    graphdef, params = model_parts()
    cfg = lora_config(micro_batches=2)
    state = create_train_state(cfg, params)
    base = jax.tree.map(np.asarray, state.base_params)
    step = make_train_step(cfg, graphdef)
    state, first = step(state, batch_of(seed=2))
    with count_compilations() as compiles:
        state, second = step(state, batch_of(seed=3, rows=5))
        jax.block_until_ready(state)
    assert compiles.count == 0
    assert int(state.step) == 2
    assert all(np.isfinite(v) for m in (first, second) for v in m.values())
    for a, b in zip(jax.tree.leaves(state.base_params), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(a, b)  # the base stays frozen
    merged = merge_adapters(state.base_params, state.adapters, LORA)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(merged), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # params is the merged policy
    changed = {
        "/".join(map(str, path[:-1]))
        for (path, new), old in zip(
            nnx.to_flat_state(state.params), jax.tree.leaves(base), strict=True
        )
        if not np.array_equal(new[...], old)
    }
    assert changed and all(name.split("/")[-1] in LORA.targets for name in changed)


def test_lora_config_is_checked():
    with pytest.raises(ValueError, match="lora"):
        TrainConfig(algorithm=algorithm("dapo"), lora={"rank": 4})


def test_a_lora_run_learns_through_the_runtime_and_resumes_to_the_uninterrupted_run(tmp_path):
    """The loop trains adapters end to end (pushes, evaluation and checkpoints see the
    merged policy), and a run resumed from its checkpoint continues bit for bit."""
    from test_runtime import SMALL, learning_metrics

    from rlaxkit.config.run import small_run_config
    from rlaxkit.runtime import Experiment

    overrides = (*SMALL, "trainer.lora.rank=4", "checkpoint.every_steps=2")
    cache = tmp_path / "cache"
    with Experiment(small_run_config(*overrides), cache_dir=cache) as exp:
        exp.run(4)
        uninterrupted = learning_metrics(exp.history)
    run_dir = tmp_path / "run"
    with Experiment(small_run_config(*overrides), run_dir=run_dir, cache_dir=cache) as exp:
        exp.run(2)
    with Experiment(small_run_config(*overrides), run_dir=run_dir, cache_dir=cache) as exp:
        exp.run(2)  # two more, from the checkpoint of step 2
        resumed = learning_metrics(exp.history)
    assert resumed == uninterrupted
    assert all(np.isfinite(m["train/loss"]) for m in uninterrupted)
    assert uninterrupted[-1]["train/grad_norm"] > 0
