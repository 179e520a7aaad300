"""One full synchronous GRPO iteration, end to end, on two small Qwen3-shaped models.

An iteration is what a synchronous (η = 0) GRPO trainer does per step:

1. **generate**: ``P`` arithmetic prompts, ``G`` samples each, ``N`` new tokens at
   temperature 1 with the jitted KV-cache sampler (``rlaxkit.inference.generate``: one
   prefill, then every decode step inside one ``lax.while_loop``); the end-of-text token
   stops a row (a random model rarely samples it, so rows run to ``N`` tokens);
2. **score**: decode every completion with the character tokenizer and score it with the
   arithmetic task's verifiable reward;
3. **recompute log-probs and update**: collate the ``P·G`` samples into one
   ``TrainBatch`` (length fixed at ``max prompt + N`` rounded up to a multiple of 8, so
   every step reuses one program) and run the jitted train step: GRPO advantages
   (group-normalised), the PPO-clip objective centred on the log-probs recomputed under
   the current weights (``proximal='recompute'``; with one update per step they come
   from the update's own forward pass), no KL term (``kl_coef = 0``: no reference
   model), AdamW.

Settings (both Qwen3-shaped like google-tunix's ``Qwen3``: 4 layers, 4 query / 2
key-value heads of width ``hidden / 4``, SwiGLU width ``4 x hidden``, tied embeddings,
RoPE base 10 000): ``small`` hidden 128, vocabulary 512, 4 prompts x 4 samples, 16 new
tokens; ``large`` hidden 256, vocabulary 2048, 8 prompts x 4 samples, 32 new tokens.
``benchmarks/peers/run.py`` runs the peer on the same shapes, side by side.

``first_step_s`` is the wall time of the first small iteration in a fresh process with
JAX's persistent compilation cache turned off: tracing and compiling every program
(sampler and train step) plus running it. The loop knows its one batch shape up front,
so the train step and the sampler's programs (``rlaxkit.inference.compile_generate``)
compile side by side on background threads from the start of the first step
(``--serial-compile``: each program compiles at its first call instead). The train
step and the sampler compile in two tiers (``make_train_step(..., tiered=True)``,
``generate(..., tiered=True)``, see ``rlaxkit.util.jaxutil.TieredJit``): the first step runs
executables compiled quickly (LLVM at -O0, XLA's loop emitters), and the optimised ones
compile after it (``hold_background_compiles``), during the second step, for every
later step. ``untiered_first_step_s`` is the same first step in a fresh
subprocess with one optimised compile (``--untiered``), measured in the same run.
Building the model and the optimizer state (``setup_s``) is reported separately. Step
times are the median of the timed iterations that follow a warm-up; each asserts that
it compiled nothing.

Peer figures are quoted from an earlier run, **not measured here**: google-tunix 0.1.7
about 0.11 s (small) and 0.85 s (large) per step after a 5-9 s first-step compile; TRL
1.16 about 0.15-0.22 s and 0.78 s. ``benchmarks/peers/run.py`` measures tunix in the
same run instead.

Usage::

    python benchmarks/grpo_step.py --quick   # < 60 s on 2 cores
    python benchmarks/grpo_step.py           # more timed iterations

The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rlaxkit.algorithms import algorithm  # noqa: E402
from rlaxkit.data.batch import BucketSpec, Sample, TrainBatch, collate  # noqa: E402
from rlaxkit.inference import SamplingConfig, compile_generate, generate  # noqa: E402
from rlaxkit.inference.config import MIN_LENGTH_BUCKET  # noqa: E402
from rlaxkit.models import CharTokenizer, ModelConfig, Transformer  # noqa: E402
from rlaxkit.tasks.arithmetic import ArithmeticConfig, ArithmeticTask  # noqa: E402
from rlaxkit.trainer.config import OptimizerConfig, TrainConfig  # noqa: E402
from rlaxkit.trainer.state import create_train_state  # noqa: E402
from rlaxkit.trainer.step import make_train_step  # noqa: E402
from rlaxkit.util.jaxutil import (  # noqa: E402
    count_compilations,
    hold_background_compiles,
    host_arrays,
)

# Quoted from the issue tracker (seconds per step on a 2-core CPU machine); not measured.
PEER_STEP_S = {
    "tunix_0.1.7": {"small": 0.11, "large": 0.85},
    "trl_1.16": {"small": 0.15, "large": 0.78},  # small: 0.15-0.22, the faster end
}
TARGET_STEP_S = {"small": 0.055, "large": 0.39}  # half the faster peer
TARGET_FIRST_STEP_S = 5.0


@dataclass(frozen=True)
class Setting:
    """One benchmarked GRPO configuration."""

    name: str
    model: ModelConfig
    prompts: int
    samples: int
    new_tokens: int


def qwen3(hidden: int, vocab: int, layers: int = 4, mlp: int | None = None) -> ModelConfig:
    """The peer's Qwen3 shape: 4 heads of ``hidden / 4``, 2 key-value heads, SwiGLU
    ``4 x hidden`` (the peer's ``hidden_dim = 4 x embed_dim``), tied embeddings."""
    return ModelConfig(
        family="qwen3",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden if mlp is None else mlp,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=10_000.0,
        tie_word_embeddings=True,
    )


SMALL = Setting(name="small", model=qwen3(128, 512), prompts=4, samples=4, new_tokens=16)
LARGE = Setting(name="large", model=qwen3(256, 2048), prompts=8, samples=4, new_tokens=32)
# Tests only: one tiny shape for both, so the second compiles nothing.
SMOKE = (
    Setting(name="small", model=qwen3(32, 64, 1, 64), prompts=2, samples=2, new_tokens=4),
    Setting(name="large", model=qwen3(32, 64, 1, 64), prompts=2, samples=2, new_tokens=4),
)


Score = Callable[[int, list[int]], float]  # (prompt index, completion tokens) -> reward


class GRPOLoop:
    """Synchronous GRPO: ``step(i)`` is one full iteration on prompts ``i * P ...``.

    ``score(k, tokens)`` rewards a completion of prompt ``k`` (its stop token removed);
    ``arithmetic_loop`` builds the arithmetic task's loop. ``model`` (default: a fresh
    one seeded with ``seed``) is the initial policy. ``min_prompt_width`` is
    ``generate``'s: a loop whose prompts all have one length passes that length.
    """

    def __init__(
        self,
        setting: Setting,
        prompts: Sequence[Sequence[int]],
        score: Score,
        *,
        pad_id: int,
        eos_id: int,
        seed: int = 0,
        tiered: bool = True,
        model: Transformer | None = None,
        min_prompt_width: int = MIN_LENGTH_BUCKET,
    ):
        self.setting = setting
        self.min_prompt_width = min_prompt_width
        self.score = score
        self.pad_id = pad_id
        if model is None:
            model = Transformer(setting.model, rngs=nnx.Rngs(seed))
        self.graphdef, params = nnx.split(model)
        self.prompts = [list(p) for p in prompts]
        width = max(len(p) for p in self.prompts) + setting.new_tokens
        self.bucket = BucketSpec(lengths=(-(-width // 8) * 8,))
        self.sampling = SamplingConfig(
            temperature=1.0,
            max_new_tokens=setting.new_tokens,
            n=setting.samples,
            stop_tokens=(eos_id,),
        )
        self.train_config = TrainConfig(
            algorithm=algorithm("grpo", loss={"kl_coef": 0.0, "proximal": "recompute"}),
            optimizer=OptimizerConfig(learning_rate=1e-4),
            # Nothing here reads it (the loop publishes no weights, so calls no
            # ``check_finite``), and the peer's GRPO step computes no update norm.
            update_norm=False,
        )
        self.state = create_train_state(self.train_config, params, seed=seed)
        self.tiered = tiered
        self.train_step = make_train_step(self.train_config, self.graphdef, tiered=tiered)
        self._compiling: threading.Thread | None = None
        self._sampler_threads: list[threading.Thread] = []
        self._sampler_started: threading.Event | None = None
        self._stepped = False

    def batch_shape(self) -> TrainBatch:
        """The one ``TrainBatch`` shape every step collates to (abstract arrays)."""
        rows = BucketSpec().batch_size_for(self.setting.prompts * self.setting.samples)
        shape = (rows, self.bucket.lengths[0])
        spec = jax.ShapeDtypeStruct
        return TrainBatch(
            tokens=spec(shape, jnp.int32),
            attention_mask=spec(shape, jnp.bool_),
            loss_mask=spec(shape, jnp.float32),
            behaviour_logprobs=spec(shape, jnp.float32),
            versions=spec(shape, jnp.int32),
            rewards=spec(shape[:1], jnp.float32),
            group_ids=spec(shape[:1], jnp.int32),
            sequence_mask=spec(shape[:1], jnp.bool_),
        )

    def start_compiling(self) -> None:
        """Compiles the train step and the sampler's programs on background threads: the
        shapes are known before any batch exists, and XLA compiles without holding the
        GIL, so the programs compile side by side.

        The train step traces and lowers first, and the sampler's programs start tracing
        once it is lowered, as it starts compiling: tracing holds the GIL, so programs
        traced side by side all start compiling late, and the train step's compile is
        the longest. A large first step took 3.09-3.22 s this way against 3.34-3.50 s
        with all three traced at once (docs/performance.md, "The first step's order")."""
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.state)
        batch = self.batch_shape()
        longest = max(len(p) for p in self.prompts)
        started = self._sampler_started = threading.Event()

        def compile_step() -> None:  # the calls find the executables
            try:
                lowered = self.train_step.lower(state, batch)
            except Exception:  # raised again when the step's call traces it
                lowered = None
            try:
                self._sampler_threads = compile_generate(
                    (self.graphdef, self.state.params),
                    self.sampling,
                    self.setting.prompts,
                    longest,
                    tiered=self.tiered,
                    min_prompt_width=self.min_prompt_width,
                )
            finally:
                started.set()
            if lowered is not None:
                lowered.compile()

        self._compiling = threading.Thread(target=compile_step, name="compile-train-step")
        self._compiling.start()

    def step(self, i: int) -> dict[str, float]:
        """Iteration ``i`` (its own prompts and seed); returns phase timings and metrics.

        The loop's first step holds the optimised compiles of the tiered programs back
        (``hold_background_compiles``): they compile during the second step."""
        if self._stepped:
            return self._step(i)
        self._stepped = True
        with hold_background_compiles():
            return self._step(i)

    def _step(self, i: int) -> dict[str, float]:
        s, t0 = self.setting, time.perf_counter()
        index = [(i * s.prompts + k) % len(self.prompts) for k in range(s.prompts)]
        prompts = [self.prompts[k] for k in index]
        version = int(self.state.step)
        # The sampler's programs, compiled ahead: waiting for them here costs nothing (the
        # call needs them), where calling while they still trace traces them again.
        if self._sampler_started is not None:
            self._sampler_started.wait()
            self._sampler_started = None
        for thread in self._sampler_threads:
            thread.join()
        self._sampler_threads = []
        result = generate(
            (self.graphdef, self.state.params),
            prompts,
            self.sampling,
            i,
            version=version,
            tiered=self.tiered,
            min_prompt_width=self.min_prompt_width,
        )
        t1 = time.perf_counter()
        samples = []
        for a, k in enumerate(index):
            for j in range(s.samples):
                done = result.completion(a, j)
                text_tokens = done.tokens[:-1] if done.finish_reason == "stop" else done.tokens
                reward = self.score(k, text_tokens)
                samples.append(
                    Sample(
                        prompt_tokens=prompts[a],
                        completion_tokens=done.tokens,
                        behaviour_logprobs=done.logprobs,
                        versions=done.versions,
                        reward=reward,
                        group_id=a,
                    )
                )
        batch = collate(samples, bucket=self.bucket, pad_token_id=self.pad_id)
        t2 = time.perf_counter()
        if self._compiling is not None:
            self._compiling.join()
            self._compiling = None
        self.state, metrics = self.train_step(self.state, batch)
        metrics = host_arrays(metrics)
        t3 = time.perf_counter()
        return {
            "step_s": t3 - t0,
            "generate_s": t1 - t0,
            "score_collate_s": t2 - t1,
            "train_s": t3 - t2,
            "tokens": float(result.lengths.sum()),
            "reward_mean": float(metrics["reward_mean"]),
            "ratio_mean": float(metrics["ratio_mean"]),
        }


def arithmetic_loop(setting: Setting, seed: int = 0, tiered: bool = True) -> GRPOLoop:
    """``GRPOLoop`` on the arithmetic task, prompts and completions in characters."""
    task = ArithmeticTask(ArithmeticConfig(seed=seed))
    tokenizer = CharTokenizer(task.alphabet())
    if tokenizer.vocab_size > setting.model.vocab_size:
        raise ValueError("the model's vocabulary must cover the character tokenizer")
    problems = task.problems("train", 64 * setting.prompts)
    prompts = [tokenizer.encode(task.format_prompt(p)) for p in problems]

    def score(k: int, tokens: list[int]) -> float:
        return task.score(problems[k], tokenizer.decode(tokens)).score

    return GRPOLoop(
        setting,
        prompts,
        score,
        pad_id=tokenizer.pad_id,
        eos_id=tokenizer.eos_id,
        seed=seed,
        tiered=tiered,
    )


def timed_steps(loop: GRPOLoop, first: int, count: int) -> list[dict[str, float]]:
    """``count`` iterations, none of which may compile."""
    out = []
    for i in range(first, first + count):
        with count_compilations() as compiles:
            out.append(loop.step(i))
        if compiles.count:
            raise RuntimeError(f"{loop.setting.name} step {i} compiled {compiles.count} programs")
    return out


def first_step_only(args: argparse.Namespace) -> int:
    """The small setting's first step alone, in this (fresh) process; prints JSON."""
    jax.config.update("jax_enable_compilation_cache", False)
    loop = arithmetic_loop(SMALL, args.seed, tiered=not args.untiered)
    start = time.perf_counter()
    if not args.serial_compile:
        loop.start_compiling()
    loop.step(0)
    print(json.dumps({"first_step_s": time.perf_counter() - start}))
    return 0


def untiered_first_step(args: argparse.Namespace) -> float:
    """``first_step_s`` of a fresh process whose train step compiles once, optimised."""
    command = [sys.executable, __file__, "--first-step-only", "--untiered"]
    command += ["--seed", str(args.seed)]
    if args.serial_compile:
        command.append("--serial-compile")
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["first_step_s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed steps, < 60 s")
    parser.add_argument("--smoke", action="store_true", help="tiny models (tests only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serial-compile", action="store_true", help="no background compilation")
    parser.add_argument("--untiered", action="store_true", help="one optimised train-step compile")
    parser.add_argument(
        "--first-step-only", action="store_true", help="the small first step only (JSON)"
    )
    args = parser.parse_args(argv)
    if args.first_step_only:
        return first_step_only(args)
    load_before = os.getloadavg()[0]  # the machine may be shared: say how busy it was
    if not args.smoke:  # a cold start: the first step traces and compiles everything
        jax.config.update("jax_enable_compilation_cache", False)
    settings = SMOKE if args.smoke else (SMALL, LARGE)
    repeats = (2, 2) if args.smoke else (10, 5) if args.quick else (40, 15)
    print(f"devices: {jax.devices()}")
    report: dict[str, object] = {
        "quick": args.quick,
        "smoke": args.smoke,
        "background_compile": not args.serial_compile,
        "tiered_compile": not args.untiered,
    }
    for setting, count in zip(settings, repeats, strict=True):
        start = time.perf_counter()
        loop = arithmetic_loop(setting, args.seed, tiered=not args.untiered)
        setup_s = time.perf_counter() - start  # model and optimizer initialisation
        start = time.perf_counter()
        if not args.serial_compile:
            loop.start_compiling()
        first = loop.step(0)
        first_s = time.perf_counter() - start  # trace + compile + run
        loop.step(1)  # warm-up
        steps = timed_steps(loop, 2, count)
        median = {k: float(np.median([s[k] for s in steps])) for k in steps[0]}
        name = setting.name
        print(
            f"\n{name}: {setting.model.num_params() / 1e6:.2f}M params, "
            f"{setting.prompts} prompts x {setting.samples} samples, "
            f"{setting.new_tokens} new tokens"
        )
        print(
            f"  setup (model + optimizer init) {setup_s:.2f} s; first step (trace + "
            f"compile + run) {first_s:.2f} s: generate {first['generate_s']:.2f} s, "
            f"train {first['train_s']:.2f} s (waits for its background compile)"
        )
        print(
            f"  median of {count} steps: {median['step_s']:.4f} s = generate "
            f"{median['generate_s']:.4f} + score/collate {median['score_collate_s']:.4f} + "
            f"train {median['train_s']:.4f}  (min {min(s['step_s'] for s in steps):.4f} s)"
        )
        report[f"{name}_step_s"] = median["step_s"]
        report[f"{name}_step_min_s"] = min(s["step_s"] for s in steps)
        for phase in ("generate_s", "score_collate_s", "train_s"):
            report[f"{name}_{phase}"] = median[phase]
        report[f"{name}_first_step_s"] = first_s
        report[f"{name}_setup_s"] = setup_s
        report[f"{name}_ratio_mean"] = median["ratio_mean"]
        report[f"{name}_target_s"] = TARGET_STEP_S[name]
        for peer, figures in PEER_STEP_S.items():
            ratio = figures[name] / median["step_s"]
            report[f"{name}_speedup_vs_{peer}_quoted"] = ratio
            print(
                f"  vs {peer} (quoted, not measured here: {figures[name]} s): {ratio:.2f}x faster"
            )
    report["first_step_s"] = report["small_first_step_s"]
    if not args.smoke and not args.untiered:
        report["untiered_first_step_s"] = untiered_first_step(args)
        print(
            f"\nsmall first step with one optimised compile (fresh process): "
            f"{report['untiered_first_step_s']:.2f} s"
        )
    report["peer_step_s_quoted"] = PEER_STEP_S
    print(
        f"\nsmall {report['small_step_s']:.4f} s (target <= {TARGET_STEP_S['small']}), "
        f"large {report['large_step_s']:.4f} s (target <= {TARGET_STEP_S['large']}), "
        f"first step {report['first_step_s']:.2f} s (target < {TARGET_FIRST_STEP_S})"
    )
    report["load_average_1m"] = [load_before, os.getloadavg()[0]]
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
