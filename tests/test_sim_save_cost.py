"""A checkpoint save charged by itself: its blocking part and its background write are
fitted from a trace, every other cost from the time away from saves, so a calibration at
one checkpoint interval predicts another."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sim_host import COSTS, _serial

from rlaxkit.rules.trace import MemoryTrace, TraceEvent
from sim import CheckpointSpec, Uniform, calibrate, fit_scenario, simulate, with_overrides
from sim.calibration.fits import MIN_BASELINE_INTERVALS, away_from, fit_save_cost
from sim.calibration.window import window_summary
from sim.host_spec import HOST_COSTS


def _steps(intervals):
    """``train_step`` events ending after each of ``intervals`` (seconds)."""
    ends = np.cumsum(intervals)
    return [
        TraceEvent(
            float(t), "train_step", "trainer", s, {"step": s, "samples": 4, "duration_s": 0.5}
        )
        for s, t in enumerate(ends, 1)
    ], ends


def _save(step, end_s, blocking_s, written_s=None):
    events = [
        TraceEvent(
            end_s, "checkpoint_save", "trainer", step, {"step": step, "duration_s": blocking_s}
        )
    ]
    if written_s is not None:
        fields = {"step": step, "duration_s": written_s - end_s}
        events.append(TraceEvent(written_s, "checkpoint_write", "trainer", step, fields))
    return events


def test_a_saves_cost_is_read_from_the_steps_its_write_spans():
    # Steps 1 s apart; the save after step 10 blocks 0.1 s and its write, which ends in
    # the third interval after it began, adds 0.5 s to each of the three: 1.6 s in all.
    intervals = [
        1.0 + (0.1 if s == 11 else 0.0) + (0.5 if 11 <= s <= 13 else 0.0) for s in range(1, 31)
    ]
    events, ends = _steps(intervals)
    saved = ends[9] + 0.1
    assert fit_save_cost(events + _save(10, saved, 0.1, written_s=ends[12] - 0.2)) == pytest.approx(
        1.6
    )
    # Without its write event the save ended when it returned: its own interval only,
    # against the mean of the 28 others, two of which the write slowed: 1.6 - 29 / 28.
    assert fit_save_cost(events + _save(10, saved, 0.1)) == pytest.approx(1.6 - 29 / 28)
    assert fit_save_cost(events) is None  # no save


@settings(max_examples=60, deadline=None)
@given(
    baseline_s=st.floats(0.01, 10.0),
    blocking_s=st.floats(0.0, 5.0),
    write_s=st.floats(0.0, 20.0),
    spanned=st.integers(1, 4),
    every=st.integers(5, 12),
    steps=st.integers(30, 80),
)
def test_fit_save_cost_gives_back_what_each_save_added(
    baseline_s, blocking_s, write_s, spanned, every, steps
):
    # Equal intervals; after every ``every``-th step a save blocks ``blocking_s`` and its
    # write adds ``write_s`` spread over the ``spanned`` intervals it overlaps.
    intervals = np.full(steps, baseline_s)
    saves = list(range(every, steps - spanned, every))
    for step in saves:
        intervals[step] += blocking_s + write_s / spanned  # the interval after step `step`
        intervals[step + 1 : step + spanned] += write_s / spanned
    events, ends = _steps(intervals)
    for step in saves:
        saved = ends[step - 1] + blocking_s
        events += _save(
            step, saved, blocking_s, written_s=max(saved, ends[step + spanned - 1] - 1e-9)
        )
    away = len(intervals) - 1 - len(saves) * spanned
    cost = fit_save_cost(events)
    if away < MIN_BASELINE_INTERVALS:
        assert cost is None
    else:
        assert cost == pytest.approx(blocking_s + write_s, rel=1e-6, abs=1e-6)


@settings(max_examples=100, deadline=None)
@given(
    spans=st.lists(st.tuples(st.floats(0, 10), st.floats(0, 3)), max_size=4),
    rows=st.lists(st.tuples(st.floats(0, 10), st.floats(0, 3)), min_size=1, max_size=8),
)
def test_away_from_is_no_overlap_with_any_span(spans, rows):
    spans = [(lo, lo + width) for lo, width in spans]
    begins, ends = [lo for lo, _ in rows], [lo + width for lo, width in rows]
    expected = [
        all(end <= lo or begin >= hi for lo, hi in spans)
        for begin, end in zip(begins, ends, strict=True)
    ]
    assert away_from(spans, begins, ends).tolist() == expected


def test_a_simulated_save_blocks_then_writes_in_the_background():
    # ``test_sim_host``'s synchronous host: steps at 0.051, 0.107, 0.163, each push 2 ms.
    # A save after step 2 (push done at 0.109) blocks 4 ms (0.113), then its write 10 ms
    # (0.123); step 3 comes 14 ms later than without it.
    checkpoint = CheckpointSpec(save_s=0.004, background_s=0.010)
    trace = MemoryTrace()
    simulate(_serial(checkpoint=checkpoint, **{"checkpointing.every_steps": 2}), trace=trace)
    events = [
        (round(e.t, 9), e.kind, round(e["duration_s"], 9))
        for e in trace.events
        if e.kind in ("train_step", "checkpoint_save", "checkpoint_write")
    ]
    assert events == [
        (0.051, "train_step", 0.010),
        (0.107, "train_step", 0.010),
        (0.113, "checkpoint_save", 0.004),
        (0.123, "checkpoint_write", 0.010),
        (0.177, "train_step", 0.010),
    ]


def test_a_background_write_slows_the_serial_hosts_work_while_it_runs():
    # As above, but the write takes half the host's time for 20 ms (0.113 to 0.133).
    # Step 3's rounds: the pull (2 ms, the parameter server's) ends at 0.115; issuing
    # 2.4 ms of work takes 4.8 ms (0.1198); the first chunk's 21 ms of work: 6.6 ms of it
    # in the 13.2 ms left of the write, 14.4 ms after it (0.1474, 27.6 ms in all); the
    # rest as without a write, 28.6 ms: step 3 at 0.176.
    checkpoint = CheckpointSpec(save_s=0.004, background_s=0.010, write_s=0.020)
    trace = MemoryTrace()
    simulate(_serial(checkpoint=checkpoint, **{"checkpointing.every_steps": 2}), trace=trace)
    kinds = ("train_step", "checkpoint_save", "checkpoint_write", "decode")
    events = [
        (round(e.t, 9), e.kind, round(e["duration_s"], 9)) for e in trace.events if e.kind in kinds
    ]
    assert events[-5:] == [
        (0.113, "checkpoint_save", 0.004),
        (0.133, "checkpoint_write", 0.020),
        (0.1474, "decode", 0.0276),
        (0.1614, "decode", 0.0136),  # after 0.4 ms of host work
        (0.176, "train_step", 0.010),
    ]


CHECKPOINT = CheckpointSpec(save_s=0.02, background_s=0.06, write_s=0.12, restore_s=0.02)


def _run(every, *, seed=0, steps=40):
    """η = 0, two workers, lengths of 1-12 tokens, a save every ``every`` steps (``None``:
    never) that blocks 20 ms, then writes in the background for 120 ms, taking half the
    host's time (60 ms)."""
    scenario = _serial(
        workers=2, response=Uniform(low=1.0, high=12.0), target_steps=steps, checkpoint=CHECKPOINT
    )
    trace = MemoryTrace()
    simulate(
        with_overrides(scenario, {"checkpointing.every_steps": every, "seed": seed}), trace=trace
    )
    return trace.events


def test_fitted_costs_do_not_depend_on_the_save_interval():
    fits = {every: fit_scenario(_run(every), warmup_steps=3) for every in (None, 4, 8)}
    never = fits[None][0]
    for every in (4, 8):
        scenario, fitted = fits[every]
        for name in HOST_COSTS:  # the chunks and gaps the write slowed are left out
            assert getattr(scenario.host, name) == pytest.approx(
                getattr(never.host, name), abs=1e-9
            )
        assert fitted["trainer_tokens_per_s"] == pytest.approx(8000.0)
        assert fitted["step_overhead_s"] == pytest.approx(0.0, abs=1e-9)
        assert fitted["save_s"] == pytest.approx(0.02)
        assert fitted["save_write_s"] == pytest.approx(0.12)
        # Read from the steps' spacing: one interval's spread of lengths per save.
        assert fitted["save_background_s"] == pytest.approx(0.06, rel=0.1)
    assert never.host.chunk_s == pytest.approx(COSTS["chunk_s"])
    assert fits[None][1].get("save_background_s") is None


@pytest.mark.parametrize("target", [None, 2, 8])
def test_calibrated_on_saves_every_four_steps_predicts_another_interval(target):
    prediction = calibrate(
        _run(4),
        warmup_steps=3,
        overrides={"checkpointing.every_steps": target},
        simulated_steps=40,
        repeats=3,
    )
    measured = window_summary(_run(target, seed=5), 3).samples_per_s
    assert prediction.predicted_figures["samples_per_s"] == pytest.approx(measured, rel=0.03)
