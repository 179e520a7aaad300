"""Attention over pages: the XLA reference on our layout (pages gathered to the dense
layout, then the model's masked attention) equals JAX's own reference of the ragged paged
attention kernel (``ref_ragged_paged_attention``, the kernel's specification)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
    ragged_paged_attention,
    ref_ragged_paged_attention,
)

from rlaxkit.inference.paged import gather_dense

ROWS, HEADS, KV_HEADS, DIM, PAGE, PAGES, PER_ROW = 4, 4, 2, 128, 16, 13, 3


def inputs(seed=0):
    rng = np.random.RandomState(seed)
    q = jnp.asarray(rng.standard_normal((ROWS, HEADS, DIM)), jnp.float32)
    pool = jnp.asarray(rng.standard_normal((PAGES, PAGE, 2 * KV_HEADS, DIM)), jnp.float32)
    # Rows hold pages in any order; page 0 (the null page) is no row's.
    table = jnp.asarray(1 + rng.permutation(PAGES - 1)[: ROWS * PER_ROW].reshape(ROWS, -1))
    kv_len = jnp.asarray([1, 17, 48, 30], jnp.int32)
    return q, pool, table.astype(jnp.int32), kv_len


def reference(q, pool, table, kv_len):
    """Our path: gather the pages to the dense layout, mask past each row's length, and
    attend as ``Attention.attend`` does (one query per row at slot ``kv_len - 1``)."""
    k, v = gather_dense(pool, table)  # [R, KV, S, D]
    mask = jnp.arange(k.shape[2])[None] < kv_len[:, None]
    groups = HEADS // KV_HEADS
    scores = jnp.einsum("bkgd,bksd->bkgs", q.reshape(ROWS, KV_HEADS, groups, DIM), k)
    scores = jnp.where(mask[:, None, None], scores * DIM**-0.5, -1e30)
    out = jnp.einsum("bkgs,bksd->bkgd", jax.nn.softmax(scores, axis=-1), v)
    return out.reshape(ROWS, HEADS, DIM)


def kernel_arguments(table, kv_len):
    return kv_len, table, jnp.arange(ROWS + 1, dtype=jnp.int32), jnp.array([ROWS], jnp.int32)


def test_the_reference_equals_the_kernels_specification_on_our_layout():
    q, pool, table, kv_len = inputs()
    expected = ref_ragged_paged_attention(
        q, pool, *kernel_arguments(table, kv_len), sm_scale=DIM**-0.5
    )
    np.testing.assert_allclose(reference(q, pool, table, kv_len), expected, atol=2e-6, rtol=0)


@pytest.mark.xfail(
    raises=Exception,
    strict=True,
    reason="JAX 0.10.2's Pallas TPU interpreter cannot run the ragged paged attention "
    "kernel (it reshapes a ref: 'ReshapeTransform' has no 'indices'); the kernel is "
    "compiled for TPU in test_paged_tpu.py instead",
)
def test_the_kernel_in_interpret_mode_equals_the_reference():
    from jax.experimental.pallas import tpu as pltpu

    q, pool, table, kv_len = inputs()
    with pltpu.force_tpu_interpret_mode():
        out = ragged_paged_attention(
            q,
            pool,
            *kernel_arguments(table, kv_len),
            sm_scale=DIM**-0.5,
            num_kv_pages_per_block=2,
            num_queries_per_block=4,
        )
    np.testing.assert_allclose(out, reference(q, pool, table, kv_len), atol=2e-6, rtol=0)
