"""What a Ray run's checkpoint holds, how it is written, and how a run resumes from it.

The Ray backend keeps its books in the driver (prompt controller, rollout buffer, the
fleet and what each worker holds in flight, goodput and fault books, history) and its
train state in the trainer actor(s). A checkpoint holds both in one Orbax step
directory, ``RUN_DIR/checkpoints/trainer/<step>/``: the driver gathers its books and
hands them to the trainer, which saves them with the train state in one Orbax save.
Orbax writes a step into a temporary directory and renames it when every item is
written, so a checkpoint half written when a process died is never listed and never
resumed from. The items are those of the local backend (``rlaxkit.runtime.state``):

- ``train_state`` (arrays; every trainer process writes its shards).
- ``weights`` (arrays, optional): ``{"v<N>": params}`` for the versions other than
  the train state's that a resume needs: the newest *published* version (pushes every
  ``k`` steps) and the versions the workers' replay logs start from or pulled. The
  driver fetches them from the workers (or the store) and process 0 writes them.
- ``meta`` (JSON): format, ``backend: ray``, step, run config, parameter shapes, the
  loop's round count, the clock, the published version, the saved weight versions,
  the goodput books, and how many trace events the run directory's trace held.
- ``controller``, ``buffer``, ``history``, ``extra`` (JSON): as the local backend's.
- ``workers`` (JSON): per worker actor, in fleet order: its id, the group ids the
  driver knows it holds, and ``InferenceWorker.snapshot()`` (its replay log).
- ``faults`` (JSON): the fleet's books (next worker id, replacements, retired
  counters).

The replay log of batches trained since the last checkpoint is empty at a checkpoint
by definition, so nothing of it is saved.

Resuming (a new ``RayExperiment`` on a run directory with checkpoints) takes the
newest checkpoint: the driver checks it was written for this config (the error names
the field that differs), cuts the trace back to the checkpoint (the steps taken after
it are taken again; the restart event counts them as lost), rewrites metrics.jsonl
from the saved history, starts the same fleet (same worker ids), has the trainer
restore the train state and publish the saved published version, and has every worker
replay its log: the prompts that were in flight are generated again with the same ids
and seeds, up to the decode chunk where the checkpoint found them. In deterministic
mode the resumed run then takes the steps the uninterrupted run would have taken.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from rlaxkit.checkpoint import CheckpointManager
from rlaxkit.config import RunConfig
from rlaxkit.param_server import layout
from rlaxkit.runtime.state import (
    FORMAT,
    JSON_ITEMS,
    check_compatible,
    continue_trace,
    param_shapes,
    read_meta,
    replace_lines,
    weights_key,
)

_GATHER_ATTEMPTS = 3  # Worker deaths while a checkpoint gathers their state.


def checkpoint_dir(run_dir: Path) -> Path:
    """Where a Ray run's checkpoints live."""
    return run_dir / "checkpoints" / "trainer"


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from: its directory, meta and other JSON items."""

    directory: Path
    meta: dict[str, Any]
    items: dict[str, Any]

    @property
    def step(self) -> int:
        return self.meta["step"]


def _holds_run(run_dir: Path) -> bool:
    checkpoints = run_dir / "checkpoints"
    return (run_dir / "trace.jsonl").exists() or (
        checkpoints.is_dir() and any(checkpoints.iterdir())
    )


def find_resume_point(run_dir: Path, config: RunConfig, resume: bool) -> ResumePoint | None:
    """The newest checkpoint in ``run_dir`` to resume from (``None``: a new run).

    Raises:
        ValueError: ``run_dir`` holds a run that cannot be resumed (``resume=False``,
            no Ray checkpoint, a checkpoint without the driver's books), or the
            checkpoint was written for another config (naming the field).
    """
    directory = checkpoint_dir(run_dir)
    steps: tuple[int, ...] = ()
    if directory.is_dir():
        with CheckpointManager(directory, async_save=False) as manager:
            steps = manager.all_steps()
            if steps and resume:
                try:
                    meta = read_meta(manager, steps[-1])
                except FileNotFoundError as error:
                    raise ValueError(
                        f"checkpoint {steps[-1]} in {directory} holds only the trainer's "
                        "state, not the driver's books (an older rlaxkit wrote it), so the "
                        "run cannot be resumed; start a new run directory"
                    ) from error
                names = [n for n in JSON_ITEMS if n != "meta"]
                items = manager.restore(steps[-1], json=names)
    if not steps or not resume:
        if not _holds_run(run_dir):
            return None
        if not resume:
            raise ValueError(
                f"run_dir {run_dir} already holds a run and resume=False: give a new run "
                "directory, or resume=True to continue it"
            )
        local = [p for p in (run_dir / "checkpoints").glob("*") if p.name.isdigit()]
        raise ValueError(
            f"run_dir {run_dir} holds a run (trace.jsonl or checkpoints/) but no Ray "
            f"checkpoint in {directory} to resume from; "
            + (
                "the local backend wrote it: resume it with runtime.backend=local"
                if local
                else "give a new run directory"
            )
        )
    if meta.get("backend") != "ray":
        raise ValueError(
            f"checkpoint in {directory} was not written by the ray backend "
            f"(backend {meta.get('backend')!r}); start a new run directory"
        )
    # Format and config now; parameter shapes once the model is built.
    check_compatible(meta, str(directory), config.to_dict(), meta["shapes"])
    return ResumePoint(directory, meta, items)


def continue_files(run_dir: Path, point: ResumePoint) -> dict[str, Any]:
    """Cuts trace.jsonl back to the checkpoint (``rlaxkit.runtime.state.continue_trace``,
    whose figures it returns) and rewrites metrics.jsonl from its history, atomically."""
    resumed = continue_trace(run_dir / "trace.jsonl", point.meta)
    replace_lines(run_dir / "metrics.jsonl", [json.dumps(row) for row in point.items["history"]])
    return resumed


def clear_weight_store(directory: Path) -> None:
    """Removes a TensorStore store's versions: a resumed run publishes from its
    checkpoint, and versions of the steps after it must not shadow that."""
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        name = entry.name
        if name == layout.POINTER:
            entry.unlink()
        elif layout.parse_dirname(name) is not None or name.startswith(
            (layout.TMP_PREFIX, layout.SPARE_PREFIX)
        ):
            shutil.rmtree(entry, ignore_errors=True)


class RayCheckpointing:
    """Checkpoints and resume of ``RayExperiment`` (uses its trainer group, workers,
    controller, buffer, trace and goodput books)."""

    def save_checkpoint(self) -> bool:
        """Saves the run as checkpoint ``version`` now: the trainer's state and the
        driver's books in one Orbax step (what SIGTERM handling calls). Returns False
        without a ``run_dir`` or when that checkpoint exists already."""
        if self.run_dir is None or self.last_save_step == self.version:
            return False
        for _ in range(_GATHER_ATTEMPTS):
            gathered = self._gather_workers()
            if gathered is not None:
                break
        else:
            raise RuntimeError(
                f"worker actors died {_GATHER_ATTEMPTS} times while checkpoint {self.version} "
                "gathered their state; see their logs"
            )
        snapshots, weights = gathered
        meta = {
            "format": FORMAT,
            "backend": "ray",
            "step": self.version,
            "config": self.config.to_dict(),
            "shapes": param_shapes(self.param_template),
            "rounds": self.rounds,
            "clock_s": self.clock(),
            "published_version": self._published,
            "weights": sorted(weights),
            "useful_train_s": list(self.useful_train_s),
            "lost_train_s": self.lost_train_s,
            "lost_steps": self.lost_steps,
            "trace_events": self.trace.written,
        }
        books = {
            "meta": meta,
            "controller": self.controller.state_dict(),
            "buffer": self.buffer.state_dict(),
            "workers": [
                {
                    "worker_id": slot.worker_id,
                    "in_flight": sorted(slot.in_flight),
                    "snapshot": snapshots[slot.worker_id],
                }
                for slot in self.workers
            ],
            "faults": {
                "next_worker": self._next_worker,
                "replacements": self._replacements,
                "retired_tokens": self._retired_tokens,
                "retired_failed_pulls": self._retired_failed_pulls,
            },
            "history": self.history,
            "extra": self.extra,
        }
        arrays = {weights_key(v): params for v, params in weights.items()} or None
        reply = self._trainer("save_checkpoint", self.version, books, arrays)
        self.trace.extend(reply["events"])
        self._replay = [(s, b) for s, b in self._replay if s > self.version]
        self.last_save_step, self.last_save_s = self.version, self.clock()
        return reply["saved"]

    def _gather_workers(self) -> tuple[dict[str, Any], dict[int, Any]] | None:
        """Every worker's snapshot and the host weights their replay logs and the
        published version need (the train state's own excepted); ``None`` when a
        worker died meanwhile (it was replaced and its prompts re-queued: try again)."""
        replies = self._call_workers("checkpoint", {})
        if any(slot.worker_id not in replies for slot in self.workers):
            return None
        sources: dict[int, str | None] = {}  # version -> a worker that holds it
        for slot in self.workers:
            for version in replies[slot.worker_id]["versions"]:
                sources.setdefault(version, slot.worker_id)
        sources.setdefault(self._published, None)
        sources.pop(self.version, None)
        wanted: dict[str, list[int]] = {}
        for version, worker_id in sorted(sources.items()):
            if worker_id is not None:
                wanted.setdefault(worker_id, []).append(version)
        fetched = self._call_workers(
            "replay_weights", {w: (v,) for w, v in wanted.items()}, only=list(wanted)
        )
        if any(worker_id not in fetched for worker_id in wanted):
            return None
        weights = {v: params for reply in fetched.values() for v, params in reply.items()}
        if self._published in sources and self._published not in weights:
            self._ensure_published()
            version, params = self.param_server.pull()
            if version != self._published:
                raise RuntimeError(
                    f"the parameter server holds version {version}, the driver published "
                    f"{self._published}: cannot checkpoint the published weights"
                )
            weights[version] = jax.device_get(params)
        snapshots = {w: reply["snapshot"] for w, reply in replies.items()}
        return snapshots, weights

    def _resume(self, point: ResumePoint) -> None:
        """Loads the driver's books from ``point``, restores the trainer and replays
        every worker's log (the fleet was started with the saved worker ids)."""
        meta, items, step = point.meta, point.items, point.step
        check_compatible(
            meta, str(point.directory), self.config.to_dict(), param_shapes(self.param_template)
        )
        weights: dict[int, Any] = {}
        if meta["weights"]:
            like = {weights_key(v): self.param_template for v in meta["weights"]}
            with CheckpointManager(point.directory, async_save=False) as manager:
                saved = manager.restore(step, pytrees={"weights": like})["weights"]
            weights = {v: jax.device_get(saved[weights_key(v)]) for v in meta["weights"]}
        self.version, self.rounds = step, meta["rounds"]
        self.last_save_step, self.last_save_s = step, self.clock()
        self.useful_train_s = list(meta["useful_train_s"])
        self.lost_train_s += meta["lost_train_s"]
        self.lost_steps += meta["lost_steps"]
        self.controller.load_state_dict(items["controller"])
        self.buffer.load_state_dict(items["buffer"])
        self.history = list(items["history"])
        self.extra = dict(items["extra"])
        fleet = items["faults"]
        self._next_worker, self._replacements = fleet["next_worker"], fleet["replacements"]
        self._retired_tokens = fleet["retired_tokens"]
        self._retired_failed_pulls = fleet["retired_failed_pulls"]
        published = meta["published_version"]
        restored = self._trainer(
            "restore", step, (published, weights[published]) if published != step else None
        )
        if restored != step:
            raise RuntimeError(
                f"the trainer restored step {restored}, not the checkpoint's step {step}"
            )
        work: dict[str, tuple] = {}
        for slot, saved in zip(self.workers, items["workers"], strict=True):
            snapshot = saved["snapshot"]
            submitted = [op[1] for op in snapshot["ops"] if op[0] == "s"]
            issues = {}
            for group_id in submitted:
                issue = self.controller.issue_for(group_id)
                issues[group_id] = (issue, self.problems[issue.problem_index])
            versions = {op[1] for op in snapshot["ops"] if op[0] == "u"}
            if snapshot["base_version"] is not None:
                versions.add(snapshot["base_version"])
            if step in versions and step not in weights:  # the train state's own
                weights[step] = self._trainer("host_params", step)
            slot.in_flight = {g: self.controller.issue_for(g) for g in saved["in_flight"]}
            slot.generated_tokens = snapshot["generated_tokens"]
            slot.failed_pulls = snapshot["failed_pulls"]
            work[slot.worker_id] = (snapshot, issues, {v: weights[v] for v in versions})
        replies = self._call_workers("restore", work)
        for slot in self.workers:
            if slot.worker_id in replies:
                self.trace.extend(replies[slot.worker_id]["events"])
        reply = self._trainer("publish", step)
        self.trace.extend(reply["events"])
        self._published = reply["version"]
        self.resumed_from = step
