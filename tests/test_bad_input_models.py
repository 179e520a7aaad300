"""A damaged safetensors file or a tokenizer larger than the model's vocabulary gets an
error naming the file (or both sizes) and the fix."""

import shutil
from pathlib import Path

import pytest
from flax import nnx

from rlaxkit.config.run import RunConfig
from rlaxkit.models import CharTokenizer, Transformer, load_hf_checkpoint, save_hf_checkpoint
from rlaxkit.rules.validation import check_tokenizer_fits

QWEN3 = Path(__file__).parent / "fixtures" / "hf" / "qwen3"


@pytest.mark.parametrize("keep_bytes", [5, 1000, 200_000])
def test_a_truncated_safetensors_file_is_named(tmp_path, keep_bytes):
    shutil.copytree(QWEN3, tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(keep_bytes)
    with pytest.raises(ValueError, match="the safetensors file is truncated or corrupt") as err:
        load_hf_checkpoint(tmp_path / "ckpt")
    assert str(weights) in str(err.value) and "copy or download the checkpoint again" in str(
        err.value
    )


def test_a_shard_the_index_names_but_is_missing_is_named(tmp_path):
    tiny = RunConfig().model.config.replace(hidden_size=16, intermediate_size=32, num_layers=1)
    model = Transformer(tiny, rngs=nnx.Rngs(0))
    save_hf_checkpoint(model, tmp_path / "ckpt", max_shard_bytes=4_000)
    shard = sorted((tmp_path / "ckpt").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"{shard}: safetensors file missing"):
        load_hf_checkpoint(tmp_path / "ckpt")


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    tiny = RunConfig().model.config.replace(hidden_size=16, intermediate_size=32, num_layers=1)
    model = Transformer(tiny, rngs=nnx.Rngs(0))  # vocab_size 16
    tokenizer = CharTokenizer("0123456789+-*/=abcdefgh")  # more than 16 ids
    assert tokenizer.vocab_size > tiny.vocab_size
    save_hf_checkpoint(model, tmp_path / "ckpt", tokenizer=tokenizer)
    message = (
        rf"checkpoint {tmp_path / 'ckpt'}: the tokenizer has {tokenizer.vocab_size} tokens "
        r"but the model's vocab_size is 16; ids 16\.\."
    )
    with pytest.raises(ValueError, match=message):
        load_hf_checkpoint(tmp_path / "ckpt")
    check_tokenizer_fits(CharTokenizer("0123456789"), 16, "fits")


def test_check_hf_checkpoint_reads_headers_only_and_names_a_wrong_shape(tmp_path):
    """The pre-run check finds what loading would, without reading tensor data: a tensor
    whose stored shape is not the config's is named with its file."""
    import json

    from rlaxkit.models import check_hf_checkpoint

    shutil.copytree(QWEN3, tmp_path / "ckpt")
    assert check_hf_checkpoint(tmp_path / "ckpt").vocab_size > 0
    config_file = tmp_path / "ckpt" / "config.json"
    config = json.loads(config_file.read_text())
    config["intermediate_size"] *= 2
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor .*mlp.* has shape"):
        check_hf_checkpoint(tmp_path / "ckpt")
