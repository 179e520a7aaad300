"""Low-rank adapters (LoRA) on the attention and MLP projections, kept apart from the model.

LoRA (Hu et al., 2021) trains, for a frozen projection ``W`` (``[in, out]``, the
``kernel`` of an ``nnx.Linear``), two small matrices ``A`` (``[in, r]``) and ``B``
(``[r, out]``) and uses ``W + (alpha / r) · A @ B``. ``B`` starts at zero, so an
untrained adapter is exactly the base model.

Here the adapters are a separate ``nnx.State`` of ``nnx.LoRAParam`` leaves, one pair per
targeted kernel at that kernel's path (``.../q_proj/lora_a``, ``.../q_proj/lora_b``),
and :func:`merge_adapters` adds them to the base parameters as a pure, jit-able
function. That keeps a single model graph for the trainer, the sampler, the Hugging
Face loader and the scanned layout (a stacked kernel ``[L, in, out]`` gets stacked
adapters ``[L, in, r]``, ``[L, r, out]``); ``flax.nnx.LoRA`` modules would instead
replace each ``Linear`` by a wrapper and change every parameter path the loaders,
sharding rules and weight pushes know. ``nnx.LoRAParam`` still types the leaves, so
``nnx`` filters tell adapters from base weights.

Adapters are saved and loaded in the PEFT layout (``adapter_config.json`` and
``adapter_model.safetensors``, tensors ``base_model.model.model.layers.{i}.
self_attn.q_proj.lora_A.weight`` of ``[r, in]`` and ``...lora_B.weight`` of
``[out, r]``), which the Hugging Face ecosystem loads onto the same base model.

>>> import jax
>>> from flax import nnx
>>> from rlaxkit.models import ModelConfig, Transformer
>>> cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
...                   num_layers=2, num_heads=2, num_kv_heads=1)
>>> params = nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
>>> lora = LoraConfig(rank=4, alpha=8.0)
>>> adapters = init_adapters(params, lora, jax.random.key(1))
>>> adapters["layers"][0]["mlp"]["up_proj"]["lora_a"].shape
(16, 4)
>>> merged = merge_adapters(params, adapters, lora)   # B = 0: the base model, exactly
>>> bool((merged["layers"][0]["mlp"]["up_proj"]["kernel"][...]
...       == params["layers"][0]["mlp"]["up_proj"]["kernel"][...]).all())
True
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlaxkit.models.config import ModelConfig
from rlaxkit.models.layout import stack_layers, unstack_layers
from rlaxkit.rules.validation import check_int

__all__ = [
    "LORA_TARGETS",
    "LoraConfig",
    "adapter_nbytes",
    "adapter_shapes",
    "init_adapters",
    "load_peft_adapters",
    "merge_adapters",
    "save_merged_checkpoint",
    "save_peft_adapters",
]

# The projections of a Qwen2/Qwen3/Llama block, by their Hugging Face module names.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_CONFIG_FILE = "adapter_config.json"
_WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Which projections get adapters, and their size.

    Attributes:
        rank: ``r``, the inner dimension of ``A @ B`` (>= 1).
        alpha: the adapters' output is scaled by ``alpha / rank`` (PEFT's
            ``lora_alpha``); with ``alpha = rank`` the scale is 1.
        targets: projection names, a non-empty subset of ``LORA_TARGETS`` (kept in
            that order).
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self) -> None:
        check_int("lora.rank", self.rank, minimum=1)
        if not (isinstance(self.alpha, int | float) and math.isfinite(self.alpha)):
            raise ValueError(f"lora.alpha: must be a finite number, got {self.alpha!r}")
        if self.alpha <= 0:
            raise ValueError(f"lora.alpha: must be > 0, got {self.alpha!r}")
        targets = tuple(self.targets)
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if not targets or unknown or len(set(targets)) != len(targets):
            raise ValueError(
                f"lora.targets: must be distinct names among {LORA_TARGETS}, got {self.targets!r}"
            )
        # In the model's order, so equal sets of targets make equal configs.
        object.__setattr__(self, "targets", tuple(t for t in LORA_TARGETS if t in targets))

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor on ``A @ B``."""
        return float(self.alpha) / self.rank


def _names(path: tuple[object, ...]) -> tuple[Any, ...]:
    return tuple(getattr(k, "key", k) for k in path)


def _targeted(params: nnx.State, config: LoraConfig) -> list[tuple[tuple[Any, ...], Any]]:
    """``(path, kernel leaf)`` of every kernel the config targets."""
    out = []
    for path, leaf in nnx.to_flat_state(params):
        names = _names(path)
        if len(names) >= 2 and names[-1] == "kernel" and names[-2] in config.targets:
            out.append((names, leaf))
    if not out:
        raise ValueError(
            f"lora.targets: none of {config.targets} is a projection of this model "
            f"(its kernels: {sorted({_names(p)[-2] for p, _ in nnx.to_flat_state(params)})})"
        )
    return out


def adapter_shapes(
    params: nnx.State, config: LoraConfig
) -> list[tuple[tuple[Any, ...], tuple[int, ...]]]:
    """``(path, shape)`` of every adapter of ``params`` (``A`` then ``B`` per targeted
    kernel; stacked kernels get stacked adapters). Works on abstract states too."""
    out = []
    for path, leaf in _targeted(params, config):
        *lead, fan_in, fan_out = leaf.shape  # a Variable, concrete or abstract
        out.append(((*path[:-1], "lora_a"), (*lead, fan_in, config.rank)))
        out.append(((*path[:-1], "lora_b"), (*lead, config.rank, fan_out)))
    return out


def init_adapters(params: nnx.State, config: LoraConfig, rng: jax.Array) -> nnx.State:
    """Adapters for every targeted kernel of ``params``: ``A`` uniform in
    ``±1/sqrt(in)`` (PEFT's default, Kaiming-uniform with ``a = sqrt(5)``), ``B`` zero,
    both float32."""
    shapes = adapter_shapes(params, config)
    pairs = list(zip(shapes[::2], shapes[1::2], strict=True))
    leaves = []
    for key, ((a_path, a_shape), (b_path, b_shape)) in zip(
        jax.random.split(rng, len(pairs)), pairs, strict=True
    ):
        bound = 1.0 / math.sqrt(a_shape[-2])
        a = jax.random.uniform(key, a_shape, jnp.float32, -bound, bound)
        leaves.append((a_path, nnx.LoRAParam(a)))
        leaves.append((b_path, nnx.LoRAParam(jnp.zeros(b_shape, jnp.float32))))
    return nnx.from_flat_state(leaves)


def merge_adapters(params: nnx.State, adapters: nnx.State, config: LoraConfig) -> nnx.State:
    """``params`` with every adapted kernel replaced by ``W + scale · A @ B`` (in ``W``'s
    dtype); pure and jit-able, gradients flow to the adapters."""
    pairs: dict[tuple[Any, ...], dict[str, object]] = {}
    for path, leaf in nnx.to_flat_state(adapters):
        names = _names(path)
        pairs.setdefault(names[:-1], {})[names[-1]] = leaf[...]
    out = []
    for path, leaf in nnx.to_flat_state(params):
        names = _names(path)
        pair = pairs.pop(names[:-1], None) if names[-1] == "kernel" else None
        if pair is None:
            out.append((path, leaf))
            continue
        kernel = leaf[...]
        delta = jnp.einsum("...ir,...ro->...io", pair["lora_a"], pair["lora_b"])
        out.append((path, leaf.replace((kernel + config.scale * delta).astype(kernel.dtype))))
    if pairs:
        raise ValueError(
            f"adapters for {sorted('/'.join(map(str, p)) for p in pairs)} match no kernel"
        )
    return nnx.from_flat_state(out)


def adapter_nbytes(adapters: nnx.State) -> int:
    """Bytes of the adapters (what a push of adapter versions moves)."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(adapters)))


def save_peft_adapters(
    path: str | Path,
    adapters: nnx.State,
    config: LoraConfig,
    *,
    base_model: str = "",
) -> Path:
    """Writes ``adapters`` as a PEFT LoRA adapter directory (``adapter_config.json``,
    ``adapter_model.safetensors``); stacked adapters are written per layer."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for leaf_path, leaf in nnx.to_flat_state(unstack_layers(adapters)):  # HF names per layer
        *module, which = (str(n) for n in _names(leaf_path))
        peft = {"lora_a": "lora_A", "lora_b": "lora_B"}[which]
        name = f"{_PEFT_PREFIX}model.{'.'.join(module)}.{peft}.weight"
        tensors[name] = np.ascontiguousarray(np.asarray(leaf[...]).T)  # PEFT: [r, in], [out, r]
    save_file(tensors, str(path / _WEIGHTS_FILE), metadata={"format": "pt"})
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or None,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "target_modules": sorted(config.targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
    }
    (path / _CONFIG_FILE).write_text(json.dumps(peft_config, indent=2))
    return path


# PEFT settings rlaxkit's LoRA cannot express, and what each asks for.
_UNSUPPORTED_PEFT = {
    "layers_to_transform": "adapters on some layers only; rlaxkit adapts every layer",
    "layers_pattern": "the layer list layers_to_transform indexes",
    "modules_to_save": "whole modules trained and saved beside the adapters",
    "lora_bias": "a trained bias on each lora_B",
}


def load_peft_adapters(path: str | Path, model_config: ModelConfig) -> tuple[nnx.State, LoraConfig]:
    """Reads a PEFT LoRA adapter directory for a model of ``model_config`` (per-layer or
    stacked, as ``model_config.scan_layers`` says); returns the adapters and their config.

    Raises:
        ValueError: naming the file and the setting, for what rlaxkit's LoRA cannot express
            (bias training, DoRA, rsLoRA, per-module ranks, ``layers_to_transform``,
            ``modules_to_save``, ``lora_bias``) or tensors of other shapes.
    """
    from safetensors.numpy import load_file

    path = Path(path)
    config_file, weights_file = path / _CONFIG_FILE, path / _WEIGHTS_FILE
    for file in (config_file, weights_file):
        if not file.is_file():
            raise FileNotFoundError(f"{file}: not found; a PEFT adapter directory has both files")
    raw = json.loads(config_file.read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{config_file}: peft_type {raw.get('peft_type')!r} is not LORA")
    for field, plain in (("bias", "none"), ("use_dora", False), ("use_rslora", False)):
        if raw.get(field, plain) != plain:
            raise ValueError(
                f"{config_file}: {field}={raw[field]!r} is not supported (needs {plain!r})"
            )
    # Settings whose tensors rlaxkit's LoRA has no place for, named before any tensor is.
    for field, meaning in _UNSUPPORTED_PEFT.items():
        if raw.get(field) not in (None, False, [], {}):
            raise ValueError(
                f"{config_file}: {field}={raw[field]!r} is not supported ({meaning}); "
                f"rlaxkit's LoRA needs {field} unset (null)"
            )
    if raw.get("rank_pattern") or raw.get("alpha_pattern"):
        raise ValueError(
            f"{config_file}: rank_pattern/alpha_pattern (per-module ranks) are not supported"
        )
    targets = raw.get("target_modules") or []
    if isinstance(targets, str):
        raise ValueError(
            f"{config_file}: target_modules as a regex is not supported; list the names"
        )
    config = LoraConfig(
        rank=int(raw["r"]), alpha=float(raw.get("lora_alpha", raw["r"])), targets=tuple(targets)
    )
    tensors = load_file(str(weights_file))
    # Read per layer, as PEFT names them; stacked afterwards when the model scans.
    per_layer_config = model_config.replace(scan_layers=False)
    template = nnx.eval_shape(lambda: _template(per_layer_config))
    expected = adapter_shapes(template, config)
    per_layer: dict[tuple[Any, ...], np.ndarray] = {}
    for name, tensor in tensors.items():
        if not name.startswith(_PEFT_PREFIX + "model."):
            raise ValueError(f"{weights_file}: tensor {name!r} is not a decoder adapter")
        *module, peft, weight = name[len(_PEFT_PREFIX + "model.") :].split(".")
        if weight != "weight" or peft not in ("lora_A", "lora_B"):
            raise ValueError(f"{weights_file}: tensor {name!r} is not a lora_A/lora_B weight")
        names = tuple(int(n) if n.isdigit() else n for n in module)
        per_layer[(*names, "lora_a" if peft == "lora_A" else "lora_b")] = tensor.T
    leaves = []
    for names, shape in expected:
        value = per_layer.pop(names, None)
        where = "/".join(map(str, names))
        if value is None:
            raise ValueError(f"{weights_file}: no tensor for {where}")
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"{weights_file}: {where} has shape {value.shape}, expected {shape}")
        leaves.append((names, nnx.LoRAParam(jnp.asarray(value, jnp.float32))))
    if per_layer:
        raise ValueError(
            f"{weights_file}: tensors for modules this model lacks: {sorted(per_layer)[:3]}"
        )
    adapters = nnx.from_flat_state(leaves)
    return (stack_layers(adapters) if model_config.scan_layers else adapters), config


def save_merged_checkpoint(
    model: Any, adapters: nnx.State, config: LoraConfig, path: str | Path, **save_options: Any
) -> Path:
    """Writes ``model`` (a ``Transformer``) with ``adapters`` merged into its weights as a
    plain Hugging Face checkpoint (``rlaxkit.models.save_hf_checkpoint``, which takes
    ``save_options`` such as ``tokenizer``): no PEFT needed to serve it."""
    from rlaxkit.models.hf import save_hf_checkpoint

    graphdef, params, *rest = nnx.split(model, nnx.Param, ...)
    merged = nnx.merge(graphdef, merge_adapters(params, adapters, config), *rest)
    return save_hf_checkpoint(merged, path, **save_options)


def _template(model_config: ModelConfig) -> nnx.State:
    from rlaxkit.models.transformer import Transformer

    return nnx.state(Transformer(model_config, rngs=nnx.Rngs(0)), nnx.Param)
