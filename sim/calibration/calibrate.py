"""Calibration: fit a scenario to a real run's trace, re-simulate, compare.

Everything is read from the ``rlaxkit.rules.trace`` schema, so a runtime trace and a
simulator trace calibrate the same way:

- ``run_start.config``: policies and fleet shape (workers, slots, group size, batch);
- ``generation_start``/``generation_end``: per-sequence latency, prompt and completion
  tokens and occupancy. Uninterrupted sequences fit, by least squares,
  ``latency = prompt_tokens / prefill_rate + tokens · (a + b · (occupancy - 1))``,
  which is the simulator's decode model; completion lengths become an empirical
  distribution (tails included);
- ``train_step``: ``duration_s = overhead + tokens / tokens_per_s`` by least squares
  (proportional to tokens when the steps' tokens vary too little to tell the two
  apart);
- ``reward``: verifier latencies (empirical); ``push``/``pull``: transfer times;
  ``drop`` with reason ``filtered``: the share of finished groups dynamic filtering
  drops;
- ``checkpoint_save``/``checkpoint_write``/``checkpoint_restore``: a save's blocking
  part (``CheckpointSpec.save_s``), the rest of what it costs the run
  (``background_s``: its background write, read from the train steps' spacing by
  :func:`sim.calibration.fits.fit_save_cost`), and a restore's duration. Every timing
  above is fitted from the time away from saves and their writes
  (:func:`sim.calibration.fits.save_spans`), so a save is charged once, by itself, and a
  prediction at another checkpoint interval charges its own saves;
- ``tool_call`` (multi-turn episodes): tool calls per episode, tool latencies and
  observation lengths as empirical distributions, completion lengths per policy turn,
  and the tool time taken out of each episode's latency before the decode fit
  (:mod:`sim.calibration.turns`);
- ``preemption``/``restart``: replayed as a FaultPlan at the same times (parallel
  fleet). A serial host replays the plan the run was given (``faults=``) on the
  runtime's logical clock, as the runtime fired it (:func:`sim.calibration.host.
  serial_fault_settings` says why the trace cannot give it back exactly).

**Two machines.** A real fleet (and the local runtime's concurrent mode) is the
*parallel* model above. The local runtime's deterministic mode runs trainer and
workers in one thread, round by round, decoding in chunks: the *serial host*
(:mod:`sim.entities.host`), fitted from the trace's ``decode`` events and the untimed host time
between chunks (:mod:`sim.calibration.host`); on the Ray placement the same rounds run
every busy worker's chunk at once (``HostSpec.concurrent_chunks``), and on the local
placement they decode at once too, with ``runtime.threaded_chunks``
(``HostSpec.threaded_chunks``: the costs are fitted the same way, from the host's
thread). The trace's config
picks one (``runtime.mode: deterministic`` on either backend is the serial host), or
``executor=`` does.

:func:`calibrate` then simulates the fitted scenario and reports predicted against
measured throughput and staleness.

**The measured window.** A real run spends time before its loop starts (warm start,
a first evaluation) and compiles its programs in the first train step and, for shapes
met there, in the first steps after it. Neither is part of the fleet the simulator
models, so both sides are measured over the same window: from the end of train step
``warmup_steps`` (or, with ``warmup_steps=0``, from the first event after
``run_start``) to the last train step. Fits use only the events of that window (a chunk
or train step that still compiled a program in it is left out of the fits, and
reported). The simulated run is cut the same way, so its pipeline fill is left out
exactly as the real one's is.
"""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

from rlaxkit.rules.fault_plan import Fault, FaultPlan
from rlaxkit.rules.policies import policy_from_dict
from rlaxkit.rules.trace import (
    MemoryTrace,
    TraceEvent,
    TraceSummary,
    durations,
    generation_records,
    read_trace,
    staleness_distribution,
)
from rlaxkit.rules.validation import check_int
from sim.calibration.extrapolation import EXTRAPOLATION_FACTOR, extrapolations
from sim.calibration.fits import (
    away_from,
    fit_decode,
    fit_length_correlation,
    fit_save_cost,
    fit_trainer,
    save_spans,
)
from sim.calibration.host import MIN_AWAY_ROWS, fault_figures, fit_host, serial_fault_settings
from sim.calibration.turns import fit_turns
from sim.calibration.window import compiled_in_window, window_start, window_summary
from sim.distributions import Constant, Empirical
from sim.engine import simulate
from sim.host_spec import HostSpec
from sim.metrics import SimResult
from sim.scenario import Scenario, with_overrides
from sim.specs import (
    CheckpointSpec,
    Executor,
    FleetSpec,
    ParamServerSpec,
    TrainerCostSpec,
    VerifierSpec,
    WorkloadSpec,
)

__all__ = [
    "EXTRAPOLATION_FACTOR",
    "Calibration",
    "calibrate",
    "compiled_in_window",
    "extrapolations",
    "fit_scenario",
    "window_start",
    "window_summary",
]

_LOG = logging.getLogger(__name__)


def _config(events: list[TraceEvent]) -> dict[str, Any]:
    for event in events:
        if event.kind == "run_start":
            return dict(event.get("config") or {})
    return {}


def _shape(config: Mapping[str, Any]) -> dict[str, Any]:
    """Fleet shape from a ``run_start`` config: the simulator's flat keys, or the
    runtime's nested ``RunConfig`` (``runtime.*``, ``sampling.*``)."""
    runtime = config.get("runtime") or {}
    sampling = config.get("sampling") or {}
    local = runtime.get("backend") == "local"
    shape = {
        "num_workers": config.get("num_workers", runtime.get("num_workers")),
        "slots_per_worker": config.get("slots_per_worker", runtime.get("slots_per_worker")),
        "group_size": config.get("group_size", sampling.get("n", 1)),
        "max_response_tokens": config.get("max_response_tokens", sampling.get("max_new_tokens")),
        "occupancy_scope": config.get("occupancy_scope", "host" if local else "worker"),
        "pauses_fleet": config.get(
            "trainer_pauses_fleet",
            local and runtime.get("mode", "deterministic") == "deterministic",
        ),
        "weight_bytes": config.get("weight_bytes"),
        # The deterministic loop runs in rounds (sim.entities.host): in one thread on the local
        # placement, with the workers' chunks at once on Ray.
        "executor": config.get(
            "host_executor",
            "serial"
            if runtime.get("backend") in ("local", "ray")
            and runtime.get("mode", "deterministic") == "deterministic"
            else "parallel",
        ),
        "concurrent_chunks": bool(
            config.get("host_concurrent_chunks", runtime.get("backend") == "ray")
        ),
        "chunk_steps": config.get("chunk_steps", runtime.get("chunk_steps", 1)),
        "overlap_training": bool(runtime.get("overlap_training", False)),
        # A trace written before the setting existed decoded one chunk after another.
        "threaded_chunks": bool(
            config.get("host_threaded_chunks", local and runtime.get("threaded_chunks", False))
        ),
        "release_after_s": config.get("release_after_s"),
    }
    for key in ("staleness", "num_workers", "slots_per_worker"):
        if (config.get(key) if key == "staleness" else shape[key]) is None:
            raise ValueError(f"trace.run_start.config.{key}: required for calibration")
    return shape


def _faults(events: list[TraceEvent]) -> FaultPlan:
    """Replay the trace's preemptions (with their measured downtime) as a FaultPlan."""
    faults = []
    for index, event in enumerate(events):
        if event.kind != "preemption":
            continue
        down = event.get("down_s")
        if down is None:
            later = (
                e for e in events[index + 1 :] if e.kind == "restart" and e.actor == event.actor
            )
            restart = next(later, None)
            down = None if restart is None else restart.t - event.t
        if event.actor == "trainer":
            faults.append(Fault(kind="preempt_trainer", at_s=event.t, restart_after_s=down))
        elif event.actor.startswith("worker-"):
            faults.append(
                Fault(kind="preempt_worker", at_s=event.t, target=event.actor, restart_after_s=down)
            )
    return FaultPlan(tuple(faults))


def _mean(values: list[float], default: float) -> float:
    return statistics.fmean(values) if values else default


def _away(events: list[TraceEvent], kind: str, spans: Sequence[tuple[float, float]]) -> list[float]:
    """Durations of ``kind``'s events away from the ``spans``, or of all of them when
    fewer than ``MIN_AWAY_ROWS`` are away."""
    timed = [e for e in events if e.kind == kind]
    seconds = [float(e["duration_s"]) for e in timed]
    away = away_from(
        spans, [e.t - s for e, s in zip(timed, seconds, strict=True)], [e.t for e in timed]
    )
    kept = [s for s, keep in zip(seconds, away, strict=True) if keep]
    return kept if len(kept) >= MIN_AWAY_ROWS else seconds


def fit_scenario(
    trace: Iterable[TraceEvent] | str | os.PathLike,
    *,
    name: str = "calibrated",
    warmup_steps: int = 0,
    executor: Executor | None = None,
    faults: FaultPlan | None = None,
    length_correlation: bool = False,
) -> tuple[Scenario, dict[str, float]]:
    """A scenario fitted to ``trace``, and the fitted timing parameters.

    The trace must hold a ``run_start`` event whose ``config`` has the policies
    (``staleness``, ``weight_sync``, ``checkpoint``) and the fleet shape, either as the
    simulator writes it (:func:`sim.engine.run_config`: ``num_workers``,
    ``slots_per_worker``, ``group_size``, ...) or as the runtime's ``RunConfig`` dict
    (``runtime.num_workers``, ``runtime.slots_per_worker``, ``sampling.n``, ...). A
    local deterministic backend shares its device between trainer and workers, so the
    train-step time inside each generation is taken out before fitting decode times.
    Timings are fitted on the window after ``warmup_steps`` train steps (compilation
    and pipeline fill left out); lengths and counts use the whole trace.

    ``executor`` picks the model: ``serial`` (:mod:`sim.entities.host`, fitted by
    :mod:`sim.calibration.host` from the trace's ``decode`` events) or ``parallel`` (the
    per-token fleet). By default it is ``serial`` when the config says the run was the
    deterministic loop (local, or Ray with ``concurrent_chunks``; or a simulated serial
    host), else ``parallel``.

    ``faults``: the FaultPlan the run was given. The serial host replays it on the
    runtime's logical clock (``runtime.round_s``, ``restart_s`` and
    ``workers_per_slice`` from the config) and needs it when the trace records
    preemptions; the parallel fleet replays the trace's preemptions at their times
    unless a plan is given.

    ``length_correlation``: also fit how alike a group's lengths are
    (``WorkloadSpec.length_correlation``, :func:`sim.calibration.fits.fit_length_correlation`).
    Off by default: on the runtime's η = 1 → η = 0 check
    (``tests/test_sim_calibrate_runtime.py``) the tiny model's groups read ρ ≈ 0.85 and
    the prediction came out further off (median −0.29 against within ±0.25 without), so
    it stays a choice until the accuracy card shows where it helps.
    """
    events = _load(trace)
    fit_correlation = length_correlation  # the name is the fitted value's below
    config = _config(events)
    shape = _shape(config)
    executor = executor or shape["executor"]
    if executor not in get_args(Executor):
        raise ValueError(f"executor: must be one of {get_args(Executor)}, got {executor!r}")
    start_s = window_start(events, warmup_steps) if warmup_steps else float("-inf")
    spans = save_spans(events)  # saves and their writes: charged apart from the rest
    host = HostSpec()
    host_fitted: dict[str, float] = {}
    plan = _faults(events) if faults is None else faults
    fault_clock: dict[str, Any] = {}
    if executor == "serial":
        if shape["overlap_training"]:
            raise ValueError(
                "trace: the run overlapped training with its rounds "
                "(runtime.overlap_training), and the serial host's costs are fitted from "
                "one thread's time line; calibrate on a trace of the same config with "
                "overlap_training=false, then simulate its scenario with "
                "host.overlap_training=True (or calibrate with executor='parallel')"
            )
        host, host_fitted = fit_host(
            events,
            chunk_steps=int(shape["chunk_steps"]),
            start_s=start_s,
            concurrent=bool(shape["concurrent_chunks"]),
            threaded=shape["threaded_chunks"],
            spans=spans,
            slots_per_worker=int(shape["slots_per_worker"]),
        )
        plan, fault_clock = serial_fault_settings(events, config, faults)
    turns = fit_turns(events)
    decode = fit_decode(
        events, pauses_fleet=bool(shape["pauses_fleet"]), start_s=start_s, adjust=turns.adjust
    )
    trainer = fit_trainer(events, start_s, spans)
    records = generation_records(events)
    lengths = turns.response_tokens or Empirical(values=tuple(r.tokens for r in records))
    # Single-turn groups: how alike a group's lengths are (multi-turn episodes keep
    # per-turn draws, fitted by fit_turns).
    correlation = None
    if fit_correlation and not turns.response_tokens and int(shape["group_size"]) > 1:
        correlation = fit_length_correlation(records)
    prompts = [r.prompt_tokens for r in records if r.prompt_tokens is not None]
    # Transfer and reward times from the window too (a first push or pull may compile),
    # away from saves where enough are; checkpoints are rare, so all of them count.
    window = [e for e in events if e.t > start_s]
    rewards, pushes, pulls = (_away(window, kind, spans) for kind in ("reward", "push", "pull"))
    weight_bytes = float(shape["weight_bytes"] or 1.0)
    staleness = policy_from_dict("staleness", config["staleness"])
    steps = [e for e in events if e.kind == "train_step"]
    end_s = max(e.t for e in events)
    # Dynamic filtering: groups dropped for equal rewards, out of all groups that
    # finished (trained, waiting, or dropped for any reason after finishing), in the
    # window: the share grows as the policy learns to solve more prompts every time.
    filtered = sum(1 for e in window if e.kind == "drop" and e.get("reason") == "filtered")
    finished = len(
        {str(e["rollout"]) for e in window if e.kind == "generation_end" and "rollout" in e.fields}
    )
    filtered_fraction = min(filtered / finished, 0.95) if finished else 0.0
    # Saves in the window (a run's first save, before its loop, costs more); a run
    # without restores is assumed to restore in the time it saves.
    saves = durations(window, "checkpoint_save") or durations(events, "checkpoint_save")
    save_s = _mean(saves, 0.0)
    restore_s = _mean(durations(events, "checkpoint_restore"), save_s)
    # The rest of a save's cost to the run, its background write: the fitted costs
    # above leave it out. Over how long the write spreads it: the writes in the window.
    whole = fit_save_cost(events, start_s)
    background = None if whole is None else max(0.0, whole - save_s)
    write_s = _mean(durations(window, "checkpoint_write"), 0.0)
    fitted = {
        **decode,
        "trainer_tokens_per_s": trainer["tokens_per_s"],
        "step_overhead_s": trainer["step_overhead_s"],
        "trainer_compiling_steps": trainer["compiling_steps"],
        "mean_response_tokens": lengths.mean(),
        **({} if correlation is None else {"length_correlation": correlation}),
        "reward_s": _mean(rewards, 0.0),
        "save_s": save_s,
        **({} if background is None else {"save_background_s": background}),
        "save_write_s": write_s,
        "push_s": _mean(pushes, 0.0),
        "pull_s": _mean(pulls, 0.0),
        "filtered_fraction": filtered_fraction,
        "mean_tool_calls": turns.turns.mean(),
        "mean_tool_s": turns.tool_latency_s.mean(),
        **host_fitted,
    }
    scenario = Scenario(
        name=name,
        trainer=TrainerCostSpec.from_rate(
            tokens_per_s=trainer["tokens_per_s"],
            step_overhead_s=trainer["step_overhead_s"],
            pauses_fleet=bool(shape["pauses_fleet"]),
        ),
        fleet=FleetSpec(
            num_workers=int(shape["num_workers"]),
            slots_per_worker=int(shape["slots_per_worker"]),
            decode_s_per_token=decode["decode_s_per_token"],
            decode_s_per_token_per_seq=decode["decode_s_per_token_per_seq"],
            prefill_tokens_per_s=decode["prefill_tokens_per_s"],
            occupancy_scope=shape["occupancy_scope"],
            release_after_s=shape["release_after_s"],
        ),
        param_server=ParamServerSpec(
            weight_bytes=weight_bytes,
            push_bytes_per_s=weight_bytes / fitted["push_s"] if fitted["push_s"] > 0 else 1e30,
            pull_bytes_per_s=weight_bytes / fitted["pull_s"] if fitted["pull_s"] > 0 else 1e30,
        ),
        verifier=VerifierSpec(
            latency_s=Empirical(values=tuple(rewards)) if rewards else Constant(value=0.0)
        ),
        checkpoint=CheckpointSpec(
            save_s=save_s, background_s=background or 0.0, write_s=write_s, restore_s=restore_s
        ),
        workload=WorkloadSpec(
            prompts_per_step=staleness.batch_size,
            group_size=int(shape["group_size"]),
            prompt_tokens=Empirical(values=tuple(prompts)) if prompts else Constant(value=0.0),
            response_tokens=lengths,
            length_correlation=correlation,
            max_response_tokens=shape["max_response_tokens"],
            filtered_fraction=filtered_fraction,
            turns=turns.turns,
            tool_latency_s=turns.tool_latency_s,
            observation_tokens=turns.observation_tokens,
        ),
        staleness=staleness,
        weight_sync=policy_from_dict("weight_sync", config.get("weight_sync", {})),
        checkpointing=policy_from_dict("checkpoint", config.get("checkpoint", {})),
        host=host,
        fault_plan=plan,
        target_steps=sum(1 for e in steps if not e.discarded) or None,
        horizon_s=max(2.0 * end_s, 1.0),
    )
    return with_overrides(scenario, fault_clock), fitted


# The fewest train steps a calibration's prediction simulates (see ``calibrate``).
MIN_SIMULATED_STEPS = 200


@dataclass(frozen=True)
class Calibration:
    """A fitted scenario, what the trace measured, and what the fitted model predicts.

    ``scenario`` is the fitted scenario (overrides applied) with the trace's number of
    steps; ``predicted`` is that scenario simulated for ``simulated_steps`` steps (see
    :func:`calibrate`) and ``predicted_window`` the same window of that simulation as
    ``measured`` is of the trace.
    """

    scenario: Scenario
    fitted: dict[str, float]
    measured: TraceSummary
    measured_staleness: dict[int, int]
    predicted: SimResult
    predicted_window: TraceSummary
    measured_figures: dict[str, float] = field(default_factory=dict)
    predicted_figures: dict[str, float] = field(default_factory=dict)
    extrapolations: tuple[str, ...] = ()

    @property
    def measured_mean_staleness(self) -> float:
        total = sum(self.measured_staleness.values())
        return sum(k * n for k, n in self.measured_staleness.items()) / total if total else 0.0

    def errors(self) -> dict[str, float]:
        """Relative errors (predicted / measured - 1) of the headline figures."""
        measured, predicted = self.measured, self.predicted_window
        return {
            "samples_per_s": float(predicted.samples_per_s / measured.samples_per_s - 1.0),
            "tokens_per_s": float(predicted.tokens_per_s / max(measured.tokens_per_s, 1e-12) - 1),
            "mean_staleness_abs": float(
                self.predicted.mean_staleness - self.measured_mean_staleness
            ),
        }

    def figure_errors(self) -> dict[str, float]:
        """Per :func:`~sim.calibration.host.fault_figures` figure: predicted / measured - 1
        (``_abs``: predicted - measured, for staleness in versions and for counts the
        run measured as zero)."""
        out = {}
        for name, measured in self.measured_figures.items():
            predicted = self.predicted_figures[name]
            if name.startswith("staleness") or measured == 0:
                out[f"{name}_abs"] = predicted - measured
            else:
                out[name] = predicted / measured - 1.0
        return out

    def report(self) -> str:
        """Predicted vs measured, one line per figure (throughput over the window)."""
        m, p = self.measured, self.predicted_window
        rows = [
            ("samples/s", m.samples_per_s, p.samples_per_s),
            ("tokens/s", m.tokens_per_s, p.tokens_per_s),
            ("mean staleness", self.measured_mean_staleness, self.predicted.mean_staleness),
            ("steps", m.steps, p.steps),
        ]
        lines = [f"{'figure':>16} {'measured':>12} {'predicted':>12}"]
        lines += [f"{label:>16} {a:>12.4g} {b:>12.4g}" for label, a, b in rows]
        lines += [f"extrapolated: {what}" for what in self.extrapolations]
        chunks = self.fitted.get("host_compiling_chunks", 0)
        steps = self.fitted.get("trainer_compiling_steps", 0)
        if chunks or steps:
            lines.append(
                f"(the window holds {chunks:.0f} chunks and {steps:.0f} train steps that "
                "compiled a program: measured, not predicted; measure after more "
                "warmup_steps or over a longer run)"
            )
        return "\n".join(lines)


def calibrate(
    trace: Iterable[TraceEvent] | str | os.PathLike,
    *,
    overrides: Mapping[str, Any] | None = None,
    seed: int = 0,
    warmup_steps: int = 3,
    executor: Executor | None = None,
    simulated_steps: int | None = None,
    faults: FaultPlan | None = None,
    repeats: int = 1,
) -> Calibration:
    """Fit ``trace``, re-simulate the fitted scenario, compare with the measurement.

    Args:
        trace: Events or a JSONL path (runtime or simulator, same schema).
        overrides: Dotted-path changes applied to the fitted scenario before
            simulating (predict a different configuration from the same fit).
        seed: Seed of the re-simulation.
        warmup_steps: train steps left out of the fit and of both throughputs (a real
            run compiles in its first step, and in the next few for shapes it meets
            then; see the module docstring).
        executor: ``serial`` or ``parallel`` model (default: from the trace's
            config; see :func:`fit_scenario`).
        simulated_steps: train steps the prediction simulates (default: the
            trace's, but at least ``MIN_SIMULATED_STEPS``). A short real run makes its
            random draws (lengths, which groups filtering drops) once; a longer
            simulated run averages them out, so its window measures the expected
            throughput. ``Calibration.scenario`` keeps the trace's length. With a
            fault plan, or saves that cost time, the default is the trace's length:
            faults and saves fire at fixed times and steps, and a longer run would
            hold another share of them than the measured window (saves every 10
            steps: 2 in the window of a 30-step run after 3 warm-up steps, 20 in that
            of a 200-step one).
        faults: The FaultPlan the run was given (see :func:`fit_scenario`).
        repeats: Simulations (seeds ``seed, seed + 1, ...``) whose
            ``predicted_figures`` are averaged: a short run's cost of a fault depends
            on what its draws put in flight when it fires.
    """
    events = _load(trace)
    check_int("repeats", repeats, minimum=1)
    fitted_scenario, fitted = fit_scenario(
        events, warmup_steps=warmup_steps, executor=executor, faults=faults
    )
    scenario = with_overrides(fitted_scenario, {**(overrides or {}), "seed": seed})
    beyond = extrapolations(events, fitted_scenario, scenario)
    for what in beyond:
        _LOG.warning("sim.calibrate: the prediction extrapolates: %s", what)
    steps = scenario.target_steps or 0
    if simulated_steps is None:
        policy, costs = scenario.checkpointing, scenario.checkpoint
        saves = (policy.every_steps or policy.every_s) and (costs.save_s or costs.background_s)
        floor = 1 if len(scenario.fault_plan) or saves else MIN_SIMULATED_STEPS
        simulated_steps = max(steps, floor)
    longer = with_overrides(
        scenario,
        {
            "target_steps": simulated_steps,
            "horizon_s": scenario.horizon_s * max(1.0, simulated_steps / max(steps, 1)),
        },
    )
    group_size = longer.workload.group_size
    simulated = MemoryTrace()
    predicted = simulate(longer, trace=simulated)
    figures = [_figures(simulated.events, warmup_steps, group_size)]
    for repeat in range(1, repeats):
        again = MemoryTrace()
        simulate(with_overrides(longer, {"seed": seed + repeat}), trace=again)
        figures.append(_figures(again.events, warmup_steps, group_size))
    return Calibration(
        scenario=scenario,
        fitted=fitted,
        measured=window_summary(events, warmup_steps),
        measured_staleness=staleness_distribution(events),
        predicted=predicted,
        predicted_window=window_summary(simulated.events, warmup_steps),
        measured_figures=_figures(events, warmup_steps, group_size),
        predicted_figures={k: statistics.fmean(f[k] for f in figures) for k in figures[0]},
        extrapolations=tuple(beyond),
    )


def _figures(events: list[TraceEvent], warmup_steps: int, group_size: int) -> dict[str, float]:
    return fault_figures(events, window_start(events, warmup_steps), group_size)


def _load(trace: Iterable[TraceEvent] | str | os.PathLike) -> list[TraceEvent]:
    if isinstance(trace, str | os.PathLike):
        return read_trace(trace)
    return list(trace)
