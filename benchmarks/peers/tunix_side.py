"""The peer's half of ``run.py``: google-tunix 0.1.7 on the shapes of ``workloads.py``.

Run only by the python of the peer's own virtualenv (``run.py`` makes it); rlaxkit is not
installed there. Each invocation does one piece of work and prints one JSON object as
its last line:

* ``--work step --setting small|large``: a ``GRPOLearner`` (``rollout_engine='vanilla'``,
  ``beta=0``, one iteration per batch, AdamW) over ``2 + steps`` batches; step times
  are the intervals between the learner's requests for its next batch, the last one
  closed by ``train`` returning; the first two steps (compiles) are left out.
* ``--work first_step --setting small|large``: one batch in this fresh process, timed
  from the model existing to ``train`` returning (cluster, learner, compile, run).
* ``--work decode --setting small|large``: the vanilla ``Sampler`` with
  ``return_logprobs=True``, temperature 1 (``top_p=1``: plain sampling), no stop
  token; a warm-up call, then ``repeats`` timed calls.

Usage (what ``run.py`` does)::

    $PEER_VENV/bin/python benchmarks/peers/tunix_side.py --work step --setting small
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import workloads  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.generate import sampler as sampler_lib  # noqa: E402
from tunix.models.qwen3 import model as qwen3_lib  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner as grpo_lib  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402


class IdTokenizer:
    """Text ``"17 4 9"`` is token ids 17, 4, 9: the peer's sampler works on strings."""

    def encode(self, text, **_: object) -> list[int]:
        return [int(word) for word in str(text).split()]

    def decode(self, ids, **_: object) -> str:
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self) -> int:
        return workloads.BOS_ID

    def eos_id(self) -> int:
        return workloads.EOS_ID

    def pad_id(self) -> int:
        return workloads.PAD_ID


def as_text(prompts: list[list[int]]) -> list[str]:
    """Prompts without their leading BOS, which the peer's sampler prepends itself."""
    return [IdTokenizer().decode(p[1:]) for p in prompts]


def build_model(shape: workloads.ModelShape, mesh, seed: int = 0):
    config = qwen3_lib.ModelConfig(
        num_layers=shape.layers,
        vocab_size=shape.vocab,
        embed_dim=shape.hidden,
        hidden_dim=shape.mlp,
        num_heads=shape.heads,
        head_dim=shape.head_dim,
        num_kv_heads=shape.kv_heads,
        rope_theta=int(workloads.ROPE_THETA),
        norm_eps=workloads.RMS_NORM_EPS,
        use_tied_embedding=True,
    )
    with jax.set_mesh(mesh):
        model = qwen3_lib.Qwen3(config, rngs=nnx.Rngs(seed))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if params != shape.num_params():
        raise RuntimeError(f"peer model has {params} parameters, expected {shape.num_params()}")
    return model, params


def reward_fn(prompts, completions, **_: object) -> list[float]:
    return [workloads.reward(IdTokenizer().encode(text)) for text in completions]


class TimedBatches:
    """The learner's dataset: ``count`` batches, recording when each is requested."""

    def __init__(self, work: workloads.GRPOWork, count: int, seed: int):
        shape = (work.prompt_tokens, work.model.vocab)
        self.batches = [  # arrays: the learner repeats each leaf num_generations times
            {"prompts": np.array(as_text(workloads.prompt_ids(work.prompts, *shape, seed + i)))}
            for i in range(count)
        ]
        self.requested: list[float] = []

    def __iter__(self):
        for batch in self.batches:
            self.requested.append(time.perf_counter())
            yield batch


def make_learner(work: workloads.GRPOWork, model, mesh, max_steps: int):
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=work.new_tokens,
        max_prompt_length=work.prompt_tokens,
        kv_cache_size=work.prompt_tokens + work.new_tokens,
        temperature=1.0,
        top_p=1.0,
        eos_tokens=[workloads.EOS_ID],
    )
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={
            rl_cluster_lib.Role.ACTOR: mesh,
            rl_cluster_lib.Role.REFERENCE: mesh,
            rl_cluster_lib.Role.ROLLOUT: mesh,
        },
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.adamw(workloads.LEARNING_RATE),
            eval_every_n_steps=10**6,
            max_steps=max_steps,
        ),
        rollout_config=rollout,
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=model, tokenizer=IdTokenizer(), cluster_config=cluster_config
    )
    config = grpo_lib.GRPOConfig(num_generations=work.samples, num_iterations=1, beta=0.0)
    return grpo_lib.GRPOLearner(rl_cluster=cluster, algo_config=config, reward_fns=reward_fn)


def run_steps(work: workloads.GRPOWork, steps: int, mesh) -> dict[str, object]:
    model, params = build_model(work.model, mesh)
    batches = TimedBatches(work, 2 + steps, seed=0)
    learner = make_learner(work, model, mesh, max_steps=2 + steps)
    learner.train(batches)
    end = time.perf_counter()
    marks = [*batches.requested, end]
    times = np.diff(marks)[2:]
    if len(times) != steps:
        raise RuntimeError(f"expected {steps} timed steps, got {len(times)}")
    return {"params": params, "step_s": times.tolist(), "flops": work.flops()}


def run_first_step(work: workloads.GRPOWork, mesh) -> dict[str, object]:
    jax.config.update("jax_enable_compilation_cache", False)
    model, params = build_model(work.model, mesh)
    start = time.perf_counter()
    learner = make_learner(work, model, mesh, max_steps=1)
    learner.train(TimedBatches(work, 1, seed=0))
    return {"params": params, "first_step_s": time.perf_counter() - start}


def run_decode(work: workloads.DecodeWork, repeats: int, mesh) -> dict[str, object]:
    model, params = build_model(work.model, mesh)
    cache = sampler_lib.CacheConfig(
        cache_size=work.prompt_tokens + work.new_tokens,
        num_layers=work.model.layers,
        num_kv_heads=work.model.kv_heads,
        head_dim=work.model.head_dim,
    )
    sampler = sampler_lib.Sampler(model, IdTokenizer(), cache)
    prompts = as_text(workloads.prompt_ids(work.batch, work.prompt_tokens, work.model.vocab, 0))

    def call(seed: int):
        out = sampler(
            input_strings=prompts,
            max_generation_steps=work.new_tokens,
            max_prompt_length=work.prompt_tokens,
            temperature=1.0,
            top_p=1.0,
            return_logprobs=True,
            eos_tokens=[-1],  # never sampled: every row runs to new_tokens
            seed=seed,
        )
        jax.block_until_ready(out.logprobs)
        return out

    out = call(0)  # compiles
    lengths = [len(t) for t in out.tokens]
    if lengths != [work.new_tokens] * work.batch:
        raise RuntimeError(f"peer rows generated {lengths} tokens, expected {work.new_tokens}")
    seconds = []
    for i in range(repeats):
        start = time.perf_counter()
        call(i + 1)
        seconds.append(time.perf_counter() - start)
    tokens = work.batch * work.new_tokens
    return {"params": params, "seconds": seconds, "tokens": tokens, "flops": work.flops()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", choices=("step", "first_step", "decode"), required=True)
    parser.add_argument("--setting", choices=("small", "large", "tiny"), required=True)
    parser.add_argument("--steps", type=int, default=5, help="timed GRPO steps")
    parser.add_argument("--repeats", type=int, default=5, help="timed decode calls")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(auto, auto))
    if args.work == "step":
        report = run_steps(workloads.grpo_work(args.setting), args.steps, mesh)
    elif args.work == "first_step":
        report = run_first_step(workloads.grpo_work(args.setting), mesh)
    else:
        report = run_decode(workloads.decode_work(args.setting), args.repeats, mesh)
    report.update(side="tunix", work=args.work, setting=args.setting)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
