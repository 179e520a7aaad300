"""Every figure ``rlaxkit plot`` draws, from one real run and one simulated run, into a folder.

Runs ``rlaxkit train`` (the demo's config; ``--quick``: the tests' tiny model,
``config.SMALL_RUN``, for a few steps) and ``rlaxkit simulate configs/sim/toy.yaml``,
then draws each run's figures (``reward``, ``staleness``, ``timeline``, ``throughput``,
``drops``) and the real run's trace overlaid on the simulated one (``compare``), and
copies the PNGs to ``OUT/real_NAME.png``, ``OUT/sim_NAME.png`` and ``OUT/compare.png``.
Look at each against the figure rule in ``docs/figures.md``; run it before and after a
change to a figure to see both.

Usage::

    python benchmarks/figures.py --quick --out /tmp/figures   # a few minutes on 2 cores

The last line printed is one JSON object: the PNGs written, each with its size in pixels,
and the wall time of each phase.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import tempfile
import time
from pathlib import Path

from rlaxkit.cli import main
from rlaxkit.config.run import SMALL_RUN
from rlaxkit.observe.plotting import FIGURES, plot_run

ROOT = Path(__file__).resolve().parents[1]
QUICK = [*SMALL_RUN, "steps=6", "eval.num_problems=8", "eval.samples=2"]


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG from its IHDR chunk."""
    width, height = struct.unpack(">II", path.read_bytes()[16:24])
    return width, height


def main_figures(out: Path, quick: bool, work: Path) -> dict[str, object]:
    timings: dict[str, float] = {}
    real, simulated = work / "real", work / "sim"
    start = time.perf_counter()
    overrides = [x for o in (QUICK if quick else []) for x in ("--set", o)]
    config = [] if quick else [str(ROOT / "configs" / "demo.yaml")]
    code = main(["train", *config, *overrides, "--run-dir", str(real), "--no-progress"])
    if code != 0:
        raise SystemExit(f"rlaxkit train exited {code}")
    timings["train_s"] = time.perf_counter() - start
    start = time.perf_counter()
    toy = str(ROOT / "configs" / "sim" / "toy.yaml")
    if main(["simulate", toy, "--run-dir", str(simulated), "--no-progress"]) != 0:
        raise SystemExit("rlaxkit simulate failed")
    timings["simulate_s"] = time.perf_counter() - start
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, list[int]] = {}
    for prefix, run, compare in (("real", real, simulated), ("sim", simulated, None)):
        for path in plot_run(run, figures=FIGURES, compare=compare):
            name = "compare.png" if path.name == "compare.png" else f"{prefix}_{path.name}"
            shutil.copyfile(path, out / name)
            written[name] = list(png_size(out / name))
    timings["plots_s"] = time.perf_counter() - start
    return {"out": str(out), "figures": written, **{k: round(v, 1) for k, v in timings.items()}}


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tests' tiny model, 6 steps")
    parser.add_argument("--out", default="figures", help="folder for the PNGs (default: figures)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlaxkit-figures-") as work:
        result = main_figures(Path(args.out), args.quick, Path(work))
    print(json.dumps(result))


if __name__ == "__main__":
    run()
