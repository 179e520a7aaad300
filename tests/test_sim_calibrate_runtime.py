"""Calibrated on one real local run, the simulator predicts the throughput of another.

Short runs of the deterministic local runtime (the tiny ``config.SMALL_RUN`` model) at
η = 1 and η = 0, three times each, alternating, and a fourth η = 1 run last. ``sim.calibrate``
fits the serial host model (``sim/entities/host.py``) to each η = 1 trace and predicts
samples/s over the measured window (after the compiling first steps): each η = 1 run
itself, the best within 10%, and η = 0: each η = 0 run is set against the mean of the
predictions of the η = 1 runs before and after it, and the median of those three errors
must be within 25%. (Three of
each, because on a loaded machine one run differs from the next by several percent:
one pair's error spread about ±10% around +2% over 15 pairs, a CI run under load once
measured η = 0 at 832 and 949 samples/s, and with two of each a full suite once
measured both η = 0 runs slowed, at 731 and 664 against 881 predicted: +20%, where the
same module alone erred by +1%. Medians, not the best of each: contention slows the
η = 1 runs the predictions come from as well, and one of them spared is the best
prediction. A clean-clone CI run predicted 767, 977 and 769 against 738, 797 and 650
measured: +23% best to best, +4% median to median; nine runs of the module, alone
or in a suite, erred by -12% to +10% median to median, where best to best two
of them failed. The ≤ 10% goal on longer windows is `benchmarks/sim_fidelity.py`'s.)
η = 0 runs about three times as many rounds per step as η = 1 (each on one worker
instead of two); on the same traces the per-token fleet model (``executor="parallel"``)
predicts η = 0 16-20% low and η = 1 itself 16-19% high.

The runs are timed on the process's CPU clock instead of the wall clock: a window
lasts about 0.3 s, and on a machine shared with other jobs the wall time of so short a
window says more about them than about the run (repeated η = 1 runs under load
measured 670 to 1620 samples/s on the wall clock, 1480 to 1680 on the CPU clock).
Calibration reads durations on whatever clock the trace carries. And a full
collection of the test session's heap takes ~100 ms at a moment nobody chooses, so
each run starts with the objects that exist before it frozen (``gc.freeze``); the
run's own collections still count.
"""

import itertools
import statistics

import pytest

import sim
from rlaxkit.config.run import small_run_config
from rlaxkit.rules.trace import TraceEvent
from rlaxkit.runtime.record import record_local_run
from sim.calibration.window import window_summary

pytestmark = pytest.mark.slow  # nine real runs, ~18 s with a warm compilation cache

STEPS = 30
REPEATS = 3
WARMUP_STEPS = 3  # the first train step compiles; so may the first chunks of a shape


def _run(cache, steps: int, *overrides: str) -> list[TraceEvent]:
    """A run's trace on the CPU clock (``rlaxkit.runtime.record.record_local_run``: run again if
    its window compiled a program)."""
    # The CPU clock adds up the threads' seconds: chunks one after another.
    config = small_run_config("runtime.threaded_chunks=false", *overrides)
    events, _ = record_local_run(
        config, steps, warmup_steps=WARMUP_STEPS, clock="cpu", cache_dir=cache
    )
    return events


@pytest.fixture(scope="module")
def traces(cache):
    # Throw-away runs first, so that the warm start and the decode programs'
    # compilations stay out of the measured runs: a process compiles a prefill and a
    # row fetch per bucket of prompts started and rows finished, and at η = 0 a chunk
    # starts every count of prompts from 1 to 4.
    _run(cache, 8, "staleness.max_staleness=0")
    _run(cache, 4, "staleness.max_staleness=1")
    # η = 1, 0, 1, 0, 1, 0, 1: every η = 0 run between two η = 1 runs.
    runs = {1: [], 0: []}
    for _ in range(REPEATS):
        for eta in (1, 0):
            runs[eta].append(_run(cache, STEPS, f"staleness.max_staleness={eta}"))
    runs[1].append(_run(cache, STEPS, "staleness.max_staleness=1"))
    return runs


def test_runtime_records_one_decode_event_per_chunk(traces):
    for events in (traces[1][0], traces[0][0]):
        chunks = [e for e in events if e.kind == "decode"]
        chunk_steps = events[0]["config"]["runtime"]["chunk_steps"]
        assert chunks and all(e.actor.startswith("worker-") for e in chunks)
        assert all(0 < e["steps"] <= chunk_steps for e in chunks)
        assert all(e["started"] <= e["rows"] and e["finished"] <= e["rows"] for e in chunks)
        # Every issued sequence is prefilled by its worker's next chunk.
        issued = sum(1 for e in events if e.kind == "generation_start")
        assert sum(e["started"] for e in chunks) == issued
        ended = sum(1 for e in events if e.kind == "generation_end")
        assert ended <= sum(e["finished"] for e in chunks) <= issued


def _error(predicted: float, measured: float) -> float:
    return predicted / measured - 1.0


def test_calibration_predicts_its_own_run(traces):
    # Best of three within 10 %, as for η = 0 below: a full suite once slowed one of them
    # to an error of 10.5 %. None may be off by a fifth.
    errors = []
    for events in traces[1][:REPEATS]:
        result = sim.calibrate(events, warmup_steps=WARMUP_STEPS)
        print("\n" + result.report())
        assert result.scenario.host.serial  # the local deterministic trace: host model
        errors.append(abs(result.errors()["samples_per_s"]))
    assert min(errors) < 0.10 and max(errors) < 0.20, errors


def test_calibration_on_eta_one_predicts_eta_zero(traces):
    results = [
        sim.calibrate(events, warmup_steps=WARMUP_STEPS, overrides={"staleness.max_staleness": 0})
        for events in traces[1]
    ]
    predicted = [r.predicted_window.samples_per_s for r in results]
    measured = [window_summary(events, WARMUP_STEPS).samples_per_s for events in traces[0]]
    print(f"\nη=0 samples/s: measured {measured}, predicted {predicted}")
    assert all(r.predicted.max_staleness == 0 for r in results)
    # Each η = 0 run against the mean of the predictions of the two η = 1 runs around it,
    # the median of the three errors within a quarter. Nine runs on a quiet machine read
    # -12 % to +10 % median to median; under a full suite the machine's speed swings
    # within seconds. One suite measured η = 0 at 376, 470 and 361 samples/s against 518,
    # 389 and 499 predicted by the η = 1 run before each (+38 %, -17 %, +38 %): the
    # runs of a pair saw different loads. Bracketed, a linear drift of the machine's
    # speed cancels and the rest halves in variance (+21 % and -6 % for the first two).
    bracketed = [(a + b) / 2 for a, b in itertools.pairwise(predicted)]
    errors = sorted(_error(p, m) for p, m in zip(bracketed, measured, strict=True))
    assert abs(statistics.median(errors)) < 0.25, errors
