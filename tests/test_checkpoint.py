"""Orbax checkpoints of the train state: save, restore, continue = never stopping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_trainer import OPTIMIZER, batch_of, model_parts

from rlaxkit.algorithms import algorithm
from rlaxkit.trainer.checkpoint import CheckpointManager, restore_train_state, save_train_state
from rlaxkit.trainer.config import TrainConfig
from rlaxkit.trainer.state import create_train_state
from rlaxkit.trainer.step import make_train_step

CFG = TrainConfig(algorithm=algorithm("grpo"), optimizer=OPTIMIZER)


def fresh_state():
    graphdef, params = model_parts()
    return graphdef, create_train_state(CFG, params, seed=3, ref_params=model_parts(seed=1)[1])


def test_save_restore_continue_equals_never_stopping(tmp_path):
    graphdef, state = fresh_state()
    step = make_train_step(CFG, graphdef)
    batches = [batch_of(seed=s) for s in range(4)]

    reference = state
    for batch in batches:
        reference, _ = step(reference, batch)

    _, state = fresh_state()
    with CheckpointManager(tmp_path, max_to_keep=2, async_save=True) as manager:
        for batch in batches[:2]:
            state, _ = step(state, batch)
            save_train_state(manager, state, json={"cursor": {"step": int(state.step)}})
        manager.wait()
        assert manager.all_steps() == (1, 2)
        _, like = fresh_state()
        restored = restore_train_state(manager, like)
        cursor = manager.restore(json=["cursor"])["cursor"]
    assert int(restored.step) == 2 and cursor == {"step": 2}
    for batch in batches[2:]:
        restored, _ = step(restored, batch)
    # Bitwise: the same programs on the same inputs.
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(reference), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_keep_n_and_missing_items_are_clear(tmp_path):
    _, state = fresh_state()
    with CheckpointManager(tmp_path, max_to_keep=2, async_save=False) as manager:
        for n in range(1, 5):
            manager.save(n, pytrees={"w": {"x": jnp.full(3, float(n))}}, json={"n": n})
        assert manager.all_steps() == (3, 4)
        back = manager.restore(3, pytrees={"w": {"x": jnp.zeros(3)}}, json=["n"])
        np.testing.assert_array_equal(back["w"]["x"], np.full(3, 3.0))
        assert back["n"] == 3
        with pytest.raises(FileNotFoundError, match="no item"):
            manager.restore(json=["cursor"])
        with pytest.raises(FileNotFoundError, match="no checkpoint for step 1"):
            manager.restore(1, json=["n"])
        with pytest.raises(ValueError, match="item name"):
            manager.save(5, json={"Bad-Name": 1})
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointManager(tmp_path / "other", max_to_keep=0)


def test_each_asynchronous_write_is_timed_from_the_saves_return_to_its_end(tmp_path):
    ticks = iter(range(1000))
    with CheckpointManager(tmp_path, async_save=True, clock=lambda: float(next(ticks))) as manager:
        for step in (1, 2):
            manager.save(step, pytrees={"w": {"x": jnp.full(3, float(step))}})
        manager.wait()
        first, second = manager.finished_writes()
        assert manager.finished_writes() == []  # each write is handed out once
    assert (first.step, second.step) == (1, 2)
    # The second save starts once the first write is done, so the writes do not overlap.
    assert first.returned_s < first.written_s < second.returned_s < second.written_s
    with CheckpointManager(tmp_path / "sync", async_save=False) as manager:
        manager.save(1, json={"n": 1})
        assert manager.finished_writes() == []  # written when save returned
