"""The simulator's headline claims: async beats sync under a long tail, throughput
grows with η and saturates, and the best checkpoint interval matches Young/Daly."""

import pytest

from sim import (
    async_vs_sync,
    checkpoint_interval_study,
    eta_curve,
    format_table,
    presets,
    young_daly_interval_s,
)


@pytest.fixture(scope="module")
def curve():
    return eta_curve(
        presets.areal_like(target_steps=30), (0, 1, 2, 4, 8), seeds=(0, 1), processes=1
    )


def test_async_beats_sync_by_2x_at_equal_chips(curve):
    print()
    print(
        format_table(
            [
                {
                    "eta": p.max_staleness,
                    "samples_per_s": p.samples_per_s,
                    "x_sync": p.samples_per_s / curve[0].samples_per_s,
                }
                for p in curve
            ]
        )
    )
    for eta in (2, 4, 8):
        assert async_vs_sync(curve, max_staleness=eta) >= 2.0


def test_throughput_grows_with_eta_and_saturates(curve):
    rates = [p.samples_per_s for p in curve]
    assert all(b >= 0.99 * a for a, b in zip(rates, rates[1:], strict=False))
    assert rates[1] > 1.5 * rates[0]  # the first step of overlap gains the most
    assert rates[-1] == pytest.approx(rates[-2], rel=0.02)  # η = 4 → 8 adds nothing
    staleness = [p.mean_staleness for p in curve]
    assert staleness[0] == 0 and staleness[-1] > staleness[1]


def test_young_daly_formula():
    assert young_daly_interval_s(save_s=60.0, mtbf_s=3600.0) == pytest.approx(657.27, abs=0.01)


def test_best_checkpoint_interval_matches_young_daly():
    study = checkpoint_interval_study(processes=2)
    print(
        f"\nfitted optimum {study.fitted_best_s:.0f} s, best grid point "
        f"{study.best_measured_s:.0f} s, sqrt(2 δ M) {study.young_daly_s:.0f} s"
    )
    assert study.relative_error <= 0.20
    # The waste curve is U-shaped: both ends of the grid are worse than its middle.
    assert min(study.waste) < study.waste[0] and min(study.waste) < study.waste[-1]
