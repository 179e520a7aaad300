"""Hugging Face checkpoint directories in and out: ``config.json``, safetensors (one file
or sharded with an index) and the tokenizer.

Only local paths are read; nothing is downloaded. Tensor names follow the HF layout of
the Qwen2/Qwen3/Llama families (``model.layers.{i}.self_attn.q_proj.weight``, ...);
HF ``Linear`` weights are ``[out, in]`` and are transposed to NNX's ``[in, out]``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.flax import save_file

from rlaxkit.models.config import ModelConfig
from rlaxkit.models.layout import relayout
from rlaxkit.models.tokenizer import Tokenizer, load_tokenizer, save_tokenizer
from rlaxkit.models.transformer import Transformer
from rlaxkit.rules.validation import check_tokenizer_fits

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# Buffers some exporters write that carry no parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_name(path: tuple[object, ...]) -> tuple[str, bool]:
    """HF tensor name of an NNX parameter path, and whether it is stored transposed."""
    *head, leaf = (str(p) for p in path)
    transposed = leaf == "kernel"
    leaf = {"kernel": "weight", "embedding": "weight"}.get(leaf, leaf)
    name = ".".join([*head, leaf])
    return (name if head[0] == "lm_head" else f"model.{name}"), transposed


def abstract_model(config: ModelConfig) -> Transformer:
    """A ``Transformer`` whose parameters are shape/dtype placeholders (no memory)."""
    return nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))


@contextlib.contextmanager
def _open_safetensors(file: Path, framework: str = "flax") -> Iterator[Any]:
    """``safe_open(file)``; a missing, truncated or corrupt file raises an error naming it
    (safetensors' own names neither the file nor the fix)."""
    if not file.exists():
        raise FileNotFoundError(
            f"{file}: safetensors file missing (named by {file.parent / _INDEX}); copy the "
            "whole checkpoint directory again"
        )
    try:
        with safe_open(str(file), framework=framework) as f:
            yield f
    except SafetensorError as error:
        raise ValueError(
            f"{file}: the safetensors file is truncated or corrupt ({error}; "
            f"{file.stat().st_size} bytes on disk); copy or download the checkpoint again"
        ) from None


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file holding it."""
    index = path / _INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / _SINGLE
    if not single.exists():
        raise FileNotFoundError(f"{path} has neither {_SINGLE} nor {_INDEX}")
    with _open_safetensors(single) as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def check_hf_checkpoint(
    path: str | Path, *, param_dtype: str | None = None, strict: bool = True
) -> ModelConfig:
    """What :func:`load_hf_checkpoint` checks, from the files' headers only (no tensor
    data is read): ``config.json``, every tensor present with the shape the config
    expects, no unused tensor, and a tokenizer that fits the vocabulary. A run calls it
    before it does any work; returns the model's config.

    Raises:
        ValueError, FileNotFoundError: as :func:`load_hf_checkpoint`, naming the file.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"model.checkpoint {path}: no config.json there")
    hf_config = json.loads(config_file.read_text())
    config = ModelConfig.from_hf(hf_config, strict=strict, param_dtype=param_dtype or "float32")
    _, abstract_state = nnx.split(abstract_model(config))
    files = _tensor_files(path)
    by_file: dict[Path, list[tuple[str, tuple[int, ...]]]] = {}
    for param_path, leaf in nnx.to_flat_state(abstract_state):
        name, transposed = hf_name(param_path)
        if name not in files:
            raise ValueError(f"checkpoint {path} lacks tensor {name}")
        shape = tuple(leaf.shape)[::-1] if transposed else tuple(leaf.shape)
        by_file.setdefault(files[name], []).append((name, shape))
    for file, names in by_file.items():
        with _open_safetensors(file, framework="numpy") as f:
            for name, shape in names:
                stored = tuple(f.get_slice(name).get_shape())
                if stored != shape:
                    raise ValueError(
                        f"{file}: tensor {name} has shape {stored}, config.json expects {shape}"
                    )
    if (path / "tokenizer.json").exists() or (path / "char_tokenizer.json").exists():
        check_tokenizer_fits(load_tokenizer(path), config.vocab_size, f"checkpoint {path}")
    return config


def load_hf_checkpoint(
    path: str | Path,
    *,
    param_dtype: str | None = None,
    strict: bool = True,
    with_tokenizer: bool = True,
    scan_layers: bool = False,
) -> tuple[Transformer, Tokenizer | None]:
    """Loads a local HF checkpoint directory into a ``Transformer``.

    Args:
        path: directory with ``config.json`` and safetensors weights.
        param_dtype: ``float32`` or ``bfloat16`` to cast to; default: the checkpoint's
            ``torch_dtype`` when it is one of those, else float32.
        strict: reject unknown ``config.json`` fields (see ``ModelConfig.from_hf``).
        with_tokenizer: also load the tokenizer when the directory has one.
        scan_layers: return the blocks stacked (``ModelConfig.scan_layers``).

    Raises:
        ValueError: a tensor is missing, unexpected, or has the wrong shape (named), or a
            safetensors file is truncated or corrupt (named).
        FileNotFoundError: no weights, or a shard the index names is missing.
    """
    path = Path(path)
    hf_config = json.loads((path / "config.json").read_text())
    if param_dtype is None:
        stored = hf_config.get("torch_dtype") or hf_config.get("dtype")
        param_dtype = stored if stored in ("float32", "bfloat16") else "float32"
    config = ModelConfig.from_hf(hf_config, strict=strict, param_dtype=param_dtype)
    graphdef, abstract_state = nnx.split(abstract_model(config))
    files = _tensor_files(path)
    wanted = {}
    for param_path, leaf in nnx.to_flat_state(abstract_state):
        name, transposed = hf_name(param_path)
        wanted[name] = (param_path, leaf, transposed)
    missing = sorted(set(wanted) - set(files))
    if missing:
        raise ValueError(f"checkpoint {path} lacks tensors {missing[:5]} (of {len(missing)})")
    unexpected = sorted(
        n
        for n in set(files) - set(wanted)
        if not n.endswith(_IGNORED_SUFFIXES)
        and not (config.tie_word_embeddings and n == "lm_head.weight")
    )
    if unexpected:
        raise ValueError(
            f"checkpoint {path} has tensors this config does not use: {unexpected[:5]} "
            f"(of {len(unexpected)}); is config.json the one for these weights?"
        )
    dtype = jnp.dtype(param_dtype)
    loaded = []
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        with _open_safetensors(file) as f:
            for name in names:
                param_path, leaf, transposed = wanted[name]
                array = f.get_tensor(name)
                if transposed:
                    array = array.T
                if array.shape != leaf.shape:
                    raise ValueError(
                        f"tensor {name} has shape {tuple(array.shape)}, the config expects "
                        f"{tuple(leaf.shape)}"
                    )
                loaded.append((param_path, leaf.replace(jnp.asarray(array, dtype))))
    model = relayout(nnx.merge(graphdef, nnx.from_flat_state(loaded)), scan_layers=scan_layers)
    tokenizer = None
    has_tokenizer = (path / "tokenizer.json").exists() or (path / "char_tokenizer.json").exists()
    if with_tokenizer and has_tokenizer:
        tokenizer = load_tokenizer(path)
        check_tokenizer_fits(tokenizer, config.vocab_size, f"checkpoint {path}")
    return model, tokenizer


def save_hf_checkpoint(
    model: Transformer,
    path: str | Path,
    *,
    tokenizer: Tokenizer | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> Path:
    """Writes ``model`` as an HF checkpoint directory that ``load_hf_checkpoint`` and
    ``transformers`` read back; shards with an index when larger than ``max_shard_bytes``.
    Stacked blocks (``scan_layers``) are written per layer, as HF names them.
    """
    model = relayout(model, scan_layers=False)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
    tensors: dict[str, jax.Array] = {}
    for param_path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, transposed = hf_name(param_path)
        array = leaf[...]
        tensors[name] = jnp.asarray(array.T if transposed else array)
    shards: list[dict[str, jax.Array]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].size * tensors[name].dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    for stale in [*path.glob("model*.safetensors"), path / _INDEX]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(path / _SINGLE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        total = int(sum(np.prod(t.shape) * t.dtype.itemsize for t in tensors.values()))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / _INDEX).write_text(json.dumps(index, indent=2))
    if tokenizer is not None:
        save_tokenizer(tokenizer, path)
    return path
