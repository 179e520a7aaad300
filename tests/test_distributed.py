"""A trainer over two processes (``jax.distributed``) = the same trainer in one process.

Two subprocesses with one CPU device each join one process group (gloo collectives over
TCP on this host), build a 2-device global mesh, and run two GRPO steps on the batches
``tests/test_trainer_sharding.py`` uses; their weights, gathered to host memory, and
their losses must equal a one-device run in this process.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_trainer import OPTIMIZER, batch_of, model_parts

from rlaxkit.algorithms import algorithm
from rlaxkit.trainer.config import TrainConfig
from rlaxkit.trainer.distributed import (
    DistributedConfig,
    initialize,
    resolve_mesh_shape,
)
from rlaxkit.trainer.state import create_train_state
from rlaxkit.trainer.step import make_train_step

# Weights split over the two processes by fsdp, then by model (tensor) parallelism.
MESHES = ((1, 2, 1), (1, 1, 2))

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from rlaxkit.trainer import distributed
    process_id, out = int(sys.argv[1]), sys.argv[2]
    # Settings from the environment, as a launcher would give them (rank from argv).
    distributed.initialize(distributed.DistributedConfig.from_env(process_id=process_id))

    import jax, jax.numpy as jnp
    from test_trainer import OPTIMIZER, batch_of, model_parts
    from rlaxkit.algorithms import algorithm
    from rlaxkit.trainer.checkpoint import CheckpointManager, restore_train_state, save_train_state
    from rlaxkit.trainer.config import TrainConfig
    from rlaxkit.trainer.state import create_train_state
    from rlaxkit.trainer.step import make_train_step

    assert jax.process_count() == 2 and jax.local_device_count() == 1, jax.devices()
    graphdef, params = model_parts()
    cfg = TrainConfig(algorithm=algorithm("grpo"), optimizer=OPTIMIZER, micro_batches=2)
    ref = model_parts(seed=1)[1]
    batches = [batch_of(seed=s, rows=8) for s in (0, 1)]
    result = {}
    for shape in MESHES:
        mesh = distributed.global_mesh(shape)
        state = create_train_state(cfg, jax.tree.map(jnp.copy, params), ref_params=ref)
        state = distributed.place_train_state(state, mesh)
        step = make_train_step(cfg, graphdef, mesh=mesh)
        losses = []
        for batch in batches:
            state, metrics = step(state, distributed.place_batch(batch, mesh))
            losses.append(distributed.metrics_to_host(metrics)["loss"])
        leaves = jax.tree.leaves(state.params)
        host = distributed.gather_to_host(state.params)
        np.savez(f"{out}/{shape}-{process_id}.npz", *jax.tree.leaves(host))
        result[str(shape)] = {
            "losses": losses,
            "specs": sorted({str(x.sharding.spec) for x in leaves}),
            # Elements this process holds of all the weights (sharded: fewer than all).
            "local": sum(s.data.size for x in leaves for s in x.addressable_shards),
            "total": sum(x.size for x in leaves),
        }
    # Every process saves its shards of one checkpoint; both restore it onto the mesh.
    with CheckpointManager(f"{out}/checkpoints", async_save=False) as manager:
        save_train_state(manager, state, force=True)
        restored = restore_train_state(manager, state, mesh=mesh)
    same = jax.tree.map(
        lambda a, b: bool(np.array_equal(a, b)),
        distributed.gather_to_host(restored),
        distributed.gather_to_host(state),
    )
    result["restored_equal"] = all(jax.tree.leaves(same))
    print(json.dumps(result))
    """
).replace("MESHES", repr(MESHES))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_device_run():
    """The reference: ``tests/test_trainer_sharding.py``'s two steps, unsharded."""
    graphdef, params = model_parts()
    cfg = TrainConfig(algorithm=algorithm("grpo"), optimizer=OPTIMIZER, micro_batches=2)
    state = create_train_state(cfg, jax.tree.map(jnp.copy, params), ref_params=model_parts(1)[1])
    step = make_train_step(cfg, graphdef)
    losses = []
    for batch in [batch_of(seed=s, rows=8) for s in (0, 1)]:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.params))], losses


@pytest.mark.slow
def test_two_processes_train_as_one_device(tmp_path):
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags)  # One CPU device per process.
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{free_port()}"
    env["JAX_NUM_PROCESSES"] = "2"
    # This test process's compilation cache, if any (conftest.py sets one).
    if jax.config.jax_compilation_cache_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = str(jax.config.jax_compilation_cache_dir)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    root = os.path.dirname(here)
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(rank), str(tmp_path)],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=240)
            assert process.returncode == 0, stderr[-3000:]
            outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for process in processes:
            process.kill()
    reference, reference_losses = one_device_run()
    norm = np.sqrt(sum(float(np.sum(y**2)) for y in reference))
    for shape in MESHES:
        for rank in (0, 1):
            got = outputs[rank][str(shape)]
            # Two steps of AdamW: weights within 1e-5 (relative), losses within 1e-5.
            with np.load(tmp_path / f"{shape}-{rank}.npz") as saved:
                leaves = [saved[f"arr_{i}"] for i in range(len(saved.files))]
            diff = np.sqrt(
                sum(float(np.sum((a - b) ** 2)) for a, b in zip(leaves, reference, strict=True))
            )
            assert diff / norm <= 1e-5, (shape, rank, diff / norm)
            assert np.allclose(got["losses"], reference_losses, rtol=1e-5, atol=0), (shape, got)
        # Both processes computed the same step: equal losses, equal gathered weights.
        assert outputs[0][str(shape)]["losses"] == outputs[1][str(shape)]["losses"]
    # The weights really were split between the processes on the sharded meshes.
    for shape, axis in (((1, 2, 1), "fsdp"), ((1, 1, 2), "model")):
        got = outputs[0][str(shape)]
        assert any(axis in spec for spec in got["specs"]), got["specs"]
        assert got["local"] < got["total"], got
    assert outputs[0]["restored_equal"] and outputs[1]["restored_equal"]


def test_settings_come_from_arguments_then_the_environment():
    env = {
        "JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
        "JAX_NUM_PROCESSES": "4",
        "JAX_PROCESS_ID": "3",
        "JAX_LOCAL_DEVICE_IDS": "0,1",
    }
    config = DistributedConfig.from_env(env)
    assert config == DistributedConfig(
        coordinator_address="10.0.0.1:1234",
        num_processes=4,
        process_id=3,
        local_device_ids=(0, 1),
    )
    assert DistributedConfig.from_env(env, process_id=1).process_id == 1
    assert DistributedConfig.from_env({}) == DistributedConfig()  # JAX's cluster detection
    with pytest.raises(ValueError, match=r"num_processes: environment variable JAX_NUM_PROCESSES"):
        DistributedConfig.from_env({"JAX_NUM_PROCESSES": "two"})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"coordinator_address": "10.0.0.1"}, "coordinator_address: must be 'host:port'"),
        ({"coordinator_address": "h:70000"}, "coordinator_address: must be 'host:port'"),
        ({"num_processes": 0}, "num_processes: must be an integer >= 1"),
        ({"process_id": -1}, "process_id: must be an integer >= 0"),
        ({"num_processes": 2, "process_id": 2}, r"process_id: must be below num_processes = 2"),
        ({"local_device_ids": (0, -1)}, "local_device_ids: must be integers >= 0"),
        ({"cpu_collectives": "nccl"}, "cpu_collectives: must be 'gloo', 'mpi' or None"),
    ],
)
def test_bad_settings_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        DistributedConfig(**fields)


def test_mesh_shape_fills_in_one_axis_and_must_cover_every_device():
    assert resolve_mesh_shape((1, -1, 1), 8) == (1, 8, 1)
    assert resolve_mesh_shape((2, 2, 2), 8) == (2, 2, 2)
    with pytest.raises(ValueError, match=r"trainer_mesh: .* has 4 devices but .* have 8"):
        resolve_mesh_shape((2, 2, 1), 8)
    with pytest.raises(ValueError, match="at most one size may be -1"):
        resolve_mesh_shape((-1, -1, 1), 8)
    with pytest.raises(ValueError, match="cannot cover 8 devices"):
        resolve_mesh_shape((3, -1, 1), 8)
    with pytest.raises(ValueError, match="three sizes"):
        resolve_mesh_shape((8,), 8)


def test_initialize_after_devices_are_in_use_says_to_call_it_first():
    jax.devices()  # This process's backend is up (as in any test process).
    with pytest.raises(RuntimeError, match="must run before anything touches a JAX device"):
        initialize(DistributedConfig(coordinator_address="127.0.0.1:1", num_processes=2))
