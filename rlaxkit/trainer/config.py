"""The trainer's configuration: the optimizer (AdamW and its schedule) and the train
step (micro- and mini-batches, epochs, the algorithm, remat, LoRA, drift attribution)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from rlaxkit.algorithms import AlgorithmConfig, DistillConfig
from rlaxkit.models import REMAT_POLICIES, RematPolicy
from rlaxkit.models.lora import LoraConfig
from rlaxkit.rules.validation import check_int, check_number, is_number


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW with global-norm clipping and a linear-warmup + cosine schedule.

    ``lr(n) = lr · (n + 1) / warmup_steps`` for ``n < warmup_steps``, then cosine from
    ``lr`` to ``lr · end_lr_ratio`` over ``decay_steps`` updates (constant when 0). ``n``
    counts optimizer updates (mini-batches), not train steps.
    """

    learning_rate: float = 1e-6
    warmup_steps: int = 0
    decay_steps: int = 0
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        for name in ("learning_rate", "eps"):
            value = getattr(self, name)
            if not (is_number(value) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
        for name in ("warmup_steps", "decay_steps"):
            check_int(name, getattr(self, name), minimum=0)
        check_number("end_lr_ratio", self.end_lr_ratio, minimum=0, maximum=1)
        for name in ("b1", "b2"):
            # Adam divides by 1 - b^t: a decay of 1 makes every update NaN.
            value = getattr(self, name)
            if not (is_number(value) and 0 <= value < 1):
                raise ValueError(f"{name}: must be in [0, 1), got {value!r}")
        check_number("weight_decay", self.weight_decay, minimum=0, allowed="a finite number >= 0")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm: must be > 0 or None, got {self.max_grad_norm!r}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything ``make_train_step`` needs besides the model.

    Attributes:
        algorithm: advantage estimator and loss (``rlaxkit.algorithms.algorithm(name)``).
        optimizer: AdamW settings.
        micro_batches: gradient-accumulation chunks per mini-batch.
        mini_batches: optimizer updates per pass over the batch.
        epochs: passes over the batch (PPO epochs).
        shuffle: permute rows (with ``state.rng``) before each pass.
        temperature: the sampler's temperature, so log-probs match the behaviour's.
        compute_dtype: cast parameters to this dtype for the forward pass (build the
            graphdef with the same ``param_dtype``; master weights stay as given). ``None``
            computes in the parameters' dtype. bfloat16 is for accelerators.
        remat: activation checkpointing of the policy's blocks in the backward pass:
            ``none`` keeps every activation, ``dots`` keeps the weight matmuls' outputs
            and recomputes the rest (attention scores included), ``full`` keeps only
            each block's input. Memory for time; the numbers do not change.
        lora: train low-rank adapters on these projections instead of every weight
            (``rlaxkit.models.lora``): the optimizer holds state for the adapters only,
            the base weights stay frozen in ``TrainState.base_params``, and
            ``TrainState.params`` is the merged policy the trainer samples, pushes and
            evaluates. ``None`` trains every weight.
        update_norm: report the global norm of the optimizer's update (metric
            ``update_norm``), which ``check_finite`` reads to stop a run before it
            publishes weights that an update overflowed. Off, the step skips that pass
            over every parameter (its cost: docs/performance.md), and such an update
            shows only in the next step's loss, after its weights were published. The
            runtime keeps it on.
        distill: on-policy distillation (``rlaxkit.algorithms.distill``): the teacher in
            ``TrainState.teacher_params`` scores the batch's tokens before the updates and
            its per-token reward enters the advantages (``sampled``), or it scores each
            micro-batch in the loss, which adds the exact KL to it (``full``). ``None``:
            no teacher.
        drift_every: every this many steps the step splits its batch's drift into
            staleness and engine mismatch first (``rlaxkit.observe.drift``, ``drift/*`` metrics;
            it reads old versions from ``PackedTrainStep.drift.reader``, a parameter
            server, and runs without a mesh only). 0: never.
    """

    algorithm: AlgorithmConfig
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    micro_batches: int = 1
    mini_batches: int = 1
    epochs: int = 1
    shuffle: bool = False
    temperature: float = 1.0
    compute_dtype: Literal["float32", "bfloat16"] | None = None
    remat: RematPolicy = "none"
    lora: LoraConfig | None = None
    update_norm: bool = True
    distill: DistillConfig | None = None
    drift_every: int = 0

    def __post_init__(self) -> None:
        if self.distill is not None and not isinstance(self.distill, DistillConfig):
            raise ValueError(f"distill: must be a DistillConfig or None, got {self.distill!r}")
        check_int("drift_every", self.drift_every, minimum=0)
        if not isinstance(self.update_norm, bool):
            raise ValueError(f"update_norm: must be true or false, got {self.update_norm!r}")
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise ValueError(f"lora: must be a LoraConfig or None, got {self.lora!r}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat: must be one of {REMAT_POLICIES}, got {self.remat!r}")
        for name in ("micro_batches", "mini_batches", "epochs"):
            check_int(name, getattr(self, name), minimum=1)
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature: must be a positive number, got {self.temperature!r}")
        if self.compute_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(
                "compute_dtype: must be one of (None, 'float32', 'bfloat16'), got "
                f"{self.compute_dtype!r}"
            )
