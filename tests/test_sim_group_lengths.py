"""A group's samples share a length (WorkloadSpec.within_group_sigma), and calibration
fits the spread from a trace."""

import math
from collections import defaultdict

import numpy as np
import pytest

from rlaxkit.faults import FaultPlan
from rlaxkit.trace import MemoryTrace, generation_records
from sim import fit_scenario, presets, simulate
from sim.distributions import Lognormal
from sim.scenario import scenario_from_dict, scenario_to_dict, with_overrides


def _lengths_by_group(events):
    groups = defaultdict(list)
    for record in generation_records(events):
        groups[record.sample.rpartition("/")[0]].append(record.tokens)
    return [tokens for tokens in groups.values() if len(tokens) > 1]


def _trace(scenario):
    trace = MemoryTrace()
    simulate(scenario, trace=trace)
    return trace.events


def _correlated(sigma, **overrides):
    base = presets.local_runtime(target_steps=30)
    return with_overrides(
        base,
        {
            "workload.within_group_sigma": sigma,
            "workload.max_response_tokens": None,
            **overrides,
        },
    )


def test_a_group_of_zero_spread_has_one_length():
    events = _trace(_correlated(0.0, target_steps=5))
    groups = _lengths_by_group(events)
    assert groups and all(len(set(tokens)) == 1 for tokens in groups)
    # Groups still differ from each other: the group's length is drawn from the law.
    assert len({tokens[0] for tokens in groups}) > len(groups) // 2


def test_independent_lengths_stay_the_default_and_round_trip():
    scenario = presets.local_runtime()
    assert scenario.workload.within_group_sigma is None
    correlated = _correlated(0.25)
    assert scenario_from_dict(scenario_to_dict(correlated)) == correlated


@pytest.mark.parametrize("sigma", [0.1, 0.4])
def test_calibration_recovers_the_within_group_spread(sigma):
    scenario, fitted = fit_scenario(_trace(_correlated(sigma)))
    assert fitted["within_group_sigma"] == pytest.approx(sigma, rel=0.15)
    assert scenario.workload.within_group_sigma == fitted["within_group_sigma"]
    # The group law's mean is the truth's mean length (48 · e^(0.5²/2) = 54.4 tokens).
    truth = Lognormal(median=48.0, sigma=0.5).mean()
    assert scenario.workload.response_tokens.mean() == pytest.approx(truth, rel=0.15)


def test_the_mean_length_is_kept_and_groups_vary_less_inside_than_between():
    events = _trace(_correlated(0.2, target_steps=40))
    groups = _lengths_by_group(events)
    logs = [np.log(tokens) for tokens in groups]
    within = math.sqrt(np.mean([np.var(g, ddof=1) for g in logs]))
    between = float(np.std([g.mean() for g in logs]))
    assert within == pytest.approx(0.2, rel=0.2)
    assert between > 2 * within
    mean = np.mean([t for tokens in groups for t in tokens])
    assert mean == pytest.approx(Lognormal(median=48.0, sigma=0.5).mean(), rel=0.15)


def test_a_preempted_worker_on_correlated_lengths_runs_to_the_end():
    # The same fault on independent and on group-correlated lengths: both runs preempt
    # the worker and reach their steps.
    plan = FaultPlan.from_dicts([{"kind": "preempt_worker", "target": "worker-0", "at_s": 1.0}])
    for sigma in (None, 0.1):
        result = simulate(_correlated(sigma, target_steps=8, fault_plan=plan))
        assert result.steps == 8
        assert result.preemptions == {"worker": 1}


@pytest.mark.parametrize("value", [-0.1, 5.0, "wide", float("nan")])
def test_a_bad_spread_names_the_field(value):
    with pytest.raises(ValueError, match="within_group_sigma"):
        _correlated(value)
