"""Where a run's metrics go: ``metrics.jsonl`` always, and the trackers ``tracking`` names.

``RunConfig.tracking`` lists them (``--set 'tracking=[jsonl,tensorboard]'``):

========================  ==========================================  ===================
name                      writes under the run directory               pip extra
========================  ==========================================  ===================
``jsonl`` (always on)     ``metrics.jsonl`` (``MetricsLogger``)        none
``tensorboard``           ``tensorboard/events.out.tfevents.*``        ``rlaxkit[tensorboard]``
``wandb``                 ``wandb/`` (offline, or synced online)       ``rlaxkit[wandb]``
``mlflow``                ``mlflow.db`` (a local SQLite store)         ``rlaxkit[mlflow]``
========================  ==========================================  ===================

Each tracker gets every step's metrics (numbers only), the staleness histogram of the
step's batch, held-out evaluations (``eval/pass_at_<k>`` at the step they were taken),
the resolved config once and the run's summary when it closes. Drop
reasons are among the step metrics (``dropped/<reason>``, cumulative) and the summary
(``buffer/dropped_by_reason/<reason>``).

Resuming: ``tracking.json`` in the run directory keeps the W&B run id and the MLflow run
id, so a run resumed from a checkpoint logs into the same tracker run; TensorBoard writes
a new event file into the same directory. The steps after the checkpoint are taken
again, and when the trainer restores a checkpoint mid-run (``Loop.roll_back``) the steps
after it are too. ``metrics.jsonl`` is rewritten to the surviving steps; of the external
trackers only TensorBoard can forget: its new event file starts with a ``SessionLog``
``START`` at the first re-done step (tensorboardX's ``purge_step``), and TensorBoard
hides the older events from that step on. W&B and MLflow cannot un-log, so in a run that
checkpoints (or has a fault plan) they get a step only once a checkpoint has committed it
(``Trackers.commit``; every step at the end of a run that has them all): each step shows
once, however often it was taken, and they lag the run by at most the steps between
checkpoints. A crashed run is marked failed (MLflow ``FAILED``, W&B exit code 1, a
``status`` text in TensorBoard).
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

import numpy as np
import yaml

from rlaxkit.observe.metrics import MetricsLogger

TrackerName = Literal["jsonl", "tensorboard", "wandb", "mlflow"]

# What each tracker imports, and the extra of pyproject.toml that installs it.
REQUIREMENTS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "jsonl": ((), None),
    "tensorboard": (("tensorboardX",), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
    "mlflow": (("mlflow", "sqlalchemy", "alembic"), "mlflow"),
}
IDS_FILE = "tracking.json"  # the W&B and MLflow run ids, for a resumed run


def check_tracking(names: Sequence[str]) -> None:
    """Raises ``ValueError`` naming ``tracking`` for an unknown or repeated tracker, or
    one whose package is not installed (found without importing it).

    >>> check_tracking(["jsonl"])
    >>> check_tracking(["jsonl", "neptune"])
    Traceback (most recent call last):
    ...
    ValueError: tracking: unknown tracker 'neptune'; one of ['jsonl', 'tensorboard', ...]
    """
    allowed = list(get_args(TrackerName))
    for name in names:
        if name not in REQUIREMENTS:
            raise ValueError(f"tracking: unknown tracker {name!r}; one of {allowed}")
    repeated = sorted(name for name, n in Counter(names).items() if n > 1)
    if repeated:
        raise ValueError(f"tracking: {repeated} named more than once")
    for name in names:
        modules, extra = REQUIREMENTS[name]
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            raise ValueError(
                f"tracking: {name} needs {', '.join(missing)}, which is not installed; "
                f"pip install 'rlaxkit[{extra}]' (or 'rlaxkit[tracking]' for every tracker), "
                f"or take {name!r} out of tracking"
            )


def check_run_dir(names: Sequence[str], run_dir: Path | None) -> None:
    """External trackers write under the run directory: refuse them without one."""
    external = [name for name in names if name != "jsonl"]
    if external and run_dir is None:
        raise ValueError(
            f"tracking: {external} write under the run directory; give the run a run_dir "
            "or set tracking=[jsonl]"
        )


class Tracker(Protocol):
    """An external experiment tracker (``TensorBoardTracker``, ``WandbTracker``,
    ``MlflowTracker``). ``Trackers`` calls it; steps may come again after ``rewind`` to
    one that ``forgets`` (hides what it was given after the rewound step); one that does
    not is given only the steps a checkpoint has committed."""

    forgets: bool

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_histogram(self, step: int, name: str, counts: Mapping[int, int]) -> None:
        """A histogram over integers (staleness in versions): value → count."""

    def log_config(self, config: Mapping[str, object]) -> None: ...

    def log_summary(self, summary: Mapping[str, object]) -> None: ...

    def rewind(self, step: int) -> None:
        """The run went back to ``step``: the steps after it will be logged again."""

    def close(self, failed: bool = False) -> None:
        """Ends the tracker's run, marked failed when ``failed`` (the run crashed)."""


def flatten(data: Mapping[str, object], sep: str = "/", prefix: str = "") -> dict[str, object]:
    """Nested mappings as one level of ``sep``-joined keys.

    >>> flatten({"buffer": {"dropped": 2, "by": {"stale": 1}}, "steps": 3})
    {'buffer/dropped': 2, 'buffer/by/stale': 1, 'steps': 3}
    """
    out: dict[str, object] = {}
    for key, value in data.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out |= flatten(value, sep, name)
        else:
            out[name] = value
    return out


def numbers(metrics: Mapping[str, object]) -> dict[str, float]:
    """The entries that are numbers (ints, floats, bools and 0-d arrays), as floats."""
    out = {}
    for key, value in metrics.items():
        if hasattr(value, "item") and getattr(value, "size", 0) == 1:
            value = value.item()
        if isinstance(value, int | float):
            out[key] = float(value)
    return out


class TensorBoardTracker:
    """Event files in ``logdir`` (tensorboardX). Every open starts a new event file
    whose first event purges the steps from ``purge_step`` on (TensorBoard hides them)."""

    forgets = True

    def __init__(self, logdir: Path, purge_step: int | None = None):
        self.logdir = logdir
        self._last_step = 0
        self._open(purge_step)

    def _open(self, purge_step: int | None) -> None:
        from tensorboardX import SummaryWriter

        # Event files are named by the second they were opened: a suffix keeps a
        # reopening within the same second from overwriting the last file.
        session = len(list(self.logdir.glob("events.out.tfevents.*")))
        self._writer = SummaryWriter(
            str(self.logdir), purge_step=purge_step, flush_secs=30, filename_suffix=f".{session}"
        )

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self._last_step = step
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)

    def log_histogram(self, step: int, name: str, counts: Mapping[int, int]) -> None:
        values = sorted(counts)
        if not values:
            return
        every = range(values[0], values[-1] + 1)  # a bucket per integer: (v - 0.5, v + 0.5]
        self._writer.add_histogram_raw(
            name,
            min=values[0],
            max=values[-1],
            num=sum(counts.values()),
            sum=sum(v * n for v, n in counts.items()),
            sum_squares=sum(v * v * n for v, n in counts.items()),
            bucket_limits=[v + 0.5 for v in every],
            bucket_counts=[counts.get(v, 0) for v in every],
            global_step=step,
        )

    def log_config(self, config: Mapping[str, object]) -> None:
        text = yaml.safe_dump(dict(config), sort_keys=False)
        self._writer.add_text("config", f"```yaml\n{text}```", 0)

    def log_summary(self, summary: Mapping[str, object]) -> None:
        flat = flatten(summary)
        for key, value in numbers(flat).items():
            self._writer.add_scalar(f"summary/{key}", value, self._last_step)
        text = json.dumps(flat, indent=2, default=str)
        self._writer.add_text("summary", f"```json\n{text}\n```", self._last_step)

    def rewind(self, step: int) -> None:
        self._writer.close()
        self._open(purge_step=step + 1)

    def close(self, failed: bool = False) -> None:
        if failed:  # TensorBoard has no run status: a text says so
            self._writer.add_text("status", "failed", self._last_step)
        self._writer.close()


class WandbTracker:
    """A Weights & Biases run in ``run_dir/wandb``, continued when ``run_id`` is given.

    ``WANDB_MODE=offline`` keeps it on disk (``wandb sync`` uploads it later);
    ``WANDB_PROJECT`` names the project (default ``rlaxkit``). Every metric is plotted
    against ``step`` (``define_metric``). It cannot un-log, so ``Trackers`` gives it
    only committed steps; a crashed run finishes with exit code 1 (failed)."""

    forgets = False

    def __init__(self, run_dir: Path, run_id: str | None, name: str):
        import wandb

        self._wandb = wandb
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "rlaxkit"),
            dir=str(run_dir),
            name=name,
            id=run_id or secrets.token_hex(4),
            resume="allow",
            reinit="create_new",
            settings=wandb.Settings(console="off"),  # our stdout stays ours
        )
        self.run_id: str = self._run.id
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log({**metrics, "step": step})

    def log_histogram(self, step: int, name: str, counts: Mapping[int, int]) -> None:
        values = sorted(counts)
        if not values:
            return
        every = range(values[0], values[-1] + 1)
        edges = np.arange(values[0], values[-1] + 2) - 0.5
        bins = np.array([counts.get(v, 0) for v in every])
        histogram = self._wandb.Histogram(np_histogram=(bins, edges))
        self._run.log({name: histogram, "step": step})

    def log_config(self, config: Mapping[str, object]) -> None:
        self._run.config.update(dict(config), allow_val_change=True)

    def log_summary(self, summary: Mapping[str, object]) -> None:
        flat = flatten(summary)
        self._run.summary.update({k: v for k, v in flat.items() if v is not None})

    def rewind(self, step: int) -> None:
        pass  # W&B cannot un-log: it was given no step after the checkpoint (Trackers)

    def close(self, failed: bool = False) -> None:
        self._run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    """An MLflow run in a SQLite store at ``run_dir/mlflow.db`` (or the server that
    ``MLFLOW_TRACKING_URI`` names), continued when ``run_id`` is given.

    MLflow has no histogram type: a histogram is logged as ``<name>/count/<value>``
    metrics. Params cannot change once logged: a resumed run logs only new fields.
    Metrics cannot be deleted either, so ``Trackers`` gives it only committed steps; a
    crashed run ends ``FAILED``."""

    forgets = False

    def __init__(self, run_dir: Path, run_id: str | None, name: str):
        from mlflow.tracking import MlflowClient

        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or (
            f"sqlite:///{run_dir / 'mlflow.db'}"
        )
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        self._last_step = 0
        self._values: dict[str, set[int]] = {}  # histogram values logged, by name
        if run_id is None:
            experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "rlaxkit")
            experiment = self._client.get_experiment_by_name(experiment_name)
            experiment_id = (
                experiment.experiment_id
                if experiment
                else self._client.create_experiment(
                    experiment_name, artifact_location=(run_dir / "mlflow-artifacts").as_uri()
                )
            )
            run_id = self._client.create_run(experiment_id, run_name=name).info.run_id
        else:
            self._client.update_run(run_id, status="RUNNING")
        self.run_id: str = run_id

    def _log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        rows = [Metric(key, value, now_ms, step) for key, value in metrics.items()]
        for start in range(0, len(rows), 1000):  # MLflow's limit per batch
            self._client.log_batch(self.run_id, metrics=rows[start : start + 1000])

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self._last_step = step
        self._log(step, metrics)

    def log_histogram(self, step: int, name: str, counts: Mapping[int, int]) -> None:
        # Every value seen so far gets a count (0 if none), so the latest value of each
        # ``count`` metric is the latest histogram's.
        seen = self._values.setdefault(name, set())
        seen |= set(counts)
        self._log(step, {f"{name}/count/{v}": float(counts.get(v, 0)) for v in sorted(seen)})

    def log_config(self, config: Mapping[str, object]) -> None:
        from mlflow.entities import Param

        logged = self._client.get_run(self.run_id).data.params
        params = [
            Param(key, str(value)[:6000])  # MLflow's longest param value
            for key, value in flatten(config, sep=".").items()
            if key not in logged
        ]
        for start in range(0, len(params), 100):  # MLflow's limit per batch
            self._client.log_batch(self.run_id, params=params[start : start + 100])

    def log_summary(self, summary: Mapping[str, object]) -> None:
        flat = flatten(summary)
        self._log(self._last_step, {f"summary/{k}": v for k, v in numbers(flat).items()})
        for key, value in flat.items():
            if isinstance(value, str):
                self._client.set_tag(self.run_id, f"summary/{key}", value)

    def rewind(self, step: int) -> None:
        pass  # MLflow cannot un-log: it was given no step after the checkpoint (Trackers)

    def close(self, failed: bool = False) -> None:
        self._client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


class Trackers:
    """The fan-out the loop logs to: ``metrics.jsonl`` and the progress bar
    (``MetricsLogger``) and each external tracker.

    A run that can go back to a checkpoint (``hold``: it checkpoints, or a fault plan
    may restore one) gives the trackers that cannot forget (W&B, MLflow) a step only once
    a checkpoint has committed it (``commit``), so that a re-done step shows once; the
    rest wait here and are dropped by a ``roll_back`` past them. A run that ends with
    all its steps gives them everything; one that stops short, or crashes, does not give
    them what a resume will do again.

    Args:
        jsonl: the run's ``MetricsLogger``.
        trackers: the external trackers, by name.
        hold: whether to hold back uncommitted steps from trackers that cannot forget.
        committed: the step already committed (the checkpoint a run resumed from).
    """

    def __init__(
        self,
        jsonl: MetricsLogger,
        trackers: Mapping[str, Tracker] | None = None,
        *,
        hold: bool = False,
        committed: int = 0,
    ):
        self.jsonl = jsonl
        self.trackers = dict(trackers or {})
        self.hold = hold
        self.committed = committed
        # Calls waiting for their step's commit: (step, what to call on a tracker).
        self._held: list[tuple[int, Callable[[Tracker], None]]] = []

    def _send(self, step: int, call: Callable[[Tracker], None]) -> None:
        """``call`` on every tracker now, except that one that cannot forget waits for
        ``step``'s commit."""
        waits = self.hold and step > self.committed
        for tracker in self.trackers.values():
            if tracker.forgets or not waits:
                call(tracker)
        if waits and any(not tracker.forgets for tracker in self.trackers.values()):
            self._held.append((step, call))

    def commit(self, step: int) -> None:
        """A checkpoint of ``step`` is taken: the held calls up to it go out, in order."""
        self.committed = max(self.committed, step)
        due = [call for held_step, call in self._held if held_step <= self.committed]
        self._held = [(s, call) for s, call in self._held if s > self.committed]
        for call in due:
            for tracker in self.trackers.values():
                if not tracker.forgets:
                    call(tracker)

    def log(
        self, metrics: Mapping[str, Any], histograms: Mapping[str, Sequence[int]] | None = None
    ) -> None:
        """One step's metrics (``metrics["step"]`` is the step) and histograms of
        integers (each value counted)."""
        self.jsonl.log(dict(metrics))
        if not self.trackers:
            return
        step = int(metrics["step"])
        scalars = numbers(metrics)
        histograms = histograms or {}
        counts = {name: Counter(int(v) for v in values) for name, values in histograms.items()}

        def call(tracker: Tracker) -> None:
            tracker.log_metrics(step, scalars)
            for name, histogram in counts.items():
                tracker.log_histogram(step, name, histogram)

        self._send(step, call)

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        """A held-out evaluation at ``step``, for the external trackers only
        (``metrics.jsonl`` holds train steps; the job's ``summary.json`` its evaluations)."""
        scalars = numbers(metrics)
        self._send(step, lambda tracker: tracker.log_metrics(step, scalars))

    def roll_back(self, step: int, rows: list[dict[str, object]]) -> None:
        """The run went back to ``step``; ``rows`` are the steps it keeps.

        ``metrics.jsonl`` is rewritten to ``rows``; TensorBoard hides its events after
        ``step``; W&B and MLflow were given nothing after it (with ``hold``), and what
        waited for a commit past it is dropped."""
        self.jsonl.rewrite(rows)
        self._held = [(s, call) for s, call in self._held if s <= step]
        for tracker in self.trackers.values():
            tracker.rewind(step)

    def log_config(self, config: Mapping[str, object]) -> None:
        for tracker in self.trackers.values():
            tracker.log_config(config)

    def log_summary(self, summary: Mapping[str, object]) -> None:
        for tracker in self.trackers.values():
            tracker.log_summary(summary)

    def close(self, finished: bool = True, failed: bool = False) -> None:
        """Ends every tracker's run. ``finished``: the run has all its steps, so what
        waits for a commit goes out first (otherwise a resume does those steps again);
        ``failed``: the run crashed, and the trackers mark their runs failed."""
        if finished and not failed:
            self.commit(max([step for step, _ in self._held], default=self.committed))
        self._held = []
        self.jsonl.close()
        for tracker in self.trackers.values():
            tracker.close(failed=failed)
        self.trackers = {}


def open_trackers(
    names: Sequence[str],
    run_dir: Path | None,
    *,
    config: Mapping[str, object],
    resumed_from: int | None = None,
    total_steps: int | None = None,
    progress: bool = False,
    hold: bool = False,
) -> Trackers:
    """``metrics.jsonl`` and the trackers ``names`` lists for the run in ``run_dir``,
    continuing the tracker runs ``tracking.json`` records there; logs ``config``.

    Args:
        names: ``RunConfig.tracking``.
        run_dir: the run directory (``None``: metrics in memory; ``names`` must then be
            ``jsonl`` alone).
        config: the resolved config, as plain dicts.
        resumed_from: the checkpoint step the run resumed from; TensorBoard hides the
            stopped run's events after it.
        total_steps, progress: the progress bar's.
        hold: the run can go back to a checkpoint: W&B and MLflow get committed steps
            only (``Trackers``).
    """
    check_tracking(names)
    check_run_dir(names, run_dir)
    jsonl = MetricsLogger(
        run_dir / "metrics.jsonl" if run_dir else None, total_steps=total_steps, progress=progress
    )
    trackers: dict[str, Tracker] = {}
    if run_dir is None:
        return Trackers(jsonl)
    ids_path = run_dir / IDS_FILE
    ids = json.loads(ids_path.read_text()) if ids_path.exists() else {}
    try:
        for name in names:
            if name == "tensorboard":
                logdir = run_dir / "tensorboard"
                again = logdir.is_dir() and any(logdir.glob("events.out.tfevents.*"))
                purge = (resumed_from or 0) + 1 if again else None
                trackers[name] = TensorBoardTracker(logdir, purge_step=purge)
            elif name == "wandb":
                wandb_tracker = WandbTracker(run_dir, ids.get("wandb"), run_dir.name)
                ids["wandb"] = wandb_tracker.run_id
                trackers[name] = wandb_tracker
            elif name == "mlflow":
                mlflow_tracker = MlflowTracker(run_dir, ids.get("mlflow"), run_dir.name)
                ids["mlflow"] = mlflow_tracker.run_id
                trackers[name] = mlflow_tracker
        if ids:
            ids_path.write_text(json.dumps(ids, indent=2) + "\n")
        out = Trackers(jsonl, trackers, hold=hold, committed=resumed_from or 0)
        out.log_config(config)
    except BaseException:
        Trackers(jsonl, trackers).close(failed=True)
        raise
    return out
