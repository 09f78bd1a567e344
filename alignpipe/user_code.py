"""Functions of the user's own, named in a recipe as `package.module:function` (reward functions, tools)."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def check_callable_name(spec: str, what: str) -> str:
    """`spec` if it has the form `package.module:function`, else a ValueError saying what is wrong. The module is not
    imported: it may exist only where the stage runs."""
    module_name, sep, attr = spec.partition(":")
    if sep and all(part.isidentifier() for part in module_name.split(".")) and attr.isidentifier():
        return spec
    raise ValueError(
        f"{what} {spec!r} is not `package.module:function` (a dotted module path, a colon, a function name)"
    )


def import_callable(spec: str, what: str) -> Callable:
    """The callable `package.module:function` names; a ValueError says which part does not resolve."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r} is not `package.module:function`")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{what} {spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn
