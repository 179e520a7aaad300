"""rlaxkit against google-tunix 0.1.7 on identical work, measured side by side in one run.

The work (``workloads.py``): one synchronous GRPO iteration on a small and a large
Qwen3-shaped model, the first such iteration in a fresh process, and KV-cache decoding
at batch 16 x 16 and 64 x 128 new tokens. Each side runs in its own process, one after
the other, never concurrently: the peer in its own virtualenv (``tunix_side.py``),
rlaxkit in this interpreter's (``rlaxkit_side.py``). Rounds alternate which side goes
first, and each figure is the median over every round, so load from other processes
on a shared machine falls on both sides alike. Both sides report their model's
parameter count; the run stops if they differ.

Each ratio is ``peer time / rlaxkit time`` (above 1: rlaxkit is faster). Each side's
model FLOP/s (``workloads.py``'s formulas, the same for both) is given as a fraction
of this machine's float32 matmul peak, measured in the same run. So is each job's
matmul floor (``floor.py``: the model's matmuls alone, at the job's shapes, in jitted
programs): each side's time against it, and ``peer time / floor``, the largest ratio
an implementation doing the same matmuls through XLA:CPU could reach on this machine.

The peer's virtualenv is made once (``pip install google-tunix==0.1.7``, about 1.6 GB,
several minutes) at ``--peer-venv``, else ``$RLAXKIT_PEER_VENV``, else
``~/.cache/rlaxkit/peers/tunix-0.1.7``. Not part of ``make test``.

Usage::

    .venv/bin/python benchmarks/peers/run.py --quick   # <= 6 min once the venv exists
    .venv/bin/python benchmarks/peers/run.py           # more rounds

The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEER_PACKAGE = "google-tunix==0.1.7"
DEFAULT_PEER_VENV = Path.home() / ".cache" / "rlaxkit" / "peers" / "tunix-0.1.7"
SIDES = ("tunix", "rlaxkit")
# (work, setting): what each round runs on both sides.
JOBS = (
    ("step", "small"),
    ("step", "large"),
    ("first_step", "small"),
    ("first_step", "large"),
    ("decode", "small"),
    ("decode", "large"),
)
GOAL_RATIO = 2.0
GOAL_FIRST_STEP_S = 3.0


def peer_venv_path(flag: str | None) -> Path:
    return Path(flag or os.environ.get("RLAXKIT_PEER_VENV") or DEFAULT_PEER_VENV)


def ensure_peer_venv(venv: Path) -> Path:
    """The peer venv's python, making the venv and installing the peer if needed."""
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import tunix"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"making the peer's virtualenv at {venv} ({PEER_PACKAGE}, ~1.6 GB) ...", flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", PEER_PACKAGE], check=True)
    subprocess.run(check, check=True)
    return python


def run_side(python: str, script: str, args: Sequence[str]) -> dict:
    """Runs one driver in a fresh process; its last stdout line is JSON."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    command = [python, str(HERE / script), *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def job_args(work: str, setting: str, steps: int, repeats: int) -> list[str]:
    return ["--work", work, "--setting", setting, "--steps", str(steps), "--repeats", str(repeats)]


def summarise(
    results: dict[tuple[str, str, str], list[dict]],
    peak_flops: float,
    floors: dict[str, float] | None = None,
) -> dict:
    """Medians, ratios and fractions of peak and of the matmul floor from every round's
    results.

    ``results[(side, work, setting)]`` lists the JSON objects of that job's runs;
    ``floors["step_large"]`` is that job's matmul floor in seconds.
    """
    report: dict[str, object] = {"peak_flops": peak_flops}
    sides = sorted({side for side, _, _ in results})
    for (side, work, setting), runs in sorted(results.items()):
        report[f"{side}_{work}_{setting}_params"] = runs[0]["params"]
        if "host_memory_kept" in runs[0]:  # rlaxkit's side: every run kept its buffers?
            kept = all(run["host_memory_kept"] for run in runs)
            report[f"{side}_host_memory_kept"] = (
                report.get(f"{side}_host_memory_kept", True) and kept
            )
        if work == "step":
            seconds = statistics.median(s for run in runs for s in run["step_s"])
            report[f"{side}_step_{setting}_s"] = seconds
            report[f"{side}_step_{setting}_peak_fraction"] = runs[0]["flops"] / seconds / peak_flops
            for phase in ("generate_s", "train_s"):  # rlaxkit's driver times its phases
                if phase in runs[0]:
                    values = [s for run in runs for s in run[phase]]
                    report[f"{side}_step_{setting}_{phase}"] = statistics.median(values)
        elif work == "first_step":
            report[f"{side}_first_step_{setting}_s"] = statistics.median(
                run["first_step_s"] for run in runs
            )
        else:
            seconds = statistics.median(s for run in runs for s in run["seconds"])
            report[f"{side}_decode_{setting}_call_s"] = seconds
            report[f"{side}_decode_{setting}_tokens_per_s"] = runs[0]["tokens"] / seconds
            report[f"{side}_decode_{setting}_peak_fraction"] = (
                runs[0]["flops"] / seconds / peak_flops
            )
    if sides == sorted(SIDES):
        peer, ours = "tunix", "rlaxkit"
        for work, setting in {(w, s) for _, w, s in results}:
            counts = {results[(side, work, setting)][0]["params"] for side in sides}
            if len(counts) != 1:
                raise RuntimeError(f"{work} {setting}: parameter counts differ: {counts}")
        for setting in ("small", "large"):
            for key in (f"step_{setting}", f"first_step_{setting}"):
                if f"{ours}_{key}_s" in report:
                    report[f"{key}_x"] = report[f"{peer}_{key}_s"] / report[f"{ours}_{key}_s"]
            key = f"decode_{setting}"
            if f"{ours}_{key}_tokens_per_s" in report:
                ours_rate = report[f"{ours}_{key}_tokens_per_s"]
                report[f"{key}_x"] = ours_rate / report[f"{peer}_{key}_tokens_per_s"]
        firsts = [report[k] for k in ("first_step_small_x", "first_step_large_x") if k in report]
        if firsts:
            report["first_step_x"] = min(firsts)
    for key, seconds in (floors or {}).items():
        report[f"{key}_floor_s"] = seconds
        times = {side: job_seconds(report, side, key) for side in sides}
        for side, took in times.items():
            if took is not None:
                report[f"{side}_{key}_floor_fraction"] = seconds / took
        if times.get("tunix") is not None:
            report[f"{key}_x_bound"] = bound = times["tunix"] / seconds
            # The fraction of the floor rlaxkit would have to run at for the goal's ratio
            # (above 1: not even the matmuls alone would be fast enough).
            report[f"{key}_goal_floor_fraction"] = GOAL_RATIO / bound
    return report


def job_seconds(report: dict, side: str, key: str) -> float | None:
    """One GRPO step, or one decode call, of ``side`` (``key``: ``step_small`` ...)."""
    return report.get(f"{side}_{key}_s" if key.startswith("step_") else f"{side}_{key}_call_s")


def print_table(report: dict) -> None:
    rows = [
        ("GRPO step, small", "step_small", "s"),
        ("GRPO step, large", "step_large", "s"),
        ("first step, small (fresh process)", "first_step_small", "s"),
        ("first step, large (fresh process)", "first_step_large", "s"),
        ("decode 16 x 16", "decode_small", "tokens_per_s"),
        ("decode 64 x 128", "decode_large", "tokens_per_s"),
    ]
    print(
        f"\n{'work':<36} {'tunix':>12} {'rlaxkit':>12} {'ratio':>7}  {'of peak':<15} "
        f"{'floor':>9}  {'of floor':<15} bound"
    )
    for label, key, unit in rows:
        peer, ours = report.get(f"tunix_{key}_{unit}"), report.get(f"rlaxkit_{key}_{unit}")
        if ours is None:
            continue
        fmt = (lambda v: f"{v:.4f} s") if unit == "s" else (lambda v: f"{v:.0f} tok/s")
        ratio = report.get(f"{key}_x")
        fractions = [report.get(f"{side}_{key}_peak_fraction") for side in SIDES]
        peak = " / ".join(f"{f:.1%}" for f in fractions if f is not None)
        floor = report.get(f"{key}_floor_s")
        of_floor = [report.get(f"{side}_{key}_floor_fraction") for side in SIDES]
        bound = report.get(f"{key}_x_bound")
        print(
            f"{label:<36} {fmt(peer) if peer else '-':>12} {fmt(ours):>12} "
            f"{f'{ratio:.2f}x' if ratio else '-':>7}  {peak:<15} "
            f"{f'{floor:.4f} s' if floor else '':>9}  "
            f"{' / '.join(f'{f:.0%}' for f in of_floor if f is not None):<15} "
            f"{f'{bound:.2f}x' if bound else ''}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds, <= 6 min")
    parser.add_argument("--rounds", type=int, help="rounds (default 2 quick, else 4)")
    parser.add_argument("--peer-venv", help=f"the peer's virtualenv (default {DEFAULT_PEER_VENV})")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--jobs", nargs="+", help="work:setting pairs, e.g. step:small")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 4)
    # Ten steps a round even when quick: a step takes 0.04-0.8 s, and on a shared machine
    # one step in a few can stall; a median of ten per round rides over them.
    steps, repeats = (10, 5) if args.quick else (10, 10)
    jobs = [tuple(j.split(":")) for j in args.jobs] if args.jobs else list(JOBS)
    pythons = {"rlaxkit": sys.executable}
    if "tunix" in args.sides:
        pythons["tunix"] = str(ensure_peer_venv(peer_venv_path(args.peer_venv)))
    scripts = {"tunix": "tunix_side.py", "rlaxkit": "rlaxkit_side.py"}
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    floor_args = ["--work", "floor", "--floors"]
    floor_args += [f"{w}:{s}" for w, s in jobs if w in ("step", "decode")]
    peaks = [run_side(sys.executable, "rlaxkit_side.py", ["--work", "peak"])["peak_flops"]]
    floors = [run_side(sys.executable, "rlaxkit_side.py", floor_args)["floor_s"]]
    results: dict[tuple[str, str, str], list[dict]] = {}
    for r in range(rounds):
        order = list(args.sides) if r % 2 == 0 else list(reversed(args.sides))
        for work, setting in jobs:
            for side in order:
                out = run_side(
                    pythons[side], scripts[side], job_args(work, setting, steps, repeats)
                )
                results.setdefault((side, work, setting), []).append(out)
                print(f"round {r}: {side:<8} {work:<10} {setting:<6} {json.dumps(out)}", flush=True)
    peaks.append(run_side(sys.executable, "rlaxkit_side.py", ["--work", "peak"])["peak_flops"])
    floors.append(run_side(sys.executable, "rlaxkit_side.py", floor_args)["floor_s"])
    # The faster of the two measurements: the floor is what the machine can do.
    report = summarise(results, max(peaks), {k: min(f[k] for f in floors) for k in floors[0]})
    report.update(
        rounds=rounds,
        steps_per_run=steps,
        decode_repeats=repeats,
        peak_flops_each=peaks,
        floor_s_each=floors,
        wall_s=time.perf_counter() - start,
        load_average_1m=[load_before, os.getloadavg()[0]],
        cpu_count=os.cpu_count(),
    )
    print(f"\nmatmul peak {max(peaks) / 1e9:.0f} GFLOP/s; load average {report['load_average_1m']}")
    print_table(report)
    ratios = [report.get(k) for k in ("step_small_x", "step_large_x")]
    ratios += [report.get(k) for k in ("decode_small_x", "decode_large_x")]
    if all(r is not None for r in ratios):
        print(
            f"goal: every ratio >= {GOAL_RATIO}x (lowest {min(ratios):.2f}x); rlaxkit first "
            f"step <= {GOAL_FIRST_STEP_S} s ({report['rlaxkit_first_step_small_s']:.2f} s small)"
        )
    for key in ("step_small", "step_large", "decode_small", "decode_large"):
        need, now = (
            report.get(f"{key}_goal_floor_fraction"),
            report.get(f"rlaxkit_{key}_floor_fraction"),
        )
        if need is not None and now is not None and report[f"{key}_x"] < GOAL_RATIO:
            print(
                f"{key}: {GOAL_RATIO}x needs rlaxkit at {need:.0%} of the matmul floor "
                f"(it runs at {now:.0%}, the peer at {report[f'tunix_{key}_floor_fraction']:.0%})"
            )
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
