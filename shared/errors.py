"""The one error tree of tensor-wasm-tenant.

Every failure a caller can act on is a subclass of :class:`TensorWasmError`
with a stable wire ``code``. Errors cross process boundaries (worker ->
supervisor -> client) as plain dicts (:meth:`TensorWasmError.to_dict`) and are
rebuilt on the other side as the *same class with the same fields*
(:func:`error_from_dict`), so ``except GpuMemoryExhausted as e: e.requested``
works identically in process and over the wire.

The mapping wire code -> class lives in exactly one table, ``_BY_CODE``,
filled by ``__init_subclass__``. Names follow the Rust crate
``tensor-wasm-tenant`` 0.3.8 where it had them.

An error class is a declaration, like a dataclass: its wire ``code``, its
fields as annotated class attributes (positional-or-keyword constructor
parameters, in order, after those of its bases; a default makes one
optional), and its message as a ``_template`` formatted with the fields (or
a ``_default_message`` method where the text depends on a field's value).
Every constructor also takes a keyword-only ``message`` that replaces the
generated text. ``__init_subclass__`` writes the constructor and
``_fields`` (what crosses the wire); ``@dataclass_transform`` on the
metaclass tells mypy the same, so constructor calls stay type-checked::

    class WasmCompile(TensorWasmError):
        # a docstring: when it is raised and what to do
        code = "wasm_compile"
        _template = "wasm module rejected: {detail}"
        detail: str

    TensorWasmError
    +-- MemoryExhausted              host (CPU) byte quota refused       retryable (not when requested > limit)
    +-- GpuMemoryExhausted           GPU byte quota / driver OOM         retryable (not when requested > limit)
    +-- TenantIsolationViolation     bad, forged or foreign capability   (PermissionError)
    |   +-- CapabilityRevoked        capability of an evicted tenant
    +-- CudaError                    a CUDA driver call failed
    +-- WasmTrap                     the guest trapped
    +-- WasmCompile                  the module does not compile / validate
    +-- KernelTimeout                deadline exceeded                   retryable (TimeoutError)
    +-- WorkerLost                   the worker died with the request    retryable
    |   +-- NodeLost                 its whole node (cluster) was lost   retryable
    +-- Overloaded                   a supervisor limit, for now         retryable
    |   +-- InFlightLimit            max_in_flight                       (cause "in_flight")
    |   +-- WorkerQueueFull          the worker instance's queue         (cause "worker_queue")
    |   +-- HeldBytesLimit           bytes held for tenants              (cause "held_bytes")
    |   +-- ClientRepliesQueued      a client not reading its replies    (cause "client_replies")
    |   +-- AdmissionRate            requests or bytes per second        (cause "rate")
    +-- Draining                     the supervisor is stopping; retry   retryable (retry_after_s)
    +-- FaultInjectionDisabled       inject_fault with fault_injection off
    +-- ProtocolError                malformed or schema-violating frame (ValueError)
    +-- InvalidArgument              well-formed request, bad argument   (ValueError)
    +-- BackendUnavailable           requested backend cannot be used
    +-- TenantFailed                 tenant exceeded its restart intensity
    +-- TenantStopped                tenant scaled to 0 instances
    +-- BufferLost                   the buffer's instance restarted since it was allocated
    +-- RequestTimeout               no reply within the client timeout  retryable (TimeoutError)
    +-- RunDirLocked                 another supervisor runs on that run dir
    +-- SupervisorUnavailable        no supervisor at that run dir       retryable (ConnectionError)
    +-- HandshakeFailed              CURVE handshake refused (wrong key)  (ConnectionError)
    +-- UntrustedRunDir              run dir / socket / file of another uid (PermissionError)
    +-- SegmentError                 shared-memory segment missing/foreign/closed
    +-- StateError                   the state database cannot be used as it is
    +-- ConfigError                  the config file cannot be applied (reload)  (ValueError)
    +-- RegistryError
        +-- AlreadyRegistered        (ValueError)
        +-- UnknownTenant            (LookupError)
        +-- UnknownModule            (LookupError)
        +-- CapabilityFromForeignRegistry  (strict variants only)
"""

from __future__ import annotations

import inspect
import keyword
from collections.abc import Callable, Mapping
from typing import ClassVar, Final, Self, TypeVar, cast, dataclass_transform, overload

__all__ = [
    "AdmissionRate",
    "AlreadyRegistered",
    "BackendUnavailable",
    "BufferLost",
    "CapabilityFromForeignRegistry",
    "CapabilityRevoked",
    "CapacityExhausted",
    "ClientRepliesQueued",
    "ConfigError",
    "CudaError",
    "Draining",
    "FaultInjectionDisabled",
    "GpuMemoryExhausted",
    "HandshakeFailed",
    "HeldBytesLimit",
    "ISOLATION_REASONS",
    "InFlightLimit",
    "InvalidArgument",
    "KernelTimeout",
    "MemoryExhausted",
    "NodeLost",
    "OVERLOADED_CAUSES",
    "Overloaded",
    "ProtocolError",
    "RegistryError",
    "RequestTimeout",
    "RunDirLocked",
    "SegmentError",
    "StateError",
    "SupervisorUnavailable",
    "TenantFailed",
    "TenantIsolationViolation",
    "TenantStopped",
    "TensorWasmError",
    "UnknownModule",
    "UnknownTenant",
    "UntrustedRunDir",
    "WasmCompile",
    "WasmTrap",
    "WorkerLost",
    "WorkerQueueFull",
    "error_class_for_code",
    "error_from_dict",
]

_BY_CODE: dict[str, type[TensorWasmError]] = {}

#: Wire values must be msgpack-able scalars; anything else is turned into str.
_SCALARS = (str, int, float, bool, type(None))

# ------------------------------------------------------------ the machinery


_T = TypeVar("_T")


def _keyword_only(*, default: _T, kw_only: bool) -> _T:
    """Field specifier (PEP 681) for the one keyword-only parameter, ``message``."""
    del kw_only  # read by type checkers only
    return default


class _Message:
    """``err.message``: the text given to the constructor, or the generated one when it got None.

    A descriptor so that the constructor parameter (``str | None``) and the
    attribute (always ``str``) can differ in type, which a type checker
    reads from ``__set__`` and ``__get__``.
    """

    @overload
    def __get__(self, obj: None, owner: type[object]) -> Self: ...
    @overload
    def __get__(self, obj: TensorWasmError, owner: type[object]) -> str: ...
    def __get__(self, obj: TensorWasmError | None, owner: type[object]) -> str | Self:
        if obj is None:
            return self
        text: str = obj.__dict__["message"]
        return text

    def __set__(self, obj: TensorWasmError, value: str | None) -> None:
        obj.__dict__["message"] = value if value is not None else obj._default_message()


@dataclass_transform(eq_default=False, field_specifiers=(_keyword_only,))
class _ErrorType(type):
    """The metaclass of the error tree; it only tells type checkers what ``__init_subclass__`` builds.

    ``dataclass_transform`` on a metaclass (rather than on the root class)
    makes the root's own ``message`` field count, so every generated
    constructor is seen with its trailing ``*, message: str | None = None``.
    """


#: the default of a field that has none (a required constructor parameter)
_REQUIRED: Final = object()


def _declared_fields(cls: type) -> dict[str, tuple[object, object]]:
    """The fields ``cls`` itself declares (annotated, not ``ClassVar``): name -> (annotation, default).

    Every other annotated name is a field to a type checker too, so one that
    cannot be a public constructor parameter is refused here, not skipped.
    """
    own: dict[str, tuple[object, object]] = {}
    for name, annotation in inspect.get_annotations(cls).items():
        text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
        if text.startswith(("ClassVar", "typing.ClassVar")) or name == "message":
            continue
        if name.startswith("_") or not name.isidentifier() or keyword.iskeyword(name) or name == "self":
            raise TypeError(f"{cls.__name__}: {name!r} cannot be an error field (annotate a class constant ClassVar)")
        own[name] = (annotation, cls.__dict__.get(name, _REQUIRED))
    return own


def _make_init(cls: type[TensorWasmError], fields: Mapping[str, tuple[object, object]]) -> Callable[..., None]:
    """The constructor a dataclass would get: ``(self, *fields, message=None)``.

    Written as source and compiled once per class, as ``dataclasses`` and
    attrs do, so that it binds its arguments as fast as a hand-written
    ``__init__`` does, with Python's own ``TypeError`` for a missing or
    unexpected one, and ``inspect.signature`` shows the real parameters.
    Defaults are passed by reference (``_defaults``), never as text.
    """
    defaults = {name: default for name, (_, default) in fields.items() if default is not _REQUIRED}
    params = [f"{name}=_defaults[{name!r}]" if name in defaults else name for name in fields]
    params.append("*, message=None")
    body = "".join(f"    self.{name} = {name}\n" for name in fields)
    source = f"def __init__(self, {', '.join(params)}):\n{body}    _root_init(self, message)\n"
    namespace: dict[str, object] = {"_defaults": defaults, "_root_init": TensorWasmError.__init__}
    try:
        exec(source, namespace)
    except SyntaxError as exc:  # a required field after one with a default
        raise TypeError(f"{cls.__name__}: {exc.msg}") from None
    init = cast("Callable[..., None]", namespace["__init__"])
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__annotations__ = {name: annotation for name, (annotation, _) in fields.items()}
    init.__annotations__.update(message="str | None", **{"return": "None"})
    return init


# ---------------------------------------------------------------- the root


class TensorWasmError(Exception, metaclass=_ErrorType):
    """Root of every error raised by tensor-wasm-tenant.

    Subclasses declare ``code`` (stable, used on the wire), ``retryable``,
    their fields (annotated class attributes: the constructor's parameters,
    all carried over the wire) and a ``_template`` for the message. The
    keyword ``message`` overrides the generated text when given.
    """

    code: ClassVar[str] = "internal"
    retryable: ClassVar[bool] = False
    #: the wire fields, in constructor order (written by ``__init_subclass__``)
    _fields: ClassVar[tuple[str, ...]] = ()
    #: ``str.format`` text with the fields by name; "" = the docstring's first line
    _template: ClassVar[str] = ""
    message: _Message = _keyword_only(default=_Message(), kw_only=True)

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        code = cls.__dict__.get("code")
        if code is not None:
            if code in _BY_CODE and _BY_CODE[code] is not cls:
                raise TypeError(f"wire code {code!r} already used by {_BY_CODE[code].__name__}")
            _BY_CODE[code] = cls
        own = _declared_fields(cls)
        if not own:
            return  # the constructor and fields of its base serve
        fields: dict[str, tuple[object, object]] = {}
        for base in reversed(cls.__mro__[1:]):  # dataclass order: a redeclared field keeps its place
            if issubclass(base, TensorWasmError) and base is not TensorWasmError:
                fields.update(_declared_fields(base))
        fields.update(own)
        cls._fields = tuple(fields)
        setattr(cls, "__match_args__", cls._fields)  # noqa: B010 - mypy refuses the plain assignment (PEP 681)
        if "__init__" not in cls.__dict__:
            setattr(cls, "__init__", _make_init(cls, fields))  # noqa: B010 - mypy: cannot assign to a method

    def __init__(self, message: str | None = None) -> None:
        self.message = message
        super().__init__(self.message)

    def _default_message(self) -> str:
        if self._template:
            return self._template.format_map(vars(self))  # the fields, set by now
        return self.__class__.__doc__.strip().splitlines()[0] if self.__class__.__doc__ else self.code

    @classmethod
    def _variant(cls, fields: Mapping[str, object]) -> type[TensorWasmError]:
        """The class to rebuild a wire record of this code as (a cause's subclass, see :class:`Overloaded`)."""
        del fields
        return cls

    def is_retryable(self) -> bool:
        """True when the same request may succeed later without any change."""
        return self.retryable

    def fields(self) -> dict[str, object]:
        """The typed fields of this error (the constructor's parameters)."""
        return {name: getattr(self, name) for name in self._fields}

    def to_dict(self) -> dict[str, object]:
        """A plain, msgpack-able dict: ``{"code", "message", "fields"}``."""
        fields = {}
        for name, value in self.fields().items():
            fields[name] = value if isinstance(value, _SCALARS) else str(value)
        return {"code": self.code, "message": self.message, "fields": fields}

    def __reduce__(self) -> tuple[object, ...]:
        # Exceptions with keyword-only constructors do not pickle by default.
        return (error_from_dict, (self.to_dict(),))

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, TensorWasmError)
        return self.message == other.message and self.fields() == other.fields()

    def __hash__(self) -> int:
        return hash((type(self), self.message))


_BY_CODE[TensorWasmError.code] = TensorWasmError


def _n(value: int | None) -> str:
    return "none" if value is None else f"{value:,}"


# ---------------------------------------------------------------- the tree


class MemoryExhausted(TensorWasmError):
    """The tenant's host (CPU) byte quota would be exceeded.

    Release memory or ask an operator to raise the quota (``twt set-quota``).
    """

    code = "memory_exhausted"
    retryable = True
    _what: ClassVar[str] = "memory quota"
    tenant_id: str
    requested: int
    limit: int
    current: int

    def is_retryable(self) -> bool:
        """Retrying helps only when the request fits the limit at all: more than the whole limit never will."""
        requested, limit = self.requested, self.limit
        if isinstance(requested, int) and isinstance(limit, int) and requested > limit:
            return False
        return self.retryable

    def _default_message(self) -> str:
        return (
            f"tenant {self.tenant_id!r}: {self._what} exhausted: requested {_n(self.requested)} B "
            f"with {_n(self.current)} B in use of a {_n(self.limit)} B limit"
        )


class GpuMemoryExhausted(MemoryExhausted):
    """The tenant's GPU byte cap, the device budget or the driver refused an allocation.

    Free GPU buffers, or raise ``gpu_memory_bytes_cap``. Catching
    :class:`MemoryExhausted` also catches this (both are quota refusals).
    """

    code = "gpu_memory_exhausted"
    _what = "GPU memory cap"


class TenantIsolationViolation(TensorWasmError, PermissionError):
    """A capability was forged, truncated, of the wrong kind, or not minted by this registry.

    Always a security signal: the request touched nothing. ``reason`` says which, in
    the words of the ``denied`` audit event (:data:`ISOLATION_REASONS`), so the audit
    and clients classify a refusal by a field, never by its message text.
    """

    code = "isolation_violation"
    tenant_id: str | None
    resource: str
    reason: str = "other"

    def _default_message(self) -> str:
        who = f"tenant {self.tenant_id!r}" if self.tenant_id else "caller"
        return f"isolation violation: {who} denied access to {self.resource}"


#: every ``TenantIsolationViolation.reason`` (the ``denied`` event's ``reason``, docs/SECURITY.md)
ISOLATION_REASONS: Final = ("missing", "malformed", "truncated", "wrong_kind", "foreign", "forged", "revoked",
                            "unknown_tenant", "other")


class CapabilityRevoked(TenantIsolationViolation):
    """The capability was valid once: its registration was evicted, or the registry key rotated.

    ``resource`` names what ended it: the capability's own (evicted)
    generation, or the key rotation. On the wire its code is
    ``capability_revoked``, never its parent's ``isolation_violation``.
    """

    code = "capability_revoked"
    reason: str = "revoked"

    def _default_message(self) -> str:
        # ``resource`` is the revoked capability's own generation, never a newer one: a new
        # registration of the name may not exist, and its capability comes from the operator
        who = f"capability for tenant {self.tenant_id!r}"
        if str(self.resource).startswith("generation"):
            return (f"{who} was revoked: its registration ({self.resource}) was evicted; a later registration "
                    f"of that name, if there is one, has a capability of its own (twt capability {self.tenant_id})")
        return (f"{who} was revoked ({self.resource}): every capability minted before is void; the new admin "
                "capability is in admin/admin.cap, a tenant's comes from twt capability NAME")


class CudaError(TensorWasmError):
    """A CUDA driver call returned an error; ``result_name`` is the driver's name for it."""

    code = "cuda_error"
    _template = "{call} failed: {result_name} ({result_code})"
    call: str
    result_name: str
    result_code: int


class WasmTrap(TensorWasmError):
    """The guest trapped (unreachable, out-of-bounds, stack overflow, fuel exhausted ...).

    The run ended; the worker is fine and serves the next run.
    """

    code = "wasm_trap"
    trap_code: str
    detail: str = ""
    #: where: the guest's frames, innermost first, ``func+0xOFF`` and ``(file:line:col)`` with DWARF
    location: str = ""
    #: the run's fuel budget, for ``out_of_fuel`` (None otherwise)
    fuel_limit: int | None = None

    def _default_message(self) -> str:
        return (f"wasm trap {self.trap_code}" + (f": {self.detail}" if self.detail else "")
                + (f" at {self.location}" if self.location else ""))


class WasmCompile(TensorWasmError):
    """The module failed to parse, validate or link (only ``tensorwasm`` imports exist)."""

    code = "wasm_compile"
    _template = "wasm module rejected: {detail}"
    detail: str


class KernelTimeout(TensorWasmError, TimeoutError):
    """A run or request exceeded its deadline and was stopped."""

    code = "kernel_timeout"
    retryable = True
    _template = "{op} exceeded its deadline of {timeout_s:g} s and was stopped"
    timeout_s: float
    op: str = "run_wasm"


class WorkerLost(TensorWasmError):
    """The worker serving the request died before answering.

    ``exit_code`` is set for a normal exit, ``signal`` when it was killed. The
    supervisor restarts it per the tenant's policy; retrying is safe for
    idempotent requests.
    """

    code = "worker_lost"
    retryable = True
    tenant_id: str
    instance: int
    exit_code: int | None = None
    signal: int | None = None
    reason: str = ""

    def _default_message(self) -> str:
        if self.signal is not None:
            how = f"killed by signal {self.signal}"
        elif self.exit_code is not None:
            how = f"exited with code {self.exit_code}"
        else:
            how = "lost"
        why = f" ({self.reason})" if self.reason else ""
        return f"worker {self.tenant_id}/{self.instance} {how}{why} before answering"


class NodeLost(WorkerLost):
    """The node serving the tenant was lost (cluster mode): its supervisor, workers and buffers are gone.

    Seen through Ray (the node's actor died) or by a client whose connection
    to the node dropped. Retrying is safe: the cluster re-registers tenants
    whose restart policy allows it on a surviving node, and the same cluster
    capability reaches them there. Buffer handles from the lost node are void.
    """

    code = "node_lost"
    instance: int = 0
    node_id: str = ""

    def _default_message(self) -> str:
        why = f" ({self.reason})" if self.reason else ""
        return (
            f"node {self.node_id[:12] or '?'} serving tenant {self.tenant_id!r} was lost{why}; "
            "its buffers are gone - retry (the tenant is re-placed when its restart policy allows)"
        )


class Overloaded(TensorWasmError):
    """A limit of the supervisor refused the request for now; retry after one of the tenant's
    requests completes, or after ``retry_after_s`` seconds when that is set.

    ``cause`` names the limit, and each cause is a subclass with its own fields (the
    numbers of that limit): :class:`InFlightLimit` (``max_in_flight``),
    :class:`WorkerQueueFull`, :class:`HeldBytesLimit`, :class:`ClientRepliesQueued`,
    :class:`AdmissionRate`. All travel as the one wire code ``overloaded``:
    ``tenant_id``, ``in_flight`` (the tenant's requests in flight and parked) and
    ``limit`` (its ``max_in_flight``) are real in every cause, so a client that knows
    only this class reads the same fields as before; ``cause`` picks the subclass.
    """

    code = "overloaded"
    retryable = True
    _template = ("tenant {tenant_id!r} overloaded: {in_flight} requests in flight "
                 "(max_in_flight={limit}); retry later")
    #: cause -> its subclass (written by ``__init_subclass__``; error_from_dict rebuilds by it)
    _causes: ClassVar[dict[str, type[Overloaded]]] = {}
    tenant_id: str
    in_flight: int
    limit: int
    retry_after_s: float | None = None
    #: which limit refused it: one of OVERLOADED_CAUSES, each a subclass; "" (an older supervisor,
    #: which sent no cause) or a cause this side does not know: this class
    cause: str = ""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cause = cls.__dict__.get("cause")
        if isinstance(cause, str):
            Overloaded._causes[cause] = cls

    @classmethod
    def _variant(cls, fields: Mapping[str, object]) -> type[TensorWasmError]:
        cause = fields.get("cause")
        return Overloaded._causes.get(cause, cls) if cls is Overloaded and isinstance(cause, str) else cls


class InFlightLimit(Overloaded):
    """The tenant already has ``limit`` (its ``max_in_flight``) requests in flight or parked."""

    cause: str = "in_flight"


class WorkerQueueFull(Overloaded):
    """The queue to the chosen worker instance is full: ``queued`` requests are in flight on it
    (the supervisor never queues without bound); retry once one completes."""

    _template = ("tenant {tenant_id!r} overloaded: the queue of instance {instance} is full "
                 "({queued} requests in flight on it); retry later")
    cause: str = "worker_queue"
    instance: int = 0
    queued: int = 0


class HeldBytesLimit(Overloaded):
    """The bytes the supervisor holds for tenants (queued replies, parked requests, stored modules)
    would pass a budget: ``held`` of ``budget`` B for ``scope`` ("tenant": this tenant's
    ``max_tenant_held_bytes``, "total": all tenants' ``max_held_bytes``), ``requested`` B more asked."""

    cause: str = "held_bytes"
    scope: str = "tenant"
    held: int = 0
    requested: int = 0
    budget: int = 0

    def _default_message(self) -> str:
        whose = "all tenants together" if self.scope == "total" else "this tenant"
        return (f"the supervisor already holds {self.held:,} B for {whose} (queued replies, parked requests, "
                f"stored modules); {self.requested:,} B more would pass the {self.budget:,} B limit: "
                "read your replies, or retry later")


class ClientRepliesQueued(Overloaded):
    """``queued`` B of big replies to this client are still waiting to be read, past
    ``budget`` (``max_client_reply_bytes``); read them, then retry."""

    _template = ("{queued:,} B of replies to this client are still queued (it is not reading them); "
                 "limit max_client_reply_bytes={budget:,}")
    cause: str = "client_replies"
    queued: int = 0
    budget: int = 0


class AdmissionRate(Overloaded):
    """The tenant sent more ``what`` ("requests" or "bytes") per second than its admission
    allows (``rate``: its ``requests_per_s`` or ``bytes_per_s``); retry after ``retry_after_s``,
    not before: past ``tenant_refusals_per_s`` such answers a second the supervisor drops the
    tenant's refused requests unanswered."""

    cause: str = "rate"
    what: str = "requests"
    rate: float = 0.0

    def _default_message(self) -> str:
        after = "later" if self.retry_after_s is None else f"after {self.retry_after_s:.3g} s"
        return f"tenant {self.tenant_id!r} sent more than its {self.rate:,.0f} {self.what} per second " \
               f"({self.what}_per_s); retry {after}"


#: every cause of :class:`Overloaded`, in the order of the checks a request passes
OVERLOADED_CAUSES: Final = ("rate", "in_flight", "held_bytes", "client_replies", "worker_queue")


class CapacityExhausted(TensorWasmError):
    """The supervisor already holds as many tenants (``what="tenants"``, the ``max_tenants``
    setting) or tenant instances (``what="workers"``, ``max_workers``) as its config allows;
    nothing was registered or scaled. Evict a tenant, or raise the setting (a restart)."""

    code = "capacity_exhausted"
    _template = ("supervisor full: {in_use} {what} of at most {limit}, {wanted} more wanted ({setting}); "
                 "evict a tenant or raise {setting}")
    what: str
    in_use: int
    wanted: int
    limit: int
    setting: str
    #: an activation refused for room (``max_active``): when an active tenant may have parked
    retry_after_s: float | None = None


class Draining(TensorWasmError):
    """The supervisor is stopping (SIGTERM: a rollout, a node drain) and admits no new work; what
    was in flight finishes and is answered. Retry after ``retry_after_s`` seconds - by then its
    replacement serves (or another node: a cluster client re-places the tenant)."""

    code = "draining"
    retryable = True
    _template = ("the supervisor is draining (stopping after its in-flight requests, at most "
                 "{drain_timeout_s:g} s); retry after {retry_after_s:g} s")
    retry_after_s: float
    drain_timeout_s: float


class FaultInjectionDisabled(TensorWasmError):
    """``inject_fault`` was refused: this supervisor runs with ``fault_injection = false`` (the
    production setting); faults are for test and staging supervisors that enable it."""

    code = "fault_injection_disabled"
    _template = "fault injection is disabled on this supervisor (fault_injection = false); {op} refused"
    op: str


class ProtocolError(TensorWasmError, ValueError):
    """A frame was malformed, too large, or violated the message schema."""

    code = "protocol_error"
    _template = "protocol error: {detail}"
    detail: str


class InvalidArgument(TensorWasmError, ValueError):
    """A well-formed request carried an argument the operation cannot accept."""

    code = "invalid_argument"
    _template = "invalid argument: {detail}"
    detail: str


#: what to do when libnvrtc is missing (the worker's tensor ops and the backend probe both say it)
NVRTC_INSTALL_HINT = ("install the 'cuda' extra (pip install 'tensor-wasm-tenant[cuda]', which brings "
                      "nvidia-cuda-nvrtc matching cuda-bindings) or a CUDA toolkit")


class BackendUnavailable(TensorWasmError):
    """The requested compute backend cannot be used here; ``reason`` says why."""

    code = "backend_unavailable"
    _template = "backend {backend!r} unavailable: {reason}"
    backend: str
    reason: str


class TenantFailed(TensorWasmError):
    """The tenant's workers crashed too often (restart intensity exceeded).

    Requests are refused until an operator resets it (``twt reset TENANT``: same capability,
    restart history cleared) or evicts and re-registers it.
    """

    code = "tenant_failed"
    _template = ("tenant {tenant_id!r} failed: {restarts} restarts within {window_s:g} s; "
                 "`twt reset {tenant_id}` starts it again (same capability)")
    tenant_id: str
    restarts: int
    window_s: float


class TenantStopped(TensorWasmError):
    """The tenant is scaled to 0 instances: nothing runs its requests.

    Answered at once, never parked, and not retryable: only ``twt scale`` (or
    the ``scale`` op) brings an instance back. The capability and the quota
    block stay valid meanwhile (``quota`` and ``put_module`` still answer).
    """

    code = "tenant_stopped"
    _template = "tenant {tenant_id!r} is scaled to 0 instances; `twt scale {tenant_id} N` to serve it again"
    tenant_id: str


class BufferLost(TensorWasmError):
    """A buffer handle from an earlier incarnation of its instance: the restart freed the buffer.

    Not retryable: the bytes are gone; allocate again and rewrite them.
    ``handle`` is the text form ``INSTANCE:SEQ`` (:func:`shared.protocol.format_handle`).
    """

    code = "buffer_lost"
    _template = ("buffer {handle} lived on {tenant_id}/{instance}, which restarted "
                 "(now incarnation {incarnation}); its bytes are gone: alloc again")
    tenant_id: str
    handle: str
    instance: int
    incarnation: int


class RequestTimeout(TensorWasmError, TimeoutError):
    """No reply arrived within the client's timeout (the supervisor may still be busy)."""

    code = "request_timeout"
    retryable = True
    _template = "no reply to {op!r} within {timeout_s:g} s"
    op: str
    timeout_s: float


class RunDirLocked(TensorWasmError):
    """Another supervisor is running on this run directory."""

    code = "run_dir_locked"
    run_dir: str
    pid: int | None

    def _default_message(self) -> str:
        who = f" (pid {self.pid})" if self.pid else ""
        return f"another supervisor{who} is running on {self.run_dir}; stop it or use another --run-dir"


class SupervisorUnavailable(TensorWasmError, ConnectionError):
    """No running supervisor could be reached at the given run directory."""

    code = "supervisor_unavailable"
    retryable = True
    _template = "no supervisor at {run_dir}: {reason}"
    run_dir: str
    reason: str


class UntrustedRunDir(TensorWasmError, PermissionError):
    """A run directory, socket or file is not owned by the expected user (or is open to others).

    A client refuses it before sending anything: whoever controls that path
    would receive the capabilities, modules and data sent to it, and could
    answer with forged results. Check who created the directory (the default
    ``/tmp/twt-<uid>`` can be pre-created by another user), remove it, and
    start the supervisor again, or pass a run dir under ``$XDG_RUNTIME_DIR``.
    """

    code = "untrusted_run_dir"
    _template = "refusing {path}: {reason}"
    path: str
    reason: str


class HandshakeFailed(TensorWasmError, ConnectionError):
    """The CURVE handshake with a remote supervisor failed.

    The server key given is not the supervisor's (``twt keys`` prints the
    right one), the peer does not speak CURVE (a plaintext endpoint), or the
    supervisor's allow-list (``client_keys_dir``) does not hold our client key.
    Not retryable: the same keys fail the same way.
    """

    code = "handshake_failed"
    _template = ("CURVE handshake with {endpoint} failed: {reason}; check the server public key "
                 "(twt keys on that host) and the client allow-list")
    endpoint: str
    reason: str


class SegmentError(TensorWasmError):
    """A quota shared-memory segment is missing, closed, or not of our layout - or cannot be made:
    ``/dev/shm`` has no room for it (its pages are reserved before first use), or it was truncated."""

    code = "segment_error"
    _template = "shared-memory segment {name!r}: {detail}"
    name: str
    detail: str


class StateError(TensorWasmError):
    """The supervisor's state database cannot be used as it is (corrupt, newer schema, in use).

    Raised at start-up; the supervisor stops without touching the file, so the
    operator can inspect it, restore a backup, or move it away for a first
    start. ``path`` names the file, ``detail`` the problem. Also the answer to an
    admin op that cannot be written (a full disk): the op was then not applied.
    """

    code = "state_error"
    _template = "state database {path}: {detail}"
    path: str
    detail: str


class ConfigError(TensorWasmError, ValueError):
    """A configuration with mistakes: a config file, the environment, or a reload that cannot be applied.

    ``path`` names where (a file, ``environment``), ``detail`` every problem found
    (joined with ``; ``). At start the supervisor does not start; on ``twt reload``
    or SIGHUP nothing was changed and it keeps running with what it had. A
    ``ValueError`` too, so the CLI reports it as bad usage (exit 2). The one class
    for all three: :meth:`listing` builds the multi-line message a person reads.
    """

    code = "config_error"
    _template = "config {path}: {detail}"
    path: str
    detail: str

    @classmethod
    def listing(cls, where: str, problems: list[str]) -> ConfigError:
        """Every problem of ``where`` at once: one line for one, a list for several."""
        if len(problems) == 1:
            text = f"{where}: {problems[0]}"
        else:
            text = f"{where} has {len(problems)} mistakes:\n" + "\n".join(f"  - {p}" for p in problems)
        return cls(where, "; ".join(problems), message=text)


class RegistryError(TensorWasmError):
    """Base of the registry's lifecycle errors."""

    code = "registry_error"
    tenant_id: str


class AlreadyRegistered(RegistryError, ValueError):
    """A tenant of that name is already registered; evict it first or pick another name."""

    code = "already_registered"
    _template = "tenant {tenant_id!r} is already registered"


class UnknownTenant(RegistryError, LookupError):
    """No tenant of that name is registered."""

    code = "unknown_tenant"
    _template = "unknown tenant {tenant_id!r}"


class UnknownModule(RegistryError, LookupError):
    """``run_wasm`` named a module digest that was never sent with ``put_module``."""

    code = "unknown_module"
    _template = "tenant {tenant_id!r}: no module with digest {digest} (send it with put_module)"
    digest: str


class CapabilityFromForeignRegistry(RegistryError):
    """(``*_strict`` methods) the capability was minted by another registry."""

    code = "foreign_capability"
    _template = ("capability for {tenant_id!r} was minted by registry {actual_registry}, "
                 "not by this registry {expected_registry}")
    expected_registry: str
    actual_registry: str


# ------------------------------------------------------------- the wire


def error_class_for_code(code: str) -> type[TensorWasmError]:
    """The class for a wire code; unknown codes map to the root class."""
    return _BY_CODE.get(code, TensorWasmError)


def error_from_dict(data: object) -> TensorWasmError:
    """Rebuild an error from :meth:`TensorWasmError.to_dict` output.

    Untrusted input never raises here: a dict that does not fit its class's
    constructor becomes a root :class:`TensorWasmError` with the message kept.
    """
    if not isinstance(data, Mapping):
        return TensorWasmError(f"malformed error record: {data!r:.200}")
    code = data.get("code")
    message = data.get("message")
    fields = data.get("fields")
    if not isinstance(message, str):
        message = None
    if not isinstance(code, str) or not isinstance(fields, Mapping):
        return TensorWasmError(message or f"malformed error record: {dict(data)!r:.200}")
    cls = error_class_for_code(code)
    if cls is TensorWasmError:
        return TensorWasmError(message or f"unknown error code {code!r}")
    cls = cls._variant(fields)
    try:
        kwargs = {name: fields[name] for name in cls._fields if name in fields}
        return cls(**kwargs, message=message)
    except (TypeError, ValueError):
        return TensorWasmError(message or f"error {code!r} with unusable fields")
