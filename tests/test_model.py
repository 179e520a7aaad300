"""The decoder: config validation, causality, padding, KV-cache decode, compilation."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlaxkit.models import KVCache, ModelConfig, Transformer, positions_from_mask
from rlaxkit.models.transformer import rope_frequencies, rope_tables
from rlaxkit.util.jaxutil import count_compilations

FAMILIES = {
    "qwen2": dict(family="qwen2"),
    "qwen3": dict(family="qwen3"),
    "llama": dict(family="llama", attention_bias=True, tie_word_embeddings=True),
}


def make(family="qwen3", **kw):
    base = dict(
        vocab_size=50,
        hidden_size=24,
        intermediate_size=40,
        num_layers=2,
        num_heads=6,
        num_kv_heads=3,
        rope_theta=10_000.0,
    )
    cfg = ModelConfig(**{**base, **FAMILIES[family], **kw})
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    # Larger weights than the 0.02 init, so numerical checks are not trivially small.
    state = nnx.state(model, nnx.Param)
    keys = jax.random.split(jax.random.key(7), len(jax.tree.leaves(state)))
    leaves = [
        leaf + 0.3 * jax.random.normal(k, leaf.shape, leaf.dtype)
        for leaf, k in zip(jax.tree.leaves(state), keys, strict=True)
    ]
    nnx.update(model, jax.tree.unflatten(jax.tree.structure(state), leaves))
    return model


@nnx.jit
def forward(model, tokens, positions, mask=None):
    return model(tokens, positions, mask)


@nnx.jit
def decode(model, tokens, positions, cache, mask=None):
    return model.decode(tokens, positions, cache, mask)


def tokens_of(shape, seed=0, vocab=50):
    return jnp.asarray(np.random.RandomState(seed).randint(0, vocab, shape), jnp.int32)


@pytest.mark.parametrize("family", FAMILIES)
def test_changing_a_later_token_never_changes_earlier_logits(family):
    model = make(family)
    tokens = tokens_of((1, 10))
    positions = jnp.arange(10)[None]
    base = forward(model, tokens, positions)
    for t in (3, 7):
        changed = tokens.at[0, t].set((tokens[0, t] + 1) % 50)
        out = forward(model, changed, positions)
        np.testing.assert_array_equal(np.asarray(out[0, :t]), np.asarray(base[0, :t]))
        assert not np.allclose(out[0, t], base[0, t])


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_batch_equals_each_row_alone(family):
    model = make(family)
    lengths = [9, 4, 6]
    width = max(lengths)
    rows = [tokens_of((1, n), seed=i) for i, n in enumerate(lengths)]
    batch = jnp.zeros((3, width), jnp.int32)
    mask = jnp.zeros((3, width), bool)
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        batch = batch.at[i, width - n :].set(row[0])
        mask = mask.at[i, width - n :].set(True)
    logits = forward(model, batch, positions_from_mask(mask), mask)
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        alone = forward(model, row, jnp.arange(n)[None])
        np.testing.assert_allclose(logits[i, width - n :], alone[0], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cache_decode_equals_full_forward_at_every_position(family):
    model = make(family)
    lengths = [8, 3, 5]
    total = 12  # prompt (left-padded to 8) + 4 decoded tokens
    width = max(lengths)
    tokens = tokens_of((3, total), seed=3)
    mask = jnp.ones((3, total), bool)
    for i, n in enumerate(lengths):
        mask = mask.at[i, : width - n].set(False)
    positions = positions_from_mask(mask)
    full = forward(model, tokens, positions, mask)

    cache = KVCache.zeros(model.config, batch=3, slots=16)
    prefill, cache = decode(model, tokens[:, :width], positions[:, :width], cache, mask[:, :width])
    steps = [prefill]
    for t in range(width, total):
        logits, cache = decode(model, tokens[:, t : t + 1], positions[:, t : t + 1], cache)
        steps.append(logits)
    decoded = jnp.concatenate(steps, axis=1)
    real = np.asarray(mask)
    np.testing.assert_allclose(
        np.asarray(decoded)[real], np.asarray(full)[real], atol=2e-5, rtol=1e-5
    )
    assert int(cache.end[0]) == total


def test_rows_of_a_cache_may_sit_at_different_offsets():
    """Per-row write offsets: the building block of continuous batching."""
    model = make("qwen3")
    a, b = tokens_of((1, 6), seed=1), tokens_of((1, 3), seed=2)
    cache = KVCache.zeros(model.config, batch=2, slots=8)
    # Row 0 takes 6 prompt tokens, row 1 only 3 (the rest of its chunk is padding).
    chunk = jnp.zeros((2, 6), jnp.int32).at[0].set(a[0]).at[1, :3].set(b[0])
    chunk_mask = jnp.zeros((2, 6), bool).at[0].set(True).at[1, :3].set(True)
    _, cache = decode(model, chunk, positions_from_mask(chunk_mask), cache, chunk_mask)
    cache = KVCache(k=cache.k, v=cache.v, valid=cache.valid, end=jnp.array([6, 3]))
    nxt = tokens_of((2, 1), seed=5)
    logits, _ = decode(model, nxt, jnp.array([[6], [3]]), cache)
    alone_b = forward(model, jnp.concatenate([b, nxt[1:]], 1), jnp.arange(4)[None])
    np.testing.assert_allclose(logits[1, 0], alone_b[0, -1], atol=2e-5, rtol=1e-5)


def test_bfloat16_params_give_float32_logits():
    model = make("qwen3", param_dtype="bfloat16")
    logits = forward(model, tokens_of((2, 5)), jnp.broadcast_to(jnp.arange(5), (2, 5)))
    assert logits.dtype == jnp.float32
    assert model.layers[0].mlp.up_proj.kernel.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(logits)).all()


def test_no_recompilation_on_second_forward_with_same_shapes():
    model = make("qwen3")
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, tokens, positions):
        return nnx.merge(graphdef, state)(tokens, positions)

    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    forward(state, tokens_of((2, 6)), positions).block_until_ready()
    with count_compilations() as compiles:
        forward(state, tokens_of((2, 6), seed=9), positions).block_until_ready()
    assert compiles.count == 0


def test_rope_tables_are_the_rotate_half_angles():
    positions = jnp.asarray([[0, 1, 2, 7], [3, 4, 5, 1000]])
    inv_freq = rope_frequencies(make("qwen3").config)
    cos, sin = rope_tables(positions, inv_freq)
    angles = np.asarray(positions, np.float32)[..., None] * np.asarray(inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)[:, :, None, :]
    assert cos.shape == sin.shape == (2, 4, 1, 2 * inv_freq.shape[0])
    np.testing.assert_allclose(cos, np.cos(angles), atol=1e-6)
    np.testing.assert_allclose(sin, np.sin(angles), atol=1e-6)
    # Rotate-half pairs dimension i with i + D/2: both halves hold the same angles.
    half = inv_freq.shape[0]
    np.testing.assert_array_equal(cos[..., :half], cos[..., half:])


def test_training_gradient_evaluates_each_rope_table_once():
    """The sines and cosines are computed once per step, not fused into each layer's
    queries and keys (and their gradients) and evaluated per head there."""
    model = make("qwen3")
    graphdef, state = nnx.split(model)
    tokens = tokens_of((2, 6))
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))

    def loss(state):
        return jnp.sum(nnx.merge(graphdef, state)(tokens, positions) ** 2)

    hlo = jax.jit(jax.grad(loss)).lower(state).compile().as_text()
    assert len(re.findall(r"\bsine\(", hlo)) == 1
    assert len(re.findall(r"\bcosine\(", hlo)) == 1


def test_layers_share_one_traced_block_and_compute_what_direct_calls_do():
    """Every layer's call is one nested program traced once (``call_block``); the
    forward, the decode and the gradient are bit for bit those of calling the blocks
    directly."""
    model = make("qwen3", num_layers=3)
    graphdef, state = nnx.split(model)
    tokens = tokens_of((2, 6))
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))

    def loss(state):
        return jnp.sum(nnx.merge(graphdef, state)(tokens, positions) ** 2)

    calls = [e for e in jax.make_jaxpr(loss)(state).eqns if e.params.get("name") == "_run_block"]
    assert len(calls) == 3
    assert all(e.params["jaxpr"] is calls[0].params["jaxpr"] for e in calls)

    def direct(block, *args):
        return block(*args)

    def both(fn):
        shared = fn()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("rlaxkit.models.transformer.call_block", direct)
            return shared, fn()

    # A fresh jit each time: a cached trace would not see the patch.
    shared, plain = both(lambda: jax.jit(jax.value_and_grad(loss))(state))
    jax.tree.map(np.testing.assert_array_equal, shared, plain)
    cache = KVCache.zeros(model.config, batch=2, slots=8)

    def prefill():
        return jax.jit(lambda s: nnx.merge(graphdef, s).decode(tokens, positions, cache))(state)

    shared, plain = both(prefill)
    jax.tree.map(np.testing.assert_array_equal, shared, plain)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("family", "gpt2", "family must be one of"),
        ("num_kv_heads", 4, "num_kv_heads (4) must divide num_heads (6)"),
        ("param_dtype", "float16", "param_dtype must be one of"),
        ("hidden_size", 0, "hidden_size must be a positive integer"),
        ("rope_theta", -1.0, "rope_theta must be a positive number"),
    ],
)
def test_config_errors_name_the_field(field, value, message):
    base = dict(
        vocab_size=50,
        hidden_size=24,
        intermediate_size=40,
        num_layers=1,
        num_heads=6,
        num_kv_heads=3,
    )
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(**{**base, field: value})


def hf_config(**changes):
    base = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "torch_dtype": "bfloat16",
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


def test_hf_config_round_trip():
    cfg = ModelConfig.from_hf(hf_config())
    assert cfg.family == "qwen2" and cfg.qkv_bias and not cfg.o_bias and cfg.head_dim == 8
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(use_sliding_window=True), "use_sliding_window"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
        (dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"]), "model_type"),
        (dict(some_new_knob=3), "some_new_knob"),
        (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    ],
)
def test_hf_config_rejects_unsupported_fields_by_name(changes, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(hf_config(**changes))


def test_hf_config_unknown_field_allowed_when_not_strict():
    cfg = ModelConfig.from_hf(hf_config(some_new_knob=3), strict=False)
    assert cfg.num_layers == 2


def test_num_params_counts_every_parameter():
    for family in FAMILIES:
        model = make(family)
        n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert model.config.num_params() == n
