"""Simulated samples/s of multi-turn agent episodes under a long-tailed tool latency.

A fleet of 8 workers x 32 slots runs episodes of 0 to 4 tool calls (``Uniform`` on
[0, 4], rounded), each policy turn about 200 tokens and each observation about 100,
with tool latencies drawn from a lognormal of median 2 s and sigma 1.5 (mean 6.2 s, p99
66 s: a few calls of every step take minutes). The trainer takes 256 episodes a step.
The benchmark simulates (``sim``, parallel fleet model):

- ``samples_per_s`` at η = 0 (synchronous) and η = 2, with slots held through tool calls,
  and ``eta2_over_eta0``, their ratio;
- the same at the *mean* tool latency (``Constant``: no tail), so that ``tail_cost`` (1 -
  samples/s with the tail ÷ without) says what the tail costs at each η and
  ``tail_hidden`` (1 - tail cost at η = 2 ÷ tail cost at η = 0) how much of it the
  asynchronous run hides;
- ``released``: η = 2 and η = 0 again with ``fleet.release_after_s`` = 10 s (a slot whose
  tool runs longer goes to other work; the episode re-prefills its context later),
  ``released_over_held``, and the tail's cost and share hidden with released slots.

What it showed (``--quick``, 30 steps, 3 seeds, 8 s): η = 0 0.78 samples/s, η = 2 2.96
(ratio 3.8); without the tail 2.08 and 4.38, so the tail costs 62% at η = 0 and 32% at
η = 2: with held slots the asynchronous run hides only about half of it, because
slots held through minutes-long tool calls starve the fleet of slots. Released slots
recover them: η = 2 3.92 samples/s (+33%), a tail cost of 10%, 83% of it hidden; at
η = 0 releasing changes almost nothing (admission, not slots, is what waits there).

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


def samples_per_s(overrides: dict[str, Any], *, eta: int, steps: int, seeds: int) -> float:
    """Mean samples/s over ``seeds`` seeds of the workload at η = ``eta``."""
    rates = []
    for seed in range(seeds):
        base = scenario(max_staleness=eta, steps=steps, seed=seed)
        rates.append(sim.simulate(sim.with_overrides(base, overrides)).samples_per_s)
    return statistics.fmean(rates)


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
    no_tail = {"workload.tool_latency_s": Constant(value=TOOL_LATENCY_S.mean())}
    released = {"fleet.release_after_s": RELEASE_AFTER_S}
    figures: dict[str, dict[str, float]] = {}
    for name, overrides in (("held", {}), ("no_tail", no_tail), ("released", released)):
        figures[name] = {
            str(eta): samples_per_s(overrides, eta=eta, steps=args.steps, seeds=args.seeds)
            for eta in (0, 2)
        }
    held, flat = figures["held"], figures["no_tail"]
    tail_cost = {eta: 1.0 - held[eta] / flat[eta] for eta in held}
    # The no-tail runs release nothing (their tools all end before release_after_s), so
    # they are the reference for released slots too.
    tail_cost_released = {eta: 1.0 - figures["released"][eta] / flat[eta] for eta in held}
    report = {
        "samples_per_s": held,
        "eta2_over_eta0": held["2"] / held["0"],
        "samples_per_s_no_tail": flat,
        "tail_cost": tail_cost,
        "tail_hidden": _hidden(tail_cost),
        "tail_cost_released": tail_cost_released,
        "tail_hidden_released": _hidden(tail_cost_released),
        "samples_per_s_released": figures["released"],
        "released_over_held": {eta: figures["released"][eta] / held[eta] for eta in held},
        "release_after_s": RELEASE_AFTER_S,
        "tool_latency_s": {"median": 2.0, "sigma": 1.5, "mean": TOOL_LATENCY_S.mean()},
        "steps": args.steps,
        "seeds": args.seeds,
        "wall_s": time.perf_counter() - began,
    }
    for name, values in figures.items():
        print(f"{name:>9}: " + ", ".join(f"η={eta} {v:.2f} samples/s" for eta, v in values.items()))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
