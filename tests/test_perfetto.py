"""Perfetto / Chrome trace export: the format's rules on a real and simulated traces, the
hand-derived spans of the toy scenario, the caps, and ``rlaxkit trace``.

``fixtures/tiny_run_trace.jsonl`` is the trace of a real local run, written by
``Experiment(small_run_config(), run_dir=...).run(3)`` (the run of
``test_plotting.py::test_plot_writes_png_files_for_a_real_local_run``, 12 s; that slow
test exports its own fresh trace too).
"""

import json
from collections import Counter
from pathlib import Path

import pytest

import sim
from rlaxkit.cli import main
from rlaxkit.observe.perfetto import export_perfetto, trace_event_format, validate
from rlaxkit.rules.fault_plan import Fault, FaultPlan
from rlaxkit.rules.trace import MemoryTrace, read_trace

REAL_TRACE = Path(__file__).parent / "fixtures" / "tiny_run_trace.jsonl"


def spans(document, name_prefix=""):
    return [
        e for e in document["traceEvents"] if e["ph"] == "X" and e["name"].startswith(name_prefix)
    ]


def track_names(document):
    names = {}
    for event in document["traceEvents"]:
        if event["ph"] == "M" and event["name"] == "thread_name":
            names[(event["pid"], event["tid"])] = event["args"]["name"]
    return names


def test_real_run_trace_exports_by_the_rules(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "trace.jsonl").write_bytes(REAL_TRACE.read_bytes())
    assert main(["trace", str(run), "-o", str(tmp_path / "run.perfetto.json")]) == 0
    assert "ui.perfetto.dev" in capsys.readouterr().out
    document = json.loads((tmp_path / "run.perfetto.json").read_text())
    validate(document)
    assert document["displayTimeUnit"] == "ms"
    events = read_trace(REAL_TRACE)
    kinds = Counter(e.kind for e in events)
    # Every completed generation, train step, push, pull and decode chunk is a span.
    assert len(spans(document, "gen v")) == kinds["generation_end"]
    assert len(spans(document, "step ")) == kinds["train_step"]
    assert len(spans(document, "push v")) == kinds["push"]
    assert len(spans(document, "pull v")) == kinds["pull"]
    assert len(spans(document, "decode")) == kinds["decode"]
    names = track_names(document)
    assert {"trainer", "parameter server", "worker", "decode", "slot 0"} <= set(names.values())
    # A train step's span ends at its event's time and lasts its duration_s.
    step = next(e for e in events if e.kind == "train_step")
    (drawn,) = [e for e in spans(document, "step ") if e["args"]["step"] == step["step"]]
    assert drawn["ts"] == round((step.t - step["duration_s"]) * 1e6)
    assert drawn["ts"] + drawn["dur"] == round(step.t * 1e6)
    metadata = document["metadata"]
    assert metadata["omitted"] == {"reward": kinds["reward"]}
    assert metadata["aggregated"] is None
    assert metadata["trace_events_read"] == len(events)


def test_toy_spans_and_counters_are_the_hand_derived_ones():
    # toy: a 0.5 s pull, two 10-token generations of 1.5 s (0.5 s prefill + 10 x 0.1 s),
    # a 0.25 s reward, a 1.5 s step (30 tokens at 20 tokens/s), a 1 s push, again.
    trace = MemoryTrace()
    sim.simulate(sim.presets.toy(target_steps=2), trace=trace)
    document = trace_event_format(trace)
    validate(document)
    names = track_names(document)

    def drawn(prefix):
        return sorted(
            (names[(e["pid"], e["tid"])], e["name"], e["ts"], e["dur"])
            for e in spans(document, prefix)
        )

    assert drawn("gen") == [
        ("slot 0", "gen v0", 500_000, 1_500_000),
        ("slot 0", "gen v1", 5_250_000, 1_500_000),
        ("slot 1", "gen v0", 500_000, 1_500_000),
        ("slot 1", "gen v1", 5_250_000, 1_500_000),
    ]
    assert drawn("step") == [
        ("trainer", "step 1", 2_250_000, 1_500_000),
        ("trainer", "step 2", 7_000_000, 1_500_000),
    ]
    assert drawn("push") == [
        ("parameter server", "push v1", 3_750_000, 1_000_000),
        ("parameter server", "push v2", 8_500_000, 1_000_000),
    ]
    assert drawn("pull") == [
        ("worker", "pull v0", 0, 500_000),
        ("worker", "pull v1", 4_750_000, 500_000),
    ]
    cnames = {e["name"]: e["cname"] for e in spans(document, "gen")}
    assert cnames["gen v0"] != cnames["gen v1"]  # colour by weight version

    def counter(name):
        return [(e["ts"], e["args"]) for e in document["traceEvents"] if e.get("name") == name]

    # Two samples generated at 2.0 s wait for the step that ends at 3.75 s.
    assert counter("buffer (samples)")[:3] == [
        (2_000_000, {"samples": 1}),
        (2_000_000, {"samples": 2}),
        (3_750_000, {"samples": 0}),
    ]
    assert counter("staleness") == [
        (3_750_000, {"mean": 0.0, "max": 0.0}),
        (8_500_000, {"mean": 0.0, "max": 0.0}),
    ]


def test_preemption_cuts_generations_and_shows_as_instants():
    plan = FaultPlan([Fault(at_s=1.0, kind="preempt_worker", target="worker-0")])
    trace = MemoryTrace()
    sim.simulate(sim.presets.toy(target_steps=2, fault_plan=plan), trace=trace)
    document = trace_event_format(trace)
    validate(document)
    names = track_names(document)
    instants = {
        (names[(e["pid"], e["tid"])], e["name"], e["ts"])
        for e in document["traceEvents"]
        if e["ph"] == "i"
    }
    assert ("worker", "preemption", 1_000_000) in instants
    assert ("worker", "restart", 4_000_000) in instants  # fleet.restart_s = 3 s
    aborted = spans(document, "gen v0 (aborted)")
    assert [(e["ts"], e["dur"], e["cname"]) for e in aborted] == [
        (500_000, 500_000, "terrible"),
        (500_000, 500_000, "terrible"),
    ]


def test_a_simulated_fleet_with_preemptions_exports_by_the_rules(tmp_path):
    trace = MemoryTrace()
    scenario = sim.presets.rlax_like(inference_chips=64, hours=1.0)
    scenario = sim.with_overrides(scenario, {"preemptions.worker_mtbf_s": 3600.0})
    result = sim.simulate(scenario, trace=trace)
    written = export_perfetto(
        trace, tmp_path / "sim.perfetto.json", metadata={"sim_result": result.to_row()}
    )
    document = json.loads(written.path.read_text())
    validate(document)
    assert written.events == document["metadata"]["events_written"]
    assert document["metadata"]["sim_result"] == result.to_row()
    kinds = Counter(e.kind for e in trace)
    assert kinds["preemption"] > 0
    instants = Counter(e["name"] for e in document["traceEvents"] if e["ph"] == "i")
    assert instants["preemption"] == kinds["preemption"]
    assert instants["restart"] == kinds["restart"]
    # Slot tracks of one worker: no more than its slots (spans of a track never overlap).
    slots = Counter(
        e["pid"] for e in document["traceEvents"] if e["ph"] == "M" and "slot" in str(e["args"])
    )
    assert max(slots.values()) <= scenario.fleet.slots_per_worker


@pytest.mark.parametrize(("per_track", "total"), [(3, 10_000), (50, 400)])
def test_caps_merge_spans_and_say_so(per_track, total):
    trace = read_trace(REAL_TRACE)
    document = trace_event_format(trace, max_events=total, max_events_per_track=per_track)
    validate(document)
    body = [e for e in document["traceEvents"] if e["ph"] != "M"]
    assert len(body) <= total
    per = Counter((e["pid"], e.get("tid"), e["name"] if e["ph"] == "C" else "") for e in body)
    cap = document["metadata"]["aggregated"]["cap_per_track"]
    assert cap <= per_track and max(per.values()) <= cap
    merged = [e for e in body if e["ph"] == "X" and "merged" in e["args"]]
    assert all("×" in e["name"] for e in merged)
    assert bool(merged) == (cap < 4)  # a slot track of this run holds 4 generations
    # Merging keeps the generated tokens and the time covered.
    generations = [e for e in body if e.get("cat") == "slot"]
    assert sum(e["args"].get("tokens", 0) for e in generations) == sum(
        e["tokens"] for e in trace if e.kind == "generation_end"
    )
    full = trace_event_format(trace)
    assert min(e["ts"] for e in spans(document)) == min(e["ts"] for e in spans(full))
    end = max(e["ts"] + e["dur"] for e in spans(full))
    assert max(e["ts"] + e["dur"] for e in spans(document)) == end


@pytest.mark.parametrize(
    ("event", "message"),
    [
        ({"name": "a", "ph": "X", "ts": 0, "dur": -1, "pid": 1, "tid": 1}, "dur"),
        ({"name": "a", "ph": "X", "ts": 0, "pid": 1, "tid": 1}, "requires"),
        ({"name": "a", "ph": "Q", "ts": 0, "pid": 1, "tid": 1}, "ph must be"),
        ({"name": "a", "ph": "i", "ts": 0, "s": "x", "pid": 1, "tid": 1}, "scope"),
        ({"name": "a", "ph": "B", "ts": 0, "pid": 1, "tid": 1}, "without an E"),
        ({"ph": "E", "ts": 0, "pid": 1, "tid": 1}, "without a matching B"),
        ({"name": "a", "ph": "X", "ts": 1, "dur": 1, "pid": 1, "tid": 2}, "thread_name"),
        ({"name": "c", "ph": "C", "ts": 1, "pid": 1, "args": {"v": "x"}}, "numbers"),
    ],
)
def test_validate_names_the_broken_rule(event, message):
    named = {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "t"}}
    with pytest.raises(ValueError, match=message):
        validate({"traceEvents": [named, event]})


@pytest.mark.parametrize(
    ("second", "message"),
    [
        ({"ts": 5, "dur": 1}, "goes back"),
        ({"ts": 15, "dur": 10}, "overlaps"),
    ],
)
def test_validate_checks_order_and_nesting_per_track(second, message):
    named = {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "t"}}
    first = {"name": "a", "ph": "X", "ts": 10, "dur": 10, "pid": 1, "tid": 1}
    with pytest.raises(ValueError, match=message):
        validate({"traceEvents": [named, first, {**first, **second}]})
    nested = {**first, "ts": 12, "dur": 3}
    validate({"traceEvents": [named, first, nested]})


def test_trace_of_a_directory_without_a_trace_exits_2(tmp_path, capsys):
    assert main(["trace", str(tmp_path)]) == 2
    assert "no trace.jsonl" in capsys.readouterr().err


def test_a_bad_line_is_named(tmp_path):
    (tmp_path / "trace.jsonl").write_text('{"t": 0, "kind": "nap", "actor": "a"}\n')
    with pytest.raises(ValueError, match=r"trace.jsonl:1: kind 'nap'"):
        export_perfetto(tmp_path, tmp_path / "out.json")
