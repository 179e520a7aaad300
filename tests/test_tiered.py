"""Two-tier compilation (``rlaxkit.util.jaxutil.TieredJit``): static arguments key the tiers,
``hold_background_compiles`` keeps a block on the quick executables, and
``generate(..., tiered=True)`` samples what the one-tier ``generate`` samples."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlaxkit.inference import SamplingConfig, compile_generate, generate, programs
from rlaxkit.util.jaxutil import TieredJit, count_compilations, hold_background_compiles


def fresh_scaled():
    """A new function each time: JAX keys its executables' caches by the function."""

    def scaled(x, *, scale):
        return x * scale

    return scaled


def calls(tiered):
    """(quick, optimised) executables JAX has dispatched through, by cache size."""
    return tiered.quick._cache_size(), tiered.optimised._cache_size()


def test_static_arguments_key_the_tiers():
    tiered = TieredJit(fresh_scaled(), static_argnames=("scale",))
    x = jnp.arange(3.0)
    np.testing.assert_array_equal(tiered(x, scale=2.0), [0.0, 2.0, 4.0])
    assert calls(tiered) == (1, 0)
    tiered.wait()
    np.testing.assert_array_equal(tiered(x, scale=2.0), [0.0, 2.0, 4.0])
    assert calls(tiered) == (1, 1)
    # Another static value is another signature: quick first again.
    np.testing.assert_array_equal(tiered(x, scale=3.0), [0.0, 3.0, 6.0])
    assert calls(tiered) == (2, 1)


@pytest.mark.parametrize("kind", ["uncommitted", "committed", "numpy"])
def test_the_call_after_the_background_compile_compiles_nothing(kind):
    # The optimised executable compiled in the background is the one the next call of
    # the signature runs: lowered for an uncommitted array's sharding, or for a Python
    # scalar without its weak type, it would be compiled a second time, in the call.
    make = {
        "uncommitted": lambda: jnp.ones(3) + 1,
        "committed": lambda: jax.device_put(np.ones(3, np.float32), jax.devices()[0]),
        "numpy": lambda: np.ones(3, np.float32),
    }[kind]
    tiered = TieredJit(lambda x, s: x * s + 1)
    tiered(make(), 2.0)
    tiered.wait()
    x = make()
    with count_compilations() as compiles:
        np.testing.assert_array_equal(tiered(x, 3.0), np.asarray(x) * 3 + 1)
    assert compiles.count == 0 and calls(tiered) == (1, 1)


def test_shapes_dtypes_and_trees_key_the_tiers_as_jit_does():
    def add(tree, y):
        return tree["a"] + y

    tiered = TieredJit(add)
    signatures = [
        ({"a": jnp.ones(3)}, 1.0),
        ({"a": jnp.ones(3)}, 2.0),  # a Python scalar's value is not its signature
        ({"a": jnp.ones(4)}, 1.0),  # a new shape
        ({"a": jnp.ones(4, jnp.int32)}, 1),  # a new dtype
        ({"a": jnp.ones(4, jnp.int32), "b": 0}, 1),  # a new tree
    ]
    seen = []
    for tree, y in signatures:
        tiered.wait()
        before = calls(tiered)
        np.testing.assert_array_equal(tiered(tree, y), add(tree, y))
        seen.append(calls(tiered)[0] - before[0])  # 1: ran quick, a new signature
    assert seen == [1, 0, 1, 1, 1]
    assert calls(tiered)[1] == 1  # the repeat ran the optimised executable


def test_a_hold_keeps_calls_on_the_quick_executable_and_releases_the_compile():
    tiered = TieredJit(fresh_scaled(), static_argnames=("scale",))
    x = jnp.arange(3.0)
    with hold_background_compiles():
        tiered(x, scale=2.0)
        tiered(x, scale=2.0)  # would wait for the optimised compile without the hold
        assert calls(tiered) == (1, 0)
        (thread,) = tiered._compiling.values()
        thread.join(timeout=0.5)
        assert thread.is_alive(), "the optimised compile started inside the hold"
    tiered.wait()
    tiered(x, scale=2.0)
    assert calls(tiered) == (1, 1)


def test_holds_nest_and_other_threads_wait_for_the_outermost():
    tiered = TieredJit(fresh_scaled(), static_argnames=("scale",))
    with hold_background_compiles():
        with hold_background_compiles():
            tiered(jnp.ones(2), scale=1.0)
        (thread,) = tiered._compiling.values()
        thread.join(timeout=0.3)
        assert thread.is_alive()
    done = threading.Event()
    threading.Thread(target=lambda: (tiered.wait(), done.set())).start()
    assert done.wait(timeout=60)


def test_tiered_generate_samples_what_untiered_generate_samples(tiny_model):
    config = SamplingConfig(temperature=1.0, max_new_tokens=8, n=2)
    split = nnx.split(tiny_model)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    plain = generate(split, prompts, config, 0)
    for thread in compile_generate(split, config, len(prompts), 4, tiered=True):
        thread.join()
    with hold_background_compiles():
        first = generate(split, prompts, config, 0, tiered=True)
    programs.tiered_begin_rows.wait()
    programs._tiered_decode_steps.wait()
    second = generate(split, prompts, config, 0, tiered=True)
    assert calls(programs.tiered_begin_rows)[1] >= 1  # the second call ran optimised
    for result in (first, second):
        np.testing.assert_array_equal(result.tokens, plain.tokens)
        np.testing.assert_array_equal(result.lengths, plain.lengths)
        np.testing.assert_allclose(result.logprobs, plain.logprobs, atol=1e-5)
