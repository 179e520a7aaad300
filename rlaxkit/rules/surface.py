"""A package's surface resolved on first use (PEP 562): ``import rlaxkit.trainer.sft``
does not import the trainer's step, nor ``rlaxkit.util.rundirs`` JAX. Plain Python,
here so that the simulator's subpackages use it too.

>>> from rlaxkit.rules.surface import lazy_names
>>> namespace = {}
>>> getattr_ = lazy_names("json", {"JSONEncoder": "encoder"}, namespace)
>>> getattr_("JSONEncoder") is namespace["JSONEncoder"]
True
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_names(
    package: str, modules: Mapping[str, str], namespace: dict[str, object]
) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``package``: a name of ``modules`` (name -> the
    package's module that defines it) is imported when first read, then kept in the
    package's ``namespace`` (its ``globals()``)."""

    def __getattr__(name: str) -> object:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    return __getattr__
