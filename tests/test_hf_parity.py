"""rlaxkit's decoder reproduces transformers' logits on real HF checkpoint directories.

The fixtures under tests/fixtures/hf/ were written by tests/fixtures/make_hf_fixtures.py
with transformers (eager attention, float32); this suite needs neither torch nor
transformers.
"""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlaxkit.models import (
    HFTokenizer,
    load_hf_checkpoint,
    positions_from_mask,
    save_hf_checkpoint,
)

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
FAMILIES = ["qwen2", "qwen3", "llama"]


@nnx.jit
def _forward(model, tokens, positions, mask):
    return model(tokens, positions, mask)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family):
    model, tokenizer = load_hf_checkpoint(FIXTURES / family)
    assert model.config.family == family
    ref = np.load(FIXTURES / family / "reference.npz")
    mask = jnp.asarray(ref["mask"], bool)
    logits = _forward(model, jnp.asarray(ref["tokens"]), positions_from_mask(mask), mask)
    real = ref["mask"].astype(bool)
    err = np.abs(np.asarray(logits)[real] - ref["logits"][real]).max()
    assert err <= 1e-4, f"{family}: max abs logit error {err:.2e}"
    assert isinstance(tokenizer, HFTokenizer)


def test_family_specific_features_were_loaded():
    qwen2, _ = load_hf_checkpoint(FIXTURES / "qwen2")
    qwen3, _ = load_hf_checkpoint(FIXTURES / "qwen3")
    llama, _ = load_hf_checkpoint(FIXTURES / "llama")
    assert qwen2.layers[0].self_attn.q_proj.bias is not None
    assert qwen3.layers[0].self_attn.q_norm is not None and qwen3.lm_head is None
    assert llama.config.rope_scaling is not None and llama.config.rope_scaling.factor == 8.0


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_save_load_round_trip_is_exact(family, tmp_path):
    model, tokenizer = load_hf_checkpoint(FIXTURES / family)
    save_hf_checkpoint(model, tmp_path / "a", tokenizer=tokenizer, max_shard_bytes=40_000)
    assert (tmp_path / "a" / "model.safetensors.index.json").exists()
    again, tok2 = load_hf_checkpoint(tmp_path / "a")
    for (p1, a), (p2, b) in zip(
        nnx.to_flat_state(nnx.state(model, nnx.Param)),
        nnx.to_flat_state(nnx.state(again, nnx.Param)),
        strict=True,
    ):
        assert p1 == p2
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]))
    assert tok2.encode("The answer is 19.") == tokenizer.encode("The answer is 19.")


def test_bfloat16_load_casts_and_stays_close(tmp_path):
    model, _ = load_hf_checkpoint(FIXTURES / "qwen3", param_dtype="bfloat16")
    ref = np.load(FIXTURES / "qwen3" / "reference.npz")
    mask = jnp.asarray(ref["mask"], bool)
    logits = _forward(model, jnp.asarray(ref["tokens"]), positions_from_mask(mask), mask)
    real = ref["mask"].astype(bool)
    scale = np.abs(ref["logits"][real]).max()
    assert logits.dtype == jnp.float32
    assert np.abs(np.asarray(logits)[real] - ref["logits"][real]).max() < 0.1 * scale


def test_tokenizer_from_checkpoint_round_trips_and_renders_chat():
    _, tok = load_hf_checkpoint(FIXTURES / "qwen2")
    text = "def add(a, b):\n    return a + b\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([tok.eos_id], skip_special_tokens=False) == "<|endoftext|>"
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}])
    assert prompt == "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"


def test_wrong_shape_checkpoint_names_the_tensor(tmp_path):
    import json
    import shutil

    shutil.copytree(FIXTURES / "qwen2", tmp_path / "bad")
    config = json.loads((tmp_path / "bad" / "config.json").read_text())
    config["intermediate_size"] = 64
    (tmp_path / "bad" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight has shape"):
        load_hf_checkpoint(tmp_path / "bad")


def test_missing_weights_give_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text((FIXTURES / "qwen2" / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint(tmp_path)
