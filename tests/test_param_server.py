"""Parameter servers: the protocol, checked on every store, and the nnx round trip.

Every test parametrised by ``store_kind`` runs against the in-process store and the
TensorStore store (default, and durable: fsync before publishing) with the same
assertions.
"""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlaxkit.param_server import (
    InProcessParameterServer,
    ParameterServer,
    TensorStoreParameterServer,
    TransferRecord,
    TransferStats,
    tree_nbytes,
)

STORE_KINDS = ["in_process", "tensorstore", "tensorstore_durable"]


@pytest.fixture(params=STORE_KINDS)
def make_store(request, tmp_path):
    """``make_store(keep=..., **kwargs)`` builds a fresh store of the parametrised kind."""

    def make(keep=2, **kwargs):
        if request.param == "in_process":
            return InProcessParameterServer(keep=keep, **kwargs)
        durable = request.param == "tensorstore_durable"
        return TensorStoreParameterServer(tmp_path / "ps", keep=keep, durable=durable, **kwargs)

    return make


def params_at(version: int) -> dict:
    """A small tree whose every element equals ``version``, so a mixed read shows."""
    return {
        "embed": jnp.full((16, 8), version, jnp.float32),
        "layers": [
            {"kernel": jnp.full((8, 8), version, jnp.bfloat16)},
            {"kernel": jnp.full((8, 8), version, jnp.bfloat16)},
        ],
        "step": jnp.asarray(version, jnp.int32),
    }


def version_of(params: dict) -> int:
    """The version every leaf agrees on; fails on a mixture of versions."""
    values = {float(v) for leaf in jax.tree.leaves(params) for v in np.asarray(leaf).ravel()}
    assert len(values) == 1, f"leaves from different versions: {sorted(values)}"
    return int(values.pop())


def test_both_stores_satisfy_the_protocol(make_store):
    assert isinstance(make_store(), ParameterServer)


def test_push_pull_and_latest_version(make_store):
    store = make_store()
    assert store.latest_version() is None
    store.push(1, params_at(1))
    assert store.latest_version() == 1
    version, params = store.pull()
    assert version == 1
    assert jax.tree.structure(params) == jax.tree.structure(params_at(1))
    jax.tree.map(np.testing.assert_array_equal, params, params_at(1))
    assert {x.dtype for x in jax.tree.leaves(params)} == {
        jnp.dtype("float32"),
        jnp.dtype("bfloat16"),
        jnp.dtype("int32"),
    }


def test_pull_returns_the_newest_version(make_store):
    store = make_store(keep=3)
    for version in (1, 2, 5):
        store.push(version, params_at(version))
    assert store.pull()[0] == 5
    assert store.pull(min_version=2)[0] == 5
    assert version_of(store.pull(min_version=5)[1]) == 5


def test_pull_times_out_with_a_clear_error(make_store):
    store = make_store()
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match="any version did not appear within 0.05 s"):
        store.pull(timeout=0.05)
    store.push(1, params_at(1))
    with pytest.raises(TimeoutError, match=r"version >= 2 .*latest published version: 1"):
        store.pull(min_version=2, timeout=0.05)
    elapsed = time.perf_counter() - start
    assert 0.1 <= elapsed < 2.0
    with pytest.raises(TimeoutError):
        store.pull(min_version=2, timeout=0)


def test_pull_blocks_until_the_wanted_version_arrives(make_store):
    store = make_store()
    store.push(1, params_at(1))
    result = {}
    reader = threading.Thread(target=lambda: result.update(got=store.pull(2, timeout=10)))
    reader.start()
    time.sleep(0.1)
    assert reader.is_alive(), "pull(min_version=2) returned before version 2 existed"
    store.push(2, params_at(2))
    reader.join(timeout=10)
    version, params = result["got"]
    assert version == 2 and version_of(params) == 2


def test_versions_strictly_increase(make_store):
    store = make_store()
    store.push(3, params_at(3))
    with pytest.raises(ValueError, match="version 3 is not newer than .* version 3"):
        store.push(3, params_at(3))
    with pytest.raises(ValueError, match="version 2 is not newer"):
        store.push(2, params_at(2))
    for bad in (-1, True, 4.0):
        with pytest.raises(ValueError, match="version"):
            make_store().push(bad, params_at(1))
    assert store.latest_version() == 3
    store.push(4, params_at(4))
    assert store.pull()[0] == 4


def test_keep_bounds_the_retained_versions(make_store):
    store = make_store(keep=2)
    for version in range(1, 6):
        store.push(version, params_at(version))
    assert store.versions() == [4, 5]
    assert store.pull()[0] == 5
    with pytest.raises(ValueError, match="keep"):
        make_store(keep=0)


def test_concurrent_readers_while_the_writer_pushes(make_store):
    store = make_store(keep=2)
    last_version = 12
    seen: list[list[int]] = [[] for _ in range(4)]
    errors = []

    def read(out: list[int]) -> None:
        try:
            while not out or out[-1] < last_version:
                version, params = store.pull(min_version=out[-1] if out else None, timeout=20)
                assert version_of(params) == version
                out.append(version)
        except BaseException as e:  # Reported by the main thread.
            errors.append(e)

    readers = [threading.Thread(target=read, args=(out,)) for out in seen]
    for reader in readers:
        reader.start()
    for version in range(1, last_version + 1):
        store.push(version, params_at(version))
        time.sleep(0.005)
    for reader in readers:
        reader.join(timeout=30)
    assert not errors, errors
    for versions in seen:
        assert versions[-1] == last_version
        assert versions == sorted(versions), "a reader went back in versions"


def test_events_and_stats_record_every_transfer(make_store):
    events = []
    store = make_store(
        on_event=lambda kind, version, **fields: events.append((kind, version, fields))
    )
    params = params_at(1)
    store.push(1, params)
    store.pull()
    nbytes = tree_nbytes(params)
    assert [(kind, version) for kind, version, _ in events] == [("push", 1), ("pull", 1)]
    for _, _, fields in events:
        assert fields["bytes"] == nbytes
        assert fields["duration_s"] >= 0
    assert events[1][2]["wait_s"] >= 0
    totals = store.stats.as_dict()
    assert totals["push_count"] == totals["pull_count"] == 1
    assert totals["push_bytes"] == totals["pull_bytes"] == nbytes
    assert store.stats.last("pull").version == 1


def test_tree_nbytes_counts_concrete_and_abstract_leaves():
    tree = {
        "w": np.zeros((4, 8), np.float32),  # 128 bytes
        "b": jnp.zeros(8, jnp.bfloat16),  # 16 bytes
        "abstract": jax.ShapeDtypeStruct((2, 3), jnp.int8),  # 6 bytes
        "scalar": 1.5,  # a float64 scalar: 8 bytes
    }
    assert tree_nbytes(tree) == 128 + 16 + 6 + 8


def test_transfer_stats_keep_a_bounded_history():
    stats = TransferStats(history=2)
    assert stats.last("push") is None
    for version in (1, 2, 3):
        stats.add(TransferRecord(kind="push", version=version, duration_s=0.5, bytes=10))
    assert [r.version for r in stats.records] == [2, 3]
    assert stats.last("push").version == 3 and stats.last("pull") is None
    totals = stats.as_dict()
    assert (totals["push_count"], totals["push_seconds"], totals["push_bytes"]) == (3, 1.5, 30)


_MODEL_STATES: dict = {}  # Model construction is the slow part; build once per config.


def model_state(config) -> nnx.State:
    from rlaxkit.models import Transformer

    if config not in _MODEL_STATES:
        _MODEL_STATES[config] = nnx.state(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)
    return _MODEL_STATES[config]


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_nnx_state_round_trips_bit_exact(make_store, tiny_config, param_dtype):
    from dataclasses import replace

    from rlaxkit.models import Transformer

    config = replace(tiny_config, param_dtype=param_dtype)
    state = model_state(config)
    store = make_store()
    store.push(7, state)
    version, pulled = store.pull(min_version=7)
    assert version == 7
    assert isinstance(pulled, nnx.State)
    assert jax.tree.structure(pulled) == jax.tree.structure(state)
    for got, want in zip(jax.tree.leaves(pulled), jax.tree.leaves(state), strict=True):
        assert got.dtype == want.dtype == jnp.dtype(param_dtype)
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    # The pulled state loads into a fresh (abstract) model of the same config.
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(1)))
    nnx.update(model, pulled)
    loaded = jax.tree.leaves(nnx.state(model, nnx.Param))
    for got, want in zip(loaded, jax.tree.leaves(state), strict=True):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
