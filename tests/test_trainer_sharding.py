"""Sharded = unsharded: the train step over 4 forced CPU devices equals one device.

XLA fixes the number of host devices when JAX starts, so the comparison runs in a
subprocess started with ``--xla_force_host_platform_device_count=4``.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import dataclasses, json
    import jax, jax.numpy as jnp, numpy as np
    from test_trainer import OPTIMIZER, batch_of, model_parts
    from rlaxkit.algorithms import algorithm
    from rlaxkit.trainer.config import TrainConfig
    from rlaxkit.trainer.state import create_train_state
    from rlaxkit.trainer.sharding import make_mesh, shard_batch, shard_train_state
    from rlaxkit.trainer.step import make_train_step

    assert jax.device_count() == 4, jax.devices()
    graphdef, params = model_parts()
    cfg = TrainConfig(algorithm=algorithm("grpo"), optimizer=OPTIMIZER, micro_batches=2)
    ref = model_parts(seed=1)[1]
    batches = [batch_of(seed=s, rows=8) for s in (0, 1)]

    def run(mesh):
        state = create_train_state(cfg, jax.tree.map(jnp.copy, params), ref_params=ref)
        step = make_train_step(cfg, graphdef, mesh=mesh)
        if mesh is not None:
            state = shard_train_state(state, mesh)
        metrics = []
        for batch in batches:
            if mesh is not None:
                batch = shard_batch(batch, mesh)
            state, m = step(state, batch)
            metrics.append({k: float(v) for k, v in m.items()})
        return state, metrics

    single, single_metrics = run(None)
    out = {}
    for shape in ((4, 1, 1), (2, 2, 1), (1, 2, 2)):
        mesh = make_mesh(*shape)
        sharded, metrics = run(mesh)
        shardings = {str(x.sharding.spec) for x in jax.tree.leaves(sharded.params)}
        a = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(sharded.params))]
        b = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(single.params))]
        diff = np.sqrt(sum(float(np.sum((x - y) ** 2)) for x, y in zip(a, b)))
        rel = diff / np.sqrt(sum(float(np.sum(y**2)) for y in b))
        loss = max(abs(a["loss"] - b["loss"]) for a, b in zip(metrics, single_metrics))
        out[str(shape)] = {"rel": rel, "loss": loss, "specs": sorted(shardings)}
    print(json.dumps(out))
    """
)


def run_on_forced_devices(script: str, devices: int = 4) -> dict:
    """Runs ``script`` in a fresh Python whose JAX sees ``devices`` CPU devices (XLA
    fixes the count when JAX starts); returns the JSON object of its last line.

    XLA:CPU ends the process when a device's thread reaches a collective more than 40 s
    after the others (by default); on a loaded 2-core machine running the suite in two
    workers that happened once, so the subprocess waits up to 240 s."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={devices}"
        + " --xla_cpu_collective_call_terminate_timeout_seconds=240"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=os.path.dirname(here),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_sharded_train_steps_equal_one_device():
    results = run_on_forced_devices(SCRIPT)
    for shape, result in results.items():
        # Two steps of AdamW: parameters within 1e-5 (relative), losses equal.
        assert result["rel"] <= 1e-5, (shape, result)
        assert result["loss"] <= 1e-5, (shape, result)
    # The meshes did shard the weights (not everything replicated).
    assert any("fsdp" in spec for spec in results["(2, 2, 1)"]["specs"])
    assert any("model" in spec for spec in results["(1, 2, 2)"]["specs"])
