"""The continuous-batching engine on cache views against the whole cache, long completions.

``InferenceEngine`` decodes each chunk on the shortest cache prefix that holds its
rows' next writes (``cache_views=True``, the default; the views are ``engine_views``'s
eighths of the cache). Rows refill at different times, so the view
follows the longest row; early in a long completion attention still reads far fewer
slots than the whole cache. Both engines run the same requests in the same run, after a
warm-up that compiles every program (the timed passes assert that nothing compiles),
and must give the same tokens.

Workload: ``--requests`` prompts of 8-48 tokens (a 64-token prompt width), budgets drawn
uniformly from ``[--new-tokens / 8, --new-tokens]`` (the random model never stops early),
through an engine of ``--slots`` rows decoding chunks of ``--chunk-steps`` steps.
The ratio is of tokens/s, best of ``--repeats``.

Usage::

    python benchmarks/engine_views.py --quick   # small model, 512 new tokens; < 60 s
    python benchmarks/engine_views.py           # larger model, 1024 new tokens

The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from decode import FULL, QUICK, random_model  # noqa: E402

from rlaxkit.inference import InferenceEngine, SamplingConfig  # noqa: E402
from rlaxkit.inference.engine import engine_views  # noqa: E402
from rlaxkit.util.jaxutil import count_compilations  # noqa: E402

PROMPT_TOKENS = (8, 48)  # prompt lengths drawn uniformly in this range
PROMPT_WIDTH = 64  # the engine's prompt width for them


def run(model, requests, config, slots, chunk_steps, views):
    """Every request through one engine; ``(completions, views each chunk ran on)``."""
    engine = InferenceEngine(
        model,
        config,
        num_slots=slots,
        max_prompt_len=PROMPT_WIDTH,
        chunk_steps=chunk_steps,
        cache_views=views,
    )
    chunks, completions = [], []
    for prompt, key, budget in requests:
        engine.submit(prompt, key, max_new_tokens=budget)
    while not engine.idle:
        if engine.launch():
            chunks.append(engine._view())  # what ``launch`` ran on (nothing changed since)
        completions.extend(engine.finish())
    return sorted(completions, key=lambda c: c.request_id), chunks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, < 60 s")
    parser.add_argument("--smoke", action="store_true", help="a few short requests (tests)")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--chunk-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    setting = QUICK if args.quick or args.smoke else FULL
    new_tokens = args.new_tokens or (128 if args.smoke else 512 if args.quick else 1024)
    count = args.requests or (6 if args.smoke else 48 if args.quick else 32)
    repeats = 1 if args.smoke else args.repeats
    rng = np.random.RandomState(args.seed)
    model = random_model(setting.model, args.seed)
    config = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens)
    requests = [
        (
            rng.randint(0, setting.model.vocab_size, rng.randint(*PROMPT_TOKENS)).tolist(),
            jax.random.key(int(rng.randint(0, 2**31 - 1))),
            int(rng.randint(max(1, new_tokens // 8), new_tokens + 1)),
        )
        for _ in range(count)
    ]
    slots = PROMPT_WIDTH + new_tokens
    print(f"devices: {jax.devices()}  model: {setting.model}")
    print(
        f"{count} requests, budgets {min(r[2] for r in requests)}-{new_tokens} tokens, "
        f"{args.slots} rows, cache {slots} slots, views {engine_views(PROMPT_WIDTH, slots)}"
    )
    report: dict[str, object] = {"quick": args.quick, "smoke": args.smoke, "cache_slots": slots}
    results, tokens_of = {}, {}
    for views in (True, False):
        run(model, requests, config, args.slots, args.chunk_steps, views)  # warm-up
    best = {True: float("inf"), False: float("inf")}
    for _ in range(repeats):  # alternating, so drift hits both alike
        for views in (True, False):
            with count_compilations() as compiles:
                start = time.perf_counter()
                done, chunks = run(model, requests, config, args.slots, args.chunk_steps, views)
                seconds = time.perf_counter() - start
            if compiles.count:
                raise RuntimeError(f"a timed run compiled {compiles.count} programs")
            best[views] = min(best[views], seconds)
            print(f"  {'views' if views else 'whole cache'}: {seconds:.2f} s", flush=True)
            results[views] = chunks
            tokens_of[views] = [c.tokens.tolist() for c in done]
            assert sum(c.num_tokens for c in done) == sum(r[2] for r in requests)
        if tokens_of[True] != tokens_of[False]:
            raise AssertionError("the engine on views sampled other tokens than on the cache")
    tokens = sum(r[2] for r in requests)
    shares = {int(v): results[True].count(v) for v in sorted(set(results[True]))}
    for views in (True, False):
        name = "views" if views else "whole cache"
        print(f"{name:<12} {tokens:>7} tokens {best[views]:>7.3f} s {tokens / best[views]:>9.0f}/s")
        report[f"{'views' if views else 'whole'}_tokens_per_s"] = tokens / best[views]
    report["chunks_by_view"] = shares
    report["same_chunks"] = len(results[True]) == len(results[False])
    report["engine_views_speedup"] = best[False] / best[True]
    print(f"chunks by view: {shares}; speedup {report['engine_views_speedup']:.2f}x")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
