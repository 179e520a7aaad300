"""The simulated parameter server's delta publication: bytes and times by hand.

The toy preset (see tests/test_sim_events.py): 100-byte weights, pushes at 100 B/s,
pulls at 200 B/s. With ``delta_changed_fraction = 0.5`` and ``snapshot_every = 2``:

- pushes alternate delta and snapshot, the initial weights counting as a snapshot:
  version 1 moves 50 B (0.5 s), version 2 all 100 B (1 s), version 3 50 B again;
- a worker one version behind moves 1 - 0.5 = 0.5 of the bytes (0.25 s), two behind
  1 - 0.5² = 0.75; one holding nothing moves all of them (0.5 s).
"""

import pytest

from rlaxkit.rules.trace import MemoryTrace
from sim import presets, simulate
from sim.specs import ParamServerSpec

DELTA = {"param_server.delta_changed_fraction": 0.5, "param_server.snapshot_every": 2}


def _transfers(trace):
    return [
        (round(e.t, 9), e.kind, e.version, e["bytes"])
        for e in trace.events
        if e.kind in ("push", "pull")
    ]


def test_synchronous_toy_moves_deltas_and_snapshots():
    trace = MemoryTrace()
    simulate(presets.toy(target_steps=3, **DELTA), trace=trace)
    # Step 1 ends at 3.75 s as without deltas (tests/test_sim_events.py); each later
    # step costs pull + 0.5 prefill + 1 decode + 0.25 reward + 1.5 train + push.
    assert _transfers(trace) == [
        (0.5, "pull", 0, 100.0),  # holds nothing: every byte
        (4.25, "push", 1, 50.0),  # 3.75 + 0.5: a delta
        (4.5, "pull", 1, 50.0),  # one behind: 0.25 s
        (8.75, "push", 2, 100.0),  # 4.5 + 3.25 -> 7.75 + 1: a snapshot
        (9.0, "pull", 2, 50.0),  # still one behind: the snapshot costs the push only
        (12.75, "push", 3, 50.0),  # 9.0 + 3.25 -> 12.25 + 0.5
    ]


def test_without_deltas_every_transfer_moves_the_whole_version():
    trace = MemoryTrace()
    simulate(presets.toy(target_steps=2), trace=trace)
    assert {e["bytes"] for e in trace.events if e.kind in ("push", "pull")} == {100}


def test_a_worker_further_behind_moves_the_union_of_the_changes():
    trace = MemoryTrace()
    # The worker pulls only when it lags 2 versions: 1 - 0.5² = 0.75 of the bytes.
    scenario = presets.toy(
        target_steps=6,
        **DELTA,
        **{"staleness.max_staleness": 100, "staleness.max_worker_lag": 1},
    )
    simulate(scenario, trace=trace)
    pulls = [(e.version, e["from_version"], e["bytes"]) for e in trace.events if e.kind == "pull"]
    assert pulls == [(0, None, 100.0), (2, 0, 75.0), (4, 2, 75.0)]


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan")])
def test_a_bad_changed_fraction_names_the_field(fraction):
    with pytest.raises(ValueError, match="delta_changed_fraction"):
        ParamServerSpec(
            weight_bytes=1.0,
            push_bytes_per_s=1.0,
            pull_bytes_per_s=1.0,
            delta_changed_fraction=fraction,
        )
    with pytest.raises(ValueError, match="snapshot_every"):
        ParamServerSpec(weight_bytes=1, push_bytes_per_s=1, pull_bytes_per_s=1, snapshot_every=0)
