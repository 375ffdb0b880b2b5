"""Which device a tenant runs on, each device's shared budget, and the MPS environment of its workers.

    select_backend() ── devices (index, name, total, free) ──► Placement.create()
                                                                 one DeviceBudget segment per device:
                                                                 limit = free (probe) - device_reserve_bytes
                                                                 (stub: the simulated capacity)
    register(spec) ──► Placement.place(spec)       pinned: spec.cuda_device_index (must be managed)
                                                   else the policy: "most-free" budget, or "first"
                   ──► Placement.isolation(spec)   "mps" needs a live daemon (clear error if none);
                                                   "auto" uses MPS when detect_mps() finds one;
                                                   "process" opts out of a live daemon (see below)
    bind ──► worker_options(spec, device)          budget segment, GPU cap, pool quota, MPS environment,
                                                   the device's GPU-time board and the tenant's slot on it
    worker death ──► reclaim_pid(pid)              shares of dead workers come back to their device;
                                                   a dead worker's device lease passes on at once
    every 10 s ──► reclaim_dead()                  the same for any owner gone unseen (reads /proc per owner)

GPU time: one :class:`~shared.gpu_time.GpuTimeBoard` per device as well. A
tenant joins the board of its device at start (``gpu_time_join``: a tenant
slot with its ``gpu_time_weight`` / ``gpu_time_cap``), changes it live
(``set_quota``, reload) and leaves at eviction.

The supervisor never initialises CUDA: device facts come from the probe's
child process, and the budgets are plain shared memory.

Opting out of MPS: a CUDA process connects to a live MPS control daemon on
its own (at ``$CUDA_MPS_PIPE_DIRECTORY``, else ``/tmp/nvidia-mps``), whether
asked to or not. So when a daemon is alive, workers of ``isolation =
"process"`` tenants get ``CUDA_MPS_PIPE_DIRECTORY`` pointed at an empty
private directory, where no daemon answers, and run as ordinary processes.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Final
from collections.abc import Iterable, Mapping
from collections.abc import Callable

from shared.device_budget import DeviceBudget
from shared.gpu_time import DEFAULT_QUANTUM_S, DEFAULT_TENANT_SLOTS, DEFAULT_WORKER_SLOTS, GpuTimeBoard
from shared.errors import BackendUnavailable, CapacityExhausted, InvalidArgument, SegmentError
from shared.log import get_logger, log_event
from supervisor.host.mps import Fallback, Mps, MpsDecision, detect_mps
from shared.quota import new_segment_name
from shared.records import DeviceRecord, ProbedDevice
from shared.spec import IsolationKind, TenantSpec

__all__ = ["MPS_HEADROOM_MIB", "POLICIES", "Placement", "mps_environment"]

_log = get_logger("supervisor.routing.placement")

POLICIES = ("most-free", "first")
MiB = 1 << 20
#: added to a tenant's GPU cap in its MPS memory limit: module images, the sum kernel's scratch,
#: and the pool's granularity rounding must not make MPS refuse below the metered cap
MPS_HEADROOM_MIB = 64
#: a device index fits in this many bits (TenantSpec.cuda_device_index <= 1023)
_DEVICE_BITS: Final = 10
_DEVICE_MASK: Final = (1 << _DEVICE_BITS) - 1
#: the isolation decision of every tenant that asks for process isolation on a host without MPS
_PROCESS: Final = Fallback("isolation='process'")


def mps_environment(
    pipe_dir: str, device_ordinal: int, gpu_cap_bytes: int | None, sm_percentage: int | None
) -> dict[str, str]:
    """The variables an MPS client worker needs before ``cuInit``.

    ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` is ``<ordinal>=<n>M`` with ``n`` the
    cap in MiB rounded up to an even number (the 2 MiB allocation
    granularity) plus :data:`MPS_HEADROOM_MIB`; absent without a cap (operator
    trust). ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` only when ``sm_percentage``
    is set.
    """
    env = {"CUDA_MPS_PIPE_DIRECTORY": pipe_dir}
    if gpu_cap_bytes is not None:
        mib = math.ceil(gpu_cap_bytes / MiB)
        mib += mib % 2
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"{device_ordinal}={mib + MPS_HEADROOM_MIB}M"
    if sm_percentage is not None:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(int(sm_percentage))
    return env


@dataclass
class _Device:
    index: int
    name: str
    total_bytes: int
    free_bytes: int | None
    budget: DeviceBudget
    #: one CUDA context's cost on this device (the probe's), handed to each worker: None for the stub
    context_bytes: int | None = None


class Placement:
    """The managed devices, their budgets, and each tenant's device and isolation."""

    def __init__(
        self,
        backend: str,
        devices: list[_Device],
        policy: str = "most-free",
        detect: Callable[[], MpsDecision] = detect_mps,
        no_mps_dir: str | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"placement must be one of {', '.join(POLICIES)}; got {policy!r}")
        self.backend = backend
        self.policy = policy
        #: nice steps a bound worker's guest thread runs below its device thread (worker.priority)
        self.guest_nice = 0
        self._devices = {d.index: d for d in devices}
        self._detect = detect
        #: the tenants whose workers go through MPS, with the daemon's decision (the others, process
        #: isolation, are not named: at 10,000 tenants a map entry each would be ~30 B a tenant)
        self._mps: dict[str, Mps] = {}
        self._opt_out: set[str] = set()  # process tenants while a daemon is alive
        self.no_mps_dir = no_mps_dir
        #: device -> its GPU-time lease board; tenant -> its tenant slot on that board and the device,
        #: as one int (``slot << _DEVICE_BITS | device``: an int each, not a tuple and two ints)
        self.boards: dict[int, GpuTimeBoard] = {}
        self._gpu_time: dict[str, int] = {}

    @classmethod
    def create(
        cls,
        backend: str,
        devices: Iterable[ProbedDevice | Mapping[str, object]],
        *,
        reserve_bytes: int,
        policy: str = "most-free",
        segment_prefix: str | None = None,
        detect: Callable[[], MpsDecision] = detect_mps,
        no_mps_dir: str | None = None,
        gpu_time_quantum_s: float = DEFAULT_QUANTUM_S,
        gpu_time_scheduler: bool = True,
        gpu_time_tenants: int = DEFAULT_TENANT_SLOTS,
        gpu_time_workers: int = DEFAULT_WORKER_SLOTS,
        guest_nice: int = 0,
    ) -> Placement:
        """One budget segment per device. Capacity: the probe's free bytes (else total) minus
        ``reserve_bytes`` for cuda; the simulated capacity for the stub. And one GPU-time board
        with ``gpu_time_tenants`` tenant slots and ``gpu_time_workers`` worker slots."""
        made: list[_Device] = []
        boards: dict[int, GpuTimeBoard] = {}
        try:
            for info in devices:
                dev = info if isinstance(info, ProbedDevice) else ProbedDevice.from_wire(info)  # checked
                index, total, free = dev.index, dev.total_bytes, dev.free_bytes
                capacity = free if free is not None else total
                reserve = 0 if backend == "stub" else reserve_bytes
                budget = DeviceBudget.create(
                    index,
                    capacity,
                    reserve_bytes=min(reserve, capacity),
                    name=new_segment_name(segment_prefix, f"dev{index}"),
                )
                made.append(_Device(index, dev.name, total, free, budget, dev.context_bytes))
                if dev.context_bytes_source == "default":  # the probe could not measure a context here
                    log_event(_log, logging.WARNING, "device.context_not_measured", device=index,
                              compute_capability=dev.compute_capability, assumed_bytes=dev.context_bytes,
                              reason=dev.context_note)
                boards[index] = GpuTimeBoard.create(index, quantum_s=gpu_time_quantum_s,
                                                    scheduler=gpu_time_scheduler,
                                                    tenants=gpu_time_tenants, workers=gpu_time_workers,
                                                    name=new_segment_name(segment_prefix, f"gt{index}"))
        except BaseException:
            for d in made:
                d.budget.unlink()
                d.budget.close()
            for board in boards.values():
                board.unlink()
                board.close()
            raise
        for d in made:
            log_event(_log, logging.INFO, "device.budget", device=d.index, name=d.name, backend=backend,
                      capacity=d.budget.capacity_bytes, reserve=d.budget.reserve_bytes, limit=d.budget.limit_bytes,
                      segment=d.budget.name, context_bytes=d.context_bytes)
        placement = cls(backend, made, policy, detect, no_mps_dir)
        placement.boards = boards
        placement.guest_nice = guest_nice
        return placement

    @property
    def indexes(self) -> list[int]:
        return sorted(self._devices)

    def context_bounds(self) -> dict[int, int]:
        """The most tenant workers each device holds: its budget over one worker's context cost,
        for the devices where the probe gave that cost (cuda; the stub has none)."""
        return {d.index: max(1, d.budget.limit_bytes // d.context_bytes)
                for d in self._devices.values() if d.context_bytes}

    def budget(self, device: int) -> DeviceBudget:
        return self._devices[device].budget

    # ------------------------------------------------------------ register

    def place(self, spec: TenantSpec, tenants_on: Mapping[int, int] | None = None) -> int:
        """The device for a new tenant; :class:`InvalidArgument` for a pinned index not managed here.

        ``tenants_on``: device -> number of tenants placed there (the tie-breaker).
        """
        if spec.cuda_device_index is not None:
            if spec.cuda_device_index not in self._devices:
                raise InvalidArgument(
                    f"tenant {spec.tenant_id!r}: cuda_device_index={spec.cuda_device_index} is not a device this "
                    f"supervisor manages (managed: {', '.join(map(str, self.indexes))}; see the 'devices' setting)"
                )
            return spec.cuda_device_index
        # (dead workers' shares are reclaimed when their death is seen, not here)
        if self.policy == "first":
            return self.indexes[0]
        # most free budget now; ties (e.g. at start-up) -> fewest tenants -> lowest index
        load = tenants_on or {}
        best = min(self._devices.values(), key=lambda d: (-d.budget.free_bytes, load.get(d.index, 0), d.index))
        return best.index

    def isolation(self, spec: TenantSpec) -> MpsDecision:
        """``Mps(pipe dir)`` or ``Fallback`` (process isolation) for a tenant; raises when MPS is
        demanded (``isolation="mps"``) and no daemon is alive."""
        found = self._detect()
        if spec.isolation is IsolationKind.PROCESS:
            if isinstance(found, Mps):
                return Fallback(f"isolation='process': opting out of the MPS daemon in {found.pipe_dir}")
            return _PROCESS  # one frozen record for every such tenant (10,000 of them: 80 B each)
        if spec.isolation is IsolationKind.MPS and not isinstance(found, Mps):
            raise BackendUnavailable(
                "mps",
                f"tenant {spec.tenant_id!r} asks for isolation='mps' but no MPS control daemon is usable: "
                f"{found.reason}. Start nvidia-cuda-mps-control -d (with CUDA_MPS_PIPE_DIRECTORY), or use "
                "isolation='process' / 'auto'",
            )
        return found

    def add(self, tenant_id: str, decision: MpsDecision) -> None:
        """Record a registered tenant's isolation (replacing a previous registration's)."""
        if isinstance(decision, Mps):
            self._mps[tenant_id] = decision
        else:
            self._mps.pop(tenant_id, None)
        self._opt_out.discard(tenant_id)
        if isinstance(decision, Fallback) and "opting out" in decision.reason and self.no_mps_dir:
            self._opt_out.add(tenant_id)

    def isolation_of(self, tenant_id: str) -> str:
        return "mps" if tenant_id in self._mps else "process"

    # ----------------------------------------------------------- GPU time

    def gpu_time_join(self, spec: TenantSpec, device: int) -> None:
        """Give the tenant a slot on ``device``'s board with its weight and cap, or update them
        (idempotent; a tenant moved to another device leaves the old board).

        :class:`CapacityExhausted` (nothing changed) when every tenant slot of the board is
        taken: the board is sized from ``max_tenants`` with room to spare, so only slots still
        named by the stopping workers of evicted tenants can fill it.
        """
        tid = spec.tenant_id
        board = self.boards.get(device)
        held = self.gpu_time_slot(tid)
        if held is not None and held[0] != device:
            self.gpu_time_leave(tid)
            held = None
        if board is None or board.closed:
            return
        if held is None:
            try:
                slot = board.add_tenant(spec.gpu_time_weight, spec.gpu_time_cap)
            except SegmentError as exc:
                if board.closed:
                    raise
                limit = board.tenant_slots
                raise CapacityExhausted("tenants", limit - board.free_tenant_slots(), 1, limit, "max_tenants",
                                        message=f"all {limit} GPU-time tenant slots of device {device} are "
                                                "taken (evicted tenants' workers still stopping); retry once "
                                                "they have exited, or raise max_tenants") from exc
            self._gpu_time[tid] = slot << _DEVICE_BITS | device
        else:
            board.set_policy(held[1], weight=spec.gpu_time_weight, cap=spec.gpu_time_cap)

    def gpu_time_leave(self, tenant_id: str) -> None:
        """Free the tenant's board slot (eviction: its workers are stopping)."""
        held = self._gpu_time.pop(tenant_id, None)
        if held is not None:
            board = self.boards.get(held & _DEVICE_MASK)
            if board is not None and not board.closed:
                board.remove_tenant(held >> _DEVICE_BITS)

    def gpu_time_slot(self, tenant_id: str) -> tuple[int, int] | None:
        """(device, tenant slot) of the tenant on a GPU-time board, or None."""
        held = self._gpu_time.get(tenant_id)
        return None if held is None else (held & _DEVICE_MASK, held >> _DEVICE_BITS)

    # --------------------------------------------------------------- bind

    def worker_options(self, spec: TenantSpec, device: int) -> dict[str, object]:
        """What a worker of ``spec`` on ``device`` gets in its backend options (besides the backend's own).

        ``gpu_memory_bytes_cap`` becomes each instance's pool ``maxSize``: the tenant's *whole* cap, as
        the metered cap is shared across instances and one instance may hold all of it. The driver's
        backstop for a tenant of k instances is therefore k x cap; the shared counter holds it to
        the cap (docs/GPU-QUOTAS.md, "Cap 2").
        """
        opts: dict[str, object] = {
            "device_index": device,
            "budget_segment": self._devices[device].budget.name,
            "gpu_memory_bytes_cap": spec.gpu_memory_bytes_cap,
            "recorded_cuda_mem_pool_quota": spec.recorded_cuda_mem_pool_quota,
        }
        if self._devices[device].context_bytes is not None:  # measured once, not by each worker at its start
            opts["context_bytes"] = self._devices[device].context_bytes
        held = self.gpu_time_slot(spec.tenant_id)
        if held is not None and held[0] == device and device in self.boards:
            opts["gpu_time_segment"] = self.boards[device].name
            opts["gpu_time_slot"] = held[1]
        if self.guest_nice:
            opts["guest_nice"] = self.guest_nice
        decision = self._mps.get(spec.tenant_id)
        if decision is not None:
            opts["environment"] = mps_environment(decision.pipe_dir, device, spec.gpu_memory_bytes_cap,
                                                  spec.sm_percentage)
        elif spec.tenant_id in self._opt_out and self.no_mps_dir:
            os.makedirs(self.no_mps_dir, mode=0o700, exist_ok=True)  # empty: no daemon answers here
            opts["environment"] = {"CUDA_MPS_PIPE_DIRECTORY": self.no_mps_dir}
        return opts

    # -------------------------------------------------------------- death

    def reclaim_dead(self) -> int:
        """Return the shares of dead workers on every device; bytes reclaimed in all."""
        return self._reclaim(lambda budget: budget.reclaim_dead(), lambda board: board.reclaim_dead())

    def reclaim_pid(self, pid: int) -> int:
        """Return the shares and the GPU-time slots of one worker the supervisor saw die (it
        reaped it) on every device; bytes reclaimed in all. Reads that pid's ``/proc`` entry
        only; :meth:`reclaim_dead`'s scan of every owner is the periodic safety net."""
        return self._reclaim(lambda budget: budget.reclaim_pid(pid), lambda board: board.reclaim_pid(pid))

    def _reclaim(self, budgets: Callable[[DeviceBudget], list[tuple[int, int, int]]],
                 boards: Callable[[GpuTimeBoard], list[tuple[int, int, bool]]]) -> int:
        """Free what ``budgets`` and ``boards`` find dead on every open budget and board, logged;
        the bytes of budget shares returned."""
        total = 0
        for d in self._devices.values():
            if d.budget.closed:
                continue
            for slot, pid, share in budgets(d.budget):
                total += share
                if share:
                    log_event(_log, logging.INFO, "device.budget_reclaimed", device=d.index, slot=slot, pid=pid,
                              bytes=share)
        for index, board in self.boards.items():
            if board.closed:
                continue
            for slot, pid, held in boards(board):
                if held:
                    log_event(_log, logging.INFO, "device.gpu_lease_reclaimed", device=index, worker_slot=slot,
                              pid=pid)
        return total

    # ------------------------------------------------------------- status

    def status(self, tenants_on: Mapping[int, list[str]] | None = None) -> list[DeviceRecord]:
        """One record per device; ``tenants_on``: device -> the tenants placed there."""
        out = []
        for d in sorted(self._devices.values(), key=lambda d: d.index):
            if d.budget.closed:
                continue
            snap = d.budget.snapshot()
            out.append(DeviceRecord(
                index=d.index,
                name=d.name,
                total_bytes=d.total_bytes,
                free_bytes_at_start=d.free_bytes,
                budget_capacity_bytes=snap.capacity_bytes,
                reserve_bytes=snap.reserve_bytes,
                budget_limit_bytes=snap.limit_bytes,
                budget_used_bytes=snap.used_bytes,
                budget_free_bytes=snap.free_bytes,
                budget_high_water=snap.high_water,
                budget_refusals=snap.refusals,
                tenants=tuple(sorted((tenants_on or {}).get(d.index, []))),
                segment=snap.name,
                gpu_time=self._board_status(d.index),
            ))
        return out

    def _board_status(self, device: int) -> dict[str, object]:
        board = self.boards.get(device)
        if board is None or board.closed:
            return {}
        snap = board.snapshot()
        return {"scheduler": snap.scheduler, "quantum_s": snap.quantum_s, "holder": snap.holder,
                "holder_pid": snap.holder_pid, "busy": snap.busy, "waiting": snap.waiting, "grants": snap.grants,
                "steals": snap.steals, "handoffs": snap.handoffs, "segment": snap.name}

    def close(self) -> None:
        """Unlink and unmap every budget (supervisor shutdown)."""
        for d in self._devices.values():
            try:
                d.budget.unlink()
            finally:
                d.budget.close()
        for board in self.boards.values():
            try:
                board.unlink()
            finally:
                board.close()
        if self.no_mps_dir:
            try:
                os.rmdir(self.no_mps_dir)
            except OSError:
                pass  # never made, or not empty (then not ours to empty)
