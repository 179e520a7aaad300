"""Type checks for validating configs and arguments: an integer is an ``int`` that is not
a ``bool``.

``bool`` subclasses ``int``, so ``isinstance(True, int)`` holds, and a count read from a
YAML file would take ``true`` as 1 without these checks. Plain Python (no JAX, no NumPy),
so ``sim`` uses them too.

>>> is_int(3), is_int(True), is_int(3.0)
(True, False, False)
>>> is_number(0.5), is_number(False)
(True, False)
>>> check_int("epochs", 2, minimum=1)
2
>>> check_int("epochs", True, minimum=1)
Traceback (most recent call last):
    ...
ValueError: epochs: must be an integer >= 1, got True
"""

from __future__ import annotations

import numbers
from typing import Any, Literal, TypeGuard, overload

__all__ = ["check_int", "is_int", "is_number"]


@overload
def is_int(value: object, *, numpy: Literal[False] = False) -> TypeGuard[int]: ...


@overload
def is_int(value: object, *, numpy: bool) -> bool: ...


def is_int(value: object, *, numpy: bool = False) -> bool:
    """Whether ``value`` is an ``int`` and not a ``bool``.

    Args:
        value: anything.
        numpy: also accept NumPy's integer scalars (``np.int64(3)``; any
            ``numbers.Integral`` that is not a ``bool``). ``np.bool_`` is never an integer.
    """
    if isinstance(value, bool):
        return False
    return isinstance(value, numbers.Integral if numpy else int)


def is_number(value: object) -> TypeGuard[int | float]:
    """Whether ``value`` is an ``int`` or a ``float`` and not a ``bool``.

    NaN and the infinities are numbers here; test ``math.isfinite`` where they are not
    wanted.
    """
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    allowed: str | None = None,
    numpy: bool = False,
) -> int:
    """``value`` when it is an integer (:func:`is_int`) ``>= minimum``.

    Args:
        name: the field, first in the message (``"epochs"``, ``"faults[2].count"``).
        value: the value given.
        minimum: the smallest value allowed; ``None``: any integer.
        allowed: what the message says is allowed; default ``"an integer >= {minimum}"``
            (``"an integer"`` without a minimum).
        numpy: also accept NumPy's integer scalars (see :func:`is_int`).

    Raises:
        ValueError: ``"{name}: must be {allowed}, got {value!r}"``.
    """
    if not is_int(value, numpy=numpy) or (minimum is not None and value < minimum):
        if allowed is None:
            allowed = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise ValueError(f"{name}: must be {allowed}, got {value!r}")
    return value
