"""Run directories are owned by one run: what a job may do with the directory it is given.

A directory holds one run's files (``config.yaml`` or ``scenario.yaml``, ``metrics.jsonl``,
``trace.jsonl``, ``checkpoints/``, ``summary.json``, ``final/``, ``plots/``). A second job
given the same directory either continues that run or is refused; it never appends a second
run to the first one's files. The rule (:func:`claim_run_dir`):

- an empty or new directory, or one holding only warm-start caches: a fresh run;
- the same config, finished (``summary.json`` without ``preempted`` or a failed
  ``status``): nothing to do, the job says so;
- the same config, stopped with a checkpoint: resumed from it;
- the same config, stopped before its first RL step (in the warm start, say): started
  again (its warm-start cache stays);
- anything else (another config, a simulated run where a real one would go or the other
  way round, a run stopped before its first checkpoint): refused, naming the choices:
  ``resume`` (continue the directory's run with its own config), ``new`` (a fresh
  directory beside it) and ``overwrite`` (delete the run's files, keep warm-start caches).

``Experiment(run_dir=...)`` follows the same rule (:func:`claim_without_checkpoint`): it
resumes from a checkpoint when there is one, and otherwise refuses a directory that holds
another run, or a finished one, in one line naming its choices from Python.

>>> import tempfile
>>> claim_run_dir(Path(tempfile.mkdtemp()) / "run", "run", {"steps": 3}).action
'fresh'
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

Choice = Literal["auto", "resume", "new", "overwrite"]
Kind = Literal["run", "simulated"]
CONFIG_FILE: dict[Kind, str] = {"run": "config.yaml", "simulated": "scenario.yaml"}
# What a run writes; ``overwrite`` deletes these and leaves the rest (warm-start caches).
RUN_FILES = (
    "config.yaml",
    "scenario.yaml",
    "metrics.jsonl",
    "trace.jsonl",
    "trace.jsonl.gz",
    "summary.json",
    "run.perfetto.json",
    "checkpoints",
    "final",
    "plots",
    "tensorboard",
    "mlruns",
    "wandb",
)
CHOICES = (
    "--resume (continue the run in it, with its own config), --new (write to a fresh "
    "directory beside it) or --overwrite (delete its run files; warm-start caches stay)"
)


@dataclass(frozen=True)
class Claim:
    """What a job does with its run directory.

    Attributes:
        run_dir: where the job writes (``new`` picks a fresh one beside the given one).
        action: ``fresh`` (nothing of a run there), ``resume`` (continue the run
            there from its checkpoint) or ``finished`` (that run is done: nothing to do).
        message: a line for the user, or ``""``.
    """

    run_dir: Path
    action: Literal["fresh", "resume", "finished"]
    message: str = ""


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds any run's files (a warm-start cache alone is not a run)."""
    return run_dir.is_dir() and any((run_dir / name).exists() for name in RUN_FILES)


def saved_config(run_dir: Path, kind: Kind) -> dict[str, Any] | None:
    """The config (``kind="run"``) or scenario saved in ``run_dir``, as a mapping."""
    path = run_dir / CONFIG_FILE[kind]
    if not path.is_file():
        return None
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else None


def differences(saved: object, given: object, path: str = "") -> list[str]:
    """Dotted paths where two config mappings differ.

    >>> differences({"a": {"b": 1, "c": 2}, "d": 3}, {"a": {"b": 1, "c": 5}, "d": 4})
    ['a.c', 'd']
    """
    if isinstance(saved, Mapping) and isinstance(given, Mapping):
        out: list[str] = []
        for key in sorted(set(saved) | set(given), key=str):
            out += differences(saved.get(key), given.get(key), f"{path}{key}.")
        return out
    return [] if saved == given else [path.rstrip(".")]


def run_status(run_dir: Path) -> tuple[str, dict[str, Any]]:
    """``("finished" | "failed" | "stopped" | "unfinished", summary)`` of a run directory:
    ``stopped`` is a run preempted by a signal, ``unfinished`` one with no summary yet."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return "unfinished", {}
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return "unfinished", {}
    if summary.get("status") == "failed":
        return "failed", summary
    if summary.get("preempted"):
        return "stopped", summary
    return "finished", summary


def fresh_beside(run_dir: Path) -> Path:
    """``RUN-2``, ``RUN-3``, ...: the first of them that holds no run."""
    for i in range(2, 10_000):
        candidate = run_dir.with_name(f"{run_dir.name}-{i}")
        if not holds_run(candidate):
            return candidate
    raise ValueError(f"no free directory beside {run_dir}; give --run-dir")


def delete_run_files(run_dir: Path) -> None:
    """Deletes a run's files from ``run_dir``; other files (warm-start caches) stay."""
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def claim_run_dir(
    run_dir: str | Path,
    kind: Kind,
    config: Mapping[str, object],
    choice: Choice = "auto",
    *,
    has_checkpoint: bool | None = None,
) -> Claim:
    """Decides what a job writing a ``kind`` run with ``config`` does with ``run_dir``
    (see the module's docstring); ``choice`` is the user's ``--resume``/``--new``/
    ``--overwrite`` (``auto``: none given).

    ``config`` is compared with the saved one as ``to_dict`` writes it; ``resume``
    expects the caller to have built ``config`` from the saved one.

    Raises:
        ValueError: the directory holds another run (one line naming the directory,
            why, and the choices), or ``overwrite`` was given for a directory whose files
            are not a run's.
    """
    run_dir = Path(run_dir)
    if not holds_run(run_dir):
        if choice == "resume":
            raise ValueError(f"--resume: {run_dir} holds no run to resume")
        return Claim(run_dir, "fresh")
    if choice == "new":
        fresh = fresh_beside(run_dir)
        return Claim(fresh, "fresh", f"{run_dir} holds a run; this one goes to {fresh}")
    if choice == "overwrite":
        delete_run_files(run_dir)
        return Claim(run_dir, "fresh", f"deleted the run in {run_dir} (--overwrite)")
    other: Kind = "simulated" if kind == "run" else "run"
    if saved_config(run_dir, kind) is None:
        what = (
            f"a {other} run ({CONFIG_FILE[other]})"
            if (run_dir / CONFIG_FILE[other]).exists()
            else f"run files without its {CONFIG_FILE[kind]}"
        )
        raise ValueError(f"run directory {run_dir} holds {what}; choose {CHOICES}")
    changed = differences(saved_config(run_dir, kind), dict(config))
    if changed and choice != "resume":
        shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if changed[4:] else "")
        raise ValueError(
            f"run directory {run_dir} holds a run with another config (it differs at "
            f"{shown}); choose {CHOICES}"
        )
    status, summary = run_status(run_dir)
    if status == "finished":
        steps = summary.get("steps")
        done = f" after {steps} steps" if steps is not None else ""
        return Claim(
            run_dir,
            "finished",
            f"the run in {run_dir} finished{done}; nothing to do (its summary: "
            f"{run_dir / 'summary.json'}; --new or --overwrite to run it again)",
        )
    if kind == "simulated" or has_checkpoint:
        # A simulation is deterministic and short: an unfinished one is run again whole.
        return Claim(run_dir, "resume" if kind == "run" else "fresh")
    reason = f" ({summary['reason']})" if summary.get("reason") else ""
    metrics = run_dir / "metrics.jsonl"
    if not (metrics.is_file() and metrics.stat().st_size):
        delete_run_files(run_dir)  # nothing of it to lose: no step, no checkpoint
        return Claim(
            run_dir,
            "fresh",
            f"the run in {run_dir} stopped before its first step{reason}; starting it again",
        )
    raise ValueError(
        f"run directory {run_dir} holds a {status} run{reason} with no checkpoint to resume "
        "from; choose --new (write to a fresh directory beside it) or --overwrite (delete "
        "its run files and start again)"
    )


def claim_without_checkpoint(run_dir: Path, config: Mapping[str, object]) -> None:
    """The rule for ``Experiment(run_dir=...)`` where ``run_dir`` has no checkpoint to
    resume from: a fresh run if it holds none (or one of ``config`` stopped before its
    first step, whose files go); else refused, since a second run would append its lines
    to the first one's files.

    Raises:
        ValueError: one line naming ``run_dir``, why, and the choices from Python.
    """
    choices = (
        f"give another run_dir (e.g. {fresh_beside(run_dir)}), delete its run files first "
        "(rlaxkit.util.rundirs.delete_run_files), or set checkpoint.every_steps to be able to "
        "resume a run"
    )
    try:
        claim = claim_run_dir(run_dir, "run", config, has_checkpoint=False)
    except ValueError as err:
        raise ValueError(f"{str(err).split('; choose')[0]}; {choices}") from None
    if claim.action == "finished":
        raise ValueError(
            f"run directory {run_dir} holds a finished run of this config with no checkpoint "
            f"to continue from; {choices}"
        )
