"""Tools that ship with alignpipe, for recipes to offer (`tools: ['alignpipe.builtin_tools:calculator']`)."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
MAX_BITS = 4096
"""A larger power or product could take the host minutes and gigabytes (`9**9**9`): a model's call must not."""


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly as written, e.g. "(48 - 12) * 3 / 4".

    Args:
        expression: Numbers with + - * / // % ** and parentheses.
    """
    tree = ast.parse(expression.replace("^", "**").replace(",", ""), mode="eval")
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    # Walks the syntax tree of numbers and operators only: no names, calls or attributes, so nothing but arithmetic
    # can run (unlike `eval`).
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, int) and value.bit_length() > MAX_BITS:
            raise ValueError(f"the result has more than {MAX_BITS} bits")
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r} (numbers, + - * / // % ** and parentheses only)")
