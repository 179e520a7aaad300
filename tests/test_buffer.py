"""RolloutBuffer accounting, admission and filtering; controller determinism."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlaxkit.data.buffer import RolloutBuffer
from rlaxkit.data.rollout import Rollout, RolloutGroup
from rlaxkit.rules.controller import PromptController
from rlaxkit.rules.policies import BatchPolicy, StalenessPolicy


def rollout(group, index, reward, version=0, n=3):
    return Rollout(
        group_id=group,
        sample_index=index,
        problem_id=f"p{group}",
        prompt_tokens=np.arange(4, dtype=np.int32),
        completion_tokens=np.arange(n, dtype=np.int32),
        behaviour_logprobs=np.full(n, -0.5, np.float32),
        versions=np.full(n, version, np.int32),
        reward=reward,
        finish_reason="stop",
    )


def test_groups_complete_filter_and_batch_oldest_first():
    buf = RolloutBuffer(StalenessPolicy(max_staleness=1, batch_size=2), group_size=2)
    for g in range(4):
        buf.issue(g, f"p{g}")
    buf.add(rollout(0, 0, 1.0), 0)
    assert buf.in_flight == 4 and buf.buffered == 0
    assert buf.add(rollout(0, 1, 0.0), 0) is None  # rewards differ: admitted
    assert buf.add(rollout(1, 0, 1.0), 0) is None
    assert buf.add(rollout(1, 1, 1.0), 0) == "filtered"  # all equal: no signal
    buf.add(rollout(2, 1, 0.0, version=1), 1)
    buf.add(rollout(2, 0, 1.0, version=1), 1)
    batch = buf.take_batch(trainer_version=1)
    assert [g.group_id for g in batch] == [0, 2]  # oldest version first
    assert buf.take_batch(trainer_version=1) is None  # nothing left for a second batch
    assert buf.counts() == {
        "in_flight": 1,
        "buffered": 0,
        "trained": 2,
        "dropped": 1,
        "dropped_by_reason": {"filtered": 1},
    }
    buf.check(issued=4)


def test_take_batch_drops_what_became_stale_and_returns_oldest():
    buf = RolloutBuffer(
        StalenessPolicy(max_staleness=1, batch_size=1),
        group_size=1,
        batching=BatchPolicy(equal_rewards="keep"),
    )
    for g, version in enumerate([0, 1, 2]):
        buf.issue(g, f"p{g}")
        buf.add(rollout(g, 0, 1.0, version=version), version)
    batch = buf.take_batch(trainer_version=2)  # version 0 is 2 behind: stale
    assert [g.group_id for g in batch] == [1]
    assert buf.dropped == {0: "stale"}
    assert buf.counts()["dropped_by_reason"] == {"stale": 1}
    buf.check(issued=3)


def test_errors_for_double_issue_and_unknown_samples():
    buf = RolloutBuffer(StalenessPolicy(batch_size=1), group_size=2)
    buf.issue(0, "p0")
    with pytest.raises(ValueError, match="issued twice"):
        buf.issue(0, "p0")
    with pytest.raises(ValueError, match="no in-flight prompt"):
        buf.add(rollout(5, 0, 1.0), 0)
    buf.add(rollout(0, 0, 1.0), 0)
    with pytest.raises(ValueError, match="arrived twice"):
        buf.add(rollout(0, 0, 1.0), 0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["sample", "train", "abandon"]), st.integers(0, 3)),
        max_size=60,
    ),
    st.integers(0, 2),
)
def test_accounting_invariant_holds_under_any_interleaving(ops, eta):
    policy = StalenessPolicy(max_staleness=eta, batch_size=2)
    buf = RolloutBuffer(policy, group_size=2)
    version, issued, progress = 0, 0, {}
    for op, arg in ops:
        if policy.can_start_generation(buf.accepted, buf.in_flight, version):
            buf.issue(issued, f"p{issued}")
            progress[issued] = 0
            issued += 1
        live = sorted(progress)
        if op == "sample" and live:
            g = live[arg % len(live)]
            buf.add(rollout(g, progress[g], float(arg % 2 + progress[g]), version), version)
            progress[g] += 1
            if progress[g] == 2:
                del progress[g]
        elif op == "train" and buf.take_batch(version):
            version += 1
        elif op == "abandon" and live:
            g = live[arg % len(live)]
            buf.abandon(g, "preempted")
            del progress[g]
        buf.check(issued)
        assert buf.accepted + buf.in_flight <= (eta + version + 1) * 2 + 2


def test_buffer_state_round_trip():
    buf = RolloutBuffer(StalenessPolicy(max_staleness=2, batch_size=4), group_size=2)
    for g in range(3):
        buf.issue(g, f"p{g}")
    buf.add(rollout(0, 0, 1.0), 0)
    buf.add(rollout(0, 1, 0.0), 0)
    buf.add(rollout(1, 0, 0.0), 0)
    buf.abandon(2, "preempted")
    again = RolloutBuffer(StalenessPolicy(max_staleness=2, batch_size=4), group_size=2)
    again.load_state_dict(buf.state_dict())
    again.check(issued=3)
    assert again.counts() == buf.counts()
    (group,) = again.ledger.ready.values()
    np.testing.assert_array_equal(group.payload.rollouts[0].behaviour_logprobs, np.full(3, -0.5))


def test_controller_is_a_pure_function_of_seed_and_issue_number():
    a, b = PromptController(7, seed=3), PromptController(7, seed=3)
    first = a.next_issues(10)
    assert first == [b.issue_for(g) for g in range(10)]
    assert sorted(i.problem_index for i in first[:7]) == list(range(7))  # one epoch
    lost = first[2:4]
    a.requeue(lost)
    assert a.next_issues(3) == [*lost, a.issue_for(10)]
    c = PromptController(7, seed=3)
    c.load_state_dict(a.state_dict())
    assert c.next_issues(2) == a.next_issues(2)
    with pytest.raises(ValueError, match="another dataset or seed"):
        PromptController(8, seed=3).load_state_dict(a.state_dict())


def test_issue_seeds_differ_by_issue_and_by_run_seed():
    seeds = {
        (run, g): PromptController(7, seed=run).issue_for(g).seed
        for run in (0, 1, 2**40)
        for g in range(500)
    }
    assert all(0 <= s < 2**31 - 1 for s in seeds.values())
    assert len(set(seeds.values())) == len(seeds)  # no two issues share a stream


def test_a_buffer_no_restore_can_reach_keeps_no_trained_group():
    """Without a trainer restore in the run (no fault plan), a trained group is let go
    with its batch; a roll-back is then refused, not half done."""

    def trained(restorable):
        buf = RolloutBuffer(
            StalenessPolicy(max_staleness=1, batch_size=1),
            group_size=2,
            restorable=restorable,
        )
        batches = []
        for g in range(3):
            buf.issue(g, f"p{g}")
            buf.add(rollout(g, 0, 1.0, version=g), g)
            buf.add(rollout(g, 1, 0.0, version=g), g)
            batches.append(buf.take_batch(trainer_version=g))
        return buf, batches

    kept, kept_batches = trained(True)
    light, light_batches = trained(False)
    assert [[g.group_id for g in b] for b in light_batches] == [[0], [1], [2]]
    assert light.counts() == kept.counts()
    light.check(issued=3)
    # Steps 2 and 3 requeued; group 2, sampled from weights of step 2, is dropped.
    assert kept.rollback(1) == [2] and kept.counts()["buffered"] == 1
    with pytest.raises(RuntimeError, match=r"roll_back\(1\).*restorable=False"):
        light.rollback(1)
    light.check(issued=3)


@settings(max_examples=60, deadline=None)
@given(
    versions=st.lists(st.integers(-1, 50), max_size=400),
    environment=st.lists(st.booleans(), max_size=400),
)
def test_a_rollout_bounds_its_policy_tokens_versions(versions, environment):
    """``first_version``/``last_version`` are the min and max version of the policy's
    tokens (short and long completions take different paths), ``-1`` without any."""
    n = len(versions)
    mask = np.array([not e for e in (environment + [False] * n)[:n]], bool)
    values = np.where(mask, np.array(versions, np.int32).reshape(-1), -1).astype(np.int32)
    r = Rollout(
        group_id=0,
        sample_index=0,
        problem_id="p",
        prompt_tokens=np.arange(2, dtype=np.int32),
        completion_tokens=np.zeros(n, np.int32),
        behaviour_logprobs=np.zeros(n, np.float32),
        versions=values,
        reward=0.0,
        finish_reason="stop",
        policy_mask=mask,
    )
    policy = values[mask]
    assert r.first_version == (int(policy.min()) if len(policy) else -1)
    assert r.last_version == (int(policy.max()) if len(policy) else -1)
    assert type(r.first_version) is int and type(r.last_version) is int


def test_rollouts_share_one_read_only_all_policy_mask_per_length():
    a, b, c = rollout(0, 0, 1.0, n=5), rollout(1, 0, 1.0, n=5), rollout(2, 0, 1.0, n=6)
    assert a.policy_mask is b.policy_mask and a.policy_mask is not c.policy_mask
    assert a.policy_mask.tolist() == [True] * 5 and a.num_policy_tokens == 5
    with pytest.raises(ValueError, match="read-only"):
        a.policy_mask[0] = False


@given(st.lists(st.sampled_from([0.0, 0.3, 0.30000000001, 1.0]), max_size=6))
def test_a_group_has_equal_rewards_when_its_float32_rewards_are_equal(rewards):
    group = RolloutGroup(0, "p", tuple(rollout(0, i, r) for i, r in enumerate(rewards)))
    expected = not rewards or bool(np.all(group.rewards == group.rewards[0]))
    assert group.equal_rewards == expected
