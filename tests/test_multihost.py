"""The Ray backend across hosts: a Ray cluster of three network namespaces on this
machine (``tests/netns_cluster.py``), each a Ray node with its own address on a virtual
network, its own custom resources, and its own processes to lose.

Host ``a`` runs Ray's head, the driver (``rlaxkit train``, run in ``a``'s namespace),
the parameter server and the trainer; ``b`` and ``c`` each offer one ``inference``
slot, so the two inference workers land one on each, and weights cross the network
to reach them. Every run is placed by its config alone (``ray.address``, custom
resources). The reference is the local backend's deterministic run of the same config,
which the Ray backend equals bit for bit (``tests/test_ray_backend.py``).

Skipped, with the reason, where the machine cannot create network namespaces (not
root, no ``ip``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from netns_cluster import NetnsCluster, leftovers, unavailable_reason
from test_distributed_ray import close_to
from test_runtime import SMALL, learning_metrics

from rlaxkit.config.run import small_run_config
from rlaxkit.observe.metrics import read_metrics
from rlaxkit.rules.trace import read_trace
from rlaxkit.runtime import Experiment

pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = 6
HOSTS = {
    "a": {"host_a": 2},  # the trainer and the parameter server
    "b": {"host_b": 1, "inference": 1, "trainer_slot": 1},
    "c": {"host_c": 1, "inference": 1, "trainer_slot": 1},
}
# Placement by the config alone: the trainer and the parameter server on a, one worker
# per inference host.
PLACED = (
    "ray.trainer.num_cpus=0.25",
    "ray.trainer.resources={host_a: 1}",
    "ray.param_server.resources={host_a: 1}",
    "ray.worker.num_cpus=0.25",
    "ray.worker.resources={inference: 1}",
)
# The command installed next to this interpreter, wherever its venv lives.
RLAXKIT = str(Path(sys.executable).parent / "rlaxkit")


@pytest.fixture(scope="module")
def cluster():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no multi-host cluster on this machine: {reason}")
    with NetnsCluster(HOSTS) as started:
        yield started
    assert not [n for n in leftovers() if n.startswith(f"rlxmh{started.tag}")]


@pytest.fixture(scope="module")
def local_run(cache):
    """The local backend's learning metrics and trained prompts, step by step."""
    with Experiment(small_run_config(*SMALL, f"steps={STEPS}"), cache_dir=cache) as exp:
        exp.run()
        return comparable(exp.history)


def comparable(history):
    """Learning metrics without the Ray backend's fleet size."""
    return [
        {k: v for k, v in m.items() if not k.startswith("fleet/")}
        for m in learning_metrics(history)
    ]


def train(cluster, config, run_dir, cache, *extra):
    """``rlaxkit train`` on ``config`` as the driver in host ``a``; returns its summary."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir.parent / f"{run_dir.name}.yaml"
    config.save(path)
    argv = [RLAXKIT, "train", str(path), "--run-dir", str(run_dir), "--no-progress"]
    cluster.run("a", [*argv, "--cache-dir", str(cache), *extra], timeout_s=600)
    return json.loads((run_dir / "summary.json").read_text())


def test_workers_on_two_hosts_and_the_trainer_on_a_third_learn_as_the_local_run(
    cluster, cache, local_run, tmp_path
):
    jobs_before = {a["job"] for a in cluster.actor_placements()}
    config = small_run_config(
        *SMALL, f"steps={STEPS}", "runtime.backend=ray", f"ray.address={cluster.address}", *PLACED
    )
    summary = train(cluster, config, tmp_path / "run", cache)
    assert summary["steps"] == STEPS and summary["accepted_lost"] == 0
    assert comparable(read_metrics(tmp_path / "run" / "metrics.jsonl")) == local_run
    # Where Ray placed them: the trainer and the parameter server on a, one worker on
    # each of b and c; every version the trainer put on a reached b and c over the
    # network (each worker pulled it from the object store).
    placed = {}
    for actor in cluster.actor_placements():
        if actor["job"] not in jobs_before:
            placed.setdefault(actor["class"], []).append(actor["address"])
    nodes = {name: host.address for name, host in cluster.nodes.items()}
    assert placed["TrainerHost"] == [nodes["a"]]
    assert placed["ParameterServerActor"] == [nodes["a"]]
    assert sorted(placed["WorkerHost"]) == sorted([nodes["b"], nodes["c"]])
    pulls = [e for e in read_trace(tmp_path / "run" / "trace.jsonl") if e.kind == "pull"]
    assert {e.actor for e in pulls} == {"worker-0", "worker-1"}


DRIVER = str(Path(__file__).resolve().with_name("multihost_driver.py"))


def wait_for(condition, what, timeout_s=300.0, every_s=0.2):
    """Polls ``condition`` until it is true (raises naming ``what`` after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every_s)


def test_a_lost_host_is_detected_its_prompts_reissued_and_it_is_used_again_when_back(
    cluster, cache, tmp_path
):
    """Every process of the host of a worker that holds prompts (its Ray node, the
    worker actor on it) is killed: the run finds the worker dead, re-issues its prompts
    to the other worker and trains on; the replacement worker waits for a host with an
    ``inference`` slot; when the host comes back (a new Ray node) the replacement
    starts there and takes work. Nothing accepted is lost."""
    # The host is lost after the first step from ``lost_after`` on at which a worker
    # holds prompts (which steps those are depends on the sampled rollouts).
    steps, lost_after, back_after = 8, 2, 4
    config = small_run_config(
        *SMALL,
        f"steps={steps}",
        "runtime.chunk_steps=1",  # prompts stay in flight across rounds
        "runtime.backend=ray",
        f"ray.address={cluster.address}",
        "ray.weight_store=tensorstore",  # weights through the run directory, shared
        "ray.worker_start_wait_s=5",
        *PLACED,
    )
    run = tmp_path / "run"
    run.mkdir()
    config.save(tmp_path / "config.yaml")
    argv = [cluster.python, DRIVER, str(tmp_path / "config.yaml"), str(run), str(cache)]
    pauses = [f"--pause-holding-after={lost_after}", f"--pause-after={back_after}"]
    driver = cluster.popen("a", [*argv, *pauses], log=tmp_path / "driver.log")
    hosts = {host.address: name for name, host in cluster.nodes.items()}
    try:
        paused = run / f"paused-{lost_after}.json"
        wait_for(lambda: paused.exists() or driver.poll() is not None, "the first pause")
        at_pause = json.loads(paused.read_text())
        lost_step, in_flight = at_pause["step"], at_pause["in_flight"]
        victim = max(in_flight, key=lambda w: len(in_flight[w]))  # a worker with prompts
        lost_host = hosts[at_pause["addresses"][victim]]
        assert lost_host in ("b", "c")
        assert cluster.kill_host(lost_host) > 0  # node loss: its raylet, its worker, all
        (run / f"go-{lost_after}").touch()
        paused = run / f"paused-{back_after}.json"
        wait_for(lambda: paused.exists() or driver.poll() is not None, "the second pause")
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        back_step = json.loads(paused.read_text())["step"]
        cluster.start_node(lost_host)  # the host comes back: a new Ray node, same slot
        address = cluster.nodes[lost_host].address
        wait_for(
            lambda: any(
                a["class"] == "WorkerHost" and a["state"] == "ALIVE" and a["address"] == address
                for a in cluster.actor_placements()
            ),
            "the replacement worker to start on the host",
        )
        (run / f"go-{back_after}").touch()
        assert driver.wait(timeout=600) == 0, (tmp_path / "driver.log").read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
    result = json.loads((run / "result.json").read_text())
    summary, events = result["summary"], read_trace(run / "trace.jsonl")
    lost, *others = [e for e in events if e.kind == "preemption"]
    assert lost.actor == victim and lost["reason"] == "actor_died"
    assert lost["reissued"] == len(in_flight[victim]) > 0
    # A replacement Ray scheduled on the host before the GCS declared it dead dies at
    # once, holding nothing, and is replaced in turn.
    restarts = [e for e in events if e.kind == "restart" and e.actor.startswith("worker")]
    assert [e["replaces"] for e in restarts] == [victim] + [e.actor for e in others]
    assert all(e["reissued"] == 0 for e in others)
    newcomer = restarts[-1].actor
    survivor = next(w for w in in_flight if w != victim)
    # Between the loss and the return the survivor alone generated, and the run trained.
    back_at = next(e.t for e in events if e.actor == newcomer and e.kind == "pull")
    between = [e for e in events if lost.t < e.t < back_at]
    assert {e.actor for e in between if e.kind == "generation_end"} == {survivor}
    assert [e["step"] for e in between if e.kind == "train_step"] == list(
        range(lost_step + 1, back_step + 1)
    )
    # The lost prompts were generated again, with their old ids.
    again = {e["rollout"] for e in events if e.kind == "generation_start" and e.t > lost.t}
    assert set(in_flight[victim]) <= again
    # Back on its host, the replacement took work and finished rollouts.
    assert any(e.kind == "generation_end" and e.actor == newcomer for e in events)
    assert summary["accepted_lost"] == 0 and summary["worker_replacements"] == len(restarts)
    assert summary["buffer"]["trained"] == steps * config.staleness.batch_size
    assert "preempted" not in summary["buffer"]["dropped_by_reason"]


def stale_processes(cluster, name):
    """The Ray node processes left in host ``name``: its raylet, its actors and agents
    (``ray::<Class>``)."""
    found = []
    for pid in cluster.pids(name):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if argv[0].startswith(b"ray::") or argv[0].endswith(b"/raylet"):
                found.append(pid)
    return found


def test_a_partitioned_host_is_replaced_and_nothing_accepted_is_lost(cluster, cache, tmp_path):
    """The host of a worker that holds prompts is cut off the network with its
    processes alive (its ``eth0`` down): the GCS declares its node dead, the run finds
    the worker dead, re-issues its prompts and trains on with the other worker. The
    network heals; the host's stale node, told it is dead, exits by itself (its raylet,
    the old worker, its agents; the log monitor Ray leaves is killed) and the host joins
    again as a new node, where the replacement worker starts and takes work. Nothing
    accepted is lost: every step trains a full batch and the books balance."""
    steps, cut_after, healed_after = 5, 2, 3
    config = small_run_config(
        *SMALL,
        f"steps={steps}",
        "runtime.chunk_steps=1",  # prompts stay in flight across rounds
        "runtime.backend=ray",
        f"ray.address={cluster.address}",
        "ray.weight_store=tensorstore",
        "ray.worker_start_wait_s=5",
        *PLACED,
    )
    run = tmp_path / "run"
    run.mkdir()
    config.save(tmp_path / "config.yaml")
    argv = [cluster.python, DRIVER, str(tmp_path / "config.yaml"), str(run), str(cache)]
    pauses = [f"--pause-holding-after={cut_after}", f"--pause-after={healed_after}"]
    driver = cluster.popen("a", [*argv, *pauses], log=tmp_path / "driver.log")
    hosts = {host.address: name for name, host in cluster.nodes.items()}
    cut, rejoined = None, False
    try:
        paused = run / f"paused-{cut_after}.json"
        wait_for(lambda: paused.exists() or driver.poll() is not None, "the first pause")
        at_pause = json.loads(paused.read_text())
        cut_step, in_flight = at_pause["step"], at_pause["in_flight"]
        victim = max(in_flight, key=lambda w: len(in_flight[w]))
        cut = hosts[at_pause["addresses"][victim]]
        assert cut in ("b", "c")
        alive_before = set(cluster.pids(cut))
        cluster.partition(cut)
        wait_for(lambda: len(cluster.alive_nodes()) == 2, "the GCS to declare the node dead")
        # Partitioned, not killed: every process the host ran is still running.
        assert alive_before and alive_before <= set(cluster.pids(cut))
        (run / f"go-{cut_after}").touch()
        paused = run / f"paused-{healed_after}.json"
        wait_for(lambda: paused.exists() or driver.poll() is not None, "the second pause")
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        healed_step = json.loads(paused.read_text())["step"]
        cluster.heal(cut)
        # Told by the GCS that it is dead, the stale node's raylet exits, and the old
        # worker and the node's agents with it (seconds); only its log monitor stays.
        wait_for(lambda: not stale_processes(cluster, cut), "the stale node to exit", 60.0)
        cluster.kill_host(cut)  # the log monitor Ray leaves behind
        cluster.start_node(cut)  # the host joins again: a new Ray node, same slot
        rejoined = True
        address = cluster.nodes[cut].address
        wait_for(
            lambda: any(
                a["class"] == "WorkerHost" and a["state"] == "ALIVE" and a["address"] == address
                for a in cluster.actor_placements()
            ),
            "the replacement worker to start on the host",
        )
        (run / f"go-{healed_after}").touch()
        assert driver.wait(timeout=600) == 0, (tmp_path / "driver.log").read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
        if cut is not None and not rejoined:  # the next test finds every host up
            cluster.heal(cut)
            cluster.kill_host(cut)
            cluster.start_node(cut)
    result = json.loads((run / "result.json").read_text())
    summary, events = result["summary"], read_trace(run / "trace.jsonl")
    lost, *others = [e for e in events if e.kind == "preemption"]
    assert lost.actor == victim and lost["reason"] == "actor_died"
    assert lost["reissued"] == len(in_flight[victim]) > 0
    restarts = [e for e in events if e.kind == "restart" and e.actor.startswith("worker")]
    assert [e["replaces"] for e in restarts] == [victim] + [e.actor for e in others]
    newcomer = restarts[-1].actor
    survivor = next(w for w in in_flight if w != victim)
    back_at = next(e.t for e in events if e.actor == newcomer and e.kind == "pull")
    between = [e for e in events if lost.t < e.t < back_at]
    assert {e.actor for e in between if e.kind == "generation_end"} == {survivor}
    assert [e["step"] for e in between if e.kind == "train_step"] == list(
        range(cut_step + 1, healed_step + 1)
    )
    again = {e["rollout"] for e in events if e.kind == "generation_start" and e.t > lost.t}
    assert set(in_flight[victim]) <= again
    assert any(e.kind == "generation_end" and e.actor == newcomer for e in events)
    # Nothing accepted lost: every step trained a full batch, and the books balance.
    assert summary["accepted_lost"] == 0 and summary["worker_replacements"] == len(restarts)
    assert summary["buffer"]["trained"] == steps * config.staleness.batch_size
    assert "preempted" not in summary["buffer"]["dropped_by_reason"]


def metrics_steps(run_dir):
    """Steps in ``metrics.jsonl`` so far (a line being written is skipped)."""
    steps = []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError, KeyError):
            steps.append(json.loads(line)["step"])
    return steps


def partial_saves(run_dir, step):
    """Orbax's temporary directories of an unfinished save of ``step``."""
    return list((run_dir / "checkpoints").glob(f"{step}.orbax-checkpoint-tmp*"))


def test_the_driver_killed_mid_run_and_mid_save_resumes_to_the_uninterrupted_run(
    cluster, cache, local_run, tmp_path
):
    """``rlaxkit train`` is killed with SIGKILL after step 3 (its last checkpoint is
    step 2); run again, it resumes from step 2 and is killed, with the trainer, in the
    middle of writing checkpoint 4; run a third time, it resumes from step 2 (the
    unfinished save is never listed) and finishes as the local run, bit for bit."""
    config = small_run_config(
        *SMALL,
        f"steps={STEPS}",
        "checkpoint.every_steps=2",
        "runtime.backend=ray",
        f"ray.address={cluster.address}",
        *PLACED,
    )
    run = tmp_path / "run"
    run.mkdir()
    config.save(tmp_path / "config.yaml")
    argv = [RLAXKIT, "train", str(tmp_path / "config.yaml"), "--run-dir", str(run)]
    argv += ["--cache-dir", str(cache), "--no-progress"]

    def train_until(condition, what):
        driver = cluster.popen("a", argv, log=tmp_path / "driver.log")
        try:
            # Polled every 5 ms: a save of this tiny model is over in a fraction of a second.
            done = lambda: condition() or driver.poll() is not None  # noqa: E731
            wait_for(done, what, timeout_s=600, every_s=0.005)
            assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            return driver
        except BaseException:
            driver.kill()
            raise

    # 1. Killed between steps: step 3 is in metrics.jsonl, checkpoint 2 is the last.
    driver = train_until(lambda: 3 in metrics_steps(run), "step 3")
    driver.kill()
    driver.wait()
    assert (run / "checkpoints" / "2").is_dir()
    # 2. Resumed, then killed with its trainer while checkpoint 4 is being written.
    driver = train_until(lambda: partial_saves(run, 4), "the save of checkpoint 4")
    trainers = cluster.processes("a", "ray::TrainerHost")
    driver.kill()
    for pid in trainers:
        os.kill(pid, signal.SIGKILL)
    driver.wait()
    assert trainers and partial_saves(run, 4) and not (run / "checkpoints" / "4").exists()
    # 3. Resumed from checkpoint 2 again, to the end.
    summary = train(cluster, config, run, cache)
    assert summary["resumed_from"] == 2
    assert summary["steps"] == STEPS and summary["accepted_lost"] == 0
    assert comparable(read_metrics(run / "metrics.jsonl")) == local_run
    assert metrics_steps(run) == list(range(1, STEPS + 1))
    kept = [e["step"] for e in read_trace(run / "trace.jsonl") if e.kind == "train_step"]
    assert kept == list(range(1, STEPS + 1))


def test_a_trainer_of_two_processes_on_two_hosts_learns_as_one(cluster, cache, local_run, tmp_path):
    """``ray.trainer_processes=2`` with ``STRICT_SPREAD``: one trainer process on b,
    one on c, one ``jax.distributed`` group whose coordinator and gloo collectives go
    over the virtual network; every learning metric within 1e-5 of the local run."""
    jobs_before = {a["job"] for a in cluster.actor_placements()}
    config = small_run_config(
        *SMALL,
        f"steps={STEPS}",
        "runtime.backend=ray",
        f"ray.address={cluster.address}",
        *PLACED,
        "ray.trainer_processes=2",
        "ray.trainer_placement=STRICT_SPREAD",
        "ray.trainer.resources={trainer_slot: 1}",
    )
    summary = train(cluster, config, tmp_path / "run", cache)
    assert summary["steps"] == STEPS and summary["accepted_lost"] == 0
    rows = comparable(read_metrics(tmp_path / "run" / "metrics.jsonl"))
    assert len(rows) == len(local_run)
    for step, (got, expected) in enumerate(zip(rows, local_run, strict=True), start=1):
        assert not close_to(got, expected), f"step {step}: {close_to(got, expected)}"
    placed = [
        a["address"]
        for a in cluster.actor_placements()
        if a["job"] not in jobs_before and a["class"] == "TrainerProcessActor"
    ]
    nodes = cluster.nodes
    assert sorted(placed) == sorted([nodes["b"].address, nodes["c"].address])


def test_worker_start_wait_is_checked():
    from rlaxkit.config.ray import RayConfig

    assert RayConfig().worker_start_wait_s == 300.0
    with pytest.raises(ValueError, match="worker_start_wait_s: must be a number"):
        RayConfig(worker_start_wait_s=-1)
