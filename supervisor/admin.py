"""Admin operations (the admin capability): register, evict, set_quota, scale, inject_fault ..."""

from __future__ import annotations

from typing import Any

from shared import protocol as proto
from shared.capability import RegistryAdminCapability
from shared.errors import (
    InvalidArgument,
    ProtocolError,
    TenantIsolationViolation,
    UnknownTenant,
    WorkerLost,
)
from shared.log import get_logger
from shared.quota import MAX_INSTANCES
from shared.spec import TenantSpec
from supervisor.lifecycle import _Lifecycle
from supervisor.tenants import InstanceSlot
from supervisor.workers import (
    WorkerState,
)

__all__: list[str] = []  # an internal layer of Supervisor (supervisor.router)

_log = get_logger("supervisor")


class _Admin(_Lifecycle):
    def _admin_request(
        self, client: bytes, rid: int, op: str, cap_raw: bytes | None, args: dict[str, Any], body: Any
    ) -> None:
        if cap_raw is None:
            raise TenantIsolationViolation(None, f"admin op {op!r} (no capability)")
        self.registry.verify_admin(RegistryAdminCapability.from_bytes(cap_raw))
        if op == "hello":
            self._reply(client, rid, self._hello_info())
        elif op == "register":
            spec = TenantSpec.from_dict(args.get("spec") or {})
            self._register(spec, client, rid)
        elif op == "evict":
            self._evict(str(args.get("tenant")), client, rid)
        elif op == "set_quota":
            self._set_quota(client, rid, args)
        elif op == "status":
            self._reply(client, rid, self.status())
        elif op == "capability":
            tid = str(args.get("tenant"))
            self._reply(client, rid, {"capability": self.registry.tenant_capability(self.admin, tid).to_bytes()})
        elif op == "tenant_status":
            tid = str(args.get("tenant"))
            rt = self.tenants.get(tid)
            if rt is None:
                raise UnknownTenant(tid)
            self._reply(client, rid, self._tenant_record(rt))
        elif op == "scale":
            self._scale(client, rid, args)
        elif op == "inject_fault":
            self._inject_fault(client, rid, args)
        else:  # pragma: no cover - the decoder only lets known ops through
            raise ProtocolError(f"unknown op {op!r}")

    def _set_quota(self, client: bytes, rid: int, args: dict[str, Any]) -> None:
        tid = str(args.get("tenant"))
        if tid not in self.tenants:
            raise UnknownTenant(tid)
        changes = {
            k: args[k]
            for k in ("memory_quota_bytes", "gpu_memory_bytes_cap", "recorded_cuda_mem_pool_quota")
            if k in args
        }
        if not changes:
            raise InvalidArgument(
                "set_quota needs at least one of memory_quota_bytes, gpu_memory_bytes_cap, recorded_cuda_mem_pool_quota"
            )
        info = self.registry.set_quota(self.admin, tid, **changes)
        self.tenants[tid].spec = info.spec
        self.events.emit("set_quota", tenant=tid, **{k: getattr(info.spec, k) for k in changes})
        self._reply(client, rid, self._tenant_record(self.tenants[tid]))

    def _scale(self, client: bytes, rid: int, args: dict[str, Any]) -> None:
        tid = str(args.get("tenant"))
        rt = self.tenants.get(tid)
        if rt is None:
            raise UnknownTenant(tid)
        n = args.get("instances")
        if isinstance(n, bool) or not isinstance(n, int):
            raise InvalidArgument("instances must be an int")
        spec = rt.spec.with_instances(n)  # validates the range
        self.registry.update_spec(self.admin, spec)
        rt.spec = spec
        wanted = [s for s in rt.slots if not s.draining]
        if n > len(wanted):
            for _ in range(n - len(wanted)):
                # reuse a scaled-away slot whose worker is gone, else open a new one
                slot = next((s for s in rt.slots if s.draining and s.worker is None), None)
                if slot is None:
                    if len(rt.slots) >= MAX_INSTANCES:
                        raise InvalidArgument(f"no free instance slot (at most {MAX_INSTANCES})")
                    slot = InstanceSlot(len(rt.slots))
                    rt.slots.append(slot)
                slot.draining = False
                self._start_instance(rt, slot)
        else:
            for slot in sorted(wanted, key=lambda s: s.index, reverse=True)[: len(wanted) - n]:
                slot.draining = True
                slot.restart_at = None
                if slot.worker is not None:
                    self._drain(slot.worker)
        self.events.emit("scale", tenant=tid, instances=n)
        rt.refresh_state()
        self._reply(client, rid, self._tenant_record(rt))

    def _inject_fault(self, client: bytes, rid: int, args: dict[str, Any]) -> None:
        tid = str(args.get("tenant"))
        rt = self.tenants.get(tid)
        if rt is None:
            raise UnknownTenant(tid)
        kind = args.get("kind")
        if kind not in ("crash", "segfault", "exit", "hang", "slow", "oom", "corrupt", "drop", "leak", "cuda-fault"):
            raise InvalidArgument(f"unknown fault kind {kind!r}")
        index = args.get("instance")
        if index is None:
            live = rt.live_slots()
            if not live:
                raise WorkerLost(tid, 0, reason="no live instance to inject into")
            slot = live[0]
        else:
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(rt.slots):
                raise InvalidArgument(f"instance must be in 0..{len(rt.slots) - 1}")
            slot = rt.slots[index]
        worker = slot.worker
        if worker is None or not worker.control_hello or worker.state is WorkerState.DEAD:
            raise WorkerLost(tid, slot.index, reason="instance is not running")
        params = args.get("params") or {}
        if not isinstance(params, dict):
            raise InvalidArgument("params must be a map")
        info = {"tenant": tid, "instance": slot.index, "pid": worker.pid, "kind": kind}
        answered = False

        def answer(result: dict[str, Any]) -> None:
            nonlocal answered
            if not answered:
                answered = True
                if result.get("ok") is False and isinstance(result.get("error"), dict):
                    self._reply_raw_error(client, rid, result["error"])
                else:
                    self._reply(client, rid, {**info, **result})

        worker.fault_waiters.append(answer)
        self.events.emit("fault", **info, params=params)
        self._send_control(worker, proto.encode_control("fault", {"kind": kind, "params": params}))
