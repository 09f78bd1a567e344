"""What `merged_projections` and `fused_residuals` share: a change to some modules' forwards that holds only while its
object is `active`.

Each such change replaces the modules' forwards once (`wrap`), with a forward that asks `in_effect()` which change
holds now and runs the module's own forward where none does. `active` sets a context variable: the change holds
within the `with`, and in contexts copied from within (a CUDA graph replays what was recorded there; the CPU
stand-in of one replays in the context it recorded in). Under `torch.compile` no change holds: dynamo does not trace
a context variable, and inductor fuses on its own.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, ClassVar

import torch


class ScopedPatch:
    """Each direct subclass gets a context variable of its own, which its subclasses share (their objects are the
    same kind of change); `forget` drops what one scope's forwards left behind."""

    _current: ClassVar[ContextVar[Any]]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if ScopedPatch in cls.__bases__:
            cls._current = ContextVar(f"alignpipe_{cls.__name__}", default=None)

    @classmethod
    def in_effect(cls) -> Any:
        """The object of this class that is active here; None where none is, or while dynamo traces."""
        return None if torch.compiler.is_compiling() else cls._current.get()  # first: no context variable traced

    @contextlib.contextmanager
    def active(self):
        """Within (and in contexts copied from within): this change holds."""
        token = self._current.set(self)
        try:
            yield
        finally:
            self._current.reset(token)
            self.forget()

    def forget(self) -> None:  # a hook: nothing kept by default
        """The scope ended: drop what its forwards left behind."""

    @staticmethod
    def wrap(module: torch.nn.Module, forward: Callable, flag: str) -> None:
        """Give `module` the instance forward `forward`, once (`flag`: a plain attribute saying it was done)."""
        if getattr(module, flag, False) is False:
            module.forward = types.MethodType(forward, module)
            object.__setattr__(module, flag, True)  # a plain flag, not a buffer
