"""The Ray backend: same results as the local backend; it heals worker, parameter-server
and trainer deaths; the fleet grows and shrinks mid-run under the staleness policy; the
same config and the same ``rlaxkit train`` job run on it."""

import dataclasses
import json
import subprocess
import sys

import pytest
from test_runtime import SMALL, learning_metrics

from rlaxkit.cli import run_job
from rlaxkit.config.io import apply_overrides
from rlaxkit.config.run import RunConfig, small_run_config
from rlaxkit.observe.metrics import read_metrics
from rlaxkit.rules.trace import read_trace
from rlaxkit.runtime import Experiment

ray = pytest.importorskip("ray")

from rlaxkit.config.ray import ActorResources, RayConfig, small_cluster_config  # noqa: E402
from rlaxkit.runtime import RayExperiment  # noqa: E402

pytestmark = pytest.mark.ray

STEPS = 4


@pytest.fixture(scope="module")
def local_run(cache):
    """The local backend's reference: learning metrics and trained prompts per step (and
    its summary's keys)."""
    with Experiment(small_run_config(*SMALL, f"steps={STEPS}"), cache_dir=cache) as exp:
        trained = []
        for _ in range(STEPS):
            exp.step()
            trained.append(sorted(g.group_id for g in exp.last_batch["groups"]))
        assert exp.run() == []  # run() runs to config.steps, not config.steps more
        return learning_metrics(exp.history), trained, exp.summary().keys()


def ray_config(**changes):
    return small_cluster_config(**changes)


def comparable(history):
    """Learning metrics without the Ray backend's fleet size."""
    return [
        {k: v for k, v in m.items() if not k.startswith("fleet/")}
        for m in learning_metrics(history)
    ]


def assert_same_metrics(history, reference):
    """Every step's learning metrics equal the reference's (names the first that differ)."""
    got = comparable(history)
    assert len(got) == len(reference)
    for step, (a, b) in enumerate(zip(got, reference, strict=True), start=1):
        differ = {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
        assert not differ, f"step {step}: (ray, local) = {differ}"


def events(exp, kind, actor=None, after=0.0):
    return [
        e
        for e in exp.trace.memory.events
        if e.kind == kind and (actor is None or e.actor == actor) and e.t >= after
    ]


def until_in_flight(exp, worker=None):
    """Advances round by round (stepping when nothing moves) until ``worker`` (any
    worker when ``None``) has prompts in flight; returns that worker."""
    for _ in range(100):
        busy = [w for w in exp.workers if w.in_flight and worker in (None, w)]
        if busy:
            return busy[0]
        if not exp.round():
            exp.step()
    raise AssertionError("no worker ever had prompts in flight")


def test_two_worker_actors_learn_exactly_as_the_local_backend(ray_cluster, cache, local_run):
    local_metrics, local_trained, local_summary = local_run
    config = small_run_config(*SMALL, "runtime.backend=ray", f"steps={STEPS}")
    with RayExperiment(config, cache_dir=cache, ray_config=ray_config()) as exp:
        trained = []
        for _ in range(STEPS):
            exp.step()
            trained.append(sorted(g.group_id for g in exp.last_batch["groups"]))
            exp.check_accounting()
        assert trained == local_trained
        assert_same_metrics(exp.history, local_metrics)
        # One behaviour on both placements: run() runs to config.steps, the same summary.
        assert exp.run() == [] and exp.version == STEPS
        assert exp.summary().keys() == local_summary and exp.summary()["backend"] == "ray"
        # Both worker actors generated and pulled weights from the object store.
        assert {e.actor for e in events(exp, "generation_end")} == {"worker-0", "worker-1"}
        assert {e.actor for e in events(exp, "pull")} == {"worker-0", "worker-1"}
        assert [e.version for e in events(exp, "push")] == list(range(STEPS + 1))
        keep = config.runtime.keep_versions
        assert exp.parts.store.versions() == list(range(STEPS + 1))[-keep:]  # bounded
        report = exp.evaluate(num_problems=4, samples=2)
        assert 0.0 <= report.rows[0]["pass@k"] <= 1.0


def test_worker_schedule_scales_the_fleet_from_the_config(ray_cluster, cache):
    with pytest.raises(ValueError, match="worker_schedule"):
        ray_config(worker_schedule=((2, 1), (2, 3)))  # steps must increase
    with pytest.raises(ValueError, match="worker_schedule"):
        ray_config(worker_schedule=((1, 0),))
    config = small_run_config(*SMALL, "runtime.backend=ray", "runtime.chunk_steps=1")
    # The YAML/CLI path: --set 'ray.worker_schedule=[[1, 1], [2, 3]]'.
    settings = RunConfig.from_dict(
        apply_overrides(config.to_dict(), ["ray.worker_schedule=[[1, 1], [2, 3]]"])
    ).ray
    assert settings.worker_schedule == ((1, 1), (2, 3))
    settings = dataclasses.replace(ray_config(), worker_schedule=settings.worker_schedule)
    with RayExperiment(config, cache_dir=cache, ray_config=settings) as exp:
        sizes = []
        for _ in range(3):
            exp.step()
            sizes.append(len(exp.workers))
            exp.check_accounting()
        assert sizes == [1, 3, 3]
        assert exp.buffer.counts()["trained"] == 3 * config.staleness.batch_size


def test_killed_worker_is_detected_its_prompts_reissued_and_the_fleet_is_elastic(
    ray_cluster, cache
):
    # One decode step per round, so prompts stay in flight across rounds.
    config = small_run_config(*SMALL, "runtime.backend=ray", "runtime.chunk_steps=1")
    eta = config.staleness.max_staleness
    # Weights through the TensorStore store here (the object store elsewhere).
    settings = ray_config(replace_dead_workers=False, weight_store="tensorstore")
    with RayExperiment(config, cache_dir=cache, ray_config=settings) as exp:
        exp.run(1)
        victim = until_in_flight(exp)
        lost = set(victim.in_flight)
        survivors = [w.worker_id for w in exp.workers if w is not victim]
        ray.kill(victim.handle)
        killed_at = exp.clock()
        exp.round()  # The next call to the dead actor finds out.
        assert [w.worker_id for w in exp.workers] == survivors
        exp.run(2)
        (preemption,) = events(exp, "preemption", victim.worker_id)
        assert preemption["reissued"] == len(lost)
        exp.check_accounting()
        newcomer = exp.scale_workers(2)  # Add one back...
        until_in_flight(exp, newcomer)
        moved = set(newcomer.in_flight)
        exp.scale_workers(1)  # ...and take it away again, mid-generation.
        exp.run(2)
        assert [w.worker_id for w in exp.workers] == survivors
        (preemption,) = events(exp, "preemption", newcomer.worker_id)
        assert preemption["reason"] == "scaled_down"
        # Every actor's start is timed, the newcomer's too (the simulator's
        # host.worker_start_s): from its start to its constructor's end.
        started = {e.actor: e["duration_s"] for e in events(exp, "worker_start")}
        assert {*survivors, victim.worker_id, newcomer.worker_id} <= set(started)
        assert all(0 < s < 600 for s in started.values())
        exp.check_accounting()
        counts = exp.buffer.counts()
        assert counts["trained"] == exp.version * config.staleness.batch_size
        assert "preempted" not in counts["dropped_by_reason"]
        # Every lost prompt was generated again with its old id and is on the books.
        regenerated = {e["rollout"] for e in events(exp, "generation_start", after=killed_at)}
        assert lost | moved <= regenerated
        buffered = {g["group_id"] for g in exp.buffer.state_dict()["ready"]}
        held = {g for w in exp.workers for g in w.in_flight}
        books = exp.buffer.trained | buffered | held | set(exp.buffer.dropped)
        assert lost | moved <= books
        assert max(m["staleness/max"] for m in exp.history) <= eta


def test_parameter_server_and_trainer_restarts_heal_without_changing_results(
    ray_cluster, cache, local_run, tmp_path
):
    """Kill the parameter server, then the trainer: workers get weights again, the
    trainer resumes from its checkpoint, and every metric equals the local run's."""
    local_metrics, _, _ = local_run
    config = small_run_config(*SMALL, "runtime.backend=ray", "checkpoint.every_steps=2")
    with RayExperiment(config, run_dir=tmp_path, cache_dir=cache, ray_config=ray_config()) as exp:
        exp.run(1)
        exp.parts.kill_store()
        ps_killed_at, ps_version = exp.clock(), exp.version
        exp.run(2)
        # Whichever finds it empty first records the restart: the next round of the
        # driver, or the trainer's next push when that step's batch needs no round
        # (which depends on the sampled rollouts, so on the CPU's float rounding).
        (restart,) = events(exp, "restart", "param_server")
        assert restart.version is None  # It came back empty...
        pulls = events(exp, "pull", after=ps_killed_at)
        assert {e.actor for e in pulls} == {"worker-0", "worker-1"}  # ...and served again,
        assert exp.parts.store.latest_version() == exp.version  # every later version too.
        # Every pull after the kill is of a version published after it or re-published
        # to the restarted server.
        assert all(ps_version <= e.version <= exp.version for e in pulls)
        ray.kill(exp.trainer.group.leader, no_restart=False)  # Its last checkpoint is step 2 of 3.
        exp.run(STEPS - 3)
        (restart,) = events(exp, "restart", "trainer")
        assert restart["lost_steps"] == 1
        (restore,) = events(exp, "checkpoint_restore", "trainer")
        assert restore["step"] == 2
        assert exp.parts.store.latest_version() == exp.version
        assert_same_metrics(exp.history, local_metrics)
        exp.check_accounting()
        summary = exp.summary()  # The replayed step's first run is lost compute.
        assert summary["lost_steps"] == 1 and summary["lost_train_s"] > 0
        assert summary["restarts"]["trainer"] == 1 and summary["restarts"]["param_server"] >= 1
        assert len(exp.books.useful_train_s) == exp.version and summary["accepted_lost"] == 0


def test_bad_ray_settings_fail_early():
    with pytest.raises(ValueError, match="weight_store"):
        RayConfig(weight_store="nfs")
    with pytest.raises(ValueError, match="num_gpus"):
        ActorResources(num_gpus=-1)
    with pytest.raises(ValueError, match="runtime.mode 'concurrent' is not available"):
        Experiment(small_run_config(*SMALL, "runtime.backend=ray", "runtime.mode=concurrent"))


def test_a_request_no_node_can_hold_is_refused_naming_the_field():
    """Ray keeps an actor whose request no node holds pending for ever: a trainer asking
    for 1 000 CPUs waited without end, and workers asking for a resource no node has
    waited ``worker_start_wait_s`` (300 s) before the loop called itself stalled."""
    from rlaxkit.config.ray import infeasible_requests

    nodes = [{"CPU": 8.0, "node:10.0.0.1": 1.0, "memory": 1e9}, {"CPU": 4.0, "GPU": 1.0}]
    assert infeasible_requests(RayConfig(trainer=ActorResources(num_gpus=1)), nodes) == []
    assert infeasible_requests(RayConfig(worker=ActorResources(resources={"TPU": 4})), nodes) == [
        "ray.worker.resources: no node has 'TPU' (the nodes have ['CPU', 'GPU']); Ray would "
        "keep the worker actor pending for ever"
    ]
    (trainer,) = infeasible_requests(
        RayConfig(trainer=ActorResources(num_cpus=6, num_gpus=1)), nodes
    )  # 6 CPUs on one node, a GPU on another: no node holds both
    assert trainer.startswith("ray.trainer: one actor asks for {'CPU': 6, 'GPU': 1}")
    tensorstore = RayConfig(weight_store="tensorstore", param_server=ActorResources(num_cpus=99))
    assert infeasible_requests(tensorstore, nodes) == []  # no parameter-server actor then
    assert infeasible_requests(RayConfig(trainer=ActorResources(num_cpus=99)), []) == []


def test_the_ray_placement_refuses_an_infeasible_request_before_any_actor(ray_cluster, cache):
    config = small_run_config(*SMALL, "runtime.backend=ray", "steps=1")
    bad = ray_config(worker=ActorResources(num_cpus=0.25, resources={"bogus": 1}))
    with pytest.raises(ValueError, match=r"ray\.worker\.resources: no node has 'bogus'"):
        Experiment(config, cache_dir=cache, ray_config=bad)
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if "rlaxkit" in a]


# Actors that fit the 2-CPU test cluster, set in the run config itself.
SMALL_ACTORS = ("ray.trainer.num_cpus=0.25", "ray.worker.num_cpus=0.25")


def test_ray_settings_live_in_the_run_config_and_round_trip_through_yaml(tmp_path):
    config = small_run_config(
        *SMALL,
        "runtime.backend=ray",
        "ray.address=auto",
        "ray.weight_store=tensorstore",
        "ray.worker.resources={TPU: 4}",
        "ray.trainer.num_gpus=0.5",
        "ray.max_worker_replacements=2",
    )
    assert config.ray.worker == ActorResources(num_cpus=1.0, resources={"TPU": 4})
    config.save(tmp_path / "c.yaml")
    assert RunConfig.from_yaml(tmp_path / "c.yaml") == config
    assert "TPU: 4" in (tmp_path / "c.yaml").read_text()
    with pytest.raises(ValueError, match=r"config\.ray\.worker: num_cpus: must be a number"):
        small_run_config(*SMALL, "ray.worker.num_cpus=-1")
    with pytest.raises(ValueError, match=r"config\.ray: unknown field\(s\) \['gpus'\]"):
        small_run_config(*SMALL, "ray.gpus=1")


def test_importing_the_runtime_does_not_import_ray():
    code = (
        "import sys, rlaxkit.runtime, rlaxkit.config.run; "
        "assert 'ray' not in sys.modules, 'ray imported'; "
        "from rlaxkit.runtime.ray_placement import start_ray; assert 'ray' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_train_job_runs_the_same_config_on_ray(ray_cluster, cache, tmp_path):
    """``rlaxkit.cli.run_job`` picks RayExperiment from runtime.backend, places its
    actors per ``config.ray`` (here: TensorStore weights) and writes a full run dir."""
    config = small_run_config(
        *SMALL, "runtime.backend=ray", "steps=2", "ray.weight_store=tensorstore", *SMALL_ACTORS
    )
    run = tmp_path / "run"
    lines = []
    summary = run_job(config, run, progress=False, log=lines.append, cache_dir=cache)
    assert any("ray backend" in line for line in lines)
    assert any((run / "weights").iterdir())  # config.ray.weight_store was used
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [1, 2]
    kinds = [e.kind for e in read_trace(run / "trace.jsonl")]
    assert {"run_start", "generation_end", "train_step", "push", "pull"} <= set(kinds)
    assert kinds[-1] == "run_end"
    saved = json.loads((run / "summary.json").read_text())
    assert saved["backend"] == "ray" and saved["steps"] == 2
    assert saved["accepted_lost"] == 0 and saved["lost_steps"] == 0
    assert 0 < saved["goodput"] <= 1 and saved["useful_train_s"] > 0
    assert saved["buffer"]["trained"] == 2 * config.staleness.batch_size
    assert 0 <= summary["pass@1_after"] <= 1
    assert (run / "final" / "config.json").exists()
    assert RunConfig.from_yaml(run / "config.yaml") == config
    # The directory holds a run now: resumed by default (tests/test_ray_resume.py), and
    # refused, before anything starts, with resume=False.
    with pytest.raises(ValueError, match="already holds a run and resume=False"):
        RayExperiment(config, run_dir=run, resume=False)


# One plan for both placements: a worker, a slice, the trainer and the parameter server;
# the trainer again right after the last step (it restores and takes step 5 again).
PLAN = [
    {"kind": "preempt_worker", "target": "worker-0", "at_step": 1, "restart_after_s": 1.0},
    {"kind": "kill_param_server", "at_step": 2, "restart_after_s": 1.0},
    {"kind": "preempt_slice", "target": "slice-0", "at_s": 4.0, "restart_after_s": 1.0},
    {"kind": "preempt_trainer", "at_step": 3, "restart_after_s": 1.0},
    {"kind": "preempt_trainer", "at_step": 5, "restart_after_s": 1.0},
]


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_one_fault_plan_runs_on_both_placements_and_loses_nothing_accepted(
    backend, ray_cluster, cache, tmp_path
):
    config = small_run_config(
        *SMALL,
        f"runtime.backend={backend}",
        "steps=5",
        "checkpoint.every_steps=2",
        "runtime.round_s=1",
        "runtime.workers_per_slice=2",
    )
    extra = {"ray_config": ray_config()} if backend == "ray" else {}
    with Experiment(config, run_dir=tmp_path, cache_dir=cache, faults=PLAN, **extra) as exp:
        exp.run()
        exp.check_accounting()
        summary = exp.summary()
        preempted = {e.actor for e in events(exp, "preemption")}
        (outage,) = events(exp, "fault", "param_server")
        pushes = [e.version for e in events(exp, "push", after=outage.t)]
    assert summary["steps"] == 5 and summary["accepted_lost"] == 0
    # Steps 3 and 5: the trainer restored checkpoints 2 and 4 and took them again.
    assert summary["lost_steps"] == 2 and summary["restarts"]["trainer"] == 2
    assert [f["index"] for f in summary["faults"]["fired"]] == list(range(len(PLAN)))
    # One of each kind in the plan, counted as such (a slice is one preemption).
    assert summary["preemptions"] == {"worker": 1, "slice": 1, "trainer": 2, "param_server": 1}
    assert summary["reissued_prompts"] == exp.history[-1]["reissued/prompts"]
    # The driver sees the parameter server come back once (on Ray: a new actor).
    assert summary["restarts"]["param_server"] == 1
    steps = [e for e in exp.trace.memory.events if e.kind == "train_step"]
    assert [e["step"] for e in steps if e.discarded] == [3, 5]
    assert [e["step"] for e in steps if not e.discarded] == [1, 2, 3, 4, 5]
    assert {"worker-0", "worker-1", "trainer"} <= preempted
    assert outage["fault"] == "kill_param_server" and 5 in pushes  # served again after it


def test_an_overlapped_run_on_ray_is_the_local_one(ray_cluster, cache):
    # The trainer steps in its own process while the driver runs the next rounds.
    overlap = [*SMALL, "runtime.overlap_training=true", "staleness.max_staleness=1", "steps=3"]
    with Experiment(small_run_config(*overlap), cache_dir=cache) as exp:
        local = learning_metrics(exp.run())
    config = small_run_config(*overlap, "runtime.backend=ray")
    with RayExperiment(config, cache_dir=cache, ray_config=ray_config()) as exp:
        exp.run()
        exp.check_accounting()
        assert_same_metrics(exp.history, local)
        assert all(m["rounds/ahead"] > 0 for m in exp.history)


@ray.remote(num_cpus=0)
class _SlowStart:
    """Up once ``go`` exists; writes ``entered`` when its constructor starts."""

    def __init__(self, entered: str, go: str) -> None:
        import pathlib
        import time

        pathlib.Path(entered).touch()
        while not pathlib.Path(go).exists():
            time.sleep(0.05)

    def sync(self) -> str:
        return "synced"


def test_a_round_waits_for_a_fleet_that_is_still_starting(ray_cluster, tmp_path):
    """The first round found every worker still starting after the trainer's warm start
    on a loaded machine, skipped them all and called the loop stalled (a multi-host
    test's driver, ``worker_start_wait_s`` 5). A worker's wait counts from the first
    round that wants it, and a round in which no worker is up waits for the first."""
    import threading
    import time
    from types import SimpleNamespace

    from rlaxkit.runtime.ray_placement import RayTransport

    def worker(worker_id, name):
        entered, go = tmp_path / f"{name}.entered", tmp_path / f"{name}.go"
        handle = transport.started(_SlowStart.remote(str(entered), str(go)))
        deadline = time.monotonic() + 120
        while not entered.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return SimpleNamespace(worker_id=worker_id, handle=handle), go

    transport = RayTransport(start_wait_s=1.0)
    slow, go = worker(0, "slow")
    time.sleep(1.5)  # longer than start_wait_s since it started: the warm start
    threading.Timer(1.5, go.touch).start()  # up after its own wait, within the round's
    replies, dead = transport.call([(slow, "sync", ())])
    assert (replies, dead) == ({0: "synced"}, [])
    never, _ = worker(1, "never")
    replies, dead = transport.call([(slow, "sync", ()), (never, "sync", ())])
    assert (replies, dead) == ({0: "synced"}, [])  # the rest of the fleet goes on
    transport.kill(never.handle)
    transport.kill(slow.handle)
