"""The trainer host compiles the first train step while the workers start, and stops the
run at a step whose loss or gradient norm is not finite."""

import re

import jax
import pytest

from rlaxkit.batch import collate
from rlaxkit.checkpoint import abstract_tree
from rlaxkit.config import small_run_config
from rlaxkit.episodes import EpisodicTask
from rlaxkit.jaxutil import count_compilations
from rlaxkit.models import CharTokenizer
from rlaxkit.runtime import Experiment
from rlaxkit.runtime.build import build_task, task_alphabet
from rlaxkit.runtime.common import TRAIN_BUCKETS
from rlaxkit.runtime.trainer_host import first_batch


def test_the_first_train_step_runs_the_program_compiled_ahead(tmp_path, no_persistent_cache):
    config = small_run_config("steps=1")
    with Experiment(config, cache_dir=tmp_path) as exp:
        host = exp.parts.trainer.group.leader
        groups = exp.collect_batch()
        samples = [r for g in groups for r in g.rollouts]
        batch = collate(samples, bucket=TRAIN_BUCKETS, pad_token_id=exp.tokenizer.pad_id)
        # The guess is the batch's shape, dtypes and structure, so its program is the step's.
        guess = first_batch(config, exp.task, exp.tokenizer)
        assert jax.tree.structure(guess) == jax.tree.structure(batch)
        assert abstract_tree(guess) == abstract_tree(batch)
        assert host.compiling is not None
        host.compiling.join()
        with count_compilations() as compiles:
            result = host.train(batch, 1)
        assert compiles.count == 0
        assert host.compiling is None and result.metrics


def test_no_guess_for_an_episodic_task():
    config = small_run_config("task.name=calculator")
    task = build_task(config)
    assert isinstance(task, EpisodicTask)
    assert first_batch(config, task, CharTokenizer(task_alphabet(task))) is None


def test_a_step_whose_loss_is_not_finite_stops_the_run_before_its_push(cache):
    """A step size of 1e30 passes the config (it is a finite number), makes the weights
    overflow on the first update, and the next step's gradient norm is NaN: the run stops
    there, naming the step, instead of training and publishing NaN for the rest of it.
    Groups whose rewards are all equal are kept: the overflowed policy may sample alike
    completions, and dropping their groups would leave the next step without a batch."""
    config = small_run_config(
        "steps=4",
        "optimizer.learning_rate=1e30",
        "optimizer.warmup_steps=0",
        "batching.equal_rewards=keep",
    )
    with Experiment(config, cache_dir=cache) as exp:
        with pytest.raises(
            FloatingPointError, match=r"train step \d+: (loss|grad_norm) is (nan|inf)"
        ) as caught:
            exp.run()
        failed = int(re.search(r"train step (\d+)", str(caught.value)).group(1))
        assert failed >= 2 and exp.parts.store.latest_version() == failed - 1
