"""``runtime.overlap_training``: the rounds of the next batch run while the trainer takes
a step. Such a run repeats bit for bit, trains rollouts at most one version older than
the serial run's, resumes as the uninterrupted run, and replays a fault plan without
losing an accepted rollout."""

import threading

import pytest
from test_runtime import SMALL, learning_metrics

from rlaxkit.config.run import small_run_config
from rlaxkit.observe.perfetto import trace_event_format
from rlaxkit.rules.fault_plan import Fault, FaultPlan
from rlaxkit.rules.trace import MemoryTrace, step_span
from rlaxkit.runtime import Experiment
from rlaxkit.runtime.trainer_client import beside
from sim import fit_scenario

OVERLAP = [*SMALL, "runtime.overlap_training=true", "staleness.max_staleness=1"]


def run_steps(config, steps, **kwargs):
    """Steps one at a time, checking the books after each; returns the experiment's
    learning metrics and the events of its trace."""
    with Experiment(config, **kwargs) as exp:
        for _ in range(steps):
            exp.step()
            exp.check_accounting()
        return learning_metrics(exp.history), list(exp.trace.memory.events)


def test_an_overlapped_run_repeats_and_trains_on_the_weights_before_each_step(cache):
    config = small_run_config(*OVERLAP)
    first, events = run_steps(config, 4, cache_dir=cache)
    again, _ = run_steps(config, 4, cache_dir=cache)
    assert first == again  # a count ends the rounds ahead, never the clock
    serial, serial_events = run_steps(
        small_run_config(*SMALL, "staleness.max_staleness=1"), 4, cache_dir=cache
    )
    assert first != serial
    assert not any("after_s" in e.fields for e in serial_events if e.kind == "train_step")
    # Every step after the first trains a batch generated while the step before it ran.
    assert all(m["rounds/ahead"] > 0 for m in first)
    assert [m["staleness/max"] for m in first[1:]] == [1, 1, 1]
    # Each step's push waits for its rounds: between two pushes, the rounds sampled
    # the previous version only.
    pushes = [e for e in events if e.kind == "push"]
    assert [e.version for e in pushes] == [0, 1, 2, 3, 4]
    for before, after in zip(pushes, pushes[1:], strict=False):
        sampled = {
            e.version for e in events if e.kind == "generation_end" and before.t <= e.t <= after.t
        }
        assert sampled <= {before.version}, (before.version, sampled)
    # Each step's compute ran after the previous step's event and before its own, which
    # says how long after the compute it came (``after_s``); a serial step says nothing.
    steps = [e for e in events if e.kind == "train_step"]
    for before, step in zip(steps, steps[1:], strict=False):
        start, end = step_span(step)
        assert before.t <= start < end <= step.t and step["after_s"] >= 0
    # A timeline draws the compute there, not at the event.
    trace = MemoryTrace()
    trace.record(5.0, "train_step", "trainer", 1, step=1, samples=1, duration_s=1.5, after_s=2.0)
    (span,) = [e for e in trace_event_format(trace)["traceEvents"] if e["ph"] == "X"]
    assert (span["ts"], span["dur"]) == (1_500_000, 1_500_000)
    # The simulator models these rounds, but fits its serial host from one thread's
    # time line: it refuses such a trace and says what to do instead.
    with pytest.raises(ValueError, match="overlap_training=false, then simulate"):
        fit_scenario(events)


def test_a_resumed_overlapped_run_is_the_uninterrupted_run(cache, tmp_path):
    config = small_run_config(*OVERLAP, "steps=4", "checkpoint.every_steps=2")
    with Experiment(config, run_dir=tmp_path / "whole", cache_dir=cache) as exp:
        exp.run()
        whole = learning_metrics(exp.history)
    with Experiment(config, run_dir=tmp_path / "parts", cache_dir=cache) as exp:
        exp.run(3)  # stops one step past the checkpoint of step 2
    with Experiment(config, run_dir=tmp_path / "parts", cache_dir=cache) as exp:
        assert exp.resumed_from == 2
        exp.run()
        assert learning_metrics(exp.history) == whole


def test_a_fault_plan_replays_and_loses_nothing_accepted_with_rounds_ahead(cache, tmp_path):
    plan = FaultPlan(
        (
            Fault(kind="preempt_worker", target="worker-1", at_s=3.0, restart_after_s=2.0),
            Fault(kind="preempt_trainer", at_step=3, restart_after_s=1.0),
            Fault(kind="kill_param_server", at_s=9.0, restart_after_s=1.0),
        )
    )
    config = small_run_config(*OVERLAP, "steps=5", "checkpoint.every_steps=2")
    runs = []
    for name in ("a", "b"):
        with Experiment(config, run_dir=tmp_path / name, cache_dir=cache, faults=plan) as exp:
            exp.run()
            exp.check_accounting()
            summary = exp.summary()
            runs.append(learning_metrics(exp.history))
        assert summary["steps"] == 5 and summary["accepted_lost"] == 0
        assert summary["lost_steps"] == 1  # step 3: the trainer restored checkpoint 2
        assert summary["preemptions"] == {"worker": 1, "slice": 0, "trainer": 1, "param_server": 1}
    assert runs[0] == runs[1]
    assert sum(m["rounds/ahead"] for m in runs[0]) > 0


def test_overlap_needs_a_staleness_bound_and_the_deterministic_mode():
    with pytest.raises(ValueError, match="overlap_training needs staleness.max_staleness >= 1"):
        small_run_config("runtime.overlap_training=true", "staleness.max_staleness=0")
    with pytest.raises(ValueError, match="mode=deterministic"):
        small_run_config("runtime.overlap_training=true", "runtime.mode=concurrent")
    with pytest.raises(ValueError, match="overlap_training"):
        small_run_config("runtime.overlap_training=3")


def test_beside_returns_after_both_and_raises_either_error():
    seen = []

    def side(stop):
        seen.append(threading.current_thread() is not threading.main_thread())

    assert beside(lambda: 7, side, threading.Event()) == 7
    assert seen == [True]

    def failing_side(stop):
        raise KeyError("side")

    with pytest.raises(KeyError, match="side"):
        beside(lambda: 7, failing_side, threading.Event())

    # A failing main sets ``stop``; the side returns early and is joined first.
    stop, stopped = threading.Event(), []

    def waiting_side(stop):
        stopped.append(stop.wait(10.0))

    def failing_main():
        raise FloatingPointError("main")

    with pytest.raises(FloatingPointError, match="main"):
        beside(failing_main, waiting_side, stop)
    assert stopped == [True]
