"""Shared test setup: CPU only, float32, quiet Ray, tiny models."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402


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


def pytest_configure(config):
    """Share compiled XLA programs between tests (many build identical tiny models)."""
    import jax

    cache = config.cache.mkdir("jax_compilation_cache")
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
