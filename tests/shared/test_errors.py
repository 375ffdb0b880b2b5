"""The error tree: wire codes, retryability, dict and pickle round trips."""

from __future__ import annotations

import functools
import inspect
import pickle
import typing
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shared
from shared import errors
from shared.errors import (
    AlreadyRegistered,
    BackendUnavailable,
    CapabilityFromForeignRegistry,
    CapabilityRevoked,
    ConfigError,
    CudaError,
    GpuMemoryExhausted,
    HandshakeFailed,
    InvalidArgument,
    KernelTimeout,
    MemoryExhausted,
    NodeLost,
    Overloaded,
    ProtocolError,
    RegistryError,
    RequestTimeout,
    SegmentError,
    StateError,
    SupervisorUnavailable,
    TenantFailed,
    TenantIsolationViolation,
    TensorWasmError,
    UnknownModule,
    UnknownTenant,
    UntrustedRunDir,
    WasmCompile,
    WasmTrap,
    WorkerLost,
    error_class_for_code,
    error_from_dict,
)
from shared.protocol import decode_reply, encode_reply

#: One sample per class: its constructor's keyword arguments.
SAMPLES: dict[type[TensorWasmError], dict[str, Any]] = {
    errors.RunDirLocked: {"run_dir": "/tmp/twt-1", "pid": 42},
    MemoryExhausted: {"tenant_id": "acme", "requested": 4096, "limit": 8192, "current": 6000},
    GpuMemoryExhausted: {"tenant_id": "acme", "requested": 1 << 30, "limit": 1 << 31, "current": 1 << 31},
    TenantIsolationViolation: {"tenant_id": "acme", "resource": "run_wasm", "reason": "forged"},
    CapabilityRevoked: {"tenant_id": "acme", "resource": "alloc", "reason": "revoked"},
    CudaError: {"call": "cuMemAllocFromPoolAsync", "result_name": "CUDA_ERROR_OUT_OF_MEMORY", "result_code": 2},
    WasmTrap: {"trap_code": "unreachable", "detail": "at func 3", "location": "f+0x3 <- run+0x9", "fuel_limit": None},
    WasmCompile: {"detail": "unknown import tensorwasm.nope"},
    KernelTimeout: {"timeout_s": 2.5, "op": "run_wasm"},
    WorkerLost: {"tenant_id": "acme", "instance": 1, "exit_code": None, "signal": 9, "reason": "oom"},
    NodeLost: {"tenant_id": "acme", "instance": 0, "exit_code": None, "signal": None, "reason": "actor died",
               "node_id": "4be0c2a1f3d9"},
    HandshakeFailed: {"endpoint": "tcp://127.0.0.1:7700", "reason": "wrong server public key?"},
    Overloaded: {"tenant_id": "acme", "in_flight": 64, "limit": 64, "retry_after_s": None, "cause": ""},
    errors.InFlightLimit: {"tenant_id": "acme", "in_flight": 64, "limit": 64, "retry_after_s": None,
                           "cause": "in_flight"},
    errors.WorkerQueueFull: {"tenant_id": "acme", "in_flight": 9, "limit": 64, "retry_after_s": None,
                             "cause": "worker_queue", "instance": 1, "queued": 1000},
    errors.HeldBytesLimit: {"tenant_id": "acme", "in_flight": 2, "limit": 64, "retry_after_s": None,
                            "cause": "held_bytes", "scope": "total", "held": 1 << 31, "requested": 4096,
                            "budget": 1 << 31},
    errors.ClientRepliesQueued: {"tenant_id": "acme", "in_flight": 2, "limit": 64, "retry_after_s": None,
                                 "cause": "client_replies", "queued": 70 << 20, "budget": 64 << 20},
    errors.AdmissionRate: {"tenant_id": "acme", "in_flight": 3, "limit": 64, "retry_after_s": 0.25,
                           "cause": "rate", "what": "bytes", "rate": 2000.0},
    errors.CapacityExhausted: {"what": "tenants", "in_use": 1024, "wanted": 1, "limit": 1024,
                               "setting": "max_tenants", "retry_after_s": None},
    errors.Draining: {"retry_after_s": 5.0, "drain_timeout_s": 35.0},
    errors.FaultInjectionDisabled: {"op": "inject_fault"},
    ProtocolError: {"detail": "header too large"},
    InvalidArgument: {"detail": "nbytes must be positive"},
    BackendUnavailable: {"backend": "cuda", "reason": "no driver"},
    TenantFailed: {"tenant_id": "acme", "restarts": 5, "window_s": 60.0},
    errors.TenantStopped: {"tenant_id": "acme"},
    errors.BufferLost: {"tenant_id": "acme", "handle": "1:7", "instance": 1, "incarnation": 3},
    RequestTimeout: {"op": "status", "timeout_s": 5.0},
    SupervisorUnavailable: {"run_dir": "/run/twt", "reason": "no socket"},
    UntrustedRunDir: {"path": "/tmp/twt-1000", "reason": "it belongs to uid 1001"},
    SegmentError: {"name": "twt-abc-0", "detail": "bad magic"},
    StateError: {"path": "/var/lib/twt/state.db", "detail": "schema version 3 is newer"},
    ConfigError: {"path": "/etc/twt/tenants.toml", "detail": "unknown key 'bogus'"},
    RegistryError: {"tenant_id": "acme"},
    AlreadyRegistered: {"tenant_id": "acme"},
    UnknownTenant: {"tenant_id": "ghost"},
    UnknownModule: {"tenant_id": "acme", "digest": "ab" * 32},
    CapabilityFromForeignRegistry: {
        "tenant_id": "acme",
        "expected_registry": "r-1111",
        "actual_registry": "r-2222",
    },
}

#: The wire codes are a protocol: changing one breaks old clients.
PINNED_CODES = {
    TensorWasmError: "internal",
    MemoryExhausted: "memory_exhausted",
    GpuMemoryExhausted: "gpu_memory_exhausted",
    TenantIsolationViolation: "isolation_violation",
    CapabilityRevoked: "capability_revoked",
    CudaError: "cuda_error",
    WasmTrap: "wasm_trap",
    WasmCompile: "wasm_compile",
    KernelTimeout: "kernel_timeout",
    WorkerLost: "worker_lost",
    NodeLost: "node_lost",
    HandshakeFailed: "handshake_failed",
    Overloaded: "overloaded",
    errors.CapacityExhausted: "capacity_exhausted",
    errors.Draining: "draining",
    errors.FaultInjectionDisabled: "fault_injection_disabled",
    ProtocolError: "protocol_error",
    InvalidArgument: "invalid_argument",
    BackendUnavailable: "backend_unavailable",
    TenantFailed: "tenant_failed",
    errors.TenantStopped: "tenant_stopped",
    errors.BufferLost: "buffer_lost",
    RequestTimeout: "request_timeout",
    SupervisorUnavailable: "supervisor_unavailable",
    SegmentError: "segment_error",
    StateError: "state_error",
    ConfigError: "config_error",
    RegistryError: "registry_error",
    AlreadyRegistered: "already_registered",
    UnknownTenant: "unknown_tenant",
    UnknownModule: "unknown_module",
    CapabilityFromForeignRegistry: "foreign_capability",
}

RETRYABLE = {
    MemoryExhausted,
    GpuMemoryExhausted,
    KernelTimeout,
    WorkerLost,
    NodeLost,
    Overloaded,
    errors.Draining,
    errors.InFlightLimit,
    errors.WorkerQueueFull,
    errors.HeldBytesLimit,
    errors.ClientRepliesQueued,
    errors.AdmissionRate,
    RequestTimeout,
    SupervisorUnavailable,
}


def _all_subclasses(cls: type[TensorWasmError]) -> set[type[TensorWasmError]]:
    """Subclasses defined in shared.errors (the one home of the tree; tests define others)."""
    found = set()
    for sub in cls.__subclasses__():
        if sub.__module__ == errors.__name__:
            found.add(sub)
        found |= _all_subclasses(sub)
    return found


def _make(cls: type[TensorWasmError]) -> TensorWasmError:
    return cls(**SAMPLES[cls])


def test_samples_cover_every_subclass() -> None:
    # A new error class must get a sample here (and thereby the round-trip tests).
    assert _all_subclasses(TensorWasmError) == set(SAMPLES)


def test_every_error_is_exported() -> None:
    for cls in SAMPLES:
        assert cls.__name__ in errors.__all__
        assert getattr(shared, cls.__name__) is cls
    assert set(errors.__all__) <= set(dir(errors))


@pytest.mark.parametrize("cls", sorted(SAMPLES, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_dict_round_trip_gives_same_class_and_fields(cls: type[TensorWasmError]) -> None:
    err = _make(cls)
    data = err.to_dict()
    assert set(data) == {"code", "message", "fields"}
    assert data["code"] == cls.code
    assert data["fields"] == SAMPLES[cls]
    back = error_from_dict(data)
    assert type(back) is cls
    assert back.fields() == err.fields() == SAMPLES[cls]
    for name, value in SAMPLES[cls].items():
        assert getattr(back, name) == value
    assert back.message == err.message == str(err)
    assert back == err
    assert hash(back) == hash(err)


@pytest.mark.parametrize("cls", sorted(SAMPLES, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_custom_message_survives_round_trip(cls: type[TensorWasmError]) -> None:
    err = cls(**SAMPLES[cls], message="custom text")
    back = error_from_dict(err.to_dict())
    assert type(back) is cls
    assert str(back) == "custom text"
    assert back.fields() == SAMPLES[cls]


@pytest.mark.parametrize("cls", sorted(SAMPLES, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_pickle_round_trip(cls: type[TensorWasmError]) -> None:
    err = _make(cls)
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(err, protocol=protocol))
        assert type(back) is cls
        assert back == err
        assert back.fields() == err.fields()


def test_root_error_round_trips() -> None:
    err = TensorWasmError("something internal")
    data = err.to_dict()
    assert data == {"code": "internal", "message": "something internal", "fields": {}}
    back = error_from_dict(data)
    assert type(back) is TensorWasmError
    assert back == err
    assert type(pickle.loads(pickle.dumps(err))) is TensorWasmError


@pytest.mark.parametrize("cls", sorted(SAMPLES, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_retryable_exactly_for_transient_kinds(cls: type[TensorWasmError]) -> None:
    assert _make(cls).is_retryable() is (cls in RETRYABLE)


@pytest.mark.parametrize("cls", [MemoryExhausted, GpuMemoryExhausted])
def test_more_than_the_whole_limit_is_not_retryable(cls: type[MemoryExhausted]) -> None:
    assert cls("acme", 1 << 31, 1 << 30, 0).is_retryable() is False  # never fits, whatever is freed
    assert cls("acme", 1 << 30, 1 << 30, 1).is_retryable() is True  # fits once use falls
    back = error_from_dict(cls("acme", 1 << 31, 1 << 30, 0).to_dict())
    assert back.is_retryable() is False  # the client sees the same answer


def test_root_is_not_retryable() -> None:
    assert TensorWasmError("x").is_retryable() is False


def test_wire_codes_are_pinned_and_unique() -> None:
    assert {cls: cls.code for cls in PINNED_CODES} == PINNED_CODES
    codes = [cls.code for cls in PINNED_CODES]
    assert len(codes) == len(set(codes))
    for cls, code in PINNED_CODES.items():
        assert error_class_for_code(code) is cls
    assert error_class_for_code("no_such_code") is TensorWasmError


def test_a_second_class_cannot_take_a_used_code() -> None:
    with pytest.raises(TypeError, match="already used"):

        class Duplicate(TensorWasmError):
            code = "memory_exhausted"


def test_builtin_bases_match_meaning() -> None:
    assert issubclass(TenantIsolationViolation, PermissionError)
    assert issubclass(KernelTimeout, TimeoutError)
    assert issubclass(RequestTimeout, TimeoutError)
    assert issubclass(SupervisorUnavailable, ConnectionError)
    assert issubclass(ProtocolError, ValueError)
    assert issubclass(InvalidArgument, ValueError)
    assert issubclass(AlreadyRegistered, ValueError)
    assert issubclass(UnknownTenant, LookupError)
    assert issubclass(UnknownModule, LookupError)
    assert issubclass(GpuMemoryExhausted, MemoryExhausted)
    assert issubclass(CapabilityFromForeignRegistry, RegistryError)
    for cls in SAMPLES:
        assert cls.__doc__, f"{cls.__name__} needs a docstring saying when it is raised"


def test_messages_carry_the_numbers() -> None:
    msg = str(GpuMemoryExhausted("acme", 1 << 30, 1 << 31, 1 << 31))
    assert "acme" in msg and "1,073,741,824" in msg and "2,147,483,648" in msg
    assert "signal 9" in str(WorkerLost("acme", 0, signal=9))
    assert "code 3" in str(WorkerLost("acme", 0, exit_code=3))
    assert "2.5 s" in str(KernelTimeout(2.5))


def test_non_scalar_fields_become_strings_on_the_wire() -> None:
    err = WasmTrap("trap", detail="x")
    err.detail = ["not", "scalar"]  # type: ignore[assignment]
    assert err.to_dict()["fields"]["detail"] == "['not', 'scalar']"


MALFORMED: list[Any] = [
    {},
    {"code": "memory_exhausted"},
    {"code": "memory_exhausted", "fields": {}},  # required fields missing
    {"code": "memory_exhausted", "fields": {"tenant_id": "a"}},
    {"code": 42, "fields": {}},
    {"code": None, "message": None, "fields": None},
    {"code": "memory_exhausted", "fields": ["tenant_id"]},
    {"code": "memory_exhausted", "fields": "nope"},
    {"code": "nonexistent_code", "fields": {}, "message": "from the future"},
    {"code": "kernel_timeout", "fields": {"timeout_s": "soon"}},  # default message cannot format
    {"code": "kernel_timeout", "fields": {"timeout_s": None}},
    {"code": "worker_lost", "fields": {"tenant_id": "a", "instance": 0, "bogus": 1}, "message": 7},
    {"code": ["list"], "fields": {}},
    None,
    "memory_exhausted",
    42,
    ["code", "fields"],
]


@pytest.mark.parametrize("data", MALFORMED, ids=repr)
def test_malformed_records_become_root_error_never_raise(data: Any) -> None:
    err = error_from_dict(data)
    assert isinstance(err, TensorWasmError)
    if isinstance(data, dict) and data.get("code") == "worker_lost":
        # Extra fields are ignored and a non-str message replaced: still a usable WorkerLost.
        assert type(err) is WorkerLost
        assert err.fields()["tenant_id"] == "a"
    else:
        assert type(err) is TensorWasmError
    assert isinstance(err.message, str) and err.message


def test_unknown_code_keeps_message() -> None:
    err = error_from_dict({"code": "nonexistent_code", "fields": {}, "message": "from the future"})
    assert type(err) is TensorWasmError
    assert str(err) == "from the future"


# ------------------------------------------------- every class, any field values, over the wire


@functools.cache
def _strategy_for(hint: Any) -> st.SearchStrategy[Any]:
    """Values of a field's type that msgpack carries (it is what the wire does with them). Built once
    per type (strategies are immutable): built per draw, they were most of the round-trip test's
    CPU outside hypothesis's engine (~60 classes x 40 examples)."""
    if hint is str:
        return st.text(st.characters(exclude_categories=("Cs",)), max_size=40)  # no lone surrogates in UTF-8
    if hint is int:
        return st.integers(-(1 << 63), (1 << 64) - 1)
    if hint is float:
        return st.floats(allow_nan=False)  # NaN != NaN: a field would never compare equal to itself
    if hint is type(None):
        return st.none()
    args = typing.get_args(hint)
    assert args, f"no strategy for field type {hint!r}: add one here"
    return st.one_of(*(_strategy_for(arg) for arg in args))


@functools.cache
def _hints(cls: type[TensorWasmError]) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _registered() -> list[type[TensorWasmError]]:
    classes = sorted(_all_subclasses(TensorWasmError), key=lambda c: c.__name__)
    # every one of them is on the wire table: by its code, or (a cause of Overloaded) by its cause
    assert all(error_class_for_code(cls.code) is cls or Overloaded._causes.get(getattr(cls, "cause", "")) is cls
               for cls in classes)
    return classes


@pytest.mark.slow  # 40 generated cases for each of ~60 classes: make test runs it, make test-fast not
@pytest.mark.parametrize("cls", _registered(), ids=lambda c: c.__name__)
@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_error_round_trips_over_the_wire_with_any_fields(cls: type[TensorWasmError], data: st.DataObject) -> None:
    hints = _hints(cls)
    fields = {name: data.draw(_strategy_for(hints[name]), label=name) for name in cls._fields}
    if issubclass(cls, Overloaded):  # the cause picks the class: its own, or one no class has (the base)
        fields["cause"] = cls.cause if cls is not Overloaded else data.draw(
            _strategy_for(str).filter(lambda c: c not in Overloaded._causes), label="cause")
    message = data.draw(st.none() | _strategy_for(str), label="message")
    err = cls(**fields, message=message)
    assert err.fields() == fields
    for name, value in fields.items():
        assert getattr(err, name) == value
    rid, ok, payload = decode_reply(encode_reply(7, False, err.to_dict()))
    back = error_from_dict(payload)
    assert type(back) is cls
    assert back.fields() == fields
    assert back == err and str(back) == str(err) == err.message
    if message is not None:
        assert str(back) == message
    assert back.is_retryable() is err.is_retryable()


def test_fields_follow_the_declaration_order_after_the_bases() -> None:
    assert WorkerLost._fields == ("tenant_id", "instance", "exit_code", "signal", "reason")
    # A redeclared field keeps its place (here it gains a default), a new one goes last.
    assert NodeLost._fields == WorkerLost._fields + ("node_id",)
    assert UnknownModule._fields == ("tenant_id", "digest")
    assert CapabilityFromForeignRegistry._fields == ("tenant_id", "expected_registry", "actual_registry")
    assert str(inspect.signature(NodeLost)) == (
        "(tenant_id: 'str', instance: 'int' = 0, exit_code: 'int | None' = None, signal: 'int | None' = None, "
        "reason: 'str' = '', node_id: 'str' = '', *, message: 'str | None' = None) -> 'None'"
    )


def test_constructors_refuse_what_a_hand_written_one_would() -> None:
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'current'"):
        MemoryExhausted("acme", 1, 2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="multiple values for argument 'tenant_id'"):
        UnknownTenant("acme", tenant_id="acme")  # type: ignore[misc]
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        WasmCompile("x", bogus=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="positional argument"):
        KernelTimeout(1.0, "op", "message")  # type: ignore[misc]


def test_a_subclass_declares_fields_in_one_block() -> None:
    # No code: nothing is registered on the shared wire table by this test.
    class Compiling(KernelTimeout):
        """A declared field, a template, and the base's fields first."""

        _template = "{op} of {module!r} exceeded {timeout_s:g} s"
        module: str = "?"

    err = Compiling(1.5, "compile", "m.wasm")
    assert (err.timeout_s, err.op, err.module) == (1.5, "compile", "m.wasm")
    assert str(err) == "compile of 'm.wasm' exceeded 1.5 s"
    assert err.code == "kernel_timeout" and isinstance(err, TimeoutError) and err.is_retryable()
    assert err.to_dict()["fields"] == {"timeout_s": 1.5, "op": "compile", "module": "m.wasm"}

    class Plain(Compiling):
        """No fields of its own: the base's constructor serves, the docstring is not the message."""

    assert Plain.__init__ is Compiling.__init__
    assert str(Plain(2.0)) == "run_wasm of '?' exceeded 2 s"


def test_a_declaration_that_cannot_be_a_constructor_is_refused_at_class_creation() -> None:
    with pytest.raises(TypeError, match="non-default argument|parameter without a default"):

        class Bad(WasmTrap):
            late: str

    with pytest.raises(TypeError, match="cannot be an error field"):

        class Worse(TensorWasmError):
            self: str

    with pytest.raises(TypeError, match="annotate a class constant ClassVar"):

        class Private(TensorWasmError):
            _hint: str = "x"


def test_root_message_defaults_to_the_docstring_and_is_always_a_str() -> None:
    assert str(TensorWasmError()) == "Root of every error raised by tensor-wasm-tenant."
    assert str(RegistryError("acme")) == "Base of the registry's lifecycle errors."
    err = WasmCompile("bad magic")
    err.message = None  # type: ignore[assignment]  # the descriptor regenerates the text
    assert err.message == "wasm module rejected: bad magic"


def test_isolation_refusals_carry_their_reason() -> None:
    """The denied audit reads ``reason`` (never the message text): each refusal names one of the vocabulary."""
    from shared.capability import capability_from_bytes
    from shared.errors import ISOLATION_REASONS

    assert TenantIsolationViolation(None, "x").reason == "other"
    assert CapabilityRevoked("acme", "generation 1").reason == "revoked"
    for raw, reason in ((b"\x01", "truncated"), (b"\x09" * 64, "malformed")):
        with pytest.raises(TenantIsolationViolation) as info:
            capability_from_bytes(raw)
        assert info.value.reason == reason, info.value
        assert info.value.reason in ISOLATION_REASONS


def test_overloaded_causes_share_the_wire_code_and_old_records_still_decode() -> None:
    """Each cause of Overloaded is its own class with its own numbers, all under the one wire code;
    ``tenant_id``, ``in_flight`` and ``limit`` stay, so a client that knows only Overloaded reads them."""
    assert set(Overloaded._causes) == set(errors.OVERLOADED_CAUSES)
    for cause, cls in Overloaded._causes.items():
        assert cls.code == "overloaded" and issubclass(cls, Overloaded) and cls.cause == cause
        assert cls._fields[:5] == Overloaded._fields == ("tenant_id", "in_flight", "limit", "retry_after_s", "cause")
    err = errors.WorkerQueueFull("acme", 9, 64, instance=1, queued=1000)
    record = err.to_dict()
    assert record["code"] == "overloaded" and record["fields"]["cause"] == "worker_queue"
    # an old supervisor's record (no cause: it sent every cause so): the base class, its fields kept
    old = error_from_dict({"code": "overloaded", "message": "m",
                           "fields": {"tenant_id": "acme", "in_flight": 64, "limit": 64, "retry_after_s": None}})
    assert type(old) is Overloaded and (old.in_flight, old.limit, old.cause) == (64, 64, "")
    # a newer supervisor's cause this client does not know: the base class, every field it knows kept
    new = error_from_dict({"code": "overloaded", "message": "m",
                           "fields": {**record["fields"], "cause": "from_the_future"}})
    assert type(new) is Overloaded and (new.tenant_id, new.in_flight, new.limit) == ("acme", 9, 64)
    assert new.is_retryable()
