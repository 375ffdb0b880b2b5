"""What one op the supervisor serves is: its handler and its doc row, in one class, registered against its definition.

A subclass of :class:`AdminOp` (served by :class:`~supervisor.control.admin.AdminOps`),
:class:`ServiceOp` (served by :class:`~supervisor.control.service.ServiceOps`),
:class:`FrontendOp` (a tenant op the :class:`~supervisor.admission.frontend.Frontend`
answers from what the supervisor holds), :class:`EitherCapabilityOp` (an op either
capability may send, ``events``: the frontend answers it too) or :class:`WorkerOp`
(a tenant op a worker answers: its handler is in ``worker/server.py``) in a module of its own under
:mod:`supervisor.control.ops` declares:

* ``name``: the wire op. Its definition in :data:`shared.protocol.OPS` (arguments,
  reply, errors, who serves it, what the request path does for it) is the contract,
  kept in ``shared/`` because the decoder, the client, the worker and the schema
  generator read it too; this class registers the op's server side against it;
* ``serve``: the handler (not for a worker op). The frontend has already verified
  the capability, admitted the request and checked its arguments against the row.
  An admin op's handler is the adapter between the wire and the domain: it reads
  the arguments, calls its part (:class:`~supervisor.control.admin.AdminOps`,
  :class:`~supervisor.control.service.ServiceOps`, whose methods take no client
  identity and return a result or a completion) and answers through its
  :class:`Reply` - the one place the request's client and id are held;
* ``args_doc``, ``result_doc``, ``error_notes`` (and for a tenant op ``body_in_doc``,
  ``body_out_doc``): its row of docs/PROTOCOL.md (``python -m supervisor.control.ops --write``),
  each derived from the definition unless given: the errors column is always the
  definition's errors, each with its note from ``error_notes`` (a note of an error the
  definition does not list is refused by :func:`~supervisor.control.ops.check_table`).

An op's ``twt`` command registers against the same definition from the command line's
layer (:mod:`supervisor.cli.commands`): the daemon loads this package, never that one, so it
loads neither the client nor argparse. A worker op with nothing to say beyond its definition
needs no class: :func:`~supervisor.control.ops.op_table` stands a plain :class:`WorkerOp` in for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

from shared import protocol as proto
from shared.errors import TensorWasmError

if TYPE_CHECKING:
    from supervisor.admission.frontend import Frontend
    from supervisor.control.admin import AdminOps
    from supervisor.control.service import ServiceOps
    from supervisor.routing.pending import PendingTable
    from supervisor.runtime.completion import Completion
    from supervisor.runtime.tenants import TenantRuntime

__all__ = ["AdminOp", "Args", "EitherCapabilityOp", "FrontendOp", "Op", "OpHandler", "PartOp", "Reply",
           "ServiceOp", "TenantOp", "WorkerOp"]

#: an op's arguments as its handler reads them: decoded msgpack, each declared one's type checked
#: by ``check_args`` against the wire row before the handler runs (the row is the precise type);
#: a handler reads one through ``shared.protocol.arg_str`` / ``arg_int`` / ... which narrow it
Args = Mapping[str, object]
#: one admin op's handler, bound to its part: ``(client, rid, args)``, answering through the pending table (at once or later)
OpHandler = Callable[[bytes, int, Args], None]

P = TypeVar("P", "AdminOps", "ServiceOps")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Reply:
    """Where one admin request's answer goes: its client and id, which only the op adapter
    holds (the domain methods never see them); every answer goes through the pending table."""

    pending: PendingTable
    client: bytes
    rid: int
    op: str

    def ok(self, result: object) -> None:
        """Answer ``result`` now."""
        self.pending.answer(self.client, self.rid, self.op, result)

    def refuse(self, exc: TensorWasmError) -> None:
        """Answer ``exc`` now."""
        self.pending.refuse(self.client, self.rid, self.op, exc)

    def error_dict(self, err: dict[str, object]) -> None:
        """Answer an error handed over as a wire dict (a worker's refusal of a fault)."""
        self.pending.answer_error(self.client, self.rid, self.op, err)

    def when(self, done: Completion[T]) -> None:
        """Answer once ``done`` completes: its value, or its error."""
        done.then(self.ok, self.refuse)


class Op:
    """One op the supervisor serves (see the module docstring): its doc row (and, by kind, its handler)."""

    #: the wire op: its row in shared.protocol.OPS
    name: ClassVar[str]
    #: the part that serves it: the row's ``served_by``
    part: ClassVar[str]
    #: its row of PROTOCOL.md: the arguments and the result in words (empty: from the definition)
    args_doc: ClassVar[str] = ""
    result_doc: ClassVar[str] = ""
    #: a few words on an error of the definition's ``errors`` (when it is answered), by its name
    error_notes: ClassVar[Mapping[str, str]] = {}

    @property
    def spec(self) -> proto.OpSpec:
        """The wire row (arguments, reply, errors, who serves it)."""
        return proto.OPS[self.name]

    @property
    def errors_doc(self) -> str:
        """The errors column of its PROTOCOL.md row: the definition's errors, each with its note."""
        notes = self.error_notes
        return ", ".join(f"`{e}`" + (f" ({notes[e]})" if e in notes else "") for e in self.spec.errors)

    @property
    def args_text(self) -> str:
        """The arguments column: ``args_doc``, or the definition's arguments and their types."""
        if self.args_doc:
            return self.args_doc
        return "`{" + ", ".join(f"{a.name}{'' if a.required else '?'}: {_types(a.types)}"
                                for a in self.spec.args) + "}`"

    @property
    def result_text(self) -> str:
        """The result column: ``result_doc``, or the definition's reply."""
        return self.result_doc or f"`{self.spec.reply}`"

    def doc_row(self) -> str:
        """Its row of PROTOCOL.md's table of its kind of op."""
        return _row(f"`{self.name}`", self.args_text, self.result_text, self.errors_doc)


class PartOp(Op, Generic[P]):
    """An admin op: served by the part ``P``, which may answer at once or later."""

    def serve(self, part: P, reply: Reply, args: Args) -> None:
        """Answer one request through ``reply`` (at once, or when the part's completion comes);
        raise a typed error to refuse it."""
        raise NotImplementedError


class AdminOp(PartOp["AdminOps"]):
    """An op :class:`~supervisor.control.admin.AdminOps` serves."""

    part = "admin"


class ServiceOp(PartOp["ServiceOps"]):
    """An op :class:`~supervisor.control.service.ServiceOps` serves."""

    part = "service"


class TenantOp(Op):
    """A tenant op (the tenant's capability): its row of PROTOCOL.md's tenant op table has body columns."""

    body_in_doc: ClassVar[str] = ""
    body_out_doc: ClassVar[str] = ""

    def doc_row(self) -> str:
        return _row(f"`{self.name}`", self.args_text, self.body_in_doc, self.result_text, self.body_out_doc,
                    self.errors_doc)


class WorkerOp(TenantOp):
    """A tenant op one of the tenant's workers answers: its handler is the worker's
    (``worker/server.py``, a process that never imports the supervisor); here is its doc row."""

    part = "worker"


class FrontendOp(TenantOp):
    """A tenant op the frontend answers at once, from what the supervisor holds (no worker)."""

    part = "frontend"

    def serve(self, frontend: Frontend, rt: TenantRuntime, args: Args, body: object) -> object:
        """The result for tenant ``rt`` (the frontend answers with it); raise a typed error to refuse.
        ``body``: the request's body frame, or None."""
        raise NotImplementedError


class EitherCapabilityOp(Op):
    """An op either capability may send (``events``), answered by the frontend at once: the admin
    capability's caller sees every tenant, a tenant capability's its own. Its wire row is in the
    generated op list of PROTOCOL.md; it has no row in the admin or tenant op tables."""

    part = "frontend"

    def serve(self, frontend: Frontend, rt: TenantRuntime | None, args: Args) -> object:
        """The result for the tenant the capability names (``rt``), or for the admin (None); the
        frontend has verified the capability, admitted the request and checked the arguments."""
        raise NotImplementedError


def _types(types: tuple[type, ...]) -> str:
    """An argument's wire types as PROTOCOL.md writes them (``int | nil``)."""
    return " | ".join("nil" if t is type(None) else t.__name__ for t in types)


def _row(*cells: str) -> str:
    """A markdown table row (a ``|`` inside a cell escaped; an empty cell is ``| |``)."""
    texts = [cell.replace("|", "\\|").replace("\n", " ") for cell in cells]
    return "|" + "|".join(f" {text} " if text else " " for text in texts) + "|"
