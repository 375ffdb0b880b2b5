"""State and plumbing every part of the supervisor loop shares: timers, replies, sends.

The supervisor is one class assembled from one module per concern, each a
layer on the one below (all run on the single loop thread, no locks)::

    _Core        (core.py)       state, timers, replies, sends to workers
    _Routing     (routing.py)    tenant requests -> the right worker instance
    _Lifecycle   (lifecycle.py)  spawn, pool, bind, stop, kill, death, restart
    _Admin       (admin.py)      register, evict, set_quota, scale, inject_fault
    Supervisor   (router.py)     sockets, the poll loop, housekeeping, shutdown
"""

from __future__ import annotations

import collections
import heapq
import logging
import os
import threading
import time
from typing import Any, Callable

import psutil
import zmq

from shared import protocol as proto
from shared.config import SupervisorConfig
from shared.errors import (
    Overloaded,
    TensorWasmError,
    WorkerLost,
)
from shared.log import get_logger, log_event
from supervisor.events import EventBus
from supervisor.guard import FrontendGuard
from supervisor.metrics import Metrics, NullMetrics
from supervisor.placement import Placement
from supervisor.registry import TenantRegistry
from supervisor.rundir import RunDir
from supervisor.tenants import InstanceSlot, TenantRuntime
from supervisor.workers import Pending, Spawner, WorkerHandle

__all__: list[str] = []  # an internal layer of Supervisor (supervisor.router)

_log = get_logger("supervisor")

TICK_S = 0.05
FRONTEND_BATCH = 256
HELLO_TIMEOUT_S = 60.0
DEADLINE_GRACE_S = 2.0
RSS_CHECK_INTERVAL_S = 1.0
MAX_MODULES_PER_TENANT = 32
#: reply bodies from this size on are tracked per client (see _Core._reply)
_TRACK_BYTES = 64 << 10
MAX_MODULE_BYTES_PER_TENANT = 256 << 20
#: worker-side ops whose handle argument pins them to one instance
_HANDLE_OPS = frozenset({"free", "write", "read"})


class _Timer:
    __slots__ = ("when", "seq", "fn", "cancelled")

    def __init__(self, when: float, seq: int, fn: Callable[[], None]) -> None:
        self.when = when
        self.seq = seq
        self.fn = fn
        self.cancelled = False

    def __lt__(self, other: _Timer) -> bool:
        return (self.when, self.seq) < (other.when, other.seq)


class _Core:
    """Shared state of the supervisor loop (see the module docstring for the layers)."""

    # set up by Supervisor._setup()
    frontend: zmq.Socket[Any]
    guard: FrontendGuard
    backend: zmq.Socket[Any]
    control: zmq.Socket[Any]
    poller: zmq.Poller
    _wake_r: int  # a self-pipe in the poller: signals and other threads wake the loop
    _wake_w: int
    spawner: Spawner
    placement: Placement  # devices, budgets, tenant isolation (set by _select_backend)

    def __init__(self, config: SupervisorConfig, *, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or NullMetrics()
        self.rundir = RunDir(config.run_dir, config.client_group)
        self.registry, self.admin = TenantRegistry.new()
        self._admin_raw = self.admin.to_bytes()
        self._metrics_cache: dict[str, Any] = {}
        self.internal_errors = 0  # bugs caught by the loop's safety net (see Supervisor._internal_error)
        self._reply_queues: dict[bytes, collections.deque[tuple[zmq.MessageTracker, int]]] = {}
        self._metrics_wanted = threading.Event()
        self._metrics_done = threading.Event()
        self.tenants: dict[str, TenantRuntime] = {}
        self.workers: dict[bytes, WorkerHandle] = {}
        self.by_token: dict[str, WorkerHandle] = {}
        self.by_sentinel: dict[int, WorkerHandle] = {}
        self.pool: list[WorkerHandle] = []  # idle, unbound, ready to bind
        self.pool_starting = 0
        self.bind_queue: list[tuple[TenantRuntime, InstanceSlot, WorkerHandle]] = []
        self.events = EventBus(None)
        self.backend_name = "stub"
        self.backend_reason = ""
        self.backend_options: dict[str, Any] = {}
        self._rid = 0
        self._timers: list[_Timer] = []
        self._timer_seq = 0
        self._deadlines: list[tuple[float, int, WorkerHandle]] = []
        self._stopping = False
        self._stop_started: float | None = None
        self._started = time.time()
        self._last_rss_check = 0.0
        self._last_beat = 0.0
        self._pool_failures = 0
        self._pool_retry_at = 0.0
        self.ready = False
        self._zctx: zmq.Context[Any] | None = None
        self.on_ready: Callable[[_Core], None] | None = None

    def _after(self, delay: float, fn: Callable[[], None]) -> _Timer:
        self._timer_seq += 1
        timer = _Timer(time.monotonic() + delay, self._timer_seq, fn)
        heapq.heappush(self._timers, timer)
        return timer

    def _run_timers(self, now: float) -> None:
        timers = self._timers
        while timers and timers[0].when <= now:
            timer = heapq.heappop(timers)
            if not timer.cancelled:
                timer.fn()

    def _reply(self, client: bytes | None, rid: int, result: Any, body: Any = None) -> None:
        if client is None:
            return
        header = proto.encode_reply(rid, True, result)
        try:
            if body is None:
                self.frontend.send_multipart([client, header], zmq.NOBLOCK)
            elif len(body) < _TRACK_BYTES:
                self.frontend.send_multipart([client, header, body], zmq.NOBLOCK, copy=False)
            else:
                # ZMQ bounds a peer's queue in messages, not bytes: remember big bodies
                # until libzmq lets go of them, so a client that does not read is refused
                # more of them (``_queued_reply_bytes``) instead of growing our memory.
                view = body.buffer if isinstance(body, zmq.Frame) else memoryview(body)
                tracked = zmq.Frame(view, track=True)  # zero-copy: refers to the received frame
                tracker = self.frontend.send_multipart([client, header, tracked], zmq.NOBLOCK, copy=False, track=True)
                if tracker is not None:
                    queue = self._reply_queues.setdefault(client, collections.deque())
                    queue.append((tracker, len(body)))
        except zmq.ZMQError as exc:  # EHOSTUNREACH (client gone) / EAGAIN (client not reading)
            log_event(_log, logging.DEBUG, "supervisor.reply_dropped", rid=rid, error=exc.strerror)

    def _queued_reply_bytes(self, client: bytes) -> int:
        """Bytes of big reply bodies sent to ``client`` that libzmq still holds."""
        queue = self._reply_queues.get(client)
        if not queue:
            return 0
        while queue and queue[0][0].done:
            queue.popleft()
        if not queue:
            del self._reply_queues[client]
            return 0
        return sum(n for _, n in queue)

    def _prune_reply_queues(self) -> None:
        """Housekeeping: forget clients whose big replies have all left."""
        for client in list(self._reply_queues):
            self._queued_reply_bytes(client)

    def _reply_error(self, client: bytes | None, rid: int, exc: TensorWasmError) -> None:
        self._reply_raw_error(client, rid, exc.to_dict())

    def _reply_raw_error(self, client: bytes | None, rid: int, err: dict[str, Any]) -> None:
        if client is None:
            return
        try:
            self.frontend.send_multipart([client, proto.encode_reply(rid, False, err)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log_event(_log, logging.DEBUG, "supervisor.reply_dropped", rid=rid, error=exc.strerror)

    def _send_to_worker(self, worker: WorkerHandle, op: str, args: dict[str, Any], body: Any, pending: Pending) -> None:
        self._rid += 1
        rid = self._rid
        header = proto.encode_worker_request(rid, op, args)
        try:
            if body is None:
                self.backend.send_multipart([worker.ident, header], zmq.NOBLOCK)
            else:
                self.backend.send_multipart([worker.ident, header, body], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            # EHOSTUNREACH: the worker's socket is gone (it is dying); EAGAIN: its queue is full
            if exc.errno == zmq.EAGAIN:
                raise Overloaded(pending.tenant, len(worker.in_flight), len(worker.in_flight)) from None
            raise WorkerLost(pending.tenant, pending.instance, reason=f"worker unreachable: {exc.strerror}") from None
        worker.in_flight[rid] = pending
        heapq.heappush(self._deadlines, (pending.deadline, rid, worker))

    def _send_control(self, worker: WorkerHandle, data: bytes) -> None:
        try:
            self.control.send_multipart([worker.ident, data], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # dying or flooded: the heartbeat check handles it

    def _hello_info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "registry_id": self.registry.registry_id,
            "backend": self.backend_name,
            "backend_reason": self.backend_reason,
            "start_method": self.config.start_method,
            "protocol": proto.PROTOCOL_VERSION,
            "uptime_s": round(time.time() - self._started, 3),
        }

    def _tenant_record(self, rt: TenantRuntime) -> dict[str, Any]:
        snap = rt.block.snapshot().to_dict() if not rt.block.closed else {}
        now = time.monotonic()
        instances = []
        for slot in rt.slots:
            w = slot.worker
            instances.append(
                {
                    "index": slot.index,
                    "pid": w.pid if w else None,
                    "state": (w.state.value if w else ("restarting" if slot.restart_at else "down")),
                    "in_flight": len(w.in_flight) if w else 0,
                    "incarnation": slot.incarnation,
                    "restarts": slot.restarts,
                    "uptime_s": round(now - w.ready_at, 3) if w and w.ready_at else None,
                    "draining": slot.draining,
                    "last_exit": slot.last_exit,
                }
            )
        return {
            "tenant_id": rt.tenant_id,
            "state": rt.state.value,
            "generation": rt.generation,
            "failed_reason": rt.failed_reason,
            "pids": [i["pid"] for i in instances if i["pid"] is not None],
            "instances": instances,
            "restarts": rt.restarts_total,
            "in_flight": rt.in_flight,
            "parked": len(rt.parked),
            "uptime_s": round(time.time() - rt.registered_at, 3),
            "backend": self.backend_name,
            "device": rt.device,
            "isolation": self.placement.isolation_of(rt.tenant_id),
            "spec": rt.spec.to_dict(),
            "bytes_in_use": snap.get("bytes_in_use", 0),
            "memory_quota_bytes": snap.get("memory_quota_bytes", rt.spec.memory_quota_bytes),
            "gpu_bytes_in_use": snap.get("gpu_bytes_in_use", 0),
            "gpu_memory_bytes_cap": snap.get("gpu_memory_bytes_cap", rt.spec.gpu_memory_bytes_cap),
            "quota": snap,
        }

    def status(self) -> dict[str, Any]:
        return {
            "supervisor": {
                **self._hello_info(),
                "run_dir": self.rundir.path,
                "pool": {
                    "idle": len(self.pool),
                    "starting": self.pool_starting,
                    "size": self.config.pool_size,
                    "pids": [w.pid for w in self.pool],
                },
                "workers": len(self.workers),
                "internal_errors": self.internal_errors,
                "rss_bytes": psutil.Process().memory_info().rss,
                **self.guard.status(),
            },
            "tenants": [self._tenant_record(rt) for _, rt in sorted(self.tenants.items())],
            "devices": self.placement.status(self._tenants_by_device()),
        }

    def _tenants_by_device(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for tid, rt in self.tenants.items():
            out.setdefault(rt.device, []).append(tid)
        return out

    def metrics_snapshot(self) -> dict[str, Any]:
        """Per-tenant gauges, for the exporter's HTTP thread.

        That thread never touches a quota block itself (closing a block while
        another thread holds a view of it fails): it asks the loop, which
        rebuilds the dict (``_refresh_metrics``) and swaps it in; the loop
        also refreshes it every second. Waits at most 1 s for a fresh one.
        """
        self._metrics_done.clear()
        self._metrics_wanted.set()
        try:
            os.write(self._wake_w, b"m")
        except (OSError, AttributeError):
            return self._metrics_cache
        self._metrics_done.wait(1.0)
        return self._metrics_cache

    def _refresh_metrics(self) -> None:
        """Loop thread: rebuild the exporter's per-tenant snapshot."""
        out = {}
        for tid, rt in self.tenants.items():
            if rt.block.closed:
                continue
            out[tid] = {"quota": rt.block.snapshot(), "instances_up": len(rt.live_slots()), "state": rt.state.value}
        self._metrics_cache = out
        self._metrics_done.set()
