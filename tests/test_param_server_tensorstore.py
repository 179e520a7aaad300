"""The TensorStore store in one process: formats, templates, leases, mapped reads, debris."""

import fcntl
import gc
import json
import os
import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from flax import nnx

from rlaxkit.param_server import InProcessParameterServer, TensorStoreParameterServer, layout
from rlaxkit.param_server.layout import chunk_shape, version_dirname
from rlaxkit.param_server.treepaths import nested_dict


def assert_bits_equal(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("chunk_bytes", [None, 4096], ids=["mapped", "chunked"])
def test_every_dtype_and_shape_round_trips_bit_exact(tmp_path, chunk_bytes):
    rng = np.random.default_rng(0)
    tree = {
        "f32": rng.standard_normal((33, 7), np.float32),
        "bf16": rng.standard_normal((5, 6)).astype(ml_dtypes.bfloat16),
        "f16": rng.standard_normal(9).astype(np.float16),
        "f8": rng.standard_normal(9).astype(ml_dtypes.float8_e4m3fn),
        "i8": rng.integers(-128, 127, (4, 4), dtype=np.int8),
        "u32": rng.integers(0, 2**32 - 1, 3, dtype=np.uint32),
        "mask": rng.random((2, 3)) > 0.5,
        "scalar": np.float32(np.nan),  # NaN payload bits survive too.
        "empty": np.zeros((0, 4), np.float32),
        # 40 000 bytes; chunked: in chunks of 4 096 bytes at most, a ragged last one.
        "large": rng.standard_normal((100, 100), np.float32),
    }
    store = TensorStoreParameterServer(tmp_path, chunk_bytes=chunk_bytes)
    store.push(0, tree)
    _, pulled = TensorStoreParameterServer(tmp_path, template=tree).pull()
    jax.tree.map(assert_bits_equal, pulled, tree)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(pulled))
    # Every leaf is a zarr3 array that TensorStore itself reads back.
    manifest = json.loads((tmp_path / version_dirname(0) / "manifest.json").read_text())
    for leaf in manifest["leaves"]:
        path = str(tmp_path / version_dirname(0) / leaf["array"])
        array = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}})
        assert_bits_equal(array.result().read().result(), tree[leaf["path"][0][1]])


def test_chunk_shapes_stay_under_the_target():
    assert chunk_shape((1024, 1024), 4, 1 << 20) == [256, 1024]
    assert chunk_shape((3, 5), 4, 1 << 20) == [3, 5]  # Small: one chunk.
    assert chunk_shape((2, 1000), 4, 1000) == [1, 250]  # One row is too big: split it.
    assert chunk_shape((), 4, 1) == []
    assert chunk_shape((0, 8), 2, 64) == [1, 8]


def test_a_reader_with_only_the_path_gets_a_nested_dict(tmp_path):
    writer = TensorStoreParameterServer(tmp_path)
    writer.push(1, {"a": {"b": np.ones(2)}, "seq": (np.zeros(1), np.ones(1))})
    version, pulled = TensorStoreParameterServer(tmp_path).pull()
    assert version == 1
    assert set(pulled) == {"a", "seq"} and set(pulled["seq"]) == {0, 1}
    np.testing.assert_array_equal(pulled["a"]["b"], np.ones(2))


def test_nnx_state_from_another_reader_via_template_or_pure_dict(tmp_path, tiny_model):
    state = nnx.state(tiny_model, nnx.Param)
    TensorStoreParameterServer(tmp_path).push(3, state)

    abstract = nnx.eval_shape(lambda: nnx.state(tiny_model, nnx.Param))
    _, from_template = TensorStoreParameterServer(tmp_path, template=abstract).pull()
    assert isinstance(from_template, nnx.State)
    jax.tree.map(assert_bits_equal, from_template, state)

    _, pure = TensorStoreParameterServer(tmp_path).pull()
    assert jax.tree.structure(pure) == jax.tree.structure(state.to_pure_dict())
    nnx.replace_by_pure_dict(abstract, pure)
    jax.tree.map(assert_bits_equal, abstract, state)


def test_a_template_that_does_not_match_is_refused(tmp_path):
    TensorStoreParameterServer(tmp_path).push(1, {"w": np.ones((2, 3), np.float32)})
    wrong_name = TensorStoreParameterServer(tmp_path, template={"v": np.ones((2, 3), np.float32)})
    with pytest.raises(ValueError, match=r"not in template: \['w'\]"):
        wrong_name.pull()
    wrong_shape = TensorStoreParameterServer(tmp_path, template={"w": np.ones(6, np.float32)})
    with pytest.raises(ValueError, match=r"\['w'\]: stored float32\[2, 3\], template wants"):
        wrong_shape.pull()


def test_nested_dict_refuses_colliding_leaves():
    paths = [[["key", "a"]], [["key", "a"], ["key", "b"]]]
    with pytest.raises(ValueError, match="collides"):
        nested_dict(paths, [1, 2])


def test_a_reader_mid_copy_is_never_corrupted_and_never_stalls_the_writer(tmp_path):
    """A reader pauses inside its pull holding version 1; the writer pushes on with
    ``keep=1``, deferring version 1's eviction until the reader has let go."""
    writer = TensorStoreParameterServer(tmp_path, keep=1, durable=False)
    leaves = {f"w{i}": np.full((64, 64), 1.0, np.float32) for i in range(4)}
    writer.push(1, leaves)
    reader = TensorStoreParameterServer(tmp_path)
    holding, release = threading.Event(), threading.Event()

    def pause_on_first_leaf(i: int) -> None:
        if i == 0:
            holding.set()
            assert release.wait(timeout=20)

    reader._leaf_read_hook = pause_on_first_leaf
    result = {}
    thread = threading.Thread(target=lambda: result.update(got=reader.pull()))
    thread.start()
    assert holding.wait(timeout=20)
    start = time.perf_counter()
    for version in (2, 3, 4):
        writer.push(version, {k: np.full((64, 64), version, np.float32) for k in leaves})
    assert time.perf_counter() - start < 5.0
    assert writer.deferred_evictions >= 1
    assert (tmp_path / version_dirname(1)).is_dir(), "evicted while a reader held it"
    assert writer.versions() == [1, 4]
    release.set()
    thread.join(timeout=20)
    version, params = result.pop("got")
    assert version == 1
    for leaf in params.values():
        np.testing.assert_array_equal(leaf, np.full((64, 64), 1.0, np.float32))
    # The pulled arrays map version 1's files: it stays while they are alive.
    writer.push(5, {k: np.full((64, 64), 5, np.float32) for k in leaves})
    assert writer.versions() == [1, 5]
    del params, leaf
    gc.collect()  # JAX lets go of aliased host buffers lazily: at its next call or a gc pass.
    writer.push(6, {k: np.full((64, 64), 6, np.float32) for k in leaves})
    assert writer.versions() == [6]


def test_a_reader_that_finds_its_version_evicted_reads_the_newest(tmp_path):
    store = TensorStoreParameterServer(tmp_path, keep=1, durable=False)
    store.push(1, {"w": np.ones(3)})
    # As if a reader read the pointer (version 1), then the writer moved on and evicted.
    assert store._read_version(1) is not None
    store.push(2, {"w": np.full(3, 2.0)})
    assert store._read_version(1) is None
    assert store.pull()[0] == 2


def test_the_writer_never_evicts_under_an_exclusive_lock_it_cannot_take(tmp_path):
    store = TensorStoreParameterServer(tmp_path, keep=1, durable=False)
    store.push(1, {"w": np.ones(3)})
    with open(tmp_path / version_dirname(1) / "manifest.json") as lease:
        fcntl.flock(lease.fileno(), fcntl.LOCK_SH)
        store.push(2, {"w": np.ones(3)})
        assert store.versions() == [1, 2]
    store.push(3, {"w": np.ones(3)})
    assert store.versions() == [3]


def test_debris_of_dead_writers_is_removed_and_unnamed_versions_stay_invisible(tmp_path):
    store = TensorStoreParameterServer(tmp_path, durable=False)
    store.push(1, {"w": np.ones(3)})
    dead_pid = 2**22 + 12345  # Above Linux's default pid_max of 4 194 304: never alive.
    (tmp_path / f".tmp-v000000000002-{dead_pid}-abcd1234").mkdir()
    (tmp_path / f".trash-v000000000000-{dead_pid}-abcd1234").mkdir()
    orphan = tmp_path / version_dirname(2)  # Renamed into place, pointer never updated.
    orphan.mkdir()
    (orphan / "manifest.json").write_text("{}")
    assert store.latest_version() == 1 and store.versions() == [1]
    assert store.pull()[0] == 1
    store.push(2, {"w": np.full(3, 2.0)})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest.json",
        version_dirname(1),
        version_dirname(2),
    ]
    assert json.loads((tmp_path / "latest.json").read_text())["version"] == 2
    np.testing.assert_array_equal(store.pull()[1]["w"], np.full(3, 2.0))


def test_a_failed_push_leaves_nothing_behind(tmp_path):
    store = TensorStoreParameterServer(tmp_path, durable=False)
    store.push(1, {"w": np.ones(3)})
    with pytest.raises(ValueError, match="neither str nor int"):
        store.push(2, {("tuple", "key"): np.ones(3)})
    with pytest.raises(ValueError, match=r"leaf \['w'\]: cannot store a <U1 array"):
        store.push(2, {"w": np.array(["a", "b"])})
    assert sorted(os.listdir(tmp_path)) == ["latest.json", version_dirname(1)]
    store.push(2, {"w": np.ones(3)})
    assert store.latest_version() == 2


def test_in_process_copy_on_push_survives_donated_buffers():
    double = jax.jit(lambda p: jax.tree.map(lambda x: x * 2, p), donate_argnums=0)
    sharing, copying = InProcessParameterServer(), InProcessParameterServer(copy_on_push=True)
    shared, copied = {"w": jnp.ones(4)}, {"w": jnp.ones(4)}
    sharing.push(1, shared)
    copying.push(1, copied)
    double(shared)
    double(copied)
    assert sharing.pull()[1]["w"].is_deleted()  # Why a donating trainer needs the copy.
    np.testing.assert_array_equal(copying.pull()[1]["w"], np.ones(4))


def test_the_manifest_names_every_leaf_by_key_path(tmp_path):
    store = TensorStoreParameterServer(tmp_path, durable=False)
    store.push(1, {"layers": [{"kernel": np.zeros((2, 2), np.float32)}]})
    manifest = json.loads((tmp_path / version_dirname(1) / "manifest.json").read_text())
    (leaf,) = manifest["leaves"]
    assert leaf["path"] == [["key", "layers"], ["index", 0], ["key", "kernel"]]
    assert (leaf["dtype"], leaf["shape"]) == ("float32", [2, 2])
    assert manifest["bytes"] == 16 and manifest["version"] == 1


def test_evicted_versions_leave_the_disk_but_one_spare(tmp_path):
    store = TensorStoreParameterServer(tmp_path, keep=2)
    for version in range(1, 6):
        store.push(version, {"w": np.full(3, version)})
    store.wait_for_cleanup()
    names = sorted(os.listdir(tmp_path))
    spares = [name for name in names if name.startswith(".spare-v")]
    assert len(spares) == 1, names  # Version 3's files, for push 6 to overwrite.
    assert sorted(set(names) - set(spares)) == ["latest.json", *map(version_dirname, (4, 5))]


def raw_file(directory, version: int, leaf: int = 0):
    manifest = json.loads((directory / version_dirname(version) / "manifest.json").read_text())
    entry = manifest["leaves"][leaf]
    return directory / version_dirname(version) / entry["array"] / entry["raw"]


def test_a_push_overwrites_the_files_of_the_version_it_evicted(tmp_path):
    store = TensorStoreParameterServer(tmp_path, keep=1)
    for version in (1, 2):
        store.push(version, {"w": np.full((64, 64), version, np.float32)})
    inode_of_2 = raw_file(tmp_path, 2).stat().st_ino
    store.push(3, {"w": np.full((64, 64), 3, np.float32)})  # Version 1's files, recycled.
    store.push(4, {"w": np.full((64, 64), 4, np.float32)})
    assert raw_file(tmp_path, 4).stat().st_ino == inode_of_2
    version, params = TensorStoreParameterServer(tmp_path).pull()
    assert version == 4
    np.testing.assert_array_equal(params["w"], np.full((64, 64), 4, np.float32))
    del params
    gc.collect()
    # A tree of another shape cannot reuse them: the spare is deleted, new files written.
    store.push(5, {"w": np.full((8, 8), 5, np.float32), "b": np.zeros(3, np.float32)})
    store.wait_for_cleanup()
    _, params = TensorStoreParameterServer(tmp_path).pull()
    np.testing.assert_array_equal(params["w"], np.full((8, 8), 5, np.float32))
    np.testing.assert_array_equal(params["b"], np.zeros(3, np.float32))


def test_a_recycled_version_takes_a_tree_with_an_empty_leaf(tmp_path):
    store = TensorStoreParameterServer(tmp_path, keep=1)
    for version in range(1, 5):  # From version 3 on, pushes write over a spare.
        store.push(version, {"w": np.full(4, version, np.float32), "e": np.zeros(0, np.int64)})
    _, params = TensorStoreParameterServer(tmp_path).pull()
    np.testing.assert_array_equal(params["w"], np.full(4, 4, np.float32))
    assert params["e"].shape == (0,)


def mapped_files() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split(maxsplit=5)[5].strip() for line in f if len(line.split()) == 6}


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_a_pull_maps_the_leaf_files_and_holds_the_version_while_they_live(tmp_path):
    writer = TensorStoreParameterServer(tmp_path, keep=1)
    writer.push(1, {"w": np.full((64, 64), 1, np.float32), "b": np.ones(5, np.int8)})
    _, params = TensorStoreParameterServer(tmp_path).pull()
    files = {str(raw_file(tmp_path, 1, leaf)) for leaf in (0, 1)}
    assert files <= mapped_files(), "the pulled leaves are not the mapped files"
    writer.push(2, {"w": np.zeros((64, 64), np.float32), "b": np.zeros(5, np.int8)})
    writer.push(3, {"w": np.zeros((64, 64), np.float32), "b": np.zeros(5, np.int8)})
    assert writer.versions() == [1, 3], "a version evicted (or overwritten) while mapped"
    np.testing.assert_array_equal(params["w"], np.full((64, 64), 1, np.float32))
    del params
    gc.collect()  # JAX lets go of aliased host buffers lazily: at its next call or a gc pass.
    assert not files & mapped_files()
    writer.push(4, {"w": np.zeros((64, 64), np.float32), "b": np.zeros(5, np.int8)})
    assert writer.versions() == [4]


def test_a_damaged_snapshot_is_refused_not_read_as_zeros(tmp_path):
    store = TensorStoreParameterServer(tmp_path)
    store.push(1, {"w": np.ones((16, 16), np.float32), "b": np.ones(4, np.float32)})
    w = raw_file(tmp_path, 1, 1)  # Leaves in key order: "b", then "w".
    os.truncate(w, 100)  # As a machine crash before the data reached the disk may leave it.
    with pytest.raises(ValueError, match=r"100 bytes on disk, the manifest says 1024.*damaged"):
        store.pull()
    w.unlink()
    with pytest.raises(ValueError, match="missing; the snapshot is damaged"):
        store.pull()


def test_a_file_system_that_cannot_map_gets_copies(tmp_path, monkeypatch):
    store = TensorStoreParameterServer(tmp_path)
    store.push(1, {"w": np.arange(12, dtype=np.float32).reshape(3, 4)})

    def cannot_map(*args, **kwargs):
        raise OSError(19, "No such device")  # ENODEV: what mmap says on such file systems

    monkeypatch.setattr(layout, "map_array", cannot_map)
    _, params = store.pull()
    np.testing.assert_array_equal(params["w"], np.arange(12, dtype=np.float32).reshape(3, 4))
