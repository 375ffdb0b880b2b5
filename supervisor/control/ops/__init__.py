"""The admin ops: one module each, one class each, holding all there is of that op.

Every op the admin capability sends (``served_by`` "admin" or "service" in
:data:`shared.protocol.OPS`) is a class here (:mod:`supervisor.control.ops._base`):
its handler over :class:`~supervisor.control.admin.AdminOps` or
:class:`~supervisor.control.service.ServiceOps`, its ``twt`` command (arguments and
rendering) and its row of docs/PROTOCOL.md. Its wire row stays in
``shared/protocol.py``: the decoder, the worker and the schema generator read it,
and ``shared`` imports nothing of the supervisor.

The classes are found by listing this package (:func:`op_table`), so adding an
op is its wire row plus one module here (and its tests): the frontend's
dispatch table (:func:`handlers`), the ``twt`` commands (``supervisor.cli.ops``)
and the doc table (``python -m supervisor.control.ops --write``) follow.
:func:`op_table` refuses a module set that does not match the wire rows
one to one, so the supervisor does not start with an op it cannot serve.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Any

from shared import protocol as proto
from supervisor.control.admin import AdminOps
from supervisor.control.ops._base import AdminOp, Connect, Op, OpHandler, ServiceOp
from supervisor.control.service import ServiceOps

__all__ = ["AdminOp", "Connect", "Op", "OpHandler", "ServiceOp", "check_table", "commands", "doc_table", "handlers", "op_table"]


@functools.cache
def op_table() -> tuple[Op[Any], ...]:
    """One instance of every op class of this package, in the order of the wire table.

    Raises RuntimeError when the classes and the wire rows of the admin ops
    disagree: an op without a class, a class without an op or of the wrong
    part, or two classes for one op.
    """
    found: list[Op[Any]] = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        found += [obj() for obj in vars(module).values()
                  if isinstance(obj, type) and issubclass(obj, (AdminOp, ServiceOp))
                  and obj.__module__ == module.__name__]
    check_table(found)
    order = list(proto.OPS)
    return tuple(sorted(found, key=lambda op: order.index(op.name)))


def check_table(found: list[Op[Any]]) -> None:
    """RuntimeError unless ``found`` holds exactly one op of the right part per admin op of the wire table."""
    names = [op.name for op in found]
    declared = {name for name, spec in proto.OPS.items() if spec.served_by in ("admin", "service")}
    wrong = [op.name for op in found if op.name in declared and proto.OPS[op.name].served_by != op.part]
    if set(names) != declared or len(names) != len(set(names)) or wrong:
        raise RuntimeError(f"admin ops without a class: {sorted(declared - set(names))}; classes of no admin op: "
                           f"{sorted(set(names) - declared)}; of the wrong part: {wrong}; "
                           f"twice: {sorted({n for n in names if names.count(n) > 1})}")


def handlers(admin: AdminOps, service: ServiceOps) -> dict[str, OpHandler]:
    """Every admin op's handler bound to the part that serves it, by name: the frontend's dispatch table."""
    table: dict[str, OpHandler] = {}
    for op in op_table():
        if isinstance(op, AdminOp):
            table[op.name] = functools.partial(op.serve, admin)
        elif isinstance(op, ServiceOp):
            table[op.name] = functools.partial(op.serve, service)
    return table


def commands() -> tuple[Op[Any], ...]:
    """The ops that own a ``twt`` command, in the order of the wire table."""
    return tuple(op for op in op_table() if op.command is not None)


def doc_table() -> str:
    """docs/PROTOCOL.md's admin op table: one row per op class (``python -m supervisor.control.ops --write``)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| op | args | result | errors |", "|---|---|---|---|"]
    lines += [f"| `{op.name}` | {cell(op.args_doc)} | {cell(op.result_doc)} | {cell(op.errors_doc)} |"
              for op in op_table()]
    return "\n".join(lines)
