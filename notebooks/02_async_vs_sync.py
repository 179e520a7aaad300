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
# # 02 · Asynchronous vs synchronous RL, for real
#
# Real local runs (`rlaxkit.runtime.Experiment`) of the same task, model and seed at
# staleness bounds η ∈ {0, 1, 2, 4}, each with plain GRPO and with AReaL's
# **decoupled PPO** (`preset: decoupled_ppo`), which corrects for stale rollouts by
# centring the trust region on a recomputed proximal policy and weighting each token by
# `π_prox / π_behaviour`.
#
# η = 0 is synchronous on-policy RL: a rollout is trained only if it was sampled with
# the trainer's current weights. η > 0 lets workers run ahead of the trainer by up to η
# versions (AReaL's admission rule: `accepted + running ≤ (η + version + 1) · batch`).
#
# What to read off the figure: reward per step, held-out pass@k after training, how
# stale the trained rollouts really were, and seconds per trainer step. The local
# backend runs in **deterministic mode** (one process, workers and trainer interleaved
# in a fixed order), so a seed fixes every number except wall time, and η changes
# *what* is trained, not how many chips work at once: the throughput gains of
# asynchrony on a real fleet are the simulator's subject (notebooks 03 and 04).
#
# One more run, **η=2 · overlapped**, is GRPO at η = 2 with
# `runtime.overlap_training=true`: while the trainer takes a step, the workers already
# generate the next batch with the weights from before it (a helper thread here; the
# trainer's own processes on Ray). A count, not the clock, decides how far they go, so
# this run too is the same every time; its rollouts are one version older, and its
# seconds per step show what overlapping the two buys on this machine.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("RLAXKIT_NOTEBOOK_SMALL", "0") == "1"
ETAS = (0, 2) if SMALL else (0, 1, 2, 4)  # CI runs two bounds of the four
PRESETS = ("grpo", "decoupled_ppo")
STEPS = 5 if SMALL else 60
EVAL_SAMPLES = 4 if SMALL else 8  # pass@k for k = 1, 2, 4(, 8)
EVAL_PROBLEMS = 8 if SMALL else 200  # one-digit addition (SMALL) has few test problems

# %%
# %matplotlib inline
import tempfile
import time
from pathlib import Path

import numpy as np

from rlaxkit.config import SMALL_RUN, RunConfig, apply_overrides
from rlaxkit.evaluation import evaluate_policy
from rlaxkit.inference import make_text_generate
from rlaxkit.observe import compare_runs_figure, export_perfetto
from rlaxkit.rules import staleness_distribution
from rlaxkit.runtime import Experiment

SMALL_MODEL = [*SMALL_RUN, "runtime.slots_per_worker=32"]  # config.SMALL_RUN, wider


def config_for(eta: int, preset: str, overlap: bool = False) -> RunConfig:
    overrides = [
        *(SMALL_MODEL if SMALL else []),
        f"steps={STEPS}",
        f"staleness.max_staleness={eta}",
        f"algorithm.preset={preset}",
        f"runtime.overlap_training={'true' if overlap else 'false'}",
        # metrics.jsonl is always written; TensorBoard too (pip install 'rlaxkit[tensorboard]';
        # wandb and mlflow are the other trackers, see docs/observability.md).
        "tracking=[jsonl,tensorboard]",
    ]
    return RunConfig.from_dict(apply_overrides(RunConfig().to_dict(), overrides))


# All runs share one warm start: it depends on the model, task, SFT config and seed only.
warm_start_cache = tempfile.mkdtemp(prefix="rlaxkit-nb02-")
# Each run writes a directory here: config.yaml, metrics.jsonl, trace.jsonl, tensorboard/.
runs_root = Path(tempfile.mkdtemp(prefix="rlaxkit-nb02-runs-"))

# %% [markdown]
# ## The runs
#
# Each run: build the experiment (the warm start is loaded from the shared cache after
# the first), take `STEPS` trainer steps, evaluate pass@k on held-out problems. The
# time per step is the wall-clock median over the steps after the first (the first
# compiles), everything included: decoding, rewards, the train step, the push.

# %%
runs = {}
# (η, preset, overlapped): every η with each preset, and GRPO at η = 2 overlapped.
settings = [(eta, preset, False) for preset in PRESETS for eta in ETAS] + [(2, "grpo", True)]
for eta, preset, overlap in settings:
    name = "overlapped" if overlap else "decoupled" if preset == "decoupled_ppo" else preset
    label = f"η={eta} · {name}"
    config = config_for(eta, preset, overlap)
    run_dir = runs_root / f"eta{eta}-{preset}{'-overlapped' if overlap else ''}"
    with Experiment(config, run_dir=run_dir, cache_dir=warm_start_cache) as exp:
        metrics, step_s = [], []
        for _ in range(STEPS):
            start = time.perf_counter()
            metrics.append(exp.step())
            step_s.append(time.perf_counter() - start)
        exp.check_accounting()
        generate = make_text_generate(exp.current_model(), exp.tokenizer, exp.config.sampling)
        report = evaluate_policy(
            exp.task,
            generate,
            problems=exp.task.problems("test", EVAL_PROBLEMS),
            n=EVAL_SAMPLES,
            ks=[k for k in (1, 2, 4, 8) if k <= EVAL_SAMPLES],
            runner=exp.parts.scorer,
        )
        runs[label] = {
            "metrics": metrics,
            "pass_at_k": report.rows,
            "staleness": staleness_distribution(exp.trace.memory.events),
            "step_s": float(np.median(step_s[1:])),
            "wall_s": sum(step_s),
            "dropped": exp.buffer.counts()["dropped_by_reason"],
        }
    print(
        f"{label:18} wall {sum(step_s):5.1f} s  pass@1 {report.rows[0]['pass@k']:.3f}  "
        f"mean staleness {np.mean([m['staleness/mean'] for m in metrics]):.2f}  "
        f"dropped {runs[label]['dropped']}"
    )

# %% [markdown]
# ## Looking at the runs: TensorBoard and Perfetto
#
# `tracking=[jsonl,tensorboard]` in the config (on the command line:
# `--set 'tracking=[jsonl,tensorboard]'`) gave every run a `tensorboard/` folder beside
# its `metrics.jsonl`: `tensorboard --logdir RUNS_ROOT` overlays the nine runs (step
# metrics, the staleness histogram of each batch, the config and the summary). `wandb`
# (offline with `WANDB_MODE=offline`) and `mlflow` (a SQLite store in the run directory)
# take the same list. The Perfetto export (`rlaxkit trace RUN_DIR` from the shell) turns
# a run's `trace.jsonl` into a timeline of every slot, train step, push and pull: drag
# the file into https://ui.perfetto.dev.

# %%
run_dir = runs_root / "eta2-grpo"
print("tensorboard --logdir", runs_root)
print(sorted(p.name for p in run_dir.iterdir()))
export = export_perfetto(run_dir, run_dir / "run.perfetto.json")
print(f"{export.path}: {export.events} events on {export.tracks} tracks, {export.bytes} bytes")

# %% [markdown]
# ## Ratios: where decoupled PPO matters
#
# At η = 0 the behaviour policy *is* the policy being trained, so every importance
# ratio is 1 at the first update and GRPO and decoupled PPO train identically. With
# η > 0 stale tokens arrive with ratios away from 1; decoupled PPO clips around the
# proximal policy instead of the stale behaviour policy.

# %%
for label, run in runs.items():
    ratio = [m["train/ratio_mean"] for m in run["metrics"]]
    clipped = [m["train/clip_fraction"] for m in run["metrics"]]
    print(f"{label:18} ratio mean {np.mean(ratio):.4f}  clip fraction {np.mean(clipped):.4f}")

# %%
compare_runs_figure(runs, smooth=1 if SMALL else 5)
