"""The paged cache's TPU programs compile for TPU targets with libtpu on this machine
(compile-only devices, no TPU needed): JAX's ragged paged attention kernel on our page
layout, and the engine's paged decode (the kernel inside its ``while_loop``) and prefill
programs, for v5p, v5e and v6e."""

import os

import jax
import jax.numpy as jnp
import pytest

from rlaxkit.inference import SamplingConfig, programs
from rlaxkit.inference.paged import _kernel_attention
from rlaxkit.inference.results import split_model
from rlaxkit.models import ModelConfig, abstract_model

TOPOLOGIES = ("v5p:2x2x1", "v5e:2x2", "v6e:2x2")
# head_dim 128: the kernel's lane width; one layer keeps the compiles short.
MODEL = ModelConfig(
    family="qwen3",
    vocab_size=128,
    hidden_size=256,
    intermediate_size=512,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=128,
    param_dtype="bfloat16",
)


def tpu_device(topology):
    """The first device of a compile-only TPU ``topology`` (libtpu), or a skip naming
    what is missing."""
    pytest.importorskip("libtpu", reason="compiling for TPU needs libtpu (jax[tpu])")
    from jax.experimental import topologies

    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server off a TPU VM
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes compile too
    return topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]


def on(device, tree):
    """Abstract arrays of ``tree``'s shapes and dtypes placed on ``device``."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


@pytest.mark.slow
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_the_kernel_and_the_paged_engine_programs_compile_for_tpu(topology):
    device = tpu_device(topology)
    rows, slots, page_size, num_pages = 8, 64, 16, 33
    config = SamplingConfig(temperature=0.0, max_new_tokens=48)
    graphdef, params = split_model(abstract_model(MODEL))
    with jax.default_device(device):  # Pallas reads the TPU generation from it
        kernel = jax.jit(
            lambda q, pool, table, kv_len: _kernel_attention(q, pool, table, kv_len, 4)
        )
        pool = (num_pages, page_size, 2 * MODEL.num_kv_heads, MODEL.head_dim)
        compiled = kernel.lower(
            *on(
                device,
                (
                    jax.ShapeDtypeStruct((rows, MODEL.num_heads, MODEL.head_dim), jnp.bfloat16),
                    jax.ShapeDtypeStruct(pool, jnp.bfloat16),
                    jax.ShapeDtypeStruct((rows, slots // page_size), jnp.int32),
                    jax.ShapeDtypeStruct((rows,), jnp.int32),
                ),
            )
        ).compile()
        assert "tpu_custom_call" in compiled.as_text()  # the Mosaic kernel, not a fallback
        state = on(
            device,
            jax.eval_shape(
                lambda: programs.init_paged_state(
                    MODEL, config, rows, slots, num_pages, page_size, "kernel", 4
                )
            ),
        )
        params = on(device, params)
        programs.compile_decode_steps(graphdef, params, state, config)

        def ints(*shape, dtype=jnp.int32):
            return on(device, jax.ShapeDtypeStruct(shape, dtype))

        prefill = programs.start_rows.lower(
            graphdef,
            params,
            state,
            ints(2, 16),
            ints(2),
            ints(rows),
            ints(rows),
            ints(rows, 2, dtype=jnp.uint32),
            ints(rows),
            ints(rows),
        ).compile()
        assert prefill.memory_analysis() is not None
