"""Simulated samples/s of multi-turn agent episodes under a long-tailed tool latency.

A fleet of 8 workers x 32 slots runs episodes of 0 to 4 tool calls (``Uniform`` on
[0, 4], rounded), each policy turn about 200 tokens and each observation about 100,
with tool latencies drawn from a lognormal of median 2 s and sigma 1.5 (mean 6.2 s, p99
66 s: a few calls of every step take minutes). The trainer takes 256 episodes a step.
The benchmark simulates (``sim``, parallel fleet model), at η = 0 (synchronous) and
η = 2, five settings:

- ``held``: slots hold their row through tool calls; workers pull between requests
  (the default: a worker that must pull drains the episodes it holds first);
- ``released``: the same with ``fleet.release_after_s`` = 10 s (a slot whose tool runs
  longer goes to other work; the episode re-prefills its context later);
- ``in_flight``: slots held, pulls in flight (decoding is interrupted for new weights);
- ``no_tail`` and ``no_tail_in_flight``: every tool call at the mean latency.

It reports ``samples_per_s`` per setting and η, ``eta2_over_eta0``, ``tail_cost`` (1 -
samples/s with the tail ÷ without, same pull mode), ``tail_hidden`` (1 - tail cost at
η = 2 ÷ tail cost at η = 0: how much of the tail the asynchronous run hides),
``released_over_held``, and ``tool_hold_fraction`` (the share of slot time held by
episodes waiting for a tool).

What it showed (``--quick``, 30 steps, 3 seeds, 7 s): at η = 0 every setting gives
0.78 samples/s against 2.08 without the tail (the tail costs 62%: every step waits for
its slowest episode). At η = 2: ``in_flight`` 4.38 against 4.58 without the tail (4.5%,
93% of the tail hidden, 5.6 times η = 0); ``held`` only 2.96 against 4.38 (32%, 48%
hidden): a worker that must pull between requests first waits for the episodes it
holds, whose tools may run for minutes, and decodes nothing new meanwhile;
``released`` 3.92 (10%, 83% hidden): released episodes do not hold up the pull.

Each figure is the mean over ``--seeds`` seeds (common random numbers across settings).
No real run is measured here: the runtime's asynchronous loop does not drive multi-turn
episodes yet (``rlaxkit.episodes.run_episodes`` runs episodes on one engine), so an η
comparison of real runs waits for that.

Usage::

    python benchmarks/multiturn.py --quick   # a few seconds
    python benchmarks/multiturn.py           # longer runs, more seeds

The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import sim
from rlaxkit.policies import StalenessPolicy
from sim import Constant, Lognormal, Uniform

TOOL_LATENCY_S = Lognormal(median=2.0, sigma=1.5)  # mean 6.2 s, p99 66 s
RELEASE_AFTER_S = 10.0


NO_TAIL = {"workload.tool_latency_s": Constant(value=TOOL_LATENCY_S.mean())}
IN_FLIGHT = {"weight_sync.pull_mode": "in_flight"}
# name -> overrides of the workload's scenario (pulls between requests by default).
SETTINGS: dict[str, dict[str, Any]] = {
    "held": {},
    "released": {"fleet.release_after_s": RELEASE_AFTER_S},
    "in_flight": IN_FLIGHT,
    "no_tail": NO_TAIL,
    "no_tail_in_flight": {**NO_TAIL, **IN_FLIGHT},
}


def scenario(*, max_staleness: int, steps: int, seed: int) -> sim.Scenario:
    """The agent workload (see the module docstring) at η = ``max_staleness``."""
    prompts, group = 32, 8
    return sim.Scenario(
        name=f"multiturn-eta{max_staleness}",
        # ~29 s per step of 256 episodes (about 180k tokens) at 6k tokens/s.
        trainer=sim.TrainerCostSpec.from_rate(tokens_per_s=6_000.0, step_overhead_s=1.0),
        fleet=sim.FleetSpec(
            num_workers=8,
            slots_per_worker=32,
            decode_s_per_token=0.02,  # 50 tokens/s for one sequence
            decode_s_per_token_per_seq=0.0003,
            prefill_tokens_per_s=20_000.0,
        ),
        param_server=sim.ParamServerSpec(
            weight_bytes=2e9, push_bytes_per_s=2e9, pull_bytes_per_s=2e9
        ),
        verifier=sim.VerifierSpec(latency_s=Constant(value=0.05)),
        workload=sim.WorkloadSpec(
            prompts_per_step=prompts,
            group_size=group,
            prompt_tokens=Constant(value=300),
            response_tokens=Lognormal(median=200.0, sigma=0.5),
            max_response_tokens=1024,
            turns=Uniform(low=0.0, high=4.0),
            tool_latency_s=TOOL_LATENCY_S,
            observation_tokens=Lognormal(median=100.0, sigma=0.5),
        ),
        staleness=StalenessPolicy(max_staleness=max_staleness, batch_size=prompts),
        target_steps=steps,
        seed=seed,
    )


def measure(overrides: dict[str, Any], *, eta: int, steps: int, seeds: int) -> tuple[float, float]:
    """Mean samples/s and mean share of slot time held by tool calls over ``seeds``
    seeds of the workload at η = ``eta``."""
    results = []
    for seed in range(seeds):
        base = scenario(max_staleness=eta, steps=steps, seed=seed)
        results.append(sim.simulate(sim.with_overrides(base, overrides)))
    return (
        statistics.fmean(r.samples_per_s for r in results),
        statistics.fmean(r.tool_hold_fraction for r in results),
    )


def _hidden(tail_cost: dict[str, float]) -> float:
    """The share of η = 0's tail cost that η = 2 does not pay."""
    return 1.0 - tail_cost["2"] / tail_cost["0"] if tail_cost["0"] > 0 else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 steps, 3 seeds")
    parser.add_argument("--smoke", action="store_true", help="3 steps, 1 seed (tests)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds = 30, 3
    if args.smoke:
        args.steps, args.seeds = 3, 1
    began = time.perf_counter()
    figures: dict[str, dict[str, float]] = {}
    hold: dict[str, dict[str, float]] = {}
    for name, overrides in SETTINGS.items():
        figures[name], hold[name] = {}, {}
        for eta in (0, 2):
            rate, held_share = measure(overrides, eta=eta, steps=args.steps, seeds=args.seeds)
            figures[name][str(eta)], hold[name][str(eta)] = rate, held_share
    # Each setting against the same pull mode at the mean latency (the no-tail runs
    # release nothing: all their tools end before release_after_s).
    reference = {
        "held": "no_tail",
        "released": "no_tail",
        "in_flight": "no_tail_in_flight",
    }
    tail_cost = {
        name: {eta: 1.0 - figures[name][eta] / figures[ref][eta] for eta in ("0", "2")}
        for name, ref in reference.items()
    }
    held = figures["held"]
    report = {
        "samples_per_s": figures,
        "eta2_over_eta0": {name: v["2"] / v["0"] for name, v in figures.items()},
        "tail_cost": tail_cost,
        "tail_hidden": {name: _hidden(cost) for name, cost in tail_cost.items()},
        "released_over_held": {eta: figures["released"][eta] / held[eta] for eta in held},
        "tool_hold_fraction": hold,
        "release_after_s": RELEASE_AFTER_S,
        "tool_latency_s": {"median": 2.0, "sigma": 1.5, "mean": TOOL_LATENCY_S.mean()},
        "steps": args.steps,
        "seeds": args.seeds,
        "wall_s": time.perf_counter() - began,
    }
    for name, values in figures.items():
        rates = ", ".join(f"η={eta} {v:.2f} samples/s" for eta, v in values.items())
        print(f"{name:>17}: {rates}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
