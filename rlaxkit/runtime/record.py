"""Records a run of the deterministic local runtime for the simulator to calibrate on
(``sim.calibrate``) or to be compared with. It lives with the runtime: the simulator
itself imports no runtime and no JAX."""

from __future__ import annotations

import gc
import os
import tempfile
import time
from pathlib import Path

from rlaxkit.config.run import RunConfig
from rlaxkit.rules.fault_plan import FaultPlan
from rlaxkit.rules.trace import TraceEvent
from rlaxkit.runtime.driver import Experiment
from sim.calibration.window import compiled_in_window

__all__ = ["record_local_run"]


def record_local_run(
    config: RunConfig,
    steps: int,
    *,
    warmup_steps: int,
    clock: str = "wall",
    cache_dir: str | os.PathLike | None = None,
    attempts: int = 3,
    faults: FaultPlan | None = None,
) -> tuple[list[TraceEvent], int]:
    """Runs the deterministic local runtime (``rlaxkit.runtime.Experiment``) for
    ``steps`` train steps and returns its trace, to calibrate on or compare with.

    ``clock="cpu"`` times the run by the CPU seconds of its process (all threads; so
    it needs ``runtime.threaded_chunks=false`` with more than one worker) instead of
    the wall clock: a window lasts a few tenths of a second, and on a machine
    shared with other jobs its wall time says more about them than about the run. The
    objects that exist before the run are frozen (``gc.freeze``), so that a full
    collection of a large heap (~100 ms) does not land in the window at random; the
    run's own collections still count. A run whose window compiled a program
    (``compiled_in_window``: rare shapes can first appear late) is run again, at most
    ``attempts`` times in all.

    ``faults`` injects a fault plan (``rlaxkit.rules.FaultPlan``) into the run, which
    then writes to a temporary run directory of its own: a preempted trainer restores
    from its checkpoints there. The folder is gone when the call returns. Without
    ``faults`` nothing is written, checkpoints included: to calibrate on a fault-free
    run that saves as its config says (so that the simulator charges the saves), pass
    an empty plan, ``FaultPlan()``.

    Returns:
        ``(events, runs)``: the last run's trace and how many runs it took.
    """

    class CpuClockExperiment(Experiment):
        def clock(self) -> float:
            origin = self.__dict__.setdefault("_cpu_origin_s", time.process_time())
            return time.process_time() - origin

    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock: must be 'wall' or 'cpu', got {clock!r}")
    runtime = config.runtime
    if clock == "cpu" and runtime.threaded_chunks and runtime.num_workers > 1:
        raise ValueError(
            "clock='cpu' adds up the seconds of every thread, so the workers' chunks "
            "that decode side by side (runtime.threaded_chunks) would not overlap on "
            "it: record with runtime.threaded_chunks=false, or with clock='wall'"
        )
    experiment = CpuClockExperiment if clock == "cpu" else Experiment
    runs = 0
    while True:
        runs += 1
        gc.collect()
        gc.freeze()
        try:
            with (
                tempfile.TemporaryDirectory(prefix="rlaxkit-record-") as scratch,
                experiment(
                    config,
                    run_dir=None if faults is None else scratch,
                    cache_dir=None if cache_dir is None else Path(cache_dir),
                    faults=faults,
                ) as exp,
            ):
                exp.run(steps)
                events = list(exp.trace.memory.events)
        finally:
            gc.unfreeze()
        settled = steps <= warmup_steps or not compiled_in_window(events, warmup_steps)
        if settled or runs >= attempts:
            return events, runs
