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
# # 05 · Simulator vs reality
#
# The simulator is only worth trusting where it reproduces what it models. Here we
# run the real local runtime, write its trace, **fit** a scenario to that trace
# (`sim.calibrate`: decode time per token and per concurrent sequence, prefill rate,
# trainer tokens/s and step overhead, reward/push/pull latencies, the empirical
# completion lengths, the run's policies and fleet shape), re-simulate the fitted
# scenario, and overlay prediction on measurement.
#
# Both sides write the same trace schema (`rlaxkit.trace`), so the same functions
# read them.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("RLAXKIT_NOTEBOOK_SMALL", "0") == "1"
STEPS = 10 if SMALL else 40
MAX_STALENESS = 2

# %%
# %matplotlib inline
import tempfile
from pathlib import Path

import sim
from rlaxkit.config import SMALL_RUN, RunConfig
from rlaxkit.configio import apply_overrides
from rlaxkit.plotting import overlay_figure
from rlaxkit.runtime import Experiment
from rlaxkit.trace import MemoryTrace, durations, generation_records, read_trace

small_model = list(SMALL_RUN)  # rlaxkit.config's tiny run, for CI
overrides = [*(small_model if SMALL else []), f"staleness.max_staleness={MAX_STALENESS}"]
config = RunConfig.from_dict(apply_overrides(RunConfig().to_dict(), overrides))
workdir = Path(tempfile.mkdtemp(prefix="rlaxkit-nb05-"))

# %% [markdown]
# ## A real run and its trace
#
# One throw-away step first, so that the warm start and the compilations are not part
# of the measured trace; then the measured run writes `trace.jsonl` into its run
# directory.

# %%
with Experiment(config, cache_dir=workdir / "cache") as exp:
    exp.step()
with Experiment(config, run_dir=workdir / "run", cache_dir=workdir / "cache") as exp:
    exp.run(STEPS)
measured = read_trace(workdir / "run" / "trace.jsonl")
print(f"{len(measured)} events, kinds: {sorted({e.kind for e in measured})}")

# %% [markdown]
# ## Fit and re-simulate

# %%
calibration = sim.calibrate(workdir / "run" / "trace.jsonl")
print(calibration.report())
print({name: round(value, 5) for name, value in calibration.fitted.items()})
print("relative errors:", {k: round(v, 3) for k, v in calibration.errors().items()})

# %% [markdown]
# How to read the errors: `samples_per_s` is the headline the fit is for. For
# `tokens_per_s`, note that the runtime's `train_step` events count completion tokens
# only, while the simulator's count prompt and completion tokens, so with prompts
# longer than completions (as here) that row compares different quantities. Staleness
# depends on the order in which the deterministic runtime interleaves workers and
# trainer, which the simulator models as concurrent processes; the gap shows how much
# that matters at this scale.
#
# ## Overlay
#
# The fitted scenario simulated again with a trace sink, so the prediction can be
# read with the same functions as the measurement: empirical CDFs of per-sequence
# generation latency, train-step time, completion length, and the times at which the
# trainer finished its steps (the CDF of step end times is the fraction of the run's
# steps done by then).

# %%
predicted_trace = MemoryTrace()
sim.simulate(calibration.scenario, trace=predicted_trace)
predicted = predicted_trace.events


def panels(events):
    records = generation_records(events)
    start = min(r.start_s for r in records)  # the runtime's clock also counts its set-up
    return {
        "generation latency (s)": [r.latency_s for r in records],
        "train step (s)": durations(events, "train_step"),
        "completion tokens": [r.tokens for r in records],
        "train step end (s after first generation)": [
            e.t - start for e in events if e.kind == "train_step"
        ],
    }


real, model = panels(measured), panels(predicted)
overlay_figure({name: (real[name], model[name]) for name in real})
