"""The TensorStore store across processes: readers that know only the directory, a
writer killed mid-push, and a reader in another process holding a version.

Each child is a fresh Python (``sys.executable -c``), as an inference worker would be.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from rlaxkit.param_server import TensorStoreParameterServer
from rlaxkit.param_server.layout import version_dirname

REPO_ROOT = Path(__file__).resolve().parents[1]

# Every element of version v equals v, so a reader can tell a mixture of versions.
LEAVES_AT = """
import numpy as np
def leaves_at(version):
    return {f"w{i}": np.full((256, 1024), version, np.float32) for i in range(4)}  # 4 x 1 MiB
"""

READER = (
    LEAVES_AT
    + """
import json, sys
from rlaxkit.param_server import TensorStoreParameterServer
directory, last = sys.argv[1], int(sys.argv[2])
store = TensorStoreParameterServer(directory)
print("ready", flush=True)
seen = []
while not seen or seen[-1] < last:
    version, params = store.pull(min_version=seen[-1] + 1 if seen else None, timeout=60)
    for name, leaf in params.items():
        assert (np.asarray(leaf) == version).all(), f"{name} of version {version} is mixed"
    seen.append(version)
print(json.dumps(seen), flush=True)
"""
)

WRITER_KILLED_MID_PUSH = (
    LEAVES_AT
    + """
import sys, time
from rlaxkit.param_server import TensorStoreParameterServer
directory, marker = sys.argv[1], sys.argv[2]
store = TensorStoreParameterServer(directory, keep=2)
for version in (1, 2):
    store.push(version, leaves_at(version))
def stall(leaf_index):
    if leaf_index == 1:  # Two of four leaves written: stop here until killed.
        open(marker, "w").close()
        time.sleep(600)
store._leaf_written_hook = stall
store.push(3, leaves_at(3))
"""
)

SLOW_READER = """
import os, sys, time
import numpy as np
from rlaxkit.param_server import TensorStoreParameterServer
directory, holding, release = sys.argv[1], sys.argv[2], sys.argv[3]
store = TensorStoreParameterServer(directory)
def pause(leaf_index):
    if leaf_index == 0:  # Mid-copy, holding the version's lease.
        open(holding, "w").close()
        while not os.path.exists(release):
            time.sleep(0.01)
store._leaf_read_hook = pause
version, params = store.pull(timeout=60)
print(version, sorted({float(v) for leaf in params.values() for v in np.unique(leaf)}), flush=True)
"""


def spawn(script: str, *args: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def leaves_at(version: int) -> dict:
    namespace: dict = {}
    exec(LEAVES_AT, namespace)
    return namespace["leaves_at"](version)


def wait_for_file(path: Path, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"child exited ({proc.returncode}) early: {proc.stderr.read()}")
        assert time.monotonic() < deadline, f"{path.name} did not appear"
        time.sleep(0.01)


def test_another_process_pulls_the_newest_version_while_the_trainer_pushes(tmp_path):
    last = 15
    with spawn(READER, tmp_path, last) as reader:
        try:
            assert reader.stdout.readline().strip() == "ready", reader.stderr.read()
            writer = TensorStoreParameterServer(tmp_path, keep=2)
            for version in range(1, last + 1):
                writer.push(version, leaves_at(version))
                time.sleep(0.02)
            out, err = reader.communicate(timeout=60)
        finally:
            reader.kill()
    assert reader.returncode == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen[-1] == last
    assert seen == sorted(set(seen)), f"versions went back or repeated: {seen}"
    assert len(seen) >= 2, "the reader should have caught versions while they were pushed"


def test_a_writer_killed_mid_push_leaves_the_last_complete_version(tmp_path):
    marker = tmp_path / "stalled"
    directory = tmp_path / "ps"
    with spawn(WRITER_KILLED_MID_PUSH, directory, marker) as writer:
        try:
            wait_for_file(marker, writer)
            os.kill(writer.pid, signal.SIGKILL)
            writer.communicate(timeout=30)
        finally:
            writer.kill()
    assert writer.returncode == -signal.SIGKILL
    (partial,) = [p for p in directory.iterdir() if p.name.startswith(".tmp-v000000000003-")]
    assert (partial / "00001").is_dir(), "the kill should land with leaves already written"
    assert not (partial / "manifest.json").exists()

    reader = TensorStoreParameterServer(directory)
    assert reader.latest_version() == 2
    version, params = reader.pull()
    assert version == 2
    for leaf in params.values():
        np.testing.assert_array_equal(leaf, np.full((256, 1024), 2.0, np.float32))
    with pytest.raises(TimeoutError):
        reader.pull(min_version=3, timeout=0.05)

    successor = TensorStoreParameterServer(directory, keep=2)
    successor.push(3, leaves_at(3))
    successor.wait_for_cleanup()
    # The dead writer's partial push is gone; version 1 stays only as the spare files
    # the successor's next push will overwrite.
    names = sorted(p.name for p in directory.iterdir() if not p.name.startswith(".spare-v0"))
    assert names == ["latest.json", version_dirname(2), version_dirname(3)]
    version, params = reader.pull(min_version=3, timeout=5)
    assert version == 3 and all((np.asarray(x) == 3).all() for x in params.values())


def test_a_reader_in_another_process_holds_its_version_without_stalling_pushes(tmp_path):
    directory = tmp_path / "ps"
    writer = TensorStoreParameterServer(directory, keep=1, durable=False)
    writer.push(1, leaves_at(1))
    holding, release = tmp_path / "holding", tmp_path / "release"
    with spawn(SLOW_READER, directory, holding, release) as reader:
        try:
            wait_for_file(holding, reader)
            start = time.perf_counter()
            for version in (2, 3, 4):
                writer.push(version, leaves_at(version))
            assert time.perf_counter() - start < 5.0
            assert writer.versions() == [1, 4], "version 1 is held and must outlive keep=1"
            release.touch()
            out, err = reader.communicate(timeout=60)
        finally:
            reader.kill()
    assert reader.returncode == 0, err
    assert out.split() == ["1", "[1.0]"]
    writer.push(5, leaves_at(5))
    assert writer.versions() == [5]
