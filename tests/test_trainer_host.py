"""The trainer host compiles the first train step while the workers start, and stops the
run at a step whose loss, gradient norm or update norm is not finite."""

import math

import jax
import pytest

from rlaxkit.config.run import small_run_config
from rlaxkit.data.batch import collate
from rlaxkit.models import CharTokenizer
from rlaxkit.runtime import Experiment
from rlaxkit.runtime.build import build_task, task_alphabet
from rlaxkit.runtime.common import TRAIN_BUCKETS
from rlaxkit.tasks.episodes import EpisodicTask
from rlaxkit.trainer.checkpoint import abstract_tree
from rlaxkit.trainer.host import check_finite, first_batch
from rlaxkit.util.jaxutil import count_compilations


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


def test_an_update_that_overflows_the_weights_stops_the_run_before_its_push(cache):
    """A step size of 1e30 passes the config (it is a finite number). The first update
    moves every weight by about 1e30: still finite, but the next forward pass overflows.
    That step's loss and gradient norm, taken before the update, are finite; its update
    norm is not (its squares overflow). The run stops at that step, naming it, and the
    new weights reach neither the store (it still holds the initial version) nor a
    worker. Groups whose rewards are all equal are kept, so that the first batch does
    not wait on the initial policy solving some problems."""
    config = small_run_config(
        "steps=4",
        "optimizer.learning_rate=1e30",
        "optimizer.warmup_steps=0",
        "batching.equal_rewards=keep",
    )
    with Experiment(config, cache_dir=cache) as exp:
        with pytest.raises(FloatingPointError, match=r"train step 1: update_norm is inf"):
            exp.run()
        assert exp.parts.store.latest_version() == 0
        assert set(exp.fleet.versions().values()) <= {0, None}


def test_a_run_whose_update_breaks_the_policy_says_which_step_and_learning_rate(cache):
    """A step size of 1e6 keeps the weights finite but breaks the policy: after a step or
    two no sampled group has a reward different from the others, and every one is
    dropped. The error names the step after which the drops came, with its update norm
    and learning rate, instead of only blaming the task or the warm start."""
    config = small_run_config("steps=6", "optimizer.learning_rate=1e6", "optimizer.warmup_steps=0")
    with Experiment(config, cache_dir=cache) as exp:
        with pytest.raises(RuntimeError, match="in a row were dropped") as caught:
            exp.run()
        step = exp.books.history[-1]["step"]
    message = str(caught.value)
    assert f"after train step {step} (" in message
    assert "learning rate 1e+06" in message and "update norm " in message
    assert "lower optimizer.learning_rate" in message


@pytest.mark.parametrize("key", ["loss", "grad_norm", "update_norm"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_check_finite_names_each_non_finite_figure(key, value):
    metrics = {"loss": 0.5, "grad_norm": 1.0, "update_norm": 0.01}
    check_finite(3, metrics)  # all finite: passes
    with pytest.raises(FloatingPointError, match=rf"train step 3: {key} is {value}"):
        check_finite(3, {**metrics, key: value})
