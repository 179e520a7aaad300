"""The Ray backend: same results as the local backend; it heals worker, parameter-server
and trainer deaths; the fleet grows and shrinks mid-run under the staleness policy."""

import shutil
import tempfile

import pytest
from test_runtime import learning_metrics, small_config

from rlaxkit.runtime import Experiment

ray = pytest.importorskip("ray")

from rlaxkit.runtime.ray_backend import RayExperiment  # noqa: E402
from rlaxkit.runtime.ray_config import ActorResources, RayConfig, small_cluster_config  # noqa: E402

pytestmark = pytest.mark.ray

STEPS = 4


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for the module; its files stay in a short temp dir (Ray's
    socket paths must fit in 107 bytes)."""
    temp_dir = tempfile.mkdtemp(prefix="ray-")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    yield
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One warm start for the module: both backends and every actor share it."""
    return tmp_path_factory.mktemp("warm_start")


@pytest.fixture(scope="module")
def local_run(cache):
    """The local backend's reference: learning metrics and trained prompts per step."""
    with Experiment(small_config(), cache_dir=cache) as exp:
        trained = []
        for _ in range(STEPS):
            exp.step()
            trained.append(sorted(g.group_id for g in exp.last_batch["groups"]))
        return learning_metrics(exp.history), trained


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
    local_metrics, local_trained = local_run
    config = small_config("runtime.backend=ray")
    with RayExperiment(config, cache_dir=cache, ray_config=ray_config()) as exp:
        trained = []
        for _ in range(STEPS):
            exp.step()
            trained.append(sorted(g.group_id for g in exp.last_batch["groups"]))
            exp.check_accounting()
        assert trained == local_trained
        assert_same_metrics(exp.history, local_metrics)
        # Both worker actors generated and pulled weights from the object store.
        assert {e.actor for e in events(exp, "generation_end")} == {"worker-0", "worker-1"}
        assert {e.actor for e in events(exp, "pull")} == {"worker-0", "worker-1"}
        assert [e.version for e in events(exp, "push")] == list(range(STEPS + 1))
        keep = config.runtime.keep_versions
        assert exp.param_server.versions() == list(range(STEPS + 1))[-keep:]  # bounded
        report = exp.evaluate(num_problems=4, samples=2)
        assert 0.0 <= report.rows[0]["pass@k"] <= 1.0


def test_killed_worker_is_detected_its_prompts_reissued_and_the_fleet_is_elastic(
    ray_cluster, cache
):
    # One decode step per round, so prompts stay in flight across rounds.
    config = small_config("runtime.backend=ray", "runtime.chunk_steps=1")
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
    local_metrics, local_trained = local_run
    config = small_config("runtime.backend=ray", "checkpoint.every_steps=2")
    with RayExperiment(config, run_dir=tmp_path, cache_dir=cache, ray_config=ray_config()) as exp:
        exp.run(1)
        ray.kill(exp.param_server_actor, no_restart=False)
        ps_killed_at = exp.clock()
        exp.run(2)
        (restart,) = events(exp, "restart", "param_server")
        assert restart.version is None  # It came back empty...
        pulls = events(exp, "pull", after=ps_killed_at)
        assert {e.actor for e in pulls} == {"worker-0", "worker-1"}  # ...and served again.
        assert max(e.version for e in pulls) == exp.version - 1
        ray.kill(exp.trainer, no_restart=False)  # Its last checkpoint is step 2 of 3.
        exp.run(STEPS - 3)
        (restart,) = events(exp, "restart", "trainer")
        assert restart["lost_steps"] == 1
        (restore,) = events(exp, "checkpoint_restore", "trainer")
        assert restore["step"] == 2
        assert exp.param_server.latest_version() == exp.version
        assert_same_metrics(exp.history, local_metrics)
        exp.check_accounting()


def test_bad_ray_settings_fail_early():
    with pytest.raises(ValueError, match="weight_store"):
        RayConfig(weight_store="nfs")
    with pytest.raises(ValueError, match="num_gpus"):
        ActorResources(num_gpus=-1)
    with pytest.raises(ValueError, match="runtime.backend"):
        RayExperiment(small_config())
