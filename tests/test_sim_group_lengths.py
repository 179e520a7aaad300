"""A group's samples are alike in length (WorkloadSpec.length_correlation), each keeping
the length law, and calibration fits the correlation from a trace."""

import statistics
from collections import defaultdict

import numpy as np
import pytest

from rlaxkit.rules.fault_plan import FaultPlan
from rlaxkit.rules.trace import MemoryTrace, generation_records
from sim import fit_scenario, presets, simulate
from sim.distributions import CorrelatedLengths, Lognormal, Uniform
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


def _correlated(rho, **overrides):
    base = presets.local_runtime(target_steps=30)
    return with_overrides(
        base,
        {"workload.length_correlation": rho, "workload.max_response_tokens": None, **overrides},
    )


def test_full_correlation_gives_one_length_per_group():
    groups = _lengths_by_group(_trace(_correlated(1.0, target_steps=5)))
    assert groups and all(len(set(tokens)) == 1 for tokens in groups)
    # Groups still differ from each other: the group's length is drawn from the law.
    assert len({tokens[0] for tokens in groups}) > len(groups) // 2


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.9])
def test_each_sample_keeps_the_length_law(rho):
    law = Lognormal(median=48.0, sigma=0.5)
    lengths = CorrelatedLengths(law, rho, seed=3)
    draws = np.array([lengths.group(4) for _ in range(5000)])
    assert np.median(draws) == pytest.approx(48.0, rel=0.05)
    assert draws.mean() == pytest.approx(law.mean(), rel=0.05)
    logs = np.log(draws)
    # Two samples of a group correlate by ρ (in normal scores; logs of a lognormal are).
    assert np.corrcoef(logs[:, 0], logs[:, 1])[0, 1] == pytest.approx(rho, abs=0.05)


def test_independent_lengths_stay_the_default_and_the_field_round_trips():
    assert presets.local_runtime().workload.length_correlation is None
    _, fitted = fit_scenario(_trace(_correlated(0.9, target_steps=5)))
    assert "length_correlation" not in fitted  # fitted only when asked
    correlated = _correlated(0.7)
    assert scenario_from_dict(scenario_to_dict(correlated)) == correlated


@pytest.mark.parametrize("rho", [0.0, 0.6, 0.95])
def test_calibration_recovers_the_correlation(rho):
    scenario, fitted = fit_scenario(
        _trace(_correlated(rho, target_steps=40)), length_correlation=True
    )
    assert fitted["length_correlation"] == pytest.approx(rho, abs=0.12)
    assert scenario.workload.length_correlation == fitted["length_correlation"]
    truth = Lognormal(median=48.0, sigma=0.5).mean()
    assert scenario.workload.response_tokens.mean() == pytest.approx(truth, rel=0.15)


def test_a_uniform_law_keeps_its_bounds():
    lengths = CorrelatedLengths(Uniform(low=1.0, high=12.0), 0.8, seed=0)
    draws = [x for _ in range(2000) for x in lengths.group(4)]
    assert min(draws) >= 1.0 and max(draws) <= 12.0
    assert statistics.fmean(draws) == pytest.approx(6.5, rel=0.03)


def test_a_preempted_worker_on_correlated_lengths_runs_to_the_end():
    # The same fault on independent and on correlated lengths: both runs preempt the
    # worker and reach their steps.
    plan = FaultPlan.from_dicts([{"kind": "preempt_worker", "target": "worker-0", "at_s": 1.0}])
    for rho in (None, 0.8):
        result = simulate(_correlated(rho, target_steps=8, fault_plan=plan))
        assert result.steps == 8
        assert result.preemptions == {"worker": 1}


@pytest.mark.parametrize("value", [-0.1, 1.5, "alike", float("nan")])
def test_a_bad_correlation_names_the_field(value):
    with pytest.raises(ValueError, match="length_correlation"):
        _correlated(value)
