"""``runtime.threaded_chunks``: the busy workers' chunks of a round decode at once, each
on a thread of its own, and the driver fetches and scores them in worker order. The
run is the run whose chunks decode one after another (the same metrics, the same
events in the same order, multi-turn episodes included, a fault plan replayed the same
way), and the simulator's serial host schedules its rounds the same way
(``HostSpec.threaded_chunks``)."""

import threading

import pytest
from test_runtime import SMALL, learning_metrics
from test_sim_host import COSTS, _serial
from test_worker_multiturn import RUN as MULTI_TURN

from rlaxkit.config.run import RunConfig, RuntimeConfig, small_run_config
from rlaxkit.rules.fault_plan import Fault, FaultPlan
from rlaxkit.rules.trace import MemoryTrace
from rlaxkit.runtime import Experiment
from rlaxkit.runtime.record import record_local_run
from rlaxkit.worker.host import WorkerHost
from sim import HostSpec, Uniform, fit_scenario, simulate
from sim.host_spec import HOST_COSTS

_TIMINGS = ("duration_s", "after_s", "written_s")
# ``run_start``'s config differs in the setting itself; a ``checkpoint_write`` is traced
# when the trainer next replies after the background write ends, wherever that falls.
_UNCOMPARED = ("run_start", "checkpoint_write")


def _untimed(events):
    """The events without their times, and without the kinds that differ between the two
    settings or by the clock (``_UNCOMPARED``)."""
    return [
        (e.kind, e.actor, e.version, {k: v for k, v in e.fields.items() if k not in _TIMINGS})
        for e in events
        if e.kind not in _UNCOMPARED
    ]


def _run(threaded, steps, **kwargs):
    """A run's learning metrics and trace events."""
    config = small_run_config(
        *SMALL, "staleness.max_staleness=1", f"runtime.threaded_chunks={threaded}"
    )
    with Experiment(config, **kwargs) as exp:
        exp.run(steps)
        exp.check_accounting()
        return learning_metrics(exp.history), list(exp.trace.memory.events)


def test_threaded_chunks_are_the_same_run(cache, monkeypatch):
    launched = []  # (worker, on the calling thread)
    launch = WorkerHost.launch

    def recording_launch(self, *args, **kwargs):
        on_main = threading.current_thread() is threading.main_thread()
        launched.append((self.worker.worker_id, on_main))
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(WorkerHost, "launch", recording_launch)
    threaded, threaded_events = _run("true", 4, cache_dir=cache)
    on_main = {worker for worker, main in launched if main}
    off_main = {worker for worker, main in launched if not main}
    assert on_main == {"worker-0"} and off_main == {"worker-1"}  # worker-1 on its thread
    launched.clear()
    serial, serial_events = _run("false", 4, cache_dir=cache)
    assert all(main for _, main in launched)
    assert threaded == serial
    assert _untimed(threaded_events) == _untimed(serial_events)
    # After a round's first chunk, an event times only the driver's wait and fetch.
    decodes = [e for e in threaded_events if e.kind == "decode"]
    assert {e.actor for e in decodes if e.get("pipelined")} == {"worker-1"}


def test_multi_turn_episodes_are_the_same_run_with_threaded_chunks(cache):
    # The tool steps due are resolved on the driver's thread, in worker order, before
    # the chunks launch: their ``tool_call`` events come in the same order either way.
    runs = {}
    for threaded in ("true", "false"):
        config = RunConfig.from_overrides(
            [*MULTI_TURN, "staleness.max_staleness=1", f"runtime.threaded_chunks={threaded}"]
        )
        with Experiment(config, cache_dir=cache) as exp:
            exp.run(3)
            exp.check_accounting()
            runs[threaded] = learning_metrics(exp.history), _untimed(exp.trace.memory.events)
    assert runs["true"] == runs["false"]
    assert any(event[0] == "tool_call" for event in runs["true"][1])


def test_a_fault_plan_replays_the_same_with_threaded_chunks(cache, tmp_path):
    plan = FaultPlan(
        (
            Fault(kind="preempt_worker", target="worker-1", at_s=3.0, restart_after_s=2.0),
            Fault(kind="slow_worker", target="worker-0", at_s=2.0, factor=2.0, duration_s=3.0),
            Fault(kind="preempt_trainer", at_step=3, restart_after_s=1.0),
            # Within the run on any machine: a five-step run ends 8 to 10 s into the
            # fault clock (logical seconds of rounds), a fault past its end never fires.
            Fault(kind="kill_param_server", at_s=6.0, restart_after_s=1.0),
        )
    )
    runs = {}
    for threaded in ("true", "false"):
        config = small_run_config(
            *SMALL,
            "staleness.max_staleness=1",
            f"runtime.threaded_chunks={threaded}",
            "steps=5",
            "checkpoint.every_steps=2",
        )
        with Experiment(config, run_dir=tmp_path / threaded, cache_dir=cache, faults=plan) as exp:
            exp.run()
            exp.check_accounting()
            summary = exp.summary()
            runs[threaded] = learning_metrics(exp.history), _untimed(exp.trace.memory.events)
        assert summary["steps"] == 5 and summary["accepted_lost"] == 0
        assert summary["preemptions"] == {"worker": 1, "slice": 0, "trainer": 1, "param_server": 1}
    assert runs["true"] == runs["false"]


def test_threaded_serial_host_exact_timeline():
    # Two workers of 8 slots, η = 1. Round 1: two pulls, 0.004; issue 4 groups = 16 seqs
    # x 0.0003 = 0.0048 (t = 0.0088). Both chunks start then: 0.010 + 0.004 + 8 x 0.0005
    # = 0.018 each (done at 0.0268). The host takes worker-0's at 0.0268, its host time
    # 0.0004, then worker-1's, done already (it waited 0) at 0.0272; host 0.0004
    # (t = 0.0276). Round 2: both chunks of 0.010 + 0.002 + 8 x 0.0002 = 0.0136 (done at
    # 0.0412); worker-0's scoring 0.0028 and host 0.0008 (t = 0.0448), then worker-1's
    # at 0.0448, scoring and host (t = 0.0484). Train 80 tokens / 8000 = 0.010 + step_s
    # 0.001: train_step at 0.0594; push 0.002; the buffer holds the next batch: step 2 at
    # 0.0724. One after another, worker-1's first chunk would be dispatched at 0.0268 and
    # done at 0.0448, and step 1 would come at 0.087.
    trace = MemoryTrace()
    host = HostSpec(executor="serial", chunk_steps=4, threaded_chunks=True, **COSTS)
    simulate(_serial(workers=2, eta=1, target_steps=2, host=host), trace=trace)
    chunks = [(round(e.t, 9), e.actor, round(e["duration_s"], 9), e.get("pipelined", False))
              for e in trace.events if e.kind == "decode"]  # fmt: skip
    assert chunks[:4] == [
        (0.0268, "worker-0", 0.018, False),
        (0.0272, "worker-1", 0.0, True),
        (0.0412, "worker-0", 0.0136, False),
        (0.0448, "worker-1", 0.0, True),
    ]
    steps = [e.t for e in trace.events if e.kind == "train_step"]
    assert steps == pytest.approx([0.0594, 0.0724])
    trace = MemoryTrace()
    host = HostSpec(executor="serial", chunk_steps=4, **COSTS)
    simulate(_serial(workers=2, eta=1, target_steps=1, host=host), trace=trace)
    assert [e.t for e in trace.events if e.kind == "train_step"] == pytest.approx([0.087])


def test_fit_recovers_the_threaded_serial_host_from_its_own_trace():
    # As for the host one chunk after another (tests/test_sim_host.py): the host's thread
    # sees the same gaps, and a round's first chunks fit the chunk costs.
    host = HostSpec(executor="serial", chunk_steps=4, threaded_chunks=True, **COSTS)
    truth = _serial(
        workers=2, eta=1, response=Uniform(low=1.0, high=12.0), target_steps=40, host=host
    )
    trace = MemoryTrace()
    simulate(truth, trace=trace)
    scenario, _ = fit_scenario(trace.events)
    assert scenario.host.serial and scenario.host.threaded_chunks
    for name in HOST_COSTS:
        assert getattr(scenario.host, name) == pytest.approx(COSTS[name], abs=1e-9), name


def test_threaded_chunks_settings_are_checked():
    with pytest.raises(ValueError, match="runtime.threaded_chunks: expected bool"):
        small_run_config("runtime.threaded_chunks=2")
    with pytest.raises(ValueError, match="threaded_chunks must be true or false"):
        RuntimeConfig(threaded_chunks=1)
    with pytest.raises(ValueError, match="concurrent_chunks .* unset one of them"):
        HostSpec(executor="serial", threaded_chunks=True, concurrent_chunks=True)
    # The CPU clock adds up the threads' seconds: the chunks would not overlap on it.
    with pytest.raises(ValueError, match="runtime.threaded_chunks=false, or with clock='wall'"):
        record_local_run(small_run_config(*SMALL), 1, warmup_steps=0, clock="cpu")
