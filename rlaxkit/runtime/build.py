"""Builds a run's parts from a ``RunConfig``: task, tokenizer, policy, warm start.

Shared by every backend so that the same config gives the same model, data and seeds
whether the loop runs in one process or across Ray actors.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
import threading
from collections.abc import Callable
from pathlib import Path

from flax import nnx

from rlaxkit.algorithms import algorithm
from rlaxkit.config.io import to_dict
from rlaxkit.config.run import RunConfig
from rlaxkit.models import (
    CharTokenizer,
    Tokenizer,
    Transformer,
    check_hf_checkpoint,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from rlaxkit.rules.validation import check_tokenizer_fits
from rlaxkit.tasks import Task, make_task
from rlaxkit.trainer.config import TrainConfig
from rlaxkit.trainer.sft import supervised_warm_start
from rlaxkit.trainer.teacher import check_teacher, distill_config


def build_task(config: RunConfig) -> Task:
    """The task named by ``config.task`` with its options."""
    return make_task(config.task.name, **config.task.options)


def task_alphabet(task: Task) -> str:
    """Characters a character tokenizer needs for ``task``'s prompts and answers."""
    alphabet = getattr(task, "alphabet", None)
    if callable(alphabet):
        return alphabet()
    chars = set(string.printable) - set("\x0b\x0c\r")
    return "".join(sorted(chars))


def build_policy(
    config: RunConfig, task: Task, abstract: bool = False
) -> tuple[Transformer, Tokenizer]:
    """A fresh model with a character tokenizer, or a local HF checkpoint.

    ``abstract``: a fresh model's parameters are ``ShapeDtypeStruct``\\ s
    (``nnx.eval_shape``), for a caller that needs only its graph and shapes or replaces
    its weights (a cached warm start): initialising them compiles one program per
    parameter shape, about 2 s for the demo's model in a fresh process.
    """
    spec = config.model
    if spec.checkpoint:
        model, tokenizer = load_hf_checkpoint(spec.checkpoint, param_dtype=spec.param_dtype)
        if tokenizer is None:
            raise ValueError(f"model.checkpoint {spec.checkpoint} has no tokenizer.json; add one")
        return model, tokenizer
    tokenizer = char_tokenizer(config, task)
    model_config = spec.config.replace(vocab_size=tokenizer.vocab_size)
    if spec.param_dtype:
        model_config = model_config.replace(param_dtype=spec.param_dtype)
    if abstract:
        model = nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(config.seed)))
        return model, tokenizer
    return Transformer(model_config, rngs=nnx.Rngs(config.seed)), tokenizer


def char_tokenizer(config: RunConfig, task: Task) -> CharTokenizer:
    """The character tokenizer of a fresh model for ``task``; refuses a configured
    ``model.config.vocab_size`` too small for it, naming the size to set."""
    tokenizer = CharTokenizer(task_alphabet(task))
    if config.model.config.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"model.config.vocab_size: {config.model.config.vocab_size}, but task "
            f"{config.task.name!r} needs a character tokenizer of {tokenizer.vocab_size} "
            f"symbols; set model.config.vocab_size={tokenizer.vocab_size} (a fresh model "
            "is built with exactly the tokenizer's size)"
        )
    return tokenizer


def check_inputs(config: RunConfig) -> None:
    """Reads the run's inputs before it does any work, so a bad file fails before a run
    folder, a warm start or an actor exists: the task's training data (readable,
    non-empty, decodable rows; the loaders name file and row) and the model (a
    checkpoint's config, tensor shapes and tokenizer, from headers only; or the
    configured vocabulary against the task's character tokenizer)."""
    task = build_task(config)
    task.problems("train", config.task.num_train)
    if config.model.checkpoint:
        model = check_hf_checkpoint(config.model.checkpoint, param_dtype=config.model.param_dtype)
        vocab_size = model.vocab_size
    else:
        vocab_size = char_tokenizer(config, task).vocab_size
    if config.distill is not None:  # the teacher's vocabulary must be the student's
        check_teacher(config.distill, vocab_size)


def warm_start_key(config: RunConfig) -> str:
    """Hash of everything the warm-started weights depend on."""
    relevant = {
        "model": {k: v for k, v in to_dict(config.model).items() if k != "sampler_dtype"},
        "task": to_dict(config.task),
        "sft": to_dict(config.sft),
        "seed": config.seed,
    }
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


def warm_start_path(config: RunConfig, cache_dir: Path | None) -> Path | None:
    """Where ``warm_start`` caches ``config``'s weights (``None``: no cache)."""
    return cache_dir / f"warm_start-{warm_start_key(config)}" if cache_dir else None


def cached_warm_start(config: RunConfig, cache_dir: Path | None) -> Path | None:
    """The cached warm start ``warm_start`` would load for ``config``, if there is one
    (then the model it is given is not used)."""
    path = warm_start_path(config, cache_dir)
    if config.sft.steps == 0 or path is None or not (path / "config.json").exists():
        return None
    return path


def warm_start(
    config: RunConfig,
    task: Task,
    model: Transformer,
    tokenizer: Tokenizer,
    cache_dir: Path | None,
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[Transformer, dict]:
    """Supervised warm start on the task's demonstrations, cached in ``cache_dir``.

    Returns the (possibly reloaded) model and a summary: ``cached``, ``steps``,
    ``final_loss``.
    """
    if config.sft.steps == 0:
        return model, {"cached": False, "steps": 0}
    demonstration = getattr(task, "demonstration", None)
    if demonstration is None:
        raise ValueError(
            f"sft.steps is {config.sft.steps} but task {config.task.name!r} has no "
            "demonstrations; set sft.steps=0"
        )
    if (cached_path := cached_warm_start(config, cache_dir)) is not None:
        cached, _ = load_hf_checkpoint(cached_path, with_tokenizer=False)
        check_tokenizer_fits(tokenizer, cached.config.vocab_size, f"warm start {cached_path}")
        return cached, {"cached": True, "steps": config.sft.steps, "path": str(cached_path)}
    problems = task.problems("train", config.task.num_train)
    pairs = [(task.format_prompt(p), demonstration(p)) for p in problems]
    losses = supervised_warm_start(model, tokenizer, pairs, config.sft, on_step=on_step)
    if (path := warm_start_path(config, cache_dir)) is not None:
        _publish(model, path)
    return model, {"cached": False, "steps": len(losses), "final_loss": losses[-1]}


def _publish(model: Transformer, path: Path) -> None:
    """Writes a warm start beside ``path`` and renames it into place, so that a reader
    finds a whole checkpoint or none. Processes that share one cache (a run's actors,
    parallel test workers, a sweep) may train the same warm start at once; the first to
    finish keeps its copy, the others' are removed."""
    staging = path.with_name(f"{path.name}.partial-{os.getpid()}-{threading.get_ident()}")
    save_hf_checkpoint(model, staging)
    try:
        staging.rename(path)
    except OSError:  # published by another process meanwhile
        shutil.rmtree(staging, ignore_errors=True)


def train_config_for(config: RunConfig) -> TrainConfig:
    """The trainer's configuration for a run (every placement builds it here)."""
    overrides = {
        k: v
        for k, v in (("advantage", config.algorithm.advantage), ("loss", config.algorithm.loss))
        if v
    }
    return TrainConfig(
        algorithm=algorithm(config.algorithm.preset, **overrides),
        optimizer=config.optimizer,
        micro_batches=config.trainer.micro_batches,
        mini_batches=config.trainer.mini_batches,
        epochs=config.trainer.epochs,
        lora=config.trainer.lora,
        temperature=config.sampling.temperature or 1.0,
        distill=distill_config(config.distill),
        drift_every=config.metrics.drift_every,
    )
