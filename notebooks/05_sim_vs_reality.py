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
# The simulator is only worth trusting where it predicts what it models. Here we
# run the real local runtime, write its trace, **fit** a scenario to that trace
# (`sim.calibrate`), re-simulate it, overlay prediction on measurement, and then
# **predict a second run with another staleness bound** and run it to check.
#
# The local runtime's deterministic mode is one thread: rounds in which every busy
# worker decodes one chunk of `runtime.chunk_steps` tokens over all its slots, with
# the trainer's steps in between. The fit for such a trace is the simulator's
# *serial host* (`sim/entities/host.py`): chunk cost (fixed, per step, per sequence started
# and finished, from the trace's `decode` events), scoring, the host's own time per
# chunk, per issued and scored sequence and per train step, trainer time per token,
# push/pull latencies, the empirical completion lengths and the share of groups
# dynamic filtering dropped. A real fleet's trace gets the per-token parallel model
# instead (`docs/simulator.md`).
#
# Both sides write the same trace schema (`rlaxkit.rules.trace`), so the same functions
# read them.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("RLAXKIT_NOTEBOOK_SMALL", "0") == "1"
STEPS = 12 if SMALL else 40
MAX_STALENESS = 2
OTHER_STALENESS = 0  # the setting predicted from the fit

# %%
# %matplotlib inline
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

import sim
from rlaxkit.config import SMALL_RUN, RunConfig, apply_overrides
from rlaxkit.observe import overlay_figure
from rlaxkit.rules import MemoryTrace, durations, generation_records, read_trace
from rlaxkit.runtime import Experiment
from sim import window_summary

small_model = list(SMALL_RUN)  # rlaxkit.config.run's tiny run, for CI
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
# How to read the errors: both throughputs are measured over the same window, from
# the end of train step `warmup_steps` (3: the first steps still compile programs for
# shapes they meet) to the last step. `samples_per_s` is the headline the fit is for;
# `tokens_per_s` counts prompt and completion tokens of the trained sequences on both
# sides. A short run is noisy at this scale (a window of a second or two on a shared
# machine): `docs/simulator.md` gives the errors measured over many runs.
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


# %% [markdown]
# ## Predict another setting, then run it
#
# The same fit, with `staleness.max_staleness` changed, predicts a run at
# η = OTHER_STALENESS; then that run is made for real and measured over the same
# window. (`tests/test_sim_calibrate_runtime.py` checks this within 10% on repeated
# tiny runs; one pair of short runs here may be further off on a busy machine.)

# %%
prediction = sim.calibrate(
    workdir / "run" / "trace.jsonl", overrides={"staleness.max_staleness": OTHER_STALENESS}
)
other_config = RunConfig.from_dict(
    apply_overrides(config.to_dict(), [f"staleness.max_staleness={OTHER_STALENESS}"])
)
with Experiment(other_config, run_dir=workdir / "other", cache_dir=workdir / "cache") as exp:
    exp.run(STEPS)
other = window_summary(read_trace(workdir / "other" / "trace.jsonl"), warmup_steps=3)
predicted_rate = prediction.predicted_window.samples_per_s
print(
    f"eta = {OTHER_STALENESS}: predicted {predicted_rate:.0f} samples/s, measured "
    f"{other.samples_per_s:.0f} ({predicted_rate / other.samples_per_s - 1:+.1%})"
)

rows = {
    f"eta = {MAX_STALENESS} (fitted run)": (
        calibration.measured.samples_per_s,
        calibration.predicted_window.samples_per_s,
    ),
    f"eta = {OTHER_STALENESS} (predicted run)": (other.samples_per_s, predicted_rate),
}
fig, ax = plt.subplots(figsize=(7, 4))
x = np.arange(len(rows))
ax.bar(x - 0.2, [m for m, _ in rows.values()], 0.4, label="measured")
ax.bar(x + 0.2, [p for _, p in rows.values()], 0.4, label="simulated")
ax.set_xticks(x, list(rows))
ax.set_ylabel("samples/s over the measured window")
ax.legend()
plt.show()
