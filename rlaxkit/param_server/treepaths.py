"""Stable, JSON-friendly names for the leaves of a pytree.

A snapshot on disk must be readable by another process that has none of the writer's
Python objects, so the tree structure is stored as the flattened *key path* of every
leaf rather than a pickled ``PyTreeDef``. Each path is a list of ``[kind, key]`` pairs:

- ``["key", k]`` for a mapping entry (``jax.tree_util.DictKey``; ``k`` a str or int),
- ``["index", i]`` for a list or tuple element (``SequenceKey``),
- ``["attr", name]`` for an attribute (``GetAttrKey``, e.g. the ``.value`` of an
  ``nnx.Variable``),
- ``["flat", i]`` for a custom node's i-th child (``FlattenedIndexKey``).

A reader rebuilds the writer's exact tree from a *template* pytree with the same key
paths (for instance ``nnx.eval_shape`` of the model's state), or, without one, a nested
``dict`` (see :func:`nested_dict`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from rlaxkit.rules.validation import is_int

__all__ = ["KeyPath", "encode_path", "flatten", "nested_dict", "path_str", "unflatten_like"]

KeyPath = list[list[object]]


def encode_path(path: Sequence[object]) -> KeyPath:
    """The JSON form of a JAX key path (see the module docstring).

    Raises:
        ValueError: the path holds a key that JSON cannot carry faithfully.
    """
    out: KeyPath = []
    for entry in path:
        if isinstance(entry, DictKey):
            key = entry.key
            if not (isinstance(key, str) or is_int(key)):
                raise ValueError(
                    f"leaf {jax.tree_util.keystr(tuple(path))}: dict key {key!r} is neither "
                    "str nor int, so it cannot be stored by name"
                )
            out.append(["key", key])
        elif isinstance(entry, SequenceKey):
            out.append(["index", entry.idx])
        elif isinstance(entry, GetAttrKey):
            out.append(["attr", entry.name])
        elif isinstance(entry, FlattenedIndexKey):
            out.append(["flat", entry.key])
        else:
            raise ValueError(
                f"leaf {jax.tree_util.keystr(tuple(path))}: unsupported key type "
                f"{type(entry).__name__}"
            )
    return out


def path_str(path: KeyPath) -> str:
    """A readable form of an encoded path, e.g. ``['layers'][0]['kernel'].value``."""
    parts = []
    for kind, key in path:
        parts.append(f".{key}" if kind == "attr" else f"[{key!r}]")
    return "".join(parts) or "<root>"


def flatten(tree: object) -> tuple[list[KeyPath], list[object], Any]:
    """Returns ``(encoded key paths, leaves, treedef)`` of ``tree``."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [encode_path(path) for path, _ in with_paths]
    leaves = [leaf for _, leaf in with_paths]
    return paths, leaves, treedef


def unflatten_like(template: object, paths: list[KeyPath], leaves: Sequence[object]) -> object:
    """Places ``leaves`` (named by ``paths``) into the tree structure of ``template``.

    Raises:
        ValueError: the template's leaves are not exactly the named ones, in order.
    """
    template_paths, _, treedef = flatten(template)
    if template_paths != paths:
        missing = [p for p in paths if p not in template_paths]
        extra = [p for p in template_paths if p not in paths]
        detail = []
        if missing:
            detail.append(f"not in template: {path_str(missing[0])}")
        if extra:
            detail.append(f"only in template: {path_str(extra[0])}")
        if not detail:
            detail.append("same leaves in a different order")
        raise ValueError(
            f"template tree does not match the stored tree ({len(template_paths)} vs "
            f"{len(paths)} leaves; {'; '.join(detail)})"
        )
    return jax.tree_util.tree_unflatten(treedef, leaves)


def nested_dict(paths: list[KeyPath], leaves: Sequence[object]) -> dict[object, object]:
    """Rebuilds a nested ``dict`` from named leaves, without any template.

    Every path entry becomes a dict key (sequence indices become int keys). A final
    ``.value`` attribute (the wrapper of an ``nnx.Variable``) is dropped, so the nested
    dict of an ``nnx.State`` is its ``State.to_pure_dict()`` form, ready for
    ``nnx.replace_by_pure_dict``.

    Raises:
        ValueError: two leaves would land on the same key, or a leaf sits at the root.
    """
    root: dict[object, object] = {}
    for path, leaf in zip(paths, leaves, strict=True):
        keys = [key for _, key in path]
        if path and path[-1] == ["attr", "value"] and len(path) > 1:
            keys = keys[:-1]
        if not keys:
            raise ValueError("a single-leaf tree needs a template to be rebuilt")
        node = root
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ValueError(f"leaf {path_str(path)} collides with another leaf")
            node = child
        if keys[-1] in node:
            raise ValueError(f"leaf {path_str(path)} collides with another leaf")
        node[keys[-1]] = leaf
    return root
