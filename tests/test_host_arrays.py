"""``rlaxkit.util.jaxutil.host_arrays``: a tree's arrays read on the host, the tree kept."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rlaxkit.util.jaxutil import host_arrays


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(-1000, 1000), min_size=1, max_size=12), st.sampled_from(["i", "f"]))
def test_host_arrays_are_numpy_with_the_values_and_the_tree(values, kind):
    dtype = jnp.int32 if kind == "i" else jnp.float32
    device = jnp.asarray(values, dtype)
    tree = {"rows": (device, device * 2), "count": jnp.sum(device), "name": None}
    host = host_arrays(tree)
    assert jax.tree.structure(host) == jax.tree.structure(tree)
    for got, want in zip(jax.tree.leaves(host), jax.tree.leaves(tree), strict=True):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype
        np.testing.assert_array_equal(got, np.asarray(want))
    # What jax.device_get gives, leaf for leaf.
    expected = jax.tree.leaves(jax.device_get(tree))
    assert all(
        a.dtype == b.dtype and np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(host), expected, strict=True)
    )
