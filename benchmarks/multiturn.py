"""Samples/s of multi-turn episodes under a long-tailed tool latency, simulated and real.

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

The real runs (``real_*``) train the calculator task (two-digit by one-digit products, a
2-layer, 32-wide character model, a short warm start) on the local runtime in
``concurrent`` mode: one worker of 32 rows (8 prompts of 4 episodes at once), pulls in
flight, a thread per row for the tool, whose every step first sleeps a latency from a
seeded lognormal of median 30 ms and sigma 1.5 (mean 92 ms, p99 1 s), or the mean
(``no_tail``). Steps that are done are resolved between chunks while the other rows
decode (``rlaxkit.worker.multi_turn``). At η = 0 and 2 they report episodes admitted per
second (``real_samples_per_s``), ``real_eta2_over_eta0`` (with the tail),
``real_tail_cost_eta0`` and ``_eta2`` and ``real_tail_hidden``, as above. One run per
η times windows of ``--real-steps`` steps, alternating the two latencies
``--real-rounds`` times, after a warm-up that compiles the engine's shape buckets.

What the real runs showed, on two CPU cores shared with another job (load average 2 to
4 while measuring, so a figure moves by up to tens of percent between runs): with
10-step windows and 3 rounds (88 s in all), at η = 0 27 samples/s with the tail against
114 without (the tail costs 76%: each step waits for its slowest episode's tools); at
η = 2 108 against 193 (44%): η = 2 gives 4.0 times η = 0 and hides 42% of the tail.
A second such run gave 27 / 115 and 109 / 212 (36% hidden); ``--quick`` (one 6-step
window each, 57 s in all at load 2.2 to 2.9) gave 42 / 104 and 100 / 142 (50% hidden;
its short windows read η = 0 with the tail high). Less
is hidden than in the simulated fleet because the real tail is long against a trainer
step: a step takes about 0.1 s here and the tool's p99 is 1 s, so a slow call spans
about ten steps, while η = 2 lets a group lag only two; the simulated step takes
about 29 s against a p99 of 66 s. Admission then bounds the run (at most (η + 1) ·
batch groups ahead of training, each as slow as its slowest episode), not the rows:
releasing rows after 0.1 s (``real_released_eta2``, ``episodes.release_after_s``, not
run by ``--quick``) gave 116 samples/s against 108 held. A wider bound says the same
(``real_eta8``, not run by ``--quick``): on a quiet machine (load 1.2; 10-step windows,
3 rounds, 136 s in all) η = 0 gave 27 / 115, η = 2 109 / 223 (33% of the tail hidden,
releasing 100), and η = 8 150 / 199: 68% hidden (``real_tail_hidden_eta8``).

Usage::

    python benchmarks/multiturn.py --quick   # under a minute on two cores
    python benchmarks/multiturn.py           # longer runs, more seeds
    python benchmarks/multiturn.py --smoke   # 3 simulated steps, no real run (tests)

The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

import sim
from rlaxkit.config.run import RunConfig
from rlaxkit.rules.policies import StalenessPolicy
from rlaxkit.tasks import register_task, task_names
from rlaxkit.tasks.calculator import CalculatorConfig, CalculatorTask
from rlaxkit.tasks.episodes import DelayedEnvironment
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


# -- real runs -------------------------------------------------------------------------
# The tool's latency of the real runs: lognormal, scaled for a model that decodes a turn
# in milliseconds (median 30 ms, sigma 1.5: mean 92 ms, p99 1 s).
REAL_MEDIAN_S, REAL_SIGMA = 0.03, 1.5
REAL_MEAN_S = REAL_MEDIAN_S * math.exp(REAL_SIGMA**2 / 2)


class DelayedCalculator(CalculatorTask):
    """The calculator behind a ``DelayedEnvironment``: every step first sleeps a latency
    drawn from the lognormal of ``REAL_MEDIAN_S`` and ``REAL_SIGMA`` (seeded by the
    task's seed), or ``REAL_MEAN_S`` while the class's ``tail`` is False (the runs
    switch it between two timed windows)."""

    name = "calculator_delayed"
    tail = True

    def __init__(self, config: CalculatorConfig | None = None):
        super().__init__(config)
        self._rng = np.random.default_rng(self.config.seed)
        self._lock = threading.Lock()  # steps draw from their threads

    def latency_s(self) -> float:
        if not DelayedCalculator.tail:
            return REAL_MEAN_S
        with self._lock:
            return float(REAL_MEDIAN_S * math.exp(REAL_SIGMA * self._rng.normal()))

    def make_environment(self) -> DelayedEnvironment:  # type: ignore[override]
        return DelayedEnvironment(super().make_environment(), self.latency_s)


if DelayedCalculator.name not in task_names():
    register_task(DelayedCalculator.name, CalculatorConfig)(DelayedCalculator)

# Two-digit by one-digit products, the tiny character model of the runtime's multi-turn
# tests and a short warm start (most episodes call the calculator once, then answer);
# the local runtime's concurrent mode, one worker of 32 rows (8 prompts of 4 episodes),
# a thread per row for the tool, pulls in flight.
REAL_RUN = [
    "model.config.hidden_size=32",
    "model.config.intermediate_size=64",
    "model.config.num_layers=2",
    "model.config.vocab_size=50",
    f"task.name={DelayedCalculator.name}",
    "task.options.first_digits=2",
    "task.options.second_digits=1",
    "task.num_train=200",
    "sft.steps=60",
    "sft.batch_size=32",
    "sampling.n=4",
    "sampling.max_new_tokens=24",
    "staleness.batch_size=4",
    "runtime.mode=concurrent",
    "runtime.num_workers=1",
    "runtime.slots_per_worker=32",
    "weight_sync.pull_mode=in_flight",
    "episodes.max_turns=3",
    "episodes.max_episode_tokens=40",
    "episodes.step_timeout_s=10.0",
    "episodes.tool_workers=32",
    "batching.equal_rewards=keep",
    "eval.num_problems=4",
    "eval.samples=1",
    "eval.every_steps=0",
]


# The released setting: a row whose tool has run 0.1 s (about the latency's 79th
# percentile) goes to other work, and the worker's room counts rows, not prompts; a
# thread for every episode that may wait.
REAL_RELEASE_AFTER_S = 0.1
RELEASED = (f"episodes.release_after_s={REAL_RELEASE_AFTER_S}", "episodes.tool_workers=64")


def real_samples_per_s(
    *,
    eta: int,
    steps: int,
    rounds: int,
    warmup_steps: int,
    cache_dir: str,
    overrides: tuple[str, ...] = (),
) -> dict[str, float]:
    """Episodes per second that a real concurrent run at η = ``eta`` finishes and admits
    (dropped ones not counted), with the tool's lognormal latency (``tail``) and with
    every call at the same mean (``no_tail``). After ``warmup_steps`` trainer steps
    (compilation: the engine's shape buckets keep compiling for about ten steps), the
    two alternate ``rounds`` times, each a window of ``steps`` steps after one step
    that lets the other latency's episodes in flight end; a rate is its windows'
    episodes over their seconds."""
    from rlaxkit.runtime import Experiment  # JAX only for the real runs

    config = RunConfig.from_overrides([*REAL_RUN, f"staleness.max_staleness={eta}", *overrides])
    episodes = {"tail": 0, "no_tail": 0}
    seconds = {"tail": 0.0, "no_tail": 0.0}
    with Experiment(config, cache_dir=cache_dir) as exp:
        exp.run(warmup_steps)
        for _ in range(rounds):
            for name in ("tail", "no_tail"):
                DelayedCalculator.tail = name == "tail"
                exp.run(1)
                accepted, began = exp.buffer.accepted, time.perf_counter()
                exp.run(steps)
                seconds[name] += time.perf_counter() - began
                episodes[name] += (exp.buffer.accepted - accepted) * config.sampling.n
        exp.check_accounting()
    DelayedCalculator.tail = True
    return {name: episodes[name] / seconds[name] for name in episodes}


def real_report(*, steps: int, rounds: int, released: bool) -> dict[str, Any]:
    """samples/s of real runs at η = 0 and 2, with and without the tail (and with
    ``released``, at η = 2 with rows released after ``REAL_RELEASE_AFTER_S``)."""
    figures: dict[str, dict[str, float]] = {"tail": {}, "no_tail": {}}
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as cache_dir:  # one warm start for all runs
        for eta in (2, 0):  # the later runs find most programs compiled
            rates = real_samples_per_s(
                eta=eta,
                steps=steps,
                rounds=rounds,
                warmup_steps=8 if eta == 2 else 3,
                cache_dir=cache_dir,
            )
            for name, rate in rates.items():
                figures[name][str(eta)] = rate
        if released:
            extra["real_released_eta2"] = real_samples_per_s(
                eta=2,
                steps=steps,
                rounds=rounds,
                warmup_steps=3,
                cache_dir=cache_dir,
                overrides=RELEASED,
            )
            extra["real_released_over_held_eta2"] = (
                extra["real_released_eta2"]["tail"] / figures["tail"]["2"]
            )
            # A wider staleness bound: does admission, not rows, bound the η = 2 run?
            eta8 = real_samples_per_s(
                eta=8, steps=steps, rounds=rounds, warmup_steps=3, cache_dir=cache_dir
            )
            extra["real_eta8"] = eta8
            extra["real_tail_cost_eta8"] = 1.0 - eta8["tail"] / eta8["no_tail"]
    tail, flat = figures["tail"], figures["no_tail"]
    cost = {eta: 1.0 - tail[eta] / flat[eta] for eta in ("0", "2")}
    if "real_eta8" in extra:
        extra["real_tail_hidden_eta8"] = 1.0 - extra["real_tail_cost_eta8"] / cost["0"]
    return {
        "real_samples_per_s": figures,
        "real_eta2_over_eta0": tail["2"] / tail["0"],
        "real_tail_cost_eta0": cost["0"],
        "real_tail_cost_eta2": cost["2"],
        "real_tail_hidden": _hidden(cost),
        "real_tool_latency_s": {"median": REAL_MEDIAN_S, "sigma": REAL_SIGMA, "mean": REAL_MEAN_S},
        "real_steps": steps,
        "real_rounds": rounds,
        **extra,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 steps, 3 seeds")
    parser.add_argument(
        "--smoke", action="store_true", help="3 simulated steps, 1 seed, no real runs (tests)"
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--real-steps", type=int, default=10, help="steps per real window")
    parser.add_argument("--real-rounds", type=int, default=4, help="windows per latency")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.real_steps, args.real_rounds = 30, 3, 6, 1
    if args.smoke:
        args.steps, args.seeds, args.real_steps = 3, 1, 0
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
    }
    for name, values in figures.items():
        rates = ", ".join(f"η={eta} {v:.2f} samples/s" for eta, v in values.items())
        print(f"{name:>17}: {rates}")
    if args.real_steps:
        report |= real_report(
            steps=args.real_steps, rounds=args.real_rounds, released=not args.quick
        )
        for name, values in report["real_samples_per_s"].items():
            rates = ", ".join(f"η={eta} {v:.2f} samples/s" for eta, v in values.items())
            print(f"{'real ' + name:>17}: {rates}")
    report["wall_s"] = time.perf_counter() - began
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
