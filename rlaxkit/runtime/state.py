"""What an RL-state checkpoint holds, and the checks made before Orbax reads one.

A run's checkpoints live in ``RUN_DIR/checkpoints/<step>/`` (``rlaxkit.checkpoint.
CheckpointManager``: Orbax, atomic, newest ``CheckpointPolicy.keep`` kept). Items:

- ``train_state`` (arrays): the ``TrainState`` (params, optimizer, step, RNG key).
- ``weights`` (arrays, optional): ``{"v<N>": params}`` for weight versions other than
  the train state's that a restore needs: the newest *published* version (pushes every
  ``k`` steps) and the versions the workers' replay logs start from.
- ``meta`` (JSON): format, step, the run config, parameter shapes and dtypes, the fault
  clock (``rounds``), the last save's step and time, wall seconds so far, the goodput
  books, the published version and the parameter-server lineage.
- ``controller`` (JSON): ``PromptController.state_dict()`` (prompt cursor; the RNG
  streams are pure functions of the seed and the issue number).
- ``buffer`` (JSON): ``RolloutBuffer.state_dict()`` (buffered-but-untrained rollouts,
  in-flight prompt ids, trained and dropped books).
- ``workers`` (JSON): ``InferenceWorker.snapshot()`` per worker: the metadata of the
  prompts in flight (re-issued on restore by replaying the worker's log).
- ``faults`` (JSON): fired faults, downtimes, parameter-server outage.
- ``history`` (JSON): every step's metrics, so a resumed run's history is complete.
- ``extra`` (JSON): the caller's (``rlaxkit train`` keeps its evaluations here).

A backend other than the local one can save the same items with its own parts
(the Ray backend does: ``rlaxkit.runtime.ray_state``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax

FORMAT = 1
PYTREE_ITEMS = ("train_state", "weights")
JSON_ITEMS = ("meta", "controller", "buffer", "workers", "faults", "history", "extra")
# Fields that may change between a save and a resume: how long to run, how to evaluate,
# when to checkpoint, where Ray would place actors (the local backend ignores it).
# Everything else shapes the RL state and must match.
RESUMABLE_FIELDS = ("steps", "eval", "checkpoint", "ray")


def param_shapes(tree: Any) -> dict[str, list]:
    """``{path: [shape, dtype]}`` of every leaf (compared before a restore)."""
    return {
        jax.tree_util.keystr(path): [list(leaf.shape), str(leaf.dtype)]
        for path, leaf in jax.tree.leaves_with_path(tree)
    }


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out |= _flatten(value, f"{prefix}{key}.")
        return out
    return {prefix[:-1]: data}


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted config fields that differ, ``RESUMABLE_FIELDS`` excepted."""
    old, new = _flatten(saved), _flatten(current)
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


def check_plan(manager: Any, plan: Any, step: int | None = None) -> None:
    """Raises ``ValueError`` when checkpoint ``step`` was written under another plan."""
    saved = manager.restore(step, json=["faults"])["faults"]["plan"]
    if saved != plan.to_dicts():
        raise ValueError(
            f"faults: the checkpoint in {manager.directory} was written with another fault "
            f"plan ({len(saved)} faults; this run has {len(plan)}); resume with the same "
            "--faults plan or start a new run directory"
        )


def weights_key(version: int) -> str:
    """Key of a weight version in the ``weights`` item."""
    return f"v{version}"


def save_experiment(exp: Any, *, force: bool = False) -> bool:
    """Saves the local ``Experiment``'s RL state as checkpoint ``exp.version``.

    Returns whether a save started (``False`` when that step is already saved, or when
    the experiment has no run directory).
    """
    manager = exp.checkpoints
    if manager is None or exp.version in manager.all_steps():
        return False
    start = exp.clock()
    published = exp.param_server.latest_version()
    needed: dict[int, Any] = {}
    for worker in exp.workers:
        needed |= worker.replay_weights()
    if published is not None and published != exp.version:
        needed[published] = exp.param_server.store.pull()[1]
    if exp.param_server.pending is not None:
        needed[exp.param_server.pending[0]] = exp.param_server.pending[1]
    needed.pop(exp.version, None)  # the train state's own params
    meta = {
        "format": FORMAT,
        "step": exp.version,
        "config": exp.config.to_dict(),
        "shapes": param_shapes(exp.state),
        "rounds": exp.rounds,
        "last_save_s": exp.fault_now(),
        "clock_s": exp.trace.offset_s + exp.clock(),  # the trace's time, resumes included
        "trace_events": exp.trace.written,
        "published_version": published,
        "weights": sorted(needed),
        "useful_train_s": list(exp.useful_train_s),
        "lost_train_s": exp.lost_train_s,
        "lost_steps": exp.lost_steps,
        "reward_counters": dict(exp.scorer.counters),
        "hangs_pending": exp.scorer.hangs_pending,
    }
    pytrees = {"train_state": exp.state}
    if needed:
        pytrees["weights"] = {weights_key(v): p for v, p in needed.items()}
    json = {
        "meta": meta,
        "controller": exp.controller.state_dict(),
        "buffer": exp.buffer.state_dict(),
        "workers": [w.snapshot() for w in exp.workers],
        "faults": {**exp.faults.state_dict(), "param_server": exp.param_server.state_dict()},
        "history": exp.history,
        "extra": exp.extra,
    }
    manager.save(exp.version, pytrees=pytrees, json=json, force=True)
    if force:
        manager.wait()
    exp.last_save_step, exp.last_save_s = exp.version, exp.fault_now()
    exp.trained_since_save.clear()
    exp.trace.record(
        exp.clock(),
        "checkpoint_save",
        "trainer",
        exp.version,
        step=exp.version,
        duration_s=exp.clock() - start,
    )
    return True


def continue_trace(path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Cuts the trace file ``path`` back to checkpoint ``meta`` for a resumed run.

    Keeps the ``meta["trace_events"]`` events written up to the checkpoint, the
    trainer's ``checkpoint_save`` of its step and the stopped run's ``run_end`` (its
    summary, when it stopped cleanly); the other events after the checkpoint go, since
    the resumed run takes those steps again. The file is replaced atomically. A checkpoint that
    predates the count keeps the whole file.

    Returns ``offset_s`` (where the resumed run's clock starts: after the last event of
    the run that stopped, so the lost time shows as a gap), ``lost_steps`` and
    ``lost_train_s`` (the train steps taken after the checkpoint) and ``events`` (the
    trace's length now).
    """
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
    return {
        "offset_s": offset_s,
        "lost_steps": lost_steps,
        "lost_train_s": lost_train_s,
        "events": len(kept),
    }


def replace_lines(path: Path, lines: list[str]) -> None:
    """Writes ``lines`` to ``path`` atomically (a scratch file, then a rename)."""
    scratch = path.with_name(path.name + ".tmp")
    scratch.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(scratch, path)


def read_meta(manager: Any, step: int | None = None) -> dict[str, Any]:
    """The ``meta`` item of checkpoint ``step`` (default: the latest)."""
    return manager.restore(step, json=["meta"])["meta"]


def load_train_state(exp: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """The train state and meta of checkpoint ``step``, after checking they fit ``exp``."""
    manager = exp.checkpoints
    manager.wait()
    meta = read_meta(manager, step)
    check_compatible(meta, str(manager.directory), exp.config.to_dict(), param_shapes(exp.state))
    from rlaxkit.checkpoint import abstract_tree

    state = manager.restore(meta["step"], pytrees={"train_state": abstract_tree(exp.state)})
    return state["train_state"], meta


def restore_experiment(exp: Any, step: int | None = None) -> dict[str, Any]:
    """Loads checkpoint ``step`` (default: the latest) into a freshly built experiment.

    Restores everything ``save_experiment`` wrote: afterwards the experiment continues
    exactly as the saved one would have (deterministic mode). Returns the meta item.

    Raises:
        ValueError: the checkpoint is for another config or model shape, or another
            fault plan.
    """
    state, meta = load_train_state(exp, step)
    manager = exp.checkpoints
    step = meta["step"]
    names = [n for n in JSON_ITEMS if n != "meta"]
    items = manager.restore(step, json=names)
    weights: dict[int, Any] = {step: state.params}
    if meta["weights"]:
        like = {weights_key(v): exp.state.params for v in meta["weights"]}
        from rlaxkit.checkpoint import abstract_tree

        saved = manager.restore(step, pytrees={"weights": abstract_tree(like)})["weights"]
        weights |= {v: saved[weights_key(v)] for v in meta["weights"]}
    exp.state, exp.version = state, step
    exp.faults.load_state_dict({k: v for k, v in items["faults"].items() if k != "param_server"})
    exp.param_server.load_state_dict(items["faults"]["param_server"], weights.__getitem__)
    published = meta["published_version"]
    exp.param_server.rollback(published, weights[published])
    exp.param_server.lineage = items["faults"]["param_server"]["lineage"]
    exp.controller.load_state_dict(items["controller"])
    exp.buffer.load_state_dict(items["buffer"])
    for worker, snapshot in zip(exp.workers, items["workers"], strict=True):
        worker.restore(
            snapshot,
            issue_for=exp.controller.issue_for,
            problem_for=lambda issue: exp.problems[issue.problem_index],
            weights_for=weights.__getitem__,
        )
    exp.rounds = meta["rounds"]
    exp.last_save_step, exp.last_save_s = step, meta["last_save_s"]
    exp.useful_train_s = list(meta["useful_train_s"])
    exp.lost_train_s, exp.lost_steps = meta["lost_train_s"], meta["lost_steps"]
    exp.scorer.counters.update(meta["reward_counters"])
    exp.scorer.hangs_pending = meta["hangs_pending"]
    exp.history = list(items["history"])
    exp.extra = dict(items["extra"])
    return meta
