"""Local runtime throughput: samples/s of ``rlaxkit.runtime.Experiment`` for η in {0,1,2,4}, and
the share of wall time spent outside jitted compute.

Two configurations, each at every η:

- ``demo`` (the headline figures): the embedded default run of ``make demo``
  (``RunConfig()``: a 4-layer, 64-wide char-level Qwen3, 32 prompts x 8 samples per
  step, 2 workers x 64 slots, GRPO on one- and two-digit sums) without its warm start;
- ``tiny`` (a stress test of the loop's Python): the 2-layer, 32-wide model of the
  tests with 4 prompts x 4 samples per step, where a whole trainer step is ~10 ms of
  compute, so every millisecond of bookkeeping shows. Its overhead is reported as
  ``tiny_overhead_fraction``; the goal is stated for the demo run, where the loop does
  the work it exists for.

Each runs the deterministic local backend for a few warm-up trainer steps, then times
``--steps`` more (demo: 8 with ``--quick``, else 30; tiny: 20, else 100).
``samples/s`` counts the samples the trainer consumed in the timed steps (batches x
group size); ``generated_per_s`` every completion the workers finished meanwhile (with
η > 0 the two differ by what the buffer holds at the start and the end).

**Compute vs overhead.** After the warm-up, each η times ``--steps`` trainer steps in
which every jitted program the loop runs is wrapped (from outside the runtime) in a
timer: the sampler's ``start_rows`` (prefill), ``decode_steps``, ``recompute_cache``,
``take_rows``, ``release_rows``, ``init_state`` and the trainer's ``train_step``. Their
summed wall time is the *jitted compute*; everything else (Python orchestration:
admission, buffer, scoring, tokenising, collation, tracing, metrics, weight pushes, and
jit dispatch outside those calls) is *overhead*: ``overhead_fraction`` = 1 - compute ÷
wall time. On XLA:CPU under ``rlaxkit.util.hostmem`` (the default on a CPU machine) a call
runs on the calling thread and returns when it is done, so a timer is the call's own
time and costs the loop nothing: compute and wall time come from the same steps
(``compute_timed_in_the_same_steps``). With asynchronous dispatch a timer must
``jax.block_until_ready`` the call's result, which stops the loop from overlapping
Python with compute; then ``--steps`` plain steps give the wall time and ``--steps``
instrumented ones after them the compute per trained sample
(``instrumented_overhead_fraction`` is the fraction inside the instrumented steps alone).
The timers include each call's own dispatch, so the compute figure is if anything an
overestimate of device time. Compilations in the timed steps (a new shape bucket) are
counted (``compile_s``: the timed calls that compiled, or XLA's compile time with
asynchronous dispatch); ``overhead_excluding_compiles`` leaves that time out, for the
steady state of a long run. Each η builds a fresh ``Experiment``; a temporary
persistent compilation cache spares the rebuilt, identical programs a second compile.
A full garbage collection runs before each build: the previous η's ``Experiment`` is
garbage by then (its parts refer to each other), and its collection is no part of the
next η's steps. Without it a 189 ms collection fell in the η = 1 run's 8 timed steps
(its figure 0.23-0.24 against 0.13-0.14 with it).
The warm-up and the timed steps of a run are one block of the run's
``FreezeAfterFullCollection`` (``with exp.collections``), as one ``exp.run()`` call of
``make demo`` is: the objects the run holds are frozen after the first full collection
and stay frozen into the timed steps. A long run's first full collection comes within
its first 30 or so steps; the warm-up ends with one (``warm_up``), so the timed steps
start where a long run is after it. Without the block and that collection, a full
collection of about 0.13 s fell in the timed steps or not by chance (one in 30 steps:
4.5 ms a step). ``full_collections_in_timed_steps`` counts those that still do.
Goal: ``overhead_fraction <= 0.10`` (the demo run).

**Overlapped.** The demo run at η = 2 also runs with ``runtime.overlap_training``
(the next batch's rounds beside each train step, ``rlaxkit.runtime.loop``) for the
same number of steps: ``overlap_speedup`` is the serial η = 2 run's wall time a step
over the overlapped run's, both from this process. Its rounds run on a helper thread
beside the train step, where timers around programs on two threads do not add up to
a share of wall time; XLA's trace of both threads does (``overlap_profiled_*``, as
the cross-check below).

**Threaded chunks.** Every run above decodes its workers' chunks one after another
(``runtime.threaded_chunks=false``): the loop on one thread, as the goal was set. The
demo run at η = 2 also runs with the default, ``runtime.threaded_chunks``, where the
chunks of a round decode at once on threads of their own: ``threaded_speedup`` is the
serial η = 2 run's wall time a step over the threaded run's, and
``threaded_profiled_overhead_fraction`` the share of its wall time in which no XLA
program executed on any thread (XLA's trace, below).

**Cross-check from XLA's own trace.** The compute figure above comes from programs
timed one at a time, from outside (and with asynchronous dispatch, from other steps
than the wall time). So the demo run at η = 2 is also measured a second way, within
one set of plain steps: they run under
``jax.profiler`` (Python tracing off), and ``profiled_overhead_fraction`` = 1 - (the
time at least one XLA program was executing: the union of the execution regions of
XLA's CPU client threads and of the ops run inline on the host thread) ÷ wall time.
The profiler slows the steps it traces (``profiled_slowdown``: traced ÷ untraced wall
time per step, the same number of steps each), which adds to this figure.
``profiled_op_overhead_fraction`` counts only the time inside XLA ops, so the XLA
runtime's own gaps between the ops of one program count as overhead there.

``--profile`` adds a cProfile of the η = 2 runs: the functions where the overhead goes.

Note: a run drops groups whose rewards are all equal by default; an untrained model fails
every problem, so the benchmark keeps them (``batching.equal_rewards=keep``) instead of
paying for a warm start: the loop does the same work either way.

Usage::

    python benchmarks/runtime.py --quick   # < 60 s on 2 cores
    python benchmarks/runtime.py           # more timed steps

The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import gc
import glob
import io
import json
import os
import pstats
import sys
import tempfile
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from jax.profiler import ProfileData  # noqa: E402

from rlaxkit.config.io import apply_overrides  # noqa: E402
from rlaxkit.config.run import RunConfig  # noqa: E402
from rlaxkit.inference import programs  # noqa: E402
from rlaxkit.runtime import Experiment  # noqa: E402
from rlaxkit.util import hostmem  # noqa: E402

GOAL_OVERHEAD = 0.10
ETAS = (0, 1, 2, 4)
DEMO = ["sft.steps=0"]  # RunConfig() is the demo run; no warm start needed here
TINY = [
    "model.config.hidden_size=32",
    "model.config.intermediate_size=64",
    "model.config.num_layers=2",
    "task.options.max_digits=1",
    "task.num_train=80",
    "sft.steps=0",
    "staleness.batch_size=4",
    "sampling.n=4",
    "runtime.slots_per_worker=16",
]
SMOKE = [*TINY, "model.config.num_layers=1", "staleness.batch_size=2", "sampling.n=2"]
_PROGRAMS = (
    "init_state",
    "start_rows",
    "decode_steps",
    "recompute_cache",
    "take_rows",
    "release_rows",
)
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class ComputeClock:
    """Sums the wall time of jitted calls (each followed by ``block_until_ready`` unless
    ``synchronous``: XLA:CPU then runs a call before it returns)."""

    def __init__(self, synchronous: bool = False) -> None:
        self.synchronous = synchronous
        self.seconds: dict[str, float] = {}
        self.compile_s = 0.0
        self.compiles = 0
        self.backend_compile_s = 0.0  # XLA's own compile time, from JAX's events
        self._lock = threading.Lock()
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration_s: float, **_: object) -> None:
        if event == _COMPILE_EVENT:
            with self._lock:
                self.compiles += 1
                self.backend_compile_s += duration_s

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            compiles, start = self.compiles, time.perf_counter()
            out = fn(*args, **kwargs)
            if not self.synchronous:
                out = jax.block_until_ready(out)
            elapsed = time.perf_counter() - start
            if self.compiles != compiles:  # tracing + compiling is not compute
                self.compile_s += elapsed
            else:
                self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
            return out

        return timed

    def reset(self) -> None:
        self.seconds, self.compile_s, self.compiles, self.backend_compile_s = {}, 0.0, 0, 0.0

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


def run_config(overrides: list[str], eta: int, steps: int) -> RunConfig:
    base = RunConfig().to_dict()
    return RunConfig.from_dict(
        apply_overrides(
            base,
            [
                *overrides,
                f"staleness.max_staleness={eta}",
                f"steps={steps}",
                "batching.equal_rewards=keep",
                # The loop on one thread, where timers around programs add up: the
                # threaded chunks are measured on their own (``threaded``).
                "runtime.threaded_chunks=false",
            ],
        )
    )


def warm_up(exp: Experiment, steps: int) -> None:
    """``steps`` steps, then a full collection: inside ``exp.collections`` the run's
    objects are frozen at the next step's end, the steady state a long run reaches at
    its first full collection."""
    exp.run(steps)
    gc.collect()


class FullCollections:
    """Counts Python's full garbage collections while active (``count``)."""

    def __init__(self) -> None:
        self.count = 0

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2:
            self.count += 1

    def reset(self) -> None:
        self.count = 0

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self._on_collection)
        return self

    def __exit__(self, *exc_info: object) -> None:
        gc.callbacks.remove(self._on_collection)


class Instrumented:
    """Wraps the sampler's programs and ``exp``'s train step in ``clock`` while active."""

    def __init__(self, clock: ComputeClock, exp: Experiment):
        self.clock, self.exp = clock, exp
        self.originals = {name: getattr(programs, name) for name in _PROGRAMS}
        self.train_step = exp.trainer.group.leader.train_step

    def __enter__(self) -> Instrumented:
        for name in _PROGRAMS:  # the engine looks these up on the module at call time
            setattr(programs, name, self.clock.wrap(name, self.originals[name]))
        self.exp.trainer.group.leader.train_step = self.clock.wrap("train_step", self.train_step)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.originals.items():
            setattr(programs, name, fn)
        self.exp.trainer.group.leader.train_step = self.train_step


def measure(config: RunConfig, clock: ComputeClock, warmup: int, steps: int, profile=None):
    """Runs ``warmup`` trainer steps, ``steps`` plain ones (timed: the wall clock a user
    sees), then ``steps`` instrumented ones (the compute); returns their figures."""
    with Experiment(config) as exp, exp.collections, FullCollections() as full:
        with Instrumented(clock, exp):  # warm-up: compiles, and a compile in a timed
            warm_up(exp, warmup)  # window below is counted
        full.reset()
        trained_at = exp.buffer.counts()["trained"]
        generated_before = sum(1 for _ in _completed(exp))
        clock.reset()
        with Instrumented(clock, exp) if clock.synchronous else contextlib.nullcontext():
            start = time.perf_counter()
            if profile is not None:
                profile.enable()
            history = exp.run(steps)
            if profile is not None:
                profile.disable()
            wall_s = time.perf_counter() - start
        samples = sum(1 for _ in _completed(exp)) - generated_before
        trained = (exp.buffer.counts()["trained"] - trained_at) * config.group_size
        trained_at = exp.buffer.counts()["trained"]
        if clock.synchronous:  # compute and wall time of the same steps
            compiles, compile_s = clock.compiles, clock.compile_s
            compute_s, instrumented_s = clock.total_s, wall_s
        else:
            # Compilations in the plain steps (XLA's time only: tracing is not in the
            # event).
            compiles, compile_s = clock.compiles, clock.backend_compile_s
            clock.reset()
            with Instrumented(clock, exp):
                start = time.perf_counter()
                history += exp.run(steps)
                instrumented_s = time.perf_counter() - start
            trained_instrumented = (exp.buffer.counts()["trained"] - trained_at) * config.group_size
            # Compute per trained sample (instrumented steps) against wall time per
            # trained sample (plain steps): each step trains the same number of samples.
            compute_s = clock.total_s * trained / trained_instrumented
        full_collections = full.count
    return {
        "wall_s": wall_s,
        "instrumented_wall_s": instrumented_s,
        "samples": samples,
        "trained_samples": trained,
        "samples_per_s": trained / wall_s,
        "generated_per_s": samples / wall_s,
        "compute_s": compute_s,
        "compute_by_program_s": dict(clock.seconds),
        "compiles": compiles,
        "compile_s": compile_s,
        "overhead_fraction": 1.0 - compute_s / wall_s,
        "instrumented_overhead_fraction": 1.0 - clock.total_s / instrumented_s,
        "same_steps": clock.synchronous,
        "full_collections": full_collections,
        "staleness_max": max(m["staleness/max"] for m in history),
    }


def _union_s(intervals: list[tuple[int, int]]) -> float:
    """Seconds covered by the union of ``(start_ns, end_ns)`` intervals."""
    total, current = 0, None
    for start, end in sorted(intervals):
        if current is None or start > current[1]:
            total += 0 if current is None else current[1] - current[0]
            current = [start, end]
        else:
            current[1] = max(current[1], end)
    return (total + (0 if current is None else current[1] - current[0])) / 1e9


def xla_busy_s(trace_dir: str) -> tuple[float, float]:
    """From a ``jax.profiler`` trace of the host: seconds in which an XLA program was
    executing (execution regions of XLA's threads, plus ops run inline on a host
    thread), and seconds in which an XLA op was executing."""
    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    regions, ops = [], []
    for plane in ProfileData.from_file(path).planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            started = None
            for event in line.events:
                if any(name == "hlo_module" for name, _ in event.stats):
                    ops.append((event.start_ns, event.start_ns + event.duration_ns))
                if event.name == "ThreadpoolListener::StartRegion":
                    started = event.start_ns
                elif event.name == "ThreadpoolListener::StopRegion" and started is not None:
                    regions.append((started, event.start_ns))
                    started = None
    return _union_s(regions + ops), _union_s(ops)


def profiled(config: RunConfig, warmup: int, steps: int) -> dict:
    """``steps`` plain steps traced by ``jax.profiler``, then ``steps`` untraced ones;
    the share of the traced wall time in which no XLA program was executing."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python tracing would slow the host far more
    gc.collect()  # the runs before this one are garbage (``run_etas``)
    with Experiment(config) as exp, exp.collections, tempfile.TemporaryDirectory() as trace_dir:
        warm_up(exp, warmup)
        jax.profiler.start_trace(trace_dir, profiler_options=options)
        start = time.perf_counter()
        exp.run(steps)
        traced_s = time.perf_counter() - start
        jax.profiler.stop_trace()
        start = time.perf_counter()
        exp.run(steps)
        untraced_s = time.perf_counter() - start
        busy_s, ops_s = xla_busy_s(trace_dir)
    return {
        "profiled_overhead_fraction": 1.0 - busy_s / traced_s,
        "profiled_op_overhead_fraction": 1.0 - ops_s / traced_s,
        "profiled_slowdown": traced_s / untraced_s,
    }


def with_runtime(config: RunConfig, **fields: bool) -> RunConfig:
    """``config`` with ``runtime.<field>`` set to each of ``fields``."""
    data = config.to_dict()
    data["runtime"].update(fields)
    return RunConfig.from_dict(data)


def with_overlap(config: RunConfig) -> RunConfig:
    """``config`` with ``runtime.overlap_training``."""
    return with_runtime(config, overlap_training=True)


def plain(config: RunConfig, warmup: int, steps: int) -> dict:
    """``steps`` plain steps of ``config``: the wall time a step. For the runs whose
    programs run on two threads at once (``runtime.overlap_training``: the rounds beside
    the train step; ``runtime.threaded_chunks``: two workers' chunks), where timers
    around programs would not add up to a share of the wall time."""
    gc.collect()  # the runs before this one are garbage (``run_etas``)
    with Experiment(config) as exp, exp.collections:
        warm_up(exp, warmup)
        start = time.perf_counter()
        history = exp.run(steps)
        wall_s = time.perf_counter() - start
    return {
        "wall_s_per_step": wall_s / steps,
        "staleness_max": max(m["staleness/max"] for m in history),
        "rounds_ahead_per_step": sum(m.get("rounds/ahead", 0) for m in history) / steps,
    }


def _completed(exp: Experiment):
    """Every finished completion so far (one ``generation_end`` trace event each)."""
    return (e for e in exp.trace.memory.events if e.kind == "generation_end")


def run_etas(name, overrides, clock, warmup, steps, profile_eta=None, etas=ETAS) -> dict[int, dict]:
    """Every η of one configuration (``etas``); prints a table row per η."""
    print(f"\n{name}:")
    header = ("eta", "samples", "wall_s", "samples/s", "compute_s", "overhead")
    print(" ".join(f"{h:>9}" for h in header))
    results = {}
    for eta in etas:
        profile = cProfile.Profile() if eta == profile_eta else None
        # The previous η's Experiment is garbage now (its parts refer to each other):
        # collected here, not by a full collection inside this η's timed steps.
        gc.collect()
        r = measure(run_config(overrides, eta, warmup + steps), clock, warmup, steps, profile)
        results[eta] = r
        print(
            f"{eta:>9} {r['samples']:>9} {r['wall_s']:>9.2f} {r['samples_per_s']:>9.1f} "
            f"{r['compute_s']:>9.2f} {r['overhead_fraction']:>9.2f}"
            + (f"  ({r['compiles']} compiles, {r['compile_s']:.2f} s)" if r["compiles"] else "")
        )
        if profile is not None:
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(40)
            print(f"\ncProfile of the η = {eta} timed steps (by cumulative time):")
            print("\n".join(out.getvalue().splitlines()[:60]))
    return results


def figures(results: dict[int, dict]) -> dict:
    """One configuration's figures over every η."""
    wall = sum(r["wall_s"] for r in results.values())
    compute = sum(r["compute_s"] for r in results.values())
    compile_s = sum(r["compile_s"] for r in results.values())
    return {
        "samples_per_s": {str(eta): r["samples_per_s"] for eta, r in results.items()},
        "generated_per_s": {str(eta): r["generated_per_s"] for eta, r in results.items()},
        "overhead_fraction": 1.0 - compute / wall,
        "overhead_excluding_compiles": 1.0 - compute / max(wall - compile_s, 1e-9),
        "overhead_fraction_by_eta": {str(e): r["overhead_fraction"] for e, r in results.items()},
        "instrumented_overhead_fraction": 1.0
        - sum(r["compute_s"] * r["instrumented_wall_s"] / r["wall_s"] for r in results.values())
        / sum(r["instrumented_wall_s"] for r in results.values()),
        "compute_by_program_s": {
            name: sum(r["compute_by_program_s"].get(name, 0.0) for r in results.values())
            for name in ("train_step", *_PROGRAMS)
        },
        "compiles_in_timed_steps": sum(r["compiles"] for r in results.values()),
        "compile_s_in_timed_steps": compile_s,
        "full_collections_in_timed_steps": sum(r["full_collections"] for r in results.values()),
        "staleness_max_by_eta": {str(e): r["staleness_max"] for e, r in results.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed steps, < 60 s")
    parser.add_argument("--smoke", action="store_true", help="tiny run (tests only)")
    parser.add_argument("--steps", type=int, default=None, help="timed demo steps per η")
    parser.add_argument("--profile", action="store_true", help="cProfile the η = 2 runs")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]  # the machine may be shared: say how busy it was
    # The smoke run (the suite's check that every path of the benchmark runs) times one
    # configuration, as both "demo" and "tiny", at η = 0 and 2: the overlapped and
    # threaded runs compare against η = 2.
    etas = (0, 2) if args.smoke else ETAS
    if args.smoke:
        configs = {"demo": (SMOKE, 2)}
    else:
        demo_steps = args.steps or (8 if args.quick else 30)
        configs = {"demo": (DEMO, demo_steps), "tiny": (TINY, 20 if args.quick else 100)}
    warmup = 1 if args.smoke else 3
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="rlaxkit-bench-"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    kept = hostmem.status()
    clock = ComputeClock(synchronous=kept is not None and kept.kept)
    print(f"devices: {jax.devices()}")
    results = {
        name: run_etas(name, overrides, clock, warmup, steps, 2 if args.profile else None, etas)
        for name, (overrides, steps) in configs.items()
    }
    demo = figures(results["demo"])
    tiny = figures(results.get("tiny", results["demo"]))
    demo_overrides, demo_steps = configs["demo"]
    cross_check = profiled(
        run_config(demo_overrides, 2, 2 * demo_steps + warmup), warmup, demo_steps
    )
    print(
        f"\ndemo, η = 2, from XLA's trace: {cross_check['profiled_overhead_fraction']:.2f} of wall "
        f"time with no XLA program executing ({cross_check['profiled_op_overhead_fraction']:.2f} "
        f"with no XLA op executing); the trace slowed the steps "
        f"{cross_check['profiled_slowdown']:.2f}x"
    )
    ahead = plain(
        with_overlap(run_config(demo_overrides, 2, demo_steps + warmup)), warmup, demo_steps
    )
    serial_s = results["demo"][2]["wall_s"] / demo_steps
    speedup = serial_s / ahead["wall_s_per_step"]
    print(
        f"\ndemo, η = 2, runtime.overlap_training: {ahead['wall_s_per_step'] * 1e3:.1f} ms a "
        f"step against {serial_s * 1e3:.1f} ms serially ({speedup:.2f}x; "
        f"{ahead['rounds_ahead_per_step']:.1f} rounds a step beside the train step, staleness "
        f"at most {ahead['staleness_max']})"
    )
    # XLA's trace sees both threads: the share of wall time with no program executing
    # on either.
    ahead_check = profiled(
        with_overlap(run_config(demo_overrides, 2, 2 * demo_steps + warmup)), warmup, demo_steps
    )
    print(
        f"demo, η = 2, overlapped, from XLA's trace: "
        f"{ahead_check['profiled_overhead_fraction']:.2f} of wall time with no XLA program "
        f"executing on either thread (the trace slowed the steps "
        f"{ahead_check['profiled_slowdown']:.2f}x)"
    )
    threaded_config = with_runtime(
        run_config(demo_overrides, 2, 2 * demo_steps + warmup), threaded_chunks=True
    )
    threaded = plain(threaded_config, warmup, demo_steps)
    threaded_speedup = serial_s / threaded["wall_s_per_step"]
    threaded_check = profiled(threaded_config, warmup, demo_steps)
    print(
        f"\ndemo, η = 2, runtime.threaded_chunks: {threaded['wall_s_per_step'] * 1e3:.1f} ms a "
        f"step against {serial_s * 1e3:.1f} ms one chunk after another "
        f"({threaded_speedup:.2f}x); from XLA's trace, "
        f"{threaded_check['profiled_overhead_fraction']:.2f} of wall time with no XLA program "
        f"executing on any thread (the trace slowed the steps "
        f"{threaded_check['profiled_slowdown']:.2f}x)"
    )
    report = {
        "quick": args.quick,
        "smoke": args.smoke,
        "timed_steps": {name: steps for name, (_, steps) in configs.items()},
        **demo,
        **cross_check,
        "overlap_wall_s_per_step": ahead["wall_s_per_step"],
        "serial_wall_s_per_step": serial_s,
        "overlap_speedup": speedup,
        "overlap_staleness_max": ahead["staleness_max"],
        "overlap_rounds_ahead_per_step": ahead["rounds_ahead_per_step"],
        **{f"overlap_{k}": v for k, v in ahead_check.items()},
        "threaded_wall_s_per_step": threaded["wall_s_per_step"],
        "threaded_speedup": threaded_speedup,
        **{f"threaded_{k}": v for k, v in threaded_check.items()},
        "tiny_overhead_fraction": tiny["overhead_fraction"],
        "tiny_overhead_excluding_compiles": tiny["overhead_excluding_compiles"],
        "tiny_samples_per_s": tiny["samples_per_s"],
        "tiny": tiny,
        "goal_overhead_fraction": GOAL_OVERHEAD,
        "compute_timed_in_the_same_steps": clock.synchronous,
    }
    print(
        f"\noverhead (outside jitted compute), demo run: {demo['overhead_fraction']:.2f} of wall "
        f"time ({demo['overhead_excluding_compiles']:.2f} without compilations; goal <= "
        f"{GOAL_OVERHEAD}); tiny run: {tiny['overhead_fraction']:.2f} "
        f"({tiny['overhead_excluding_compiles']:.2f})"
    )
    report["load_average_1m"] = [load_before, os.getloadavg()[0]]
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
