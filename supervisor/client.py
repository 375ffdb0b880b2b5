"""SupervisorClient: typed calls to a running supervisor, found by its run directory.

    with SupervisorClient("/tmp/twt-1000") as c:
        acme = c.register(c.admin, TenantSpec("acme").with_gpu_memory_bytes_cap("1GiB"))
        h = c.alloc(acme, 1 << 20)
        c.write(acme, h, b"\\0" * 1024)

Remote errors are raised as the same classes with the same fields
(``GpuMemoryExhausted.requested`` ...). Every call has a timeout
(:class:`RequestTimeout`); a missing supervisor is
:class:`SupervisorUnavailable`. One client is one DEALER socket: use one
client per thread (calls on one client from several threads are serialised).
For pipelining, :meth:`send` and :meth:`recv` expose the raw request/reply.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
import time
from collections.abc import Generator, Sequence
from typing import Any

import psutil
import zmq

from shared import protocol as proto
from shared.capability import RegistryAdminCapability, TenantCapability
from shared.errors import (
    InvalidArgument,
    ProtocolError,
    RequestTimeout,
    SupervisorUnavailable,
    TensorWasmError,
    error_from_dict,
)
from shared.spec import TenantSpec
from supervisor.events import TOPIC_PREFIX, decode_event
from supervisor.rundir import read_admin_capability, read_ready, verify_run_dir

__all__ = ["SupervisorClient"]

_UNCHANGED: Any = object()
Capability = TenantCapability | RegistryAdminCapability


def _cap_bytes(cap: Capability | bytes | None) -> bytes | None:
    if cap is None or isinstance(cap, bytes):
        return cap
    return cap.to_bytes()


class SupervisorClient:
    """A connection to the supervisor whose run directory is ``run_dir``."""

    def __init__(self, run_dir: str, *, timeout_s: float = 30.0, check: bool = True,
                 expected_uid: int | None = None) -> None:
        """``expected_uid``: who must own the run dir, its sockets and files (default:
        this process's uid); anything else is refused with :class:`UntrustedRunDir`
        before a byte is sent."""
        self.run_dir = os.path.abspath(run_dir)
        self.timeout_s = timeout_s
        self._expected_uid = os.getuid() if expected_uid is None else expected_uid
        info = read_ready(self.run_dir, self._expected_uid)
        if check:
            if info is None:
                raise SupervisorUnavailable(self.run_dir, "no supervisor.json (not running, or not ready yet)")
            pid = info.get("pid")
            if not isinstance(pid, int) or not psutil.pid_exists(pid):
                raise SupervisorUnavailable(self.run_dir, f"supervisor pid {pid} is not running (stale run dir)")
        self.info = info or {}
        verify_run_dir(self.run_dir, self._expected_uid)  # again: the sockets exist now
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 10_000)
        self._sock.setsockopt(zmq.SNDHWM, 10_000)
        self._sock.connect("ipc://" + os.path.join(self.run_dir, "frontend.ipc"))
        self._rids = itertools.count(1)
        self._lock = threading.Lock()
        self._admin: RegistryAdminCapability | None = None
        self._closed = False

    # ----------------------------------------------------------- plumbing

    @property
    def admin(self) -> RegistryAdminCapability:
        """The admin capability from ``<run_dir>/admin/admin.cap`` (read once)."""
        if self._admin is None:
            try:
                self._admin = RegistryAdminCapability.from_bytes(
                    read_admin_capability(self.run_dir, self._expected_uid)
                )
            except FileNotFoundError:
                raise SupervisorUnavailable(self.run_dir, "no admin/admin.cap (not running, or not the operator?)") from None
        return self._admin

    def send(self, op: str, cap: Capability | bytes | None, args: dict[str, Any] | None = None,
             body: bytes | memoryview | None = None) -> int:
        """Send one request without waiting; returns its rid (pair with :meth:`recv`)."""
        rid = next(self._rids)
        header = proto.encode_request(rid, op, _cap_bytes(cap), args or {})
        try:
            if body is None:
                self._sock.send(header, zmq.NOBLOCK)
            else:
                self._sock.send_multipart([header, body], zmq.NOBLOCK, copy=len(body) < 65536)
        except zmq.Again:
            raise RequestTimeout(op, 0, message=f"cannot queue {op!r}: the send queue is full") from None
        return rid

    def recv(self, timeout_s: float | None = None) -> tuple[int, bool, Any, bytes | None]:
        """The next reply: (rid, ok, result-or-error-dict, body). Raises RequestTimeout, or
        ProtocolError for a reply that does not decode and names no request (one that
        names its request comes back as that request's ``protocol_error``)."""
        return self._recv_one(time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s), "recv")

    def _recv_one(self, deadline: float, op: str) -> tuple[int, bool, Any, bytes | None]:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(max(1, int(remaining * 1000))):
                raise RequestTimeout(op, round(self.timeout_s, 3))
            frames = self._sock.recv_multipart()
            try:
                rid, ok, payload = proto.decode_reply(frames[0])
            except ProtocolError as exc:
                # Never silence: the reply is answered as a typed error to whoever waits for it.
                got = proto.peek_rid(frames[0])
                error = ProtocolError(
                    exc.detail,
                    message=f"a reply{'' if got is None else f' to request {got}'} ({len(frames[0]):,} B) "
                    f"could not be decoded: {exc.detail}",
                )
                if got is None:
                    raise error from None
                return got, False, error.to_dict(), None
            return rid, ok, payload, frames[1] if len(frames) > 1 else None

    def request(self, op: str, cap: Capability | bytes | None, args: dict[str, Any] | None = None,
                body: bytes | memoryview | None = None, *, timeout_s: float | None = None) -> tuple[Any, bytes | None]:
        """One call: send, wait for its reply, raise its error. Returns (result, body)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            if self._closed:
                raise SupervisorUnavailable(self.run_dir, "client is closed")
            rid = self.send(op, cap, args, body)
            deadline = time.monotonic() + timeout
            while True:
                try:
                    got, ok, payload, out_body = self._recv_one(deadline, op)
                except RequestTimeout:
                    raise RequestTimeout(op, timeout) from None
                except ProtocolError as exc:  # undecodable and unattributable: ours is the one waiting
                    raise ProtocolError(exc.detail, message=f"{op}: {exc.message}") from None
                if got == rid:
                    break
                # a late reply to an earlier, timed-out request: drop it
        if not ok:
            raise error_from_dict(payload if isinstance(payload, dict) else {"code": "internal", "message": str(payload), "fields": {}})
        return payload, out_body

    def call(self, op: str, cap: Capability | bytes | None, args: dict[str, Any] | None = None, **kw: Any) -> Any:
        return self.request(op, cap, args, **kw)[0]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close(0)

    def __enter__(self) -> SupervisorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- admin

    def hello(self, admin: RegistryAdminCapability | None = None) -> dict[str, Any]:
        """Supervisor identity: pid, registry id, backend (and why), start method, uptime."""
        result: dict[str, Any] = self.call("hello", admin or self.admin)
        return result

    def register(self, admin: RegistryAdminCapability | None, spec: TenantSpec, *,
                 timeout_s: float | None = None) -> TenantCapability:
        """Register a tenant; returns once every instance is ready, with its capability."""
        result = self.call("register", admin or self.admin, {"spec": spec.to_dict()},
                           timeout_s=timeout_s or max(self.timeout_s, 60.0))
        return TenantCapability.from_bytes(result["capability"])

    def tenant_capability(self, admin: RegistryAdminCapability | None, tenant_id: str) -> TenantCapability:
        """The capability of a registered tenant (e.g. one from the config file) to hand to it."""
        result = self.call("capability", admin or self.admin, {"tenant": tenant_id})
        return TenantCapability.from_bytes(result["capability"])

    def evict(self, admin: RegistryAdminCapability | None, tenant_id: str) -> dict[str, Any]:
        """Stop the tenant's workers, revoke its capabilities, unlink its block (returns after the workers exit)."""
        result: dict[str, Any] = self.call("evict", admin or self.admin, {"tenant": tenant_id}, timeout_s=max(self.timeout_s, 30.0))
        return result

    unregister = evict

    def set_quota(self, admin: RegistryAdminCapability | None, tenant_id: str, *,
                  memory_quota_bytes: int | str = _UNCHANGED,
                  gpu_memory_bytes_cap: int | str | None = _UNCHANGED,
                  recorded_cuda_mem_pool_quota: int | str | None = _UNCHANGED) -> dict[str, Any]:
        """Change limits live (omitted ones stay; ``None`` removes the GPU cap)."""
        args: dict[str, Any] = {"tenant": tenant_id}
        for name, value in (("memory_quota_bytes", memory_quota_bytes), ("gpu_memory_bytes_cap", gpu_memory_bytes_cap),
                            ("recorded_cuda_mem_pool_quota", recorded_cuda_mem_pool_quota)):
            if value is not _UNCHANGED:
                args[name] = value
        result: dict[str, Any] = self.call("set_quota", admin or self.admin, args)
        return result

    def status(self, admin: RegistryAdminCapability | None = None) -> dict[str, Any]:
        """``{"supervisor": {...}, "tenants": [one record per tenant]}``."""
        result: dict[str, Any] = self.call("status", admin or self.admin)
        return result

    def tenant_status(self, admin: RegistryAdminCapability | None, tenant_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self.call("tenant_status", admin or self.admin, {"tenant": tenant_id})
        return result

    def scale(self, admin: RegistryAdminCapability | None, tenant_id: str, instances: int) -> dict[str, Any]:
        """Run ``instances`` workers for the tenant (live; scaling down drains first)."""
        result: dict[str, Any] = self.call("scale", admin or self.admin, {"tenant": tenant_id, "instances": instances})
        return result

    def inject_fault(self, admin: RegistryAdminCapability | None, tenant_id: str, kind: str, *,
                     instance: int | None = None, **params: Any) -> dict[str, Any]:
        """Break one worker of a tenant on purpose (docs/RELIABILITY.md lists the kinds).

        Returns once the fault is armed, or - for crash, segfault and exit -
        once the worker process is gone.
        """
        args: dict[str, Any] = {"tenant": tenant_id, "kind": kind, "params": params}
        if instance is not None:
            args["instance"] = instance
        result: dict[str, Any] = self.call("inject_fault", admin or self.admin, args)
        return result

    def reload(self, admin: RegistryAdminCapability | None = None) -> dict[str, Any]:
        """Read the supervisor's config file again and apply the difference (as SIGHUP does).

        Returns ``{registered, changed, evicted, unchanged, conflicts, settings_not_applied}``;
        a file that cannot be applied raises :class:`~shared.errors.ConfigError` and changes nothing.
        """
        result: dict[str, Any] = self.call("reload", admin or self.admin, timeout_s=max(self.timeout_s, 60.0))
        return result

    def reset(self, admin: RegistryAdminCapability | None, tenant_id: str) -> dict[str, Any]:
        """Clear a failed tenant and start its instances (same capability); returns once they are ready."""
        result: dict[str, Any] = self.call("reset", admin or self.admin, {"tenant": tenant_id},
                                           timeout_s=max(self.timeout_s, 60.0))
        return result

    def restart_tenant(self, admin: RegistryAdminCapability | None, tenant_id: str) -> dict[str, Any]:
        """Restart a tenant's instances one at a time (new processes, same capability); returns when done."""
        result: dict[str, Any] = self.call("restart", admin or self.admin, {"tenant": tenant_id},
                                           timeout_s=max(self.timeout_s, 120.0))
        return result

    def rotate_key(self, admin: RegistryAdminCapability | None = None) -> RegistryAdminCapability:
        """Replace the registry key: every capability is revoked; returns the new admin capability
        (also written to ``admin.cap``, and used by this client from now on)."""
        result = self.call("rotate_key", admin or self.admin)
        new = RegistryAdminCapability.from_bytes(result["admin_capability"])
        self._admin = new
        return new

    # ------------------------------------------------------------- tenant

    def ping(self, cap: TenantCapability) -> dict[str, Any]:
        result: dict[str, Any] = self.call("ping", cap)
        return result

    def quota(self, cap: TenantCapability) -> dict[str, Any]:
        """The tenant's own quota snapshot (answered by the supervisor from shared memory)."""
        result: dict[str, Any] = self.call("quota", cap)
        return result

    def alloc(self, cap: TenantCapability, nbytes: int, instance: int | None = None) -> int:
        """A device buffer of ``nbytes``; returns its handle. GpuMemoryExhausted when refused.

        ``instance``: allocate on that instance of the tenant (buffers a run
        uses together must live on one instance); default: the least loaded.
        """
        args: dict[str, Any] = {"nbytes": nbytes}
        if instance is not None:
            args["instance"] = instance
        return int(self.call("alloc", cap, args)["handle"])

    def free(self, cap: TenantCapability, handle: int) -> int:
        return int(self.call("free", cap, {"handle": handle})["freed"])

    def write(self, cap: TenantCapability, handle: int, data: bytes | bytearray | memoryview, offset: int = 0) -> int:
        return int(self.call("write", cap, {"handle": handle, "offset": offset}, body=memoryview(data))["written"])

    def read(self, cap: TenantCapability, handle: int, nbytes: int, offset: int = 0) -> bytes:
        _, body = self.request("read", cap, {"handle": handle, "offset": offset, "nbytes": nbytes})
        return body or b""

    def buffers(self, cap: TenantCapability) -> dict[int, int]:
        """handle -> size of the tenant's live buffers (across instances)."""
        result = self.call("buffers", cap)
        return {int(h): int(n) for h, n in result["buffers"]}

    def put_module(self, cap: TenantCapability, module: bytes) -> str:
        """Upload a WASM module once; later ``run_wasm`` calls can name it by digest."""
        return str(self.call("put_module", cap, {}, body=module)["digest"])

    def run_wasm(self, cap: TenantCapability, module: bytes | str, export: str,
                 args: Sequence[Any] = (), *, fuel: int | None = None, timeout_s: float | None = None,
                 request_timeout_s: float | None = None) -> dict[str, Any]:
        """Run ``export`` of a module (bytes, WAT text as bytes, or a digest from :meth:`put_module`).

        ``args`` items are ints, floats or ``{"handle": h}`` buffer references.
        Returns ``{"results", "fuel_used", "elapsed_s"}``.
        """
        req: dict[str, Any] = {"export": export, "args": [_wasm_arg(a) for a in args]}
        if fuel is not None:
            req["fuel"] = fuel
        if timeout_s is not None:
            req["timeout_s"] = timeout_s
        body: bytes | None = None
        if isinstance(module, str):
            req["digest"] = module
        else:
            body = bytes(module)
            req["digest"] = hashlib.sha256(body).hexdigest()
        wait = request_timeout_s or max(self.timeout_s, (timeout_s or 0) + 10.0)
        result: dict[str, Any] = self.call("run_wasm", cap, req, body=body, timeout_s=wait)
        return result

    # ------------------------------------------------------------- events

    def events(self, kinds: Sequence[str] = (), *, timeout_s: float | None = None) -> Generator[dict[str, Any], None, None]:
        """Follow lifecycle events (``kinds`` filters; ``timeout_s`` ends quietly after silence)."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        for kind in kinds or [""]:
            sub.setsockopt(zmq.SUBSCRIBE, TOPIC_PREFIX + kind.encode())
        verify_run_dir(self.run_dir, self._expected_uid)
        sub.connect("ipc://" + os.path.join(self.run_dir, "events.ipc"))
        try:
            while True:
                if not sub.poll(int(timeout_s * 1000) if timeout_s is not None else -1):
                    return
                try:
                    yield decode_event(sub.recv_multipart())
                except (ValueError, TensorWasmError):
                    continue
        finally:
            sub.close(0)


def _wasm_arg(value: Any) -> Any:
    if isinstance(value, bool):
        raise InvalidArgument("wasm arguments are ints, floats or {'handle': h}, not bool")
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, dict) and set(value) == {"handle"}:
        return value
    raise InvalidArgument(f"unsupported wasm argument {value!r}: use ints, floats or {{'handle': h}}")
