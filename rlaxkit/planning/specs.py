"""What a plan is asked about: the models (dimensions of a few real checkpoints, no
weights) and the run's shape (``PlanConfig``), checked against the chip table
(``rlaxkit.planning.chips``) and the TPU topologies (``rlaxkit.planning.tpu``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlaxkit.models.config import ModelConfig, RopeScaling
from rlaxkit.planning.chips import CHIPS
from rlaxkit.planning.tpu import parse_topology
from rlaxkit.rules.validation import check_int


def _qwen(family: str, **dims: int | float | bool) -> ModelConfig:
    return ModelConfig(family=family, rope_theta=1_000_000.0, rms_norm_eps=1e-6, **dims)  # type: ignore[arg-type]


# Dimensions from each checkpoint's published config.json (architecture only).
MODEL_PRESETS: dict[str, ModelConfig] = {
    "qwen2.5-0.5b": _qwen(
        "qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": _qwen(
        "qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": _qwen(
        "qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        max_position_embeddings=32768,
    ),
    # QwQ-32B is a Qwen2.5-32B fine-tune: the same dimensions (40 960 positions).
    "qwq-32b": _qwen(
        "qwen2",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_layers=64,
        num_heads=40,
        num_kv_heads=8,
        max_position_embeddings=40960,
    ),
    "qwen3-8b": _qwen(
        "qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
    ),
    "qwen3-32b": _qwen(
        "qwen3",
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=25600,
        num_layers=64,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
    ),
    "llama-3.1-8b": ModelConfig(
        family="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        rope_theta=500_000.0,
        rope_scaling=RopeScaling(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
    ),
}

Remat = Literal["none", "dots", "full"]
PROGRAMS = ("train", "prefill", "decode", "publish")
Dtype = Literal["float32", "bfloat16"]


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """A run to plan: the model, the trainer's mesh and batch, the sampler's shape.

    Attributes:
        model: a key of ``MODEL_PRESETS`` or the path of a Hugging Face ``config.json``
            (or of the directory holding it).
        num_layers: use this many layers instead of the model's (0: the model's); for
            quick checks of how a plan scales with depth.
        mesh: the trainer's ``(data, fsdp, model)`` sizes; their product is its chips.
        rows: sequences per train step (the global batch).
        prompt_tokens, completion_tokens: the trained sequence is their sum.
        micro_batches: gradient-accumulation chunks per step.
        remat: activation checkpointing (``rlaxkit.trainer.config.TrainConfig.remat``).
        scan_layers: stacked blocks under ``lax.scan`` (``ModelConfig.scan_layers``).
        master_dtype: dtype of the trained weights and the AdamW moments.
        compute_dtype: dtype of the forward and backward pass, of the sampler's weights
            and KV cache, and of a weight push.
        reference: keep a frozen reference policy on the trainer (a KL penalty).
        chip: a key of ``CHIPS``.
        mfu: model FLOP utilisation to assume for the step time (0-1].
        decode_efficiency: fraction of HBM bandwidth a decode step reaches (0-1].
        sampler_chips: chips of one inference worker (tensor-parallel over ``model``).
        slots: sequences one worker decodes at once.
        samples_per_prompt: completions per prefilled prompt.
        programs: which programs to compile: ``train``, ``prefill``, ``decode``,
            ``publish`` (the trainer's weights cast and laid out as a worker holds them).
        target: a TPU topology (``v5p:4x4x4``, ``v5p-128``; ``rlaxkit.planning.tpu``)
            whose devices the trainer's mesh covers exactly: the programs are compiled by
            XLA:TPU (libtpu, the ``rlaxkit[tpu]`` extra) and ``chip`` becomes the target's
            generation; each worker is compiled on the first ``sampler_chips`` devices of
            the smallest slice of that generation that holds them. Empty: XLA:CPU on
            forced host devices, an estimate of a TPU's program.
        total_chips: chips of the whole pod, trainer and workers (0: the trainer's); the
            rest, in workers of ``sampler_chips``, is the simulator's fleet.
    """

    model: str = "qwen2.5-0.5b"
    num_layers: int = 0
    mesh: tuple[int, int, int] = (1, 1, 1)
    rows: int = 8
    prompt_tokens: int = 512
    completion_tokens: int = 7680
    micro_batches: int = 1
    remat: Remat = "none"
    scan_layers: bool = True
    master_dtype: Dtype = "float32"
    compute_dtype: Dtype = "bfloat16"
    reference: bool = False
    chip: str = "v5p"
    mfu: float = 0.4
    decode_efficiency: float = 0.6
    sampler_chips: int = 8
    slots: int = 64
    samples_per_prompt: int = 8
    programs: tuple[str, ...] = ("train", "prefill", "decode")
    target: str = ""
    total_chips: int = 0

    def __post_init__(self) -> None:
        if self.model not in MODEL_PRESETS and not _config_path(self.model).is_file():
            raise ValueError(
                f"model: {self.model!r} is neither a preset ({sorted(MODEL_PRESETS)}) nor a "
                "config.json path"
            )
        check_int("num_layers", self.num_layers, minimum=0)
        if len(self.mesh) != 3:
            raise ValueError(f"mesh: must be three sizes (data, fsdp, model), got {self.mesh!r}")
        for axis, size in zip(("data", "fsdp", "model"), self.mesh, strict=True):
            check_int(f"mesh ({axis})", size, minimum=1)
        for name in ("rows", "prompt_tokens", "completion_tokens", "micro_batches"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("sampler_chips", "slots", "samples_per_prompt"):
            check_int(name, getattr(self, name), minimum=1)
        shards = self.mesh[0] * self.mesh[1]
        if self.rows % (self.micro_batches * shards):
            raise ValueError(
                f"rows: {self.rows} must split into micro_batches = {self.micro_batches} "
                f"chunks of a size divisible by data·fsdp = {shards}; make rows a multiple "
                f"of {self.micro_batches * shards}"
            )
        if self.slots % self.samples_per_prompt:
            raise ValueError(
                f"slots: {self.slots} must be a multiple of samples_per_prompt = "
                f"{self.samples_per_prompt}"
            )
        if self.remat not in ("none", "dots", "full"):
            raise ValueError(f"remat: must be 'none', 'dots' or 'full', got {self.remat!r}")
        for name in ("master_dtype", "compute_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16"):
                raise ValueError(f"{name}: must be 'float32' or 'bfloat16'")
        if self.chip not in CHIPS:
            raise ValueError(f"chip: must be one of {sorted(CHIPS)}, got {self.chip!r}")
        for name in ("mfu", "decode_efficiency"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value <= 1):
                raise ValueError(f"{name}: must be in (0, 1], got {value!r}")
        unknown = sorted(set(self.programs) - set(PROGRAMS))
        if unknown or not self.programs:
            raise ValueError(
                f"programs: must be a non-empty subset of {PROGRAMS}, got {self.programs!r}"
            )
        check_int("total_chips", self.total_chips, minimum=0)
        if self.total_chips and self.total_chips < self.trainer_chips + self.sampler_chips:
            raise ValueError(
                f"total_chips: {self.total_chips} leaves no worker of {self.sampler_chips} "
                f"chips beside the trainer's {self.trainer_chips}"
            )
        if self.target:
            top = parse_topology(self.target)
            if self.trainer_chips != top.devices:
                raise ValueError(
                    f"mesh: {tuple(self.mesh)} has {self.trainer_chips} devices but the "
                    f"target {top.name} has {top.devices}; make the mesh sizes multiply "
                    f"to {top.devices}"
                )
            object.__setattr__(self, "chip", top.generation.name)

    @property
    def length(self) -> int:
        """Tokens of one trained sequence (and slots of one sampler row)."""
        return self.prompt_tokens + self.completion_tokens

    @property
    def trainer_chips(self) -> int:
        """Chips of the trainer's mesh."""
        return math.prod(self.mesh)

    @property
    def devices(self) -> int:
        """Forced host devices the compile needs (the larger mesh)."""
        return max(self.trainer_chips, self.sampler_chips)

    def model_config(self) -> ModelConfig:
        """The architecture (preset or ``config.json``) with this plan's layout and depth."""
        if self.model in MODEL_PRESETS:
            config = MODEL_PRESETS[self.model]
        else:
            hf = json.loads(_config_path(self.model).read_text())
            config = ModelConfig.from_hf(hf, strict=False)
        changes: dict[str, object] = {
            "scan_layers": self.scan_layers,
            "param_dtype": self.master_dtype,
        }
        if self.num_layers:
            changes["num_layers"] = self.num_layers
        return config.replace(**changes)


def _config_path(model: str) -> Path:
    path = Path(model)
    return path / "config.json" if path.is_dir() else path
