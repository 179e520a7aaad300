# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · Step through one training step
#
# One turn of the RL loop by hand, with the library's own parts: build a tiny
# Qwen3-shaped model, warm-start it on addition, **sample** a group of completions
# with the jitted KV-cache sampler, **score** them with the task's verifiable reward,
# turn rewards into **advantages** (GRPO), take **one train step**, and look at what
# the step did: importance ratios, clipping and the size of the update.
#
# The runtime (`rlaxkit.runtime.Experiment`, notebook 02) does exactly this in a loop,
# with many workers, a parameter server and a staleness bound.

# %% tags=["parameters"]
import os

# CI sets RLAXKIT_NOTEBOOK_SMALL=1: a smaller model and a shorter warm start.
SMALL = os.environ.get("RLAXKIT_NOTEBOOK_SMALL", "0") == "1"
NUM_PROMPTS = 4  # prompts in the batch; GROUP_SIZE samples each
GROUP_SIZE = 8
PRESET = "grpo"

# %%
# %matplotlib inline
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlaxkit.algorithms import AdvantageInputs, algorithm, compute_advantages
from rlaxkit.config import RunConfig, apply_overrides
from rlaxkit.data import Sample, collate
from rlaxkit.inference import generate
from rlaxkit.models import positions_from_mask
from rlaxkit.observe import update_figure
from rlaxkit.runtime import build_policy, build_task, warm_start
from rlaxkit.trainer import TrainConfig, create_train_state, make_train_step, token_logprobs

small = [
    "model.config.hidden_size=32",
    "model.config.intermediate_size=64",
    "model.config.num_layers=2",
    "task.options.max_digits=1",
    "task.num_train=80",
    "sft.steps=150",
    "sft.batch_size=32",
]
config = RunConfig.from_dict(
    apply_overrides(RunConfig().to_dict(), [*(small if SMALL else []), f"sampling.n={GROUP_SIZE}"])
)
config.model.config

# %% [markdown]
# ## The model and its warm start
#
# `build_policy` makes a fresh decoder with a character tokenizer over the task's
# alphabet; `warm_start` runs a short supervised phase on the task's demonstrations,
# so that RL starts from a policy that sometimes succeeds (a group whose samples all
# get the same reward carries no learning signal).

# %%
task = build_task(config)
model, tokenizer = build_policy(config, task)
model, info = warm_start(config, task, model, tokenizer, cache_dir=None)
info

# %% [markdown]
# ## Sample a group
#
# `generate` prefills each prompt once and decodes `n` samples per prompt in one
# compiled loop. Every token comes back with its **behaviour log-prob** (under the
# distribution it was drawn from) and the **weight version** that produced it.

# %%
problems = task.problems("train", NUM_PROMPTS)
prompts = [tokenizer.encode(task.format_prompt(p)) for p in problems]
sampling = dataclasses.replace(config.sampling, stop_tokens=(tokenizer.eos_id,))
result = generate(model, prompts, sampling, rng=0, version=0)
result.tokens.shape, result.lengths[0]

# %% [markdown]
# ## Score it
#
# The task parses each completion and checks it against the problem's answer; the
# reward is a number and a reason.

# %%
samples, rows = [], []
for i, problem in enumerate(problems):
    for completion in result.completions()[i]:
        tokens = completion.tokens.tolist()
        if completion.finish_reason == "stop":
            tokens = tokens[:-1]  # drop the end-of-sequence token before decoding
        text = tokenizer.decode(tokens)
        scored = task.score(problem, text)
        rows.append((task.format_prompt(problem), text, scored.score, scored.reason))
        samples.append(
            Sample(
                prompt_tokens=completion.prompt_tokens,
                completion_tokens=completion.tokens,
                behaviour_logprobs=completion.logprobs,
                versions=completion.versions,
                reward=scored.score,
                group_id=i,
            )
        )
for prompt, text, reward, reason in rows[:GROUP_SIZE]:
    print(f"{prompt!r:>14} -> {text!r:10} reward {reward:.1f} {reason or ''}")

# %% [markdown]
# ## Advantages
#
# `collate` pads the samples into one bucketed `TrainBatch` (prompt, then completion,
# right-padded). GRPO's advantage is the reward standardised within its group,
# $A_i = (R_i - \mathrm{mean}_g R)/\mathrm{std}_g R$, spread over the completion's
# tokens. Groups where every sample got the same reward have zero advantage.

# %%
batch = collate(samples, pad_token_id=tokenizer.pad_id)
algo = algorithm(PRESET, loss={"kl_coef": 0.0})
advantages, _ = compute_advantages(
    AdvantageInputs(
        rewards=jnp.asarray(batch.rewards),
        group_ids=jnp.asarray(batch.group_ids),
        sequence_mask=jnp.asarray(batch.sequence_mask),
        loss_mask=jnp.asarray(batch.loss_mask),
    ),
    algo.advantage,
)
n = len(samples)
row_advantage = (np.asarray(advantages) * batch.loss_mask).sum(1) / batch.loss_mask.sum(1).clip(1)
print("rewards\n", batch.rewards[:n].reshape(NUM_PROMPTS, GROUP_SIZE))
print("advantages\n", row_advantage[:n].reshape(NUM_PROMPTS, GROUP_SIZE).round(2))

# %% [markdown]
# ## One train step
#
# `make_train_step` returns a jitted `train_step(state, batch) -> (state, metrics)`.
# The batch was sampled with the weights being trained (version 0), so every ratio
# $r = \pi_\theta / \pi_\mathrm{behaviour}$ is 1 at the first update: nothing is
# clipped yet.

# %%
graphdef, params = nnx.split(model)
train_config = TrainConfig(algorithm=algo, optimizer=config.optimizer)
state = create_train_state(train_config, jax.tree.map(jnp.copy, params), seed=config.seed)
train_step = make_train_step(train_config, graphdef, donate=False)
new_state, metrics = train_step(state, batch)
{k: round(float(v), 4) for k, v in metrics.items()}

# %% [markdown]
# ## What the step did
#
# Recompute the log-probs of the same tokens under the updated weights: the ratio to
# the behaviour log-probs is what the *next* update on this batch (a second PPO epoch,
# or a stale rollout in an asynchronous run) would see. Tokens with a positive
# advantage became more likely, negative ones less; the PPO clip
# $[1-\varepsilon, 1+\varepsilon]$ bounds how far one batch may pull the policy.
# The first Adam update moves every weight by about the learning rate (it is close to
# `lr · sign(g)`), so the relative update is largest where weights are small.

# %%
positions = positions_from_mask(jnp.asarray(batch.attention_mask))
new_model = nnx.merge(graphdef, new_state.params)
new_logprobs = token_logprobs(
    new_model, jnp.asarray(batch.tokens), positions, jnp.asarray(batch.attention_mask)
)
mask = batch.loss_mask > 0
ratios = np.exp(np.asarray(new_logprobs) - batch.behaviour_logprobs)[mask]
token_advantages = np.asarray(advantages)[mask]
eps_low, eps_high = algo.loss.clip_eps_low, algo.loss.clip_eps_high
outside = np.mean((ratios < 1 - eps_low) | (ratios > 1 + eps_high))
relative_update = {  # ||Δθ|| / ||θ|| per parameter tensor
    jax.tree_util.keystr(path, simple=True, separator="/"): float(
        jnp.linalg.norm(new - old) / jnp.linalg.norm(old)
    )
    for (path, new), old in zip(
        jax.tree_util.tree_leaves_with_path(new_state.params),
        jax.tree.leaves(params),
        strict=True,
    )
}
print(f"ratio after the step: mean {ratios.mean():.4f}, {ratios.min():.3f}..{ratios.max():.3f}")
print(f"tokens outside the clip range: {outside:.1%}")
print(f"largest relative update: {max(relative_update.items(), key=lambda kv: kv[1])}")

# %%
fig = update_figure(ratios, token_advantages, relative_update, clip=(eps_low, eps_high))
fig
