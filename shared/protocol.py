"""Wire protocol: frames, headers and their limits (see docs/PROTOCOL.md).

Every message is one small msgpack *header* frame, optionally followed by one
opaque *body* frame (WASM modules, tensor bytes) that the supervisor forwards
without decoding or copying.

    client -> supervisor   [header, body?]   header = [VERSION, rid, op, capability|nil, args]
    supervisor -> client   [header, body?]   header = [VERSION, rid, ok, result | error-dict]
    supervisor -> worker   [header, body?]   header = [rid, op, args]
    worker -> supervisor   [header, body?]   header = [rid, ok, result | error-dict]
    control (both ways)    [header]          header = [kind, args]

Decoding untrusted input (:func:`decode_client_header`) uses a fresh
unpacker per message with explicit ``max_*_len`` limits and
``strict_map_key``, then a schema check; anything malformed raises
:class:`ProtocolError` and never anything else.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Final, Generic, Protocol, TypeVar
from collections.abc import Callable

import msgpack

from shared.checks import is_int
from shared.errors import InvalidArgument, ProtocolError
from shared.frames import (  # the framing, re-exported: a worker imports shared.frames alone
    CONTROL_KINDS,
    MAX_BUFFERS_PER_INSTANCE,
    MAX_HEADER_BYTES,
    MAX_WORKER_REPLY_BYTES,
    MAX_WORKER_REPLY_ITEMS,
    _packb,
    _unpack,
    decode_control,
    decode_worker_reply as decode_worker_reply,
    decode_worker_request,
    encode_control,
    encode_worker_reply,
    encode_worker_request,
    format_handle,
    handle_incarnation,
    handle_instance,
    handle_seq,
    make_handle,
    parse_handle_text,
)
from shared.kinds import WORKER_FAULT_KINDS
from shared.quota import QuotaSnapshot
from shared.records import (
    EventsPage,
    EvictResult,
    FaultResult,
    HelloInfo,
    PingInfo,
    RegionGrant,
    ReloadResult,
    RunResult,
    StatusRecord,
    TenantRecord,
)
from shared.spec import TenantSpec
from shared.wire import Record

__all__ = [
    "ADMIN_OPS",
    "CONTROL_KINDS",
    "FAULT_KINDS",
    "HANDLE_OPS",
    "MAX_BUFFERS_PER_INSTANCE",
    "MAX_CLIENT_REPLY_BYTES",
    "MAX_CLIENT_REPLY_ITEMS",
    "MAX_HEADER_BYTES",
    "MAX_WORKER_REPLY_BYTES",
    "MAX_WORKER_REPLY_ITEMS",
    "METERED_OPS",
    "MONITOR_OPS",
    "OPS",
    "PROTOCOL_VERSION",
    "QUOTA_KEYS",
    "REPLY_RECORDS",
    "SERVED_BY",
    "TENANT_OPS",
    "ABSENT",
    "Absent",
    "Alloc",
    "Arg",
    "Buffers",
    "Capability",
    "Echo",
    "Events",
    "Evict",
    "Free",
    "FromWire",
    "Hello",
    "InjectFault",
    "OpSpec",
    "Ping",
    "PutModule",
    "Quota",
    "Read",
    "ReadRegion",
    "RegionCreate",
    "RegionRelease",
    "Register",
    "Reload",
    "Reset",
    "Restart",
    "RotateKey",
    "RunWasm",
    "Scale",
    "SetQuota",
    "Status",
    "TenantStatus",
    "Version",
    "WireArgs",
    "WireReply",
    "Write",
    "WriteRegion",
    "checked",
    "wire_fields",
    "arg_int",
    "arg_map",
    "arg_opt_int",
    "arg_opt_map",
    "arg_opt_str",
    "arg_str",
    "check_args",
    "decode_client_header",
    "decode_control",
    "decode_reply",
    "decode_worker_request",
    "encode_control",
    "encode_reply",
    "encode_request",
    "encode_worker_reply",
    "encode_worker_request",
    "format_handle",
    "handle_incarnation",
    "handle_instance",
    "handle_seq",
    "make_handle",
    "parse_handle_text",
    "peek_rid",
]

PROTOCOL_VERSION: Final = 1
#: the framing limits (MAX_HEADER_BYTES, MAX_BUFFERS_PER_INSTANCE, MAX_WORKER_REPLY_*) are
#: shared.frames's, imported above
#: the supervisor's reply header, as a client decodes it: a merged ``buffers`` list of 64
#: instances (~64 MB) or a ``status`` of many thousand tenants. The client chose this
#: supervisor (its run dir is verified) and decodes with these limits, never unbounded.
MAX_CLIENT_REPLY_BYTES: Final = 256 << 20
MAX_CLIENT_REPLY_ITEMS: Final = 64 * MAX_BUFFERS_PER_INSTANCE + 1024


# ------------------------------------------------------------------ the op table
#
# Every wire op is defined once, here: its :class:`OpSpec` is the one source of truth of what the op
# is - its arguments, its reply, its errors, who serves it, who may send it, and every property the
# supervisor's request path reads (pins, local-only, big reply, its deadline, body in/out, the
# argument the frontend fills in ...). The frontend, the pending table and the spec read those
# properties generically and never name an op. The handlers register against the definition from
# their own layers: the supervisor's under supervisor/control/ops/ (and its twt command and doc
# notes), the worker's with ``worker.server.register_op``; SupervisorClient sends any op through
# the generic :meth:`~supervisor.client.api.SupervisorClient.invoke` (typed ops) or ``call``, and
# has a named method ``OPS[op].client`` for most. docs/PROTOCOL.md and the schema are generated.


@dataclass(frozen=True, slots=True)
class Arg:
    """One argument of an op: its name, the types it may have, whether it must be present, and
    (for structured values) a ``check`` that refuses a bad value with :class:`InvalidArgument`,
    so a handler never meets input that :func:`check_args` let through unchecked."""

    name: str
    types: tuple[type, ...]
    required: bool = False
    check: Callable[[object], None] | None = None


def _check_spec(value: object) -> None:
    """``register``'s ``spec``: every key known and every value of its type and range."""
    if not isinstance(value, dict):
        raise InvalidArgument(f"register: spec must be a map, not {type(value).__name__}")
    try:
        TenantSpec.from_dict(value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"register: spec: {exc}") from None


@dataclass(frozen=True, slots=True)
class OpSpec:
    """One wire op: who may call it, its arguments, its reply, the errors it may answer."""

    name: str
    admin: bool  # the admin capability grants it; else a tenant capability does
    args: tuple[Arg, ...]
    reply: str  # the result's shape, as docs/PROTOCOL.md shows it
    errors: tuple[str, ...]  # error class names beyond the refusals every op can get
    client: str  # the SupervisorClient method that sends it ("call": only the generic SupervisorClient.call)
    cli: str | None = None  # the `twt` command that sends it (None: library only)
    body_in: bool = False  # takes a body frame
    body_out: bool = False  # answers with a body frame
    #: the other capability grants it too, each with its own scope (``events``: the admin sees
    #: every event, a tenant its own); counted with the tenant ops, served by the supervisor
    any_capability: bool = False
    #: who answers it: "worker" (one of the tenant's instances), "frontend" (the supervisor's
    #: frontend, from what it holds), "admin" (supervisor.control.admin.AdminOps), "service"
    #: (supervisor.control.service.ServiceOps) - the supervisor dispatches by this, never by name lists
    served_by: str = "worker"
    #: its ``handle`` argument pins it to the instance holding that buffer
    handle: bool = False
    #: it may be pinned to one instance (``alloc``'s ``instance``, buffer handles it names)
    pins: bool = False
    #: it names a shared-memory region of this host: local (ipc) clients only, refused over TCP
    local_only: bool = False
    #: its reply may carry a big body: refused while the client lets replies pile up unread
    big_reply: bool = False
    #: answered without a capability too, with a part that names nothing of any tenant
    #: (``hello``: ``{protocol, ready}``, the liveness probe); with its capability, in full
    anonymous: bool = False
    #: the monitor capability grants it too (the read-only role: status, events, quota views):
    #: it changes nothing, so it is accepted over TCP without ``allow_remote_admin``
    monitor: bool = False
    #: counted in twt_requests_total and the latency histogram (a tenant op: its workload); false for
    #: ``events``, which a follower (``twt events``) polls every 0.2 s: its polls would swamp both
    #: with requests that measure nothing of the tenants' work
    metered: bool = True
    # ---- what the frontend does for it, read generically (the request path names no op)
    #: the argument the frontend sets to the pid the kernel reports for the local connection (an
    #: ipc peer's credentials), dropping the client's own value: the owner of what it creates
    peer_pid_arg: str | None = None
    #: its body is a WASM module: refused above ``shared.sizes.MAX_MODULE_BYTES``
    module_body: bool = False
    #: sent without a body, its ``digest`` argument names a module stored by ``put_module``
    stored_module: bool = False
    #: the argument naming one of the tenant's shared-memory regions: resolved by the frontend
    #: (the tenant's own region or refused) and handed to the worker as ``region_name``
    region_arg: str | None = None
    #: the argument naming the instance to send it to (``alloc``'s ``instance``)
    instance_arg: str | None = None
    #: the list argument whose ``{handle}`` items name buffers (``run_wasm``'s ``args``): they pin it
    handle_list_arg: str | None = None
    #: the argument whose value is the size of the reply body (``read``'s ``nbytes``): reserved
    #: against the tenant's reply budget before it is sent
    reply_body_arg: str | None = None
    #: it runs guest code: its ``fuel`` and ``timeout_s`` are the spec's limits at most, and its
    #: deadline is its run time plus ``shared.spec.DEADLINE_GRACE_S`` (see :meth:`deadline_s`)
    guest_run: bool = False
    #: its reply's ``handle`` names a buffer made for it: when the reply cannot be delivered (its
    #: client is gone) the supervisor frees that buffer
    makes_handle: bool = False
    #: sent to every ready instance of the tenant; the replies are merged by this function
    #: (``buffers``: one list of every instance's buffers)
    merge: Callable[[Sequence[Mapping[str, object]]], object] | None = None
    #: it lists the tenant's buffers: while the tenant is parked its held copies answer it, and it
    #: wakes no instance (supervisor.lifecycle.parking)
    lists_buffers: bool = False
    #: the typed arguments and reply of a typed op (:class:`WireArgs`, :meth:`OpSpec.typed`)
    args_type: type | None = None
    reply_type: type | None = None

    def __post_init__(self) -> None:
        if self.monitor and not (self.admin or self.any_capability):
            raise ValueError(f"op {self.name!r}: the monitor capability grants admin-side ops only")
        if self.served_by not in SERVED_BY:
            raise ValueError(f"op {self.name!r}: served_by must be one of {SERVED_BY}")
        if self.admin != (self.served_by in ("admin", "service")):
            raise ValueError(f"op {self.name!r}: admin ops are served by AdminOps or ServiceOps, and only they")
        named = {arg.name for arg in self.args}
        for what, arg_name in (("peer_pid_arg", self.peer_pid_arg), ("region_arg", self.region_arg),
                               ("instance_arg", self.instance_arg), ("handle_list_arg", self.handle_list_arg),
                               ("reply_body_arg", self.reply_body_arg)):
            if arg_name is not None and arg_name not in named:
                raise ValueError(f"op {self.name!r}: its {what} {arg_name!r} is none of its arguments")
        if (self.handle or self.instance_arg or self.handle_list_arg) and not self.pins:
            raise ValueError(f"op {self.name!r}: an op naming buffers or an instance pins")

    @classmethod
    def typed(cls, name: str, args_type: type[WireArgs[R]], reply_type: type[R], errors: tuple[str, ...],
              client: str = "invoke", *, reply: str | None = None, **flags: typing.Any) -> OpSpec:
        """The definition of a typed op: its argument rows derived from its :class:`WireArgs`
        dataclass, its reply text from its reply dataclass unless ``reply`` says it in words (a
        record's nested shape: ``tenant status record``)."""
        return cls(name, flags.pop("admin", False), wire_fields(args_type),
                   _reply_text(reply_type) if reply is None else reply, errors, client,
                   args_type=args_type, reply_type=reply_type, **flags)

    def handles(self, args: Mapping[str, object]) -> list[int]:
        """The buffer handles a request of this op names (its ``handle``, or the ``{handle}`` items
        of its handle list). InvalidArgument for a ``handle`` that is no non-negative int."""
        if self.handle:
            handle = args.get("handle")
            if not is_int(handle) or handle < 0:
                raise InvalidArgument("handle must be a non-negative int")
            return [handle]
        if self.handle_list_arg is not None:
            items = args.get(self.handle_list_arg)
            return [handle for a in (items if isinstance(items, list) else ())
                    if isinstance(a, dict) and is_int(handle := a.get("handle"))]
        return []

    def deadline_s(self, spec: TenantSpec, timeout_s: object = None) -> float:
        """THE deadline rule: how long after it arrives the supervisor answers this op at the
        latest - a guest run its run time plus grace (:meth:`TenantSpec.run_deadline_s` of its
        ``timeout_s``), every other op ``request_timeout_s``. The supervisor applies it and the
        chaos checker checks against it."""
        return spec.run_deadline_s(timeout_s) if self.guest_run else spec.request_timeout_s

    def reply_body_bytes(self, args: Mapping[str, object], limit: int) -> int:
        """The reply body a request will bring back (its ``reply_body_arg``, at most ``limit``)."""
        if self.reply_body_arg is None:
            return 0
        n = args.get(self.reply_body_arg)
        if not is_int(n) or n <= 0:
            return 0
        return min(n, limit)


#: the parts of the supervisor that answer ops (OpSpec.served_by)
SERVED_BY: Final = ("worker", "frontend", "admin", "service")


# ------------------------------------------------------------------ typed ops
#
# A typed op declares its arguments and its reply as dataclasses (the wire maps are their fields);
# ``OpSpec.typed`` derives the argument rows and the reply text from them, and
# ``SupervisorClient.invoke(cap, Op.Args(...))`` sends one and answers its reply type.


class FromWire(Protocol):
    """A reply type: built from the decoded reply map, refusing a malformed one with ProtocolError."""

    @classmethod
    def from_wire(cls, payload: object) -> typing.Self: ...


R = TypeVar("R", bound=FromWire)


class WireReply:
    """Base of a typed reply dataclass: :meth:`from_wire` checks each field's type."""

    @classmethod
    def from_wire(cls, payload: object) -> typing.Self:
        """The reply from its decoded map; ProtocolError when a field is missing or of another type."""
        if not isinstance(payload, dict):
            raise ProtocolError(f"{cls.__name__}: the reply is no map")
        values: dict[str, object] = {}
        for field, types_ in _field_types(typing.cast(type, cls)).items():
            if field.name not in payload:
                if field.default is dataclasses.MISSING:
                    raise ProtocolError(f"{cls.__name__}: the reply has no {field.name!r}")
                continue
            value = payload[field.name]
            if (isinstance(value, bool) and bool not in types_) or not isinstance(value, types_):
                raise ProtocolError(f"{cls.__name__}: {field.name} is a {type(value).__name__}")
            values[field.name] = value
        return cls(**values)


class Absent(enum.Enum):
    """The default of a typed op's optional argument: left out of the request (the server's default
    applies). Distinct from None, which is nil on the wire where the argument takes nil."""

    ABSENT = "absent"


#: an optional argument not given (:class:`Absent`)
ABSENT: Final = Absent.ABSENT


def checked(check: Callable[[object], None]) -> typing.Any:
    """A required argument field whose value ``check`` refuses with InvalidArgument when malformed
    (``register``'s ``spec``): its row's :attr:`Arg.check`."""
    return dataclasses.field(metadata={"check": check})


class WireArgs(Generic[R]):
    """Base of a typed op's argument dataclass: its op's name, its wire map, its reply type (the
    type parameter, e.g. ``WireArgs[Echo.Reply]``)."""

    #: the wire op these arguments are sent with
    op: ClassVar[str]
    #: the reply type (from the type parameter)
    reply_type: ClassVar[type[FromWire]]

    def __init_subclass__(cls, **kwargs: typing.Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            if typing.get_origin(base) is WireArgs:
                cls.reply_type = typing.get_args(base)[0]

    def to_wire(self) -> dict[str, object]:
        """The argument map: an optional argument left :data:`ABSENT` is left out (None is sent as nil,
        which some arguments take: ``set_quota``'s ``gpu_time_cap=None`` lifts the cap)."""
        return {name: value for name in _field_names(typing.cast(type, type(self))) if (value := getattr(self, name)) is not ABSENT}

    def reply(self, payload: object) -> R:
        """The typed reply of a request with these arguments."""
        return typing.cast(R, self.reply_type.from_wire(payload))


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """A typed op's argument names, once per class (every named call of the client builds its map
    from them)."""
    return tuple(f.name for f in dataclasses.fields(cls))


_WIRE_TYPES: Final[dict[object, tuple[type, ...]]] = {str: (str,), int: (int,), float: (int, float), bool: (bool,),
                                                     bytes: (bytes,), list: (list,), dict: (dict,)}


@functools.cache
def _field_types(cls: type) -> dict[dataclasses.Field[object], tuple[type, ...]]:
    """Each field of a dataclass and the wire types its annotation allows (``X | None`` adds nil,
    ``X | Absent`` none: it may be left out; once per class: a typed reply is checked against it at
    each call)."""
    hints = typing.get_type_hints(cls)
    out: dict[dataclasses.Field[object], tuple[type, ...]] = {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        parts = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        allowed: tuple[type, ...] = ()
        for part in parts:
            if part is Absent:
                continue  # not a wire value: the argument is left out
            if part is type(None):
                allowed += (type(None),)
                continue
            wire = _WIRE_TYPES.get(typing.get_origin(part) or part)
            if wire is None:
                raise TypeError(f"{cls.__name__}.{field.name}: {part!r} is no wire type")
            allowed += wire
        out[field] = allowed
    return out


def wire_fields(args_type: type) -> tuple[Arg, ...]:
    """The fields of a typed op's arguments or reply as rows: a field without a default is required;
    its ``check`` (:func:`checked`) comes along."""
    return tuple(Arg(field.name, types_, field.default is dataclasses.MISSING
                     and field.default_factory is dataclasses.MISSING, field.metadata.get("check"))
                 for field, types_ in _field_types(args_type).items())


def _reply_text(reply_type: type) -> str:
    """The reply's shape as PROTOCOL.md shows it: ``{field, field?}``."""
    return "{" + ", ".join(f.name + ("" if f.default is dataclasses.MISSING else "?")
                           for f in dataclasses.fields(reply_type)) + "}"


def _merge_buffers(parts: Sequence[Mapping[str, object]]) -> object:
    """``buffers`` of every instance as one reply: every instance's list, sorted, and their bytes."""
    merged: list[tuple[int, int]] = []
    for part in parts:
        items = part.get("buffers")
        merged.extend(items if isinstance(items, list) else ())
    merged.sort()
    return {"buffers": merged, "bytes": sum(n for _, n in merged)}


class Echo:
    """``echo``: the tenant's worker answers the text it was sent (the smallest typed op: a
    definition, a worker handler, a test)."""

    @dataclass(frozen=True, slots=True)
    class Reply(WireReply):
        text: str

    @dataclass(frozen=True, slots=True)
    class Args(WireArgs[Reply]):
        op: ClassVar[str] = "echo"
        text: str

    spec: ClassVar[OpSpec] = OpSpec.typed("echo", Args, Reply, ())

# ------------------------------------------------------------------ the typed ops: per op, its arguments and its reply as dataclasses; OPS holds their rows.
# An optional argument defaults to ABSENT (left out of the request); ``X | None`` takes nil too.


class Ping:
    """``ping``: an instance of the tenant answers who it is."""

    Reply = PingInfo

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[PingInfo]):
        op: ClassVar[str] = "ping"

    spec: ClassVar[OpSpec] = OpSpec.typed("ping", Args, PingInfo, ("WorkerLost",), "ping",
                                          reply="{pid, tenant, instance, requests, uptime_s}")


class Alloc:
    """``alloc``: a device buffer of ``nbytes`` on one of the tenant's instances (``instance``, or the
    least loaded)."""

    @dataclass(frozen=True, slots=True)
    class Reply(WireReply):
        handle: int
        nbytes: int

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[Reply]):
        op: ClassVar[str] = "alloc"
        nbytes: int
        instance: int | None | Absent = ABSENT

    spec: ClassVar[OpSpec] = OpSpec.typed("alloc", Args, Reply, ("GpuMemoryExhausted", "InvalidArgument"), "alloc",
                                          cli="alloc", pins=True, instance_arg="instance", makes_handle=True)


class Free:
    """``free``: the buffer ``handle`` freed; ``freed`` is its size."""

    @dataclass(frozen=True, slots=True)
    class Reply(WireReply):
        freed: int

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[Reply]):
        op: ClassVar[str] = "free"
        handle: int

    spec: ClassVar[OpSpec] = OpSpec.typed("free", Args, Reply, ("InvalidArgument", "BufferLost"), "free",
                                          cli="free", handle=True, pins=True)


class Write:
    """``write``: the body frame written into the buffer ``handle`` at ``offset``."""

    @dataclass(frozen=True, slots=True)
    class Reply(WireReply):
        written: int

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[Reply]):
        op: ClassVar[str] = "write"
        handle: int
        offset: int | Absent = ABSENT

    spec: ClassVar[OpSpec] = OpSpec.typed("write", Args, Reply, ("InvalidArgument", "BufferLost"), "write",
                                          cli="write", body_in=True, handle=True, pins=True)


class Read:
    """``read``: ``nbytes`` of the buffer ``handle`` from ``offset``, as the reply's body frame."""

    @dataclass(frozen=True, slots=True)
    class Reply(WireReply):
        nbytes: int

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[Reply]):
        op: ClassVar[str] = "read"
        handle: int
        offset: int | Absent = ABSENT
        nbytes: int

    spec: ClassVar[OpSpec] = OpSpec.typed("read", Args, Reply, ("InvalidArgument", "BufferLost", "Overloaded"),
                                          "read", cli="read", body_out=True, handle=True, pins=True,
                                          big_reply=True, reply_body_arg="nbytes")


class Buffers:
    """``buffers``: the tenant's live buffers on every instance, ``[handle, nbytes]`` pairs sorted,
    and their bytes."""

    @dataclass(frozen=True, slots=True)
    class Reply(WireReply):
        buffers: list[list[int]]
        bytes: int

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[Reply]):
        op: ClassVar[str] = "buffers"

    spec: ClassVar[OpSpec] = OpSpec.typed("buffers", Args, Reply, ("WorkerLost",), "buffers", cli="buffers",
                                          reply="{buffers: [[handle, nbytes]...], bytes}", merge=_merge_buffers,
                                          lists_buffers=True)


class Quota:
    """``quota``: the tenant's quota block as the supervisor reads it."""

    Reply = QuotaSnapshot

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[QuotaSnapshot]):
        op: ClassVar[str] = "quota"

    spec: ClassVar[OpSpec] = OpSpec.typed("quota", Args, QuotaSnapshot, (), "quota", reply="QuotaSnapshot map",
                                          served_by="frontend")


class PutModule:
    """``put_module``: the body frame (a WASM module) kept under its digest for later runs."""

    @dataclass(frozen=True, slots=True)
    class Reply(WireReply):
        digest: str

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[Reply]):
        op: ClassVar[str] = "put_module"

    spec: ClassVar[OpSpec] = OpSpec.typed("put_module", Args, Reply, ("InvalidArgument",), "put_module",
                                          body_in=True, served_by="frontend", module_body=True)


class RunWasm:
    """``run_wasm``: the export of a module (the body frame, or the stored ``digest``) run on an instance."""

    Reply = RunResult

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[RunResult]):
        op: ClassVar[str] = "run_wasm"
        export: str
        args: list[object] | Absent = ABSENT
        fuel: int | Absent = ABSENT
        timeout_s: float | Absent = ABSENT
        digest: str | Absent = ABSENT

    spec: ClassVar[OpSpec] = OpSpec.typed(
        "run_wasm", Args, RunResult,
        ("WasmCompile", "WasmTrap", "KernelTimeout", "MemoryExhausted", "UnknownModule", "InvalidArgument",
         "BufferLost"),
        "run_wasm", cli="run",
        reply="{results, fuel_used, elapsed_s, cached, gpu_peak_bytes, memory_bytes, logs, logs_dropped, exit_code, "
              "gpu_time_s, gpu_wait_s}",
        body_in=True, pins=True, big_reply=True, module_body=True, stored_module=True, handle_list_arg="args",
        guest_run=True)


class Events:
    """``events``: a page of the event log the capability may see."""

    Reply = EventsPage

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[EventsPage]):
        op: ClassVar[str] = "events"
        after: int | None | Absent = ABSENT
        max: int | Absent = ABSENT
        kinds: list[str] | Absent = ABSENT
        log: str | None | Absent = ABSENT

    spec: ClassVar[OpSpec] = OpSpec.typed("events", Args, EventsPage, ("InvalidArgument",), "events_page",
                                          cli="events", reply="{events: [{seq, event, ts, ...}...], next, missed, "
                                                              "more, log}",
                                          any_capability=True, served_by="frontend", monitor=True, metered=False)


class RegionCreate:
    """``region_create``: a shared-memory region of this host for a local client's bulk data."""

    Reply = RegionGrant

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[RegionGrant]):
        op: ClassVar[str] = "region_create"
        nbytes: int
        pid: int | Absent = ABSENT

    spec: ClassVar[OpSpec] = OpSpec.typed("region_create", Args, RegionGrant, ("MemoryExhausted", "InvalidArgument"),
                                          "region_create", reply="{region, name, nbytes}", served_by="frontend",
                                          local_only=True, peer_pid_arg="pid")


class RegionRelease:
    """``region_release``: the region released; ``released`` is its size."""

    @dataclass(frozen=True, slots=True)
    class Reply(WireReply):
        released: int

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[Reply]):
        op: ClassVar[str] = "region_release"
        region: int

    spec: ClassVar[OpSpec] = OpSpec.typed("region_release", Args, Reply, ("InvalidArgument",), "region_release",
                                          served_by="frontend", local_only=True)


class WriteRegion:
    """``write_region``: ``nbytes`` of the tenant's region copied into the buffer ``handle``."""

    @dataclass(frozen=True, slots=True)
    class Reply(WireReply):
        written: int

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[Reply]):
        op: ClassVar[str] = "write_region"
        handle: int
        offset: int | Absent = ABSENT
        region: int
        region_offset: int | Absent = ABSENT
        nbytes: int

    spec: ClassVar[OpSpec] = OpSpec.typed("write_region", Args, Reply, ("InvalidArgument",), "write_region",
                                          handle=True, pins=True, local_only=True, region_arg="region")


class ReadRegion:
    """``read_region``: ``nbytes`` of the buffer ``handle`` copied into the tenant's region."""

    @dataclass(frozen=True, slots=True)
    class Reply(WireReply):
        nbytes: int

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[Reply]):
        op: ClassVar[str] = "read_region"
        handle: int
        offset: int | Absent = ABSENT
        region: int
        region_offset: int | Absent = ABSENT
        nbytes: int

    spec: ClassVar[OpSpec] = OpSpec.typed("read_region", Args, Reply, ("InvalidArgument",), "read_region",
                                          handle=True, pins=True, local_only=True, region_arg="region")


class Hello:
    """``hello``: the supervisor's identity (without a capability: only ``{protocol, ready}``)."""

    Reply = HelloInfo

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[HelloInfo]):
        op: ClassVar[str] = "hello"

    spec: ClassVar[OpSpec] = OpSpec.typed(
        "hello", Args, HelloInfo, (), "hello", cli="status", admin=True,
        reply="{pid, registry_id, backend, backend_reason, start_method, protocol, uptime_s}",
        served_by="admin", anonymous=True, monitor=True)


class Register:
    """``register``: a tenant registered from its spec; its capability and status."""

    @dataclass(frozen=True, slots=True)
    class Reply(WireReply):
        capability: bytes
        tenant: dict[str, object]

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[Reply]):
        op: ClassVar[str] = "register"
        spec: dict[str, object] = checked(_check_spec)

    spec: ClassVar[OpSpec] = OpSpec.typed(
        "register", Args, Reply,
        ("AlreadyRegistered", "InvalidArgument", "BackendUnavailable", "KernelTimeout", "WorkerLost",
         "CapacityExhausted"),
        "register", cli="register", admin=True, reply="{capability, tenant: {...}}", served_by="admin")


class Capability:
    """``capability``: a tenant's capability (or one of another ``role``) issued again."""

    @dataclass(frozen=True, slots=True)
    class Reply(WireReply):
        capability: bytes

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[Reply]):
        op: ClassVar[str] = "capability"
        tenant: str | Absent = ABSENT
        role: str | Absent = ABSENT

    spec: ClassVar[OpSpec] = OpSpec.typed("capability", Args, Reply, ("UnknownTenant", "InvalidArgument"),
                                          "tenant_capability", cli="capability", admin=True, served_by="admin")


class Evict:
    """``evict``: a tenant stopped and forgotten."""

    Reply = EvictResult

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[EvictResult]):
        op: ClassVar[str] = "evict"
        tenant: str

    spec: ClassVar[OpSpec] = OpSpec.typed("evict", Args, EvictResult, ("UnknownTenant",), "evict", cli="evict",
                                          admin=True, reply="{evicted, pids}", served_by="admin")


class SetQuota:
    """``set_quota``: a tenant's limits changed live (:data:`QUOTA_KEYS`; a byte size is an int or a
    size string, nil lifts a limit that may be lifted)."""

    Reply = TenantRecord

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[TenantRecord]):
        op: ClassVar[str] = "set_quota"
        tenant: str
        memory_quota_bytes: int | str | Absent = ABSENT
        gpu_memory_bytes_cap: int | str | None | Absent = ABSENT
        recorded_cuda_mem_pool_quota: int | str | None | Absent = ABSENT
        gpu_time_weight: float | Absent = ABSENT
        gpu_time_cap: float | None | Absent = ABSENT
        idle_timeout_s: float | None | Absent = ABSENT

    spec: ClassVar[OpSpec] = OpSpec.typed("set_quota", Args, TenantRecord, ("UnknownTenant", "InvalidArgument"),
                                          "set_quota", cli="set-quota", admin=True, reply="tenant status record",
                                          served_by="admin")


class Scale:
    """``scale``: a tenant's instance count set."""

    Reply = TenantRecord

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[TenantRecord]):
        op: ClassVar[str] = "scale"
        tenant: str
        instances: int

    spec: ClassVar[OpSpec] = OpSpec.typed("scale", Args, TenantRecord,
                                          ("UnknownTenant", "InvalidArgument", "CapacityExhausted"), "scale",
                                          cli="scale", admin=True, reply="tenant status record", served_by="admin")


class Status:
    """``status``: the supervisor, its devices and a page of its tenants."""

    Reply = StatusRecord

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[StatusRecord]):
        op: ClassVar[str] = "status"
        after: str | None | Absent = ABSENT
        limit: int | None | Absent = ABSENT
        state: str | None | Absent = ABSENT
        view: str | None | Absent = ABSENT

    spec: ClassVar[OpSpec] = OpSpec.typed("status", Args, StatusRecord, ("InvalidArgument",), "status",
                                          cli="status", admin=True, reply="{supervisor, devices, tenants, summary, next}",
                                          served_by="admin", monitor=True)


class TenantStatus:
    """``tenant_status``: one tenant's status record."""

    Reply = TenantRecord

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[TenantRecord]):
        op: ClassVar[str] = "tenant_status"
        tenant: str

    spec: ClassVar[OpSpec] = OpSpec.typed("tenant_status", Args, TenantRecord, ("UnknownTenant",), "tenant_status",
                                          cli="status", admin=True, reply="tenant status record", served_by="admin",
                                          monitor=True)


class InjectFault:
    """``inject_fault``: a fault armed in one of a tenant's workers (``fault_injection`` set)."""

    Reply = FaultResult

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[FaultResult]):
        op: ClassVar[str] = "inject_fault"
        tenant: str
        kind: str
        instance: int | None | Absent = ABSENT
        params: dict[str, object] | Absent = ABSENT

    spec: ClassVar[OpSpec] = OpSpec.typed("inject_fault", Args, FaultResult,
                                          ("UnknownTenant", "InvalidArgument", "WorkerLost", "FaultInjectionDisabled"),
                                          "inject_fault", cli="fault", admin=True,
                                          reply="{tenant, instance, pid, kind, ...armed}", served_by="admin")


class Version:
    """``version``: the supervisor's version, Python and protocol."""

    @dataclass(frozen=True, slots=True)
    class Reply(WireReply):
        version: str
        python: str
        protocol: int

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[Reply]):
        op: ClassVar[str] = "version"

    spec: ClassVar[OpSpec] = OpSpec.typed("version", Args, Reply, (), "call", cli="version", admin=True,
                                          served_by="admin", monitor=True)


class Reload:
    """``reload``: the config file read again and applied."""

    Reply = ReloadResult

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[ReloadResult]):
        op: ClassVar[str] = "reload"

    spec: ClassVar[OpSpec] = OpSpec.typed(
        "reload", Args, ReloadResult, ("ConfigError",), "reload", cli="reload", admin=True,
        reply="{registered, changed: [{tenant, fields, restart, scale}], evicted, unchanged, conflicts, "
              "settings_not_applied, errors}",
        served_by="service")


class Reset:
    """``reset``: a failed tenant started again."""

    Reply = TenantRecord

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[TenantRecord]):
        op: ClassVar[str] = "reset"
        tenant: str

    spec: ClassVar[OpSpec] = OpSpec.typed("reset", Args, TenantRecord, ("UnknownTenant", "TenantFailed"), "reset",
                                          cli="reset", admin=True, reply="tenant status record (once it runs)",
                                          served_by="service")


class Restart:
    """``restart``: every instance of a tenant replaced, one at a time."""

    Reply = TenantRecord

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[TenantRecord]):
        op: ClassVar[str] = "restart"
        tenant: str

    spec: ClassVar[OpSpec] = OpSpec.typed("restart", Args, TenantRecord, ("UnknownTenant", "TenantFailed"),
                                          "restart_tenant", cli="restart", admin=True,
                                          reply="tenant status record (once every instance is new)",
                                          served_by="service")


class RotateKey:
    """``rotate_key``: a new registry key: every capability issued before is void."""

    @dataclass(frozen=True, slots=True)
    class Reply(WireReply):
        admin_capability: bytes
        registry_id: str

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Args(WireArgs[Reply]):
        op: ClassVar[str] = "rotate_key"

    spec: ClassVar[OpSpec] = OpSpec.typed("rotate_key", Args, Reply, ("StateError",), "rotate_key",
                                          cli="rotate-key", admin=True, served_by="service")


#: the limits set_quota changes live (each a TenantSpec field)
QUOTA_KEYS: Final = tuple(f.name for f in dataclasses.fields(SetQuota.Args) if f.name != "tenant")
#: what inject_fault accepts (the "worker" rows of shared.kinds.FAULT_TABLE; docs/RELIABILITY.md describes each)
FAULT_KINDS: Final = WORKER_FAULT_KINDS

#: every op, in the order of PROTOCOL.md: the tenant ops, the region ops, the admin ops, the service ops
OPS: Final[dict[str, OpSpec]] = {
    op.spec.name: op.spec
    for op in (Ping, Alloc, Free, Write, Read, Echo, Buffers, Quota, PutModule, RunWasm, Events, RegionCreate,
               RegionRelease, WriteRegion, ReadRegion, Hello, Register, Capability, Evict, SetQuota, Scale, Status,
               TenantStatus, InjectFault, Version, Reload, Reset, Restart, RotateKey)
}
#: the record each op's success reply decodes as, read from the ops' reply types (``SupervisorClient``
#: returns these; the JSON Schema's reply of the op is this record's). The other ops reply with a
#: flat typed map (their ``Reply`` dataclass). ``hello`` answers a :class:`~shared.records.HelloInfo`
#: with a capability; without one an ``AliveInfo``.
REPLY_RECORDS: Final[dict[str, type[Record]]] = {
    name: op.reply_type for name, op in OPS.items()
    if isinstance(op.reply_type, type) and issubclass(op.reply_type, Record)
}
#: ops a tenant capability grants (routed to one of the tenant's workers)
TENANT_OPS: Final = frozenset(name for name, op in OPS.items() if not op.admin)
#: ops the admin capability grants (handled by the supervisor)
ADMIN_OPS: Final = frozenset(name for name, op in OPS.items() if op.admin)
#: ops the monitor capability grants too: read-only, none changes any state
MONITOR_OPS: Final = frozenset(name for name, op in OPS.items() if op.monitor)
#: ops counted in the request metrics (twt_requests_total, twt_request_duration_seconds): the tenant ops
#: but the event follows
METERED_OPS: Final = frozenset(name for name in TENANT_OPS if OPS[name].metered)
#: worker-side ops whose handle argument pins them to one instance (``alloc`` may name one: ``instance``)
HANDLE_OPS: Final = frozenset(name for name, op in OPS.items() if op.handle)


def check_args(op: str, args: Mapping[str, object]) -> None:
    """Check ``args`` against ``op``'s schema: required arguments present, every declared one of a
    declared type (``bool`` is not an int). Raises :class:`InvalidArgument`; unknown names pass
    (the handler ignores them)."""
    for arg in OPS[op].args:
        if arg.name not in args:
            if arg.required:
                raise InvalidArgument(f"{op} needs the argument {arg.name!r}")
            continue
        value = args[arg.name]
        if (isinstance(value, bool) and bool not in arg.types) or not isinstance(value, arg.types):
            want = " or ".join("nil" if t is type(None) else t.__name__ for t in arg.types)
            raise InvalidArgument(f"{op}: {arg.name} must be {want}, not {type(value).__name__}")
        if arg.check is not None:
            arg.check(value)


# ------------------------------------------------------------------ reading checked arguments
#
# A handler's ``args`` are ``Mapping[str, object]``: decoded msgpack. ``check_args`` has
# already checked each declared argument against its op's Arg row, so these accessors
# narrow the type for mypy rather than validate: for a declared argument their
# InvalidArgument is unreachable. They still raise it (naming the argument) rather
# than trust the row, so a row and a handler that disagree fail as a refusal, not a crash.


def _wrong(name: str, want: str, value: object) -> InvalidArgument:
    return InvalidArgument(f"{name} must be {want}, not {type(value).__name__}")


def arg_str(args: Mapping[str, object], name: str) -> str:
    """A required ``str`` argument."""
    value = args.get(name)
    if not isinstance(value, str):
        raise _wrong(name, "str", value)
    return value


def arg_opt_str(args: Mapping[str, object], name: str) -> str | None:
    """An optional ``str`` argument (absent or nil: None)."""
    value = args.get(name)
    if value is not None and not isinstance(value, str):
        raise _wrong(name, "str or nil", value)
    return value


def arg_int(args: Mapping[str, object], name: str) -> int:
    """A required ``int`` argument (a bool is not one)."""
    value = args.get(name)
    if not is_int(value):
        raise _wrong(name, "int", value)
    return value


def arg_opt_int(args: Mapping[str, object], name: str) -> int | None:
    """An optional ``int`` argument (absent or nil: None; a bool is not one)."""
    value = args.get(name)
    if value is not None and not is_int(value):
        raise _wrong(name, "int or nil", value)
    return value


def arg_map(args: Mapping[str, object], name: str) -> dict[str, object]:
    """A required map argument with string keys; its values are the caller's to narrow (its Arg
    row's ``check`` has checked them)."""
    value = arg_opt_map(args, name)
    if value is None:
        raise _wrong(name, "map", value)
    return value


def arg_opt_map(args: Mapping[str, object], name: str) -> dict[str, object] | None:
    """An optional map argument with string keys (absent or nil: None); its values are the
    caller's to narrow (its Arg row's ``check`` has checked them)."""
    value = args.get(name)
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise _wrong(name, "map", value)
    return value


def encode_request(rid: int, op: str, capability: bytes | None, args: Mapping[str, object]) -> bytes:
    """A client's request header."""
    return _packb([PROTOCOL_VERSION, rid, op, capability, args])


def decode_client_header(data: bytes, max_len: int = MAX_HEADER_BYTES) -> tuple[int, str, bytes | None, dict[str, object]]:
    # args: dynamically typed until check_args checks them against the op's Arg rows; the handlers
    # (supervisor.admission.frontend, control) then read them by name
    """Validate a client request header: (rid, op, capability, args). Raises ProtocolError."""
    obj = _unpack(data, max_len)
    if not isinstance(obj, list) or len(obj) != 5:
        raise ProtocolError("header must be an array of 5: [version, rid, op, capability, args]")
    version, rid, op, cap, args = obj
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version!r} (this supervisor speaks {PROTOCOL_VERSION})")
    if not is_int(rid) or not 0 <= rid < 1 << 63:
        raise ProtocolError("rid must be a non-negative int")
    if not isinstance(op, str) or (op not in TENANT_OPS and op not in ADMIN_OPS):
        raise ProtocolError(f"unknown op {op!r:.80}")  # never echo an unbounded name
    if cap is not None and not isinstance(cap, bytes):
        raise ProtocolError("capability must be bytes or nil")
    if not isinstance(args, dict):
        raise ProtocolError("args must be a map")
    return rid, op, cap, args


def peek_rid(data: bytes) -> int | None:
    """Best effort: the rid of a header that failed validation (so it can be answered).

    Reads only the array header and its first two items, whatever follows.
    """
    data = data[:64]  # more than the array header, the version and a rid ever take
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_HEADER_BYTES, max_str_len=256,
                                    max_bin_len=256, max_array_len=16, max_map_len=16, max_ext_len=0)
        unpacker.feed(data)
        if unpacker.read_array_header() < 2:
            return None
        unpacker.skip()  # version
        rid = unpacker.unpack()
    except Exception:  # noqa: BLE001 - untrusted bytes; any failure means "no rid"
        return None
    if is_int(rid) and 0 <= rid < 1 << 63:
        return rid
    return None


def encode_reply(rid: int, ok: bool, payload: object) -> bytes:
    """The supervisor's reply header to a client."""
    return _packb([PROTOCOL_VERSION, rid, ok, payload])


def decode_reply(data: bytes, max_len: int = MAX_CLIENT_REPLY_BYTES,
                 max_items: int = MAX_CLIENT_REPLY_ITEMS) -> tuple[int, bool, object]:
    """A reply header as the client sees it: (rid, ok, result-or-error-dict)."""
    obj = _unpack(data, max_len, max_items)
    if not isinstance(obj, list) or len(obj) != 4 or obj[0] != PROTOCOL_VERSION:
        raise ProtocolError("reply must be [version, rid, ok, payload]")
    _, rid, ok, payload = obj
    if not isinstance(rid, int) or not isinstance(ok, bool):
        raise ProtocolError("reply rid/ok of the wrong type")
    return rid, ok, payload
