"""rlaxkit's JAX-native inference engine: a jitted KV-cache sampler that records behaviour
log-probs and weight versions per token, with continuous batching and interruptible
generation.
"""

from rlaxkit.inference.config import (
    InferenceConfig,
    SamplingConfig,
    bucket_length,
    bucket_rows,
)
from rlaxkit.inference.engine import InferenceEngine
from rlaxkit.inference.generate import compile_generate, generate
from rlaxkit.inference.reference import generate_by_recompute
from rlaxkit.inference.results import Completion, GenerationResult
from rlaxkit.inference.sampler import kept_tokens, sample_tokens
from rlaxkit.inference.text import make_text_generate

__all__ = [
    "Completion",
    "GenerationResult",
    "InferenceConfig",
    "InferenceEngine",
    "SamplingConfig",
    "bucket_length",
    "bucket_rows",
    "compile_generate",
    "generate",
    "generate_by_recompute",
    "kept_tokens",
    "make_text_generate",
    "sample_tokens",
]
