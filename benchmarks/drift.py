"""Drift attribution in three settings, and what it costs per step.

Three runs of ``small_run_config`` (the tests' tiny run) with ``metrics.drift_every=1``,
each reporting the mean over its steps of ``drift/staleness`` and ``drift/mismatch``
(mean ``|log-ratio|`` and the k3 KL estimate, ``rlaxkit.observe.drift``):

- ``exact``: η = 0 and a float32 sampler: both ≈ 0 (staleness exactly 0);
- ``stale``: η = 4, 64 decode rows a worker (so the buffer runs ahead) and
  ``runtime.keep_versions=6``: staleness, and its mean ``|log-ratio|`` by lag;
- ``bfloat16_sampler``: η = 0, ``model.sampler_dtype=bfloat16`` against the float32
  trainer: mismatch and no staleness.

The cost is timed in the ``stale`` run, the dearest (a forward pass under each older
version over the rows it sampled; ``log π_θ`` comes from the train step's own forward):
``attribution_s`` is the median of ``drift/seconds`` and ``train_step_s`` the median of
the rest of the trainer's call (``time/train_s`` less the attribution), over the steps
after the first two (which compile). ``cost_fraction_every_1 = attribution_s /
train_step_s``; at ``drift_every=10`` a tenth of the steps pay it:
``cost_fraction_every_10 = cost_fraction_every_1 / 10``; the default is off
(``cost_fraction_default`` 0). ``cost_fraction_of_loop_step``
divides by the whole loop step instead (generation included).

Usage::

    python benchmarks/drift.py --quick     # 8 steps a setting (under a minute)
    python benchmarks/drift.py             # 30 steps a setting

The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlaxkit.config.run import MetricsConfig, small_run_config  # noqa: E402
from rlaxkit.runtime import Experiment  # noqa: E402

SETTINGS = {
    "exact": ("staleness.max_staleness=0",),
    "stale": (
        "staleness.max_staleness=4",
        "runtime.keep_versions=6",
        "runtime.slots_per_worker=64",
    ),
    "bfloat16_sampler": ("staleness.max_staleness=0", "model.sampler_dtype=bfloat16"),
}
COMMON = ("metrics.drift_every=1", "eval.num_problems=4", "eval.samples=1")


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    values = [m[key] for m in rows if key in m]
    return float(statistics.fmean(values)) if values else 0.0


def run_setting(overrides: tuple[str, ...], steps: int, cache: Path) -> dict[str, Any]:
    with Experiment(small_run_config(*COMMON, *overrides), cache_dir=cache) as exp:
        history = exp.run(steps)
    rows = [m for m in history if "drift/tokens" in m]
    out: dict[str, Any] = {"steps": len(history), "attributed_steps": len(rows)}
    for part in ("staleness", "mismatch"):
        for stat in ("abs_mean", "k3", "clipped_share"):
            out[f"{part}_{stat}"] = _mean(rows, f"drift/{part}/{stat}")
    lags = sorted({k for m in rows for k in m if k.startswith("drift/staleness/lag_")})
    out["staleness_by_lag"] = {k.rsplit("_", 1)[1]: _mean(rows, k) for k in lags}
    out["skipped_batches"] = history[-1].get("drift/skipped_batches", 0.0)
    out["staleness_mean_versions"] = _mean(history, "staleness/mean")
    timed = rows[2:] or rows
    attribution = [m["drift/seconds"] for m in timed]
    train = [m["time/train_s"] - m["drift/seconds"] for m in timed]
    loop = [m["time/train_s"] + m["time/generate_s"] - m["drift/seconds"] for m in timed]
    out["attribution_s"] = statistics.median(attribution)
    out["train_step_s"] = statistics.median(train)
    out["loop_step_s"] = statistics.median(loop)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 steps a setting")
    parser.add_argument("--steps", type=int, default=None, help="steps a setting")
    args = parser.parse_args(argv)
    steps = args.steps or (8 if args.quick else 30)
    start = time.perf_counter()
    report: dict[str, Any] = {"steps": steps}
    with tempfile.TemporaryDirectory() as cache:
        if not jax.config.jax_compilation_cache_dir:
            # Each setting builds a fresh Experiment: a persistent cache spares the
            # programs they share (the train step, evaluation) a second compile.
            jax.config.update("jax_compilation_cache_dir", str(Path(cache) / "jax"))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        for name, overrides in SETTINGS.items():
            report[name] = run_setting(overrides, steps, Path(cache))
            print(name, json.dumps(report[name]), flush=True)
    stale = report["stale"]
    every = MetricsConfig().drift_every
    fraction = stale["attribution_s"] / stale["train_step_s"]
    report["cost_fraction_every_1"] = fraction
    report["drift_every_default"] = every
    report["cost_fraction_default"] = fraction / every if every else 0.0  # off by default
    report["cost_fraction_every_10"] = fraction / 10
    report["cost_fraction_of_loop_step"] = stale["attribution_s"] / stale["loop_step_s"]
    report["wall_s"] = time.perf_counter() - start
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
