"""The Qwen2 / Qwen3 / Llama-3 decoder, its KV cache, checkpoints and tokenizers."""

from rlaxkit.models.config import ModelConfig, RopeScaling
from rlaxkit.models.hf import (
    abstract_model,
    check_hf_checkpoint,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from rlaxkit.models.kv_cache import KVCache
from rlaxkit.models.layout import (
    is_stacked,
    relayout,
    relayout_tree,
    stack_layers,
    unstack_layers,
)
from rlaxkit.models.tokenizer import (
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    save_tokenizer,
)
from rlaxkit.models.transformer import (
    REMAT_POLICIES,
    RematPolicy,
    Transformer,
    positions_from_mask,
)
from rlaxkit.util import hostmem

# Before any program runs: XLA:CPU then keeps its freed buffers (``rlaxkit.util.hostmem``).
hostmem.keep()

__all__ = [
    "CharTokenizer",
    "HFTokenizer",
    "REMAT_POLICIES",
    "RematPolicy",
    "KVCache",
    "ModelConfig",
    "RopeScaling",
    "Tokenizer",
    "Transformer",
    "abstract_model",
    "check_hf_checkpoint",
    "is_stacked",
    "load_hf_checkpoint",
    "positions_from_mask",
    "relayout",
    "relayout_tree",
    "save_hf_checkpoint",
    "save_tokenizer",
    "stack_layers",
    "unstack_layers",
    "load_tokenizer",
]
