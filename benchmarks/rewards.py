"""Rewards scored per second, per task and execution mode.

Measures, in one run:

* arithmetic in-process (the fast path) and through the process pool, which shows why
  cheap pure rewards run inline: the pool's per-item round trip costs far more than the
  check itself;
* countdown in-process;
* code through the pool (each test case is a sandboxed child interpreter), once with the
  sandbox's limits only and once in namespaces (``rlaxkit.tasks.sandbox``), on the same
  batch in the same run, so their ratio is the cost of the isolation per program;
* math through the pool (math-verify / sympy), in the full run only.

Pool start-up is timed separately and excluded from the rates. The last line printed is
a JSON object with ``arithmetic_per_s`` (in-process), ``arithmetic_pool_per_s``,
``countdown_per_s``, ``code_per_s`` (the isolation a run gets here, ``isolation_mode()``),
``code_limits_only_per_s``, ``code_namespaces_per_s`` and their ratio
``code_namespaces_vs_limits_only`` (the last two only where namespaces are allowed) and,
without ``--quick``, ``math_per_s``.

Usage::

    python benchmarks/rewards.py --quick   # < 60 s on 2 cores
    python benchmarks/rewards.py --workers 8
"""

from __future__ import annotations

import argparse
import json
import os
import time

from rlaxkit.tasks import RewardRunner, RewardRunnerConfig, SandboxLimits, make_task
from rlaxkit.tasks.sandbox import isolation_mode


def rate(runner: RewardRunner, problems, completions, repeats: int) -> float:
    """Items scored per second over ``repeats`` passes of the batch (best pass)."""
    best_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        results = runner.score(problems, completions)
        best_s = min(best_s, time.perf_counter() - start)
    assert len(results) == len(problems)
    return len(problems) / best_s


# A wrong completion per task that goes through the whole check (parsed, then judged).
WRONG = {
    "arithmetic": "-1",
    "countdown": "1 + 1",
    "code": "```python\nprint(0)\n```",
    "math": "\\boxed{-1}",
}


def batch(task, num_problems: int, split: str = "train"):
    """Problems and a mix of right and wrong completions (half each)."""
    problems = task.problems(split, num_problems)
    wrong = WRONG[task.name]
    completions = [task.demonstration(p) if i % 2 == 0 else wrong for i, p in enumerate(problems)]
    return problems, completions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small batches (< 60 s on 2 cores)")
    parser.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 8))
    args = parser.parse_args()
    quick = args.quick
    out: dict[str, float] = {}

    arithmetic = make_task("arithmetic", max_digits=3)
    problems, completions = batch(arithmetic, 2000 if quick else 20000)
    with RewardRunner.for_task(arithmetic, "inline") as runner:
        out["arithmetic_per_s"] = rate(runner, problems, completions, repeats=3)
    print(f"arithmetic inline : {out['arithmetic_per_s']:>12,.0f} rewards/s")

    pool_config = RewardRunnerConfig(mode="pool", num_workers=args.workers)
    pool_problems, pool_completions = problems[:400], completions[:400]
    with RewardRunner.for_task(arithmetic, pool_config) as runner:
        start = time.perf_counter()
        runner.start()
        out["pool_startup_s"] = time.perf_counter() - start
        out["arithmetic_pool_per_s"] = rate(runner, pool_problems, pool_completions, repeats=2)
    print(f"arithmetic pool   : {out['arithmetic_pool_per_s']:>12,.0f} rewards/s")
    print(f"pool start-up     : {out['pool_startup_s']:>12.2f} s ({args.workers} workers)")
    speedup = out["arithmetic_per_s"] / out["arithmetic_pool_per_s"]
    print(f"inline / pool     : {speedup:>12,.0f}x for arithmetic")

    countdown = make_task("countdown")
    problems, completions = batch(countdown, 1000 if quick else 10000)
    with RewardRunner.for_task(countdown) as runner:
        out["countdown_per_s"] = rate(runner, problems, completions, repeats=3)
    print(f"countdown inline  : {out['countdown_per_s']:>12,.0f} rewards/s")

    mode = isolation_mode()
    isolations = ["limits-only", "namespaces"] if mode == "namespaces" else ["limits-only"]
    problems, completions = batch(make_task("code"), 60 if quick else 200)
    for isolation in isolations:
        code = make_task("code", limits=SandboxLimits(isolation=isolation))
        with RewardRunner.for_task(code, pool_config) as runner:
            runner.start()
            key = f"code_{isolation.replace('-', '_')}_per_s"
            out[key] = rate(runner, problems, completions, repeats=1)
        print(f"code pool         : {out[key]:>12,.1f} rewards/s ({isolation}, 3 tests each)")
    out["code_per_s"] = out[f"code_{mode.replace('-', '_')}_per_s"]
    if mode == "namespaces":
        ratio = out["code_namespaces_per_s"] / out["code_limits_only_per_s"]
        out["code_namespaces_vs_limits_only"] = ratio
        print(f"namespaces / limits-only: {ratio:.2f} (code rewards per second)")
    else:
        print("code pool         : namespaces refused here, limits only")

    if not quick:
        math_task = make_task("math")
        problems, completions = batch(math_task, 400)
        with RewardRunner.for_task(math_task, pool_config) as runner:
            runner.start()
            out["math_per_s"] = rate(runner, problems, completions, repeats=1)
        print(f"math pool         : {out['math_per_s']:>12,.1f} rewards/s")

    out["workers"] = args.workers
    print(json.dumps({k: round(v, 3) for k, v in out.items()}))


if __name__ == "__main__":
    main()
