"""Delta publication: chunk diff and patch, and the delta store over every store kind.

The pure functions are checked by properties over random buffers; the store by random
sequences of pushes, pulls, evictions and restarts, after each of which every pull must
reproduce the pushed weights bit for bit and read exactly the chunks that differ from
what the puller held.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlaxkit.param_server import InProcessParameterServer, TensorStoreParameterServer
from rlaxkit.param_server.delta import (
    ChunkLayout,
    apply_chunks,
    byte_view,
    changed_chunks,
    chunk_checksums,
    gather_chunks,
    num_chunks,
    patch_chunks,
    patch_nbytes,
    word_patches,
)
from rlaxkit.param_server.delta_store import DeltaParameterServer, delta_keep

# ----------------------------------------------------------------- pure functions
buffers = st.lists(st.binary(min_size=0, max_size=64), min_size=1, max_size=4)


@settings(max_examples=200, deadline=None)
@given(old=buffers, chunk_bytes=st.integers(1, 17), data=st.data())
def test_applying_the_changed_chunks_rebuilds_the_new_buffers(old, chunk_bytes, data):
    old_arrays = [np.frombuffer(b, np.uint8).copy() for b in old]
    new_arrays = []
    for a in old_arrays:  # Same sizes; some bytes changed.
        flips = data.draw(st.lists(st.integers(0, max(0, a.size - 1)), max_size=4))
        b = a.copy()
        for i in flips:
            if a.size:
                b[i] ^= 0xFF
        new_arrays.append(b)
    layout = ChunkLayout.of([a.size for a in old_arrays], chunk_bytes)
    old_sums = np.concatenate(
        [np.empty((0, 16), np.uint8)] + [chunk_checksums(a, chunk_bytes) for a in old_arrays]
    )
    new_sums = np.concatenate(
        [np.empty((0, 16), np.uint8)] + [chunk_checksums(a, chunk_bytes) for a in new_arrays]
    )
    ids = changed_chunks(old_sums, new_sums)
    # Exactly the chunks whose bytes differ, found by comparing the bytes themselves.
    differ = [
        g
        for g in range(layout.num_chunks)
        if not np.array_equal(
            old_arrays[layout.leaf[g]][layout.start[g] : layout.start[g] + layout.size[g]],
            new_arrays[layout.leaf[g]][layout.start[g] : layout.start[g] + layout.size[g]],
        )
    ]
    assert ids.tolist() == differ
    payload = gather_chunks(new_arrays, layout, ids)
    assert payload.size == layout.payload_bytes(ids)
    rebuilt = apply_chunks(old_arrays, layout, ids, payload)
    for got, want, base in zip(rebuilt, new_arrays, old_arrays, strict=True):
        assert got.tobytes() == want.tobytes()
        assert got is base or not np.shares_memory(got, base)  # The base is never written.
    # From nothing, every chunk rebuilds the buffers too.
    everything = changed_chunks(None, new_sums)
    full = apply_chunks(
        [None] * len(new_arrays), layout, everything, gather_chunks(new_arrays, layout, everything)
    )
    assert [a.tobytes() for a in full] == [a.tobytes() for a in new_arrays]


@settings(max_examples=100, deadline=None)
@given(old=buffers, chunk_bytes=st.integers(1, 17), data=st.data())
def test_word_patches_rebuild_the_new_chunks_from_the_old(old, chunk_bytes, data):
    old_arrays = [np.frombuffer(b, np.uint8).copy() for b in old]
    new_arrays = [
        np.frombuffer(data.draw(st.binary(min_size=a.size, max_size=a.size)), np.uint8).copy()
        for a in old_arrays
    ]
    layout = ChunkLayout.of([a.size for a in old_arrays], chunk_bytes)
    drawn = data.draw(st.sets(st.integers(0, max(0, layout.num_chunks - 1))))
    ids = np.asarray(sorted(g for g in drawn if g < layout.num_chunks), np.int64)
    patches = word_patches(old_arrays, new_arrays, layout, ids)
    if np.any(layout.size[ids] % 2):
        assert patches is None  # odd chunks are not patched
        return
    masks, values, counts = patches
    assert masks.size + values.nbytes == patch_nbytes(layout, ids, counts)
    patched = [a.copy() for a in old_arrays]
    patch_chunks(patched, layout, ids, masks, values, counts)
    expected = apply_chunks(old_arrays, layout, ids, gather_chunks(new_arrays, layout, ids))
    assert [a.tobytes() for a in patched] == [a.tobytes() for a in expected]


@given(nbytes=st.integers(0, 1000), chunk_bytes=st.integers(1, 100))
def test_the_layout_covers_each_leaf_once(nbytes, chunk_bytes):
    layout = ChunkLayout.of([nbytes, 3], chunk_bytes)
    assert layout.num_chunks == num_chunks(nbytes, chunk_bytes) + num_chunks(3, chunk_bytes)
    assert int(layout.size[layout.leaf == 0].sum()) == nbytes
    assert np.all(layout.size > 0)


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="chunk_bytes"):
        ChunkLayout.of([4], 0)
    with pytest.raises(ValueError, match="snapshot_every"):
        DeltaParameterServer(InProcessParameterServer(keep=2), snapshot_every=0)
    # The store must keep the versions a newest version's chunks may lie in.
    # (Checked at the first push: only the pusher's store evicts.)
    with pytest.raises(ValueError, match="snapshot_every.*delta_keep"):
        DeltaParameterServer(InProcessParameterServer(keep=2), snapshot_every=4).push(1, {})


# ----------------------------------------------------------------- the store
def weights_at(rng: np.random.Generator) -> dict:
    """A tree with leaves of several dtypes and sizes, an empty one and a scalar."""
    import ml_dtypes

    return {
        "embed": rng.standard_normal((7, 5)).astype(np.float32),
        "kernel": rng.standard_normal((4, 3)).astype(ml_dtypes.bfloat16),
        "empty": np.zeros((0, 3), np.float32),
        "step": np.asarray(rng.integers(100), np.int32),
    }


def perturb(weights: dict, rng: np.random.Generator, how: str) -> dict:
    """New weights: ``how`` is ``none``, ``one`` (one element), ``all`` or ``shape``."""
    out = {k: np.array(v, copy=True) for k, v in weights.items()}
    if how == "one":
        out["embed"][rng.integers(7), rng.integers(5)] += 1.0
    elif how == "all":
        out = {k: (v + 1).astype(v.dtype) for k, v in out.items()}
    elif how == "shape":  # The tree changes: a leaf grows.
        out["embed"] = rng.standard_normal((8, 5)).astype(np.float32)
    return out


def differing_bytes(held: dict | None, new: dict, chunk_bytes: int) -> tuple[int, int]:
    """``(bytes of the chunks in which new differs from held, bytes of their word
    patches)`` (every chunk, and no patch, if the trees differ), by comparing the bytes
    themselves: a patch is a bit per 16-bit word, rounded up to bytes, and 2 bytes per
    changed word."""
    keys = list(new)
    layout = ChunkLayout.of([new[k].nbytes for k in keys], chunk_bytes)
    if held is None or [held[k].shape for k in keys] != [new[k].shape for k in keys]:
        return int(layout.size.sum()), -1
    old_bytes = [byte_view(held[k]) for k in keys]
    new_bytes = [byte_view(new[k]) for k in keys]
    total = patch = 0
    for g in range(layout.num_chunks):
        span = slice(layout.start[g], layout.start[g] + layout.size[g])
        before, after = old_bytes[layout.leaf[g]][span], new_bytes[layout.leaf[g]][span]
        if not np.array_equal(before, after):
            total += int(layout.size[g])
            if before.size % 2:
                patch = -1  # odd chunks are never patched
            elif patch >= 0:
                changed = before.view(np.uint16) != after.view(np.uint16)
                patch += -(-changed.size // 8) + 2 * int(changed.sum())
    return total, patch


def assert_bitwise_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, leaf in want.items():
        pulled = np.asarray(got[key])
        assert pulled.dtype == leaf.dtype and pulled.shape == leaf.shape, key
        assert pulled.tobytes() == leaf.tobytes(), key


push_ops = st.tuples(st.just("push"), st.sampled_from(["one", "none", "all", "shape"]))
pull_ops = st.tuples(st.just("pull"), st.integers(0, 2))
# Pushes and pulls three times as often as restarts, so that chains of deltas form.
operations = st.lists(
    st.one_of(
        push_ops,
        push_ops,
        push_ops,
        pull_ops,
        pull_ops,
        pull_ops,
        st.tuples(st.just("restart_puller"), st.integers(0, 2)),
        st.tuples(st.just("restart_pusher"), st.just(0)),
    ),
    min_size=1,
    max_size=25,
)


class Scenario:
    """A pusher and three pullers on one store; checks every pull against the truth."""

    def __init__(self, make_inner, make_reader, snapshot_every: int, chunk_bytes: int):
        self.make_inner, self.make_reader = make_inner, make_reader
        self.options = {"snapshot_every": snapshot_every, "chunk_bytes": chunk_bytes}
        self.inner = make_inner()
        self.pusher = DeltaParameterServer(self.inner, **self.options)
        self.pullers = [self.new_puller() for _ in range(3)]
        self.held: list[dict | None] = [None] * 3
        self.held_version: list[int | None] = [None] * 3
        self.rng = np.random.default_rng(0)
        self.weights = weights_at(self.rng)
        self.version = 0

    def new_puller(self) -> DeltaParameterServer:
        return DeltaParameterServer(self.make_reader(self.inner), **self.options)

    def run(self, ops) -> None:
        for op, arg in ops:
            if op == "push":
                self.weights = (
                    perturb(self.weights, self.rng, arg) if self.version else self.weights
                )
                self.version += 1
                self.pusher.push(self.version, self.weights)
            elif op == "pull" and self.version:
                self.pull(arg)
            elif op == "restart_puller":
                self.pullers[arg], self.held[arg] = self.new_puller(), None
                self.held_version[arg] = None
            elif op == "restart_pusher":  # The same store, a new client: a full snapshot next.
                self.pusher = DeltaParameterServer(self.make_reader(self.inner), **self.options)
        if self.version:
            for i in range(3):
                self.pull(i)

    def pull(self, i: int) -> None:
        puller = self.pullers[i]
        version, params = puller.pull(timeout=0)
        assert version == self.version
        assert_bitwise_equal(params, self.weights)
        moved = puller.stats.last("pull").bytes
        chunks, patches = differing_bytes(self.held[i], self.weights, self.options["chunk_bytes"])
        record = self.inner.read(version)
        patched = int(record["patch_base"]) >= 0  # the push stored word patches
        if self.held[i] is not None and self.held[i] is self.weights:
            assert moved == 0  # It holds this version already: no read at all.
        elif patched and self.held_version[i] == int(record["patch_base"]):
            # One version behind: the patches, with their per-chunk counts.
            assert moved - puller.metadata_bytes - record["patch_counts"].nbytes == patches
            assert patches < chunks
        else:
            assert moved - puller.metadata_bytes == chunks
        self.held[i], self.held_version[i] = self.weights, version


@settings(max_examples=100, deadline=None)
@given(ops=operations, snapshot_every=st.integers(1, 4), chunk_bytes=st.sampled_from([8, 64, 3]))
def test_delta_pulls_are_bitwise_exact_in_process(ops, snapshot_every, chunk_bytes):
    # The store keeps only what the newest version needs, so held versions are evicted.
    Scenario(
        lambda: InProcessParameterServer(keep=snapshot_every),
        lambda inner: inner,
        snapshot_every,
        chunk_bytes,
    ).run(ops)


@settings(max_examples=8, deadline=None)
@given(ops=operations, snapshot_every=st.integers(1, 3))
def test_delta_pulls_are_bitwise_exact_through_tensorstore(tmp_path_factory, ops, snapshot_every):
    directory = tmp_path_factory.mktemp("delta")
    # Readers are other store objects on the directory, as other processes would be.
    Scenario(
        lambda: TensorStoreParameterServer(directory, keep=snapshot_every),
        lambda inner: TensorStoreParameterServer(directory, keep=snapshot_every),
        snapshot_every,
        8,
    ).run(ops)


def test_full_snapshots_come_every_k_pushes_and_deltas_hold_only_changes():
    inner = InProcessParameterServer(keep=3)
    store = DeltaParameterServer(inner, snapshot_every=3, chunk_bytes=4)
    weights = {"w": np.zeros(8, np.float32)}  # 32 bytes: 8 chunks
    for version in range(1, 8):
        weights = {"w": weights["w"].copy()}
        weights["w"][version % 8] = version  # One chunk changes per push.
        store.push(version, weights)
        assert inner.read(version)["changed"].size == (8 if version in (1, 4, 7) else 1)
    # A push with nothing changed stores no chunk, and its pull reads none.
    reader = DeltaParameterServer(inner, snapshot_every=3, chunk_bytes=4)
    reader.pull()
    store.push(8, weights)
    assert inner.read(8)["changed"].size == 0
    reader.pull()
    assert reader.stats.last("pull").bytes == reader.metadata_bytes


def test_a_new_reader_reads_each_chunk_once_from_where_it_was_last_written():
    inner = InProcessParameterServer(keep=4)
    store = DeltaParameterServer(inner, snapshot_every=4, chunk_bytes=4)
    weights = np.zeros(8, np.float32)
    for version in range(1, 5):
        weights = weights.copy()
        weights[:version] = version  # chunks 0..version-1 change
        store.push(version, {"w": weights})
    assert inner.read(4)["owner"].tolist() == [4, 4, 4, 4, 1, 1, 1, 1]
    reader = DeltaParameterServer(inner, snapshot_every=4, chunk_bytes=4)
    version, params = reader.pull()
    assert version == 4 and params["w"].tobytes() == weights.tobytes()
    assert reader.stats.last("pull").bytes - reader.metadata_bytes == weights.nbytes  # once


def test_an_nnx_state_comes_back_in_its_structure(tiny_model, tmp_path):
    import jax
    from flax import nnx

    state = nnx.state(tiny_model, nnx.Param)
    writer = DeltaParameterServer(TensorStoreParameterServer(tmp_path, keep=2), snapshot_every=2)
    writer.push(1, state)
    # With a template, and without one (the records carry the tree's skeleton).
    for template in (state, None):
        reader = DeltaParameterServer(
            TensorStoreParameterServer(tmp_path), snapshot_every=2, template=template
        )
        version, pulled = reader.pull(min_version=1, timeout=5)
        assert isinstance(pulled, nnx.State)
        assert jax.tree.structure(pulled) == jax.tree.structure(state)
        for got, want in zip(jax.tree.leaves(pulled), jax.tree.leaves(state), strict=True):
            assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


@pytest.mark.ray
def test_delta_pulls_through_the_ray_object_store(ray_cluster):
    import ray

    from rlaxkit.param_server.ray_store import RayObjectStoreParameterServer, parameter_server_actor

    actor = parameter_server_actor(keep=delta_keep(1, 2))
    pusher = DeltaParameterServer(
        RayObjectStoreParameterServer(actor), snapshot_every=2, chunk_bytes=8
    )
    reader = DeltaParameterServer(
        RayObjectStoreParameterServer(actor, to_device=False), snapshot_every=2, chunk_bytes=8
    )
    rng = np.random.default_rng(0)
    weights, held = weights_at(rng), None
    for version in range(1, 7):
        weights = perturb(weights, rng, "one") if version > 1 else weights
        pusher.push(version, weights)
        if version in (1, 2, 5, 6):  # 3 and 4 pass unseen: the held version is evicted
            got, params = reader.pull(min_version=version, timeout=10)
            assert got == version
            assert_bitwise_equal(params, weights)
            moved = reader.stats.last("pull").bytes - reader.metadata_bytes
            chunks, patches = differing_bytes(held, weights, 8)
            assert moved in (chunks, patches + 8)  # chunks, or patches and their count
            held = weights
    # Each part of a record is an object of its own, fetched when a pull uses it.
    record = reader.inner.read(6)
    assert not isinstance(record, dict) and "payload" in record and len(record) == 10
    assert int(record["patch_base"]) == 5
    ray.kill(actor)


# ----------------------------------------------------------------- the run config
def test_the_config_turns_delta_on_and_checks_it():
    from rlaxkit.config.run import RunConfig
    from rlaxkit.param_server import ParamServerConfig

    config = RunConfig.from_overrides(["param_server.delta=true", "param_server.snapshot_every=2"])
    assert config.param_server == ParamServerConfig(delta=True, snapshot_every=2)
    with pytest.raises(ValueError, match="chunk_bytes"):
        RunConfig.from_overrides(["param_server.chunk_bytes=16"])
    with pytest.raises(ValueError, match="snapshot_every.*keep_versions"):
        RunConfig.from_overrides(["param_server.delta=true", "param_server.snapshot_every=8"])


def test_a_local_run_learns_the_same_with_delta_publication(tmp_path):
    from rlaxkit.config.run import small_run_config
    from rlaxkit.runtime import Experiment

    runs = {}
    for delta in ("false", "true"):
        config = small_run_config(f"param_server.delta={delta}", "param_server.chunk_bytes=4096")
        with Experiment(config, cache_dir=tmp_path) as exp:
            runs[delta] = [
                {k: v for k, v in m.items() if not k.startswith(("time/", "throughput/"))}
                for m in exp.run(3)
            ]
            store = exp.parts.store
            assert isinstance(store, DeltaParameterServer) == (delta == "true")
            if delta == "true":  # the workers' pulls went through it
                assert store.stats.count["pull"] > 0 and store.stats.count["push"] == 4
    assert runs["true"] == runs["false"]
