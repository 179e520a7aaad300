"""Checkpoints of named items (array pytrees and JSON metadata) with Orbax.

``CheckpointManager`` wraps ``orbax.checkpoint.CheckpointManager``: each step directory
holds any number of named items, each either a pytree of arrays (saved with Orbax's
standard tensorstore format, restored onto any sharding) or a JSON-able value. The
train state is one item; later parts of the system add theirs (controller cursor,
rollout buffer, in-flight metadata) by name, without a new checkpoint format.

Saves are asynchronous by default: ``save`` returns once the arrays are copied off the
device, and writing continues in the background; ``wait`` blocks until it is durable.
``finished_writes`` says when each background write ended (on the manager's ``clock``),
so that a trace can charge a save its whole cost. Only the newest ``max_to_keep``
checkpoints are kept.

>>> import tempfile, jax.numpy as jnp
>>> directory = tempfile.TemporaryDirectory()
>>> with CheckpointManager(directory.name, async_save=False) as manager:
...     manager.save(3, pytrees={"weights": {"w": jnp.ones(2)}}, json={"cursor": {"i": 7}})
...     manager.restore(json=["cursor"])["cursor"]
True
{'i': 7}
>>> directory.cleanup()
"""

from __future__ import annotations

import json as json_module
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from rlaxkit.rules.validation import check_int
from rlaxkit.trainer.sharding import state_shardings
from rlaxkit.trainer.state import TrainState

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
TRAIN_STATE = "train_state"
# Wall seconds between looks at whether a background write has ended: it sleeps between
# them, so on a CPU clock the end is read within about this much of another thread's work.
WRITE_POLL_S = 0.002


class BackgroundWrite(NamedTuple):
    """One asynchronous save's write, on the manager's clock: ``returned_s`` when
    ``save`` returned (the arrays copied), ``written_s`` when the write was durable."""

    step: int
    returned_s: float
    written_s: float


def abstract_tree(tree: object, shardings: object = None) -> object:
    """``ShapeDtypeStruct`` per leaf: a restore target.

    Args:
        tree: arrays or ``ShapeDtypeStruct``\\ s giving shapes and dtypes.
        shardings: a matching tree of shardings to restore onto; ``None`` keeps each
            leaf's own sharding (or the default device for leaves that have none).
    """
    if shardings is None:
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            tree,
        )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


class CheckpointDamaged(RuntimeError):
    """A committed checkpoint step whose files cannot be read back (deleted or truncated
    data files, a corrupt JSON item).

    Attributes:
        step: the damaged step.
        step_dir: its directory; deleting it makes ``previous_step`` the latest.
        problem: what could not be read (item, error type and its first line).
        previous_step: the newest older checkpoint kept, or ``None``.
    """

    def __init__(self, step: int, step_dir: Path, problem: str, previous_step: int | None):
        self.step, self.step_dir = step, step_dir
        self.problem, self.previous_step = problem, previous_step
        if previous_step is None:
            fix = f"delete {step_dir} and start again (no earlier checkpoint is kept)"
        else:
            fix = f"delete {step_dir} to resume from step {previous_step}, the previous checkpoint"
        super().__init__(f"checkpoint step {step} at {step_dir} is damaged: {problem}; {fix}")


def verify_step(step_dir: str | Path, items: Iterable[str] | None = None) -> str | None:
    """Reads every item of a checkpoint step back; ``None`` when all of them read, else
    what failed (item, error type and the error's first line).

    Pytree items are read onto the host as NumPy arrays from their own saved metadata (no
    restore target or devices needed), so this reads the whole step: it costs as much as
    a restore.

    Args:
        step_dir: the step's directory (``<checkpoints>/<step>``).
        items: the item names to read; ``None``: every item of the step.
    """
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        return f"{step_dir} does not exist"
    names = sorted(p.name for p in step_dir.iterdir() if p.is_dir()) if items is None else items
    for name in names:
        item_dir = step_dir / name
        try:
            if not item_dir.is_dir():
                raise FileNotFoundError(f"item directory {item_dir} is missing")
            if (item_dir / "metadata").is_file():  # a JSON item's one file
                json_module.loads((item_dir / "metadata").read_text())
            elif any((item_dir / f).exists() for f in ("_METADATA", "manifest.ocdbt")):
                _read_pytree(item_dir)
            else:
                raise FileNotFoundError(
                    f"{item_dir} holds neither a pytree (_METADATA) nor a JSON item (metadata)"
                )
        except Exception as error:  # noqa: BLE001 (any failure to read is the answer)
            first_line = (str(error).strip().splitlines() or [""])[0][:300]
            return f"item {name!r}: {type(error).__name__}: {first_line}"
    return None


def _read_pytree(item_dir: Path) -> None:
    with ocp.PyTreeCheckpointer() as checkpointer:
        metadata = checkpointer.metadata(item_dir).item_metadata
        if metadata is None:
            raise FileNotFoundError(f"no readable pytree metadata in {item_dir}")
        restore_args = jax.tree.map(
            lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata.tree
        )
        checkpointer.restore(item_dir, args=ocp.args.PyTreeRestore(restore_args=restore_args))


class CheckpointManager:
    """Saves and restores named items per step; keeps the newest ``max_to_keep``.

    Args:
        directory: where step directories are written (created if missing).
        max_to_keep: number of checkpoints kept; older ones are deleted.
        async_save: write in the background (call ``wait`` before relying on it).
        clock: the clock ``finished_writes`` reports on (a run passes its own).
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        max_to_keep: int = 3,
        async_save: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ):
        check_int("max_to_keep", max_to_keep, minimum=1)
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._async, self._clock = async_save, clock
        self._written: queue.SimpleQueue[BackgroundWrite] = queue.SimpleQueue()
        self._watcher: threading.Thread | None = None

    def save(
        self,
        step: int,
        *,
        pytrees: Mapping[str, object] | None = None,
        json: Mapping[str, object] | None = None,
        force: bool = False,
    ) -> bool:
        """Saves the items as checkpoint ``step``; returns whether a save started.

        Args:
            step: the step number (unique, increasing).
            pytrees: name -> pytree of arrays.
            json: name -> JSON-serialisable value (dicts, lists, numbers, strings).
            force: save even if Orbax's save policy would skip this step.
        """
        items = {name: ocp.args.StandardSave(tree) for name, tree in (pytrees or {}).items()}
        items |= {name: ocp.args.JsonSave(value) for name, value in (json or {}).items()}
        if not items:
            raise ValueError("save: give at least one item in pytrees or json")
        for name in items:
            _check_name(name)
        overlap = set(pytrees or {}) & set(json or {})
        if overlap:
            raise ValueError(f"save: item names used twice: {sorted(overlap)}")
        # Orbax starts a save once the previous write is done; the previous watcher ends
        # first, so that it cannot take this write's progress for its own.
        self._join_watcher()
        started = self._manager.save(step, args=ocp.args.Composite(**items), force=force)
        if started and self._async:
            self._watch(step, self._clock())
        return started

    def _watch(self, step: int, returned_s: float) -> None:
        def watch() -> None:
            while self._manager.is_saving_in_progress():
                time.sleep(WRITE_POLL_S)
            self._written.put(BackgroundWrite(step, returned_s, self._clock()))

        self._watcher = threading.Thread(target=watch, name=f"checkpoint-write-{step}", daemon=True)
        self._watcher.start()

    def _join_watcher(self) -> None:
        if self._watcher is not None:
            self._manager.wait_until_finished()
            self._watcher.join()
            self._watcher = None

    def finished_writes(self) -> list[BackgroundWrite]:
        """The background writes that ended since the last call, oldest first (none
        without ``async_save``: ``save`` returns once the checkpoint is written)."""
        out = []
        while not self._written.empty():
            out.append(self._written.get_nowait())
        return out

    def restore(
        self,
        step: int | None = None,
        *,
        pytrees: Mapping[str, object] | None = None,
        json: Iterable[str] = (),
    ) -> dict[str, Any]:
        """Restores the named items of checkpoint ``step`` (default: the latest).

        Args:
            step: which checkpoint; ``None`` for the latest.
            pytrees: name -> restore target: a tree of ``ShapeDtypeStruct`` (see
                ``abstract_tree``) whose shardings say where the arrays go, or a tree of
                arrays used as a template (restored onto the same shardings).
            json: names of JSON items.

        Raises:
            FileNotFoundError: when there is no such checkpoint or item.
            CheckpointDamaged: the step is committed but its files cannot be read back
                (``verify_step`` fails too, so the fault is not the restore target's);
                the error names the step directory and the previous step to resume from.
        """
        step = self.latest_step() if step is None else step
        if step is None or step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}")
        available = self.item_names(step)
        wanted = {**{n: "pytree" for n in (pytrees or {})}, **{n: "json" for n in json}}
        missing = sorted(set(wanted) - set(available))
        if missing:
            raise FileNotFoundError(
                f"checkpoint {step} in {self.directory} has no item(s) {missing}; it has "
                f"{sorted(available)}"
            )
        items = {
            name: ocp.args.StandardRestore(abstract_tree(target))
            for name, target in (pytrees or {}).items()
        }
        items |= {name: ocp.args.JsonRestore() for name in json}
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception:
            # A target that does not fit fails here too; only a step whose own files
            # cannot be read back is called damaged.
            problem = verify_step(self.directory / str(step), items)
            if problem is None:
                raise
            raise CheckpointDamaged(
                step, self.directory / str(step), problem, self.previous_step(step)
            ) from None
        return {name: restored[name] for name in items}

    def verify(self, step: int) -> str | None:
        """``verify_step`` of checkpoint ``step``: ``None`` when every item reads back."""
        return verify_step(self.directory / str(step))

    def previous_step(self, step: int) -> int | None:
        """The newest checkpoint kept before ``step``, or ``None``."""
        older = [s for s in self.all_steps() if s < step]
        return older[-1] if older else None

    def item_names(self, step: int) -> tuple[str, ...]:
        """Names of the items saved in checkpoint ``step``."""
        step_dir = self.directory / str(step)
        return tuple(sorted(p.name for p in step_dir.iterdir() if p.is_dir()))

    def latest_step(self) -> int | None:
        """The newest checkpoint's step, or ``None``."""
        return self._manager.latest_step()

    def all_steps(self) -> tuple[int, ...]:
        """Steps of the checkpoints kept, oldest first."""
        return tuple(sorted(self._manager.all_steps()))

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are written."""
        self._join_watcher()
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases Orbax's resources."""
        self.wait()
        self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def save_train_state(
    manager: CheckpointManager,
    state: TrainState,
    *,
    json: Mapping[str, object] | None = None,
    pytrees: Mapping[str, object] | None = None,
    force: bool = False,
) -> bool:
    """Saves ``state`` as item ``train_state`` at step ``state.step``, with extra items."""
    return manager.save(
        int(state.step), pytrees={TRAIN_STATE: state, **(pytrees or {})}, json=json, force=force
    )


def restore_train_state(
    manager: CheckpointManager,
    like: TrainState,
    *,
    mesh: Mesh | None = None,
    step: int | None = None,
) -> TrainState:
    """Restores the ``train_state`` item shaped like ``like``.

    Args:
        manager: where to read.
        like: a state (arrays or ``ShapeDtypeStruct``\\ s) with the saved structure, e.g.
            a freshly created one; only shapes and dtypes are read from it.
        mesh: restore sharded onto this mesh (any shape: the saved layout does not
            matter) with ``trainer.state_shardings``; ``None`` keeps ``like``'s placement.
        step: which checkpoint; ``None`` for the latest.
    """
    target = abstract_tree(like, state_shardings(like, mesh) if mesh is not None else None)
    return manager.restore(step, pytrees={TRAIN_STATE: target})[TRAIN_STATE]


def _check_name(name: str) -> None:
    if not _NAME.match(name):
        raise ValueError(
            f"item name {name!r}: must start with a lowercase letter and contain only "
            "lowercase letters, digits and underscores"
        )
