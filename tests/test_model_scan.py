"""Scan over layers and activation checkpointing change memory and compile time, never a
number: stacked = per-layer and remat = no remat, for the forward pass, the KV-cache
decode, a train step (also sharded), checkpoints and HF round trips."""

import dataclasses
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from test_trainer import CONFIG, OPTIMIZER, batch_of, relative_error
from test_trainer_sharding import run_on_forced_devices

from rlaxkit.algorithms import algorithm
from rlaxkit.models import (
    KVCache,
    ModelConfig,
    Transformer,
    is_stacked,
    load_hf_checkpoint,
    relayout,
    relayout_tree,
    save_hf_checkpoint,
    stack_layers,
    unstack_layers,
)
from rlaxkit.models.kv_cache import store
from rlaxkit.trainer.checkpoint import CheckpointManager, restore_train_state, save_train_state
from rlaxkit.trainer.config import OptimizerConfig, TrainConfig
from rlaxkit.trainer.sharding import param_partition_spec
from rlaxkit.trainer.state import create_train_state, make_optimizer
from rlaxkit.trainer.step import make_gradient_fn, make_train_step
from rlaxkit.util.jaxutil import count_compilations

SCAN = CONFIG.replace(scan_layers=True)


def test_stacked_layers_start_from_the_per_layer_numbers_and_convert_both_ways():
    per_layer = Transformer(CONFIG, rngs=nnx.Rngs(0))
    stacked = Transformer(SCAN, rngs=nnx.Rngs(0))
    kernel = stacked.layers.self_attn.q_proj.kernel[...]
    assert kernel.shape == (CONFIG.num_layers, *per_layer.layers[0].self_attn.q_proj.kernel.shape)
    for i in range(CONFIG.num_layers):
        np.testing.assert_array_equal(kernel[i], per_layer.layers[i].self_attn.q_proj.kernel[...])
    converted = stack_layers(nnx.state(per_layer))
    jax.tree.map(np.testing.assert_array_equal, converted, nnx.state(stacked))
    jax.tree.map(np.testing.assert_array_equal, unstack_layers(converted), nnx.state(per_layer))
    assert relayout(per_layer, scan_layers=False) is per_layer


def test_scan_and_remat_give_the_per_layer_logits_and_decode():
    per_layer = Transformer(CONFIG, rngs=nnx.Rngs(0))
    stacked = Transformer(SCAN, rngs=nnx.Rngs(0))
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, CONFIG.vocab_size, (2, 9)))
    mask = jnp.asarray(np.arange(9)[None] >= np.array([[0], [3]]))  # second row left-padded
    positions = jnp.maximum(jnp.cumsum(mask, -1) - 1, 0) * mask
    logits = nnx.jit(
        lambda model, remat: model.unembed(
            model.hidden_states(tokens, positions, mask, remat=remat)
        ),
        static_argnums=1,
    )
    want = logits(per_layer, "none")
    for model in (per_layer, stacked):
        for remat in ("none", "dots", "full"):
            got = logits(model, remat)
            assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) <= 1e-6
    decode = nnx.jit(lambda model, cache: model.decode(tokens, positions, cache, mask))
    a, cache_a = decode(per_layer, KVCache.zeros(CONFIG, 2, 12))
    b, cache_b = decode(stacked, KVCache.zeros(CONFIG, 2, 12))
    np.testing.assert_array_equal(a, b)  # a per-layer cache runs the per-layer program
    jax.tree.map(np.testing.assert_array_equal, cache_a, cache_b)


def test_a_stacked_cache_decodes_in_one_scan_as_the_per_layer_cache():
    # Prefill, then single-token steps whose rows write at different slots, one of them
    # past the cache's end (moved back to the last slot, as a dynamic update slice is).
    per_layer = Transformer(CONFIG, rngs=nnx.Rngs(0))
    stacked = Transformer(SCAN, rngs=nnx.Rngs(0))
    rng = np.random.RandomState(1)
    tokens = jnp.asarray(rng.randint(0, CONFIG.vocab_size, (3, 6)))
    mask = jnp.asarray(np.arange(6)[None] < np.array([[6], [4], [2]]))
    decode = nnx.jit(lambda model, cache, t, p, m: model.decode(t, p, cache, m))
    caches = {"list": KVCache.zeros(CONFIG, 3, 8), "stacked": KVCache.zeros(SCAN, 3, 8)}
    assert caches["stacked"].stacked and not caches["list"].stacked
    assert caches["stacked"].k.shape == (CONFIG.num_layers, *caches["list"].k[0].shape)
    models = {"list": per_layer, "stacked": stacked}
    positions = jnp.broadcast_to(jnp.arange(6), (3, 6))
    feeds = [(tokens, positions, mask)]
    for step in range(3):
        next_tokens = jnp.asarray(rng.randint(0, CONFIG.vocab_size, (3, 1)))
        feeds.append((next_tokens, jnp.array([[6 + step], [4 + step], [2]]), jnp.ones((3, 1))))
    for feed in feeds:
        out = {name: decode(models[name], caches[name], *feed) for name in caches}
        np.testing.assert_allclose(out["stacked"][0], out["list"][0], rtol=1e-6, atol=1e-6)
        caches = {name: out[name][1] for name in out}
        assert caches["stacked"].stacked
        for got, want in (
            (caches["stacked"].k, caches["list"].k),
            (caches["stacked"].v, caches["list"].v),
        ):
            np.testing.assert_allclose(got, jnp.stack(want), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(caches["stacked"].valid, caches["list"].valid)
        np.testing.assert_array_equal(caches["stacked"].end, caches["list"].end)


@settings(max_examples=40, deadline=None)
@given(
    starts=st.lists(st.integers(0, 9), min_size=3, max_size=3),
    tokens=st.integers(1, 4),
    layer=st.integers(0, 2),
)
def test_a_stacked_store_writes_its_layer_as_a_dynamic_update_slice_writes_one(
    starts, tokens, layer
):
    # Starts past ``slots - tokens`` (up to 9 of 8 slots) move back, as a dynamic update
    # slice moves them; the other layers keep every value.
    rng = np.random.RandomState(tokens)
    stacked = jnp.asarray(rng.standard_normal((3, 3, 2, 8, 2)), jnp.float32)
    new = jnp.asarray(rng.standard_normal((3, 2, tokens, 2)), jnp.float32)
    start = jnp.asarray(starts, jnp.int32)
    want = stacked.at[layer].set(store(stacked[layer], new, start))
    np.testing.assert_array_equal(store(stacked, new, start, jnp.int32(layer)), want)


def _parts(config, remat):
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    cfg = TrainConfig(
        algorithm=algorithm("grpo"), optimizer=OPTIMIZER, micro_batches=2, remat=remat
    )
    ref = nnx.state(Transformer(config, rngs=nnx.Rngs(1)))
    return cfg, graphdef, create_train_state(cfg, params, ref_params=ref)


def _per_layer(tree, config):
    return unstack_layers(tree) if config.scan_layers else tree


def test_gradients_with_scan_or_remat_equal_the_per_layer_gradient():
    # GRPO (k3 KL to a reference, two micro-batches): within 1e-6 of the per-layer,
    # no-remat gradient, relative (measured: 0 for scan alone, 4.8e-7 with remat, whose
    # recomputed forward rounds differently).
    cfg, graphdef, state = _parts(CONFIG, "none")
    want, want_metrics = make_gradient_fn(cfg, graphdef)(state, batch_of(seed=0))
    for config, remat in ((CONFIG, "full"), (SCAN, "none"), (SCAN, "dots")):
        cfg, graphdef, state = _parts(config, remat)
        grads, metrics = make_gradient_fn(cfg, graphdef)(state, batch_of(seed=0))
        assert relative_error(_per_layer(grads[0], config), want[0]) <= 1e-6, (config, remat)
        assert abs(float(metrics["loss"]) - float(want_metrics["loss"])) <= 1e-6


def test_scan_and_remat_train_steps_do_not_recompile_and_equal_per_layer_steps():
    # Two AdamW steps stay within 1e-5: Adam's first update is ~lr·sign(g), so entries
    # with |g| near eps turn the gradient's rounding into visible differences (the
    # sharded = unsharded test uses the same bound for the same reason).
    def run(config, remat):
        cfg, graphdef, state = _parts(config, remat)
        step = make_train_step(cfg, graphdef)
        state, first = step(state, batch_of(seed=0))
        with count_compilations() as compiles:
            state, second = step(state, batch_of(seed=1))
            jax.block_until_ready(state)
        assert compiles.count == 0  # the second step reuses the first one's program
        return _per_layer(state.params, config), [float(first["loss"]), float(second["loss"])]

    want, want_losses = run(CONFIG, "none")
    got, losses = run(SCAN, "dots")
    assert relative_error(got, want) <= 1e-5
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)


def test_stacked_parameters_shard_and_decay_like_one_layer():
    class Mesh:  # param_partition_spec reads only the axis names and sizes
        axis_names = ("data", "fsdp", "model")
        devices = np.empty((1, 2, 2))

    path = ("layers", "self_attn", "q_proj", "kernel")
    assert is_stacked(path) and not is_stacked(("layers", 0, "self_attn", "q_proj", "kernel"))
    assert param_partition_spec(path, (2, 32, 64), Mesh) == P(None, "fsdp", "model")
    assert param_partition_spec(path[:1] + (0,) + path[1:], (32, 64), Mesh) == P("fsdp", "model")
    down = ("layers", "mlp", "down_proj", "kernel")
    assert param_partition_spec(down, (2, 64, 32), Mesh) == P(None, "model", "fsdp")
    assert param_partition_spec(("layers", "input_layernorm", "weight"), (2, 32), Mesh) == P(None)
    # Weight decay: stacked norm weights [L, hidden] are vectors of each layer, not
    # decayed. A zero gradient leaves only the decay term in the update.
    tx = make_optimizer(OptimizerConfig(weight_decay=1.0, learning_rate=1.0))
    params = nnx.state(Transformer(SCAN, rngs=nnx.Rngs(0)))
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    assert float(jnp.max(jnp.abs(updates["layers"]["input_layernorm"]["weight"][...]))) == 0.0
    assert float(jnp.max(jnp.abs(updates["layers"]["mlp"]["up_proj"]["kernel"][...]))) > 0.0


def test_checkpoints_and_hf_round_trips_work_in_either_layout(tmp_path):
    stacked = Transformer(SCAN, rngs=nnx.Rngs(0))
    save_hf_checkpoint(stacked, tmp_path / "hf")
    per_layer, _ = load_hf_checkpoint(tmp_path / "hf")
    again, _ = load_hf_checkpoint(tmp_path / "hf", scan_layers=True)
    assert not per_layer.config.scan_layers and again.config.scan_layers
    jax.tree.map(np.testing.assert_array_equal, nnx.state(again), nnx.state(stacked))
    jax.tree.map(
        np.testing.assert_array_equal,
        nnx.state(per_layer),
        nnx.state(Transformer(CONFIG, rngs=nnx.Rngs(0))),
    )
    cfg = TrainConfig(algorithm=algorithm("grpo"), optimizer=OPTIMIZER)
    state = create_train_state(cfg, nnx.state(stacked))
    with CheckpointManager(tmp_path / "ckpt", async_save=False) as manager:
        save_train_state(manager, state)
        like = create_train_state(cfg, nnx.state(Transformer(SCAN, rngs=nnx.Rngs(5))))
        restored = restore_train_state(manager, like, step=0)
    jax.tree.map(np.testing.assert_array_equal, restored, state)
    # Across layouts: restore as saved, then convert (parameters and AdamW moments).
    per_layer_state = relayout_tree(restored, scan_layers=False)
    want = create_train_state(cfg, nnx.state(Transformer(CONFIG, rngs=nnx.Rngs(0))))
    assert jax.tree.structure(per_layer_state) == jax.tree.structure(want)
    jax.tree.map(np.testing.assert_array_equal, per_layer_state, want)
    back = relayout_tree(per_layer_state, scan_layers=True)
    jax.tree.map(np.testing.assert_array_equal, back, state)


def test_bad_scan_and_remat_options_name_the_field():
    with pytest.raises(ValueError, match="scan_layers"):
        ModelConfig(**{**dataclasses.asdict(CONFIG), "scan_layers": "yes"})
    with pytest.raises(ValueError, match=r"remat: must be one of \('none', 'dots', 'full'\)"):
        TrainConfig(algorithm=algorithm("grpo"), remat="all")
    model = Transformer(CONFIG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="remat"):
        model.hidden_states(jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32), remat="x")


SHARDED = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp
    from flax import nnx
    from test_trainer import CONFIG, OPTIMIZER, batch_of, relative_error
    from rlaxkit.algorithms import algorithm
    from rlaxkit.models import Transformer, unstack_layers
    from rlaxkit.trainer.config import TrainConfig
    from rlaxkit.trainer.state import create_train_state
    from rlaxkit.trainer.sharding import make_mesh, shard_batch, shard_train_state
    from rlaxkit.trainer.step import make_train_step

    def run(config, remat, mesh):
        graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
        cfg = TrainConfig(
            algorithm=algorithm("grpo", loss={"kl_coef": 0.0}), optimizer=OPTIMIZER, remat=remat
        )
        state = create_train_state(cfg, params)
        step = make_train_step(cfg, graphdef, mesh=mesh)
        batch = batch_of(seed=0, rows=8)
        if mesh is not None:
            state, batch = shard_train_state(state, mesh), shard_batch(batch, mesh)
        return step(state, batch)[0]

    want = run(CONFIG, "none", None)
    got = run(CONFIG.replace(scan_layers=True), "dots", make_mesh(1, 2, 2))
    kernel = got.params["layers"]["self_attn"]["q_proj"]["kernel"][...]
    params = unstack_layers(jax.device_get(got.params))
    print(json.dumps({"rel": relative_error(params, want.params),
                      "spec": str(kernel.sharding.spec)}))
    """
)


def test_sharded_scan_with_remat_equals_one_device():
    result = run_on_forced_devices(SHARDED)
    assert result["rel"] <= 1e-6, result
    assert result["spec"] == str(P(None, "fsdp", "model")), result


@settings(max_examples=25, deadline=None)
@given(
    layers=st.integers(1, 3),
    width=st.integers(1, 4),
    dest=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_a_stacked_cache_takes_rows_a_layer_at_a_time_as_per_layer_caches_do(
    layers, width, dest, seed
):
    # A prompt's prefilled rows copied to its samples' rows (start_rows): the stacked
    # cache's loop over layers writes what the per-layer copy writes, a destination past
    # the last row (padding) writing nothing.
    rows, heads, slots, dim, prompts = 4, 2, 6, 3, 2
    keys = jax.random.split(jax.random.key(seed), 4)
    full = [jax.random.normal(k, (layers, rows, heads, slots, dim)) for k in keys[:2]]
    part = [jax.random.normal(k, (layers, prompts, heads, width, dim)) for k in keys[2:]]
    source = jnp.asarray([i % prompts for i in range(len(dest))], jnp.int32)
    dest = jnp.asarray(dest, jnp.int32)
    valid, end = jnp.zeros((rows, slots), bool), jnp.zeros((rows,), jnp.int32)
    stacked = KVCache(full[0], full[1], valid, end)
    prefill = KVCache(part[0], part[1], valid[:prompts, :width], end[:prompts])
    unstack = lambda c: KVCache(list(c.k), list(c.v), c.valid, c.end)  # noqa: E731
    got = jax.jit(lambda c, p: c.with_rows(p, dest, source))(stacked, prefill)
    want = unstack(stacked).with_rows(unstack(prefill), dest, source)
    for got_layers, want_layers in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(got_layers), np.stack(want_layers))
