"""Every op: one module each, one class each, holding all there is of that op but its wire row.

Every op of :data:`shared.protocol.OPS` is a class here
(:mod:`supervisor.control.ops._base`), by who serves it: an admin op
(:class:`~supervisor.control.admin.AdminOps` or
:class:`~supervisor.control.service.ServiceOps`), a tenant op the
:class:`~supervisor.admission.frontend.Frontend` answers from what it holds, an op
either capability may send (``events``: the frontend verifies the capability, the
class reads the event log for it), or a tenant op a worker answers. The class holds the op's handler (a worker op's is
the worker's: ``worker/server.py``, a process that never imports the
supervisor) and its row of docs/PROTOCOL.md (notes on its errors; the errors themselves, its arguments and its reply
come from the definition unless the class words them). The op's definition stays in
``shared/protocol.py``: the decoder, the client, the worker and the schema generator read
it, and ``shared`` imports nothing of the supervisor.

The classes are found by listing this package (:func:`op_table`), so adding an
op the supervisor serves is its definition plus one module here (and its tests):
the dispatch tables (:func:`handlers`, :func:`local_handlers`) and the doc rows
(``python -m supervisor.control.ops --write``) follow. Its ``twt`` command, if it has one,
is a module of :mod:`supervisor.cli.commands`, registered against the same definition (the
daemon never loads it). A worker op with nothing to say beyond its definition needs
no module here (a plain :class:`WorkerOp` stands in: its doc row is its definition).
:func:`op_table` refuses a module set that does not match the definitions, so the
supervisor does not start with an op it cannot serve.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import TYPE_CHECKING

from shared import protocol as proto
from supervisor.control.ops._base import (
    AdminOp,
    EitherCapabilityOp,
    FrontendOp,
    Op,
    OpHandler,
    Reply,
    ServiceOp,
    TenantOp,
    WorkerOp,
)

if TYPE_CHECKING:
    from supervisor.admission.frontend import EitherOp, LocalOp
    from supervisor.control.admin import AdminOps
    from supervisor.control.service import ServiceOps
    from supervisor.routing.pending import PendingTable

__all__ = ["AdminOp", "EitherCapabilityOp", "FrontendOp", "Op", "OpHandler", "Reply", "ServiceOp", "TenantOp", "WorkerOp",
           "check_table", "doc_table", "either_doc_table", "either_handlers", "handlers", "local_handlers", "op_table",
           "served_here", "tenant_doc_table"]

_KINDS = (AdminOp, ServiceOp, FrontendOp, EitherCapabilityOp, WorkerOp)


def served_here() -> set[str]:
    """The wire ops that must have a class here: every one the supervisor serves, and every one
    with a ``twt`` command (a worker op with neither may have one: for its doc notes)."""
    return {name for name, spec in proto.OPS.items() if spec.served_by != "worker" or spec.cli is not None}


def _stand_in(name: str) -> WorkerOp:
    """The class of a worker op that has no module here: its doc row is its definition."""
    cls: type[WorkerOp] = type(f"WorkerOp[{name}]", (WorkerOp,), {"name": name, "__module__": WorkerOp.__module__})
    return cls()


@functools.cache
def op_table() -> tuple[Op, ...]:
    """One instance of every op class of this package, in the order of the wire table.

    Raises RuntimeError when the classes and the wire rows disagree (:func:`check_table`).
    """
    found: list[Op] = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        found += [obj() for obj in vars(module).values()
                  if isinstance(obj, type) and issubclass(obj, _KINDS) and obj.__module__ == module.__name__]
    have = {op.name for op in found}
    found += [_stand_in(name) for name, spec in proto.OPS.items() if name not in have and spec.served_by == "worker"
              and spec.cli is None]
    check_table(found)
    order = list(proto.OPS)
    return tuple(sorted(found, key=lambda op: order.index(op.name)))


def check_table(found: list[Op]) -> None:
    """RuntimeError unless ``found`` holds exactly one op of the right part per wire op (every
    one :func:`served_here` among them), each noting only errors its definition lists."""
    names = [op.name for op in found]
    needed, defined = served_here(), set(proto.OPS)
    wrong = [op.name for op in found if op.name in defined and proto.OPS[op.name].served_by != op.part]
    stray_notes = [f"{op.name}: {sorted(set(op.error_notes) - set(op.spec.errors))}" for op in found
                   if op.name in defined and not set(op.error_notes) <= set(op.spec.errors)]
    stray_notes += [f"{op.name}: errors_doc written by hand (its definition's errors and error_notes make it)"
                    for op in found if type(op).errors_doc is not Op.errors_doc]
    if (not needed <= set(names) or not set(names) <= defined or len(names) != len(set(names)) or wrong
            or stray_notes):
        raise RuntimeError(f"ops without a class: {sorted(needed - set(names))}; classes of no op served here: "
                           f"{sorted(set(names) - defined)}; of the wrong part: {wrong}; "
                           f"twice: {sorted({n for n in names if names.count(n) > 1})}; "
                           f"notes on errors the definition does not list: {stray_notes}")


def handlers(admin: AdminOps, service: ServiceOps, pending: PendingTable) -> dict[str, OpHandler]:
    """Every admin op's handler bound to the part that serves it, by name: the frontend's dispatch
    table. Each request's answer goes through ``pending`` (its :class:`Reply`)."""

    def bind(op: AdminOp | ServiceOp) -> OpHandler:
        name = op.name
        if isinstance(op, AdminOp):
            return lambda client, rid, args: op.serve(admin, Reply(pending, client, rid, name), args)
        return lambda client, rid, args: op.serve(service, Reply(pending, client, rid, name), args)

    return {op.name: bind(op) for op in op_table() if isinstance(op, (AdminOp, ServiceOp))}


def local_handlers() -> dict[str, LocalOp]:
    """Every tenant op the frontend answers itself, by name: ``(frontend, tenant, args, body) -> result``
    (the frontend hands itself in: it is built with this table)."""
    return {op.name: op.serve for op in op_table() if isinstance(op, FrontendOp)}


def either_handlers() -> dict[str, EitherOp]:
    """Every op either capability may send, by name: ``(frontend, tenant or None, args) -> result``."""
    return {op.name: op.serve for op in op_table() if isinstance(op, EitherCapabilityOp)}


def doc_table() -> str:
    """docs/PROTOCOL.md's admin op table: one row per admin op class."""
    lines = ["| op | args | result | errors |", "|---|---|---|---|"]
    lines += [op.doc_row() for op in op_table() if isinstance(op, (AdminOp, ServiceOp))]
    return "\n".join(lines)


def either_doc_table() -> str:
    """docs/PROTOCOL.md's table of the ops either capability may send (``events``)."""
    lines = ["| op | args | result | errors |", "|---|---|---|---|"]
    lines += [op.doc_row() for op in op_table() if isinstance(op, EitherCapabilityOp)]
    return "\n".join(lines)


def tenant_doc_table() -> str:
    """docs/PROTOCOL.md's tenant op table: one row per tenant op class (worker and frontend ops)."""
    lines = ["| op | args | body in | result | body out | errors |", "|---|---|---|---|---|---|"]
    lines += [op.doc_row() for op in op_table() if isinstance(op, TenantOp)]
    return "\n".join(lines)
