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
# # 08 · Plan a TPU run before renting the pod
#
# RLAX trained QwQ-32B on 1024 v5p chips for 12 h 48 min, with preemptions. Before
# spending a pod on a run like it, two questions: **do the programs fit the chips**, and
# **what will the run do over its hours**? The first is the TPU compiler's: rlaxkit
# compiles its own programs with XLA:TPU on this machine (`libtpu`, no chip attached) and
# reads the memory each needs per chip against the chip's HBM, with the compiler's
# estimate of each program's time. The second is the simulator's: it takes those
# compiled costs, adds what a compiler cannot know (preemptions, the verifier's
# latency, the long tail of completion lengths), and runs the hours in seconds.
#
# The plan is `configs/plan/qwq32b_v5p_1024.yaml`: a v5p-512 trainer slice (256 chips)
# and 96 inference workers of 8 chips, completions of up to 32k tokens, GRPO groups of
# 16. The file says why that split. Compiling its programs takes minutes on two cores,
# so this notebook reads the result stored beside the YAML, written by
# `rlaxkit plan configs/plan/qwq32b_v5p_1024.yaml --json` (7 minutes on two cores).

# %% tags=["parameters"]
import os

SMALL = os.environ.get("RLAXKIT_NOTEBOOK_SMALL", "0") == "1"
HOURS = 0.25 if SMALL else 13.0  # simulated hours (RLAX's run took 12 h 48 min)
SEED = 0

# %%
# %matplotlib inline
import json
from pathlib import Path

import rlaxkit
import sim
from rlaxkit.observe import throughput_figure, timeline_figure
from rlaxkit.planning import Plan
from rlaxkit.rules import MemoryTrace

ROOT = Path(rlaxkit.__file__).parents[1]  # the repository, from any folder
PLAN = ROOT / "configs/plan/qwq32b_v5p_1024.yaml"

# %% [markdown]
# ## What the TPU compiler says
#
# One row per program and device: the bytes its arguments, outputs and temporaries take
# per chip, against the chip's HBM; whether it fits; its FLOPs per chip; and the
# compiler's estimated time (an estimate from the compiler's cost model, not a
# measurement). `train` is one step of the trainer: 256 rows of 33 792 tokens in 8
# micro-batches on 256 chips; `prefill` starts a worker's 64 sequences from 4 prompts of
# 1 024 tokens; `decode` is one step of a worker's 64 sequences; `publish`
# converts the trainer's float32 master weights to the bfloat16 a worker holds and splits
# them as its 8 chips do.

# %%
plan = Plan.from_summary(json.loads(PLAN.with_name(PLAN.stem + ".plan.json").read_text()))
print(plan.table())
summary = plan.summary()
print("compiled by:", summary["compiler"])

# %% [markdown]
# A worker's 8 chips hold the weights and 64 sequences of up to 33 792 tokens: 73.8 GiB
# of the 95 GiB of HBM per chip for a decode step, 74.8 GiB for a prefill, so both fit
# with room to spare. The compiler puts one step of the 64 rows at full length at about
# 46 ms, a little under the 48 ms the roofline at 60 % of HBM bandwidth gives. The
# train step fits at 67 GiB per chip on the trainer's `(1, 32, 8)` mesh (the YAML says
# why not `(1, 64, 4)`). The compiler puts it at about 126 s, 14 % MFU against the 40 %
# the plan assumed: at 33k tokens a row, the training forward's attention materialises
# each head's 33k x 33k scores, work and memory traffic a blocked attention would avoid.
# The simulation below uses the compiler's 126 s.

# %% [markdown]
# ## The run, simulated
#
# `sim.presets.from_plan` takes the RLAX-like scenario (`sim.presets.rlax_like`: every
# assumption sourced or marked in its docstring, preemptions on) and replaces its
# assumed costs with the plan's: the workers' shape and per-step decode time, the push
# bytes, the number of workers (96), the trainer's step time.

# %%
base = sim.presets.rlax_like(hours=HOURS, seed=SEED)
planned = sim.presets.from_plan(PLAN, base=base)
runs = {}
traces = {}
for name, scenario in (("assumed costs", base), ("compiled plan", planned)):
    traces[name] = MemoryTrace()
    runs[name] = sim.simulate(scenario, trace=traces[name])
for name, result in runs.items():
    print(
        f"{name:>14}: {result.samples_per_s:6.1f} samples/s, goodput {result.goodput:.2f}, "
        f"{result.steps} steps in {result.sim_time_s / 3600:.1f} h, mean staleness "
        f"{result.mean_staleness:.2f}, preemptions {result.preemptions}, "
        f"lost steps {result.lost_steps}, simulated in {result.wall_s:.1f} s"
    )

# %% [markdown]
# The compiled plan predicts fewer samples per second than the preset's assumptions, for
# two reasons. The plan gives the fleet 96 workers of 8 chips (768 chips, the rest is
# the trainer's) where the preset assumed 128 workers (1024 chips) beside the trainer.
# And a decode step of 64 sequences costs about 46 ms in the plan against 20 ms in the
# preset: the compiled step reads every row's cache at its full 33 792 tokens, while the
# preset assumed a 12k-token mean context (the plan's figure is an upper bound for
# shorter rows). Either way the fleet, not the trainer, bounds this run: a question to
# settle before renting (more workers, shorter completions, a smaller trainer slice).
#
# ## Its timeline and throughput
#
# The planned run, the first 16 workers and the trainer: each generation a bar coloured
# by the weight version it started on, preemptions hatched, pushes marked.

# %%
timeline_figure(traces["compiled plan"].events)

# %% [markdown]
# Throughput over the run: what to read in it. The decode time per step the compiler
# gives decides how many samples a worker finishes per hour; the trainer's step is the
# bound when samples are trained as fast as steps end, whatever the fleet does.
# Preemptions show as dips and as lost steps; their rate is the scenario's assumption
# (`sim.presets.rlax_like`'s docstring), not something a compiler can say.

# %%
throughput_figure(traces["compiled plan"].events)
