"""What one admin op is: its wire row, its handler, its ``twt`` command and its doc row, in one class.

A subclass of :class:`AdminOp` (served by :class:`~supervisor.control.admin.AdminOps`)
or :class:`ServiceOp` (served by :class:`~supervisor.control.service.ServiceOps`)
in a module of its own under :mod:`supervisor.control.ops` declares:

* ``name``: the wire op. Its row in :data:`shared.protocol.OPS` (arguments,
  reply, errors, who serves it) is the contract, kept in ``shared/`` because
  the decoder, the worker and the schema generator read it too;
* :meth:`Op.serve`: the handler, over its part; the frontend has already
  verified the admin capability and checked the arguments against the row;
* ``command``, ``help``, ``description``, ``json_help``, :meth:`Op.arguments`
  and :meth:`Op.run`: its ``twt`` command (``supervisor.cli.ops`` adds the
  run-dir options and ``--json``, and hands :meth:`Op.run` a way to connect);
* ``args_doc``, ``result_doc``, ``errors_doc``: its row of docs/PROTOCOL.md's
  admin op table (``python -m supervisor.control.ops --write``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from shared import protocol as proto
from supervisor.client.api import SupervisorClient
from supervisor.control.admin import AdminOps
from supervisor.control.service import ServiceOps

__all__ = ["AdminOp", "Connect", "Op", "OpHandler", "ServiceOp"]

#: one op's handler, bound to its part: ``(client, rid, args)``, answering through the pending table (at once or later)
OpHandler = Callable[[bytes, int, dict[str, Any]], None]

P = TypeVar("P", AdminOps, ServiceOps)


class Connect(Protocol):
    """A client of the supervisor the command line names (``--run-dir`` or ``--connect``); the
    read-only commands' timeout unless one is given (the ops that wait for workers give theirs)."""

    def __call__(self, timeout_s: float | None = None) -> SupervisorClient: ...


class Op(Generic[P]):
    """One admin op (see the module docstring); subclass :class:`AdminOp` or :class:`ServiceOp`."""

    #: the wire op: its row in shared.protocol.OPS
    name: ClassVar[str]
    #: the part that serves it: the row's ``served_by``
    part: ClassVar[str]
    #: its row of PROTOCOL.md's admin op table: the arguments, the result and the errors, in words
    args_doc: ClassVar[str] = "`{}`"
    result_doc: ClassVar[str] = ""
    errors_doc: ClassVar[str] = ""
    #: the ``twt`` command it owns (None: another command sends it, or the library only)
    command: ClassVar[str | None] = None
    help: ClassVar[str] = ""
    description: ClassVar[str] = ""
    json_help: ClassVar[str] = ""

    @property
    def spec(self) -> proto.OpSpec:
        """The wire row (arguments, reply, errors, who serves it)."""
        return proto.OPS[self.name]

    def serve(self, part: P, client: bytes, rid: int, args: dict[str, Any]) -> None:
        """Answer one request (through ``part.pending``, at once or later); raise a typed error to refuse it."""
        raise NotImplementedError

    def answer(self, part: P, client: bytes, rid: int, result: Any) -> None:
        """The request's answer, at once."""
        part.pending.answer(client, rid, self.name, result)

    def arguments(self, p: argparse.ArgumentParser) -> None:
        """The command's own arguments (``--json`` and the run-dir options are added for it)."""

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        """The command: call the supervisor, print the answer; the exit status."""
        raise NotImplementedError(f"op {self.name!r} has no twt command")


class AdminOp(Op[AdminOps]):
    """An op :class:`~supervisor.control.admin.AdminOps` serves."""

    part = "admin"


class ServiceOp(Op[ServiceOps]):
    """An op :class:`~supervisor.control.service.ServiceOps` serves."""

    part = "service"
