"""Does asynchronous GRPO teach a tiny model to use its calculator? (issue #21)

Runs ``rlaxkit train`` on two configs of the same model, warm start and RL budget:

- ``configs/calculator_tools.yaml``: 3-digit by 2-digit products with a calculator the
  model may call; a short warm start leaves the format in place and few answers right;
- ``configs/calculator_no_tool.yaml``: the same without the tool (a call gets
  ``=error: no calculator``, the warm start shows the answer alone).

Each run's held-out evaluation plays whole episodes with the tool (100 test problems,
4 episodes each, before and after RL) and reports pass@1 and ``tool_use_rate``, the
share of episodes that asked the calculator for the problem's own product. The
benchmark prints both runs' figures; the last line is one JSON object:
``pass1_before_tool``, ``pass1_after_tool``, ``pass1_gain_tool``, the same for
``no_tool``, ``tool_use_rate_before`` / ``_after`` (the tool run's), and
``wall_s_tool`` / ``wall_s_no_tool`` (each whole job: warm start, RL, evaluations).

The full run is the issue's figure (each job within 10 minutes on 2 CPU cores).
``--quick`` trains a third of the RL steps and evaluates 40 problems: it shows whether
the gain starts, not its size.

What it showed (2 shared CPU cores, load average about 3): with the tool, held-out
pass@1 0.037 -> 0.407 (+37 points) and tool_use_rate 0.305 -> 0.858 in 271 s (warm
start, 120 RL steps, four evaluations); without it 0.000 -> 0.000 in 84 s: the warm
start gets no product right, so every group's rewards are equal and GRPO has nothing to
push on. ``--quick``: 0.031 -> 0.144 and 0.362 -> 0.544 (40 problems) in 131 s. The
runs are deterministic (``runtime.mode: deterministic``): the same figures each time.
With ``seed=1`` the warm start already reaches 0.383 and RL takes it to 0.718.

Usage::

    python benchmarks/tool_learning.py --quick
    python benchmarks/tool_learning.py [--run-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from rlaxkit.cli import run_job
from rlaxkit.config.run import RunConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RUNS = {"tool": "calculator_tools.yaml", "no_tool": "calculator_no_tool.yaml"}


def config_for(name: str, quick: bool) -> RunConfig:
    """The shipped config of run ``name``; with ``quick`` a third of its RL steps and 40
    held-out problems."""
    config = RunConfig.from_yaml(CONFIGS / RUNS[name])
    if not quick:
        return config
    return RunConfig.from_overrides(
        [f"steps={max(config.steps // 3, 1)}", "eval.num_problems=40"], base=config
    )


def measure(name: str, run_dir: Path, quick: bool) -> dict[str, Any]:
    """One ``rlaxkit train`` job; its summary's evaluation figures and wall time."""
    summary = run_job(config_for(name, quick), run_dir / name, progress=False, log=lambda _: None)
    return {
        "pass1_before": summary["pass@1_before"],
        "pass1_after": summary["pass@1_after"],
        "tool_use_rate_before": summary["tool_use_rate_before"],
        "tool_use_rate_after": summary["tool_use_rate_after"],
        "wall_s": summary["wall_s"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a third of the RL steps")
    parser.add_argument("--run-dir", help="where the two runs go (default: a temporary one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(args.run_dir or scratch)
        results = {name: measure(name, base, args.quick) for name in RUNS}
    for name, r in results.items():
        print(
            f"{name:>8}: pass@1 {r['pass1_before']:.3f} -> {r['pass1_after']:.3f}, "
            f"tool_use_rate {r['tool_use_rate_before']:.3f} -> {r['tool_use_rate_after']:.3f}, "
            f"{r['wall_s']:.0f} s"
        )
    tool, no_tool = results["tool"], results["no_tool"]
    report = {
        "quick": args.quick,
        "pass1_before_tool": tool["pass1_before"],
        "pass1_after_tool": tool["pass1_after"],
        "pass1_gain_tool": tool["pass1_after"] - tool["pass1_before"],
        "pass1_before_no_tool": no_tool["pass1_before"],
        "pass1_after_no_tool": no_tool["pass1_after"],
        "pass1_gain_no_tool": no_tool["pass1_after"] - no_tool["pass1_before"],
        "tool_use_rate_before": tool["tool_use_rate_before"],
        "tool_use_rate_after": tool["tool_use_rate_after"],
        "tool_use_rate_after_no_tool": no_tool["tool_use_rate_after"],
        "wall_s_tool": tool["wall_s"],
        "wall_s_no_tool": no_tool["wall_s"],
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
