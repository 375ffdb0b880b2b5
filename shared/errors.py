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
    +-- Overloaded                   too many requests in flight         retryable
    +-- ProtocolError                malformed or schema-violating frame (ValueError)
    +-- InvalidArgument              well-formed request, bad argument   (ValueError)
    +-- BackendUnavailable           requested backend cannot be used
    +-- TenantFailed                 tenant exceeded its restart intensity
    +-- TenantStopped                tenant scaled to 0 instances
    +-- BufferLost                   the buffer's instance restarted since it was allocated
    +-- RequestTimeout               no reply within the client timeout  retryable (TimeoutError)
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

from typing import Any, ClassVar, Mapping

__all__ = [
    "AlreadyRegistered",
    "BackendUnavailable",
    "BufferLost",
    "CapabilityFromForeignRegistry",
    "CapabilityRevoked",
    "ConfigError",
    "CudaError",
    "GpuMemoryExhausted",
    "HandshakeFailed",
    "InvalidArgument",
    "KernelTimeout",
    "MemoryExhausted",
    "NodeLost",
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
    "error_class_for_code",
    "error_from_dict",
]

_BY_CODE: dict[str, type[TensorWasmError]] = {}

#: Wire values must be msgpack-able scalars; anything else is turned into str.
_SCALARS = (str, int, float, bool, type(None))


class TensorWasmError(Exception):
    """Root of every error raised by tensor-wasm-tenant.

    Subclasses declare ``code`` (stable, used on the wire), ``retryable`` and
    ``_fields`` (the constructor's keyword arguments, all carried over the
    wire). ``message`` overrides the generated text when given.
    """

    code: ClassVar[str] = "internal"
    retryable: ClassVar[bool] = False
    _fields: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        code = cls.__dict__.get("code")
        if code is not None:
            if code in _BY_CODE and _BY_CODE[code] is not cls:
                raise TypeError(f"wire code {code!r} already used by {_BY_CODE[code].__name__}")
            _BY_CODE[code] = cls

    def __init__(self, message: str | None = None) -> None:
        self.message = message if message is not None else self._default_message()
        super().__init__(self.message)

    def _default_message(self) -> str:
        return self.__class__.__doc__.strip().splitlines()[0] if self.__class__.__doc__ else self.code

    def is_retryable(self) -> bool:
        """True when the same request may succeed later without any change."""
        return self.retryable

    def fields(self) -> dict[str, Any]:
        """The typed fields of this error (the constructor's keyword arguments)."""
        return {name: getattr(self, name) for name in self._fields}

    def to_dict(self) -> dict[str, Any]:
        """A plain, msgpack-able dict: ``{"code", "message", "fields"}``."""
        fields = {}
        for name, value in self.fields().items():
            fields[name] = value if isinstance(value, _SCALARS) else str(value)
        return {"code": self.code, "message": self.message, "fields": fields}

    def __reduce__(self) -> tuple[Any, ...]:
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


class MemoryExhausted(TensorWasmError):
    """The tenant's host (CPU) byte quota would be exceeded.

    Release memory or ask an operator to raise the quota (``twt set-quota``).
    """

    code = "memory_exhausted"
    retryable = True
    _fields = ("tenant_id", "requested", "limit", "current")
    _what: ClassVar[str] = "memory quota"

    def __init__(
        self,
        tenant_id: str,
        requested: int,
        limit: int,
        current: int,
        *,
        message: str | None = None,
    ) -> None:
        self.tenant_id = tenant_id
        self.requested = requested
        self.limit = limit
        self.current = current
        super().__init__(message)

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

    Always a security signal: the request touched nothing.
    """

    code = "isolation_violation"
    _fields = ("tenant_id", "resource")

    def __init__(self, tenant_id: str | None, resource: str, *, message: str | None = None) -> None:
        self.tenant_id = tenant_id
        self.resource = resource
        super().__init__(message)

    def _default_message(self) -> str:
        who = f"tenant {self.tenant_id!r}" if self.tenant_id else "caller"
        return f"isolation violation: {who} denied access to {self.resource}"


class CapabilityRevoked(TenantIsolationViolation):
    """The capability was valid once, but its tenant was evicted (generation bumped)."""

    code = "capability_revoked"

    def _default_message(self) -> str:
        return (
            f"capability for tenant {self.tenant_id!r} was revoked (tenant evicted); "
            f"use the capability returned by the new registration ({self.resource})"
        )


class CudaError(TensorWasmError):
    """A CUDA driver call returned an error; ``result_name`` is the driver's name for it."""

    code = "cuda_error"
    _fields = ("call", "result_name", "result_code")

    def __init__(
        self, call: str, result_name: str, result_code: int, *, message: str | None = None
    ) -> None:
        self.call = call
        self.result_name = result_name
        self.result_code = result_code
        super().__init__(message)

    def _default_message(self) -> str:
        return f"{self.call} failed: {self.result_name} ({self.result_code})"


class WasmTrap(TensorWasmError):
    """The guest trapped (unreachable, out-of-bounds, stack overflow, fuel exhausted ...).

    The run ended; the worker is fine and serves the next run.
    """

    code = "wasm_trap"
    _fields = ("trap_code", "detail")

    def __init__(self, trap_code: str, detail: str = "", *, message: str | None = None) -> None:
        self.trap_code = trap_code
        self.detail = detail
        super().__init__(message)

    def _default_message(self) -> str:
        return f"wasm trap {self.trap_code}" + (f": {self.detail}" if self.detail else "")


class WasmCompile(TensorWasmError):
    """The module failed to parse, validate or link (only ``tensorwasm`` imports exist)."""

    code = "wasm_compile"
    _fields = ("detail",)

    def __init__(self, detail: str, *, message: str | None = None) -> None:
        self.detail = detail
        super().__init__(message)

    def _default_message(self) -> str:
        return f"wasm module rejected: {self.detail}"


class KernelTimeout(TensorWasmError, TimeoutError):
    """A run or request exceeded its deadline and was stopped."""

    code = "kernel_timeout"
    retryable = True
    _fields = ("timeout_s", "op")

    def __init__(self, timeout_s: float, op: str = "run_wasm", *, message: str | None = None) -> None:
        self.timeout_s = timeout_s
        self.op = op
        super().__init__(message)

    def _default_message(self) -> str:
        return f"{self.op} exceeded its deadline of {self.timeout_s:g} s and was stopped"


class WorkerLost(TensorWasmError):
    """The worker serving the request died before answering.

    ``exit_code`` is set for a normal exit, ``signal`` when it was killed. The
    supervisor restarts it per the tenant's policy; retrying is safe for
    idempotent requests.
    """

    code = "worker_lost"
    retryable = True
    _fields: ClassVar[tuple[str, ...]] = ("tenant_id", "instance", "exit_code", "signal", "reason")

    def __init__(
        self,
        tenant_id: str,
        instance: int,
        exit_code: int | None = None,
        signal: int | None = None,
        reason: str = "",
        *,
        message: str | None = None,
    ) -> None:
        self.tenant_id = tenant_id
        self.instance = instance
        self.exit_code = exit_code
        self.signal = signal
        self.reason = reason
        super().__init__(message)

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
    retryable = True
    _fields: ClassVar[tuple[str, ...]] = ("tenant_id", "instance", "exit_code", "signal", "reason", "node_id")

    def __init__(
        self,
        tenant_id: str,
        instance: int = 0,
        exit_code: int | None = None,
        signal: int | None = None,
        reason: str = "",
        node_id: str = "",
        *,
        message: str | None = None,
    ) -> None:
        self.node_id = node_id
        super().__init__(tenant_id, instance, exit_code, signal, reason, message=message)

    def _default_message(self) -> str:
        why = f" ({self.reason})" if self.reason else ""
        return (
            f"node {self.node_id[:12] or '?'} serving tenant {self.tenant_id!r} was lost{why}; "
            "its buffers are gone - retry (the tenant is re-placed when its restart policy allows)"
        )


class Overloaded(TensorWasmError):
    """The tenant already has ``limit`` requests in flight; retry after one completes."""

    code = "overloaded"
    retryable = True
    _fields = ("tenant_id", "in_flight", "limit")

    def __init__(
        self, tenant_id: str, in_flight: int, limit: int, *, message: str | None = None
    ) -> None:
        self.tenant_id = tenant_id
        self.in_flight = in_flight
        self.limit = limit
        super().__init__(message)

    def _default_message(self) -> str:
        return (
            f"tenant {self.tenant_id!r} overloaded: {self.in_flight} requests in flight "
            f"(max_in_flight={self.limit}); retry later"
        )


class ProtocolError(TensorWasmError, ValueError):
    """A frame was malformed, too large, or violated the message schema."""

    code = "protocol_error"
    _fields = ("detail",)

    def __init__(self, detail: str, *, message: str | None = None) -> None:
        self.detail = detail
        super().__init__(message)

    def _default_message(self) -> str:
        return f"protocol error: {self.detail}"


class InvalidArgument(TensorWasmError, ValueError):
    """A well-formed request carried an argument the operation cannot accept."""

    code = "invalid_argument"
    _fields = ("detail",)

    def __init__(self, detail: str, *, message: str | None = None) -> None:
        self.detail = detail
        super().__init__(message)

    def _default_message(self) -> str:
        return f"invalid argument: {self.detail}"


#: what to do when libnvrtc is missing (the worker's tensor ops and the backend probe both say it)
NVRTC_INSTALL_HINT = ("install the 'cuda' extra (pip install 'tensor-wasm-tenant[cuda]', which brings "
                      "nvidia-cuda-nvrtc matching cuda-bindings) or a CUDA toolkit")


class BackendUnavailable(TensorWasmError):
    """The requested compute backend cannot be used here; ``reason`` says why."""

    code = "backend_unavailable"
    _fields = ("backend", "reason")

    def __init__(self, backend: str, reason: str, *, message: str | None = None) -> None:
        self.backend = backend
        self.reason = reason
        super().__init__(message)

    def _default_message(self) -> str:
        return f"backend {self.backend!r} unavailable: {self.reason}"


class TenantFailed(TensorWasmError):
    """The tenant's workers crashed too often (restart intensity exceeded).

    Requests are refused until an operator evicts and re-registers the tenant.
    """

    code = "tenant_failed"
    _fields = ("tenant_id", "restarts", "window_s")

    def __init__(
        self, tenant_id: str, restarts: int, window_s: float, *, message: str | None = None
    ) -> None:
        self.tenant_id = tenant_id
        self.restarts = restarts
        self.window_s = window_s
        super().__init__(message)

    def _default_message(self) -> str:
        return (
            f"tenant {self.tenant_id!r} failed: {self.restarts} restarts within "
            f"{self.window_s:g} s; evict and re-register it"
        )


class TenantStopped(TensorWasmError):
    """The tenant is scaled to 0 instances: nothing runs its requests.

    Answered at once, never parked, and not retryable: only ``twt scale`` (or
    the ``scale`` op) brings an instance back. The capability and the quota
    block stay valid meanwhile (``quota`` and ``put_module`` still answer).
    """

    code = "tenant_stopped"
    _fields = ("tenant_id",)

    def __init__(self, tenant_id: str, *, message: str | None = None) -> None:
        self.tenant_id = tenant_id
        super().__init__(message)

    def _default_message(self) -> str:
        return (f"tenant {self.tenant_id!r} is scaled to 0 instances; "
                f"`twt scale {self.tenant_id} N` to serve it again")


class BufferLost(TensorWasmError):
    """A buffer handle from an earlier incarnation of its instance: the restart freed the buffer.

    Not retryable: the bytes are gone; allocate again and rewrite them.
    ``handle`` is the text form ``INSTANCE:SEQ`` (:func:`shared.protocol.format_handle`).
    """

    code = "buffer_lost"
    _fields = ("tenant_id", "handle", "instance", "incarnation")

    def __init__(self, tenant_id: str, handle: str, instance: int, incarnation: int, *,
                 message: str | None = None) -> None:
        self.tenant_id = tenant_id
        self.handle = handle
        self.instance = instance
        self.incarnation = incarnation
        super().__init__(message)

    def _default_message(self) -> str:
        return (f"buffer {self.handle} lived on {self.tenant_id}/{self.instance}, which restarted "
                f"(now incarnation {self.incarnation}); its bytes are gone: alloc again")


class RequestTimeout(TensorWasmError, TimeoutError):
    """No reply arrived within the client's timeout (the supervisor may still be busy)."""

    code = "request_timeout"
    retryable = True
    _fields = ("op", "timeout_s")

    def __init__(self, op: str, timeout_s: float, *, message: str | None = None) -> None:
        self.op = op
        self.timeout_s = timeout_s
        super().__init__(message)

    def _default_message(self) -> str:
        return f"no reply to {self.op!r} within {self.timeout_s:g} s"


class RunDirLocked(TensorWasmError):
    """Another supervisor is running on this run directory."""

    code = "run_dir_locked"
    _fields = ("run_dir", "pid")

    def __init__(self, run_dir: str, pid: int | None, *, message: str | None = None) -> None:
        self.run_dir = run_dir
        self.pid = pid
        super().__init__(message)

    def _default_message(self) -> str:
        who = f" (pid {self.pid})" if self.pid else ""
        return f"another supervisor{who} is running on {self.run_dir}; stop it or use another --run-dir"


class SupervisorUnavailable(TensorWasmError, ConnectionError):
    """No running supervisor could be reached at the given run directory."""

    code = "supervisor_unavailable"
    retryable = True
    _fields = ("run_dir", "reason")

    def __init__(self, run_dir: str, reason: str, *, message: str | None = None) -> None:
        self.run_dir = run_dir
        self.reason = reason
        super().__init__(message)

    def _default_message(self) -> str:
        return f"no supervisor at {self.run_dir}: {self.reason}"


class UntrustedRunDir(TensorWasmError, PermissionError):
    """A run directory, socket or file is not owned by the expected user (or is open to others).

    A client refuses it before sending anything: whoever controls that path
    would receive the capabilities, modules and data sent to it, and could
    answer with forged results. Check who created the directory (the default
    ``/tmp/twt-<uid>`` can be pre-created by another user), remove it, and
    start the supervisor again, or pass a run dir under ``$XDG_RUNTIME_DIR``.
    """

    code = "untrusted_run_dir"
    _fields = ("path", "reason")

    def __init__(self, path: str, reason: str, *, message: str | None = None) -> None:
        self.path = path
        self.reason = reason
        super().__init__(message)

    def _default_message(self) -> str:
        return f"refusing {self.path}: {self.reason}"


class HandshakeFailed(TensorWasmError, ConnectionError):
    """The CURVE handshake with a remote supervisor failed.

    The server key given is not the supervisor's (``twt keys`` prints the
    right one), the peer does not speak CURVE (a plaintext endpoint), or the
    supervisor's allow-list (``client_keys_dir``) does not hold our client key.
    Not retryable: the same keys fail the same way.
    """

    code = "handshake_failed"
    _fields = ("endpoint", "reason")

    def __init__(self, endpoint: str, reason: str, *, message: str | None = None) -> None:
        self.endpoint = endpoint
        self.reason = reason
        super().__init__(message)

    def _default_message(self) -> str:
        return (
            f"CURVE handshake with {self.endpoint} failed: {self.reason}; check the server public key "
            "(twt keys on that host) and the client allow-list"
        )


class SegmentError(TensorWasmError):
    """A quota shared-memory segment is missing, closed, or not of our layout."""

    code = "segment_error"
    _fields = ("name", "detail")

    def __init__(self, name: str, detail: str, *, message: str | None = None) -> None:
        self.name = name
        self.detail = detail
        super().__init__(message)

    def _default_message(self) -> str:
        return f"shared-memory segment {self.name!r}: {self.detail}"


class StateError(TensorWasmError):
    """The supervisor's state database cannot be used as it is (corrupt, newer schema, in use).

    Raised at start-up; the supervisor stops without touching the file, so the
    operator can inspect it, restore a backup, or move it away for a first
    start. ``path`` names the file, ``detail`` the problem.
    """

    code = "state_error"
    _fields = ("path", "detail")

    def __init__(self, path: str, detail: str, *, message: str | None = None) -> None:
        self.path = path
        self.detail = detail
        super().__init__(message)

    def _default_message(self) -> str:
        return f"state database {self.path}: {self.detail}"


class ConfigError(TensorWasmError, ValueError):
    """The config file cannot be applied (``twt reload``, SIGHUP): nothing was changed.

    ``path`` names the file, ``detail`` every problem found. Fix the file and
    reload again; the supervisor keeps running with what it had.
    """

    code = "config_error"
    _fields = ("path", "detail")

    def __init__(self, path: str, detail: str, *, message: str | None = None) -> None:
        self.path = path
        self.detail = detail
        super().__init__(message)

    def _default_message(self) -> str:
        return f"config {self.path}: {self.detail}; nothing was changed"


class RegistryError(TensorWasmError):
    """Base of the registry's lifecycle errors."""

    code = "registry_error"
    _fields: ClassVar[tuple[str, ...]] = ("tenant_id",)

    def __init__(self, tenant_id: str, *, message: str | None = None) -> None:
        self.tenant_id = tenant_id
        super().__init__(message)


class AlreadyRegistered(RegistryError, ValueError):
    """A tenant of that name is already registered; evict it first or pick another name."""

    code = "already_registered"

    def _default_message(self) -> str:
        return f"tenant {self.tenant_id!r} is already registered"


class UnknownTenant(RegistryError, LookupError):
    """No tenant of that name is registered."""

    code = "unknown_tenant"

    def _default_message(self) -> str:
        return f"unknown tenant {self.tenant_id!r}"


class UnknownModule(RegistryError, LookupError):
    """``run_wasm`` named a module digest that was never sent with ``put_module``."""

    code = "unknown_module"
    _fields = ("tenant_id", "digest")

    def __init__(self, tenant_id: str, digest: str, *, message: str | None = None) -> None:
        self.digest = digest
        super().__init__(tenant_id, message=message)

    def _default_message(self) -> str:
        return f"tenant {self.tenant_id!r}: no module with digest {self.digest} (send it with put_module)"


class CapabilityFromForeignRegistry(RegistryError):
    """(``*_strict`` methods) the capability was minted by another registry."""

    code = "foreign_capability"
    _fields = ("tenant_id", "expected_registry", "actual_registry")

    def __init__(
        self,
        tenant_id: str,
        expected_registry: str,
        actual_registry: str,
        *,
        message: str | None = None,
    ) -> None:
        self.expected_registry = expected_registry
        self.actual_registry = actual_registry
        super().__init__(tenant_id, message=message)

    def _default_message(self) -> str:
        return (
            f"capability for {self.tenant_id!r} was minted by registry {self.actual_registry}, "
            f"not by this registry {self.expected_registry}"
        )


def error_class_for_code(code: str) -> type[TensorWasmError]:
    """The class for a wire code; unknown codes map to the root class."""
    return _BY_CODE.get(code, TensorWasmError)


def error_from_dict(data: Mapping[str, Any]) -> TensorWasmError:
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
    try:
        kwargs = {name: fields[name] for name in cls._fields if name in fields}
        return cls(**kwargs, message=message)
    except (TypeError, ValueError):
        return TensorWasmError(message or f"error {code!r} with unusable fields")
