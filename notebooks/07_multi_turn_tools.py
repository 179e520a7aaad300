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
# # 07 · Multi-turn episodes with a tool
#
# An episode is several turns: the model writes until it calls a tool (here a
# calculator, `<calc>417*38</calc>`), the tool's answer is appended **as token ids**,
# and the model goes on. This notebook steps through one episode by hand with the
# engine's own calls (`submit(hold=True)`, `resume`), looks at what each token carries
# (who wrote it, its weight version, its behaviour log-prob), checks that the trained
# sequence is exactly the sampled ids plus the observation ids and that resuming the
# KV cache gives the log-probs of recomputing the whole episode, and then trains a few
# GRPO steps with `run_episodes` and the trainer.
#
# The same parts serve the code task with test feedback (`rlaxkit.tasks.code_tools`):
# there each turn is a program and the observation is the failing tests.

# %% tags=["parameters"]
import os

# CI sets RLAXKIT_NOTEBOOK_SMALL=1: a shorter format warm start and fewer train steps.
SMALL = os.environ.get("RLAXKIT_NOTEBOOK_SMALL", "0") == "1"
SFT_STEPS = 40 if SMALL else 300  # supervised steps on the tool-call format
TRAIN_STEPS = 2 if SMALL else 20
NUM_PROBLEMS = 2 if SMALL else 4  # problems per train step; GROUP_SIZE episodes each
GROUP_SIZE = 4 if SMALL else 8

# %%
# %matplotlib inline
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlaxkit.algorithms import algorithm
from rlaxkit.data import BucketSpec, collate
from rlaxkit.inference import InferenceEngine, SamplingConfig
from rlaxkit.models import CharTokenizer, ModelConfig, Transformer, positions_from_mask
from rlaxkit.observe import curves_figure
from rlaxkit.tasks import (
    Action,
    CalculatorEnvironment,
    CalculatorTask,
    Episode,
    EpisodeConfig,
    StepRecord,
    episode_sampling,
    run_episodes,
    tool_use_metrics,
)
from rlaxkit.trainer import (
    SFTConfig,
    TrainConfig,
    create_train_state,
    make_train_step,
    supervised_warm_start,
    token_logprobs,
)

# %% [markdown]
# ## A tiny model that knows the format
#
# The calculator task asks for 3-digit × 2-digit products, too long for a tiny model
# to work out. Its demonstrations are the ideal transcript: the call, the
# calculator's answer, the answer (`<calc>417*38</calc>=15846\n15846`). A few seconds
# of supervised training on them teach a tiny random model the *format*, so that many
# of its turns end in a tool call; it does not learn to copy the factors into the call
# or the result into its answer.

# %%
task = CalculatorTask()
tokenizer = CharTokenizer(task.alphabet())
model_config = ModelConfig(
    family="qwen3",
    vocab_size=tokenizer.vocab_size,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
)
model = Transformer(model_config, rngs=nnx.Rngs(0))
pairs = [(task.format_prompt(p), task.demonstration(p)) for p in task.problems("train", 200)]
sft = SFTConfig(steps=SFT_STEPS, batch_size=32, warmup_steps=10, learning_rate=1e-2)
losses = supervised_warm_start(model, tokenizer, pairs, sft)
print(f"warm start: {SFT_STEPS} steps, loss {losses[0]:.2f} -> {losses[-1]:.2f}")
print("a demonstration:", repr(pairs[0][1]))

# %% [markdown]
# ## One episode by hand
#
# `episode_sampling` makes the engine stop at the end token and after the tool's
# closing tag. A request submitted with `hold=True` whose turn ends in a tool call is
# **parked**: the engine keeps its row and KV cache until the observation arrives.
# We look for a problem whose first turn opens and closes a call.

# %%
sampling = episode_sampling(SamplingConfig(max_new_tokens=24), tokenizer, ("</calc>",))
engine = InferenceEngine(model, sampling, num_slots=8, max_prompt_len=64, chunk_steps=8)


def next_completion(engine):
    """Decodes until the one running turn finishes."""
    while not (finished := engine.step()):
        pass
    return finished[0]


for request, problem in enumerate(task.problems("train", 16)):
    environment = CalculatorEnvironment(task)
    prompt_ids = tokenizer.encode(environment.reset(problem))
    engine.submit(prompt_ids, jax.random.key(request), request_id=request, hold=True)
    first = next_completion(engine)
    first_text = tokenizer.decode(first.tokens.tolist())
    if first.parked and "<calc>" in first_text:  # ended in </calc>: the row waits
        break
    if first.parked:  # a malformed call: give the row back and try another problem
        engine.release(request)
assert first.parked, "no first turn called the tool: warm start longer"
print(f"prompt {environment.reset(problem)!r}, turn 1 {first_text!r} ({first.finish_reason})")

# %% [markdown]
# The environment answers the turn. Its observation is text in the tool's own format;
# it is encoded **once** and appended as ids: nothing already sampled is decoded and
# re-encoded (re-tokenising a history changes its tokens).

# %%
first_action = Action(first_text, tuple(first.tokens.tolist()), first.finish_reason)
first_result = environment.step(first_action)
observation_ids = tokenizer.encode(first_result.observation)
print(f"observation {first_result.observation!r} -> ids {observation_ids}")
print("tool call:", dict(first_result.info))

# %% [markdown]
# While the row waits, the trainer may publish new weights (here the same ones, as
# version 1). `resume` prefills only the observation into the parked row and decodes
# the next turn; its tokens carry version 1, the first turn's version 0.

# %%
engine.update_weights(model, version=1)
engine.resume(request, observation_ids, jax.random.key(1000))
second = next_completion(engine)
if second.parked:  # a second tool call: this walk-through stops here
    engine.release(request)
second_text = tokenizer.decode(second.tokens.tolist())
second_result = environment.step(
    Action(second_text, tuple(second.tokens.tolist()), second.finish_reason)
)
context = prompt_ids + first.tokens.tolist() + observation_ids
assert second.prompt_tokens.tolist() == context  # the turn followed the whole episode
print(f"turn 2 {second_text!r}: reward {second_result.reward}, done {second_result.done}")

# %% [markdown]
# `Episode` keeps the record `run_episodes` keeps: per token, who wrote it, its
# behaviour log-prob and version (environment tokens: log-prob 0, version -1).

# %%
episode = Episode(problem, 0, np.asarray(prompt_ids))
episode.add_policy_tokens(first)
episode.steps.append(
    StepRecord(first_action, "ok", 0.0, False, tuple(observation_ids), first_result.info)
)
episode.add_observation(observation_ids)
episode.add_policy_tokens(second)
second_action = Action(second_text, tuple(second.tokens.tolist()), second.finish_reason)
episode.steps.append(
    StepRecord(second_action, "ok", second_result.reward, True, (), second_result.info)
)
episode.reward, episode.finish_reason = second_result.reward, "stop"

# One row per policy token; the observation's tokens share one row.
print(f"{'token':>8} {'who':>11} {'version':>8} {'log-prob':>9}")
columns = (episode.tokens, episode.policy_mask, episode.versions, episode.behaviour_logprobs)
rows = zip(*columns, strict=True)
for i, (token, policy, version, logprob) in enumerate(rows):
    if policy:
        text = tokenizer.decode([token], skip_special_tokens=False)
        print(f"{text!r:>8} {'policy':>11} {version:>8} {logprob:9.3f}")
    elif episode.policy_mask[i - 1]:  # the first token of an observation
        print(f"{str(len(observation_ids)) + ' ids':>8} {'environment':>11} {version:>8} {'-':>9}")

# %% [markdown]
# ## What is trained is what was sampled
#
# `to_rollout` gives the episode as one `Rollout`; `collate` puts it in a train batch.
# The row is the prompt, then exactly the sampled ids and the observation ids, and the
# environment's tokens have `loss_mask` 0: they are not actions and carry no gradient.

# %%
rollout = episode.to_rollout(group_id=0)
batch = collate([rollout], pad_token_id=tokenizer.pad_id)
sampled = prompt_ids + first.tokens.tolist() + observation_ids + second.tokens.tolist()
start, end = len(prompt_ids), len(sampled)
assert batch.tokens[0, :end].tolist() == sampled
assert batch.loss_mask[0, start:end].tolist() == [float(p) for p in episode.policy_mask]
whole = rollout.prompt_tokens.tolist() + rollout.completion_tokens.tolist()
print("trained ids == prompt + turn 1 + observation + turn 2:", whole == sampled)
print("loss mask over the completion:", batch.loss_mask[0, start:end].astype(int).tolist())

# %% [markdown]
# ## Resuming the KV cache = recomputing the episode
#
# The second turn was decoded from a cache that held the first turn and had the
# observation prefilled into it. One forward pass over the whole episode gives the
# same log-probs for every policy token (the trainer's recomputation is this pass).

# %%
attention_mask = jnp.asarray(batch.attention_mask)
recomputed = token_logprobs(
    model, jnp.asarray(batch.tokens), positions_from_mask(attention_mask), attention_mask
)
policy = batch.loss_mask[0] > 0
gap = np.abs(np.asarray(recomputed)[0][policy] - batch.behaviour_logprobs[0][policy]).max()
print(f"largest |sampled - recomputed| log-prob over {policy.sum()} policy tokens: {gap:.1e}")
assert gap <= 1e-5

# %% [markdown]
# ## Train a few steps
#
# The loop with the pieces: `run_episodes` drives a group of episodes per problem
# (the parked rows keep their caches: `keep_cache=True`), `to_rollout` and `collate`
# build the batch (one width for every step, so the train step compiles once), GRPO's
# advantage is per episode (the group's episodes of a problem), and the engine gets
# the new weights after each step.
#
# Be warned: **this tiny model will not learn the task in a few steps.** It calls the
# tool, but with the wrong numbers, so almost every reward is 0 and GRPO has almost
# nothing to push on; here the curves only show the pieces running together. The
# learning run is `rlaxkit train configs/calculator_tools.yaml` (a longer warm start,
# asynchronous GRPO, held-out pass@1 and tool use over whole episodes before and
# after); `benchmarks/tool_learning.py` runs it and the same model without the tool.

# %%
graphdef, params = nnx.split(model)
train_config = TrainConfig(algorithm=algorithm("grpo", loss={"kl_coef": 0.0}))
state = create_train_state(train_config, jax.tree.map(jnp.copy, params), seed=0)
train_step = make_train_step(train_config, graphdef, donate=False)
episode_config = EpisodeConfig(
    samples_per_problem=GROUP_SIZE, max_turns=3, max_episode_tokens=48, keep_cache=True
)
train_problems = task.problems("train", NUM_PROBLEMS * TRAIN_STEPS)
history = []
for step in range(TRAIN_STEPS):
    problems = train_problems[step * NUM_PROBLEMS : (step + 1) * NUM_PROBLEMS]
    episodes = run_episodes(
        engine, lambda: CalculatorEnvironment(task), problems, tokenizer, episode_config, seed=step
    )
    rollouts = [e.to_rollout(group_id=i // GROUP_SIZE) for i, e in enumerate(episodes)]
    batch = collate(rollouts, bucket=BucketSpec(lengths=(64,)), pad_token_id=tokenizer.pad_id)
    state, metrics = train_step(state, batch)
    engine.update_weights(state.params, version=int(state.step))
    tools = tool_use_metrics(episodes)
    history.append({"step": step, "reward/mean": tools["pass_rate"], **tools})
    print(
        f"step {step}: reward {tools['pass_rate']:.2f}, tool calls {tools['tool_call_rate']:.2f}, "
        f"correct calls {tools['tool_use_rate']:.2f}, turns "
        f"{np.mean([e.turns for e in episodes]):.1f}, loss {float(metrics['loss']):+.4f}"
    )

# %%
fig = curves_figure(
    {"calculator, GRPO": history}, keys=("reward/mean", "tool_call_rate", "tool_use_rate")
)
fig
