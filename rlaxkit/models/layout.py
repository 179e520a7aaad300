"""The two layouts of a decoder's block parameters, and the one place that converts them.

Per layer (``ModelConfig.scan_layers=False``, the default) a parameter's path is
``("layers", i, "self_attn", "q_proj", "kernel")``, one array per layer. Stacked
(``scan_layers=True``) it is ``("layers", "self_attn", "q_proj", "kernel")``, one
array with a leading ``[num_layers]`` axis, which is what ``lax.scan`` walks over.
Hugging Face checkpoints, ``save_hf_checkpoint`` and the weight pushes see per-layer
names either way; the trainer's sharding rules and weight-decay mask look through the
layer axis with :func:`is_stacked`.

>>> from flax import nnx
>>> from rlaxkit.models import ModelConfig, Transformer
>>> cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
...                   num_layers=3, num_heads=2, num_kv_heads=1)
>>> model = Transformer(cfg, rngs=nnx.Rngs(0))
>>> stacked = relayout(model, scan_layers=True)
>>> stacked.layers.mlp.up_proj.kernel.shape      # [layers, hidden, intermediate]
(3, 16, 32)
>>> back = relayout(stacked, scan_layers=False)
>>> bool((back.layers[2].mlp.up_proj.kernel[...] == model.layers[2].mlp.up_proj.kernel[...]).all())
True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rlaxkit.models.transformer import Transformer

LAYERS = "layers"


def _name(key: object) -> object:
    """The plain name or index of one path entry (``nnx`` keys or ``jax`` key objects)."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return key


def is_stacked(path: Sequence[object]) -> bool:
    """Whether the leaf at ``path`` holds every layer along a leading axis.

    True for a path through ``"layers"`` not followed by a layer index; works on
    ``nnx`` flat-state paths and on ``jax.tree_util`` key paths (so also on optimizer
    moments, whose paths end in the parameter's).
    """
    names = [_name(k) for k in path]
    for i, name in enumerate(names[:-1]):
        if name == LAYERS:
            return not isinstance(names[i + 1], int)
    return False


def stack_layers(state: nnx.State) -> nnx.State:
    """Per-layer state (``layers/i/...``) to stacked (``layers/...`` with ``[L, ...]``)."""
    flat = nnx.to_flat_state(state)
    out: list[tuple[tuple[Any, ...], Any]] = []
    by_rest: dict[tuple[Any, ...], dict[int, Any]] = {}
    for path, leaf in flat:
        at = _layer_index(path)
        if at is None:
            out.append((path, leaf))
            continue
        key = (*path[:at], *path[at + 1 :])
        index = path[at]
        assert isinstance(index, int)  # _layer_index found an int there
        by_rest.setdefault(key, {})[index] = leaf
    for key, layers in by_rest.items():
        order = sorted(layers)
        if order != list(range(len(order))):
            raise ValueError(f"layers {order} of {'/'.join(map(str, key))} are not 0..L-1")
        first = layers[order[0]]
        out.append((key, first.replace(jnp.stack([layers[i][...] for i in order]))))
    return nnx.from_flat_state(out)


def unstack_layers(state: nnx.State) -> nnx.State:
    """Stacked state to per-layer: the inverse of :func:`stack_layers`."""
    out: list[tuple[tuple[Any, ...], Any]] = []
    for path, leaf in nnx.to_flat_state(state):
        if not is_stacked(path):
            out.append((path, leaf))
            continue
        at = list(path).index(LAYERS) + 1
        value = leaf[...]
        for i in range(value.shape[0]):
            out.append(((*path[:at], i, *path[at:]), leaf.replace(value[i])))
    return nnx.from_flat_state(out)


def _layer_index(path: Sequence[object]) -> int | None:
    """Position of the layer index in a per-layer path, else ``None``."""
    for i, name in enumerate(path[:-1]):
        if name == LAYERS and isinstance(path[i + 1], int):
            return i + 1
    return None


def relayout_tree(tree: object, *, scan_layers: bool) -> object:
    """Every ``nnx.State`` inside ``tree`` (a ``TrainState``: parameters, AdamW moments,
    reference weights) converted to the layout ``scan_layers`` asks for; a state already
    in it, and every other leaf, is kept.

    A checkpoint restores in the layout it was saved in (the restore target must match
    it); ``relayout_tree`` then moves it to the other one.
    """

    def convert(node: object) -> object:
        if not isinstance(node, nnx.State):
            return node
        paths = [path for path, _ in nnx.to_flat_state(node)]
        stacked = any(is_stacked(p) for p in paths)
        per_layer = any(_layer_index(p) is not None for p in paths)
        if scan_layers and per_layer:
            return stack_layers(node)
        if not scan_layers and stacked:
            return unstack_layers(node)
        return node

    return jax.tree.map(convert, tree, is_leaf=lambda x: isinstance(x, nnx.State))


def relayout(model: Transformer, *, scan_layers: bool) -> Transformer:
    """``model`` with its blocks in the layout ``scan_layers`` asks for (same numbers).

    Returns ``model`` itself when it is already in that layout; otherwise a new
    ``Transformer`` whose parameters are stacked (or split) copies.
    """
    if model.config.scan_layers == scan_layers:
        return model
    config = model.config.replace(scan_layers=scan_layers)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    state = nnx.state(model)
    state = stack_layers(state) if scan_layers else unstack_layers(state)
    return nnx.merge(graphdef, state)
