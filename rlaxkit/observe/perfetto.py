"""A run's ``trace.jsonl`` in the Trace Event Format, for https://ui.perfetto.dev and
``chrome://tracing`` (``rlaxkit trace RUN_DIR``, ``SimResult.to_perfetto``).

The output is one JSON object ``{"traceEvents": [...], "displayTimeUnit": "ms",
"metadata": {...}}``; ``ts`` and ``dur`` are microseconds since the run's start (wall
time for a real run, simulated time for a simulated one). The layout:

- process ``trainer``: a track each for the trainer (train steps ``step N``, checkpoint
  saves and restores, its preemptions and restarts), the parameter server (pushes), the
  buffer (drops, as instants) and any other actor of the trace (``controller``,
  ``verifier``); the counters ``staleness`` (mean and max over the rollouts of each
  step), ``buffer (samples)`` (generated, not yet trained or dropped) and
  ``generating (samples)`` (sequences decoding across the fleet);
- one process per worker: a track for the worker itself (pulls, faults, preemptions and
  restarts as instants), one for its decode chunks when the trace has them, and one
  track per slot, ``slot 0``, ``slot 1``, ...: its generations packed so that no two
  overlap on a track. A generation is a span ``gen vK`` (``gen vK→vL`` when an in-flight
  update moved it from version K to L; ``(aborted)`` when a preemption cut it), with
  its versions, tokens and sample id in ``args``.

Colours: ``cname`` picks one of the viewer's named colours by the generation's first
weight version, and train steps alternate two colours so step boundaries show. Perfetto
ignores ``cname`` and colours a slice by its name, which carries the version, so a
version keeps one colour there too.

Size: a viewer struggles past a few hundred MB of JSON or a track of many thousand
slices. Past ``max_events_per_track`` spans a track's consecutive spans are merged
``k`` at a time (name ``gen vK–vL ×k``, ``args.merged = k``); instants and counter
points are thinned to every ``k``-th. When the whole file would exceed ``max_events``,
the per-track cap is lowered until it fits. ``metadata.aggregated`` says what was merged.
``reward`` events are left out (the verifier runs thousands of calls at once; see
``trace.jsonl``); ``metadata.omitted`` counts them.

>>> from rlaxkit.rules.trace import MemoryTrace
>>> trace = MemoryTrace()
>>> trace.record(1.0, "generation_start", "worker-0", 0, sample="0/0")
>>> trace.record(3.5, "generation_end", "worker-0", 0, sample="0/0", tokens=12)
>>> trace.record(5.0, "train_step", "trainer", 1, step=1, samples=1, duration_s=1.5)
>>> spans = [e for e in trace_event_format(trace)["traceEvents"] if e["ph"] == "X"]
>>> [(e["name"], e["ts"], e["dur"]) for e in spans]
[('step 1', 3500000, 1500000), ('gen v0', 1000000, 2500000)]
"""

from __future__ import annotations

import gc
import heapq
import json
import math
import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlaxkit.rules.trace import KINDS, TraceEvent, open_trace, trace_path

__all__ = [
    "MAX_EVENTS",
    "MAX_EVENTS_PER_TRACK",
    "PerfettoExport",
    "export_perfetto",
    "read_rows",
    "trace_event_format",
    "validate",
]

MAX_EVENTS = 600_000  # spans, instants and counter points: about 100 MB of JSON
MAX_EVENTS_PER_TRACK = 5_000  # slices per track before they are merged
# Named colours of the trace viewer (catapult's colour scheme), one per weight version
# in turn; Perfetto ignores them (see the module docstring).
VERSION_CNAMES = (
    "thread_state_running",
    "rail_response",
    "thread_state_iowait",
    "rail_animation",
    "yellow",
    "thread_state_runnable",
    "olive",
    "rail_load",
)
STEP_CNAMES = ("generic_work", "grey")
TRAINER = "trainer"
_US = 1e6  # microseconds per second

# One trace line as the exporter reads it: t, kind, actor, version, and the line's keys.
Row = tuple[float, str, str, int | None, Mapping[str, Any]]


@dataclass(frozen=True)
class PerfettoExport:
    """What :func:`export_perfetto` wrote: counts of events and tracks, the file size,
    and how many tracks were merged or thinned to fit the caps (0: nothing was)."""

    path: Path
    events: int
    tracks: int
    bytes: int
    aggregated_tracks: int


def read_rows(path: str | os.PathLike) -> Iterator[Row]:
    """The events of a ``trace.jsonl`` as rows, without building a ``TraceEvent`` each
    (twice as fast on the millions of lines of a fleet-scale simulated run). Each line
    must be an object with ``t``, ``kind`` (one of the schema's) and ``actor``; errors
    name the line."""
    with open_trace(path) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                t, kind, actor = data["t"], data["kind"], data["actor"]
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number}: not a trace event ({error})") from None
            if kind not in KINDS:
                raise ValueError(f"{path}:{number}: kind {kind!r} is not one of {sorted(KINDS)}")
            yield float(t), kind, actor, data.get("version"), data


def _rows(events: Iterable[TraceEvent | Row]) -> Iterator[Row]:
    for event in events:
        if isinstance(event, TraceEvent):
            yield event.t, event.kind, event.actor, event.version, event.fields
        else:
            yield event


@dataclass(slots=True)
class _Span:
    start_s: float
    end_s: float
    name: str
    cname: str | None
    args: dict[str, Any]


class _Builder:
    """Collects spans, instants and counter points per logical track while the trace
    streams by; :meth:`events` lays them out on tracks and applies the caps."""

    def __init__(self) -> None:
        # (process, track) -> spans; slots of a worker are one logical track packed later.
        self.spans: dict[tuple[str, str], list[_Span]] = defaultdict(list)
        self.instants: dict[tuple[str, str], list[tuple[float, str, dict]]] = defaultdict(list)
        # name -> (t, values): the staleness counter has two series, the others one.
        self.counters: dict[str, list[tuple[float, tuple[float, ...]]]] = defaultdict(list)
        self.waiting_points = self.counters["buffer (samples)"]
        self.generating_points = self.counters["generating (samples)"]
        self.open: dict[tuple[str, str], Row] = {}
        self.ended: Counter[str] = Counter()  # generated samples per rollout still held
        self.dropped: set[str] = set()
        self.waiting = 0  # generated samples not yet trained or dropped
        self.generating = 0
        self.omitted: Counter[str] = Counter()
        self.config: Mapping[str, Any] | None = None
        self.end_s = 0.0
        self.rows = 0

    def add(self, row: Row) -> None:
        t, kind, actor, version, data = row
        self.rows += 1
        if t > self.end_s:
            self.end_s = t
        if kind == "generation_start":
            key = (actor, str(data["sample"]))
            if key in self.open:  # started again before it ended: the first was cut
                self._close(key, t, aborted=True)
            self.open[key] = row
            self._count_generating(t, +1)
            return
        if kind == "generation_end":
            self._end_generation(row)
            return
        if kind == "reward":
            self.omitted[kind] += 1
            return
        process, track = _place(actor, kind)
        duration = data.get("duration_s")
        if kind == "train_step":
            step = int(data["step"])
            staleness = [int(s) for s in data.get("staleness", ())]
            args = {"step": step, "version": version, "samples": data["samples"]}
            args |= {k: data[k] for k in ("tokens", "completion_tokens") if k in data}
            if staleness:
                args["mean_staleness"] = sum(staleness) / len(staleness)
                point = (args["mean_staleness"], float(max(staleness)))
                self.counters["staleness"].append((t, point))
            end = t - float(data.get("after_s", 0.0))  # ``step_span``: the compute's end
            self._span(process, track, end, duration, f"step {step}", STEP_CNAMES[step % 2], args)
            self._count_waiting(t, -int(data["samples"]))
        elif kind in ("push", "pull", "checkpoint_save", "decode") or (
            kind == "checkpoint_restore" and duration is not None
        ):
            name = {
                "push": f"push v{version}",
                "pull": f"pull v{version}",
                "decode": "decode",
            }.get(kind, f"{kind.replace('_', ' ')} step {data.get('step')}")
            args = {k: v for k, v in data.items() if k not in ("t", "kind", "actor")}
            self._span(process, track, t, duration, name, None, args)
        else:
            if kind == "preemption" and actor.startswith("worker-"):
                for key in [k for k in self.open if k[0] == actor]:
                    self._close(key, t, aborted=True)
            if kind == "drop":
                self._drop(t, data)
            if kind == "run_start":
                self.config = data.get("config")
            label = {"drop": f"drop: {data.get('reason')}", "fault": f"fault: {data.get('fault')}"}
            args = {k: v for k, v in data.items() if k not in ("t", "kind", "actor", "config")}
            self.instants[(process, track)].append((t, label.get(kind, kind), args))

    def _span(
        self,
        process: str,
        track: str,
        end_s: float,
        duration_s: float | None,
        name: str,
        cname: str | None,
        args: dict[str, Any],
    ) -> None:
        start_s = max(0.0, end_s - float(duration_s or 0.0))
        self.spans[(process, track)].append(_Span(start_s, end_s, name, cname, args))

    def _end_generation(self, row: Row) -> None:
        t, _, actor, version, data = row
        start = self.open.pop((actor, str(data["sample"])), None)
        if start is None:
            return  # its start came before the trace was cut (a resumed run)
        self._count_generating(t, -1)
        first = data.get("first_version", start[3])
        name = f"gen v{first}" if first == version else f"gen v{first}→v{version}"
        args = {"sample": data["sample"], "version": version, "first_version": first}
        args |= {k: data[k] for k in ("tokens", "finish") if k in data}
        if "prompt_tokens" in start[4]:
            args["prompt_tokens"] = start[4]["prompt_tokens"]
        self.spans[(actor, "slot")].append(_Span(start[0], t, name, _version_cname(first), args))
        rollout = str(data.get("rollout"))
        if rollout not in self.dropped:
            self.ended[rollout] += 1
            self._count_waiting(t, +1)

    def _close(self, key: tuple[str, str], t: float, *, aborted: bool) -> None:
        start = self.open.pop(key)
        self._count_generating(t, -1)
        version = start[3]
        name = f"gen v{version} (aborted)" if aborted else f"gen v{version} (unfinished)"
        args = {"sample": key[1], "first_version": version, "aborted": aborted}
        self.spans[(key[0], "slot")].append(_Span(start[0], t, name, "terrible", args))

    def _drop(self, t: float, data: Mapping[str, object]) -> None:
        rollout = str(data.get("rollout"))
        if "rollout" in data and rollout not in self.dropped:
            self.dropped.add(rollout)
            self._count_waiting(t, -self.ended.pop(rollout, 0))

    def _count_waiting(self, t: float, change: int) -> None:
        self.waiting += change
        self.waiting_points.append((t, (self.waiting,)))

    def _count_generating(self, t: float, change: int) -> None:
        self.generating += change
        self.generating_points.append((t, (self.generating,)))

    def finish(self) -> None:
        """Close generations still open at the end of the trace."""
        for key in list(self.open):
            self._close(key, self.end_s, aborted=False)


def _place(actor: str, kind: str) -> tuple[str, str]:
    """(process, track) of an event that is not a generation."""
    if kind == "push" or actor.startswith("param"):
        return TRAINER, "parameter server"
    if actor.startswith("worker-"):
        return actor, "decode" if kind == "decode" else "worker"
    return TRAINER, actor


def _version_cname(version: int | None) -> str:
    return VERSION_CNAMES[(version or 0) % len(VERSION_CNAMES)]


def _pack(spans: list[_Span]) -> list[list[_Span]]:
    """Spans split into lanes so that none overlaps another of its lane; each goes to
    the lowest-numbered lane free at its start (as many lanes as the peak overlap)."""
    lanes: list[list[_Span]] = []
    busy: list[tuple[float, int]] = []  # (end, lane)
    free: list[int] = []
    for span in sorted(spans, key=lambda s: (s.start_s, -s.end_s)):
        while busy and busy[0][0] <= span.start_s:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            lane = heapq.heappop(free)
        else:
            lane = len(lanes)
            lanes.append([])
        lanes[lane].append(span)
        heapq.heappush(busy, (span.end_s, lane))
    return lanes


def _merge(spans: list[_Span], cap: int) -> list[_Span]:
    """At most ``cap`` spans: consecutive runs of ``k = ceil(n / cap)`` become one."""
    k = math.ceil(len(spans) / cap)
    if k <= 1:
        return spans
    merged = []
    for i in range(0, len(spans), k):
        run = spans[i : i + k]
        same = all(s.name == run[0].name for s in run)
        name = run[0].name if same else f"{run[0].name} … {run[-1].name}"
        tokens = sum(int(s.args.get("tokens", 0)) for s in run)
        args = {"merged": len(run), "first": run[0].args, "tokens": tokens}
        merged.append(
            _Span(run[0].start_s, run[-1].end_s, f"{name} ×{len(run)}", run[0].cname, args)
        )
    return merged


def _cap_for(sizes: list[int], per_track: int, budget: int) -> int:
    """The largest cap ``c <= per_track`` with ``sum(min(n, c)) <= budget`` (at least 1)."""
    low, high = 1, per_track
    while low < high:
        middle = (low + high + 1) // 2
        if sum(min(n, middle) for n in sizes) <= budget:
            low = middle
        else:
            high = middle - 1
    return low


def _worker_key(name: str) -> tuple[int, str]:
    suffix = name.rpartition("-")[2]
    return (int(suffix), name) if suffix.isdigit() else (1 << 30, name)


def trace_event_format(
    events: Iterable[TraceEvent | Row],
    *,
    max_events: int = MAX_EVENTS,
    max_events_per_track: int = MAX_EVENTS_PER_TRACK,
    metadata: Mapping[str, object] | None = None,
) -> dict[str, Any]:
    """The Trace Event Format object of a trace (see the module docstring).

    Args:
        events: ``TraceEvent``s (a ``MemoryTrace``, ``read_trace``) or rows of
            :func:`read_rows`, in the order they were written: a generation's start
            comes before its end, a preemption after the starts it cuts (tracks are
            sorted by time on output).
        max_events: cap on spans, instants and counter points in all.
        max_events_per_track: cap on the events of one track (or counter).
        metadata: extra entries for the file's ``metadata`` (e.g. a scenario's name).
    """
    if max_events < 1 or max_events_per_track < 1:
        raise ValueError(
            f"max_events and max_events_per_track: must be >= 1, got {max_events} and "
            f"{max_events_per_track}"
        )
    # A fleet-scale trace makes millions of small lists and dicts and no reference
    # cycles; the cyclic collector would rescan them again and again (a third of the
    # time), so it waits until the document is built.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _document(events, max_events, max_events_per_track, metadata)
    finally:
        if collecting:
            gc.enable()


def _document(
    events: Iterable[TraceEvent | Row],
    max_events: int,
    max_events_per_track: int,
    metadata: Mapping[str, object] | None,
) -> dict[str, Any]:
    builder = _Builder()
    for row in _rows(events):
        builder.add(row)
    builder.finish()
    # Lay spans out on tracks: (process, track name, items).
    tracks: list[tuple[str, str, list[_Span]]] = []
    for (process, track), spans in builder.spans.items():
        lanes = _pack(spans)
        for i, lane in enumerate(lanes):
            name = f"slot {i}" if track == "slot" else track if i == 0 else f"{track} ({i + 1})"
            tracks.append((process, name, lane))
    instants = list(builder.instants.items())
    counters = [(name, series) for name, series in builder.counters.items() if series]
    sizes = [len(t[2]) for t in tracks] + [len(i[1]) for i in instants]
    sizes += [len(c[1]) for c in counters]
    cap = _cap_for(sizes, max_events_per_track, max_events)
    aggregated = sum(n > cap for n in sizes)

    processes = sorted(
        {t[0] for t in tracks} | {key[0] for key, _ in instants} | {TRAINER},
        key=lambda p: (p != TRAINER, _worker_key(p)),
    )
    pids = {process: i + 1 for i, process in enumerate(processes)}
    out: list[dict[str, Any]] = []
    for process, pid in pids.items():
        out.append(_meta("process_name", pid, 0, {"name": process}))
        out.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))
    tids: dict[tuple[str, str], int] = {}

    def tid_of(process: str, track: str) -> int:
        if (process, track) not in tids:
            tid = tids[(process, track)] = len(tids) + 1
            pid = pids[process]
            out.append(_meta("thread_name", pid, tid, {"name": track}))
            out.append(_meta("thread_sort_index", pid, tid, {"sort_index": _track_order(track)}))
        return tids[(process, track)]

    # Per track, so that spans and instants of one track come out in time order.
    by_track: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for process, track, spans in sorted(tracks, key=lambda t: (pids[t[0]], _track_order(t[1]))):
        pid, tid = pids[process], tid_of(process, track)
        for span in _merge(spans, cap):
            event = {
                "name": span.name,
                "cat": track.split()[0],
                "ph": "X",
                "ts": _us(span.start_s),
                "dur": max(_us(span.end_s) - _us(span.start_s), 0),
                "pid": pid,
                "tid": tid,
                "args": span.args,
            }
            if span.cname is not None:
                event["cname"] = span.cname
            by_track[tid].append(event)
    for (process, track), points in instants:
        pid, tid = pids[process], tid_of(process, track)
        points.sort(key=lambda p: p[0])
        for t, name, args in _thin(points, cap):
            by_track[tid].append(
                {"name": name, "cat": track, "ph": "i", "s": "t", "ts": _us(t)}
                | {"pid": pid, "tid": tid, "args": args}
            )
    body = [
        event
        for tid in sorted(by_track)
        for event in sorted(by_track[tid], key=lambda e: (e["ts"], -e.get("dur", 0.0)))
    ]
    for name, series in counters:
        keys = ("mean", "max") if name == "staleness" else ("samples",)
        series.sort(key=lambda p: p[0])
        for t, values in _thin(series, cap):
            body.append(
                {"name": name, "ph": "C", "ts": _us(t), "pid": pids[TRAINER]}
                | {"args": dict(zip(keys, values, strict=True))}
            )
    info: dict[str, Any] = {
        "source": "rlaxkit trace.jsonl (rlaxkit.observe.perfetto)",
        "time": "ts and dur in whole microseconds since the run's start",
        "trace_events_read": builder.rows,
        "events_written": len(body),
        "tracks": len(tids),
        "max_events": max_events,
        "max_events_per_track": max_events_per_track,
        "aggregated": (
            {
                "tracks": aggregated,
                "cap_per_track": cap,
                "how": "spans merged k at a time (args.merged = k); instants and "
                "counter points thinned to every k-th, k = ceil(events / cap)",
            }
            if aggregated
            else None
        ),
        "omitted": dict(builder.omitted),
        "colours": "cname by a generation's first weight version (chrome://tracing); "
        "Perfetto colours by slice name, which carries the version",
    }
    if builder.config is not None:
        info["run_config"] = builder.config
    info |= dict(metadata or {})
    return {"traceEvents": out + body, "displayTimeUnit": "ms", "metadata": info}


def _us(seconds: float) -> int:
    """Whole microseconds: a span's end is exactly ``ts + dur``, so spans that touch in
    the trace touch in the file instead of overlapping by a rounding error."""
    return round(seconds * _US)


def _meta(name: str, pid: int, tid: int, args: Mapping[str, object]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _track_order(track: str) -> int:
    """Tracks of a process in this order: its own, parameter server, decode, slots."""
    if track.startswith("slot "):
        return 100 + int(track.split()[1])
    return {"trainer": 0, "worker": 0, "parameter server": 1, "decode": 2}.get(track, 50)


def _thin(points: list, cap: int) -> list:
    """Every ``k``-th point, ``k = ceil(len / cap)``, the last kept one swapped for the
    last point (a counter ends at its final value)."""
    k = math.ceil(len(points) / cap)
    if k <= 1:
        return points
    kept = points[::k]
    kept[-1] = points[-1]
    return kept


_PHASES = {
    "X": ("name", "ts", "dur", "pid", "tid"),
    "B": ("name", "ts", "pid", "tid"),
    "E": ("ts", "pid", "tid"),
    "i": ("name", "ts", "pid", "tid"),
    "C": ("name", "ts", "pid", "args"),
    "M": ("name", "pid", "args"),
}
_METADATA_NAMES = {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}


def validate(document: Mapping[str, object]) -> None:
    """Check a Trace Event Format document against the format's rules that viewers rely
    on; raise ``ValueError`` naming the first event that breaks one.

    The rules: the top level holds ``traceEvents``; each event has the fields its phase
    requires, numbers for ``ts``, a ``dur >= 0``, an instant scope among ``g p t``,
    numeric counter values and a ``cname`` among the named colours this module uses;
    ``B``/``E`` pairs match per track; per track (``pid``, ``tid``; counters by ``pid``
    and name) timestamps never decrease in file order; complete events of a track nest
    or do not overlap; every track with events is named by a ``thread_name`` event.
    """
    events = document.get("traceEvents")
    if not isinstance(events, list):
        raise ValueError("traceEvents: missing or not a list")
    if document.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        raise ValueError(f"displayTimeUnit: must be ms or ns, got {document['displayTimeUnit']}")
    colours = {*VERSION_CNAMES, *STEP_CNAMES, "terrible"}
    last_ts: dict[tuple, float] = {}
    open_ends: dict[tuple, list[float]] = defaultdict(list)  # X ends enclosing the next
    begun: dict[tuple, list[str]] = defaultdict(list)
    named: set[tuple[int, int]] = set()
    used: set[tuple[int, int]] = set()
    for index, event in enumerate(events):
        where = f"traceEvents[{index}] {event!r:.120}"
        phase = event.get("ph")
        if phase not in _PHASES:
            raise ValueError(f"{where}: ph must be one of {sorted(_PHASES)}")
        missing = [k for k in _PHASES[phase] if k not in event]
        if missing:
            raise ValueError(f"{where}: phase {phase} requires {missing}")
        if "cname" in event and event["cname"] not in colours:
            raise ValueError(f"{where}: cname {event['cname']!r} is not a named colour")
        if phase == "M":
            if event["name"] not in _METADATA_NAMES:
                raise ValueError(f"{where}: unknown metadata event")
            if event["name"] == "thread_name":
                named.add((event["pid"], event["tid"]))
            continue
        ts = event["ts"]
        if not isinstance(ts, int | float) or not math.isfinite(ts):
            raise ValueError(f"{where}: ts must be a finite number")
        if phase == "C":
            track: tuple = (event["pid"], "counter", event["name"])
            if not all(isinstance(v, int | float) for v in event["args"].values()):
                raise ValueError(f"{where}: counter values must be numbers")
        else:
            track = (event["pid"], event["tid"])
            used.add(track)
        if ts < last_ts.get(track, -math.inf):
            raise ValueError(f"{where}: ts goes back on track {track}")
        last_ts[track] = ts
        if phase == "X":
            if not isinstance(event["dur"], int | float) or event["dur"] < 0:
                raise ValueError(f"{where}: dur must be a number >= 0")
            ends = open_ends[track]
            while ends and ends[-1] <= ts:
                ends.pop()
            end = ts + event["dur"]
            if ends and end > ends[-1]:
                raise ValueError(f"{where}: overlaps the span before it without nesting")
            ends.append(end)
        elif phase == "i" and event.get("s", "t") not in ("g", "p", "t"):
            raise ValueError(f"{where}: instant scope s must be g, p or t")
        elif phase == "B":
            begun[track].append(event["name"])
        elif phase == "E" and not begun[track]:
            raise ValueError(f"{where}: E without a matching B")
        elif phase == "E":
            begun[track].pop()
    unmatched = {track: names for track, names in begun.items() if names}
    if unmatched:
        raise ValueError(f"B events without an E: {unmatched}")
    if used - named:
        raise ValueError(f"tracks without a thread_name event: {sorted(used - named)}")


def export_perfetto(
    trace: str | os.PathLike | Iterable[TraceEvent | Row],
    path: str | os.PathLike,
    *,
    max_events: int = MAX_EVENTS,
    max_events_per_track: int = MAX_EVENTS_PER_TRACK,
    metadata: Mapping[str, object] | None = None,
) -> PerfettoExport:
    """Write a trace (a ``trace.jsonl`` path, a run directory holding one, or events)
    as a Trace Event Format JSON file at ``path``; see :func:`trace_event_format`."""
    if isinstance(trace, str | os.PathLike):
        source = Path(trace)
        if source.is_dir():
            source = trace_path(source)
        if not source.exists():
            raise FileNotFoundError(f"{source}: no trace.jsonl to export")
        trace = read_rows(source)
    document = trace_event_format(
        trace, max_events=max_events, max_events_per_track=max_events_per_track, metadata=metadata
    )
    path = Path(path)
    # One dumps and one write: json.dump's chunked writes run the pure-Python encoder.
    path.write_text(json.dumps(document, separators=(",", ":")), encoding="utf-8")
    info = document["metadata"]
    return PerfettoExport(
        path=path,
        events=info["events_written"],
        tracks=info["tracks"],
        bytes=path.stat().st_size,
        aggregated_tracks=info["aggregated"]["tracks"] if info["aggregated"] else 0,
    )
