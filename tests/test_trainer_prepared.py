"""The prepared batch: which fields each algorithm fills before its updates, and their values."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_trainer import CONFIG, OPTIMIZER, batch_of, model_parts, on_policy

from rlaxkit.algorithms import PRESETS, ValueModel, algorithm
from rlaxkit.models import positions_from_mask
from rlaxkit.trainer.config import TrainConfig
from rlaxkit.trainer.state import create_train_state
from rlaxkit.trainer.step import PreparedBatch, make_prepare_fn

OPTIONAL = ("returns", "old_values", "ref_logprobs", "proximal_logprobs")


def shapes(name, epochs=1):
    """``jax.eval_shape`` of the prepared batch for preset ``name`` (traced, not run)."""
    graphdef, params = model_parts()
    cfg = TrainConfig(algorithm=algorithm(name), optimizer=OPTIMIZER, epochs=epochs)
    value_graphdef, value_params = None, None
    if cfg.algorithm.needs_value_model:
        value_graphdef, value_params = nnx.split(ValueModel(CONFIG, rngs=nnx.Rngs(3)))
    state = create_train_state(cfg, params, value_params=value_params, ref_params=params)
    prepare = make_prepare_fn(cfg, graphdef, value_graphdef=value_graphdef)
    return cfg, jax.eval_shape(prepare, state, batch_of(seed=0))[0]


@pytest.mark.parametrize("epochs", [1, 2])
@pytest.mark.parametrize("name", PRESETS.names())
def test_every_preset_prepares_what_its_loss_reads(name, epochs):
    cfg, prepared = shapes(name, epochs)
    algo = cfg.algorithm
    recompute = algo.loss.proximal == "recompute" and epochs > 1  # one update: fused
    present = {field: getattr(prepared, field) is not None for field in OPTIONAL}
    assert present == {
        "returns": algo.needs_value_model,
        "old_values": algo.needs_value_model,
        "ref_logprobs": algo.needs_reference,
        "proximal_logprobs": recompute,
    }
    # The aggregation weights belong to a mini-batch, set only when its gradient is taken.
    assert prepared.token_weights is None and prepared.metric_weights is None
    for leaf in jax.tree.leaves(prepared):
        assert leaf.shape == (8, 16)
    assert prepared.loss_mask.dtype == jnp.float32


def test_prepared_values_are_the_batch_the_reference_and_the_current_policy():
    graphdef, params = model_parts()
    ref_params = model_parts(seed=1)[1]
    cfg = TrainConfig(
        algorithm=algorithm("decoupled_ppo", loss={"kl_coef": 0.01}),
        optimizer=OPTIMIZER,
        epochs=2,
        micro_batches=2,
    )
    state = create_train_state(cfg, params, ref_params=ref_params)
    batch = batch_of(seed=1)
    advantages = (np.arange(8, dtype=np.float32)[:, None] * batch.loss_mask).astype(np.float32)
    prepared, stats = make_prepare_fn(cfg, graphdef)(state, batch.replace(advantages=advantages))
    assert isinstance(prepared, PreparedBatch)
    assert prepared.returns is None and prepared.old_values is None
    # Carried from the batch unchanged; positions derived from the mask.
    for field in ("tokens", "attention_mask", "behaviour_logprobs", "versions", "advantages"):
        expected = advantages if field == "advantages" else getattr(batch, field)
        np.testing.assert_array_equal(getattr(prepared, field), expected, err_msg=field)
    np.testing.assert_array_equal(prepared.positions, positions_from_mask(batch.attention_mask))
    # Reference and proximal log-probs: the reference and the current policy's on every
    # completion token (micro-batched forward passes, so not bitwise).
    mask = batch.loss_mask > 0
    for got, model_params in (
        (prepared.ref_logprobs, ref_params),
        (prepared.proximal_logprobs, params),
    ):
        want = on_policy(batch, graphdef, model_params).behaviour_logprobs
        np.testing.assert_allclose(np.asarray(got)[mask], want[mask], rtol=1e-5, atol=1e-5)
    assert float(stats["tokens"]) == float(batch.loss_mask.sum())
    assert float(stats["sequences"]) == 7.0


def test_prepared_batch_is_a_pytree_without_its_empty_fields():
    rows = jnp.zeros((4, 3))
    prepared = PreparedBatch(
        tokens=rows,
        positions=rows,
        attention_mask=rows,
        loss_mask=rows,
        behaviour_logprobs=rows,
        versions=rows,
        advantages=rows,
    )
    assert len(jax.tree.leaves(prepared)) == 7
    split = jax.tree.map(lambda x: x.reshape(2, 2, 3), prepared)
    assert split.returns is None and split.tokens.shape == (2, 2, 3)
    _, scanned = jax.lax.scan(lambda c, micro: (c, micro), 0, split)
    assert jax.tree.structure(scanned) == jax.tree.structure(prepared)
    assert dataclasses.replace(prepared, returns=rows).returns is rows
