"""Adapter publication for LoRA runs: the base once, then adapter versions that readers
merge into it, bit for bit the trainer's merged ``params``, on every store kind."""

import time

import jax
import numpy as np
import pytest
from test_trainer import batch_of, model_parts
from test_trainer_lora import LORA, lora_config

from rlaxkit.models.lora import adapter_nbytes
from rlaxkit.param_server import (
    AdapterParameterServer,
    InProcessParameterServer,
    TensorStoreParameterServer,
    tree_nbytes,
)
from rlaxkit.param_server.ray_store import ParameterServerActor
from rlaxkit.trainer.state import create_train_state
from rlaxkit.trainer.step import make_train_step

STEPS = 4


@pytest.fixture(scope="module")
def trained():
    """``(base_params, [(adapters, merged params)] per step)`` of a LoRA run whose step
    keeps its params and donates the rest (the local trainer's step)."""
    graphdef, params = model_parts()
    cfg = lora_config()
    state = create_train_state(cfg, params)
    base = jax.device_get(state.base_params)
    step = make_train_step(cfg, graphdef, keep_params=True)
    versions = [(jax.device_get(state.adapters), jax.device_get(state.params))]
    for seed in range(STEPS):
        state, _ = step(state, batch_of(seed=seed))
        versions.append((jax.device_get(state.adapters), jax.device_get(state.params)))
    return base, versions


def assert_bitwise_equal(got, want):
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(got_leaves, want_leaves, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


_IN_PROCESS: dict = {}


def make_inner(kind, tmp_path, keep=2):
    """A client of the store at ``tmp_path``: a TensorStore client of its own, or the one
    in-process store that every client of this test shares."""
    if kind == "in_process":
        return _IN_PROCESS.setdefault(str(tmp_path), InProcessParameterServer(keep=keep))
    return TensorStoreParameterServer(tmp_path / "ps", keep=keep)


@pytest.mark.parametrize("kind", ["in_process", "tensorstore"])
def test_readers_hold_the_trainers_merged_params_bitwise_and_pushes_move_adapters(
    trained, tmp_path, kind
):
    base, versions = trained
    pusher = AdapterParameterServer(make_inner(kind, tmp_path), lora=LORA)
    pusher.publish_base(base)
    every = AdapterParameterServer(make_inner(kind, tmp_path))  # pulls every version
    late = AdapterParameterServer(make_inner(kind, tmp_path))  # first pull at the end
    for version, (adapters, merged) in enumerate(versions):
        pusher.push(version, adapters)
        pulled, params = every.pull(min_version=version, timeout=10)
        assert pulled == version
        assert_bitwise_equal(params, merged)
    # The base version 0 is pinned: evicted from the newest keep=2, still readable.
    assert pusher.versions() == [0, STEPS - 1, STEPS]
    pulled, params = late.pull(timeout=10)
    assert pulled == STEPS
    assert_bitwise_equal(params, versions[-1][1])
    assert every.base_pulls == late.base_pulls == 1

    # Bytes: the first push holds the base; the others the adapters and a short meta.
    pushes = [r.bytes for r in pusher.stats.records if r.kind == "push"]
    full = tree_nbytes(base)
    adapters_bytes = adapter_nbytes(versions[0][0])
    assert pushes[0] > full + adapters_bytes
    assert all(adapters_bytes <= b < adapters_bytes + 256 for b in pushes[1:])
    pulls = [r.bytes for r in every.stats.records if r.kind == "pull"]
    assert pulls[0] > full and all(b == pushes[1] for b in pulls[1:])


@pytest.mark.parametrize("kind", ["in_process", "tensorstore"])
def test_a_restarted_reader_pulls_the_base_again(trained, tmp_path, kind):
    base, versions = trained
    pusher = AdapterParameterServer(make_inner(kind, tmp_path), lora=LORA)
    pusher.publish_base(base)
    reader = AdapterParameterServer(make_inner(kind, tmp_path))
    for version, (adapters, _) in enumerate(versions[:3]):
        pusher.push(version, adapters)
        reader.pull(timeout=10)
    assert reader.base_pulls == 1
    restarted = AdapterParameterServer(make_inner(kind, tmp_path))  # a new worker's client
    pusher.push(3, versions[3][0])
    pulled, params = restarted.pull(timeout=10)
    assert pulled == 3 and restarted.base_pulls == 1
    assert restarted.stats.last("pull").bytes > tree_nbytes(base)
    assert_bitwise_equal(params, versions[3][1])


def test_a_restarted_pusher_stores_the_base_again_and_readers_follow(trained, tmp_path):
    """A restarted trainer's client knows no base record: its first push writes one, and
    readers holding the old base read the new one."""
    base, versions = trained
    pusher = AdapterParameterServer(make_inner("tensorstore", tmp_path), lora=LORA)
    pusher.publish_base(base)
    reader = AdapterParameterServer(make_inner("tensorstore", tmp_path))
    for version in range(2):
        pusher.push(version, versions[version][0])
        reader.pull(timeout=10)
    restarted = AdapterParameterServer(make_inner("tensorstore", tmp_path), lora=LORA)
    restarted.publish_base(base)
    for version in range(2, STEPS + 1):
        restarted.push(version, versions[version][0])
    assert restarted.stats.records[0].bytes > tree_nbytes(base)
    pulled, params = reader.pull(timeout=10)
    assert pulled == STEPS and reader.base_pulls == 2
    assert_bitwise_equal(params, versions[-1][1])


def test_a_store_without_read_carries_the_base_in_every_record_by_reference(trained):
    """The fault plan's store hands out only its newest version: every record holds the
    base, the same host arrays, so a push still copies only the adapters."""
    from rlaxkit.runtime.faulty_store import UnreliableParameterServer

    base, versions = trained
    store = UnreliableParameterServer(lambda: InProcessParameterServer(keep=2))
    pusher = AdapterParameterServer(store, lora=LORA)
    pusher.publish_base(base)
    reader = AdapterParameterServer(store.view("worker-0"))
    assert not pusher.pins and not reader.pins
    for version, (adapters, merged) in enumerate(versions):
        pusher.push(version, adapters)
        assert_bitwise_equal(reader.pull(timeout=10)[1], merged)
    held = [store.store.read(v)["base"] for v in store.store.versions()]
    assert all(a is b for a, b in zip(held[0], held[1], strict=True))
    assert pusher.stats.last("push").bytes < tree_nbytes(base) / 10
    assert reader.base_pulls == 1
    pusher.rollback(2, versions[2][0])  # a new lineage: a fresh store with the base
    assert_bitwise_equal(reader.pull(timeout=10)[1], versions[2][1])


def test_pinned_versions_outlive_keep_until_the_next_pin():
    """Each store keeps the newest ``keep`` versions besides the newest pinned one."""
    store = InProcessParameterServer(keep=2)
    actor = ParameterServerActor(keep=2)
    for version in range(6):
        pin = version in (0, 4)
        store.push(version, {"v": np.full(2, version)}, pin=pin)
        actor.register(version, [f"ref{version}"], 8, pin=pin)
        if version == 3:
            assert store.versions() == actor.versions() == [0, 2, 3]
    assert store.versions() == actor.versions() == [3, 4, 5]  # 0 unpinned by 4
    actor.register(6, ["ref6"], 8, reset=True)  # its owner died: the pin goes too
    actor.register(7, ["ref7"], 8)
    actor.register(8, ["ref8"], 8)
    assert actor.versions() == [7, 8]


def test_merged_weights_pass_through_unmerged(trained):
    """A run resumed at a published version older than its state publishes that
    version's merged weights; the next push stores the base again."""
    base, versions = trained
    pusher = AdapterParameterServer(InProcessParameterServer(keep=2), lora=LORA)
    pusher.publish_base(base)
    reader = AdapterParameterServer(pusher.inner)
    pusher.push_merged(1, versions[1][1])
    assert_bitwise_equal(reader.pull(timeout=10)[1], versions[1][1])
    pusher.push(2, versions[2][0])
    assert pusher.stats.last("push").bytes > tree_nbytes(base)
    assert_bitwise_equal(reader.pull(timeout=10)[1], versions[2][1])


def test_a_local_lora_run_publishes_adapters_and_its_workers_merge_them(tmp_path):
    from test_runtime import SMALL

    from rlaxkit.config.run import small_run_config
    from rlaxkit.runtime import Experiment

    config = small_run_config(*SMALL, "trainer.lora.rank=4")
    with Experiment(config, cache_dir=tmp_path) as exp:
        exp.run(3)
        host = exp.parts.trainer.group.leader
        pushes = [r.bytes for r in exp.parts.store.stats.records if r.kind == "push"]
        full = tree_nbytes(host.state.base_params)
        assert len(pushes) == 4 and pushes[0] > full
        assert all(b < adapter_nbytes(host.state.adapters) + 256 for b in pushes[1:])
        clients = [slot.handle.store.server for slot in exp.fleet.workers]
        assert all(isinstance(c, AdapterParameterServer) and c.base_pulls == 1 for c in clients)
        pulled, params = AdapterParameterServer(exp.parts.store).pull(timeout=10)
        assert pulled == host.version == 3
        assert_bitwise_equal(params, host.state.params)
        # What a checkpoint saves for the published version: full weights, not a record.
        assert_bitwise_equal(exp.parts.published_weights(3), host.state.params)


@pytest.mark.ray
def test_through_the_ray_object_store_across_its_restart(ray_cluster, trained):
    """Readers are Ray-picklable clients holding nothing; the actor restarts empty and
    the trainer's client registers the pinned base record again with the newest."""
    import pickle

    import ray

    from rlaxkit.param_server.ray_store import RayObjectStoreParameterServer, parameter_server_actor

    base, versions = trained
    actor = parameter_server_actor(keep=2)
    pusher = AdapterParameterServer(RayObjectStoreParameterServer(actor), lora=LORA)
    pusher.publish_base(base)
    reader = pickle.loads(
        pickle.dumps(AdapterParameterServer(RayObjectStoreParameterServer(actor)))
    )
    for version in range(3):
        pusher.push(version, versions[version][0])
        assert_bitwise_equal(reader.pull(min_version=version, timeout=10)[1], versions[version][1])
    ray.kill(actor, no_restart=False)  # Ray restarts it empty
    deadline = time.monotonic() + 60
    while pusher.latest_version() is not None:  # the kill lands asynchronously
        assert time.monotonic() < deadline, "the parameter-server actor did not restart"
        time.sleep(0.05)
    assert pusher.republish() == 2
    assert pusher.versions() == [0, 2]  # the pinned base record and the newest push
    for version in range(3, STEPS + 1):
        pusher.push(version, versions[version][0])
    assert pusher.versions() == [0, STEPS - 1, STEPS]
    fresh = pickle.loads(pickle.dumps(AdapterParameterServer(RayObjectStoreParameterServer(actor))))
    for client in (reader, fresh):
        pulled, params = client.pull(timeout=10)
        assert pulled == STEPS and client.base_pulls == 1
        assert_bitwise_equal(params, versions[-1][1])
    ray.kill(actor)


@pytest.mark.ray
def test_a_push_that_finds_the_actor_restarted_registers_the_base_again(ray_cluster, trained):
    """Nobody noticed the restart before the trainer's next push (in a run, when the
    next batch needed no round): the push registers the pinned base record first, so a
    worker that starts later still finds it, and reports the restart."""
    import pickle

    import ray

    from rlaxkit.param_server.ray_store import RayObjectStoreParameterServer, parameter_server_actor

    base, versions = trained
    actor = parameter_server_actor(keep=2)
    seen = []
    client = RayObjectStoreParameterServer(actor, on_event=lambda kind, v, **_: seen.append(kind))
    pusher = AdapterParameterServer(client, lora=LORA)
    pusher.publish_base(base)
    for version in range(2):
        pusher.push(version, versions[version][0])
    ray.kill(actor, no_restart=False)
    deadline = time.monotonic() + 60
    while pusher.latest_version() is not None:
        assert time.monotonic() < deadline, "the parameter-server actor did not restart"
        time.sleep(0.05)
    assert "restart" not in seen
    pusher.push(2, versions[2][0])
    assert seen.count("restart") == 1 and pusher.versions() == [0, 1, 2]
    pusher.push(3, versions[3][0])  # the next push finds it as it left it
    assert seen.count("restart") == 1 and pusher.versions() == [0, 2, 3]
    fresh = pickle.loads(pickle.dumps(AdapterParameterServer(RayObjectStoreParameterServer(actor))))
    pulled, params = fresh.pull(timeout=10)
    assert pulled == 3 and fresh.base_pulls == 1
    assert_bitwise_equal(params, versions[3][1])
    ray.kill(actor)


def test_the_simulated_parameter_server_moves_adapters_after_the_base():
    """The toy preset (tests/test_sim_delta.py): 100-byte weights, pushes at 100 B/s,
    pulls at 200 B/s, here with adapters of 2% of them. The worker's first pull reads
    the base record (102 B, 0.51 s); each push moves 2 B (0.02 s) and each later pull
    2 B (0.01 s). Step 1 ends at 3.76 s (3.75 without adapters, the first pull 0.01 s
    longer); each later step costs pull + 3.25 s + push."""
    from rlaxkit.rules.trace import MemoryTrace
    from sim import presets, simulate
    from sim.specs import ParamServerSpec

    trace = MemoryTrace()
    simulate(presets.toy(target_steps=3, **{"param_server.adapter_fraction": 0.02}), trace=trace)
    moved = [
        (round(e.t, 9), e.kind, e.version, e["bytes"])
        for e in trace.events
        if e.kind in ("push", "pull")
    ]
    assert moved == [
        (0.51, "pull", 0, 102.0),
        (3.78, "push", 1, 2.0),
        (3.79, "pull", 1, 2.0),
        (7.06, "push", 2, 2.0),
        (7.07, "pull", 2, 2.0),
        (10.34, "push", 3, 2.0),
    ]
    with pytest.raises(ValueError, match="adapter_fraction"):
        ParamServerSpec(
            weight_bytes=1,
            push_bytes_per_s=1,
            pull_bytes_per_s=1,
            adapter_fraction=0.1,
            delta_changed_fraction=0.5,
        )


def test_a_local_lora_run_survives_worker_trainer_and_parameter_server_faults(tmp_path):
    """Through the fault plan's store (every record carries the base by reference): a
    preempted worker comes back with a new client that reads the base again, the
    trainer's rollback starts a new lineage with a base record, the store's outage holds
    a push; the workers end on the trainer's merged weights, bit for bit."""
    from rlaxkit.config.run import small_run_config
    from rlaxkit.rules.fault_plan import Fault, FaultPlan
    from rlaxkit.runtime import Experiment

    plan = FaultPlan(
        (
            Fault(kind="preempt_worker", target="worker-0", at_s=2.0, restart_after_s=1.0),
            Fault(kind="kill_param_server", at_s=4.0, restart_after_s=1.0),
            Fault(kind="preempt_trainer", at_step=3, restart_after_s=1.0),
        )
    )
    config = small_run_config(
        "runtime.chunk_steps=2",
        "runtime.restart_s=1",
        "trainer.lora.rank=4",
        "steps=4",
        "checkpoint.every_steps=2",
    )
    with Experiment(config, run_dir=tmp_path / "run", cache_dir=tmp_path, faults=plan) as exp:
        exp.run()
        exp.check_accounting()
        assert exp.summary()["lost_steps"] == 1
        kinds = {e.kind for e in exp.trace.memory.events}
        assert {"preemption", "restart"} <= kinds
        host = exp.parts.trainer.group.leader
        for slot in exp.fleet.workers:
            client = slot.handle.store.server
            assert client.base_pulls >= 1
            pulled, params = client.pull(timeout=10)
            assert pulled == host.version == 4
            assert_bitwise_equal(params, host.state.params)


def test_an_adapter_push_held_by_an_outage_is_checkpointed_as_weights_and_restored(trained):
    """The local fault plan's store holds a push back while it is down. A LoRA run's push
    is an adapter record; its checkpoint holds the merged weights, and the store restored
    from it publishes them (as a merged record) when the outage ends, which a worker
    pulls as the weights the trainer pushed."""
    from rlaxkit.runtime.faulty_store import UnreliableParameterServer
    from rlaxkit.runtime.local import lora_conversions

    base, versions = trained
    store = UnreliableParameterServer(
        lambda: InProcessParameterServer(keep=2), **lora_conversions(LORA)
    )
    pusher = AdapterParameterServer(store, lora=LORA)
    pusher.publish_base(base)
    pusher.push(1, versions[1][0])
    store.kill(until_s=10.0)
    pusher.push(2, versions[2][0])  # held back
    held = store.held_weights()
    assert held.keys() == {2}
    assert_bitwise_equal(held[2], versions[2][1])

    restored = UnreliableParameterServer(
        lambda: InProcessParameterServer(keep=2), **lora_conversions(LORA)
    )
    restored.load_state_dict(store.state_dict(), {2: jax.device_get(held[2])}.__getitem__)
    assert not restored.tick(5.0) and restored.tick(10.0)
    version, params = AdapterParameterServer(restored.store).pull(timeout=10)
    assert version == 2
    assert_bitwise_equal(params, versions[2][1])
