"""Shared test setup: CPU only, float32, quiet Ray, tiny models."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("MPLBACKEND", "Agg")
# Tests compile far more than they run, so they compile as ``TieredJit``'s quick tier
# does (``rlaxkit.util.jaxutil.QUICK_COMPILER_OPTIONS``): LLVM at -O0 took about a quarter
# off the suite, and XLA:CPU's loop emitters for fusions instead of its MLIR emitters
# took a further 23-36 % off six compile-heavy modules from an empty cache (95-97 s
# against 123-152 s). Each LLVM module compiles whole rather than split for a thread
# pool, whose parts only add work when two workers compile at once: the model,
# sampling, engine and chunked-generation modules took 33.8-34.3 s against
# 39.2-42.2 s (59 s of CPU against 68-71 s) on two workers from an empty cache. The
# tiny models run a little slower. The processes tests start inherit the flags; runs
# outside the tests use XLA's defaults.
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    " --xla_cpu_parallel_codegen_split_count=1",
)

import pytest  # noqa: E402

# --doctest-modules (pyproject) imports every module it collects; this script
# regenerates fixtures with torch, which the test environment does not install.
collect_ignore = ["fixtures/make_hf_fixtures.py"]


@pytest.fixture
def tiny_config():
    """A Qwen3-shaped model small enough for any test (GQA 4:2, qk-norm)."""
    from rlaxkit.models import ModelConfig

    return ModelConfig(
        family="qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
    )


@pytest.fixture
def tiny_model(tiny_config):
    from flax import nnx

    from rlaxkit.models import Transformer

    return Transformer(tiny_config, rngs=nnx.Rngs(0))


@pytest.fixture
def no_persistent_cache():
    """JAX's persistent compilation cache off for one test, so that ``count_compilations``
    counts every program the test needs (a hit in the shared cache is no compile)."""
    import jax

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", before)


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """One warm-start cache for every module of the session, shared by xdist's workers
    (their temporary folders share a parent). Its entries are keyed by everything the
    warm-started weights depend on (``warm_start_key``: model, task, SFT and seed), so
    runs that share them load one warm start instead of each module, or each worker,
    training its own (about 3 s each); a warm start is renamed into place whole, so a
    worker never reads one half written."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "warm_start"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("warm_start")


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster (2 CPUs) per pytest process, for every module that asks
    (starting and stopping one costs about 8 s). Its files stay in a short temp dir
    (Ray's socket paths must fit in 107 bytes); evicted weight versions are freed at
    once, as clusters the Ray backend starts do (``RAY_SYSTEM_CONFIG``)."""
    pytest.importorskip("ray")
    from rlaxkit.param_server.ray_store import local_cluster

    with local_cluster(num_cpus=2):
        yield


# Modules whose tests start processes of their own (a Ray cluster, JAX processes): with
# ``make test``'s two workers they all run on one, one after another, so that two such
# runs never share the two cores.
PROCESS_MODULES = {
    "test_distributed.py",
    "test_distributed_ray.py",
    "test_multihost.py",
    "test_param_server_processes.py",
    "test_ray_backend.py",
    "test_ray_resume.py",
}


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """Before xdist's hook reads the groups, puts the tests that start processes in the
    ``processes`` group and every other test in its module's (unless it names one): a
    module's fixtures are then built once, on one worker (a two-worker run took 10:28
    against 10:59 with single tests spread). After xdist's hook, makes the groups count
    under pytest 9.2.

    pytest-xdist 3.8 names a test's group by appending ``@<group>`` to the item's
    ``_nodeid``, but pytest 9.2 derives ``nodeid`` from ``_id``: xdist's scheduler saw no
    group and spread grouped tests over both workers (two Ray clusters at once, module
    fixtures built once per worker). The suffix is carried over to ``_id`` where the two
    disagree; versions that agree are left alone.
    """
    for item in items:
        if item.path.name in PROCESS_MODULES or "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("processes"))
        elif item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    yield
    for item in items:
        grouped = getattr(item, "_nodeid", None)
        if isinstance(grouped, str) and "@" in grouped and grouped != item.nodeid:
            from _pytest.nodeid import coerce_node_id  # pytest 9.2's; older ones agree

            item._id = coerce_node_id(grouped)


def pytest_configure(config):
    """Share compiled XLA programs between tests (many build identical tiny models)."""
    import jax

    cache = config.cache.mkdir("jax_compilation_cache")
    jax.config.update("jax_compilation_cache_dir", str(cache))
    # Every program, however quickly it compiles: the processes tests start rebuild the
    # same small ones (weight initialisers, optimizer state, key folds), and reading one
    # back is cheaper than compiling it. Against a 0.2 s floor, the Ray backend and
    # runtime modules took 155-156 s against 162-164 s from an empty cache.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # The processes tests start (Ray actors, notebook kernels, the CLI) read the same
    # cache: JAX takes both settings from the environment when it is imported.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def pytest_report_header(config):
    """The code sandbox's isolation, at the top of a verbose run."""
    from sandbox_machine import sandbox_mode_line

    return sandbox_mode_line()


def pytest_terminal_summary(terminalreporter):
    """The code sandbox's isolation, at the end of every run (``-q`` shows no header): a
    limits-only run says why, and whether the machine offers namespaces."""
    from sandbox_machine import sandbox_mode_line

    terminalreporter.write_line(sandbox_mode_line())
