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
# # 06 · Bring your own checkpoint
#
# rlaxkit trains Hugging Face checkpoints of the Qwen2 / Qwen3 / Llama-3 family from a
# **local directory** (`config.json`, safetensors weights, a tokenizer): no
# download happens at run time. To keep this notebook self-contained (and runnable in
# CI), it first *writes* such a directory: a tiny Qwen3-shaped model, warm-started on
# addition so that it solves some problems. Point `CHECKPOINT` at your own directory
# to use a real model instead (on CPU keep it small; `model.param_dtype` picks
# float32 or bfloat16).
#
# Then: load it, measure held-out pass@k, start RL from it, and measure again.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("RLAXKIT_NOTEBOOK_SMALL", "0") == "1"
CHECKPOINT = None  # a local HF checkpoint directory; None writes a tiny one below
STEPS = 6 if SMALL else 60
SAMPLES = 8  # pass@k for k = 1, 2, 4, 8
EVAL_PROBLEMS = 8 if SMALL else 200

# %%
# %matplotlib inline
import tempfile
from pathlib import Path

from rlaxkit.config import SMALL_RUN, RunConfig, apply_overrides
from rlaxkit.evaluation import evaluate_policy
from rlaxkit.inference import make_text_generate
from rlaxkit.models import load_hf_checkpoint, save_hf_checkpoint
from rlaxkit.observe import pass_at_k_figure
from rlaxkit.runtime import Experiment, build_policy, build_task, warm_start

small = list(SMALL_RUN)  # rlaxkit.config.run's tiny run, for CI
base = RunConfig.from_dict(apply_overrides(RunConfig().to_dict(), small if SMALL else []))
workdir = Path(tempfile.mkdtemp(prefix="rlaxkit-nb06-"))

# %% [markdown]
# ## A checkpoint directory
#
# `save_hf_checkpoint` writes the model the way `transformers` does (`config.json`
# with `model_type: qwen3`, `model.safetensors`) and the tokenizer next to them (this
# tiny model's character tokenizer as `char_tokenizer.json`; a real checkpoint brings
# its `tokenizer.json`).

# %%
if CHECKPOINT is None:
    task = build_task(base)
    model, tokenizer = build_policy(base, task)
    model, info = warm_start(base, task, model, tokenizer, cache_dir=None)
    CHECKPOINT = save_hf_checkpoint(model, workdir / "tiny-qwen3", tokenizer=tokenizer)
    print(f"warm start: {info['steps']} steps, final loss {info['final_loss']:.3f}")
sorted(p.name for p in Path(CHECKPOINT).iterdir())

# %% [markdown]
# ## Load it and measure pass@k
#
# `load_hf_checkpoint` checks every tensor's name and shape against the architecture
# in `config.json` and names the first one that does not fit.

# %%
model, tokenizer = load_hf_checkpoint(CHECKPOINT)
task = build_task(base)
ks = [k for k in (1, 2, 4, 8) if k <= SAMPLES]
problems = task.problems("test", EVAL_PROBLEMS)
before = evaluate_policy(
    task,
    make_text_generate(model, tokenizer, base.sampling),
    problems=problems,
    n=SAMPLES,
    ks=ks,
)
print(model.config.family, f"{model.config.num_layers} layers, hidden {model.config.hidden_size}")
print(before.table())

# %% [markdown]
# ## Start RL from it
#
# `model.checkpoint` makes the run load the directory (its tokenizer included) instead
# of building a fresh model; `sft.steps=0` skips the supervised warm start because
# the checkpoint is the starting point.

# %%
rl = [f"model.checkpoint={CHECKPOINT}", "sft.steps=0", f"steps={STEPS}"]
if SMALL:  # few steps: a larger learning rate without warm-up so they show
    rl += ["optimizer.learning_rate=0.003", "optimizer.warmup_steps=0"]
config = RunConfig.from_dict(apply_overrides(base.to_dict(), rl))
with Experiment(config, run_dir=workdir / "run") as exp:
    metrics = exp.run()
    after = evaluate_policy(
        task,
        make_text_generate(exp.current_model(), exp.tokenizer, base.sampling),
        problems=problems,
        n=SAMPLES,
        ks=ks,
    )
    save_hf_checkpoint(exp.current_model(), workdir / "after-rl", tokenizer=exp.tokenizer)
print(
    f"train reward: step 1 {metrics[0]['reward/mean']:.3f}, last {metrics[-1]['reward/mean']:.3f}"
)
print(after.table())

# %%
pass_at_k_figure({"checkpoint": before.rows, f"after {STEPS} RL steps": after.rows})
