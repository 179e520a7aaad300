"""The distribution audit: sampled against trained completion length and pass rate."""

import random

import pytest

from rlaxkit.rules.audit import AuditBook, AuditRecord, audit_distributions, ks_statistic


def test_ks_statistic_matches_hand_derived_values():
    # F_a jumps by 1/4 at 1, 2, 3, 4; F_b by 1/2 at 2, 4: |F_a - F_b| is 1/4 at 1,
    # 0 at 2, 1/4 at 3 and 0 at 4.
    assert ks_statistic([1, 2, 3, 4], [2, 4]) == pytest.approx(0.25)
    assert ks_statistic([1, 1, 1], [2, 2]) == 1.0
    assert ks_statistic([], [1]) == 0.0


def _records(groups, rng, drop_long=False):
    """Groups of 4 samples; a hard group (pass rate 1/4) answers in 3x the tokens."""
    sampled, trained = [], []
    for g in range(groups):
        hard = g % 2 == 0
        rows = [
            AuditRecord(g, rng.randint(30, 60) if hard else rng.randint(10, 20), i == 0 or not hard)
            for i in range(4)
        ]
        sampled += rows
        if not (drop_long and hard and rng.random() < 0.7):  # the slow ones go stale
            trained += rows
    return sampled, trained


def test_a_subset_that_favours_short_easy_groups_is_flagged_and_a_fair_one_passes():
    rng = random.Random(0)
    sampled, trained = _records(200, rng, drop_long=True)
    audit = audit_distributions(sampled, trained)
    assert audit["length"]["flagged"] and audit["pass_rate"]["flagged"]
    assert audit["length"]["trained_mean"] < audit["length"]["sampled_mean"]
    assert audit["pass_rate"]["trained_mean"] > audit["pass_rate"]["sampled_mean"]
    assert not audit["passed"]
    # A random half of the groups, whatever their length: no flag.
    fair = [r for r in sampled if r.group_id % 4 in (0, 1)]
    assert audit_distributions(sampled, fair)["passed"]


def test_book_leaves_filtered_groups_out_and_counts_the_lost():
    book = AuditBook()
    for g in range(3):
        for i in range(2):
            book.finished(AuditRecord(g, 5 + g, i == 0))
    step = book.take_step([0], dropped={1: "filtered", 2: "stale", 7: "preempted"})
    assert step["audit/length_sampled_mean"] == 6.0  # groups 0 and 2 settled; 1 filtered
    assert step["audit/length_trained_mean"] == 5.0
    audit = book.audit({1: "filtered", 2: "stale", 7: "preempted"})
    assert (audit["sampled"], audit["trained"], audit["filtered"], audit["lost"]) == (4, 2, 1, 1)


def _simulated_audit(max_staleness, hard_length_factor):
    from sim.distributions import Uniform
    from sim.engine import simulate
    from sim.presets import areal_like
    from sim.scenario import with_overrides

    scenario = with_overrides(
        areal_like(max_staleness=max_staleness, target_steps=20),
        {
            "workload.pass_rate": Uniform(low=0.0, high=1.0),
            "workload.hard_length_factor": hard_length_factor,
        },
    )
    return simulate(scenario)


def test_the_simulator_flags_a_small_eta_that_drops_the_long_hard_prompts():
    # Hard prompts (low pass rate) answer in up to 4x the tokens; at η = 1 the long tail
    # finishes too late and is dropped as stale: the trained data is shorter and easier.
    result = _simulated_audit(max_staleness=1, hard_length_factor=4.0)
    audit = result.audit
    assert result.drops.get("stale", 0) > 0
    assert audit["length"]["flagged"] and not audit["passed"]
    assert audit["length"]["dropped_mean"] > audit["length"]["trained_mean"]
    assert audit["pass_rate"]["dropped_mean"] < audit["pass_rate"]["trained_mean"]
    # The preset's own settings (η = 4) drop nothing: the audit passes.
    assert _simulated_audit(max_staleness=4, hard_length_factor=1.0).audit["passed"]
