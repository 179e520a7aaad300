"""Simulator benchmark: ``python -m sim.bench [--quick]``.

Prints the wall time and events/s of the RLAX-like 1024-chip, 13-hour scenario (with
preemptions), the AReaL-like η curve and its async/sync ratio, and (without
``--quick``) the RLAX fleet-size scaling and the Young/Daly checkpoint study. The last
line is one JSON object with ``rlax_1024_wall_s``, ``events_per_s``,
``async_vs_sync`` and the other headline numbers.
"""

from __future__ import annotations

import argparse
import json

from sim.engine import simulate
from sim.presets import areal_like, rlax_like
from sim.studies.standard import async_vs_sync, checkpoint_interval_study, eta_curve
from sim.studies.sweep import format_table, sweep

ASYNC_ETA = 4  # η compared with sync (η = 0); AReaL's typical range is 2-8 (docs/papers.md [A4])


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print it, and return the JSON summary."""
    parser = argparse.ArgumentParser(prog="python -m sim.bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="headline numbers only (< 60 s)")
    parser.add_argument("--processes", type=int, default=None, help="sweep processes")
    parser.add_argument(
        "--hours",
        type=float,
        default=13.0,
        help="simulated hours of the 1024-chip run (13: the headline figure; the test "
        "suite runs 1 to check the benchmark's path)",
    )
    args = parser.parse_args(argv)
    summary: dict = {"rlax_1024_hours": args.hours}

    scenario = rlax_like(inference_chips=1024, hours=args.hours)
    result = simulate(scenario)
    print(f"RLAX-like 1024 chips, {scenario.horizon_s / 3600:g} h simulated:")
    print(format_table([result.to_row()]))
    print(
        f"wall {result.wall_s:.2f} s, {result.events} events, {result.events_per_s:,.0f} events/s"
    )
    summary.update(
        rlax_1024_wall_s=round(result.wall_s, 3),
        events_per_s=round(result.events_per_s),
        rlax_1024_steps=result.steps,
        rlax_1024_goodput=round(result.goodput, 4),
    )

    curve = eta_curve(areal_like(target_steps=30), (0, 1, 2, 4, 8), processes=args.processes)
    print("\nAReaL-like long tail (99% in 40 s, +80 s tail), equal chips: throughput vs η")
    print(
        format_table(
            [
                {
                    "eta": p.max_staleness,
                    "samples_per_s": p.samples_per_s,
                    "speedup_vs_sync": p.samples_per_s / curve[0].samples_per_s,
                    "mean_staleness": p.mean_staleness,
                }
                for p in curve
            ]
        )
    )
    ratio = async_vs_sync(curve, max_staleness=ASYNC_ETA)
    print(f"async (η={ASYNC_ETA}) vs sync: {ratio:.2f}x")
    summary.update(
        async_vs_sync=round(ratio, 3),
        eta_curve={p.max_staleness: round(p.samples_per_s, 4) for p in curve},
    )

    if not args.quick:
        base = rlax_like(hours=13.0, preemptions=False)
        points = sweep(base, {"fleet.num_workers": [16, 32, 64, 128]}, processes=args.processes)
        print("\nRLAX-like scaling: inference chips (8 per worker) vs throughput")
        print(format_table([p.row() for p in points]))
        study = checkpoint_interval_study(processes=args.processes)
        print(
            f"\ncheckpoint interval: fitted optimum {study.fitted_best_s:.0f} s, "
            f"Young/Daly sqrt(2 δ M) {study.young_daly_s:.0f} s "
            f"({100 * study.relative_error:.1f}% apart)"
        )
        summary.update(
            scaling={
                p.overrides["fleet.num_workers"] * 8: round(p.result.samples_per_s, 3)
                for p in points
            },
            checkpoint_best_s=round(study.fitted_best_s, 1),
            young_daly_s=round(study.young_daly_s, 1),
        )
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
