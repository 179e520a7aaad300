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
# # 03 · Preemption scenarios: tune in simulation, then run it for real
#
# Preemptible accelerators are cheap because they get taken away. Two knobs decide
# how much a preemption costs:
#
# - the **checkpoint interval**: save too often and the trainer spends its time
#   saving; too rarely and a preemption throws away many steps. Young's first-order
#   optimum is √(2δM), with δ the time to write a checkpoint and M the mean time
#   between preemptions (Young 1974; Daly 2006 refines it);
# - the **staleness bound η**: a preempted worker loses its in-flight prompts; with
#   η > 0 the others keep the trainer fed meanwhile.
#
# We tune both with the SimPy model (`sim/`), then run the chosen policy on the real
# local runtime with a `FaultPlan` (a worker preemption and a trainer preemption) and
# check that nothing accepted was lost. The simulator and the runtime read the same
# `FaultPlan` format and call the same `rlaxkit.rules.policies` objects.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("RLAXKIT_NOTEBOOK_SMALL", "0") == "1"
SEEDS = (0,) if SMALL else (0, 1, 2)
CHECKPOINT_HORIZON_H = 50 if SMALL else 200  # simulated hours per checkpoint-interval run
ETAS = (0, 1, 2, 4)
WORKER_MTBF_S = (None, 1200.0, 300.0)  # None: no preemptions
TOLERANCE = 0.10  # pick the smallest η within 10% of the best throughput
REAL_STEPS = 10 if SMALL else 40

# %%
# %matplotlib inline
import tempfile
from pathlib import Path

import numpy as np

import sim
from rlaxkit.config import SMALL_RUN, RunConfig, apply_overrides
from rlaxkit.observe import timeline_figure
from rlaxkit.rules import FaultPlan, read_trace
from rlaxkit.runtime import Experiment

# %% [markdown]
# ## 1. The checkpoint interval
#
# `sim.checkpoint_study` is a trainer-bound run (120 s steps, 60 s saves) with
# exponential trainer preemptions (MTBF 1 h). Every interval sees the same preemption
# times, so the differences come from the interval alone. The fitted optimum of
# `waste(τ) ≈ a + b/τ + c·τ` (the star) should sit near Young's √(2δM) (the dashed
# line), here with δ = 60 s and M = 3600 s.

# %%
study = sim.checkpoint_interval_study(seeds=SEEDS, horizon_s=CHECKPOINT_HORIZON_H * 3600.0)
step_s = 120.0  # the study's step time
every_steps = max(1, round(study.fitted_best_s / step_s))
print(
    f"fitted optimum {study.fitted_best_s:.0f} s, Young {study.young_daly_s:.0f} s, "
    f"best simulated {study.best_measured_s:.0f} s -> checkpoint every {every_steps} steps"
)
sim.checkpoint_figure(study)

# %% [markdown]
# ## 2. The staleness bound under worker preemptions
#
# `sim.areal_like`: one fleet and trainer, long-tailed completion lengths, at each η,
# without preemptions and with each worker preempted on average every 20 and 5
# minutes. We keep the smallest η whose throughput under the harshest preemptions is
# within `TOLERANCE` of the best: fresher data for nearly the same speed.

# %%
base = sim.areal_like(target_steps=20)
grid = {"staleness.max_staleness": list(ETAS), "preemptions.worker_mtbf_s": list(WORKER_MTBF_S)}
points = sim.sweep(base, grid, seeds=SEEDS)
columns = [*grid, "seed", "samples_per_s", "mean_staleness", "preemptions"]
print(sim.format_table([p.row() for p in points], columns))


def throughput(eta, mtbf):
    runs = [
        p.result
        for p in points
        if p.overrides["staleness.max_staleness"] == eta
        and p.overrides["preemptions.worker_mtbf_s"] == mtbf
    ]
    return float(np.mean([r.samples_per_s for r in runs]))


harshest = WORKER_MTBF_S[-1]
best = max(throughput(eta, harshest) for eta in ETAS)
eta = min(e for e in ETAS if throughput(e, harshest) >= (1 - TOLERANCE) * best)
print(f"chosen: η = {eta}, checkpoint every {every_steps} steps")

# %% [markdown]
# ## 3. The chosen policy, for real, with a fault plan
#
# The same `StalenessPolicy` and `CheckpointPolicy` go into a real local run, with
# a plan that preempts `worker-1` (its in-flight prompts are re-issued; it restarts
# empty and pulls the newest weights) and then the trainer right after step 7 (it
# loses the steps since its last checkpoint, restores it from disk, and the run goes
# on). Timed faults in the deterministic local runtime use a logical clock: one
# decode round is `runtime.round_s` seconds.

# %%
small_model = list(SMALL_RUN)  # rlaxkit.config.run's tiny run, for CI
overrides = [
    *(small_model if SMALL else []),
    f"staleness.max_staleness={eta}",
    f"checkpoint.every_steps={every_steps}",
]
config = RunConfig.from_dict(apply_overrides(RunConfig().to_dict(), overrides))
plan = FaultPlan.from_dicts(
    [
        {"kind": "preempt_worker", "target": "worker-1", "at_s": 6, "restart_after_s": 4},
        {"kind": "preempt_trainer", "at_step": 7, "restart_after_s": 2},
    ]
)
run_dir = Path(tempfile.mkdtemp(prefix="rlaxkit-nb03-")) / "run"
warm_start_cache = run_dir.parent / "cache"  # the clean run below loads this run's warm start
with Experiment(config, run_dir=run_dir, cache_dir=warm_start_cache, faults=plan) as exp:
    metrics = exp.run(REAL_STEPS)
    exp.check_accounting()  # every issued prompt is in flight, buffered, trained or dropped
    summary = exp.summary()
print({k: summary[k] for k in ("steps", "lost_steps", "accepted_lost", "goodput", "wall_s")})
events = read_trace(run_dir / "trace.jsonl")
faults_seen = {(e.kind, e.actor) for e in events if e.kind in ("preemption", "restart")}
print("faults seen:", sorted(faults_seen))
assert summary["accepted_lost"] == 0

# %% [markdown]
# The timeline: one row per worker and one for the trainer; generations coloured by
# the weight version they started with, pushes as ticks, preemptions as red crosses.

# %%
timeline_figure(events)

# %% [markdown]
# ## 4. What the simulator predicted for this run
#
# The simulator's serial host is the model of this deterministic local runtime; it
# keeps its books in the runtime's own ledger and fires faults on the runtime's own
# clock. Calibrated on a fault-free run of the same config, it replays the same plan;
# side by side with what the run above measured (over the same window: the steps
# after the first, which compiles).
#
# Read the throughput rows with the run's length in mind: on the wall clock, a run of
# a few steps is dominated by one-time costs the model does not see (the restore from
# disk, programs compiled after it, checkpoint writes): with the CI settings (10 steps)
# the simulator predicts several times the measured samples/s while lost work and
# staleness agree. `benchmarks/sim_fidelity.py` measures the prediction properly
# (longer runs, the CPU clock, repeated runs): there lost work and staleness agree within
# a few percent, throughput and goodput within about 5-25%.

# %%
clean_dir = run_dir.parent / "clean"
with Experiment(config, run_dir=clean_dir, cache_dir=warm_start_cache) as clean:
    clean.run(REAL_STEPS)
predicted = sim.calibrate(clean_dir / "trace.jsonl", faults=plan)
measured = sim.calibrate(events, faults=plan)  # read the same way, from the real trace
print(f"{'':>18} {'measured':>9} {'simulated':>9}")
for name in ("samples_per_s", "goodput", "lost_samples", "lost_steps", "staleness_mean"):
    real, model = measured.measured_figures[name], predicted.predicted_figures[name]
    print(f"{name:>18} {real:>9.3f} {model:>9.3f}")

# %%
import matplotlib.pyplot as plt  # noqa: E402

figure, axes = plt.subplots(figsize=(7.0, 3.0))
real = measured.measured_staleness
model = predicted.predicted.staleness
ages = sorted(set(real) | set(model))
width = 0.4
axes.bar(
    [a - width / 2 for a in ages],
    [real.get(a, 0) / max(sum(real.values()), 1) for a in ages],
    width,
    label="measured",
)
axes.bar(
    [a + width / 2 for a in ages],
    [model.get(a, 0) / max(sum(model.values()), 1) for a in ages],
    width,
    label="simulated",
)
axes.set(xlabel="staleness (versions)", ylabel="share of trained groups", xticks=ages)
axes.set_title("staleness of trained groups under the fault plan: measured vs simulated")
axes.legend(frameon=False)
plt.show()  # shown once (the figure as the cell's value would show it a second time)

# %% [markdown]
# ## 5. The tuner's advice, checked for real
#
# Sections 1 and 2 swept two knobs by hand. `sim.tune` searches several at once: fitted
# to one fault-free run of the settings a cautious user starts from (η = 0, a checkpoint
# every 20 steps), it simulates candidates for the staleness bound η, the push
# interval, the pull mode and the checkpoint interval under a fault plan (two trainer
# preemptions and a worker preemption) and returns the fastest, with its predicted
# gain in trained samples per second over the start. Then both settings run for real
# with the same plan, and the measured gain is set against the predicted one:
# `(1 + measured) / (1 + predicted) - 1`, 0 when the advice is worth exactly what was
# promised (the goal is within ±0.10).
#
# The runs use the tests' tiny model with two workers on one slice, timed on the CPU
# clock of this process (`record_local_run(clock="cpu")`, the chunks decoded one after
# another, `runtime.threaded_chunks=false`): the windows last about a second, and on a
# shared machine the wall clock would measure the neighbours. The simulator models
# that host as serial (`host.serial_chunks`). With the CI settings (one short run of
# each) the measured gain is mostly noise; `benchmarks/tune_check.py` is the same
# check with longer runs in the order default, tuned, tuned, default.

# %%
from rlaxkit.runtime import record_local_run  # noqa: E402

TUNE_STEPS, TUNE_RUNS, WARMUP = (12, 1, 3) if SMALL else (40, 2, 3)
TUNE_SEEDS = range(1 if SMALL else 3)
TUNE_FAULTS = [
    {"kind": "preempt_trainer", "at_step": 9, "restart_after_s": 3},
    {"kind": "preempt_worker", "target": "worker-0", "at_s": 20, "restart_after_s": 4},
    {"kind": "preempt_trainer", "at_step": 19, "restart_after_s": 2},
]
tune_plan = FaultPlan.from_dicts(TUNE_FAULTS[:1] if SMALL else TUNE_FAULTS)  # CI: 12 steps
start = [
    *SMALL_RUN,
    "runtime.workers_per_slice=2",
    "runtime.threaded_chunks=false",
    "staleness.max_staleness=0",
    "checkpoint.every_steps=20",
]


def tune_config(settings=None):
    changes = sim.run_overrides(settings or {})  # the tuner's names to the run config's
    return RunConfig.from_dict(apply_overrides(RunConfig().to_dict(), [*start, *changes]))


def record(config, plan=None, steps=TUNE_STEPS):
    events, runs = record_local_run(
        config, steps, warmup_steps=WARMUP, clock="cpu", cache_dir=warm_start_cache, faults=plan
    )
    print(f"recorded in {runs} run(s)")  # a run whose window compiled is run again
    return events


# Not measured: the warm start, and the programs compiled up to a trainer's restore.
record(tune_config(), FaultPlan.from_dicts(TUNE_FAULTS[:1]), steps=10)
# Fault-free, in a run directory (an empty plan), so that its checkpoint saves are timed.
base = record(tune_config(), FaultPlan())
scenario, _ = sim.fit_scenario(base, warmup_steps=WARMUP, faults=tune_plan)
serial = {"host.serial_chunks": True}
tuned = sim.tune(
    sim.with_overrides(scenario, serial),
    sim.TuneSpace(
        max_staleness=(0, 1, 2, 4),
        push_every_steps=(1, 2),
        pull_mode=("between_requests", "in_flight"),
        checkpoint_every_steps=(5, 10, 20),
    ),
    seeds=TUNE_SEEDS,
)
print(tuned.table())
choices = {"default": tuned.default.settings, "tuned": tuned.best.settings}
check = {}
for label, settings in choices.items():
    predicted = sim.calibrate(
        base,
        warmup_steps=WARMUP,
        faults=tune_plan,
        overrides={**settings, **serial},
        repeats=len(TUNE_SEEDS),
    ).predicted_figures["samples_per_s"]
    check[label] = {"predicted": predicted, "measured": []}
for r in range(TUNE_RUNS):  # default, tuned, tuned, default, ...
    for label in ("default", "tuned") if r % 2 == 0 else ("tuned", "default"):
        events = record(tune_config(choices[label]), tune_plan)
        figures = sim.calibrate(events, warmup_steps=WARMUP, faults=tune_plan).measured_figures
        check[label]["measured"].append(figures["samples_per_s"])
gain = {
    kind: (np.mean(check["tuned"][kind]) / np.mean(check["default"][kind]) - 1)
    for kind in ("predicted", "measured")
}
print("tuned:", choices["tuned"])
print(
    f"gain over the start: predicted {gain['predicted']:+.1%}, measured {gain['measured']:+.1%}, "
    f"gain error {(1 + gain['measured']) / (1 + gain['predicted']) - 1:+.3f}"
)

# %%
figure, axes = plt.subplots(figsize=(6.0, 3.0))
for i, kind in enumerate(("predicted", "measured")):
    values = [np.mean(check[label][kind]) for label in ("default", "tuned")]
    axes.bar([x + (i - 0.5) * 0.38 for x in (0, 1)], values, 0.38, label=kind)
axes.set_xticks([0, 1], ["start (η = 0, checkpoint every 20)", "tuned by sim.tune"])
axes.set(ylabel="trained samples / s (CPU clock)")
axes.set_title(
    f"the tuner's advice under preemptions: gain predicted {gain['predicted']:+.0%}, "
    f"measured {gain['measured']:+.0%}"
)
axes.legend(frameon=False)
plt.show()
