"""Host-side PRNG key derivation in ``rlaxkit.inference.results`` equals ``jax.random``."""

import jax
import numpy as np
import pytest

from rlaxkit.inference.results import key_data, prompt_keys, threefry_fold_in


@pytest.mark.parametrize("seed", [0, 1, 7, 123_456_789, 2**31 - 1])
def test_threefry_fold_in_equals_jax_random_fold_in(seed):
    base = jax.random.key(seed)
    data = np.array([0, 1, 2, 5, 1000, 2**31 - 1, 2**32 - 1])
    expected = [np.asarray(jax.random.key_data(jax.random.fold_in(base, int(d)))) for d in data]
    got = threefry_fold_in(key_data(seed), data)
    np.testing.assert_array_equal(got, np.stack(expected))
    assert got.dtype == np.uint32


def test_prompt_keys_of_a_seed_and_of_a_key_agree():
    keys = prompt_keys(42, 6)
    np.testing.assert_array_equal(keys, prompt_keys(jax.random.key(42), 6))
    folded = jax.random.fold_in(jax.random.key(42), 5)
    np.testing.assert_array_equal(keys[5], np.asarray(jax.random.key_data(folded)))
