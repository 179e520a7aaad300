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

import json
from pathlib import Path

import pytest
from netns_cluster import NetnsCluster, unavailable_reason
from test_runtime import SMALL, learning_metrics

from rlaxkit.config import small_run_config
from rlaxkit.metrics import read_metrics
from rlaxkit.runtime import Experiment
from rlaxkit.trace import read_trace

pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = 4
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
RLAXKIT = str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "rlaxkit")


@pytest.fixture(scope="module")
def cluster():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no multi-host cluster on this machine: {reason}")
    with NetnsCluster(HOSTS) as started:
        yield started


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One warm start for the module, shared by the local reference and every host."""
    return tmp_path_factory.mktemp("warm_start")


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
