"""``rlaxkit`` command line: train, sft, eval, plot, trace, simulate, demo.

rlaxkit demo                                  # the embedded default run
rlaxkit train configs/demo.yaml --set staleness.max_staleness=4
rlaxkit train configs/arithmetic_ray.yaml     # the same run on the Ray backend (actors)
rlaxkit train CONFIG --run-dir RUN --faults configs/faults/standard.yaml   # inject faults
rlaxkit train CONFIG --run-dir RUN            # again after a preemption: resumes
rlaxkit sft configs/demo.yaml                 # warm start only (cached in the run dir)
rlaxkit eval RUN_DIR                          # held-out pass@k of a run's final policy
rlaxkit plot RUN_DIR                          # PNGs from metrics.jsonl and trace.jsonl
rlaxkit plot RUN_DIR --compare SIM_RUN_DIR    # ... and the two traces overlaid
rlaxkit trace RUN_DIR -o run.perfetto.json    # the trace for ui.perfetto.dev
rlaxkit simulate configs/sim/toy.yaml --set fleet.num_workers=4   # a simulated run dir
rlaxkit plan configs/plan/qwen25_7b_v5p.yaml --set remat=full   # memory and FLOPs per chip
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import numpy as np

from rlaxkit.config import RunConfig
from rlaxkit.perfetto import MAX_EVENTS, MAX_EVENTS_PER_TRACK

if TYPE_CHECKING:
    from rlaxkit.evaluation import EvalReport
    from rlaxkit.perfetto import PerfettoExport
    from rlaxkit.trace import TraceSink
    from sim.metrics import SimResult
    from sim.scenario import Scenario

SIM_CHUNKS = 200  # progress-bar updates of a simulated run


class StopRequest:
    """SIGTERM/SIGINT handling for a job: the first signal asks the job to stop after the
    current trainer step (it then checkpoints and exits 0, as a spot VM or TPU
    preemption notice expects); a second one stops at once (the last checkpoint stands).

    Use as a context manager; the previous handlers come back on exit.
    """

    def __init__(self, log: Callable[[str], object] = print):
        self.requested: str | None = None
        self._log = log
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
        self.requested = signal.Signals(signum).name
        self._log(f"{self.requested}: finishing the current step, then checkpointing")

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread may take signals (a notebook's worker)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def run_job(
    config: RunConfig,
    run_dir: str | Path,
    *,
    progress: bool = True,
    log: Callable[[str], object] = print,
    faults: str | Path | None = None,
    cache_dir: str | Path | None = None,
) -> dict[str, Any]:
    """The main job: warm start, held-out eval, RL for ``config.steps``, eval, plots.

    Writes into ``run_dir``: ``config.yaml``, ``metrics.jsonl``, ``trace.jsonl``,
    ``checkpoints/``, ``summary.json``, ``final/`` (an HF checkpoint of the trained
    policy) and ``plots/``. A run directory with checkpoints is resumed. On SIGTERM or
    SIGINT the job finishes its current step, checkpoints and returns a summary with
    ``"preempted": true`` (no final eval, no plots).

    ``runtime.backend`` picks where ``Experiment`` places the run's parts: ``local`` (this
    process) or ``ray`` (actors placed per ``config.ray``). Both checkpoint on a signal,
    resume, and replay fault plans.

    Args:
        faults: a FaultPlan file to inject.
        cache_dir: where the warm start is cached (default: ``run_dir``).
    """
    from rlaxkit import runtime
    from rlaxkit.models import save_hf_checkpoint
    from rlaxkit.plotting import TRAIN_JOB_FIGURES, plot_run

    run_dir = Path(run_dir)
    start = time.perf_counter()
    log(f"run directory: {run_dir} ({config.runtime.backend} backend)")
    summary: dict[str, Any]
    with (
        StopRequest(log) as stop,
        runtime.Experiment(
            config, run_dir=run_dir, progress=progress, faults=faults, cache_dir=cache_dir
        ) as exp,
    ):
        ws = exp.warm_start
        if ws["steps"]:
            how = "loaded from cache" if ws["cached"] else f"final loss {ws['final_loss']:.3f}"
            log(f"warm start: {ws['steps']} supervised steps ({how})")
        evals = exp.extra.setdefault("evals", [])
        if exp.resumed_from is not None:
            log(f"resumed from the checkpoint of step {exp.resumed_from}")
        if not evals:
            before = exp.evaluate()
            evals.append({"step": 0, **_row(before, 1)})
            log(f"held-out pass@1 before RL: {evals[0]['pass@1']:.3f}{_extras(before)}")
        every = config.eval.every_steps
        while exp.version < config.steps and not stop.requested:
            exp.step()
            step = exp.version
            if every and step % every == 0 and step < config.steps:
                evals.append({"step": step, **_row(exp.evaluate(), 1)})
        if stop.requested:
            saved = exp.save_checkpoint()
            summary = {"preempted": True, "signal": stop.requested, "step": exp.version}
            summary |= {"checkpoint_saved": saved, **exp.summary()}
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            log(f"stopped at step {exp.version}; run again with --run-dir {run_dir} to resume")
            return summary
        after = exp.evaluate()
        evals.append({"step": config.steps, **_row(after, 1)})
        exp.check_accounting()
        # Experiment.current_model is typed nnx.Module until rlaxkit.runtime is rewritten;
        # the model is the trainer's Transformer.
        save_hf_checkpoint(
            exp.current_model(),  # type: ignore[arg-type]
            run_dir / "final",
            tokenizer=exp.tokenizer,
        )
        summary = {
            "steps": config.steps,
            "pass@1_before": evals[0]["pass@1"],
            "pass@1_after": evals[-1]["pass@1"],
            # A multi-turn task's own metrics (tool_use_rate_before, tool_use_rate_after).
            **{f"{k}_before": evals[0].get(k) for k in after.metrics},
            **{f"{k}_after": v for k, v in after.metrics.items()},
            "evals": evals,
            "buffer": exp.buffer.counts(),
            "wall_s": time.perf_counter() - start,
            "eval_after": after.rows,
            **{k: v for k, v in exp.summary().items() if k not in ("buffer", "wall_s")},
        }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plots = plot_run(run_dir, figures=TRAIN_JOB_FIGURES)
    log(
        f"held-out pass@1 after RL:  {summary['pass@1_after']:.3f} "
        f"({100 * (summary['pass@1_after'] - summary['pass@1_before']):+.1f} points)"
        f"{_extras(after)}"
    )
    log(after.table())
    log("plots: " + ", ".join(str(p) for p in plots))
    log(f"wall time: {summary['wall_s']:.0f} s, goodput {summary['goodput']:.3f}")
    return summary


def simulate_job(
    scenario: Scenario,
    run_dir: str | Path,
    *,
    progress: bool = True,
    log: Callable[[str], object] = print,
) -> dict[str, Any]:
    """Simulate ``scenario`` into a run directory laid out as a real run's.

    Writes ``scenario.yaml`` (the scenario as resolved, overrides applied),
    ``trace.jsonl``, ``summary.json`` (``SimResult.to_row`` plus the staleness, drop
    and preemption counts), ``plots/`` and ``run.perfetto.json``. The progress bar
    advances over simulated time: the run goes in chunks of 1/200 of the horizon
    (``env.run(until=...)``), which leaves its events and results as they are.
    """
    from rlaxkit.plotting import plot_run
    from rlaxkit.trace import JsonlTraceWriter
    from sim.scenario import save_scenario

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    log(f"run directory: {run_dir} (simulated: {scenario.name}, {scenario.chips} chips)")
    save_scenario(scenario, run_dir / "scenario.yaml")
    with JsonlTraceWriter(run_dir / "trace.jsonl", append=False) as trace:
        result = _simulate_in_chunks(scenario, trace, progress=progress)
    summary = {
        **result.to_row(),
        "samples_trained": result.samples_trained,
        "samples_generated": result.samples_generated,
        "staleness": result.staleness,
        "drops": result.drops,
        "preemptions_by_kind": result.preemptions,
        "sim_events": result.events,
        "wall_s": result.wall_s,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plots = plot_run(run_dir)
    export = result.to_perfetto(run_dir / "run.perfetto.json", run_dir / "trace.jsonl")
    log(
        f"{result.steps} steps in {result.sim_time_s / 3600:.2f} simulated h "
        f"({result.wall_s:.1f} s wall): {result.samples_per_s:.3g} samples/s, goodput "
        f"{result.goodput:.3f}, mean staleness {result.mean_staleness:.2f}"
    )
    log("plots: " + ", ".join(str(p) for p in plots))
    log(_export_line(export))
    return summary


def _simulate_in_chunks(scenario: Scenario, trace: TraceSink, *, progress: bool) -> SimResult:
    """``Simulation(scenario, trace=trace).run()`` with a progress bar: the same stop
    rule (the target step or the horizon), run ``CHUNKS`` slices of the horizon at a
    time. ``sim.engine`` offers no progress hook; the chunk timeouts only add events
    to the schedule, they do not reorder the run's own."""
    from tqdm.auto import tqdm

    from sim.engine import Simulation, events_scheduled
    from sim.metrics import build_result

    simulation = Simulation(scenario, trace=trace)
    env = simulation.env
    horizon_s = scenario.horizon_s
    done, horizon = simulation.trainer.done, env.timeout(horizon_s)
    bar = tqdm(
        total=round(horizon_s), unit="sim s", desc="simulate", disable=not progress, leave=False
    )
    wall_start = time.perf_counter()
    while not (done.processed or horizon.processed):
        # One flat condition per chunk: a processed condition strips the checks of the
        # conditions nested in it, so a stop rule nested here would never fire.
        env.run(until=env.any_of([done, horizon, env.timeout(horizon_s / SIM_CHUNKS)]))
        bar.update(round(env.now) - bar.n)
        bar.set_postfix(step=simulation.trainer.version, refresh=False)
    bar.close()
    fleet = scenario.fleet
    return build_result(
        name=scenario.name,
        counters=simulation.counters,
        sim_time_s=env.now,
        total_slots=fleet.num_workers * fleet.slots_per_worker,
        events=events_scheduled(env),
        wall_s=time.perf_counter() - wall_start,
        reached_target=simulation.trainer.done.triggered,
    )


def _export_line(export: PerfettoExport) -> str:
    merged = (
        f"; {export.aggregated_tracks} tracks merged or thinned to fit (see its metadata)"
        if export.aggregated_tracks
        else ""
    )
    return (
        f"perfetto: {export.path} ({export.events} events on {export.tracks} tracks, "
        f"{export.bytes / 1e6:.1f} MB{merged}); open it at https://ui.perfetto.dev"
    )


def load_scenario_with_overrides(path: str | Path, overrides: list[str]) -> Scenario:
    """A scenario YAML with ``section.field=value`` overrides (values parsed as YAML, so
    a distribution can be given as ``{type: constant, value: 10}``). As with
    ``sim.with_overrides``, overriding ``workload.prompts_per_step`` alone also sets
    ``staleness.batch_size``, which must equal it."""
    import yaml

    from rlaxkit.configio import apply_overrides
    from sim.scenario import scenario_from_dict

    data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a scenario file must hold a mapping")
    given = dict(item.split("=", 1) for item in overrides if "=" in item)
    given = {key.strip(): value for key, value in given.items()}
    if "workload.prompts_per_step" in given and "staleness.batch_size" not in given:
        overrides = [*overrides, f"staleness.batch_size={given['workload.prompts_per_step']}"]
    return scenario_from_dict(apply_overrides(data, overrides))


def _row(report: EvalReport, k: int) -> dict[str, float]:
    """Held-out pass@1 and its standard error over the problems (each problem's pass@1
    is its share of correct samples)."""
    row = next(r for r in report.rows if r["k"] == k)
    per_problem = [p["correct"] / report.samples for p in report.per_problem]
    spread = float(np.std(per_problem, ddof=1)) if len(per_problem) > 1 else 0.0
    se = spread / max(len(per_problem), 1) ** 0.5
    return {"pass@1": row["pass@k"], "pass@1_se": se, **report.metrics}


def _extras(report: EvalReport) -> str:
    """``", tool_use_rate 0.412"`` for a multi-turn task's evaluation, else ``""``."""
    if "tool_use_rate" not in report.metrics:
        return ""
    return f", tool_use_rate {report.metrics['tool_use_rate']:.3f}"


def _config(args: argparse.Namespace) -> RunConfig:
    if args.config:
        return RunConfig.from_yaml(args.config, args.set)
    return RunConfig.from_overrides(args.set)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlaxkit", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p, optional=False):
        p.add_argument("config", nargs="?" if optional else None, help="YAML run config")
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config field, e.g. staleness.max_staleness=4",
        )
        p.add_argument("--run-dir", default=None, help="output directory")
        p.add_argument("--no-progress", action="store_true")

    for name, text in (("train", "run RL from a config"), ("demo", "the embedded default run")):
        p_run = sub.add_parser(name, help=text)
        with_config(p_run, optional=True)
        p_run.add_argument("--faults", default=None, help="FaultPlan YAML/JSON to inject")
        p_run.add_argument("--cache-dir", default=None, help="warm-start cache directory")
    with_config(sub.add_parser("sft", help="supervised warm start only"), optional=True)
    p_eval = sub.add_parser("eval", help="held-out pass@k of a run's final policy")
    p_eval.add_argument("run_dir")
    p_eval.add_argument("--samples", type=int, default=None)
    p_plot = sub.add_parser("plot", help="write PNG figures of a run directory")
    p_plot.add_argument("run_dir")
    p_plot.add_argument(
        "--compare", default=None, help="another run directory to overlay (plots/compare.png)"
    )
    p_trace = sub.add_parser("trace", help="export a run's trace for ui.perfetto.dev")
    p_trace.add_argument("run_dir", help="run directory (or its trace.jsonl)")
    p_trace.add_argument("-o", "--output", default=None, help="default RUN_DIR/run.perfetto.json")
    p_trace.add_argument("--max-events", type=int, default=MAX_EVENTS)
    p_trace.add_argument("--max-events-per-track", type=int, default=MAX_EVENTS_PER_TRACK)
    p_sim = sub.add_parser("simulate", help="simulate a scenario YAML into a run directory")
    p_sim.add_argument("scenario", help="scenario YAML, e.g. configs/sim/toy.yaml")
    p_sim.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a scenario field, e.g. fleet.num_workers=8",
    )
    p_sim.add_argument("--run-dir", default=None, help="output directory")
    p_sim.add_argument("--no-progress", action="store_true")
    p_plan = sub.add_parser("plan", help="compile a run's programs for a mesh: memory, FLOPs")
    p_plan.add_argument("config", nargs="?", help="plan YAML (rlaxkit.planning.PlanConfig)")
    p_plan.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="e.g. mesh=[1,16,4]"
    )
    p_plan.add_argument("--json", action="store_true", help="print one JSON line instead")
    p_plan.add_argument(
        "--target",
        default=None,
        metavar="TOPOLOGY",
        help="compile with XLA:TPU for this TPU slice (v5p:4x4x4, v5p-128; rlaxkit[tpu])",
    )
    args = parser.parse_args(argv)

    try:
        if args.command in ("train", "demo"):
            config = _config(args)
            run_dir = args.run_dir or (
                "runs/demo" if args.command == "demo" else f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
            )
            run_job(
                config,
                run_dir,
                progress=not args.no_progress,
                faults=args.faults,
                cache_dir=args.cache_dir,
            )
        elif args.command == "sft":
            from rlaxkit.runtime.build import build_policy, build_task, warm_start

            config = _config(args)
            run_dir = Path(args.run_dir or "runs/demo")
            run_dir.mkdir(parents=True, exist_ok=True)
            task = build_task(config)
            model, tokenizer = build_policy(config, task)
            _, info = warm_start(config, task, model, tokenizer, run_dir)
            print(json.dumps(info))
        elif args.command == "eval":
            _eval(Path(args.run_dir), args.samples)
        elif args.command == "plot":
            from rlaxkit.plotting import plot_run

            for path in plot_run(args.run_dir, compare=args.compare):
                print(path)
        elif args.command == "trace":
            from rlaxkit.perfetto import export_perfetto

            source = Path(args.run_dir)
            run_dir = source if source.is_dir() else source.parent
            output = args.output or run_dir / "run.perfetto.json"
            export = export_perfetto(
                source,
                output,
                max_events=args.max_events,
                max_events_per_track=args.max_events_per_track,
            )
            print(_export_line(export))
        elif args.command == "simulate":
            scenario = load_scenario_with_overrides(args.scenario, args.set)
            run_dir = args.run_dir or f"runs/sim-{scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            simulate_job(scenario, run_dir, progress=not args.no_progress)
        elif args.command == "plan":
            from rlaxkit.planning import load_plan_config, plan

            target = [f"target={args.target}"] if args.target else []
            try:
                result = plan(load_plan_config(args.config, [*args.set, *target]))
            except ImportError as err:  # no libtpu: the message names the extra
                raise ValueError(str(err)) from None
            print(json.dumps(result.summary()) if args.json else result.table())
    except (ValueError, FileNotFoundError) as err:
        print(f"rlaxkit {args.command}: {err}", file=sys.stderr)
        return 2
    return 0


def _eval(run_dir: Path, samples: int | None) -> None:
    from rlaxkit.evaluation import evaluate_model
    from rlaxkit.models import load_hf_checkpoint
    from rlaxkit.runtime.build import build_task

    config = RunConfig.from_yaml(run_dir / "config.yaml")
    model, tokenizer = load_hf_checkpoint(run_dir / "final")
    if tokenizer is None:
        raise FileNotFoundError(f"{run_dir / 'final'} holds no tokenizer to decode with")
    task = build_task(config)
    n = samples or config.eval.samples
    problems = task.problems("test", config.eval.num_problems)
    report = evaluate_model(config, task, model, tokenizer, problems=problems, n=n, seed=0)
    print(report.table())


if __name__ == "__main__":
    sys.exit(main())
