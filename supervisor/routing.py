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
from typing import Any, Callable

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
    WorkerLost,
)
from shared.log import get_logger
from supervisor.core import (
    _HANDLE_OPS,
    DEADLINE_GRACE_S,
    MAX_MODULE_BYTES_PER_TENANT,
    MAX_MODULES_PER_TENANT,
    _Core,
)

#: ops whose replies can carry big bodies: refused while a client lets too many pile up
_BIG_REPLY_OPS = frozenset({"read", "run_wasm"})
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
        # Every limit applies to every op, before anything is done for it: the failed
        # tenant, max_in_flight (quota and put_module count, though answered at once),
        # the module cap.
        if rt.state is TenantState.FAILED:
            raise TenantFailed(tid, len(rt.restart_times), rt.spec.restart_window_s)
        if rt.in_flight + len(rt.parked) >= rt.spec.max_in_flight:
            raise Overloaded(tid, rt.in_flight + len(rt.parked), rt.spec.max_in_flight)
        if body is not None and op in ("run_wasm", "put_module") and len(body) > MAX_MODULE_BYTES:
            raise InvalidArgument(f"module of {len(body):,} B exceeds the {MAX_MODULE_BYTES:,}-byte limit")
        if op == "quota":
            self._reply(client, rid, rt.block.snapshot().to_dict())
            self.metrics.request_done(tid, op, "ok", 0.0)
            return
        if op == "put_module":
            self._reply(client, rid, {"digest": self._put_module(rt, body)})
            self.metrics.request_done(tid, op, "ok", 0.0)
            return
        if op == "run_wasm" and body is None:
            digest = args.get("digest")
            stored = rt.modules.get(digest) if isinstance(digest, str) else None
            if stored is None or not isinstance(digest, str):
                raise UnknownModule(tid, str(digest))
            rt.modules.move_to_end(digest)
            body = stored
        if op in _BIG_REPLY_OPS:
            queued = self._queued_reply_bytes(client)
            if queued > self.config.max_client_reply_bytes:
                raise Overloaded(
                    tid, rt.in_flight, rt.spec.max_in_flight,
                    message=f"{queued:,} B of replies to this client are still queued (it is not reading them); "
                    f"limit max_client_reply_bytes={self.config.max_client_reply_bytes:,}",
                )
        if op == "buffers":
            self._buffers_of_every_instance(rt, client, rid)
            return
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

    def _buffers_of_every_instance(self, rt: TenantRuntime, client: bytes, rid: int) -> None:
        """``buffers`` lists the tenant's buffers on every ready instance (a fan-out, merged)."""
        slots = rt.live_slots()
        if not slots:
            raise WorkerLost(rt.tenant_id, 0, reason="no ready instance to list buffers on")
        now = time.monotonic()
        deadline = now + rt.spec.request_timeout_s
        remaining = {slot.index for slot in slots}
        merged: list[Any] = []
        errors: list[Any] = []

        def collect(index: int) -> Callable[[bool, Any], None]:
            def done(ok: bool, payload: Any) -> None:
                if index not in remaining:
                    return
                remaining.discard(index)
                if ok and isinstance(payload, dict):
                    merged.extend(payload.get("buffers") or ())
                else:
                    errors.append(payload)
                if remaining:
                    return
                if errors:
                    self._reply_raw_error(client, rid, errors[0])
                else:
                    self._reply(client, rid, {"buffers": sorted(merged), "bytes": sum(n for _, n in merged)})

            return done

        for slot in slots:
            assert slot.worker is not None
            pending = Pending(None, 0, "buffers", rt.tenant_id, slot.index, now, deadline, collect(slot.index))
            try:
                self._send_to_worker(slot.worker, "buffers", {}, None, pending)
            except TensorWasmError as exc:
                pending.callback(False, exc.to_dict())  # type: ignore[misc]

    def _put_module(self, rt: TenantRuntime, body: Any) -> str:
        """Keep a tenant's module (bounded LRU) so runs can name it by digest."""
        if body is None:
            raise InvalidArgument("put_module needs the module bytes as the body frame")
        data = body.bytes if isinstance(body, zmq.Frame) else bytes(body)
        if not data:
            raise InvalidArgument("put_module: empty module")
        digest = hashlib.sha256(data).hexdigest()
        held = self.guard.held
        if digest in rt.modules:
            rt.modules.move_to_end(digest)
            return digest
        # Room first among the tenant's own modules (LRU), then the held-bytes budgets
        # (per tenant and for all tenants together): Overloaded beyond them.
        while rt.modules and (
            len(rt.modules) >= MAX_MODULES_PER_TENANT
            or sum(map(len, rt.modules.values())) + len(data) > MAX_MODULE_BYTES_PER_TENANT
        ):
            _, old = rt.modules.popitem(last=False)
            held.release(rt.tenant_id, "modules", len(old))
        held.reserve(rt.tenant_id, "modules", len(data))
        rt.modules[digest] = data
        return digest

    def _forget_tenant(self, rt: TenantRuntime) -> None:
        """An evicted tenant leaves nothing behind in the frontend: its verified
        tokens (which kept its runtime alive), stored modules and held bytes."""
        for raw in [raw for raw, cached in self._verified_caps.items() if cached is rt]:
            del self._verified_caps[raw]
        rt.modules.clear()
        self.guard.held.forget(rt.tenant_id)

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
        *,
        started: float | None = None,
        deadline: float | None = None,
    ) -> None:
        """Send to the slot's worker. A request that waited (parked) keeps its
        original start and deadline; a run is shortened to fit what is left."""
        worker = slot.worker
        assert worker is not None
        if op == "run_wasm":
            args = self._with_wasm_limits(rt, args)
            if deadline is not None:
                left = deadline - now - DEADLINE_GRACE_S
                if left < args["timeout_s"]:
                    args["timeout_s"] = max(0.001, left)
        own = now + self._deadline_s(rt, op, args)
        deadline = own if deadline is None else min(own, deadline)
        pending = Pending(client, rid, op, rt.tenant_id, slot.index, started if started is not None else now, deadline)
        self._send_to_worker(worker, op, args, body, pending)
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
                self._forward(rt, slot, p.client, p.rid, p.op, p.args, p.body, now,
                              started=p.started, deadline=p.deadline)
            except TensorWasmError as exc:
                self._reply_error(p.client, p.rid, exc)
        rt.parked.extend(keep)
