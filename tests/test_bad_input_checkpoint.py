"""A committed checkpoint step whose files were deleted or truncated is named as damaged,
with the previous step to resume from; a restore target that does not fit is not."""

import shutil

import jax.numpy as jnp
import pytest

from rlaxkit.trainer.checkpoint import CheckpointDamaged, CheckpointManager, verify_step


def _two_steps(directory):
    with CheckpointManager(directory, async_save=False) as manager:
        for step in (1, 2):
            manager.save(step, pytrees={"weights": {"w": jnp.full(4, step)}}, json={"cursor": {}})


def _delete_array_files(step_dir):
    for path in (step_dir / "weights").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.unlink()


def _truncate_array_files(step_dir):
    for path in (step_dir / "weights").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            with path.open("r+b") as f:
                f.truncate(3)


def _delete_weights_dir_contents(step_dir):
    shutil.rmtree(step_dir / "weights")
    (step_dir / "weights").mkdir()


def _corrupt_json_item(step_dir):
    (step_dir / "cursor" / "metadata").write_text("{trunc")


@pytest.mark.parametrize(
    ("damage", "item"),
    [
        (_delete_array_files, "weights"),
        (_truncate_array_files, "weights"),
        (_delete_weights_dir_contents, "weights"),
        (_corrupt_json_item, "cursor"),
    ],
)
def test_a_damaged_step_names_its_directory_and_the_previous_step(tmp_path, damage, item):
    _two_steps(tmp_path)
    step_dir = tmp_path / "2"
    damage(step_dir)
    manager = CheckpointManager(tmp_path, async_save=False)
    with pytest.raises(CheckpointDamaged) as err:
        manager.restore(pytrees={"weights": {"w": jnp.zeros(4)}}, json=["cursor"])
    error = err.value
    assert (error.step, error.step_dir, error.previous_step) == (2, step_dir, 1)
    assert str(error).startswith(f"checkpoint step 2 at {step_dir} is damaged: item {item!r}")
    assert str(error).endswith(f"delete {step_dir} to resume from step 1, the previous checkpoint")
    assert manager.verify(2) is not None and manager.verify(1) is None
    # The fix the message gives works.
    shutil.rmtree(step_dir)
    manager = CheckpointManager(tmp_path, async_save=False)
    restored = manager.restore(pytrees={"weights": {"w": jnp.zeros(4)}})
    assert restored["weights"]["w"].tolist() == [1, 1, 1, 1]


def test_the_only_step_damaged_says_to_start_again(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as manager:
        manager.save(5, pytrees={"weights": {"w": jnp.ones(4)}})
    _delete_array_files(tmp_path / "5")
    with pytest.raises(CheckpointDamaged, match="and start again") as err:
        CheckpointManager(tmp_path, async_save=False).restore(
            pytrees={"weights": {"w": jnp.ones(4)}}
        )
    assert err.value.previous_step is None


def test_a_target_that_does_not_fit_is_not_called_damage(tmp_path):
    _two_steps(tmp_path)
    manager = CheckpointManager(tmp_path, async_save=False)
    with pytest.raises(Exception) as err:  # Orbax's own error about the target
        manager.restore(pytrees={"weights": {"other": jnp.zeros(4)}})
    assert not isinstance(err.value, CheckpointDamaged)
    assert verify_step(tmp_path / "2") is None
    assert verify_step(tmp_path / "9") == f"{tmp_path / '9'} does not exist"


# A failed read can leave Orbax's event-loop callbacks to run after their loop closed
# ("Event loop is closed", raised in its threads, not ours): noise of the failure path.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_run_on_a_damaged_checkpoint_says_which_and_resumes_from_the_previous(tmp_path):
    """The newest checkpoint of a run lost its data files: the next run on the directory
    names the damaged step and the one to resume from; without it, the run resumes."""
    from rlaxkit.config.run import small_run_config
    from rlaxkit.runtime import Experiment

    config = small_run_config(
        "steps=4", "checkpoint.every_steps=2", "sft.steps=0", "batching.equal_rewards=keep"
    )
    with Experiment(config, run_dir=tmp_path) as exp:
        exp.run()
    step_dir = tmp_path / "checkpoints" / "4"
    data = [p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data
    for path in data:
        path.unlink()
    with pytest.raises(CheckpointDamaged, match=r"step 4 .* resume from step 2") as error:
        Experiment(config, run_dir=tmp_path)
    shutil.rmtree(error.value.step_dir)
    with Experiment(config, run_dir=tmp_path) as exp:
        assert exp.resumed_from == 2
