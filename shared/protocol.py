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

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final
from collections.abc import Callable

import msgpack

from shared.checks import is_int
from shared.errors import InvalidArgument, ProtocolError
from shared.kinds import WORKER_FAULT_KINDS
from shared.spec import TenantSpec

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
    "SERVED_BY",
    "TENANT_OPS",
    "Arg",
    "OpSpec",
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
MAX_HEADER_BYTES: Final = 64 * 1024
#: Limits on decoding a *reply*: each is at least what the producer may send, so a reply
#: the system itself produced always decodes (requests keep the small limits above).
#: a worker's buffer table holds at most this many buffers (its ``buffers`` reply lists them)
MAX_BUFFERS_PER_INSTANCE: Final = 65_536
#: a worker's reply header, as the supervisor decodes it (one ``buffers`` list: ~1.3 MB)
MAX_WORKER_REPLY_BYTES: Final = 4 << 20
MAX_WORKER_REPLY_ITEMS: Final = MAX_BUFFERS_PER_INSTANCE + 1024
#: the supervisor's reply header, as a client decodes it: a merged ``buffers`` list of 64
#: instances (~64 MB) or a ``status`` of many thousand tenants. The client chose this
#: supervisor (its run dir is verified) and decodes with these limits, never unbounded.
MAX_CLIENT_REPLY_BYTES: Final = 256 << 20
MAX_CLIENT_REPLY_ITEMS: Final = 64 * MAX_BUFFERS_PER_INSTANCE + 1024


# ------------------------------------------------------------------ the op table
#
# Every wire op is declared once, here (an admin op's handler, command and doc row are its class
# in supervisor/control/ops/). The supervisor dispatches by ``OPS[op].served_by``
# and checks arguments with :func:`check_args`; SupervisorClient has a method named
# ``OPS[op].client`` for each; ``OPS[op].cli`` names the ``twt`` command that issues it;
# docs/PROTOCOL.md lists every op (tests/shared/test_protocol.py checks all three).


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

    def __post_init__(self) -> None:
        if self.monitor and not (self.admin or self.any_capability):
            raise ValueError(f"op {self.name!r}: the monitor capability grants admin-side ops only")
        if self.served_by not in SERVED_BY:
            raise ValueError(f"op {self.name!r}: served_by must be one of {SERVED_BY}")
        if self.admin != (self.served_by in ("admin", "service")):
            raise ValueError(f"op {self.name!r}: admin ops are served by AdminOps or ServiceOps, and only they")


#: the parts of the supervisor that answer ops (OpSpec.served_by)
SERVED_BY: Final = ("worker", "frontend", "admin", "service")

_INT = (int,)
_NUM = (int, float)
_STR = (str,)
_SIZE = (int, str)
_SIZE_OR_NIL = (int, str, type(None))
_MAP = (dict,)

#: the limits set_quota changes live (each a TenantSpec field)
QUOTA_KEYS: Final = ("memory_quota_bytes", "gpu_memory_bytes_cap", "recorded_cuda_mem_pool_quota",
                     "gpu_time_weight", "gpu_time_cap", "idle_timeout_s")
#: the wire types of set_quota's keys that are no byte sizes (the GPU-time policy, the idle time: numbers)
_QUOTA_TYPES: Final[dict[str, tuple[type, ...]]] = {"gpu_time_weight": (int, float),
                                                    "gpu_time_cap": (int, float, type(None)),
                                                    "idle_timeout_s": (int, float, type(None))}
#: what inject_fault accepts (the "worker" rows of shared.kinds.FAULT_TABLE; docs/RELIABILITY.md describes each)
FAULT_KINDS: Final = WORKER_FAULT_KINDS

_T = "tenant"
OPS: Final[dict[str, OpSpec]] = {
    op.name: op
    for op in (
        # ---- tenant ops (a tenant capability)
        OpSpec("ping", False, (), "{pid, tenant, instance, requests, uptime_s}", ("WorkerLost",), "ping"),
        OpSpec("alloc", False, (Arg("nbytes", _INT, True), Arg("instance", (int, type(None)))), "{handle, nbytes}",
               ("GpuMemoryExhausted", "InvalidArgument"), "alloc", "alloc", pins=True),
        OpSpec("free", False, (Arg("handle", _INT, True),), "{freed}", ("InvalidArgument", "BufferLost"),
               "free", "free", handle=True, pins=True),
        OpSpec("write", False, (Arg("handle", _INT, True), Arg("offset", _INT)), "{written}",
               ("InvalidArgument", "BufferLost"), "write", "write", body_in=True, handle=True, pins=True),
        OpSpec("read", False, (Arg("handle", _INT, True), Arg("offset", _INT), Arg("nbytes", _INT, True)),
               "{nbytes}", ("InvalidArgument", "BufferLost", "Overloaded"), "read", "read", body_out=True,
               handle=True, pins=True, big_reply=True),
        OpSpec("buffers", False, (), "{buffers: [[handle, nbytes]...], bytes}", ("WorkerLost",), "buffers",
               "buffers"),
        OpSpec("quota", False, (), "QuotaSnapshot map", (), "quota", served_by="frontend"),
        OpSpec("put_module", False, (), "{digest}", ("InvalidArgument",), "put_module", body_in=True,
               served_by="frontend"),
        OpSpec("run_wasm", False,
               (Arg("export", _STR, True), Arg("args", (list,)), Arg("fuel", _INT), Arg("timeout_s", _NUM),
                Arg("digest", _STR)),
               "{results, fuel_used, elapsed_s, cached, gpu_peak_bytes, memory_bytes, logs, logs_dropped, exit_code, "
               "gpu_time_s, gpu_wait_s}",
               ("WasmCompile", "WasmTrap", "KernelTimeout", "MemoryExhausted", "UnknownModule", "InvalidArgument",
                "BufferLost"),
               "run_wasm", "run", body_in=True, pins=True, big_reply=True),
        # ---- shared-memory regions of local clients (shared.region, supervisor.routing.regions)
        # ---- either capability, each seeing its own part (supervisor.observe.event_log)
        OpSpec("events", False, (Arg("after", (int, type(None))), Arg("max", _INT), Arg("kinds", (list,)),
                                 Arg("log", (str, type(None)))),
               "{events: [{seq, event, ts, ...}...], next, missed, more, log}", ("InvalidArgument",),
               "events_page", "events", any_capability=True, served_by="frontend", monitor=True, metered=False),
        OpSpec("region_create", False, (Arg("nbytes", _INT, True), Arg("pid", _INT)),
               "{region, name, nbytes}", ("MemoryExhausted", "InvalidArgument"), "region_create",
               served_by="frontend", local_only=True),
        OpSpec("region_release", False, (Arg("region", _INT, True),), "{released}", ("InvalidArgument",),
               "region_release", served_by="frontend", local_only=True),
        OpSpec("write_region", False,
               (Arg("handle", _INT, True), Arg("offset", _INT), Arg("region", _INT, True), Arg("region_offset", _INT),
                Arg("nbytes", _INT, True)), "{written}", ("InvalidArgument",), "write_region", handle=True, pins=True,
               local_only=True),
        OpSpec("read_region", False,
               (Arg("handle", _INT, True), Arg("offset", _INT), Arg("region", _INT, True), Arg("region_offset", _INT),
                Arg("nbytes", _INT, True)), "{nbytes}", ("InvalidArgument",), "read_region", handle=True, pins=True,
               local_only=True),
        # ---- admin ops (the admin capability)
        OpSpec("hello", True, (), "{pid, registry_id, backend, backend_reason, start_method, protocol, uptime_s}",
               (), "hello", "status", served_by="admin", anonymous=True, monitor=True),
        OpSpec("register", True, (Arg("spec", _MAP, True, _check_spec),), "{capability, tenant: {...}}",
               ("AlreadyRegistered", "InvalidArgument", "BackendUnavailable", "KernelTimeout", "WorkerLost",
                "CapacityExhausted"),
               "register", "register", served_by="admin"),
        OpSpec("capability", True, (Arg(_T, _STR), Arg("role", _STR)), "{capability}",
               ("UnknownTenant", "InvalidArgument"),
               "tenant_capability", "capability", served_by="admin"),
        OpSpec("evict", True, (Arg(_T, _STR, True),), "{evicted, pids}", ("UnknownTenant",), "evict", "evict",
               served_by="admin"),
        OpSpec("set_quota", True, (Arg(_T, _STR, True), *(Arg(k, _QUOTA_TYPES.get(k, _SIZE_OR_NIL)
                                                               if k != "memory_quota_bytes"
                                                               else _SIZE) for k in QUOTA_KEYS)),
               "tenant status record", ("UnknownTenant", "InvalidArgument"), "set_quota", "set-quota",
               served_by="admin"),
        OpSpec("scale", True, (Arg(_T, _STR, True), Arg("instances", _INT, True)), "tenant status record",
               ("UnknownTenant", "InvalidArgument", "CapacityExhausted"), "scale", "scale", served_by="admin"),
        OpSpec("status", True, (Arg("after", (str, type(None))), Arg("limit", (int, type(None))),
                                Arg("state", (str, type(None)))),
               "{supervisor, devices, tenants, summary, next}", ("InvalidArgument",), "status", "status",
               served_by="admin", monitor=True),
        OpSpec("tenant_status", True, (Arg(_T, _STR, True),), "tenant status record", ("UnknownTenant",),
               "tenant_status", "status", served_by="admin", monitor=True),
        OpSpec("inject_fault", True,
               (Arg(_T, _STR, True), Arg("kind", _STR, True), Arg("instance", (int, type(None))), Arg("params", _MAP)),
               "{tenant, instance, pid, kind, ...armed}",
               ("UnknownTenant", "InvalidArgument", "WorkerLost", "FaultInjectionDisabled"),
               "inject_fault", "fault", served_by="admin"),
        OpSpec("version", True, (), "{version, python, protocol}", (), "call", "version", served_by="admin",
               monitor=True),
        # ---- service ops (the admin capability; supervisor.control.service)
        OpSpec("reload", True, (),
               "{registered, changed: [{tenant, fields, restart, scale}], evicted, unchanged, conflicts, "
               "settings_not_applied, errors}", ("ConfigError",), "reload", "reload", served_by="service"),
        OpSpec("reset", True, (Arg(_T, _STR, True),), "tenant status record (once it runs)",
               ("UnknownTenant", "TenantFailed"), "reset", "reset", served_by="service"),
        OpSpec("restart", True, (Arg(_T, _STR, True),), "tenant status record (once every instance is new)",
               ("UnknownTenant", "TenantFailed"), "restart_tenant", "restart", served_by="service"),
        OpSpec("rotate_key", True, (), "{admin_capability, registry_id}", ("StateError",), "rotate_key",
               "rotate-key", served_by="service"),
    )
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
#: control-channel message kinds (supervisor <-> worker)
CONTROL_KINDS: Final = frozenset({"hello", "hb", "stop", "fault", "fault_ack"})


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


# ------------------------------------------------------------------ packing
#
# msgpack's Packer keeps a buffer between calls and is not thread-safe; the supervisor's
# loop, the client's callers and a worker's executor and control threads all pack. One
# packer per thread keeps the speed of a reused packer without sharing it.

_local = threading.local()


def _packb(obj: object) -> bytes:
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    data: bytes = packer.pack(obj)
    return data


def _unpack(data: bytes, max_len: int, max_items: int = 4096) -> object:
    if len(data) > max_len:
        raise ProtocolError(f"header of {len(data)} bytes exceeds the {max_len}-byte limit")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=max_len,
            max_bin_len=max_len,
            max_array_len=max_items,
            max_map_len=max(1024, max_items),
            max_ext_len=0,
        )
    except ProtocolError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        # ExtraData, FormatError, StackError, OutOfData, UnicodeDecodeError ...
        raise ProtocolError(f"malformed msgpack header: {type(exc).__name__}") from None


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


def encode_worker_request(rid: int, op: str, args: Mapping[str, object]) -> bytes:
    return _packb([rid, op, args])


def decode_worker_request(data: bytes) -> tuple[int, str, dict[str, object]]:
    obj = _unpack(data, 1 << 20)
    if not isinstance(obj, list) or len(obj) != 3:
        raise ProtocolError("worker request must be [rid, op, args]")
    rid, op, args = obj
    if not isinstance(rid, int) or not isinstance(op, str) or not isinstance(args, dict):
        raise ProtocolError("worker request fields of the wrong type")
    return rid, op, args


def encode_worker_reply(rid: int, ok: bool, payload: object) -> bytes:
    return _packb([rid, ok, payload])


def decode_worker_reply(data: bytes, max_len: int = MAX_WORKER_REPLY_BYTES,
                        max_items: int = MAX_WORKER_REPLY_ITEMS) -> tuple[int, bool, object]:
    """Workers are semi-trusted (they run tenant code): validate like any input."""
    obj = _unpack(data, max_len, max_items)
    if not isinstance(obj, list) or len(obj) != 3:
        raise ProtocolError("worker reply must be [rid, ok, payload]")
    rid, ok, payload = obj
    if not is_int(rid) or not isinstance(ok, bool):
        raise ProtocolError("worker reply rid/ok of the wrong type")
    return rid, ok, payload


def encode_control(kind: str, args: Mapping[str, object] | None = None) -> bytes:
    return _packb([kind, args or {}])


def decode_control(data: bytes) -> tuple[str, dict[str, object]]:
    obj = _unpack(data, MAX_HEADER_BYTES)
    if not isinstance(obj, list) or len(obj) != 2:
        raise ProtocolError("control message must be [kind, args]")
    kind, args = obj
    if not isinstance(kind, str) or kind not in CONTROL_KINDS or not isinstance(args, dict):
        raise ProtocolError(f"bad control message {kind!r}")
    return kind, args


# ------------------------------------------------------------------ handles
#
# A buffer handle names a buffer in one incarnation of one worker instance, so
# the supervisor routes free/write/read to the process that holds it, and a
# handle from before a restart is refused instead of aliasing a new buffer.
#     bits 48..55 instance | bits 32..47 incarnation (mod 2**16) | bits 0..31 sequence

_INSTANCE_SHIFT = 48
_INCARNATION_SHIFT = 32


def make_handle(instance: int, incarnation: int, seq: int) -> int:
    return (instance << _INSTANCE_SHIFT) | ((incarnation & 0xFFFF) << _INCARNATION_SHIFT) | (seq & 0xFFFFFFFF)


def handle_instance(handle: int) -> int:
    return (handle >> _INSTANCE_SHIFT) & 0xFF


def handle_incarnation(handle: int) -> int:
    return (handle >> _INCARNATION_SHIFT) & 0xFFFF


def handle_seq(handle: int) -> int:
    return handle & 0xFFFFFFFF


def format_handle(handle: int) -> str:
    """A handle as people read and type it: ``INSTANCE:SEQ`` (``1:7``, the 7th buffer of instance 1).

    The incarnation is left out: among the buffers a tenant holds, instance
    and sequence number pick one; the CLI turns the text back into the handle
    by looking it up in ``buffers`` (so a buffer that is gone is named as such).
    """
    return f"{handle_instance(handle)}:{handle_seq(handle)}"


def parse_handle_text(text: str) -> tuple[int, int]:
    """``"1:7"`` -> ``(1, 7)``: (instance, sequence number). ValueError for anything else."""
    head, sep, tail = text.strip().partition(":")
    try:
        instance, seq = int(head), int(tail)
    except ValueError:
        instance = seq = -1
    if not sep or instance < 0 or seq < 0 or instance > 0xFF or seq > 0xFFFFFFFF:
        raise ValueError(f"not a buffer handle: {text!r} (INSTANCE:SEQ as twt alloc prints it, e.g. 1:7)")
    return instance, seq
