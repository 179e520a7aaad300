"""rlaxkit command line: demo, train, sft, eval, plot, trace, simulate, plan, tune.

rlaxkit demo                                  # the embedded default run
rlaxkit train configs/demo.yaml --set staleness.max_staleness=0   # the demo, synchronous
rlaxkit train configs/arithmetic_ray.yaml     # the same run on the Ray backend (actors)
rlaxkit train CONFIG --run-dir RUN --faults configs/faults/standard.yaml   # inject faults
rlaxkit train CONFIG --run-dir RUN            # again after a preemption: resumes
rlaxkit train CONFIG --run-dir RUN --new      # RUN holds another run: write to RUN-2
rlaxkit sft configs/demo.yaml                 # warm start only (cached in the run dir)
rlaxkit eval RUN_DIR                          # held-out pass@k of a run's final policy
rlaxkit plot RUN_DIR                          # PNGs from metrics.jsonl and trace.jsonl
rlaxkit plot RUN_DIR --compare SIM_RUN_DIR    # ... and the two traces overlaid
rlaxkit trace RUN_DIR -o run.perfetto.json    # the trace for ui.perfetto.dev
rlaxkit simulate configs/sim/toy.yaml --set fleet.num_workers=4   # a simulated run dir
rlaxkit plan configs/plan/qwen25_7b_v5p.yaml --set remat=full   # memory and FLOPs per chip
rlaxkit tune configs/sim/rlax_like_1024.yaml --chips 1280   # settings the simulator advises
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import numpy as np

from rlaxkit.config.run import RunConfig
from rlaxkit.observe.perfetto import MAX_EVENTS, MAX_EVENTS_PER_TRACK
from rlaxkit.rules.stalls import TrainingStalled
from rlaxkit.util.rundirs import Choice, claim_run_dir

if TYPE_CHECKING:
    from rlaxkit.evaluation import EvalReport
    from rlaxkit.observe.perfetto import PerfettoExport
    from rlaxkit.rules.trace import TraceSink
    from sim.metrics import SimResult
    from sim.scenario import Scenario

SIM_CHUNKS = 200  # progress-bar updates of a simulated run
EVAL_SEED = 1234  # the sampling seed of a run's held-out evaluations (and rlaxkit eval's)


class StopRequest:
    """SIGTERM/SIGINT handling for a job: during RL steps (inside ``steps()``) the first
    signal asks the job to stop after the current trainer step (it then checkpoints and
    exits 0, as a spot VM or TPU preemption notice expects); a second one stops at once
    (the last checkpoint stands). Outside them (the warm start, the evaluations, the
    plots) there is no step to finish: a signal stops the job at once.

    Use as a context manager; the previous handlers come back on exit.
    """

    def __init__(self, log: Callable[[str], object] = print):
        self.requested: str | None = None
        self._log = log
        self._previous: dict[int, Any] = {}
        self._in_steps = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:
            raise KeyboardInterrupt(f"second {name}")
        if not self._in_steps:
            raise KeyboardInterrupt(f"{name} outside the RL steps")
        self.requested = name
        self._log(f"{self.requested}: finishing the current step, then checkpointing")

    @contextlib.contextmanager
    def steps(self) -> Iterator[None]:
        """The RL steps: a first signal here waits for the step under way."""
        self._in_steps = True
        try:
            yield
        finally:
            self._in_steps = False

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

    A run that stops on an error leaves ``summary.json`` with ``status: failed`` and the
    reason; a finished one says ``status: finished``, a signalled one ``stopped``.
    """
    run_dir = Path(run_dir)
    log(f"run directory: {run_dir} ({config.runtime.backend} backend)")
    try:
        return _run_job(
            config, run_dir, progress=progress, log=log, faults=faults, cache_dir=cache_dir
        )
    except (Exception, KeyboardInterrupt) as error:
        if (run_dir / "config.yaml").exists():  # the run started: say why it stopped
            _write_failed_summary(run_dir, error)
        raise


def _warm_start_with_bar(
    config: RunConfig, cache_dir: Path, *, progress: bool
) -> dict[str, Any] | None:
    """The run's supervised warm start with a progress bar, into ``cache_dir``, where
    ``Experiment`` then loads it (its own warm start has no bar); ``None`` when there is
    none to run here (``sft.steps`` 0, cached already, or the Ray backend)."""
    from tqdm.auto import tqdm

    from rlaxkit.runtime.build import build_policy, build_task, cached_warm_start, warm_start

    if config.runtime.backend != "local" or not config.sft.steps:
        return None  # on Ray the trainer's actor warm-starts, on its own resources
    if cached_warm_start(config, cache_dir) is not None:
        return None
    task = build_task(config)
    if getattr(task, "demonstration", None) is None:
        return None  # Experiment refuses it, naming sft.steps
    model, tokenizer = build_policy(config, task)
    bar = tqdm(total=config.sft.steps, desc="warm start", unit="step", disable=not progress)

    def on_step(step: int, loss: float) -> None:
        bar.update(1)
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

    with bar:
        _, info = warm_start(config, task, model, tokenizer, cache_dir, on_step=on_step)
    return info


def _write_failed_summary(run_dir: Path, error: BaseException) -> None:
    """``summary.json`` of a run that stopped on ``error``: ``status: failed``, the reason,
    and the step of its newest checkpoint (``null``: none), so the folder says why."""
    from rlaxkit.runtime.state import checkpoint_dir

    directory = checkpoint_dir(run_dir)
    found = directory.iterdir() if directory.is_dir() else ()
    steps = sorted(int(p.name) for p in found if p.name.isdigit())
    summary = {
        "status": "failed",
        "reason": f"{type(error).__name__}: {error}",
        "checkpoint_step": steps[-1] if steps else None,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def _run_job(
    config: RunConfig,
    run_dir: Path,
    *,
    progress: bool,
    log: Callable[[str], object],
    faults: str | Path | None,
    cache_dir: str | Path | None,
) -> dict[str, Any]:
    from rlaxkit import runtime
    from rlaxkit.models import save_hf_checkpoint
    from rlaxkit.observe.plotting import TRAIN_JOB_FIGURES, plot_run
    from rlaxkit.rules.stalls import check_start

    start = time.perf_counter()
    summary: dict[str, Any]
    with StopRequest(log):  # a signal in the warm start stops the job at once
        trained = _warm_start_with_bar(config, Path(cache_dir or run_dir), progress=progress)
    with (
        StopRequest(log) as stop,
        runtime.Experiment(
            config, run_dir=run_dir, progress=progress, faults=faults, cache_dir=cache_dir
        ) as exp,
    ):
        if config.agent is not None:  # a user's agent produces the samples (rlaxkit.serve)
            from rlaxkit.serve.agents import attach_agent

            log(f"agent endpoint: {attach_agent(exp).endpoint.url}")
        ws = trained or exp.warm_start
        if ws["steps"]:
            how = "loaded from cache" if ws["cached"] else f"final loss {ws['final_loss']:.3f}"
            log(f"warm start: {ws['steps']} supervised steps ({how})")
        evals = exp.extra.setdefault("evals", [])
        if exp.resumed_from is not None:
            log(f"resumed from the checkpoint of step {exp.resumed_from}")
        if not evals:
            before = exp.evaluate(seed=EVAL_SEED, progress=progress)
            evals.append({"step": 0, **_row(before, 1)})
            log(f"held-out pass@1 before RL: {evals[0]['pass@1']:.3f}{_extras(before)}")
            mean_score = next(r["mean@k"] for r in before.rows if r["k"] == 1)
            p1, samples = evals[0]["pass@1"], before.num_problems * before.samples
            check_start(config.batching.equal_rewards, config.sampling.n, p1, samples, mean_score)

        def evaluate(done: runtime.StepDone) -> None:
            if done.step < config.steps:  # the last step's comes after the loop
                evals.append({"step": done.step, **_row(exp.evaluate(seed=EVAL_SEED), 1)})

        exp.add_hook(evaluate, every=config.eval.every_steps, name="evaluation")
        with stop.steps():
            # more_steps: a trainer preempted at the last step restores and redoes its steps.
            while not stop.requested and exp.more_steps(config.steps):
                exp.step()
        if stop.requested:
            saved = exp.save_checkpoint()
            summary = {"status": "stopped", "preempted": True, "signal": stop.requested}
            summary |= {"step": exp.version}
            summary |= {"checkpoint_saved": saved, **exp.summary()}
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            log(f"stopped at step {exp.version}; run again with --run-dir {run_dir} to resume")
            return summary
        after = exp.evaluate(seed=EVAL_SEED, progress=progress)
        evals.append({"step": config.steps, **_row(after, 1)})
        exp.check_accounting()
        save_hf_checkpoint(exp.current_model(), run_dir / "final", tokenizer=exp.tokenizer)
        summary = {
            "status": "finished",
            "steps": config.steps,
            "pass@1_before": evals[0]["pass@1"],
            "pass@1_after": evals[-1]["pass@1"],
            # A multi-turn task's own metrics (tool_use_rate_before, tool_use_rate_after).
            **{f"{k}_before": evals[0].get(k) for k in after.metrics},
            **{f"{k}_after": v for k, v in after.metrics.items()},
            "evals": evals,
            "eval_seed": EVAL_SEED,
            "buffer": exp.buffer.counts(),
            "wall_s": time.perf_counter() - start,
            "eval_after": after.rows,
            **{k: v for k, v in exp.summary().items() if k not in ("buffer", "wall_s")},
        }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    log(f"drawing {', '.join(TRAIN_JOB_FIGURES)} into {run_dir / 'plots'} ...")
    plots = plot_run(run_dir, figures=TRAIN_JOB_FIGURES, progress=progress)
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
    from rlaxkit.observe.perfetto import export_perfetto
    from rlaxkit.observe.plotting import plot_run
    from rlaxkit.rules.trace import JsonlTraceWriter
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
        "audit": result.audit,  # sampled against trained length and pass rate
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    log(f"drawing the figures into {run_dir / 'plots'} ...")
    plots = plot_run(run_dir, progress=progress)
    log(f"exporting the trace for Perfetto to {run_dir / 'run.perfetto.json'} ...")
    export = export_perfetto(
        run_dir / "trace.jsonl",
        run_dir / "run.perfetto.json",
        metadata={"sim_result": result.to_row()},
    )
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
        audit=simulation.audit.audit(simulation.buffer.ledger.dropped),
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
    from rlaxkit.config.io import apply_overrides, read_yaml
    from sim.scenario import scenario_from_dict

    data = read_yaml(path)
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
    saved = Path(args.run_dir or "") / "config.yaml"
    if getattr(args, "resume", False) and args.run_dir and saved.is_file():
        return RunConfig.from_yaml(saved, args.set)  # --resume: the run's own config
    return RunConfig.from_overrides(args.set)


def _claim(args: argparse.Namespace, config: RunConfig, run_dir: str) -> Path | None:
    """Where a train/demo job writes (see ``rlaxkit.util.rundirs``); ``None``: the run in
    ``run_dir`` finished and there is nothing to do (the reason is printed)."""
    from rlaxkit.runtime.state import checkpoint_dir

    directory = checkpoint_dir(Path(run_dir))
    claim = claim_run_dir(
        run_dir,
        "run",
        config.to_dict(),
        _choice(args),
        has_checkpoint=directory.is_dir() and any(directory.iterdir()),
    )
    if claim.message:
        print(claim.message)
    return None if claim.action == "finished" else claim.run_dir


def _choice(args: argparse.Namespace) -> Choice:
    choices: tuple[Choice, ...] = ("resume", "new", "overwrite")
    return next((name for name in choices if getattr(args, name, False)), "auto")


def _ownership_options(p: argparse.ArgumentParser) -> None:
    """``--resume``/``--new``/``--overwrite``: what to do with a run directory that holds
    a run (without one: continue the same config's run, refuse another)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --run-dir with its own config.yaml (--set still applies)",
    )
    group.add_argument(
        "--new",
        action="store_true",
        help="if --run-dir holds a run, write to a fresh RUN_DIR-2 (-3, ...) beside it",
    )
    group.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run files in --run-dir first (warm-start caches stay)",
    )
    p.add_argument(
        "--compact-trace",
        action="store_true",
        help="gzip trace.jsonl into trace.jsonl.gz once the run has finished (24x smaller "
        "on the demo's trace, 7.6x on a fleet-scale simulation's; plot, trace and sim read "
        "it as it is)",
    )


def main(argv: list[str] | None = None) -> int:
    from rlaxkit import __version__

    parser = argparse.ArgumentParser(
        prog="rlaxkit",
        description=__doc__.split("\n")[0],
        epilog="examples:\n" + __doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"rlaxkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_config(p, optional=False, run_dir="runs/demo"):
        p.add_argument(
            "config",
            nargs="?" if optional else None,
            help="YAML run config, e.g. configs/demo.yaml (default: the demo's config)",
        )
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config field, e.g. sampling.n=4 (repeat for more)",
        )
        p.add_argument("--run-dir", default=None, help=f"output directory (default: {run_dir})")
        p.add_argument("--no-progress", action="store_true", help="no progress bars")

    for name, text, description, default_dir in (
        (
            "train",
            "run RL from a config",
            "Warm start, held-out eval, RL for `steps` steps, eval and plots, from a config.",
            "runs/YYYYmmdd-HHMMSS",
        ),
        (
            "demo",
            "the embedded default run",
            "The embedded default run (configs/demo.yaml: a warm start, then asynchronous "
            "GRPO at staleness bound 2 on addition with a tiny model); the job of `train` "
            "with no config.",
            "runs/demo",
        ),
    ):
        p_run = sub.add_parser(name, help=text, description=description)
        with_config(p_run, optional=True, run_dir=default_dir)
        p_run.add_argument("--faults", default=None, help="FaultPlan YAML/JSON to inject")
        p_run.add_argument(
            "--cache-dir", default=None, help="warm-start cache directory (default: --run-dir)"
        )
        _ownership_options(p_run)
    with_config(sub.add_parser("sft", help="supervised warm start only"), optional=True)
    p_eval = sub.add_parser(
        "eval",
        help="held-out pass@k of a run's final policy",
        description="Held-out pass@k of RUN_DIR/final with the run's own evaluation settings "
        "(eval.num_problems, eval.samples and the sampling seed its summary used).",
    )
    p_eval.add_argument("run_dir", help="a finished run directory (holds config.yaml, final/)")
    p_eval.add_argument(
        "--samples", type=int, default=None, help="samples per problem (default: eval.samples)"
    )
    p_eval.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampling seed (default: the seed the run's own final evaluation used)",
    )
    p_plot = sub.add_parser("plot", help="write PNG figures of a run directory")
    p_plot.add_argument("run_dir", help="a run directory; figures go to RUN_DIR/plots")
    p_plot.add_argument("--compare", help="another run directory to overlay (plots/compare.png)")
    p_plot.add_argument("--no-progress", action="store_true", help="no progress bar")
    p_trace = sub.add_parser("trace", help="export a run's trace for ui.perfetto.dev")
    p_trace.add_argument("run_dir", help="run directory (or its trace.jsonl)")
    p_trace.add_argument("-o", "--output", default=None, help="default RUN_DIR/run.perfetto.json")
    p_trace.add_argument(
        "--max-events",
        type=int,
        default=MAX_EVENTS,
        help=f"events in the export at most (default: {MAX_EVENTS})",
    )
    p_trace.add_argument(
        "--max-events-per-track",
        type=int,
        default=MAX_EVENTS_PER_TRACK,
        help=f"events per track at most; busier tracks are thinned (default: "
        f"{MAX_EVENTS_PER_TRACK})",
    )
    p_sim = sub.add_parser("simulate", help="simulate a scenario YAML into a run directory")
    p_sim.add_argument("scenario", help="scenario YAML, e.g. configs/sim/toy.yaml")
    p_sim.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a scenario field, e.g. fleet.num_workers=8",
    )
    p_sim.add_argument(
        "--run-dir", default=None, help="output directory (default: runs/sim-NAME-YYYYmmdd-HHMMSS)"
    )
    p_sim.add_argument("--no-progress", action="store_true", help="no progress bars")
    _ownership_options(p_sim)
    p_tune = sub.add_parser("tune", help="search a scenario's settings in the simulator")
    p_tune.add_argument("scenario", help="scenario YAML, e.g. configs/sim/rlax_like_1024.yaml")
    p_tune.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a field"
    )
    p_tune.add_argument("--chips", type=int, default=None, help="chip budget to split")
    p_tune.add_argument("--seeds", type=int, default=2, help="seeds per setting (default 2)")
    p_tune.add_argument(
        "--max-mean-staleness", type=float, default=None, help="refuse settings staler than this"
    )
    p_tune.add_argument(
        "--min-goodput", type=float, default=None, help="refuse settings below this goodput"
    )
    p_tune.add_argument("--json", action="store_true", help="print the result as JSON")
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
    p_plan.add_argument("--timeout-s", type=float, default=1800.0, help="give up after (s)")
    args = parser.parse_args(argv)

    try:
        if args.command in ("train", "demo"):
            config = _config(args)
            run_dir = args.run_dir or (
                "runs/demo" if args.command == "demo" else f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
            )
            claimed = _claim(args, config, run_dir)
            if claimed is None:
                return 0
            run_job(
                config,
                claimed,
                progress=not args.no_progress,
                faults=args.faults,
                cache_dir=args.cache_dir,
            )
            if args.compact_trace:
                _compact(claimed)
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
            _eval(Path(args.run_dir), args.samples, args.seed)
        elif args.command == "plot":
            from rlaxkit.observe.plotting import plot_run

            for path in plot_run(args.run_dir, compare=args.compare, progress=not args.no_progress):
                print(path)
        elif args.command == "trace":
            from rlaxkit.observe.perfetto import export_perfetto

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
            claim = claim_run_dir(run_dir, "simulated", _scenario_dict(scenario), _choice(args))
            if claim.message:
                print(claim.message)
            if claim.action != "finished":
                simulate_job(scenario, claim.run_dir, progress=not args.no_progress)
                if args.compact_trace:
                    _compact(claim.run_dir)
        elif args.command == "tune":
            _tune(args)
        elif args.command == "plan":
            from rlaxkit.planning import load_plan_config, plan

            target = [f"target={args.target}"] if args.target else []
            planned = load_plan_config(args.config, [*args.set, *target])
            try:
                result = plan(planned, timeout_s=args.timeout_s)
            except (ImportError, TimeoutError) as err:  # the message says what to change
                raise ValueError(str(err)) from None
            print(json.dumps(result.summary()) if args.json else result.table())
    except (ValueError, FileNotFoundError, NotADirectoryError, TrainingStalled) as err:
        print(f"rlaxkit {args.command}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        why = f" ({err})" if str(err) else ""
        print(f"rlaxkit {args.command}: interrupted{why}", file=sys.stderr)
        return 130
    return 0


def _tune(args: argparse.Namespace) -> None:
    from sim.studies.tune import tune

    if args.seeds < 1:
        raise ValueError(f"--seeds: must be at least 1, got {args.seeds}")
    scenario = load_scenario_with_overrides(args.scenario, args.set)
    result = tune(
        scenario,
        chips=args.chips,
        seeds=range(args.seeds),
        max_mean_staleness=args.max_mean_staleness,
        min_goodput=args.min_goodput,
    )
    if args.json:
        summary = {
            "default": result.default.row(),
            "tuned": result.best.row(),
            "predicted_gain": result.predicted_gain,
            "uncertainty": result.uncertainty,
            "settings_simulated": len(result.evaluated),
            "skipped": result.skipped,
        }
        print(json.dumps(summary))
    else:
        print(result.table())


def _compact(run_dir: Path) -> None:
    """``--compact-trace``: a finished run's trace.jsonl gzipped (a stopped run keeps its
    plain trace, which a resumed run cuts back and appends to)."""
    from rlaxkit.rules.trace import compress_trace
    from rlaxkit.util.rundirs import run_status

    if run_status(run_dir)[0] == "finished" and (run_dir / "trace.jsonl").exists():
        before, after = compress_trace(run_dir)
        print(
            f"trace: {run_dir / 'trace.jsonl.gz'} ({before / 1e6:.1f} MB -> {after / 1e6:.1f} MB)"
        )


def _scenario_dict(scenario: Scenario) -> dict[str, Any]:
    """The scenario as ``scenario.yaml`` holds it (what a run directory is compared by)."""
    import yaml

    from sim.scenario import scenario_to_dict

    data: dict[str, Any] = yaml.safe_load(yaml.safe_dump(scenario_to_dict(scenario)))
    return data


def _eval(run_dir: Path, samples: int | None, seed: int | None) -> None:
    """Held-out pass@k of ``run_dir/final`` with the run's own evaluation settings: the
    same problems, samples and sampling seed as its summary's ``pass@1_after``."""
    from rlaxkit.evaluation import evaluate_model
    from rlaxkit.models import load_hf_checkpoint
    from rlaxkit.runtime.build import build_task
    from rlaxkit.util.rundirs import run_status

    what = "the folder `rlaxkit train` wrote (it holds config.yaml and final/)"
    if run_dir.is_file():
        raise ValueError(f"{run_dir} is a file, not a run directory: give {what}")
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml): give {what}")
    if not (run_dir / "final" / "config.json").is_file():
        status, summary = run_status(run_dir)
        why = f": {summary['reason']}" if summary.get("reason") else ""
        raise FileNotFoundError(
            f"the run in {run_dir} has no final policy (final/); it is {status}{why}. "
            f"Finish it first: rlaxkit train --run-dir {run_dir} --resume"
        )
    config = RunConfig.from_yaml(run_dir / "config.yaml")
    _, summary = run_status(run_dir)
    model, tokenizer = load_hf_checkpoint(run_dir / "final")
    if tokenizer is None:
        raise FileNotFoundError(f"{run_dir / 'final'} holds no tokenizer to decode with")
    task = build_task(config)
    n = samples or config.eval.samples
    seed = summary.get("eval_seed", EVAL_SEED) if seed is None else seed
    problems = task.problems("test", config.eval.num_problems)
    print(f"{len(problems)} held-out problems, {n} samples each, sampling seed {seed}")
    report = evaluate_model(config, task, model, tokenizer, problems=problems, n=n, seed=seed)
    print(report.table())


if __name__ == "__main__":
    sys.exit(main())
