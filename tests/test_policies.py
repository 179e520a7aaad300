"""Unit and property tests of the shared, JAX-free policies (rlaxkit.rules.policies)."""

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlaxkit.rules.policies import (
    CheckpointPolicy,
    StalenessPolicy,
    WeightSyncPolicy,
    policy_from_dict,
    policy_to_dict,
)


def test_policies_trace_faults_import_neither_jax_nor_simpy():
    code = (
        "import sys, rlaxkit.rules.policies, rlaxkit.rules.trace, rlaxkit.rules.fault_plan;"
        "bad = [m for m in ('jax', 'simpy', 'flax') if m in sys.modules];"
        "sys.exit(repr(bad) if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_capacity_is_areal_formula():
    # η=1, B=4, version 0: (1 + 0 + 1) * 4 - (4 + 3) = 1 more generation may start.
    policy = StalenessPolicy(max_staleness=1, batch_size=4)
    assert policy.capacity(accepted=4, running=3, trainer_version=0) == 1
    assert policy.can_start_generation(4, 3, 0)
    assert not policy.can_start_generation(4, 4, 0)
    # After one step the bound grows by one batch: (1 + 1 + 1) * 4 - 8 = 4.
    assert policy.capacity(accepted=4, running=4, trainer_version=1) == 4


def test_max_concurrent_caps_running():
    policy = StalenessPolicy(max_staleness=8, batch_size=4, max_concurrent=2)
    assert policy.capacity(accepted=0, running=1, trainer_version=0) == 1
    assert not policy.can_start_generation(0, 2, 0)


def test_synchronous_admits_one_batch_per_version():
    policy = StalenessPolicy(max_staleness=0, batch_size=3)
    assert [policy.can_start_generation(0, r, 0) for r in range(4)] == [True] * 3 + [False]
    # All three accepted, none consumed yet: nothing more until the version moves.
    assert not policy.can_start_generation(3, 0, 0)
    assert policy.capacity(3, 0, 1) == 3


def test_staleness_counts_from_oldest_version():
    policy = StalenessPolicy(max_staleness=2, batch_size=1)
    assert policy.staleness((5, 7), trainer_version=8) == 3
    assert policy.drop_reason((5, 7), 8) == "stale"
    assert policy.drop_reason((6, 7), 8) is None
    assert policy.admits(6, 8)
    assert not policy.admits(5, 8)


def test_rollout_newer_than_trainer_is_dropped():
    policy = StalenessPolicy(max_staleness=4, batch_size=1)
    assert policy.drop_reason(5, trainer_version=3) == "future_version"
    assert policy.drop_reason((2, 5), trainer_version=3) == "future_version"


def test_must_pull():
    policy = StalenessPolicy(batch_size=1, max_worker_lag=1)
    assert policy.must_pull(None, 0)
    assert not policy.must_pull(4, 5)
    assert policy.must_pull(3, 5)
    assert policy.must_pull(6, 5)  # ahead of the store: discarded branch


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_staleness": -1, "batch_size": 1}, "max_staleness"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 1.5}, "batch_size"),
        ({"batch_size": 2, "max_concurrent": 0}, "max_concurrent"),
        ({"batch_size": 2, "max_worker_lag": -2}, "max_worker_lag"),
    ],
)
def test_staleness_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        StalenessPolicy(**kwargs)


def test_weight_sync():
    policy = WeightSyncPolicy(push_every_steps=3)
    assert [s for s in range(1, 10) if policy.should_push(s)] == [3, 6, 9]
    assert not policy.interrupts_generation
    assert WeightSyncPolicy(pull_mode="in_flight").interrupts_generation
    with pytest.raises(ValueError, match="pull_mode:.*between_requests"):
        WeightSyncPolicy(pull_mode="sometimes")
    with pytest.raises(ValueError, match="push_every_steps:"):
        WeightSyncPolicy(push_every_steps=0)


def test_checkpoint_policy():
    by_steps = CheckpointPolicy(every_steps=5)
    assert not by_steps.should_save(4, 100.0, 0, 0.0)
    assert by_steps.should_save(5, 1.0, 0, 0.0)
    assert not by_steps.should_save(5, 1.0, 5, 0.0)
    by_time = CheckpointPolicy(every_s=60.0)
    assert not by_time.should_save(3, 59.0, 0, 0.0)
    assert by_time.should_save(3, 60.0, 0, 0.0)
    both = CheckpointPolicy(every_steps=100, every_s=10.0)
    assert both.should_save(1, 10.0, 0, 0.0)
    assert not CheckpointPolicy().should_save(1000, 1e9, 0, 0.0)
    assert CheckpointPolicy(keep=2).to_delete([30, 10, 20]) == [10]
    with pytest.raises(ValueError, match="every_s:"):
        CheckpointPolicy(every_s=0)
    with pytest.raises(ValueError, match="keep:"):
        CheckpointPolicy(keep=0)


def test_dict_round_trip_and_unknown_field():
    policy = StalenessPolicy(max_staleness=3, batch_size=8, max_worker_lag=1)
    assert policy_from_dict("staleness", policy_to_dict(policy)) == policy
    with pytest.raises(ValueError, match=r"staleness\.eta: unknown field"):
        policy_from_dict("staleness", {"eta": 1, "batch_size": 1})
    with pytest.raises(ValueError, match="kind:"):
        policy_from_dict("nope", {})


# --- properties ------------------------------------------------------------------------

operations = st.lists(st.sampled_from(["start", "finish", "drop", "step"]), max_size=200)


@settings(max_examples=200, deadline=None)
@given(
    eta=st.integers(0, 5),
    batch=st.integers(1, 6),
    cap=st.one_of(st.none(), st.integers(1, 20)),
    ops=operations,
)
def test_admission_never_exceeds_bound(eta, batch, cap, ops):
    """Whatever happens, a start the policy allows keeps accepted + running within
    (η + version + 1) · batch_size and running within max_concurrent."""
    policy = StalenessPolicy(max_staleness=eta, batch_size=batch, max_concurrent=cap)
    accepted = running = consumed = version = 0
    for op in ops:
        if op == "start" and policy.can_start_generation(accepted, running, version):
            running += 1
            assert accepted + running <= (eta + version + 1) * batch
            assert cap is None or running <= cap
        elif op == "finish" and running:
            running -= 1
            accepted += 1
        elif op == "drop" and running:
            running -= 1
        elif op == "step" and accepted - consumed >= batch:
            consumed += batch
            version += 1


@given(rollout=st.integers(0, 1000), trainer=st.integers(0, 1000))
def test_synchronous_never_admits_stale(rollout, trainer):
    policy = StalenessPolicy(max_staleness=0, batch_size=1)
    assert policy.admits(rollout, trainer) == (rollout == trainer)


@given(
    eta=st.integers(0, 10),
    versions=st.lists(st.integers(0, 100), min_size=1, max_size=5),
    trainer=st.integers(0, 120),
)
def test_admits_iff_oldest_within_bound(eta, versions, trainer):
    policy = StalenessPolicy(max_staleness=eta, batch_size=1)
    expected = max(versions) <= trainer and trainer - min(versions) <= eta
    assert policy.admits(tuple(versions), trainer) == expected


@given(
    eta=st.integers(0, 5),
    batch=st.integers(1, 8),
    accepted=st.integers(0, 100),
    running=st.integers(0, 100),
    version=st.integers(0, 20),
)
def test_capacity_grows_with_version(eta, batch, accepted, running, version):
    policy = StalenessPolicy(max_staleness=eta, batch_size=batch)
    now = policy.capacity(accepted, running, version)
    assert policy.capacity(accepted, running, version + 1) >= now >= 0


@given(
    version=st.none() | st.integers(0, 20),
    latest=st.none() | st.integers(0, 20),
    lag=st.integers(0, 4),
    busy=st.booleans(),
    mode=st.sampled_from(["between_requests", "in_flight"]),
)
def test_a_workers_sync_action_is_keep_drain_or_pull_by_the_two_policies(
    version, latest, lag, busy, mode
):
    """The one decision the runtime's workers and the simulator's two worker models take
    about their weights: pull when too stale, unless busy between requests (drain)."""
    staleness = StalenessPolicy(batch_size=4, max_worker_lag=lag)
    weight_sync = WeightSyncPolicy(pull_mode=mode)
    action = weight_sync.sync_action(staleness, version, latest, busy=busy)
    due = latest is not None and staleness.must_pull(version, latest)
    if not due:
        assert action == "keep"
    elif busy and mode == "between_requests":
        assert action == "drain"
    else:
        assert action == "pull"
