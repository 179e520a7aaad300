"""Every program rlaxkit runs compiles with XLA:TPU (libtpu, compile-only) for v5p, v5e
and v6e slices; the planner's figures are a direct compile's; a model too big for its
chips is reported as not fitting, with what to change; bad topologies are named."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rlaxkit.models import ModelConfig, abstract_model
from rlaxkit.planning import PlanConfig, parse_topology, tpu_mesh
from rlaxkit.planning.costs import Plan
from rlaxkit.planning.tpu import check_shardable, topology_for

libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed (pip install 'rlaxkit[tpu]'; make installs it)",
)

TINY = ModelConfig(
    family="qwen3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
)
# v5p gets every program; v5e and v6e the scanned train step, the decode loop on a cache
# view and the publication (the suite's CPU budget). benchmarks/plan.py compiles all eight
# for all three (tpu_programs_compiled).
CASES = [
    ("v5p:2x2x1", name) for name in ("train", "train_lora", "prefill", "extend", "recompute")
] + [
    (top, name)
    for top in ("v5p:2x2x1", "v5e:2x2", "v6e:2x2")
    for name in ("train_scan_remat", "decode_view", "publish")
]


@pytest.fixture(scope="module")
def lowerings():
    from rlaxkit.planning.suite import runtime_lowerings

    return {top: runtime_lowerings(top, TINY) for top in ("v5p:2x2x1", "v5e:2x2", "v6e:2x2")}


@libtpu
@pytest.mark.parametrize(("topology", "name"), CASES)
def test_runtime_program_compiles_for_tpu(lowerings, topology, name):
    from rlaxkit.planning.compile import _measure

    cost = _measure(name, lowerings[topology][name], 0)
    assert cost.compiled, cost.refusal
    assert cost.argument_bytes > 0 and cost.flops > 0
    assert cost.optimal_s >= 0  # the compiler's time estimate (0 where it has none)


@libtpu
def test_plan_figures_equal_a_direct_compile():
    """The planner's decode program for a small model is the one the sampler runs,
    lowered here straight from ``rlaxkit.inference``'s public programs."""
    from rlaxkit.inference import SamplingConfig
    from rlaxkit.inference.programs import _decode_steps, init_state, step_config
    from rlaxkit.inference.results import StaticGraph
    from rlaxkit.planning.compile import compile_programs
    from rlaxkit.trainer.sharding import state_shardings

    config = PlanConfig(
        model="qwen2.5-0.5b",
        num_layers=1,
        target="v5p:2x2x1",
        mesh=(1, 2, 2),
        rows=4,
        prompt_tokens=16,
        completion_tokens=16,
        sampler_chips=2,
        slots=4,
        samples_per_prompt=2,
        programs=("decode",),
    )
    (planned,) = compile_programs(config)
    model = config.model_config().replace(param_dtype="bfloat16")
    mesh = tpu_mesh("v5p:2x2x1", (1, 1, 2), devices=2)
    graphdef, params = nnx.split(abstract_model(model))
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        params,
        state_shardings(params, mesh),
    )
    sampling = SamplingConfig(max_new_tokens=16, n=2)
    state = jax.eval_shape(lambda: init_state(model, sampling, 4, 16))

    def place(path, leaf):
        names = {str(getattr(k, "name", getattr(k, "key", k))) for k in path}
        # The KV cache, stacked over the layers ([layers, rows, kv_heads, ...]): heads split.
        heads = "model" if "cache" in names and names & {"k", "v"} and leaf.ndim == 5 else None
        spec = P(None, None, heads) if heads else P()
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

    state = jax.tree_util.tree_map_with_path(place, state)
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    direct = (
        _decode_steps.lower(
            StaticGraph(graphdef),
            params,
            state,
            scalar,
            scalar,
            scalar,
            config=step_config(sampling),
            view=None,
        )
        .compile()
        .memory_analysis()
    )
    assert planned.argument_bytes == direct.argument_size_in_bytes
    assert planned.temp_bytes == direct.temp_size_in_bytes
    assert planned.output_bytes == direct.output_size_in_bytes
    assert planned.alias_bytes == direct.alias_size_in_bytes


@libtpu
def test_32b_on_a_v5e_worker_of_one_chip_does_not_fit():
    """QwQ-32B's bf16 weights laid out for a one-chip v5e worker: XLA:TPU refuses the
    program (over 16 GiB); the plan says so and what to change."""
    from rlaxkit.planning.compile import compile_programs

    config = PlanConfig(
        model="qwq-32b",
        target="v5e:2x2",
        mesh=(1, 2, 2),
        rows=4,
        sampler_chips=1,
        slots=8,
        programs=("publish",),
    )
    plan = Plan(
        config=config, model=config.model_config(), programs=tuple(compile_programs(config))
    )
    assert not plan.fits("publish")
    advice = plan.advice("publish")
    assert advice[0].startswith("XLA:TPU refused it: RESOURCE_EXHAUSTED")
    assert any(tip.startswith("sampler_chips=") for tip in advice)
    assert "NO" in plan.table() and "XLA:TPU for v5e:2x2" in plan.table()


def test_topology_names_both_spellings():
    assert parse_topology("v5p-128").name == "v5p:4x4x4"
    assert parse_topology("v5p:4x4x4").chips == 64
    assert parse_topology("v5e-256").name == parse_topology("v6e-256").name.replace("v6e", "v5e")
    assert parse_topology("v4-32").devices == 32  # v4: a device per TensorCore
    assert topology_for("v5p", 1024).name == "v5p:8x8x16"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("v9z:2x2", "known generations: v4, v5e, v5p, v6e"),
        ("v5p:2x2", "a v5p slice has 3 axes"),
        ("v5e-3", "not a topology libtpu knows"),
        ("tpu", "known generations"),
    ],
)
def test_bad_topology_names_the_known_ones(name, message):
    with pytest.raises(ValueError, match=message):
        parse_topology(name)


def test_plan_mesh_that_does_not_match_the_target_names_both_numbers():
    with pytest.raises(ValueError, match=r"mesh: \(1, 4, 4\) has 16 devices but the target "):
        PlanConfig(target="v5p:2x2x1", mesh=(1, 4, 4))
    assert PlanConfig(target="v6e:2x2", mesh=(1, 2, 2)).chip == "v6e"


def test_model_that_cannot_split_names_the_dimension_and_axis():
    with pytest.raises(
        ValueError, match="num_kv_heads = 2 does not split over the mesh axis 'model'"
    ):
        check_shardable(TINY, {"data": 1, "fsdp": 1, "model": 4})


@libtpu
def test_mesh_size_mismatch_names_both_numbers():
    with pytest.raises(ValueError, match=r"has 8 devices but the TPU topology v5p:2x2x1 has 4"):
        tpu_mesh("v5p:2x2x1", (1, 4, 2))


def test_missing_libtpu_names_the_extra(monkeypatch):
    import builtins

    from rlaxkit.planning.tpu import require_libtpu

    real_import = builtins.__import__

    def no_libtpu(name, *args, **kwargs):
        if name == "libtpu":
            raise ImportError("No module named 'libtpu'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_libtpu)
    with pytest.raises(ImportError, match=r"rlaxkit\[tpu\]"):
        require_libtpu()


@pytest.mark.parametrize(
    ("name", "chip", "devices"),
    [("qwq32b_v5p_1024", "v5p", 256), ("qwen3_8b_v5e_256", "v5e", 256)]
    + [("qwen3_8b_v6e_256", "v6e", 256)],
)
def test_shipped_tpu_plans_parse(name, chip, devices):
    from rlaxkit.planning import load_plan_config

    config = load_plan_config(f"configs/plan/{name}.yaml")
    assert config.chip == chip and config.trainer_chips == devices
    axes = dict(zip(("data", "fsdp", "model"), config.mesh, strict=True))
    check_shardable(config.model_config(), axes)
    check_shardable(config.model_config(), {"model": config.sampler_chips})


def test_cli_plan_with_a_bad_target_names_the_known_topologies(capsys):
    from rlaxkit.cli import main

    assert main(["plan", "--target", "v9z:2x2"]) == 2
    err = capsys.readouterr().err
    assert "unknown TPU topology 'v9z:2x2'" in err and "Traceback" not in err


def lowered_train_step(model: ModelConfig, remat: str = "none") -> str:
    """The StableHLO text of ``model``'s train step for a ``(1, 2, 2)`` v5e mesh, two
    rows of 32 tokens (lowered, not compiled: seconds)."""
    from rlaxkit.planning.compile import _train_parts, trainer_mesh

    config = PlanConfig(
        model="qwen2.5-0.5b",
        target="v5e:2x2",
        mesh=(1, 2, 2),
        rows=2,
        prompt_tokens=8,
        completion_tokens=24,
        micro_batches=1,
        remat=remat,
        programs=("train",),
    )
    step, state, batch = _train_parts(config, model, trainer_mesh(config), 2, 1)
    return step.lower(state, batch).as_text()


@libtpu
def test_train_step_keeps_the_logits_split_by_rows_and_vocabulary():
    """The lowered train step constrains its logits to rows over ``data × fsdp`` and the
    vocabulary over ``model`` (``rlaxkit.trainer.sharding.constrain_logits``). Without
    it, GSPMD gathered every row's logits onto each device for large models: XLA:TPU
    gave Qwen3-8B on 256 v5e chips (8k tokens, one row a device) 75.7 GiB of temporaries
    a device instead of 13.1 (two layers), and Qwen2.5-7B on 64 v5p chips 25.45 GiB
    instead of 12.04. A tiny model does not show it in memory (XLA splits small
    matmuls the other way), so this reads the lowering, which takes seconds."""
    text = lowered_train_step(TINY.replace(vocab_size=512))
    logits = [line for line in text.splitlines() if "tensor<2x31x512xf32>" in line]
    constrained = [line for line in logits if "sharding_constraint" in line]
    assert constrained, "no sharding constraint on the [rows, T - 1, vocab] logits"
    assert all('[{"data", "fsdp"}, {}, {"model"}]' in line for line in constrained)


@libtpu
def test_train_step_splits_the_residual_stream_between_blocks_over_the_model_axis():
    """The residual stream between blocks (what ``remat="full"`` keeps of each layer)
    is constrained to rows over ``data × fsdp`` and tokens over ``model``
    (``rlaxkit.trainer.sharding.constrain_stream``, sequence parallelism). Split by rows
    only, every ``model`` device kept a whole copy of it per layer: Qwen3-8B's v5e-256
    train step grew about 0.15 GiB a layer under ``remat="full"``."""
    text = lowered_train_step(TINY, remat="full")
    stream = [
        line
        for line in text.splitlines()
        if "sharding_constraint" in line
        and ("tensor<2x32x32xf32>" in line or "tensor<2x32x32xbf16>" in line)
    ]
    assert stream, "no sharding constraint on the [rows, T, hidden] residual stream"
    assert all('[{"data", "fsdp"}, {"model"}, {}]' in line for line in stream), stream[:2]
