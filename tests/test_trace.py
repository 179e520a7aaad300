"""The trace schema: validation, JSONL writer/reader, and the shared helpers."""

import json

import pytest

from rlaxkit.rules.trace import (
    KINDS,
    JsonlTraceWriter,
    MemoryTrace,
    TraceEvent,
    drop_counts,
    durations,
    generation_records,
    read_trace,
    staleness_distribution,
    summarize,
)


def _events():
    trace = MemoryTrace()
    trace.record(0.0, "run_start", "trainer", 0, config={"num_workers": 1})
    trace.record(1.0, "generation_start", "worker-0", 0, sample="0/0", prompt_tokens=4, occupancy=1)
    trace.record(1.0, "generation_start", "worker-0", 0, sample="0/1", prompt_tokens=4, occupancy=2)
    trace.record(3.0, "generation_end", "worker-0", 0, sample="0/0", tokens=10)
    trace.record(4.0, "generation_end", "worker-0", 1, sample="0/1", tokens=30, first_version=0)
    trace.record(4.5, "reward", "verifier", 1, sample="0/1", duration_s=0.5)
    trace.record(6.0, "train_step", "trainer", 1, step=1, samples=2, tokens=48, duration_s=1.5,
                 staleness=[0, 1])  # fmt: skip
    trace.record(7.0, "push", "trainer", 1, duration_s=1.0)
    trace.record(8.0, "drop", "buffer", 0, reason="stale")
    trace.record(10.0, "train_step", "trainer", 2, step=2, samples=2, tokens=52, duration_s=2.0,
                 staleness=[1, 1])  # fmt: skip
    return trace.events


def test_kinds_are_the_closed_set():
    assert {"generation_start", "generation_end", "train_step", "push", "pull"} <= KINDS
    assert {"checkpoint_save", "checkpoint_restore", "preemption", "restart", "drop"} <= KINDS


@pytest.mark.parametrize(
    ("event", "field"),
    [
        ({"t": 0, "kind": "nap", "actor": "trainer"}, "kind"),
        ({"t": -1, "kind": "push", "actor": "trainer", "duration_s": 1}, "t"),
        ({"t": 0, "kind": "push", "actor": "", "duration_s": 1}, "actor"),
        ({"t": 0, "kind": "push", "actor": "trainer"}, "duration_s"),
        ({"t": 0, "kind": "drop", "actor": "buffer", "version": "3", "reason": "x"}, "version"),
        ({"kind": "push", "actor": "trainer", "duration_s": 1}, "t"),
    ],
)
def test_validation_names_the_field(event, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        TraceEvent.from_dict(event)


def test_dict_round_trip_is_flat():
    event = TraceEvent(2.5, "pull", "worker-1", 3, {"duration_s": 0.2, "bytes": 10})
    data = event.to_dict()
    assert data == {"t": 2.5, "kind": "pull", "actor": "worker-1", "version": 3,
                    "duration_s": 0.2, "bytes": 10}  # fmt: skip
    assert TraceEvent.from_dict(json.loads(event.to_json())) == event


def test_jsonl_writer_appends_and_flushes(tmp_path):
    path = tmp_path / "run.jsonl"
    with JsonlTraceWriter(path) as writer:
        writer.record(0.0, "run_start", "trainer", 0)
        # Flushed per line: readable while the writer is still open.
        assert len(read_trace(path)) == 1
    with JsonlTraceWriter(path) as writer:
        writer.record(1.0, "restart", "worker-0")
    assert [e.kind for e in read_trace(path)] == ["run_start", "restart"]


def test_reader_reports_line_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t": 0, "kind": "restart", "actor": "a"}\n{"t": 1, "kind": "oops"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: "):
        read_trace(path)


def test_memory_trace_writes_jsonl(tmp_path):
    events = _events()
    trace = MemoryTrace()
    for event in events:
        trace.emit(event)
    trace.write(tmp_path / "m.jsonl")
    assert read_trace(tmp_path / "m.jsonl") == events


def test_helpers():
    events = _events()
    summary = summarize(events)
    # From t=0 to the last train_step at t=10: 4 samples, 100 tokens, 40 generated.
    assert summary.duration_s == 10.0
    assert summary.steps == 2
    assert summary.samples_per_s == pytest.approx(0.4)
    assert summary.tokens_per_s == pytest.approx(10.0)
    assert summary.generated_tokens_per_s == pytest.approx(4.0)
    assert staleness_distribution(events) == {0: 1, 1: 3}
    assert drop_counts(events) == {"stale": 1}
    assert durations(events, "train_step") == [1.5, 2.0]
    with pytest.raises(ValueError, match="kind:"):
        durations(events, "nap")


def test_generation_records_join_start_and_end():
    records = generation_records(_events())
    assert [(r.sample, r.latency_s, r.tokens, r.occupancy) for r in records] == [
        ("0/0", 2.0, 10, 1),
        ("0/1", 3.0, 30, 2),
    ]
    assert not records[0].interrupted
    assert records[1].interrupted  # tokens from versions 0 and 1
