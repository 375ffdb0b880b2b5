"""A picklable reference to a function by name, imported only where it is called.

The supervisor starts workers with ``multiprocessing`` and must hand over a
target. Pickling ``worker.main.run`` itself would import the worker package
into the supervisor; ``EntryPoint("worker.main:run")`` names it instead, and
only the child process imports it.
"""

from __future__ import annotations

import importlib

__all__ = ["EntryPoint"]


class EntryPoint:
    """``EntryPoint("pkg.module:function")(*args)`` imports and calls it."""

    __slots__ = ("spec",)

    def __init__(self, spec: str) -> None:
        module, sep, attr = spec.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"entry point must be 'module:function', got {spec!r}")
        self.spec = spec

    def __call__(self, *args: object, **kwargs: object) -> object:
        module, _, attr = self.spec.partition(":")
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)

    def __reduce__(self) -> tuple[object, ...]:
        return (EntryPoint, (self.spec,))

    def __repr__(self) -> str:
        return f"EntryPoint({self.spec!r})"
