"""The wire protocol as data: a JSON Schema built from the op table and the error registry.

Clients in other languages get the contract from ``shared/protocol.schema.json``
(package data, written by ``python -m supervisor.docgen.protocol_doc --write``), which
:func:`build_schema` makes at run time from what the code itself uses:

* :data:`shared.protocol.OPS`: every op, who may call it, its arguments and
  their types, its body frames, its reply and the errors it names;
* the error registry of :mod:`shared.errors`: every wire ``code``, its fields
  (the class's declared ones, with their annotated types), whether it is
  retryable, and its parent class (subclassing never shows on the wire);
* :class:`shared.spec.TenantSpec`: the ``register`` spec's keys, with the
  ranges, enums and size strings ``TenantSpec.from_dict`` accepts;
* the reply records of :mod:`shared.records` (``shared.protocol.REPLY_RECORDS``, read from the
  ops' reply types: the record each op's success reply decodes as, nested records by reference).

A row added to any of those tables flows into the schema (and into
docs/PROTOCOL.md) with no edit here; the notes below only add prose. The
argument schemas say what :func:`shared.protocol.check_args` and the spec
and size parsers accept, no more and no less, except where JSON Schema has
no words for it (:data:`SCHEMA_GAPS`): tests/supervisor/docgen/test_protocol_schema.py
proves the two agree on generated arguments.

Two conventions a validator must follow, because msgpack keeps apart what
JSON merges: ``"integer"`` is a msgpack int only (a float ``1.0`` is not an
int on the wire; ``jsonschema``'s default checker accepts it, so a strict
``integer`` type check is needed), and a msgpack ``bin`` value (capabilities,
bodies) is marked ``"x-msgpack": "bin"`` and never a JSON ``"string"``.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import re
import types
import typing
from importlib import resources
from typing import Any, Final

from shared import protocol as proto
from shared.errors import ISOLATION_REASONS, TenantIsolationViolation, TensorWasmError, _BY_CODE
from shared.quota import MAX_INSTANCES
from shared.sizes import MAX_SIZE
from shared.spec import TenantSpec
from shared.wire import Record

__all__ = [
    "ANONYMOUS_HELLO_KEYS",
    "COMMON_ERRORS",
    "LOCAL_ONLY_CODES",
    "SCHEMA_FILE",
    "SCHEMA_GAPS",
    "build_schema",
    "error_codes",
    "load_schema",
    "schema_text",
]

SCHEMA_FILE: Final = "protocol.schema.json"
JSON_SCHEMA_DIALECT: Final = "https://json-schema.org/draft/2020-12/schema"

#: what ``hello`` answers without a capability (liveness): nothing about tenants
ANONYMOUS_HELLO_KEYS: Final = ("protocol", "ready")

#: error classes any request may be answered with, beyond those its op names (docs/PROTOCOL.md "Refusals")
COMMON_ERRORS: Final = {
    "tenant": ("TenantIsolationViolation", "CapabilityRevoked", "Overloaded", "TenantFailed", "TenantStopped",
               "WorkerLost", "KernelTimeout", "MemoryExhausted", "ProtocolError", "InvalidArgument",
               "UnknownTenant", "TensorWasmError"),
    "admin": ("TenantIsolationViolation", "CapabilityRevoked", "ProtocolError", "InvalidArgument",
              "TensorWasmError"),
}

#: codes the Python client (or a library call) raises itself; the supervisor never sends them
LOCAL_ONLY_CODES: Final = {
    "request_timeout": "the Python client's own timeout: a raw client keeps its own",
    "supervisor_unavailable": "the Python client found no supervisor (no run dir, no connection)",
    "handshake_failed": "the Python client's socket monitor saw the CURVE handshake fail",
    "untrusted_run_dir": "the Python client refused a run dir, socket or file of another user",
    "run_dir_locked": "`twt supervise` found another supervisor on the run dir",
    "foreign_capability": "the registry's `*_strict` library methods only",
    "node_lost": "the cluster client (Ray) lost a node",
    "registry_error": "a base class; its subclasses are what is sent",
}

#: where the schema cannot say all the supervisor checks; the supervisor refuses these,
#: the schema lets them pass (never the other way round)
SCHEMA_GAPS: Final = (
    "a non-finite float (NaN): JSON has no NaN, so a range cannot exclude it",
    "a size string whose value is 2**63 bytes or more, or below a field's minimum "
    "(`wasm_max_memory_bytes`: 65536, `bytes_per_s`: 1): the schema checks the form of a size string, "
    "not its value",
)

# ------------------------------------------------------------------ prose that the tables lack

#: what every ``handle`` argument says (handles start at 2**32: a float64 client loses them)
_HANDLE: Final = "a buffer handle from `alloc`: an integer >= 2^32 (up to 2^56), kept as a 64-bit int"

#: what each argument means (op, arg) -> text; an argument without a note is documented by its type
ARG_NOTES: Final[dict[tuple[str, str], str]] = {
    ("alloc", "nbytes"): "bytes to allocate (> 0)",
    ("alloc", "instance"): "the instance to allocate on (nil or absent: the least loaded)",
    ("free", "handle"): _HANDLE,
    ("write", "handle"): _HANDLE,
    ("write", "offset"): "byte offset in the buffer (default 0); the body frame holds the bytes",
    ("read", "handle"): _HANDLE,
    ("read", "offset"): "byte offset in the buffer (default 0)",
    ("read", "nbytes"): "bytes to read; they come back as the body frame",
    ("run_wasm", "export"): "the exported function to call",
    ("run_wasm", "args"): "its arguments: ints, floats, or `{handle: int}` maps naming buffers",
    ("run_wasm", "fuel"): "fuel for the run (default and ceiling: the spec's `wasm_fuel`)",
    ("run_wasm", "timeout_s"): "wall-clock limit in seconds (default and ceiling: `wasm_timeout_s`)",
    ("run_wasm", "digest"): "sha256 hex of a module stored with `put_module`, when no body frame is sent",
    ("events", "after"): "cursor: events after this `seq`; nil or absent: only the cursor of now; 0: all held",
    ("events", "max"): "most events in the reply (served up to 1,000)",
    ("events", "kinds"): "event kinds to return (names of 1..64 characters, at most 64)",
    ("events", "log"): "the `log` the cursor came from (a restarted supervisor has a new one)",
    ("region_create", "nbytes"): "region size, 64 KiB..1 GiB (rounded up to pages)",
    ("region_create", "pid"): "ignored (older clients send their process id): the owner is the connecting process",
    ("region_release", "region"): "a region id from `region_create`",
    ("write_region", "handle"): "the destination buffer; " + _HANDLE,
    ("write_region", "offset"): "byte offset in the buffer (default 0)",
    ("write_region", "region"): "the source region",
    ("write_region", "region_offset"): "byte offset in the region (default 0)",
    ("write_region", "nbytes"): "bytes to copy",
    ("read_region", "handle"): "the source buffer; " + _HANDLE,
    ("read_region", "offset"): "byte offset in the buffer (default 0)",
    ("read_region", "region"): "the destination region",
    ("read_region", "region_offset"): "byte offset in the region (default 0)",
    ("read_region", "nbytes"): "bytes to copy",
    ("register", "spec"): "the tenant spec: a map of the keys in [The tenant spec](#the-tenant-spec)",
    ("capability", "tenant"): "tenant name",
    ("evict", "tenant"): "tenant name",
    ("set_quota", "tenant"): "tenant name",
    ("set_quota", "memory_quota_bytes"): "new host byte quota: bytes or a size string",
    ("set_quota", "gpu_memory_bytes_cap"): "new GPU byte cap: bytes, a size string, or nil (no cap)",
    ("set_quota", "recorded_cuda_mem_pool_quota"): "new pool retention hint: bytes, a size string, or nil",
    ("set_quota", "idle_timeout_s"): "new idle time before parking, seconds, or nil (never parks)",
    ("scale", "tenant"): "tenant name",
    ("scale", "instances"): f"instances wanted, 0..{MAX_INSTANCES} (0: stopped)",
    ("tenant_status", "tenant"): "tenant name",
    ("inject_fault", "tenant"): "tenant name",
    ("inject_fault", "kind"): "one of " + ", ".join(f"`{k}`" for k in proto.FAULT_KINDS),
    ("inject_fault", "instance"): "the instance (nil or absent: the first live one)",
    ("inject_fault", "params"): "the fault's parameters (docs/RELIABILITY.md)",
    ("reset", "tenant"): "tenant name",
    ("restart", "tenant"): "tenant name",
}

#: the register spec's keys: (schema, unit/meaning). A key of TenantSpec missing here is described
#: from its annotation (tests/supervisor/docgen/test_protocol_schema.py then shows where the two differ)
_SIZE_NOTE = "bytes: an int, or a size string (`\"512MiB\"`, `\"2GiB\"`, `\"1.5GB\"`, `\"4096\"`)"


def _size_schema(nullable: bool = False, minimum: int = 0) -> dict[str, object]:
    """A size (``#/$defs/size``), nil too when ``nullable``; an int below ``minimum`` is refused
    (a size *string* below it is one of the :data:`SCHEMA_GAPS`)."""
    size: dict[str, object] = {"$ref": "#/$defs/size"}
    if minimum:
        size = {"allOf": [size, {"anyOf": [{"type": "string"}, {"type": "integer", "minimum": minimum}]}]}
    return {"anyOf": [size, {"type": "null"}]} if nullable else size


def _int_schema(lo: int, hi: int, nullable: bool = False) -> dict[str, object]:
    return {"type": ["integer", "null"] if nullable else "integer", "minimum": lo, "maximum": hi}


def _num_schema(lo: float, hi: float) -> dict[str, object]:
    return {"type": "number", "minimum": lo, "maximum": hi}


_TENANT_PATTERN = "^[a-z0-9][a-z0-9._-]{0,62}(?![\\s\\S])"  # (?!...): the end in ECMA 262 and Python alike


def _spec_fields() -> dict[str, tuple[dict[str, object], str]]:
    from shared.spec import IsolationKind, RestartPolicy

    return {
        "tenant_id": ({"type": "string", "pattern": _TENANT_PATTERN},
                      "1-63 characters: lowercase letters, digits, `-`, `_`, `.`; starts with a letter or digit "
                      "(`name` is accepted instead; never both)"),
        "memory_quota_bytes": (_size_schema(), "host byte quota of all instances together; " + _SIZE_NOTE),
        "gpu_memory_bytes_cap": (_size_schema(True), "GPU byte cap; nil: counted, never refused; " + _SIZE_NOTE),
        "recorded_cuda_mem_pool_quota": (_size_schema(True), "the pool's release threshold (a hint); " + _SIZE_NOTE),
        "cuda_device_index": (_int_schema(0, 1023, True), "GPU index; nil: the placement policy picks"),
        "isolation": ({"enum": [k.value for k in IsolationKind]}, "how its workers share a GPU"),
        "sm_percentage": (_int_schema(1, 100, True), "MPS only: active thread percentage"),
        "instances": (_int_schema(0, MAX_INSTANCES), "worker processes sharing the quota"),
        "restart": ({"enum": [k.value for k in RestartPolicy]}, "when an exited worker is started again"),
        "max_restarts": (_int_schema(0, 1_000_000), "restarts allowed within `restart_window_s`"),
        "restart_window_s": (_num_schema(0.001, 1e7), "seconds"),
        "max_in_flight": (_int_schema(1, 1_000_000), "requests in flight or parked before `overloaded`"),
        "request_timeout_s": (_num_schema(0.001, 1e6), "seconds before a request is answered `kernel_timeout`"),
        "wasm_fuel": (_int_schema(1, (1 << 63) - 1), "a run's default fuel and its ceiling"),
        "wasm_timeout_s": (_num_schema(0.001, 1e6), "seconds: a run's default limit and its ceiling"),
        "wasm_max_memory_bytes": (_size_schema(minimum=65536), "largest guest linear memory, at least 65536; " + _SIZE_NOTE),
        "requests_per_s": ({"type": ["number", "null"], "minimum": 0.001, "maximum": 1e9},
                           "admission: requests per second, every op; nil: the supervisor's `tenant_requests_per_s`"),
        "bytes_per_s": (_size_schema(True, minimum=1),
                        "admission: request bytes per second; nil: the supervisor's `tenant_bytes_per_s`; "
                        + _SIZE_NOTE),
        "gpu_time_weight": ({"type": "number", "exclusiveMinimum": 0, "maximum": 1e6},
                            "work-conserving weight of its GPU time on its device (docs/GPU-QUOTAS.md)"),
        "gpu_time_cap": ({"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
                         "hard ceiling on its fraction of the device's time; nil: none"),
        "idle_timeout_s": ({"type": ["number", "null"], "minimum": 0.001, "maximum": 1e7},
                           "seconds without a request before the tenant is parked; nil: never"),
    }


# ------------------------------------------------------------------ Python types -> JSON Schema

_SCALARS: Final[dict[object, str]] = {int: "integer", float: "number", str: "string", bool: "boolean",
                                   type(None): "null", dict: "object", list: "array"}
_MSGPACK_NAMES: Final[dict[str, str]] = {"integer": "int", "number": "float or int", "string": "str",
                                         "boolean": "bool", "null": "nil", "object": "map", "array": "array"}


def _arg_schema(arg: proto.Arg) -> dict[str, object]:
    """What ``check_args`` accepts for one argument: exactly its types (a bool is no int)."""
    names: list[str] = []
    for t in arg.types:
        name = _SCALARS.get(t)
        if name is None:
            raise TypeError(f"argument {arg.name!r}: no JSON Schema type for {t!r}")
        names.append(name)
    if "number" in names and "integer" in names:
        names.remove("integer")  # a JSON number includes the integers
    return {"type": names[0] if len(names) == 1 else names}


def _type_schema(tp: object) -> dict[str, object]:
    """A schema for an annotated type (records, error fields); a free-form value (``object``, or
    ``typing``'s catch-all, which this module only compares against) is anything."""
    if tp is Any or tp is object:
        return {}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"enum": [m.value for m in tp]}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return {"$ref": f"#/$defs/records/{tp.__name__}"}
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        parts = [_type_schema(a) for a in args]
        plain = [p["type"] for p in parts if set(p) == {"type"} and isinstance(p["type"], str)]
        if len(plain) == len(parts):
            if "number" in plain and "integer" in plain:
                plain.remove("integer")
            return {"type": plain}
        return {"anyOf": parts}
    if origin in (tuple, list):
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _type_schema(args[0])}
        if origin is tuple and args:
            return {"type": "array", "prefixItems": [_type_schema(a) for a in args], "minItems": len(args)}
        return {"type": "array"}
    if origin is dict:
        return {"type": "object"}
    return {}


def _dataclasses_in(tp: object) -> list[type]:
    """The record classes an annotation names (itself, or inside a tuple/union)."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return [tp]
    return [cls for arg in typing.get_args(tp) for cls in _dataclasses_in(arg)]


def _record_defs(roots: typing.Iterable[type]) -> dict[str, object]:
    """``#/$defs/records``: each reply record once, nested ones by reference."""
    todo, out = list(roots), {}
    while todo:
        cls = todo.pop()
        if cls.__name__ not in out:
            out[cls.__name__] = _record_schema(cls)
            todo += [nested for hint in typing.get_type_hints(cls).values() for nested in _dataclasses_in(hint)]
    return dict(sorted(out.items()))


def _record_schema(cls: type) -> dict[str, object]:
    """Every field of a reply record; those without a default are required (a reply built as a
    map may leave the others out: ``Record.from_wire`` fills them in); more may come."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    return {
        "type": "object",
        "required": [f.name for f in fields
                     if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING],
        "properties": {f.name: _type_schema(hints[f.name]) for f in fields},
    }


def _annotation_schema(annotation: object) -> dict[str, object]:
    """An error field's annotation (a string under ``from __future__ import annotations``)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    names: list[str] = []
    for part in (p.strip() for p in text.split("|")):
        name = {"int": "integer", "float": "number", "str": "string", "bool": "boolean", "None": "null"}.get(part)
        if name is None:
            return {}
        names.append(name)
    if "number" in names and "integer" in names:
        names.remove("integer")
    return {"type": names[0] if len(names) == 1 else names}


# ------------------------------------------------------------------ the parts


def _size_def() -> dict[str, object]:
    """A byte size: a non-negative int below 2**63, or a size string as ``shared.sizes.parse_size`` reads it."""
    from shared.sizes import _UNITS

    def anycase(unit: str) -> str:
        return "".join(f"[{c.lower()}{c.upper()}]" for c in unit)

    units = "|".join(anycase(u) for u in sorted((u for u in _UNITS if u), key=lambda u: (-len(u), u)))
    space = "[ \\t\\n\\r\\f\\v]*"
    return {
        "description": "bytes: an int, or a string of digits (an optional fraction) and an optional unit "
                       "(K/KiB.. powers of 1024, kB/MB/GB/TB powers of 1000, any case but bits: "
                       "an upper-case prefix with a lower-case b, e.g. Gb, is refused)",
        "anyOf": [
            {"type": "integer", "minimum": 0, "maximum": MAX_SIZE},
            {"type": "string", "pattern": f"^{space}[0-9]+(\\.[0-9]+)?{space}({units})?{space}(?![\\s\\S])",
             # an upper-case prefix with a lower-case b (Gb, Mib) means bits: refused, not read as bytes
             "not": {"pattern": f"[0-9]{space}[A-Z][a-zA-Z]*b{space}(?![\\s\\S])"}},
        ],
    }


def tenant_spec_schema() -> dict[str, object]:
    """The ``register`` spec: every TenantSpec key; ``name`` or ``tenant_id``; no other key."""
    notes = _spec_fields()
    hints = typing.get_type_hints(TenantSpec)
    properties: dict[str, dict[str, object]] = {}
    meanings: dict[str, str] = {}
    defaults: dict[str, object] = {}
    for f in dataclasses.fields(TenantSpec):
        schema, meaning = notes.get(f.name) or (_type_schema(hints[f.name]), "")
        properties[f.name] = dict(schema)
        meanings[f.name] = meaning
        if f.default is not dataclasses.MISSING:
            default = f.default.value if isinstance(f.default, enum.Enum) else f.default
            properties[f.name]["default"] = default
            defaults[f.name] = default
        if meaning:
            properties[f.name]["description"] = meaning
    properties["name"] = {**properties["tenant_id"], "description": "the same as `tenant_id` (give one of the two)"}
    return {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
        "oneOf": [{"required": ["tenant_id"]}, {"required": ["name"]}],
    }


def _error_classes() -> dict[str, type[TensorWasmError]]:
    return dict(sorted(_BY_CODE.items()))


def error_codes() -> tuple[str, ...]:
    """Every wire error code the registry knows (sorted)."""
    return tuple(_error_classes())


def _error_parent(cls: type[TensorWasmError]) -> str | None:
    for base in cls.__mro__[1:]:
        if isinstance(base, type) and issubclass(base, TensorWasmError) and "code" in base.__dict__:
            return str(base.__dict__["code"])
    return None


#: meanings the docstrings do not give as a client needs them
_MEANINGS: Final = {
    "internal": "The request failed inside the supervisor (a bug; it went on serving). A client also "
                "treats an error code it does not know like this one.",
}


def _error_meaning(cls: type[TensorWasmError]) -> str:
    if cls.code in _MEANINGS:
        return _MEANINGS[cls.code]
    doc = inspect.getdoc(cls) or ""
    return doc.split("\n\n")[0].replace("\n", " ").strip()


def _error_schema(code: str, cls: type[TensorWasmError]) -> dict[str, object]:
    annotations: dict[str, object] = {}
    for base in reversed(cls.__mro__):
        if isinstance(base, type) and issubclass(base, TensorWasmError):
            annotations.update(inspect.get_annotations(base))
    fields = {name: _annotation_schema(annotations.get(name, "")) for name in cls._fields}
    if issubclass(cls, TenantIsolationViolation):  # the audit's words: a client classifies by them
        fields["reason"] = {"enum": list(ISOLATION_REASONS)}
    # the causes of one code (Overloaded): subclasses without a code of their own, told apart by
    # ``cause``; their own fields are optional here, present when the cause is theirs
    causes: dict[str, object] = {}
    used_by: dict[str, list[str]] = {}  # a cause's own field -> the causes that have it
    for cause, sub in sorted(getattr(cls, "_causes", {}).items()):
        own = [name for name in sub._fields if name not in cls._fields]
        for name in own:
            fields.setdefault(name, _annotation_schema(inspect.get_annotations(sub).get(name, "")))
            used_by.setdefault(name, []).append(cause)
        causes[cause] = {"class": sub.__name__, "fields": own, "meaning": _error_meaning(sub)}
    for name, its_causes in used_by.items():
        fields[name] = {**fields[name], "description": "cause " + " ".join(f"`{c}`" for c in its_causes)}
    # a class with its own rule (MemoryExhausted: not when more than the whole limit was asked for)
    rule = cls.is_retryable if "is_retryable" in _own_or_inherited(cls) else None
    return {
        "type": "object",
        "required": ["code", "message", "fields"],
        "properties": {
            "code": {"const": code},
            "message": {"type": "string"},
            "fields": {"type": "object", "required": list(cls._fields), "properties": fields},
        },
        "x-twt": {
            "class": cls.__name__,
            "parent": _error_parent(cls),
            "retryable": bool(cls.retryable),
            "retryable_rule": (inspect.getdoc(rule) or "").replace("\n", " ") if rule is not None else None,
            "sent_by_supervisor": code not in LOCAL_ONLY_CODES,
            "local_only": LOCAL_ONLY_CODES.get(code),
            "meaning": _error_meaning(cls),
            "causes": causes,
        },
    }


def _own_or_inherited(cls: type) -> set[str]:
    """Method names defined below the root of the error tree (a class's own rule)."""
    names: set[str] = set()
    for base in cls.__mro__:
        if base is TensorWasmError:
            break
        names.update(base.__dict__)
    return names


def _codes_of(names: typing.Iterable[str]) -> list[str]:
    by_name = {cls.__name__: code for code, cls in _BY_CODE.items()}
    out: list[str] = []
    for name in names:
        code = by_name.get(name)
        if code is None:
            raise KeyError(f"the op table names an error class {name!r} that the registry does not know")
        if code not in out:
            out.append(code)
    return out


def _reply_keys(text: str) -> list[str]:
    """The top-level keys of a reply shape as the op table writes it: ``{a, b: [...], c}``."""
    text = text.strip()
    if not text.startswith("{"):
        return []
    depth, token, keys = 0, "", []
    for ch in text[1:]:
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            if depth == 0:
                break
            depth -= 1
        if depth == 0 and ch == ",":
            keys.append(token)
            token = ""
        else:
            token += ch
    keys.append(token)
    out = []
    for key in keys:
        name = key.split(":")[0].strip()
        if re.fullmatch(r"[a-z_][a-z0-9_]*", name):
            out.append(name)
    return out


def _reply_record(op: proto.OpSpec) -> type | None:
    return proto.REPLY_RECORDS.get(op.name)


def _reply_schema(op: proto.OpSpec) -> dict[str, object]:
    record = _reply_record(op)
    if record is not None:
        return {"$ref": f"#/$defs/records/{record.__name__}"}
    keys = _reply_keys(op.reply)
    schema: dict[str, object] = {"type": "object", "required": keys}
    if op.reply_type is not None and not issubclass(op.reply_type, Record):  # a flat typed reply: its fields
        fields = proto.wire_fields(op.reply_type)
        schema["required"] = [f.name for f in fields if f.required]
        schema["properties"] = {f.name: {"x-msgpack": "bin"} if f.types == (bytes,) else _arg_schema(f)
                                for f in fields}
    if op.name == "register":
        schema["properties"] = {"capability": {"x-msgpack": "bin", "description": "the tenant's capability bytes"}}
    if op.name == "rotate_key":
        schema["properties"] = {"admin_capability": {"x-msgpack": "bin"}}
    if op.name == "capability":
        schema["properties"] = {"capability": {"x-msgpack": "bin"}}
    return schema


def _capability_of(op: proto.OpSpec) -> str:
    if op.any_capability:
        return "admin or tenant"
    return "admin" if op.admin else "tenant"


def _op_entry(op: proto.OpSpec) -> dict[str, object]:
    required = [a.name for a in op.args if a.required]
    properties: dict[str, object] = {}
    for arg in op.args:
        schema = _arg_schema(arg)
        if op.name == "register" and arg.name == "spec":
            schema = {"$ref": "#/$defs/tenant_spec"}
        elif op.name == "set_quota" and arg.name in proto.QUOTA_KEYS and str in arg.types:  # the byte sizes
            schema = _size_schema("null" in str(schema.get("type")))
        elif op.name == "set_quota" and arg.name in proto.QUOTA_KEYS:  # the GPU-time policy: the spec's bounds
            schema = dict(_spec_fields()[arg.name][0])
        note = ARG_NOTES.get((op.name, arg.name))
        if note:
            schema = {**schema, "description": note}
        properties[arg.name] = schema
    args: dict[str, object] = {"type": "object", "properties": properties, "additionalProperties": True}
    if required:
        args["required"] = required
    entry: dict[str, object] = {
        "capability": _capability_of(op),
        "without_capability": op.anonymous,
        "args": args,
        "body_in": op.body_in,
        "body_out": op.body_out,
        "reply": _reply_schema(op),
        "reply_text": op.reply,
        "errors": _codes_of(op.errors),
        "common_errors": _codes_of(COMMON_ERRORS["admin" if op.admin and not op.any_capability else "tenant"]),
        "client_method": op.client,
        "cli": op.cli,
    }
    if entry["without_capability"]:
        entry["reply_without_capability"] = {
            "type": "object", "required": list(ANONYMOUS_HELLO_KEYS),
            "properties": {"protocol": {"type": "integer"}, "ready": {"type": "boolean"}},
        }
    return entry


def build_schema() -> dict[str, object]:
    """The whole contract as one JSON Schema document (see the module docstring)."""
    ops = {name: _op_entry(op) for name, op in sorted(proto.OPS.items())}
    errors = {code: _error_schema(code, cls) for code, cls in _error_classes().items()}
    defs: dict[str, object] = {
        "size": _size_def(),
        "tenant_spec": tenant_spec_schema(),
        "request_header": {
            "description": "frame 1 of a request: [version, rid, op, capability, args] (msgpack array of 5)",
            "type": "array",
            "prefixItems": [
                {"const": proto.PROTOCOL_VERSION},
                {"type": "integer", "minimum": 0, "maximum": (1 << 63) - 1},
                {"enum": sorted(proto.OPS)},
                {"x-msgpack": "bin or nil", "description": "the capability's bytes (bin, never str), or nil"},
                {"type": "object"},
            ],
            "minItems": 5,
            "maxItems": 5,
        },
        "reply_header": {
            "description": "frame 1 of a reply: [version, rid, ok, result or error] (msgpack array of 4)",
            "type": "array",
            "prefixItems": [{"const": proto.PROTOCOL_VERSION}, {"type": "integer", "minimum": 0},
                            {"type": "boolean"}, {}],
            "minItems": 4,
            "maxItems": 4,
        },
        "error": {
            "description": "an error reply's payload; `code` picks its schema under $defs/errors",
            "type": "object",
            "required": ["code", "message", "fields"],
            "properties": {"code": {"type": "string"}, "message": {"type": "string"}, "fields": {"type": "object"}},
        },
        "records": _record_defs(r for r in map(_reply_record, proto.OPS.values()) if r is not None),
        "args": {name: entry["args"] for name, entry in ops.items()},
        "replies": {name: entry["reply"] for name, entry in ops.items()},
        "errors": {code: {k: v for k, v in schema.items() if k != "x-twt"} for code, schema in errors.items()},
    }
    return {
        "$schema": JSON_SCHEMA_DIALECT,
        "$id": f"urn:tensor-wasm-tenant:protocol:{proto.PROTOCOL_VERSION}",
        "title": "tensor-wasm-tenant wire protocol",
        "description": "Generated from shared/protocol.py OPS and the shared/errors.py registry by "
                       "`python -m supervisor.docgen.protocol_doc --write`; docs/PROTOCOL.md explains it. Validate "
                       "args against `#/$defs/args/<op>` with a strict integer type (a msgpack float is no int).",
        "x-twt": {
            "protocol": proto.PROTOCOL_VERSION,
            "max_header_bytes": proto.MAX_HEADER_BYTES,
            "ops": {name: {k: v for k, v in entry.items() if k not in ("args", "reply")}
                    for name, entry in ops.items()},
            "errors": {code: schema["x-twt"] for code, schema in errors.items()},
            "schema_gaps": list(SCHEMA_GAPS),
        },
        "$defs": defs,
    }


def schema_text(schema: dict[str, object] | None = None) -> str:
    """The schema file's exact text (sorted keys, two-space indent, a final newline)."""
    return json.dumps(build_schema() if schema is None else schema, indent=2, sort_keys=True) + "\n"


def load_schema() -> dict[str, object]:
    """The schema shipped with the package (``shared/protocol.schema.json``)."""
    data: dict[str, object] = json.loads(resources.files("shared").joinpath(SCHEMA_FILE).read_text(encoding="utf-8"))
    return data

