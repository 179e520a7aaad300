"""LoRA adapters: an untrained adapter is the base model, merging equals the extra
matmul, stacked and per-layer layouts agree, and the PEFT layout round-trips."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_trainer import CONFIG

from rlaxkit.models import Transformer
from rlaxkit.models.layout import relayout
from rlaxkit.models.lora import (
    LoraConfig,
    adapter_nbytes,
    init_adapters,
    load_peft_adapters,
    merge_adapters,
    save_merged_checkpoint,
    save_peft_adapters,
)

CFG = CONFIG.replace(num_layers=2)  # the trainer tests' model, two layers to stack


def _model(scan_layers=False):
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    return relayout(model, scan_layers=scan_layers)


def _randomised(adapters, seed=3):
    """Adapters with non-zero B (trained ones), so merging changes the model."""
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        treedef,
        [0.1 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)],
    )


def _logits(graphdef, params):
    model = nnx.merge(graphdef, params)
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % CFG.vocab_size
    positions = jnp.broadcast_to(jnp.arange(6), tokens.shape)
    return model(tokens, positions)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_untrained_adapter_is_the_base_model_bitwise(scan_layers):
    graphdef, params = nnx.split(_model(scan_layers))
    lora = LoraConfig(rank=4, alpha=8.0)
    adapters = init_adapters(params, lora, jax.random.key(1))
    merged = merge_adapters(params, adapters, lora)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(merged), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_merged_kernel_equals_the_extra_matmul():
    """x @ (W + s·A@B) = x @ W + s·(x @ A) @ B, the two ways a worker can apply it."""
    _, params = nnx.split(_model())
    lora = LoraConfig(rank=4, alpha=2.0, targets=("up_proj",))
    adapters = _randomised(init_adapters(params, lora, jax.random.key(1)))
    merged = merge_adapters(params, adapters, lora)
    x = jax.random.normal(jax.random.key(2), (5, CFG.hidden_size))
    w = params["layers"][1]["mlp"]["up_proj"]["kernel"][...]
    a = adapters["layers"][1]["mlp"]["up_proj"]["lora_a"][...]
    b = adapters["layers"][1]["mlp"]["up_proj"]["lora_b"][...]
    extra = x @ w + lora.scale * (x @ a) @ b
    np.testing.assert_allclose(
        x @ merged["layers"][1]["mlp"]["up_proj"]["kernel"][...], extra, rtol=1e-5, atol=1e-6
    )
    # Only the targeted kernels change.
    np.testing.assert_array_equal(
        merged["layers"][1]["mlp"]["down_proj"]["kernel"][...],
        params["layers"][1]["mlp"]["down_proj"]["kernel"][...],
    )


def test_stacked_and_per_layer_adapters_give_the_same_model():
    graphdef, params = nnx.split(_model())
    s_graphdef, s_params = nnx.split(_model(scan_layers=True))
    lora = LoraConfig(rank=2, alpha=4.0)
    adapters = _randomised(init_adapters(params, lora, jax.random.key(1)))
    # The same adapter values, stacked along the layer axis.
    stacked = nnx.from_flat_state(
        [
            (
                (*path[:1], *path[2:]),
                leaf.replace(
                    jnp.stack(
                        [
                            adapters["layers"][i][path[2]][path[3]][path[4]][...]
                            for i in range(CFG.num_layers)
                        ]
                    )
                ),
            )
            for path, leaf in nnx.to_flat_state(adapters)
            if path[1] == 0
        ]
    )
    per_layer = _logits(graphdef, merge_adapters(params, adapters, lora))
    scanned = _logits(s_graphdef, merge_adapters(s_params, stacked, lora))
    np.testing.assert_allclose(per_layer, scanned, rtol=1e-5, atol=1e-5)


def test_merge_is_jittable_and_differentiable_in_the_adapters():
    graphdef, params = nnx.split(_model())
    lora = LoraConfig(rank=2, alpha=2.0, targets=("q_proj", "v_proj"))
    adapters = init_adapters(params, lora, jax.random.key(1))

    @jax.jit
    def loss(adapters):
        return jnp.mean(_logits(graphdef, merge_adapters(params, adapters, lora)) ** 2)

    grads = jax.grad(loss)(adapters)
    # With B = 0 the gradient reaches B (through A's output) but not A (through B = 0).
    g = grads["layers"][0]["self_attn"]["q_proj"]
    assert float(jnp.abs(g["lora_b"][...]).sum()) > 0
    assert float(jnp.abs(g["lora_a"][...]).sum()) == 0


@pytest.mark.parametrize("scan_layers", [False, True])
def test_peft_layout_round_trips(tmp_path, scan_layers):
    _, params = nnx.split(_model(scan_layers))
    lora = LoraConfig(rank=4, alpha=16.0, targets=("q_proj", "down_proj"))
    adapters = _randomised(init_adapters(params, lora, jax.random.key(1)))
    save_peft_adapters(tmp_path, adapters, lora, base_model="tiny-qwen3")
    peft = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (peft["peft_type"], peft["r"], peft["lora_alpha"]) == ("LORA", 4, 16.0)
    assert peft["target_modules"] == ["down_proj", "q_proj"]
    from safetensors.numpy import load_file

    tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    name = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    assert tensors[name].shape == (4, CFG.hidden_size)  # PEFT's [r, in]
    assert tensors[name.replace("lora_A", "lora_B")].shape == (CFG.num_heads * CFG.head_dim, 4)
    loaded, config = load_peft_adapters(tmp_path, CFG.replace(scan_layers=scan_layers))
    assert config == lora
    for a, b in zip(jax.tree.leaves(adapters), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert adapter_nbytes(loaded) == adapter_nbytes(adapters)


def test_adapters_are_a_small_fraction_of_the_model():
    _, params = nnx.split(_model())
    lora = LoraConfig(rank=1, alpha=1.0)
    adapters = init_adapters(params, lora, jax.random.key(0))
    full = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    assert adapter_nbytes(adapters) < 0.1 * full


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"rank": 0}, "lora.rank"),
        ({"alpha": float("nan")}, "lora.alpha"),
        ({"alpha": -1.0}, "lora.alpha"),
        ({"targets": ("qkv",)}, "lora.targets"),
        ({"targets": ()}, "lora.targets"),
    ],
)
def test_bad_lora_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LoraConfig(**kwargs)


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"use_dora": True}, r"use_dora=True is not supported"),
        (
            {"layers_to_transform": [0]},
            r"layers_to_transform=\[0\] is not supported \(adapters on some layers only",
        ),
        (
            {"modules_to_save": ["lm_head"]},
            r"modules_to_save=\['lm_head'\] is not supported \(whole modules trained",
        ),
        ({"lora_bias": True}, r"lora_bias=True is not supported \(a trained bias on each lora_B"),
    ],
)
def test_peft_features_rlaxkit_cannot_express_are_refused_by_name(tmp_path, setting, message):
    from safetensors.numpy import load_file, save_file

    _, params = nnx.split(_model())
    lora = LoraConfig(rank=2, alpha=2.0)
    save_peft_adapters(tmp_path, init_adapters(params, lora, jax.random.key(0)), lora)
    raw = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**raw, **setting}))
    if "lora_bias" in setting:  # PEFT writes the bias beside lora_B's weight
        weights = tmp_path / "adapter_model.safetensors"
        tensors = load_file(str(weights))
        name = next(n for n in tensors if n.endswith("lora_B.weight"))
        bias = name.replace(".weight", ".bias")
        save_file({**tensors, bias: np.zeros(tensors[name].shape[0], np.float32)}, str(weights))
    with pytest.raises(ValueError, match=message):
        load_peft_adapters(tmp_path, CFG)


def test_merged_export_is_a_plain_checkpoint_of_the_adapted_model(tmp_path):
    from rlaxkit.models import load_hf_checkpoint

    model = _model()
    graphdef, params = nnx.split(model)
    lora = LoraConfig(rank=2, alpha=4.0)
    adapters = _randomised(init_adapters(params, lora, jax.random.key(1)))
    save_merged_checkpoint(model, adapters, lora, tmp_path)
    loaded, _ = load_hf_checkpoint(tmp_path, with_tokenizer=False)
    want = _logits(graphdef, merge_adapters(params, adapters, lora))
    np.testing.assert_allclose(_logits(*nnx.split(loaded)), want, rtol=1e-6, atol=1e-6)
