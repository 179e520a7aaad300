"""One checkpoint codec for every placement: what a checkpoint holds, how the driver's
books go in and come back, and the checks made before anything is read.

A run's checkpoints live in ``RUN_DIR/checkpoints/<step>/`` (``rlaxkit.trainer.checkpoint.
CheckpointManager``: Orbax, atomic, newest ``CheckpointPolicy.keep`` kept), written by
the trainer (in process, or every process of a Ray trainer group) with the driver's
items in the same Orbax step, so a checkpoint half written when a process died is never
listed. Items:

- ``train_state`` (arrays): the ``TrainState`` (params, optimizer, step, RNG key).
- ``weights`` (arrays, optional): ``{"v<N>": params}`` for weight versions other than
  the train state's that a restore needs: the newest *published* version (pushes every
  ``k`` steps), a push held back by a parameter-server outage, and the versions the
  workers' replay logs start from or pulled.
- ``meta`` (JSON): format, backend, step, the run config, parameter shapes and dtypes,
  the run's books (``RunBooks.state_dict``: fault clock, last save, goodput), the
  trace's clock and length, the published version, the saved weight versions.
- ``controller`` (JSON): ``PromptController.state_dict()`` (prompt cursor; the RNG
  streams are pure functions of the seed and the issue number).
- ``buffer`` (JSON): ``RolloutBuffer.state_dict()`` (buffered-but-untrained rollouts,
  in-flight prompt ids, trained and dropped books).
- ``workers`` (JSON): per worker, in fleet order, its id and its replay log
  (``InferenceWorker.snapshot``): the prompts in flight are generated again on restore
  with the same ids and seeds, up to the chunk where the checkpoint found them.
- ``fleet`` (JSON): the fleet's own books (reward counters, retired workers' counters).
- ``faults`` (JSON): the fault plan's state (fired faults, downtimes, outages).
- ``history`` (JSON): every step's metrics, so a resumed run's history is complete.
- ``extra`` (JSON): the caller's (``rlaxkit train`` keeps its evaluations here).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from rlaxkit.api import FleetCheckpoint
from rlaxkit.config.run import RunConfig
from rlaxkit.data.buffer import RolloutBuffer
from rlaxkit.observe.metrics import replace_lines
from rlaxkit.observe.tracking import flatten
from rlaxkit.rules.books import RunBooks
from rlaxkit.rules.controller import PromptController
from rlaxkit.rules.fault_plan import FaultPlan
from rlaxkit.trainer.checkpoint import CheckpointManager
from rlaxkit.util.rundirs import claim_without_checkpoint

FORMAT = 2
JSON_ITEMS = ("meta", "controller", "buffer", "workers", "fleet", "faults", "history", "extra")
# Config sections a run may change when it resumes: how long to run, how to evaluate,
# when to checkpoint, where Ray places actors (the local backend ignores it), what it
# records (tracking: a checkpoint written before it existed, or another list of trackers,
# resumes). Everything else shapes the RL state and must match.
RESUMABLE_FIELDS = ("steps", "eval", "checkpoint", "ray", "tracking")


def param_shapes(tree: object) -> dict[str, list]:
    """``{path: [shape, dtype]}`` of every leaf (compared before a restore)."""
    return {
        jax.tree_util.keystr(path): [list(leaf.shape), str(leaf.dtype)]
        for path, leaf in jax.tree.leaves_with_path(tree)
    }


def config_differences(saved: Mapping[str, object], current: Mapping[str, object]) -> list[str]:
    """Dotted config fields that differ, ``RESUMABLE_FIELDS`` excepted."""
    old, new = flatten(saved, "."), flatten(current, ".")
    out = []
    for key in sorted(set(old) | set(new)):
        if key.split(".")[0] in RESUMABLE_FIELDS:
            continue
        if old.get(key, "<unset>") != new.get(key, "<unset>"):
            out.append(
                f"{key} is {old.get(key, '<unset>')!r} in the checkpoint, "
                f"{new.get(key, '<unset>')!r} now"
            )
    return out


def check_compatible(meta: dict[str, Any], directory: str, config: dict, shapes: dict) -> None:
    """Raises ``ValueError`` naming what differs when a checkpoint cannot resume this run.

    Args:
        meta: the checkpoint's ``meta`` item.
        directory: the checkpoint directory (for the message).
        config: this run's config as a dict.
        shapes: ``param_shapes`` of this run's train state.
    """
    fix = "start a new run directory, or resume with the config the checkpoint was written with"
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"checkpoint in {directory}: format {meta.get('format')!r}, this version reads "
            f"format {FORMAT}; {fix}"
        )
    differences = config_differences(meta["config"], config)
    if differences:
        shown = "; ".join(differences[:5])
        more = f" (and {len(differences) - 5} more)" if len(differences) > 5 else ""
        raise ValueError(f"checkpoint in {directory} is for another config: {shown}{more}; {fix}")
    for path in sorted(set(meta["shapes"]) | set(shapes)):
        if meta["shapes"].get(path) != shapes.get(path):
            raise ValueError(
                f"checkpoint in {directory}: train state leaf {path} is "
                f"{meta['shapes'].get(path, 'missing')} there and {shapes.get(path, 'missing')} "
                f"in this run (another model shape); {fix}"
            )


def check_plan(directory: Path, saved: list, plan: FaultPlan) -> None:
    """Raises ``ValueError`` when a checkpoint was written under another plan."""
    if saved != plan.to_dicts():
        raise ValueError(
            f"faults: the checkpoint in {directory} was written with another fault "
            f"plan ({len(saved)} faults; this run has {len(plan)}); resume with the same "
            "--faults plan or start a new run directory"
        )


def weights_key(version: int) -> str:
    """Key of a weight version in the ``weights`` item."""
    return f"v{version}"


def checkpoint_dir(run_dir: Path) -> Path:
    """Where a run's checkpoints live."""
    return run_dir / "checkpoints"


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from: its directory, meta and other JSON items."""

    directory: Path
    meta: dict[str, Any]
    items: dict[str, Any]

    @property
    def step(self) -> int:
        return self.meta["step"]


def find_resume_point(
    run_dir: Path | None, config: RunConfig, plan: FaultPlan, resume: bool
) -> ResumePoint | None:
    """The newest checkpoint in ``run_dir`` to resume from (``None``: a new run).

    Raises:
        ValueError: ``run_dir`` holds a run and ``resume=False``; the checkpoint was
            written by another backend, for another config (naming the field) or under
            another fault plan; concurrent mode cannot resume.
    """
    if run_dir is None:
        return None
    directory = checkpoint_dir(run_dir)
    steps: tuple[int, ...] = ()
    meta: dict[str, Any] = {}
    items: dict[str, Any] = {}
    if directory.is_dir():
        with CheckpointManager(directory, async_save=False) as manager:
            steps = manager.all_steps()
            if steps and resume:
                try:
                    meta = manager.restore(steps[-1], json=["meta"])["meta"]
                except FileNotFoundError as error:
                    raise ValueError(
                        f"checkpoint {steps[-1]} in {directory} has no meta item, so the run "
                        "cannot be resumed; start a new run directory"
                    ) from error
                backend = meta.get("backend")
                if backend != config.runtime.backend:
                    raise ValueError(
                        f"checkpoint in {directory} was written by the {backend} backend: "
                        f"resume it with runtime.backend={backend}, or start a new run "
                        "directory"
                    )
                names = [n for n in JSON_ITEMS if n != "meta"]
                items = manager.restore(steps[-1], json=names)
    if not steps or not resume:
        if resume:  # nothing to resume from: another run there is refused (rundirs)
            claim_without_checkpoint(run_dir, config.to_dict())
            return None
        holds_run = (run_dir / "trace.jsonl").exists() or (
            directory.is_dir() and any(directory.iterdir())
        )
        if not holds_run:
            return None
        raise ValueError(
            f"run_dir {run_dir} already holds a run and resume=False: give a new run "
            "directory, or resume=True to continue it"
        )
    if config.runtime.mode == "concurrent":
        raise ValueError(
            f"run_dir {run_dir} holds checkpoints; runtime.mode=concurrent cannot resume "
            "them (use runtime.mode=deterministic, or a new run directory)"
        )
    # Format and config now; parameter shapes once the model is built.
    check_compatible(meta, str(directory), config.to_dict(), meta["shapes"])
    check_plan(directory, items["faults"].get("plan", []), plan)
    return ResumePoint(directory, meta, items)


def continue_files(run_dir: Path, point: ResumePoint) -> dict[str, Any]:
    """Cuts trace.jsonl back to checkpoint ``point`` for a resumed run and rewrites
    metrics.jsonl from its history, atomically.

    The trace keeps the ``meta["trace_events"]`` events written up to the checkpoint, the
    trainer's ``checkpoint_save`` of its step and the stopped run's ``run_end`` (its
    summary, when it stopped cleanly); the other events after the checkpoint go, since
    the resumed run takes those steps again.

    Returns ``offset_s`` (where the resumed run's clock starts: after the last event of
    the run that stopped, so the lost time shows as a gap), ``lost_steps`` and
    ``lost_train_s`` (the train steps taken after the checkpoint) and ``events`` (the
    trace's length now).
    """
    meta, path = point.meta, run_dir / "trace.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    count = meta.get("trace_events", len(lines))
    kept = lines[:count]
    offset_s, lost_steps, lost_train_s = meta["clock_s"], 0, 0.0
    for line in lines[count:]:
        try:
            event = json.loads(line)
            offset_s = max(offset_s, float(event["t"]))
        except (ValueError, KeyError, TypeError):
            continue  # A line cut short when the process died.
        kind = event.get("kind")
        if kind == "run_end" or (kind == "checkpoint_save" and event.get("step") == meta["step"]):
            kept.append(line)
        elif kind == "train_step":
            lost_steps += 1
            lost_train_s += float(event.get("duration_s", 0.0))
    if len(kept) != len(lines):
        replace_lines(path, kept)
    replace_lines(run_dir / "metrics.jsonl", [json.dumps(row) for row in point.items["history"]])
    return {
        "offset_s": offset_s,
        "lost_steps": lost_steps,
        "lost_train_s": lost_train_s,
        "events": len(kept),
    }


def encode(
    *,
    config: RunConfig,
    books: RunBooks,
    controller: PromptController,
    buffer: RolloutBuffer,
    fleet: FleetCheckpoint,
    faults: Mapping[str, object],
    published: int,
    weights: dict[int, object],
    shapes: dict[str, list],
    clock_s: float,
    trace_events: int,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The JSON items and the ``weights`` item of a checkpoint of ``books.version``.

    Args:
        weights: version -> params of every version a restore needs besides the train
            state's own (the published one, the replay logs', a held-back push).
        shapes: ``param_shapes`` of the params (checked before a restore).
        clock_s: the trace's clock now (a resumed run's clock goes on from it).
        trace_events: events trace.jsonl holds now.
    """
    meta = {
        "format": FORMAT,
        "backend": config.runtime.backend,
        "config": config.to_dict(),
        "shapes": shapes,
        **books.state_dict(),
        "clock_s": clock_s,
        "trace_events": trace_events,
        "published_version": published,
        "weights": sorted(weights),
    }
    items = {
        "meta": meta,
        "controller": controller.state_dict(),
        "buffer": buffer.state_dict(),
        "workers": fleet.workers,
        "fleet": fleet.books,
        "faults": faults,
        "history": books.history,
        "extra": books.extra,
    }
    arrays = {weights_key(v): params for v, params in weights.items()} or None
    return items, arrays


def read_weights(point: ResumePoint, template: object) -> dict[int, object]:
    """The ``weights`` item of ``point`` as ``version -> params`` shaped like
    ``template`` (abstract params)."""
    versions = point.meta["weights"]
    if not versions:
        return {}
    like = {weights_key(v): template for v in versions}
    with CheckpointManager(point.directory, async_save=False) as manager:
        saved = manager.restore(point.step, pytrees={"weights": like})["weights"]
    return {v: saved[weights_key(v)] for v in versions}
