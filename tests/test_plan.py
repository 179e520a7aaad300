"""Planning a run: the compiled programs' bytes are the real arrays' bytes, the FLOPs of
a scanned, accumulated step are those of the unrolled step, a scanned program does not
grow with depth, and the plan's arithmetic (fits, advice, step time, KV cache, push,
simulator inputs) is worked out by hand."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rlaxkit
from rlaxkit.algorithms import algorithm
from rlaxkit.cli import main as cli_main
from rlaxkit.data.batch import TrainBatch
from rlaxkit.models import ModelConfig, Transformer
from rlaxkit.planning import (
    CHIPS,
    MODEL_PRESETS,
    Plan,
    PlanConfig,
    ProgramCost,
    load_plan_config,
)
from rlaxkit.planning.compile import compile_sampler, compile_train, sampler_lowerings, worker_mesh
from rlaxkit.trainer.config import TrainConfig
from rlaxkit.trainer.sharding import param_partition_spec
from rlaxkit.trainer.state import create_train_state
from rlaxkit.trainer.step import make_train_step

GIB = 1024**3
TINY = ModelConfig(
    family="qwen2",
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
)


def test_presets_have_the_published_parameter_counts():
    # Counts from the model cards (embedding counted once when tied).
    published = {
        "qwen2.5-0.5b": 494_032_768,
        "qwen2.5-1.5b": 1_543_714_304,
        "qwen2.5-7b": 7_615_616_512,
        "qwen3-8b": 8_190_735_360,
        "qwen3-32b": 32_762_123_264,
        "qwq-32b": 32_763_876_352,  # Qwen2.5-32B's dimensions
        "llama-3.1-8b": 8_030_261_248,
    }
    assert {k: m.num_params() for k, m in MODEL_PRESETS.items()} == published


def test_plan_arithmetic_by_hand():
    config = PlanConfig(
        model="qwen2.5-0.5b",
        mesh=(1, 4, 2),
        rows=8,
        prompt_tokens=100,
        completion_tokens=156,
        chip="v5e",
        mfu=0.5,
        slots=16,
        samples_per_prompt=4,
        sampler_chips=2,
        decode_efficiency=0.6,
    )
    train = ProgramCost(
        name="train",
        devices=8,
        argument_bytes=10 * GIB,
        output_bytes=6 * GIB,
        alias_bytes=6 * GIB,
        temp_bytes=7 * GIB,
        flops=1.97e14,
        bytes_accessed=0.0,
        compile_s=1.0,
    )
    decode = ProgramCost(
        name="decode",
        devices=2,
        argument_bytes=GIB,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=0,
        flops=0.0,
        bytes_accessed=0.0,
        compile_s=1.0,
    )
    p = Plan(config=config, model=config.model_config(), programs=(train, decode))
    assert train.peak_bytes == 17 * GIB  # 10 + 6 - 6 + 7
    assert not p.fits("train") and p.fits("decode")  # a v5e has 16 GiB
    # 1.97e14 FLOPs per chip at 50% of 197 TFLOP/s: 2 s; 8 rows x 256 tokens per step.
    assert p.step_s == pytest.approx(2.0)
    assert p.trainer_tokens_per_s == pytest.approx(1024.0)
    assert p.step_flops == pytest.approx(8 * 1.97e14)
    # KV cache: 24 layers x (K, V) x 2 heads x 64 dims x 2 bytes = 12288 bytes per token.
    assert p.kv_cache_bytes == 16 * 256 * 12288
    assert p.push_bytes == 2 * 494_032_768
    # Decode, memory-bound at 60% of 2 chips' 0.82 TB/s: the weights once, then each
    # sequence's 256 cached tokens of 12288 bytes.
    rate = 0.82e12 * 0.6 * 2
    assert p.decode_s_per_token() == pytest.approx((2 * 494_032_768 / rate, 256 * 12288 / rate))
    assert p.decode_step_s() == pytest.approx((2 * 494_032_768 + 16 * 256 * 12288) / rate)
    advice = " ".join(p.advice("train"))
    assert "1.0 GiB over" in advice
    assert "remat=dots" in advice and "micro_batches=2" in advice and "fsdp=8" in advice
    assert p.advice("decode") == []
    sim = p.sim_overrides()
    assert sim["trainer.flops_per_token_factor"] == pytest.approx(
        8 * 1.97e14 / (2048 * 494_032_768)
    )
    assert sim["trainer.chips"] == 8 and sim["fleet.chips_per_worker"] == 2
    assert sim["fleet.decode_s_per_token"] == pytest.approx(2 * 494_032_768 / rate)
    assert sim["fleet.decode_s_per_token_per_seq"] == pytest.approx(256 * 12288 / rate)
    assert "NO" in p.table() and "estimate" in p.table()
    json.dumps(p.summary())


def test_a_train_step_xla_refused_is_reported_not_divided_by_zero():
    """XLA:TPU's RESOURCE_EXHAUSTED leaves the train step (and its probes) with no
    FLOPs: the plan still prints, its throughput is 0, and the simulator keeps its own
    trainer figures instead of a step of no work."""
    config = PlanConfig(model="qwen2.5-0.5b", mesh=(1, 4, 2), rows=8, chip="v5e")
    refused = ProgramCost(
        name="train",
        devices=8,
        argument_bytes=10 * GIB,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=30 * GIB,
        flops=0.0,
        bytes_accessed=0.0,
        compile_s=1.0,
        compiled=False,
        refusal="RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory",
    )
    p = Plan(config=config, model=config.model_config(), programs=(refused,))
    summary = p.summary()
    json.dumps(summary)
    assert summary["step_s"] == 0.0 and summary["trainer_tokens_per_s"] == 0.0
    assert not summary["programs"]["train"]["fits"]
    assert summary["advice"]["train"][0].startswith("XLA:TPU refused it: RESOURCE_EXHAUSTED")
    assert not any(key.startswith("trainer.") for key in p.sim_overrides())
    assert "NO" in p.table()
    assert "fsdp=8 (spreads weights, moments and batch" in " ".join(p.advice("train"))


def test_plan_configs_name_the_bad_field():
    with pytest.raises(ValueError, match="rows: 12 must split"):
        PlanConfig(mesh=(1, 8, 1), rows=12)
    with pytest.raises(ValueError, match="chip: must be one of"):
        PlanConfig(chip="v9")
    with pytest.raises(ValueError, match="model: 'gpt-9' is neither a preset"):
        PlanConfig(model="gpt-9")
    with pytest.raises(ValueError, match="remat"):
        load_plan_config(None, ["remat=some"])
    assert sorted(CHIPS) == ["h100", "v4", "v5e", "v5p", "v6e"]
    for name in ("qwen25_7b_v5p", "qwen3_32b_v5p"):
        config = load_plan_config(f"configs/plan/{name}.yaml")
        assert config.length == 8192


def _lowered_step(config, micro_batches=1, rows=4, length=16):
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    cfg = TrainConfig(
        algorithm=algorithm("grpo", loss={"kl_coef": 0.0}), micro_batches=micro_batches
    )
    state = jax.eval_shape(lambda p: create_train_state(cfg, p), params)
    batch = _abstract_batch(rows, length)
    return make_train_step(cfg, graphdef).lower(state, batch), state, batch


def _abstract_batch(rows, length):
    def s(shape, dtype):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))

    return TrainBatch(
        tokens=s((rows, length), jnp.int32),
        attention_mask=s((rows, length), bool),
        loss_mask=s((rows, length), jnp.float32),
        behaviour_logprobs=s((rows, length), jnp.float32),
        versions=s((rows, length), jnp.int32),
        rewards=s((rows,), jnp.float32),
        group_ids=s((rows,), jnp.int32),
        sequence_mask=s((rows,), bool),
    )


def test_scanned_program_does_not_grow_with_depth():
    scan = [
        len(_lowered_step(TINY.replace(num_layers=n, scan_layers=True))[0].as_text())
        for n in (2, 8)
    ]
    unrolled = [len(_lowered_step(TINY.replace(num_layers=n))[0].as_text()) for n in (2, 8)]
    assert scan[1] / scan[0] < 1.02  # the layer count is only a shape
    assert unrolled[1] / unrolled[0] > 2.5


def _tiny_plan(folder, **fields):
    """A plan of ``TINY`` (its ``config.json`` written to ``folder``): 6 + 10 tokens,
    float32."""
    (folder / "config.json").write_text(json.dumps(TINY.to_hf()))
    common = {"prompt_tokens": 6, "completion_tokens": 10, "compute_dtype": "float32"}
    return PlanConfig(model=str(folder), **common | fields)


def test_plan_flops_of_a_scanned_step_equal_the_unrolled_step(tmp_path):
    # XLA counts a loop body once; the plan's probes scale it to every layer.
    # Reference: the unscanned step (its loops run once, so XLA's count is the whole
    # step's).
    [train] = compile_train(_tiny_plan(tmp_path, rows=4, programs=("train",)))
    reference = _lowered_step(TINY, rows=4, length=16)[0].compile().cost_analysis()["flops"]
    assert train.flops == pytest.approx(reference, rel=1e-6)
    assert train.loop_flops < train.flops  # what XLA alone would have said


def test_plan_flops_of_scanned_prefill_and_decode_equal_the_unrolled_programs(tmp_path):
    # Stacked blocks prefill and decode in a layer scan; the probes scale its body to
    # every layer. Reference: the per-layer programs, unrolled, counted whole by XLA.
    # Decode's count grows by the same FLOPs with each layer; prefill's second layer adds
    # 510 FLOPs (0.1 %) more than each later one (XLA simplifies a one-layer prefill a
    # little further), a constant that the scaled count carries at any depth.
    config = _tiny_plan(
        tmp_path, programs=("prefill", "decode"), sampler_chips=1, slots=4, samples_per_prompt=2
    )
    unrolled = sampler_lowerings(
        config.model_config().replace(scan_layers=False, param_dtype="float32"),
        worker_mesh(config),
        rows=4,
        prompt_tokens=6,
        completion_tokens=10,
        samples_per_prompt=2,
    )
    costs = compile_sampler(config)
    assert [c.name for c in costs] == ["prefill", "decode"]
    for cost in costs:
        reference = unrolled[cost.name]().compile().cost_analysis()["flops"]
        assert cost.flops == pytest.approx(reference, rel=2e-3), cost.name
        assert cost.loop_flops < cost.flops  # the scan's body, counted once


def _shard_bytes(tree, sizes):
    class Mesh:  # param_partition_spec reads only the axis names and sizes
        axis_names = tuple(sizes)
        devices = np.empty(tuple(sizes.values()))

    def nbytes(path, leaf):
        spec = param_partition_spec(path, leaf.shape, Mesh)
        shape = [
            d // (sizes[a] if a else 1)
            for d, a in zip(leaf.shape, (*spec, *[None] * 9), strict=False)
        ]
        return math.prod(shape) * jnp.dtype(leaf.dtype).itemsize

    return sum(jax.tree.leaves(jax.tree_util.tree_map_with_path(nbytes, tree)))


def test_compiled_bytes_are_the_real_arrays_bytes_on_a_forced_mesh(tmp_path):
    # One compile process with 4 forced devices, mesh (1, 2, 2); this process keeps its
    # one device and its XLA flags.
    flags = os.environ.get("XLA_FLAGS")
    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps(TINY.to_hf()))
    result = rlaxkit.plan(
        model=str(config_json),
        mesh=(1, 2, 2),
        rows=4,
        prompt_tokens=6,
        completion_tokens=10,
        compute_dtype="float32",
        sampler_chips=2,
        slots=4,
        samples_per_prompt=2,
        programs=("train",),
    )
    assert os.environ.get("XLA_FLAGS") == flags and jax.device_count() == 1
    train = result.program("train")
    assert train.devices == 4
    scanned = TINY.replace(scan_layers=True)
    _, state, batch = _lowered_step(scanned, rows=4, length=16)
    sizes = {"data": 1, "fsdp": 2, "model": 2}
    state_bytes = _shard_bytes(state, sizes)
    batch_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(batch)) // 2
    cfg = TrainConfig(algorithm=algorithm("grpo", loss={"kl_coef": 0.0}))
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(scanned, rngs=nnx.Rngs(0))))
    metrics = jax.eval_shape(make_train_step(cfg, graphdef), state, batch)[1]
    metric_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(metrics))
    assert train.argument_bytes == state_bytes + batch_bytes  # rows split over fsdp = 2
    assert train.alias_bytes == state_bytes  # the donated state is updated in place
    # Outputs: the new state and the metrics, plus XLA's CPU output tuple, a table of one
    # 8-byte pointer per output array.
    outputs = len(jax.tree.leaves(state)) + len(jax.tree.leaves(metrics))
    assert train.output_bytes == state_bytes + metric_bytes + 8 * outputs
    # 4 slots x 16 tokens x 3 layers x (K, V) x 2 heads x 8 dims x 4 bytes (float32).
    assert result.kv_cache_bytes == 4 * 16 * 3 * 2 * 2 * 8 * 4


def test_cli_plan_prints_one_json_line(capsys):
    code = cli_main(
        [
            "plan",
            "--set",
            "model=qwen2.5-0.5b",
            "--set",
            "num_layers=1",
            "--set",
            "programs=[prefill]",
            "--set",
            "sampler_chips=1",
            "--set",
            "slots=2",
            "--set",
            "samples_per_prompt=2",
            "--set",
            "prompt_tokens=8",
            "--set",
            "completion_tokens=8",
            "--json",
        ]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["programs"]["prefill"]["fits"] is True
    assert (
        summary["push_bytes"]
        == 2 * MODEL_PRESETS["qwen2.5-0.5b"].replace(num_layers=1).num_params()
    )
    assert cli_main(["plan", "--set", "chip=v9"]) == 2


def test_public_surface():
    import rlaxkit.planning

    assert all(hasattr(rlaxkit.planning, name) for name in rlaxkit.planning.__all__)
    assert rlaxkit.plan is rlaxkit.planning.plan


def test_remat_probes_are_skipped_where_the_compiler_gives_no_time(monkeypatch):
    """This libtpu gives no time estimate for v5e and v6e train steps: the probes with
    the plan's remat, which only time the step, are not compiled there (two of the
    plan's longest compiles); where it gives one, they are."""
    import rlaxkit.planning.compile as compile_module

    probes = ["train_probe_1", "train_probe_2"]
    cases = (  # (a one-layer probe's time, the others'), programs compiled, the step's time
        ((0.0, 0.0), ["train", *probes], 0.0),
        ((1.0, 1.0), ["train", *probes, *probes], 1.0),
        ((0.0, 1.0), ["train", *probes], 0.0),  # one probe untimed: no time, never negative
    )
    for (first, seconds), expected, step_s in cases:
        names = []

        def measured(name, lowered_fn, devices, first=first, seconds=seconds, names=names):
            names.append(name)
            seconds = first if name == "train_probe_1" else seconds
            return _cost(name, devices, 2e12 if name == "train_probe_2" else 1e12, seconds)

        monkeypatch.setattr(compile_module, "_measure", measured)
        monkeypatch.setattr(compile_module, "_train_parts", lambda *a, **k: (_Step(), None, None))
        monkeypatch.setattr(compile_module, "trainer_mesh", lambda plan: None)
        config = PlanConfig(
            model="qwen2.5-0.5b",
            num_layers=2,
            mesh=(1, 2, 2),
            rows=2,
            remat="full",
            target="v5e:2x2",
            programs=("train",),
        )
        (train,) = compile_train(config)
        assert names == expected
        assert train.flops == pytest.approx(2e12)  # f1 + (L - 1)(f2 - f1)
        assert train.optimal_s == step_s


class _Step:
    def lower(self, *args):
        return None


def _cost(name, devices, flops, seconds, compiled=True):
    """A measured program of a GiB of arguments and a GiB of temporaries."""
    return ProgramCost(
        name=name,
        devices=devices,
        argument_bytes=GIB,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=GIB,
        flops=flops,
        bytes_accessed=0.0,
        compile_s=0.1,
        compiled=compiled,
        optimal_s=seconds,
    )


def test_a_refused_probe_leaves_the_step_without_flops_not_negative(monkeypatch):
    """XLA:TPU refused a two-layer probe of Qwen3-8B on v6e (no remat at 8k tokens):
    its zero FLOPs made the step's ``micro · (f₁ + (L − 1)(f₂ − f₁))`` negative (the
    stored plan read -510 738 tokens/s). A refused probe now leaves FLOPs and time at 0,
    unknown, and the real program's memory stands."""
    import rlaxkit.planning.compile as compile_module

    def measured(name, lowered_fn, devices):
        refused = name == "train_probe_2"
        return _cost(name, devices, 0.0 if refused else 1e12, 0.0 if refused else 1.0, not refused)

    monkeypatch.setattr(compile_module, "_measure", measured)
    config = PlanConfig(model="qwen2.5-0.5b", num_layers=2, mesh=(1, 1, 1), rows=1)
    (train,) = compile_train(config)
    assert train.compiled and train.peak_bytes == 2 * GIB
    assert train.flops == 0.0 and train.optimal_s == 0.0
    plan = Plan(config=config, model=config.model_config(), programs=(train,))
    assert plan.trainer_tokens_per_s == 0.0 and plan.est_mfu == 0.0


def test_a_plan_past_its_timeout_says_what_to_change_in_one_line(capsys):
    """The compile process is stopped at ``timeout_s``; ``plan`` raises ``TimeoutError``
    and ``rlaxkit plan`` prints one line naming ``--timeout-s`` (exit 2), no traceback."""
    from rlaxkit.planning import plan

    with pytest.raises(TimeoutError, match=r"took over 0 s \(timeout_s\).*--timeout-s"):
        plan(model="qwen2.5-0.5b", mesh=(1, 1, 1), programs=("train",), timeout_s=0.2)
    assert cli_main(["plan", "--set", "model=qwen2.5-0.5b", "--timeout-s", "0.2"]) == 2
    err = capsys.readouterr().err
    assert "--timeout-s" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
