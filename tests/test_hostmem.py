"""``rlaxkit.util.hostmem``: XLA:CPU keeps its freed buffers, so a call does not fault its
output's pages in again; each condition that leaves the settings alone says why."""

import json
import os
import platform
import subprocess
import sys

import pytest

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
# ``mallinfo2`` (the fast-bin count of the test below) came with glibc 2.33.
GLIBC_VERSION = tuple(int(x) for x in platform.libc_ver()[1].split(".")[:2] if x.isdigit())

# Eight calls of a program whose 64 MiB output is dropped after each: the page faults
# the eight calls take, and what rlaxkit.util.hostmem decided.
FAULTS = """
import json, resource
import rlaxkit.util.jaxutil
import jax, jax.numpy as jnp
from jax._src import xla_bridge
from rlaxkit.util import hostmem
f = jax.jit(lambda x: jnp.sin(x) * 2.0)
x = jnp.ones((16 * 1024 * 1024,), jnp.float32)
for _ in range(3):
    f(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(CALLS):
    f(x).block_until_ready()
print(json.dumps({
    "kept": hostmem.status().kept,
    "reason": hostmem.status().reason,
    "async_dispatch": xla_bridge._CPU_ENABLE_ASYNC_DISPATCH.value,
    "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before,
}))
"""

CALLS = 8
PAGES_PER_CALL = 16 * 1024 * 1024 * 4 // 4096
FAULTS = FAULTS.replace("CALLS", str(CALLS))


def run(script: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "JAX_PLATFORMS": "cpu"}
    environ.pop("RLAXKIT_HOST_MEMORY", None)
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-c", script], env=environ, capture_output=True, text=True, timeout=120
    )


def report(script: str, **env: str) -> dict:
    done = run(script, **env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="rlaxkit.util.hostmem acts on glibc only")
def test_kept_memory_spares_each_call_its_page_faults():
    kept = report(FAULTS)
    default = report(FAULTS, RLAXKIT_HOST_MEMORY="default")
    assert kept["kept"] and not kept["async_dispatch"]
    assert not default["kept"] and default["reason"] == "RLAXKIT_HOST_MEMORY=default"
    assert default["async_dispatch"]
    # glibc maps each 64 MiB output anew: its pages fault again on every call. Kept,
    # the heap grows only when an output is allocated before the previous one is
    # freed: one call's worth of faults or none on an idle machine, two in 1 of 8
    # processes run beside a busy one. At most three calls' worth, against seven.
    assert default["faults"] >= (CALLS - 1) * PAGES_PER_CALL
    assert kept["faults"] <= 3 * PAGES_PER_CALL


# Small blocks malloc'd and every other one freed, from this thread and no Python
# allocation between the frees: how many sit in glibc's fast bins. A fast bin holds a
# freed block until a later large malloc sweeps the whole bin at once; in a small GRPO
# step that sweep took 30-40 ms of one step in ten (docs/performance.md).
FAST_BINS = """
import ctypes, json
import rlaxkit.models
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd",
        "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
malloc, free, mallinfo2 = libc.malloc, libc.free, libc.mallinfo2
malloc.restype = ctypes.c_void_p
free.argtypes = [ctypes.c_void_p]
mallinfo2.restype = MallInfo2
blocks = [malloc(48) for _ in range(1000)]
i = 0
while i < 1000:
    free(blocks[i])
    i += 2
print(json.dumps({"fast_blocks": mallinfo2().smblks}))
"""


@pytest.mark.skipif(
    not GLIBC or GLIBC_VERSION < (2, 33), reason="counts fast bins with glibc 2.33's mallinfo2"
)
def test_kept_memory_has_no_fast_bins_to_sweep():
    assert report(FAST_BINS)["fast_blocks"] == 0
    # glibc's default, for contrast: what seven per-thread cache slots do not hold.
    assert report(FAST_BINS, RLAXKIT_HOST_MEMORY="default")["fast_blocks"] > 400


def test_settings_are_left_alone_for_an_accelerator_platform():
    decided = report(
        "import json; from rlaxkit.util import hostmem; s = hostmem.keep();"
        "print(json.dumps({'kept': s.kept, 'reason': s.reason}))",
        JAX_PLATFORMS="cuda",
    )
    assert decided == {"kept": False, "reason": "JAX runs on cuda"}


@pytest.mark.skipif(not GLIBC, reason="rlaxkit.util.hostmem acts on glibc only")
def test_a_backend_created_first_is_named():
    decided = report(
        "import json; import jax.numpy as jnp; jnp.ones(2); import rlaxkit.models;"
        "from rlaxkit.util import hostmem; s = hostmem.status();"
        "print(json.dumps({'kept': s.kept, 'reason': s.reason}))"
    )
    assert not decided["kept"]
    assert "import rlaxkit first" in decided["reason"]


def test_an_unknown_choice_names_the_variable_and_the_choices():
    done = run("import rlaxkit.models", RLAXKIT_HOST_MEMORY="always")
    assert done.returncode != 0
    assert "RLAXKIT_HOST_MEMORY='always': choose one of keep, default" in done.stderr


def test_long_lived_objects_leave_full_collections_while_the_loop_runs():
    import gc
    import weakref

    from rlaxkit.util.hostmem import FreezeAfterFullCollection

    class Node:
        pass

    before = gc.get_freeze_count()  # 0 unless an earlier test left a run open
    freezer = FreezeAfterFullCollection()
    try:
        gc.collect()
        freezer.step_done()  # outside the loop: nothing is frozen
        assert not freezer.frozen and gc.get_freeze_count() == before
        with freezer:
            held, dropped = Node(), Node()
            cycle = Node()
            cycle.self = cycle
            freezer.step_done()  # a full collection ran before: freeze
            assert freezer.frozen and gc.get_freeze_count() > before
            assert freezer._on_collection not in gc.callbacks
            # A frozen object still goes with its last reference; a frozen cycle waits.
            gone, cyclic = weakref.ref(dropped), weakref.ref(cycle)
            del dropped, cycle
            gc.collect()
            assert gone() is None and cyclic() is not None and held is not None
        # The loop's end unfreezes; the next loop waits for a full collection of its own.
        assert not freezer.frozen and gc.get_freeze_count() == 0
        with freezer:
            gc.collect(1)
            freezer.step_done()
            assert not freezer.frozen
            gc.collect()  # the cycle goes with it
            assert cyclic() is None
            freezer.step_done()
            assert freezer.frozen
    finally:
        freezer.close()
    assert gc.get_freeze_count() == 0 and freezer._on_collection not in gc.callbacks
    freezer.close()  # idempotent


def test_young_collections_wait_longer_while_a_loop_runs():
    import gc

    from rlaxkit.util.hostmem import YOUNG_THRESHOLD, FreezeAfterFullCollection

    saved = gc.get_threshold()
    one, two = FreezeAfterFullCollection(), FreezeAfterFullCollection()
    try:
        gc.set_threshold(700, 10, 10)
        with one:
            assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
            with one, two:  # nested blocks, and a second run's, share the raise
                assert gc.get_threshold()[0] == YOUNG_THRESHOLD
            two.__enter__()
        # The first block closed while the second is open: still raised until it closes.
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD
        two.close()
        assert gc.get_threshold() == (700, 10, 10)
        two.close()  # idempotent
        assert gc.get_threshold() == (700, 10, 10)
        gc.set_threshold(0, 10, 10)  # collection switched off stays off
        with one:
            assert gc.get_threshold()[0] == 0
        assert gc.get_threshold()[0] == 0
    finally:
        one.close()
        two.close()
        gc.set_threshold(*saved)
