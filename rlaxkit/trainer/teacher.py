"""The on-policy distillation teacher of a run (``RunConfig.distill``): a frozen model
read from an HF checkpoint directory, of any size, with the student's vocabulary.

The train step scores the student's samples with it (``rlaxkit.algorithms.distill``).
It is held like the reference policy: its weights in ``TrainState.teacher_params``,
frozen; its architecture in ``DistillConfig.teacher_model``, from which the step builds
its graph.
"""

from __future__ import annotations

from pathlib import Path

from flax import nnx

from rlaxkit.algorithms import DistillConfig
from rlaxkit.config.run import DistillSpec, RunConfig
from rlaxkit.models import ModelConfig, check_hf_checkpoint, load_hf_checkpoint
from rlaxkit.trainer.config import TrainConfig
from rlaxkit.trainer.state import TrainState, create_train_state


def teacher_config(spec: DistillSpec) -> ModelConfig:
    """The architecture of ``spec.teacher``, from its ``config.json`` and tensor headers;
    a directory without one names the field and the fix."""
    teacher = Path(str(spec.teacher))
    if not (teacher / "config.json").is_file():
        raise ValueError(
            f"distill.teacher: {teacher} has no config.json; point it at the teacher's "
            "checkpoint directory (a finished run's final/, written by rlaxkit train)"
        )
    return check_hf_checkpoint(teacher, param_dtype=spec.param_dtype)


def check_teacher(spec: DistillSpec, vocab_size: int) -> ModelConfig:
    """``teacher_config(spec)``, refused when its vocabulary is not the student's
    ``vocab_size`` (the teacher scores the student's token ids)."""
    config = teacher_config(spec)
    if config.vocab_size != vocab_size:
        raise ValueError(
            f"distill.teacher: {spec.teacher} has a vocabulary of {config.vocab_size} tokens, "
            f"the student {vocab_size}; distil from a teacher trained with the student's "
            "tokenizer (the same task's characters, or the student checkpoint's family)"
        )
    return config


def distill_config(spec: DistillSpec | None) -> DistillConfig | None:
    """The trainer's ``DistillConfig`` of a run's ``distill`` section (``None``: none);
    reads the teacher's architecture from its checkpoint."""
    if spec is None:
        return None
    return DistillConfig(
        weight=spec.weight,
        task_reward=spec.task_reward,
        teacher_model=teacher_config(spec),
        estimator=spec.estimator,
    )


def initial_train_state(
    config: RunConfig, train_config: TrainConfig, params: object, vocab_size: int
) -> TrainState:
    """A run's step-0 train state: its reference is the initial policy when the
    algorithm needs one, and ``config.distill``'s teacher is loaded, checked against the
    student's ``vocab_size``, as ``teacher_params``."""
    ref = params if train_config.algorithm.needs_reference else None
    teacher = None
    if config.distill is not None:
        dtype = check_teacher(config.distill, vocab_size).param_dtype
        model, _ = load_hf_checkpoint(
            str(config.distill.teacher), param_dtype=dtype, with_tokenizer=False
        )
        teacher = nnx.split(model)[1]
    return create_train_state(
        train_config, params, seed=config.seed, ref_params=ref, teacher_params=teacher
    )
