"""The one trace schema written by the runtime and the simulator, read by plots and
calibration.

A trace is JSON lines, one event per line: ``{"t": 12.5, "kind": "train_step",
"actor": "trainer", "version": 3, ...}``. ``t`` is seconds since run start (simulated
seconds in ``sim/``, wall seconds in the runtime), ``actor`` names who did it
(``trainer``, ``param_server``, ``worker-3``, ``verifier``, ``buffer``), ``version`` is
the weight version involved (``null`` where none is). Further keys depend on the kind;
the closed set of kinds and the keys each requires are in :data:`REQUIRED_FIELDS`.
An event that lasts (a train step, a push, a pull, a checkpoint, a reward) is written
when it ends, with its ``duration_s``; ``generation_start`` marks a sequence's start.

Per kind, the keys this module's helpers read (others are free):

- ``run_start``: ``config`` (dict: policies and fleet shape, for calibration).
- ``generation_start`` / ``generation_end``: one generated sequence. ``sample`` (id),
  optional ``rollout`` (id of its prompt group), ``prompt_tokens``, ``occupancy``
  (sequences decoding on that worker when it started); at the end ``tokens``
  (completion tokens), ``first_version`` (oldest version of its tokens; defaults to
  ``version``), ``finish`` (``stop`` | ``length``); for a multi-turn episode
  ``tokens`` counts the environment's tokens too, and optional ``turn_tokens`` (list)
  gives the policy tokens of each turn.
- ``reward``: ``sample``, ``duration_s`` (verifier latency).
- ``decode``: one chunk of decode steps on a worker (written by the runtime's workers,
  which decode in chunks, and by the simulator's serial host; its per-sequence
  workers write none).
  ``duration_s`` (wall time of the chunk: prefill of the prompts it starts, the decode
  steps, fetching finished rows), ``rows`` (sequences decoding in it), ``started``
  (sequences it started, i.e. prefilled), ``finished`` (sequences it finished),
  optional ``steps`` (decode steps it ran: fewer than the chunk's when every row
  stopped early), optional ``pipelined`` (true: the chunk was dispatched before the
  host finished with the previous worker's and decoded meanwhile, so ``duration_s``,
  its launch and the wait left over, is less than its cost).
- ``train_step``: ``step``, ``samples``, ``tokens`` (every token of the trained
  sequences, prompt and completion: the work of the step's forward and backward
  passes), optional ``completion_tokens`` (the tokens trained on), ``duration_s``
  (compute), and ``staleness`` (list: trainer version minus oldest version, per
  rollout trained); with ``runtime.overlap_training``, ``after_s``: seconds from the
  compute's end to the event (the wait for the rounds beside the step if they
  outlasted it, then the push and the step's books), so the compute ran over
  ``step_span``'s interval.
- ``push`` / ``pull``: ``duration_s``, optional ``bytes``; a pull in the middle of
  generation (``weight_sync.pull_mode: in_flight``) has ``rebuilt``, the rows whose KV
  cache it rebuilds under the new weights. The rebuild is dispatched, not waited for:
  its time lands in the worker's next ``decode`` chunk.
- ``checkpoint_save`` / ``checkpoint_restore``: ``step``, ``duration_s``. A save's
  ``duration_s`` is the part the trainer waits for (an asynchronous save returns once
  its arrays are copied).
- ``checkpoint_write``: an asynchronous save's background write, ``step`` and
  ``duration_s`` (from the save's return to the write being durable), and optionally
  ``written_s``, when it became durable. The simulator stamps it with the write's end;
  the runtime learns of it when the trainer next replies and stamps it then (the trace
  stays in time order), with ``written_s``. A write still going when the run ends has
  none. Calibration takes a save without one as written when it returned.
- ``preemption`` / ``restart``: optional ``lost_steps`` (trainer).
- ``worker_start``: ``duration_s``, the wall seconds a worker actor took from its start
  to being up (process, imports, constructor); written by the Ray placement at the
  worker's first ``sync``, for the fleet's first actors and their replacements alike.
- ``tool_call``: one environment step of a multi-turn episode (a tool call), written
  when it ends: ``sample`` (the episode), ``turn`` (index of the policy turn that made
  the call, from 0), ``duration_s`` (the step's own time), ``outcome`` (``ok`` |
  ``error`` | ``timeout``), optional ``observation_tokens`` (tokens appended),
  ``action_tokens`` (the policy tokens of the turn) and, in the simulator,
  ``released`` (the slot was given up while the tool ran).
- ``drop``: ``reason`` (``stale``, ``future_version``, ``preempted``,
  ``reward_timeout``, ...), optional ``rollout``.
- ``fault``: ``fault`` (the FaultPlan kind injected, when it is not a preemption);
  a weight pull that failed is a ``fault`` event of the worker with that kind.
- ``run_end``: ``goodput`` (useful trainer compute ÷ wall time), optional
  ``useful_train_s``, ``lost_train_s``, ``wall_s``, ``lost_steps``.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from rlaxkit.rules.validation import is_int, is_number

__all__ = [
    "KINDS",
    "REQUIRED_FIELDS",
    "GenerationRecord",
    "JsonlTraceWriter",
    "MemoryTrace",
    "TraceEvent",
    "TraceSink",
    "TraceSummary",
    "drop_counts",
    "durations",
    "generation_records",
    "iter_trace",
    "read_trace",
    "staleness_distribution",
    "step_span",
    "summarize",
]

REQUIRED_FIELDS: Mapping[str, tuple[str, ...]] = {
    "run_start": (),
    "generation_start": ("sample",),
    "generation_end": ("sample", "tokens"),
    "reward": ("sample", "duration_s"),
    "decode": ("duration_s", "rows", "started", "finished"),
    "train_step": ("step", "samples", "duration_s"),
    "push": ("duration_s",),
    "pull": ("duration_s",),
    "checkpoint_save": ("step", "duration_s"),
    "checkpoint_write": ("step", "duration_s"),
    "checkpoint_restore": ("step",),
    "preemption": (),
    "restart": (),
    "worker_start": ("duration_s",),
    "tool_call": ("sample", "turn", "duration_s", "outcome"),
    "drop": ("reason",),
    "fault": ("fault",),
    "run_end": ("goodput",),
}
KINDS: frozenset[str] = frozenset(REQUIRED_FIELDS)
# ``json.dumps`` with any option builds an encoder per call: 6.1 us a line against 3.6 us
# for this one (a run writes two lines per sample).
_ENCODER = json.JSONEncoder(separators=(",", ":"))
_CORE = ("t", "kind", "actor", "version")


@dataclass(frozen=True, init=False)
class TraceEvent:
    """One trace line: time, kind, actor, weight version, and kind-specific fields."""

    t: float
    kind: str
    actor: str
    version: int | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)

    def __init__(
        self,
        t: float,
        kind: str,
        actor: str,
        version: int | None = None,
        fields: Mapping[str, object] | None = None,
    ) -> None:
        fields = {} if fields is None else fields
        # The common case in a few type tests and two set tests (a run records two
        # events a sample: about 0.5 us against 1.0 us for ``_validate``); anything
        # else, errors included, goes through ``_validate``, which names the field.
        required = _REQUIRED_SETS.get(kind)
        if not (
            required is not None
            and type(t) is float
            and 0.0 <= t < math.inf
            and type(actor) is str
            and actor
            and (version is None or type(version) is int)
            and required <= fields.keys()
            and _CORE_SET.isdisjoint(fields)
        ):
            _validate(t, kind, actor, version, fields, where="event")
        # Written to the instance's dict, as a frozen dataclass's own __init__ does
        # through object.__setattr__ one field at a time: 0.8 us an event against
        # 1.3 us (a run records two a sample).
        state = self.__dict__
        state["t"], state["kind"], state["actor"] = t, kind, actor
        state["version"], state["fields"] = version, fields

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def get(self, key: str, default: object = None) -> Any:
        """The field ``key``, or ``default`` when absent."""
        return self.fields.get(key, default)

    @property
    def discarded(self) -> bool:
        """A ``train_step`` whose weights a trainer restore threw away (the step was taken
        again): its compute happened, but it is not part of the run's history."""
        return bool(self.fields.get("discarded", False))

    def to_dict(self) -> dict[str, Any]:
        """Flat dict: the four core keys followed by the fields."""
        out: dict[str, Any] = {
            "t": self.t,
            "kind": self.kind,
            "actor": self.actor,
            "version": self.version,
        }
        out.update(self.fields)
        return out

    def to_json(self) -> str:
        """One JSON line (no trailing newline)."""
        return _ENCODER.encode(self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TraceEvent:
        """Parse a flat dict, validating the kind and its required fields."""
        for key in ("t", "kind", "actor"):
            if key not in data:
                raise ValueError(f"{key}: missing from trace event {dict(data)!r}")
        fields = {k: v for k, v in data.items() if k not in _CORE}
        return cls(
            t=data["t"],
            kind=data["kind"],
            actor=data["actor"],
            version=data.get("version"),
            fields=fields,
        )


# Per kind, its required keys as a set: the common event's checks are two set tests.
_REQUIRED_SETS: dict[str, frozenset[str]] = {k: frozenset(v) for k, v in REQUIRED_FIELDS.items()}
_CORE_SET = frozenset(_CORE)


def _validate(
    t: float,
    kind: str,
    actor: str,
    version: int | None,
    fields: Mapping[str, object],
    *,
    where: str,
) -> None:
    if not is_number(t) or not math.isfinite(t) or t < 0:
        raise ValueError(f"{where}.t: must be a finite number >= 0, got {t!r}")
    if kind not in KINDS:
        raise ValueError(f"{where}.kind: must be one of {sorted(KINDS)}, got {kind!r}")
    if not isinstance(actor, str) or not actor:
        raise ValueError(f"{where}.actor: must be a non-empty string, got {actor!r}")
    if version is not None and not is_int(version):
        raise ValueError(f"{where}.version: must be an integer or null, got {version!r}")
    for key in fields:
        if key in _CORE:
            raise ValueError(f"{where}.{key}: reserved key cannot be a field")
    for key in REQUIRED_FIELDS[kind]:
        if key not in fields:
            raise ValueError(f"{where}.{key}: required for kind {kind!r}")


class TraceSink(Protocol):
    """Anything that takes trace events: a JSONL writer, an in-memory list."""

    def record(
        self, t: float, kind: str, actor: str, version: int | None = None, **fields: object
    ) -> None:
        """Record one event (validated)."""
        ...


class MemoryTrace:
    """In-memory trace: ``events`` is the list of recorded :class:`TraceEvent`."""

    def __init__(self) -> None:
        self.events: list[TraceEvent] = []

    def record(
        self, t: float, kind: str, actor: str, version: int | None = None, **fields: object
    ) -> None:
        """Append one validated event."""
        self.events.append(TraceEvent(t, kind, actor, version, fields))

    def emit(self, event: TraceEvent) -> None:
        """Append an already-built event."""
        self.events.append(event)

    def write(self, path: str | os.PathLike) -> None:
        """Write all events to ``path`` as JSON lines (overwriting)."""
        with open(path, "w", encoding="utf-8") as handle:
            for event in self.events:
                handle.write(event.to_json() + "\n")

    def __iter__(self) -> Iterator[TraceEvent]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)


class JsonlTraceWriter:
    """Appends events to a JSONL file, flushing after every line so a killed process
    leaves a readable trace. Use as a context manager or call :meth:`close`."""

    def __init__(self, path: str | os.PathLike, *, append: bool = True) -> None:
        self.path = Path(path)
        self._handle = open(self.path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115

    def record(
        self, t: float, kind: str, actor: str, version: int | None = None, **fields: object
    ) -> None:
        """Validate, write and flush one event."""
        self.emit(TraceEvent(t, kind, actor, version, fields))

    def emit(self, event: TraceEvent) -> None:
        """Write and flush an already-built event."""
        self._handle.write(event.to_json() + "\n")
        self._handle.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if not self._handle.closed:
            self._handle.close()

    def __enter__(self) -> JsonlTraceWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_trace(path: str | os.PathLike) -> IO[str]:
    """A JSONL trace opened for reading as text, gzip-compressed when its name ends
    in ``.gz`` (``trace.jsonl.gz``, see :func:`compress_trace`)."""
    if os.fspath(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")  # noqa: SIM115


def trace_path(run_dir: str | os.PathLike) -> Path:
    """A run directory's trace: ``trace.jsonl``, else ``trace.jsonl.gz`` if only that
    exists (a compact run), else the ``trace.jsonl`` it would be."""
    plain = Path(run_dir) / "trace.jsonl"
    packed = plain.with_name("trace.jsonl.gz")
    return packed if packed.exists() and not plain.exists() else plain


def compress_trace(run_dir: str | os.PathLike) -> tuple[int, int]:
    """Replaces a finished run's ``trace.jsonl`` by ``trace.jsonl.gz`` (gzip level 6),
    which every reader here reads as it is; returns the bytes before and after."""
    plain = Path(run_dir) / "trace.jsonl"
    packed = plain.with_name("trace.jsonl.gz")
    with open(plain, "rb") as source, gzip.open(packed, "wb", compresslevel=6) as target:
        shutil.copyfileobj(source, target, length=1 << 20)
    before = plain.stat().st_size
    plain.unlink()
    return before, packed.stat().st_size


def iter_trace(path: str | os.PathLike) -> Iterator[TraceEvent]:
    """Yield validated events from a JSONL trace (plain or ``.gz``); errors name the
    line number."""
    with open_trace(path) as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                if not isinstance(data, dict):
                    raise ValueError("line is not a JSON object")
                yield TraceEvent.from_dict(data)
            except (ValueError, json.JSONDecodeError) as error:
                raise ValueError(f"{path}:{line_number}: {error}") from error


def read_trace(path: str | os.PathLike) -> list[TraceEvent]:
    """All validated events of a JSONL trace, in file order."""
    return list(iter_trace(path))


# --- helpers shared by runtime reports and calibration ---------------------------------


@dataclass(frozen=True)
class TraceSummary:
    """Throughput of a run as its trace tells it.

    ``duration_s`` runs from the first event to the last kept ``train_step`` (or the last
    event when no step happened; discarded steps do not count). Rates divide trained
    (consumed) samples and tokens, and generated completion tokens, by that duration.
    """

    duration_s: float
    steps: int
    samples_trained: int
    tokens_trained: int
    tokens_generated: int
    samples_per_s: float
    tokens_per_s: float
    generated_tokens_per_s: float
    mean_step_s: float


def summarize(events: Iterable[TraceEvent]) -> TraceSummary:
    """Throughput figures of a trace (see :class:`TraceSummary`)."""
    events = list(events)
    if not events:
        raise ValueError("events: empty trace")
    start = min(e.t for e in events)
    steps = [e for e in events if e.kind == "train_step" and not e.discarded]
    end = max(e.t for e in steps) if steps else max(e.t for e in events)
    duration = max(end - start, 1e-12)
    samples = sum(int(e["samples"]) for e in steps)
    tokens = sum(int(e.get("tokens", 0)) for e in steps)
    generated = sum(int(e["tokens"]) for e in events if e.kind == "generation_end")
    mean_step = (max(e.t for e in steps) - start) / len(steps) if steps else float("nan")
    return TraceSummary(
        duration_s=duration,
        steps=len(steps),
        samples_trained=samples,
        tokens_trained=tokens,
        tokens_generated=generated,
        samples_per_s=samples / duration,
        tokens_per_s=tokens / duration,
        generated_tokens_per_s=generated / duration,
        mean_step_s=mean_step,
    )


def staleness_distribution(events: Iterable[TraceEvent]) -> dict[int, int]:
    """Counts of per-rollout staleness over the kept ``train_step`` events, sorted by age."""
    counts: Counter[int] = Counter()
    for event in events:
        if event.kind == "train_step" and not event.discarded:
            counts.update(int(s) for s in event.get("staleness", ()))
    return dict(sorted(counts.items()))


def drop_counts(events: Iterable[TraceEvent]) -> dict[str, int]:
    """Number of ``drop`` events per reason."""
    return dict(Counter(str(e["reason"]) for e in events if e.kind == "drop"))


def step_span(event: TraceEvent) -> tuple[float, float]:
    """``(start, end)`` of a ``train_step`` event's compute: ``duration_s`` ending
    ``after_s`` (0 without it) before the event."""
    end = event.t - float(event.get("after_s", 0.0))
    return end - float(event["duration_s"]), end


def durations(events: Iterable[TraceEvent], kind: str) -> list[float]:
    """The ``duration_s`` of every event of ``kind`` that has one."""
    if kind not in KINDS:
        raise ValueError(f"kind: must be one of {sorted(KINDS)}, got {kind!r}")
    return [float(e["duration_s"]) for e in events if e.kind == kind and "duration_s" in e.fields]


@dataclass(frozen=True)
class GenerationRecord:
    """One completed generation, joined from its start and end events."""

    actor: str
    sample: str
    start_s: float
    end_s: float
    tokens: int
    prompt_tokens: int | None
    occupancy: int | None
    first_version: int | None
    version: int | None

    @property
    def latency_s(self) -> float:
        """End minus start, in seconds."""
        return self.end_s - self.start_s

    @property
    def interrupted(self) -> bool:
        """True when its tokens span weight versions (an in-flight update paused it)."""
        return self.first_version != self.version


def generation_records(events: Iterable[TraceEvent]) -> list[GenerationRecord]:
    """Completed generations, joining start and end events on ``(actor, sample)``.

    Starts without an end (aborted by a preemption) are left out.
    """
    starts: dict[tuple[str, str], TraceEvent] = {}
    records: list[GenerationRecord] = []
    for event in events:
        key = (event.actor, str(event.get("sample")))
        if event.kind == "generation_start":
            starts[key] = event
        elif event.kind == "generation_end" and key in starts:
            start = starts.pop(key)
            records.append(
                GenerationRecord(
                    actor=event.actor,
                    sample=key[1],
                    start_s=start.t,
                    end_s=event.t,
                    tokens=int(event["tokens"]),
                    prompt_tokens=start.get("prompt_tokens"),
                    occupancy=start.get("occupancy"),
                    first_version=event.get("first_version", start.version),
                    version=event.version,
                )
            )
    return records
