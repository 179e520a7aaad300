"""Model configuration for the Qwen2 / Qwen2.5 / Qwen3 / Llama-3 decoder family.

``ModelConfig`` is the one description of an architecture. It reads and writes the
Hugging Face ``config.json`` of those families and refuses any field that would change
the computation in a way this decoder does not implement (sliding windows, MLP bias,
other RoPE scalings, ...), naming the field, so a checkpoint never loads into a
silently different network.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

Family = Literal["qwen2", "qwen3", "llama"]
ParamDtype = Literal["float32", "bfloat16"]

FAMILIES: tuple[str, ...] = ("qwen2", "qwen3", "llama")
PARAM_DTYPES: tuple[str, ...] = ("float32", "bfloat16")

_ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
}

# Fields of an HF config.json that do not change the forward pass of this decoder.
_BENIGN_HF_FIELDS = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "_name_or_path",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "initializer_range",
        "use_cache",
        "attention_dropout",
        "max_window_layers",
        "sliding_window",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "tie_encoder_decoder",
        "is_encoder_decoder",
        "quantization_config_ignored",
    }
)


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (``rope_type: llama3``).

    Frequencies whose wavelength is longer than ``original_max_position_embeddings /
    low_freq_factor`` are divided by ``factor``; those shorter than ``... /
    high_freq_factor`` are kept; the band between is interpolated linearly in
    ``original_max_position_embeddings / wavelength``.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                "rope_scaling needs high_freq_factor > low_freq_factor > 0, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of a decoder-only transformer of the Qwen2/Qwen3/Llama family.

    Attributes:
        family: ``qwen2`` (q/k/v bias), ``qwen3`` (q/k RMSNorm per head) or ``llama``.
        vocab_size: rows of the embedding table.
        hidden_size: model width.
        intermediate_size: SwiGLU hidden width.
        num_layers: decoder blocks.
        num_heads: query heads.
        num_kv_heads: key/value heads; must divide ``num_heads`` (GQA).
        head_dim: per-head width; 0 means ``hidden_size // num_heads``.
        rope_theta: RoPE base.
        rope_scaling: optional Llama-3 frequency scaling.
        rms_norm_eps: epsilon of every RMSNorm.
        max_position_embeddings: longest position the checkpoint was trained for.
        tie_word_embeddings: the output projection reuses the embedding table.
        attention_bias: bias on q/k/v/o (llama, qwen3); qwen2 always has q/k/v bias.
        param_dtype: storage and compute dtype of the weights; logits are always float32.
        scan_layers: store the decoder blocks stacked (every block parameter gets a
            leading ``[num_layers]`` axis) and run the training forward as one
            ``lax.scan`` over them, so compile time and program size do not grow with
            depth. The numbers are the same as with one module per layer (the default);
            ``rlaxkit.models.layout`` converts parameters between the two layouts.
            Not an architecture field: ``to_hf`` leaves it out.
    """

    family: Family = "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    param_dtype: ParamDtype = "float32"
    scan_layers: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"scan_layers must be true or false, got {self.scan_layers!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"param_dtype must be one of {PARAM_DTYPES}, got {self.param_dtype!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})"
            )
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_heads "
                    f"({self.num_heads}); set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even integer, got {self.head_dim}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"rope_theta must be a positive number, got {self.rope_theta}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ValueError(f"rms_norm_eps must be a finite number > 0, got {self.rms_norm_eps}")

    @property
    def qkv_bias(self) -> bool:
        """Whether the q/k/v projections carry a bias."""
        return self.family == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        """Whether the output projection carries a bias (never for qwen2)."""
        return self.family != "qwen2" and self.attention_bias

    @property
    def qk_norm(self) -> bool:
        """Whether queries and keys get a per-head RMSNorm before RoPE (qwen3)."""
        return self.family == "qwen3"

    def replace(self, **changes: Any) -> ModelConfig:
        """Returns a copy with ``changes`` applied and validated."""
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Number of scalar parameters (embedding counted once when tied)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * q + 2 * h * kv + q * h
        attn += (q + 2 * kv) * self.qkv_bias + h * self.o_bias + 2 * d * self.qk_norm
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    @classmethod
    def from_hf(
        cls, hf: dict[str, Any], *, strict: bool = True, **overrides: object
    ) -> ModelConfig:
        """Builds a config from a Hugging Face ``config.json`` dictionary.

        Args:
            hf: the parsed ``config.json``.
            strict: raise on fields this decoder does not know; with ``strict=False``
                unknown fields are ignored (known unsupported values still raise).
            **overrides: fields of ``ModelConfig`` to set afterwards (e.g. ``param_dtype``).

        Raises:
            ValueError: naming the field, when the checkpoint uses a feature this decoder
                does not implement.
        """
        hf = dict(hf)
        family = _family_of(hf)
        _require(hf, "hidden_act", ("silu",), default="silu")
        _require(hf, "mlp_bias", (False,), default=False)
        _require(hf, "pretraining_tp", (1,), default=1)
        _require(hf, "use_sliding_window", (False,), default=False)
        layer_types = hf.pop("layer_types", None)
        if layer_types is not None and set(layer_types) - {"full_attention"}:
            raise ValueError(
                "config.json field 'layer_types' asks for "
                f"{sorted(set(layer_types) - {'full_attention'})}; only full attention "
                "is supported"
            )
        rope_theta, rope_scaling = _rope_of(hf)
        known = dict(
            family=family,
            vocab_size=hf.pop("vocab_size"),
            hidden_size=hf.pop("hidden_size"),
            intermediate_size=hf.pop("intermediate_size"),
            num_layers=hf.pop("num_hidden_layers"),
            num_heads=hf.pop("num_attention_heads"),
            num_kv_heads=hf.pop("num_key_value_heads", None),
            head_dim=hf.pop("head_dim", None) or 0,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=hf.pop("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.pop("max_position_embeddings", 4096),
            tie_word_embeddings=hf.pop("tie_word_embeddings", False),
            attention_bias=hf.pop("attention_bias", False),
        )
        if known["num_kv_heads"] is None:
            known["num_kv_heads"] = known["num_heads"]
        if family == "qwen2":
            known["attention_bias"] = False  # qwen2's q/k/v bias is implied by the family
        unknown = sorted(set(hf) - _BENIGN_HF_FIELDS)
        if unknown and strict:
            raise ValueError(
                f"config.json has fields this decoder does not implement: {unknown}. "
                "If they do not change the architecture, load with strict=False."
            )
        known.update(overrides)
        return cls(**known)

    def to_hf(self) -> dict[str, object]:
        """Returns the Hugging Face ``config.json`` dictionary of this architecture."""
        arch = {v: k for k, v in _ARCHITECTURES.items()}[self.family]
        out: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.param_dtype,
        }
        if self.family != "qwen2":
            out["attention_bias"] = self.attention_bias
        if self.family == "qwen2":
            out["use_sliding_window"] = False
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        return out


def _family_of(hf: dict[str, Any]) -> str:
    model_type = hf.pop("model_type", None)
    archs = hf.get("architectures") or []
    if model_type in FAMILIES:
        return model_type
    for arch in archs:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    raise ValueError(
        f"config.json field 'model_type' is {model_type!r} (architectures {archs}); "
        f"supported: {FAMILIES}"
    )


def _require(
    hf: dict[str, Any], field: str, allowed: tuple[object, ...], *, default: object
) -> None:
    value = hf.pop(field, default)
    if value is None:
        value = default
    if value not in allowed:
        raise ValueError(
            f"config.json field {field!r} is {value!r}; this decoder supports only {allowed}"
        )


def _rope_of(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Reads RoPE settings from either the classic or the ``rope_parameters`` layout."""
    params = hf.pop("rope_parameters", None) or {}
    scaling = hf.pop("rope_scaling", None) or {}
    theta = hf.pop("rope_theta", None) or params.get("rope_theta") or 10_000.0
    spec = {**params, **scaling}
    spec.pop("rope_theta", None)
    rope_type = spec.pop("rope_type", spec.pop("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(
            f"config.json field 'rope_scaling' has rope_type {rope_type!r}; supported: "
            "'default' and 'llama3'"
        )
    try:
        scaling_cfg = RopeScaling(
            factor=float(spec["factor"]),
            low_freq_factor=float(spec["low_freq_factor"]),
            high_freq_factor=float(spec["high_freq_factor"]),
            original_max_position_embeddings=int(spec["original_max_position_embeddings"]),
        )
    except KeyError as missing:
        raise ValueError(f"config.json field 'rope_scaling' lacks {missing}") from None
    return float(theta), scaling_cfg
