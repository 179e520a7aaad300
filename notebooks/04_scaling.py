# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Scaling the inference fleet
#
# RLAX scales the inference fleet against a fixed trainer (a v5p-512 trainer with
# fleets of 128 to 1024 chips, RLAX Fig. 3). We simulate that setting with the SimPy
# model (`sim.presets.rlax_like`: QwQ-32B, long reasoning completions, preemptions;
# every number is sourced or marked as an assumption in its docstring) from 64 to 1024
# inference chips, synchronously (η = 0) and asynchronously (η = 2), where η, the
# staleness bound, is how many weight versions older than the trainer's a rollout it
# trains on may be.
#
# Throughput grows with the fleet until the trainer is the bottleneck; asynchrony moves
# that point because workers keep generating while the trainer steps and the long tail
# of a batch does not hold everyone up.
#
# Then the same question for rlaxkit's **local runtime**: real runs with 1, 2 and 4
# workers.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("RLAXKIT_NOTEBOOK_SMALL", "0") == "1"
CHIPS = (64, 128, 256, 512, 1024)
ETAS = (0, 2)
HOURS = 2.0 if SMALL else 13.0  # simulated hours per run (RLAX's run took 12 h 48 min)
SEEDS = (0,) if SMALL else (0, 1, 2)
LOCAL_WORKERS = (1, 2, 4)
LOCAL_STEPS = 8 if SMALL else 30

# %%
# %matplotlib inline
import tempfile

import numpy as np

import sim
from rlaxkit.config import SMALL_RUN, RunConfig, apply_overrides
from rlaxkit.observe import scaling_figure
from rlaxkit.rules import summarize
from rlaxkit.runtime import Experiment

# %% [markdown]
# ## The RLAX-like fleet, 64 to 1024 chips
#
# `sim.sweep` runs every combination of the grid (and seed) in parallel processes,
# with common random numbers: every fleet size sees the same preemption times and
# completion lengths for a given seed.

# %%
base = sim.rlax_like(hours=HOURS)
grid = {
    "fleet.num_workers": [chips // base.fleet.chips_per_worker for chips in CHIPS],
    "staleness.max_staleness": list(ETAS),
}
points = sim.sweep(base, grid, seeds=SEEDS)
rows = [
    {"chips": p.overrides["fleet.num_workers"] * base.fleet.chips_per_worker, **p.row()}
    for p in points
]
columns = ["chips", "staleness.max_staleness", "seed", "samples_per_s", "trainer_util"]
columns += ["worker_util", "mean_staleness", "preemptions", "lost_steps"]
print(sim.format_table(rows, columns))


# %%
def mean_over_seeds(chips: int, eta: int) -> float:
    runs = [r for r in rows if r["chips"] == chips and r["staleness.max_staleness"] == eta]
    return float(np.mean([r["samples_per_s"] for r in runs]))


throughput = {
    f"η = {eta}, assumed costs": [mean_over_seeds(chips, eta) for chips in CHIPS] for eta in ETAS
}
workload = base.workload
tokens_per_step = workload.samples_per_step * (
    workload.prompt_tokens.mean() + workload.response_tokens.mean()
)
trainer_bound = workload.samples_per_step / base.trainer.step_s(tokens_per_step)
print(f"trainer bound: {trainer_bound:.2f} samples/s (a {base.trainer.chips}-chip trainer)")
for eta, values in throughput.items():
    print(eta, "speed-up 64 -> 1024 chips:", round(values[-1] / values[0], 1), "x")

# %% [markdown]
# ## The local runtime: 1, 2 and 4 workers
#
# Real runs of the tiny default model with 1, 2 and 4 workers, measured in trained
# samples per second from their traces (`rlaxkit.rules.trace.summarize`). The local backend
# interleaves its workers in one process, so more workers mean more sequences in
# flight on the same cores, not more cores: past the point where the decode batches
# fill the cores, adding workers only adds scheduling. (Notebook 05 fits the simulator
# to such a trace.) On a machine shared with other jobs these numbers move with the
# load; compare them within one execution only.

# %%
small_model = list(SMALL_RUN)  # rlaxkit.config.run's tiny run, for CI
cache = tempfile.mkdtemp(prefix="rlaxkit-nb04-")


def local_config(workers: int) -> RunConfig:
    overrides = [*(small_model if SMALL else []), f"runtime.num_workers={workers}"]
    return RunConfig.from_dict(apply_overrides(RunConfig().to_dict(), overrides))


# A throw-away step first: the warm start (cached for all runs) and the compilations
# would otherwise be timed as part of the first run's trace.
with Experiment(local_config(LOCAL_WORKERS[0]), cache_dir=cache) as exp:
    exp.step()
traces = {}
for workers in LOCAL_WORKERS:
    with Experiment(local_config(workers), cache_dir=cache) as exp:
        exp.run(LOCAL_STEPS)
        traces[workers] = list(exp.trace.memory.events)
measured = [summarize(traces[workers]).samples_per_s for workers in LOCAL_WORKERS]
for workers, rate in zip(LOCAL_WORKERS, measured, strict=True):
    print(f"{workers} workers: {rate:6.1f} trained samples/s")

scaling_figure(
    LOCAL_WORKERS,
    {"local runtime (measured)": measured},
    xlabel="inference workers (one process)",
    title="trained samples/s by local workers (measured)",
)

# %% [markdown]
# ## From compiled programs instead of assumed rates
#
# The preset's trainer FLOPs per token, decode cost and push size are assumptions
# (marked so in `sim.rlax_like`'s docstring). `rlaxkit.plan` compiles the real train step
# and decode program for the trainer's `(1, 64, 4)` v5p mesh and an 8-chip worker, with
# Qwen3-32B's dimensions (the preset closest to QwQ-32B), and reads XLA's counts;
# `sim.presets.planned` puts them into the scenario. Compiling takes about a minute on two
# cores, so the small run reads the plan stored by
# `rlaxkit plan configs/plan/qwen3_32b_v5p.yaml --json`. Both are estimates from XLA's
# CPU compiler (`docs/running_at_scale.md`, "Before you rent").
#
# By the CPU compiler's count every program fits: the train step peaks at about 20 GiB
# per chip on the `(1, 64, 4)` mesh against the v5p's 95 GiB, and a worker at about
# 71 GiB. (The stored plan said 162 GiB, not fitting, until the train step constrained
# its logits to their rows and split the residual stream between blocks over `model`;
# `docs/running_at_scale.md` tells both fixes.) What the simulator reads from the plan,
# the FLOPs per token, the decode step's bytes and the push size, is counted the same
# whether a program fits or not.

# %%
import json
from pathlib import Path

import rlaxkit
from rlaxkit.planning import Plan, load_plan_config
from sim import planned

PLAN = Path(rlaxkit.__file__).parents[1] / "configs/plan/qwen3_32b_v5p.yaml"  # from any folder
if SMALL:
    plan = Plan.from_summary(json.loads(PLAN.with_suffix(".plan.json").read_text()))
else:
    plan = rlaxkit.plan(load_plan_config(PLAN))
print(plan.table())
compiled = plan.sim_overrides()
compiled_base = planned(base, compiled)
assumed = sim.scenario_to_dict(base)
rows_compiled = [
    {"field": key, "assumed": assumed[key.split(".")[0]][key.split(".")[1]], "compiled": value}
    for key, value in compiled.items()
]
print(sim.format_table(rows_compiled, ["field", "assumed", "compiled"]))
compiled_points = sim.sweep(
    compiled_base,
    {"fleet.num_workers": grid["fleet.num_workers"], "staleness.max_staleness": [max(ETAS)]},
    seeds=SEEDS,
)


def compiled_mean(chips: int) -> float:
    workers = chips // base.fleet.chips_per_worker
    runs = [p for p in compiled_points if p.overrides["fleet.num_workers"] == workers]
    return float(np.mean([p.row()["samples_per_s"] for p in runs]))


throughput[f"η = {max(ETAS)}, compiled costs"] = [compiled_mean(chips) for chips in CHIPS]
compiled_bound = workload.samples_per_step / compiled_base.trainer.step_s(tokens_per_step)
print(
    f"trainer bound with compiled costs: {compiled_bound:.2f} samples/s "
    f"(assumed: {trainer_bound:.2f})"
)

# %% [markdown]
# ## The RLAX-style figure
#
# Trained samples/s against inference chips on log-log axes; dotted lines are linear
# scaling from 64 chips. A trainer bound is the trainer's samples per step over its
# step time when it never waits for data: the dashed line with the assumed costs (it
# bounds the two "assumed costs" curves), the dash-dotted one with the compiled costs
# (it bounds the "compiled costs" curve, which takes the trainer, decode and push costs
# from the plan). Each curve flattens below its own bound, not the other's.

# %%
scaling_figure(
    CHIPS,
    throughput,
    ceiling={
        "trainer bound, assumed costs": trainer_bound,
        "trainer bound, compiled costs": compiled_bound,
    },
    title="trained samples/s by fleet size (simulated; η: staleness bound, versions)",
)
