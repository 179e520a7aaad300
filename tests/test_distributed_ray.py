"""A multi-process trainer on Ray (``RayConfig.trainer_processes = 2``) learns as one
trainer does, and heals when one of its processes dies.

Two ``TrainerProcessActor``\\ s, one CPU device each, form one ``jax.distributed`` group
(gloo collectives) on this host; the driver sends both every batch and process 0
pushes. The reference is the local backend's run of the same config, which
``tests/test_ray_backend.py`` shows equals ``trainer_processes = 1`` bit for bit. Two
processes reduce in another order, so floats agree to 1e-5, not bitwise.
"""

import os
import time

import jax
import numpy as np
import pytest
from test_runtime import SMALL, learning_metrics

from rlaxkit.config.run import RunConfig, small_run_config
from rlaxkit.runtime import Experiment

ray = pytest.importorskip("ray")

from rlaxkit.config.ray import RayConfig, small_cluster_config  # noqa: E402
from rlaxkit.runtime import RayExperiment  # noqa: E402

pytestmark = pytest.mark.ray

STEPS = 4


def close_to(got, reference):
    """Names of the metrics of one step that differ by more than 1e-5 (absolute, as
    ``tests/test_trainer_sharding.py`` compares losses, plus 1e-5 relative), with their
    values; counts and prompts must be equal."""
    differ = {}
    for key in got.keys() | reference.keys():
        a, b = got.get(key), reference.get(key)
        if isinstance(a, float) and isinstance(b, float):
            if not abs(a - b) <= 1e-5 + 1e-5 * abs(b):
                differ[key] = (a, b)
        elif a != b:
            differ[key] = (a, b)
    return differ


@pytest.mark.slow
def test_two_trainer_processes_learn_as_one_and_survive_losing_one(ray_cluster, tmp_path, cache):
    with Experiment(small_run_config(*SMALL, "checkpoint.every_steps=2"), cache_dir=cache) as local:
        trained = []
        for _ in range(STEPS):
            local.step()
            trained.append(sorted(g.group_id for g in local.last_batch["groups"]))
        reference = learning_metrics(local.history)
        reference_params = leaves(local.params())
    config = small_run_config(*SMALL, "runtime.backend=ray", "checkpoint.every_steps=2")
    settings = small_cluster_config(trainer_processes=2)
    with RayExperiment(
        config, run_dir=tmp_path / "run", cache_dir=cache, ray_config=settings
    ) as exp:
        prompts = []
        for _ in range(3):  # checkpoints at steps 0 and 2, written by both processes
            exp.step()
            prompts.append(sorted(g.group_id for g in exp.last_batch["groups"]))
        group = exp.trainer.group
        assert [j["process_id"] for j in group.joined] == [0, 1]
        assert group.joined[0]["mesh"] == {"data": 1, "fsdp": 2, "model": 1}
        ray.kill(group.handles[1])  # One trainer process dies between steps.
        exp.step()
        prompts.append(sorted(g.group_id for g in exp.last_batch["groups"]))
        assert group.restarts == 1
        restore = [e for e in exp.trace.memory.events if e.kind == "checkpoint_restore"]
        assert [e["step"] for e in restore] == [2]
        got = learning_metrics(exp.history)
        for step, (a, b) in enumerate(zip(got, reference, strict=True), start=1):
            a = {k: v for k, v in a.items() if not k.startswith("fleet/")}
            assert not close_to(a, b), f"step {step}: (2 processes, local) = {close_to(a, b)}"
        assert prompts == trained
        summary = exp.summary()
        assert summary["lost_steps"] == 1 and summary["restarts"]["trainer"] == 1
        assert summary["accepted_lost"] == 0
        exp.check_accounting()
        # Process 0 pushed every version, the new group's too; the weights it gathers
        # are whole arrays, within 1e-5 (relative, in norm) of the one-process run's.
        assert exp.parts.store.latest_version() == exp.version
        params = leaves(exp.params())
        assert [x.shape for x in params] == [x.shape for x in reference_params]
        diff = np.sqrt(
            sum(np.sum((a - b) ** 2) for a, b in zip(params, reference_params, strict=True))
        )
        assert diff / np.sqrt(sum(np.sum(b**2) for b in reference_params)) <= 1e-5


def test_a_dead_process_stops_its_group_at_once(ray_cluster, monkeypatch):
    """When one trainer process dies, the others may be stuck in a collective that will
    never end: the group is killed at once, not after a grace period (here an hour)."""
    from ray.exceptions import RayActorError

    from rlaxkit.runtime import ray_trainer_group
    from rlaxkit.runtime.ray_trainer_group import TrainerGroup

    @ray.remote(num_cpus=0)
    class Process:
        def __init__(self, dies: bool):
            self.dies = dies

        def step(self):
            if self.dies:
                os._exit(1)
            time.sleep(3600)  # a collective whose peer is gone

    monkeypatch.setattr(ray_trainer_group, "_GRACE_S", 3600.0)
    survivor, dying = Process.remote(False), Process.remote(True)
    group = TrainerGroup.__new__(TrainerGroup)  # two started processes; no trainer in them
    group.size, group.handles, group._joining, group._placement = 2, [survivor, dying], [], None
    with pytest.raises(RayActorError):
        group.call("step")
    with pytest.raises(RayActorError):  # killed with the group
        ray.get(survivor.step.remote(), timeout=60)


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_trainer_group_settings_fail_early(tmp_path):
    with pytest.raises(ValueError, match="trainer_processes: must be an int >= 1"):
        RayConfig(trainer_processes=0)
    with pytest.raises(ValueError, match="trainer_mesh: must be three sizes"):
        RayConfig(trainer_mesh=(2, 2))
    with pytest.raises(ValueError, match="trainer_mesh: must be three sizes"):
        RayConfig(trainer_mesh=(-1, -1, 1))
    with pytest.raises(ValueError, match=r"trainer_mesh: \(1, 3, 1\) has 3 devices, which 2"):
        RayConfig(trainer_processes=2, trainer_mesh=(1, 3, 1))
    with pytest.raises(ValueError, match="trainer_placement: must be one of"):
        RayConfig(trainer_placement="ANYWHERE")
    with pytest.raises(ValueError, match="trainer_coordinator_port"):
        RayConfig(trainer_coordinator_port=0)
    config = small_run_config(
        *SMALL, "runtime.backend=ray", "ray.trainer_processes=2", "ray.trainer_mesh=[2, 1, 1]"
    )
    assert config.ray.trainer_processes == 2 and config.ray.trainer_mesh == (2, 1, 1)
    config.save(tmp_path / "c.yaml")
    assert RunConfig.from_yaml(tmp_path / "c.yaml") == config
