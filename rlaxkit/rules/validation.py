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
>>> check_int("max_digits", "two", minimum=1, maximum=18)
Traceback (most recent call last):
    ...
ValueError: max_digits: must be an integer in [1, 18], got 'two'
>>> check_number("test_fraction", 1.5, minimum=0.0, maximum=1.0)
Traceback (most recent call last):
    ...
ValueError: test_fraction: must be a number in [0.0, 1.0], got 1.5
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Literal, Protocol, TypeGuard, overload

__all__ = ["check_int", "check_number", "check_tokenizer_fits", "is_int", "is_number"]


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
    maximum: int | None = None,
    allowed: str | None = None,
    numpy: bool = False,
) -> int:
    """``value`` when it is an integer (:func:`is_int`) in ``[minimum, maximum]``.

    Args:
        name: the field, first in the message (``"epochs"``, ``"faults[2].count"``).
        value: the value given.
        minimum: the smallest value allowed; ``None``: no lower bound.
        maximum: the largest value allowed; ``None``: no upper bound.
        allowed: what the message says is allowed; default ``"an integer >= {minimum}"``,
            ``"an integer in [{minimum}, {maximum}]"`` and so on.
        numpy: also accept NumPy's integer scalars (see :func:`is_int`).

    Raises:
        ValueError: ``"{name}: must be {allowed}, got {value!r}"``.
    """
    if not is_int(value, numpy=numpy) or not _within(value, minimum, maximum):
        allowed = allowed or f"an integer{_bounds(minimum, maximum)}"
        raise ValueError(f"{name}: must be {allowed}, got {value!r}")
    return value


def check_number(
    name: str,
    value: object,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    allowed: str | None = None,
) -> float:
    """``value`` when it is a finite number (:func:`is_number`) in ``[minimum, maximum]``.

    Args:
        name: the field, first in the message.
        value: the value given.
        minimum: the smallest value allowed; ``None``: no lower bound.
        maximum: the largest value allowed; ``None``: no upper bound.
        allowed: what the message says is allowed; default ``"a number in [0.0, 1.0]"``
            and so on.

    Raises:
        ValueError: ``"{name}: must be {allowed}, got {value!r}"``.
    """
    if not (is_number(value) and math.isfinite(value) and _within(value, minimum, maximum)):
        allowed = allowed or f"a number{_bounds(minimum, maximum)}"
        raise ValueError(f"{name}: must be {allowed}, got {value!r}")
    return value


def _within(value: float, minimum: float | None, maximum: float | None) -> bool:
    return (minimum is None or value >= minimum) and (maximum is None or value <= maximum)


def _bounds(minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


class _HasVocabulary(Protocol):
    vocab_size: int


def check_tokenizer_fits(tokenizer: _HasVocabulary, vocab_size: int, where: str) -> None:
    """Raises unless every id ``tokenizer`` can produce is below the model's ``vocab_size``.

    An id at or past ``vocab_size`` indexes past the embedding table: JAX clamps or fills
    such gathers, so the model gives NaN or wrong logits without an error. A model larger
    than its tokenizer (HF checkpoints pad their vocabulary) is fine.

    Args:
        tokenizer: anything with ``vocab_size`` (the ids it produces are below it).
        vocab_size: rows of the model's embedding table (``ModelConfig.vocab_size``).
        where: what is being checked, first in the message (a checkpoint path).

    Raises:
        ValueError: naming both sizes and the fix.

    >>> class Chars:
    ...     vocab_size = 20
    >>> check_tokenizer_fits(Chars(), 32, "model")
    >>> check_tokenizer_fits(Chars(), 16, "model")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    ValueError: model: the tokenizer has 20 tokens but the model's vocab_size is 16; ids ...
    """
    tokens = tokenizer.vocab_size
    if tokens > vocab_size:
        raise ValueError(
            f"{where}: the tokenizer has {tokens} tokens but the model's vocab_size is "
            f"{vocab_size}; ids {vocab_size}..{tokens - 1} would index past the embedding "
            "table (NaN logits). Use the tokenizer the model was built with, or a model with "
            f"vocab_size >= {tokens}"
        )
