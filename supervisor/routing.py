"""Tenant requests: capability check, back-pressure, instance choice, forwarding, deadlines.

A request names no worker: the supervisor picks the least-loaded ready
instance of the capability's tenant, or the instance that holds the buffer
handle it names. When no instance is ready (a restart is under way) the
request is parked, bounded by ``max_in_flight`` and its deadline, and sent as
soon as one is.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import zmq

from shared import protocol as proto
from shared.capability import TenantCapability
from shared.errors import (
    InvalidArgument,
    Overloaded,
    TenantFailed,
    TenantIsolationViolation,
    TensorWasmError,
    UnknownModule,
    UnknownTenant,
)
from shared.log import get_logger
from supervisor.core import (
    _HANDLE_OPS,
    DEADLINE_GRACE_S,
    MAX_MODULE_BYTES_PER_TENANT,
    MAX_MODULES_PER_TENANT,
    _Core,
)

#: the largest module run_wasm/put_module accept (the worker's own cap too):
#: compiling is not under the run's deadline, so it must stay bounded
MAX_MODULE_BYTES = 32 << 20
from supervisor.tenants import InstanceSlot, Parked, TenantRuntime, TenantState
from supervisor.workers import (
    Pending,
)

__all__: list[str] = []  # an internal layer of Supervisor (supervisor.router)

_log = get_logger("supervisor")


class _Routing(_Core):
    """Tenant requests to workers (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: raw capability bytes -> the tenant runtime they were verified for
        self._verified_caps: dict[bytes, TenantRuntime] = {}

    def _tenant_request(
        self, client: bytes, rid: int, op: str, cap_raw: bytes | None, args: dict[str, Any], body: Any
    ) -> None:
        if cap_raw is None:
            raise TenantIsolationViolation(None, f"op {op!r} (no capability)")
        # Fast path: these exact bytes were verified for this very tenant runtime
        # (an eviction replaces the runtime, so a revoked token misses here).
        rt = self._verified_caps.get(cap_raw)
        if rt is None or self.tenants.get(rt.tenant_id) is not rt:
            tid = self.registry.verify(TenantCapability.from_bytes(cap_raw))
            rt = self.tenants.get(tid)
            if rt is None or rt.state is TenantState.EVICTING:
                raise UnknownTenant(tid)
            if len(self._verified_caps) >= 65536:
                self._verified_caps.clear()
            self._verified_caps[cap_raw] = rt
        tid = rt.tenant_id
        if op == "quota":
            self._reply(client, rid, rt.block.snapshot().to_dict())
            self.metrics.request_done(tid, op, "ok", 0.0)
            return
        if op == "put_module":
            self._reply(client, rid, {"digest": self._put_module(rt, body)})
            self.metrics.request_done(tid, op, "ok", 0.0)
            return
        if body is not None and op in ("run_wasm", "put_module") and len(body) > MAX_MODULE_BYTES:
            raise InvalidArgument(f"module of {len(body):,} B exceeds the {MAX_MODULE_BYTES:,}-byte limit")
        if op == "run_wasm" and body is None:
            digest = args.get("digest")
            stored = rt.modules.get(digest) if isinstance(digest, str) else None
            if stored is None or not isinstance(digest, str):
                raise UnknownModule(tid, str(digest))
            rt.modules.move_to_end(digest)
            body = stored
        if rt.state is TenantState.FAILED:
            raise TenantFailed(tid, len(rt.restart_times), rt.spec.restart_window_s)
        if rt.in_flight + len(rt.parked) >= rt.spec.max_in_flight:
            raise Overloaded(tid, rt.in_flight + len(rt.parked), rt.spec.max_in_flight)
        pinned = self._pinned_instance(rt, op, args)
        slot = self._slot_for(rt, pinned)
        now = time.monotonic()
        if slot is None:
            if pinned is not None and (pinned >= len(rt.slots) or rt.slots[pinned].draining):
                raise InvalidArgument(f"buffer handle names instance {pinned}, which {tid!r} does not run")
            # no ready instance (restarting / starting): wait for one, bounded
            rt.parked.append(Parked(client, rid, op, args, body, now, now + self._deadline_s(rt, op, args), pinned))
            return
        self._forward(rt, slot, client, rid, op, args, body, now)

    def _put_module(self, rt: TenantRuntime, body: Any) -> str:
        """Keep a tenant's module (bounded LRU) so runs can name it by digest."""
        if body is None:
            raise InvalidArgument("put_module needs the module bytes as the body frame")
        data = body.bytes if isinstance(body, zmq.Frame) else bytes(body)
        if not data:
            raise InvalidArgument("put_module: empty module")
        digest = hashlib.sha256(data).hexdigest()
        rt.modules[digest] = data
        rt.modules.move_to_end(digest)
        while (
            len(rt.modules) > MAX_MODULES_PER_TENANT or sum(map(len, rt.modules.values())) > MAX_MODULE_BYTES_PER_TENANT
        ):
            rt.modules.popitem(last=False)
        return digest

    def _pinned_instance(self, rt: TenantRuntime, op: str, args: dict[str, Any]) -> int | None:
        if op in _HANDLE_OPS:
            handle = args.get("handle")
            if isinstance(handle, bool) or not isinstance(handle, int) or handle < 0:
                raise InvalidArgument("handle must be a non-negative int")
            return proto.handle_instance(handle)
        if op == "run_wasm":
            found = {
                proto.handle_instance(a["handle"])
                for a in args.get("args") or ()
                if isinstance(a, dict) and isinstance(a.get("handle"), int) and not isinstance(a.get("handle"), bool)
            }
            if len(found) > 1:
                raise InvalidArgument("run_wasm buffer arguments live on different instances")
            return found.pop() if found else None
        return None

    def _slot_for(self, rt: TenantRuntime, pinned: int | None) -> InstanceSlot | None:
        if pinned is None:
            return rt.pick_slot()
        if pinned < len(rt.slots) and rt.slots[pinned].ready:
            return rt.slots[pinned]
        return None

    def _deadline_s(self, rt: TenantRuntime, op: str, args: dict[str, Any]) -> float:
        if op == "run_wasm":
            t = args.get("timeout_s")
            run_s = (
                min(float(t), rt.spec.wasm_timeout_s)
                if isinstance(t, (int, float)) and t > 0
                else rt.spec.wasm_timeout_s
            )
            return max(run_s + DEADLINE_GRACE_S, rt.spec.request_timeout_s)
        return rt.spec.request_timeout_s

    def _forward(
        self,
        rt: TenantRuntime,
        slot: InstanceSlot,
        client: bytes,
        rid: int,
        op: str,
        args: dict[str, Any],
        body: Any,
        now: float,
    ) -> None:
        worker = slot.worker
        assert worker is not None
        if op == "run_wasm":
            args = self._with_wasm_limits(rt, args)
        deadline = now + self._deadline_s(rt, op, args)
        self._send_to_worker(worker, op, args, body, Pending(client, rid, op, rt.tenant_id, slot.index, now, deadline))
        rt.in_flight += 1

    def _with_wasm_limits(self, rt: TenantRuntime, args: dict[str, Any]) -> dict[str, Any]:
        """Defaults from the spec, and never above it."""
        spec = rt.spec
        fuel = args.get("fuel")
        timeout = args.get("timeout_s")
        out = dict(args)
        out["fuel"] = (
            min(fuel, spec.wasm_fuel)
            if isinstance(fuel, int) and not isinstance(fuel, bool) and fuel > 0
            else spec.wasm_fuel
        )
        out["timeout_s"] = (
            min(float(timeout), spec.wasm_timeout_s)
            if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
            else spec.wasm_timeout_s
        )
        return out

    def _dispatch_parked(self, rt: TenantRuntime) -> None:
        now = time.monotonic()
        keep: list[Parked] = []
        while rt.parked:
            p = rt.parked.popleft()
            slot = self._slot_for(rt, p.instance)
            if slot is None:
                keep.append(p)
                continue
            try:
                self._forward(rt, slot, p.client, p.rid, p.op, p.args, p.body, now)
            except TensorWasmError as exc:
                self._reply_error(p.client, p.rid, exc)
        rt.parked.extend(keep)
