"""Every figure ``rlaxkit plot`` draws, from one real run and one simulated run, into a
folder; and the two study figures of notebooks 03 and 04.

Runs ``rlaxkit train`` (the demo's config; ``--quick``: the tests' tiny model,
``config.SMALL_RUN``, for a few steps), fits the simulator to that run's trace
(``sim.fit_scenario``) and simulates the fitted scenario into a run folder as
``rlaxkit simulate`` writes one, so the simulated run is the model of the real one. It
then draws each run's figures (``reward``, ``staleness``, ``timeline``, ``throughput``,
``drops``, ``audit``) and the real run's trace overlaid on the simulated one
(``compare``), and copies the PNGs to ``OUT/real_NAME.png``, ``OUT/sim_NAME.png`` and
``OUT/compare.png``. Last, the
checkpoint-interval study of notebook 03 (``study_checkpoint.png``) and, without
``--quick``, the RLAX-like scaling figure of notebook 04 (``study_scaling.png``, assumed
and compiled costs), at short simulated horizons. Look at each against the figure rule
in ``docs/figures.md``; run it before and after a change to a figure to see both.

Usage::

    python benchmarks/figures.py --quick --out /tmp/figures   # about a minute on 2 cores
    python benchmarks/figures.py --out /tmp/figures --runs /tmp/runs   # keeps the runs;
    # a second call with the same --runs draws from them without running again

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

from matplotlib.figure import Figure

import sim
from rlaxkit.cli import main
from rlaxkit.config.run import SMALL_RUN
from rlaxkit.observe.comparisons import scaling_figure
from rlaxkit.observe.plotting import FIGURES, plot_run
from rlaxkit.observe.style import DPI
from rlaxkit.planning import Plan
from rlaxkit.rules.trace import JsonlTraceWriter, trace_path
from sim.presets import planned

ROOT = Path(__file__).resolve().parents[1]
QUICK = [*SMALL_RUN, "steps=6", "eval.num_problems=8", "eval.samples=2"]
PLAN = ROOT / "configs" / "plan" / "qwen3_32b_v5p.plan.json"  # stored by `rlaxkit plan`


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG from its IHDR chunk."""
    width, height = struct.unpack(">II", path.read_bytes()[16:24])
    return width, height


def real_and_simulated(work: Path, quick: bool, timings: dict[str, float]) -> tuple[Path, Path]:
    """The real run and its simulation in ``work`` (``real/``, ``sim/``); a run already
    there is kept."""
    real, simulated = work / "real", work / "sim"
    start = time.perf_counter()
    if not (real / "summary.json").exists():
        overrides = [x for o in (QUICK if quick else []) for x in ("--set", o)]
        config = [] if quick else [str(ROOT / "configs" / "demo.yaml")]
        code = main(
            ["train", *config, *overrides, "--run-dir", str(real), "--no-progress", "--overwrite"]
        )
        if code != 0:
            raise SystemExit(f"rlaxkit train exited {code}")
    timings["train_s"] = time.perf_counter() - start
    start = time.perf_counter()
    if not trace_path(simulated).exists():
        # The folder `rlaxkit simulate` writes, less its plots and Perfetto export (drawn
        # below, or not needed): scenario.yaml marks it simulated for the legends.
        scenario, _ = sim.fit_scenario(trace_path(real), name="fitted", warmup_steps=3)
        simulated.mkdir(parents=True, exist_ok=True)
        sim.save_scenario(scenario, simulated / "scenario.yaml")
        with JsonlTraceWriter(simulated / "trace.jsonl", append=False) as trace:
            sim.simulate(scenario, trace=trace)
    timings["simulate_s"] = time.perf_counter() - start
    return real, simulated


def study_figures(quick: bool) -> dict[str, Figure]:
    """Notebook 03's checkpoint-interval study and (without ``quick``: a minute of
    simulation) notebook 04's scaling figure, drawn as the notebooks draw them, at
    short horizons and one seed."""
    study = sim.checkpoint_interval_study(seeds=(0,), horizon_s=(5 if quick else 50) * 3600.0)
    figures = {"study_checkpoint.png": sim.checkpoint_figure(study)}
    if quick:
        return figures
    chips = (64, 128, 256, 512, 1024)
    base = sim.rlax_like(hours=2.0)
    compiled = planned(base, Plan.from_summary(json.loads(PLAN.read_text())).sim_overrides())
    workers = [c // base.fleet.chips_per_worker for c in chips]
    series, bounds = {}, {}
    for scenario, costs, etas in ((base, "assumed", (0, 2)), (compiled, "compiled", (2,))):
        grid = {"fleet.num_workers": workers, "staleness.max_staleness": list(etas)}
        points = sim.sweep(scenario, grid, seeds=(0,))
        for eta in etas:
            series[f"η = {eta}, {costs} costs"] = [
                next(
                    p.result.samples_per_s
                    for p in points
                    if p.overrides == {"fleet.num_workers": w, "staleness.max_staleness": eta}
                )
                for w in workers
            ]
        workload = scenario.workload
        tokens = workload.samples_per_step * (
            workload.prompt_tokens.mean() + workload.response_tokens.mean()
        )
        bound = workload.samples_per_step / scenario.trainer.step_s(tokens)
        bounds[f"trainer bound, {costs} costs"] = bound
    figures["study_scaling.png"] = scaling_figure(
        chips,
        series,
        ceiling=bounds,
        title="trained samples/s by fleet size (simulated; η: staleness bound, versions)",
    )
    return figures


def main_figures(out: Path, quick: bool, work: Path) -> dict[str, object]:
    timings: dict[str, float] = {}
    real, simulated = real_and_simulated(work, quick, timings)
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, list[int]] = {}
    for prefix, run, compare in (("real", real, simulated), ("sim", simulated, None)):
        for path in plot_run(run, figures=FIGURES, compare=compare):
            name = "compare.png" if path.name == "compare.png" else f"{prefix}_{path.name}"
            shutil.copyfile(path, out / name)
            written[name] = list(png_size(out / name))
    timings["plots_s"] = time.perf_counter() - start
    start = time.perf_counter()
    for name, figure in study_figures(quick).items():
        figure.savefig(out / name, dpi=DPI)
        written[name] = list(png_size(out / name))
    timings["studies_s"] = time.perf_counter() - start
    return {"out": str(out), "figures": written, **{k: round(v, 1) for k, v in timings.items()}}


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tests' tiny model, 6 steps")
    parser.add_argument("--out", default="figures", help="folder for the PNGs (default: figures)")
    parser.add_argument(
        "--runs",
        help="folder for the real and simulated runs, kept and reused by a later call "
        "(default: a temporary folder, deleted)",
    )
    args = parser.parse_args()
    if args.runs:
        result = main_figures(Path(args.out), args.quick, Path(args.runs))
    else:
        with tempfile.TemporaryDirectory(prefix="rlaxkit-figures-") as work:
            result = main_figures(Path(args.out), args.quick, Path(work))
    print(json.dumps(result))


if __name__ == "__main__":
    run()
