"""Exact evaluation of untrusted arithmetic expressions, parsed with ``ast`` (never ``eval``).

Only integer literals, the binary operators ``+ - * /`` and parentheses are accepted;
names, calls, attribute access, subscripts, ``**``, unary signs and floats are rejected
before anything is computed. Arithmetic is exact, on ``fractions.Fraction``.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from fractions import Fraction

MAX_EXPRESSION_CHARS = 256  # longer input is rejected before parsing (ast recursion depth)

_BINARY_OPS: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


class ExpressionError(ValueError):
    """The text is not an expression of integers, ``+ - * /`` and parentheses."""


def evaluate_expression(text: str) -> tuple[Fraction, list[int]]:
    """The exact value of ``text`` and the integer literals it uses, in order.

    >>> evaluate_expression("(3 + 5) / 2")
    (Fraction(4, 1), [3, 5, 2])

    Raises:
      ExpressionError: on anything but integer literals, ``+ - * /`` and parentheses, on
        input longer than ``MAX_EXPRESSION_CHARS``, and on division by zero.
    """
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        raise ExpressionError(f"not an expression: {type(error).__name__}") from None
    literals: list[int] = []
    return _evaluate(tree.body, literals), literals


def _evaluate(node: ast.AST, literals: list[int]) -> Fraction:
    if isinstance(node, ast.Constant):
        # bool is an int subclass; reject it along with floats, strings and complex numbers.
        if type(node.value) is not int:
            raise ExpressionError(f"literal {node.value!r} is not an integer")
        literals.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp):
        op = _BINARY_OPS.get(type(node.op))
        if op is None:
            raise ExpressionError(f"operator {type(node.op).__name__} is not allowed")
        left = _evaluate(node.left, literals)
        right = _evaluate(node.right, literals)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ExpressionError("division by zero")
        return op(left, right)
    raise ExpressionError(f"{type(node).__name__} is not allowed")


def render(value: Fraction) -> str:
    """``'7'`` for integers, ``'7/2'`` otherwise."""
    return str(value.numerator) if value.denominator == 1 else str(value)
