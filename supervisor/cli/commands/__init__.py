"""The op commands: one module per op that owns a ``twt`` command, one :class:`OpCommand` each.

Each registers against its op's definition (:data:`shared.protocol.OPS`: ``OpSpec.cli`` names
the command) from the command line's own layer; the op's handler and doc row are its class
under :mod:`supervisor.control.ops`, which the daemon loads without this package.
:func:`commands` finds the classes by listing this package and refuses a set that does not
match the definitions; ``supervisor.cli.ops`` makes a ``twt`` command of each.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from shared import protocol as proto
from supervisor.cli.commands._base import Connect, OpCommand

__all__ = ["Connect", "OpCommand", "commands"]


@functools.cache
def commands() -> tuple[OpCommand, ...]:
    """One instance of every command class of this package, in the order of the wire table.

    RuntimeError when a class names no op, or a command its op's definition does not name.
    """
    found: list[OpCommand] = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        found += [obj() for obj in vars(module).values()
                  if isinstance(obj, type) and issubclass(obj, OpCommand) and obj.__module__ == module.__name__]
    wrong = [type(c).__name__ for c in found if c.name not in proto.OPS or proto.OPS[c.name].cli != c.command]
    names = [c.name for c in found]
    if wrong or len(names) != len(set(names)):
        raise RuntimeError(f"commands of no op or of another command than their definition names: {wrong}; "
                           f"twice: {sorted({n for n in names if names.count(n) > 1})}")
    order = list(proto.OPS)
    return tuple(sorted(found, key=lambda c: order.index(c.name)))
