"""The supervisor process: one single-threaded loop that routes, supervises and recovers.

    clients ──DEALER──► ROUTER frontend ─┐ decode header only; check capability;
                                         │ back-pressure (max_in_flight); pick instance
    workers ◄──DEALER── ROUTER backend ◄─┘ forward [hdr'|body] (body not copied)
    workers ──DEALER──► ROUTER control     hello / heartbeats / fault acks
    subscribers ◄─SUB── PUB events         spawn, ready, exit, restart, failed ...
    worker sentinels (fds) ─► poller       a death is seen the moment it happens

Everything the loop does is non-blocking; sends use ``NOBLOCK`` and a full
peer (a slow client) loses its reply rather than stalling everyone. The
quota hot path never passes through here: workers consume and release on
their tenant's shared-memory block directly; the loop reads the blocks for
status and reclaims a dead instance's share.

Failure handling: a dead worker's in-flight requests are answered
:class:`WorkerLost` (with exit code or signal), its quota share reclaimed,
an ``exit`` event published, and the tenant's restart policy applied. Missed
heartbeats, a request past its deadline, a malformed reply or RSS beyond the
tenant's quota plus an allowance get the worker killed (SIGTERM, grace,
SIGKILL of its process tree) and then handled the same way.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import os
import signal
import time
from typing import Any, Callable

import psutil
import zmq

from shared import protocol as proto
from shared.capability import RegistryAdminCapability, TenantCapability
from shared.config import SupervisorConfig
from shared.errors import (
    InvalidArgument,
    KernelTimeout,
    MemoryExhausted,
    Overloaded,
    ProtocolError,
    TenantFailed,
    TenantIsolationViolation,
    TensorWasmError,
    UnknownModule,
    UnknownTenant,
    WorkerLost,
)
from shared.log import get_logger, log_event
from shared.proctitle import set_process_name
from shared.quota import MAX_INSTANCES, cleanup_stale_segments
from shared.spec import TenantSpec
from supervisor.events import EventBus
from supervisor.metrics import Metrics, NullMetrics
from supervisor.registry import TenantRegistry
from supervisor.rundir import RunDir
from supervisor.tenants import InstanceSlot, Parked, TenantRuntime, TenantState
from supervisor.workers import Pending, Spawner, WorkerHandle, WorkerState, exit_status, kill_tree

__all__ = ["Supervisor"]

_log = get_logger("supervisor")

TICK_S = 0.05
FRONTEND_BATCH = 256
HELLO_TIMEOUT_S = 60.0
DEADLINE_GRACE_S = 2.0
RSS_CHECK_INTERVAL_S = 1.0
MAX_MODULES_PER_TENANT = 32
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


class Supervisor:
    """Runs until :meth:`request_stop` (or SIGTERM/SIGINT in :meth:`run`)."""

    def __init__(self, config: SupervisorConfig, *, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or NullMetrics()
        self.rundir = RunDir(config.run_dir)
        self.registry, self.admin = TenantRegistry.new()
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
        self.on_ready: Callable[[Supervisor], None] | None = None

    # ================================================================ setup

    def _setup(self) -> None:
        cfg = self.config
        removed = cleanup_stale_segments()
        if removed:
            log_event(_log, logging.INFO, "supervisor.stale_segments_removed", count=len(removed))
        self._select_backend()
        self._zctx = zmq.Context()
        z = self._zctx

        def router(name: str, max_msg: int, hwm: int) -> zmq.Socket[Any]:
            s = z.socket(zmq.ROUTER)
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.MAXMSGSIZE, max_msg)
            s.setsockopt(zmq.SNDHWM, hwm)
            s.setsockopt(zmq.RCVHWM, hwm)
            s.bind(self.rundir.endpoint(name))
            return s

        self.frontend = router("frontend", cfg.max_message_bytes, 10_000)
        self.backend = router("backend", cfg.max_message_bytes, 10_000)
        self.control = router("control", 1 << 20, 10_000)
        pub = z.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 10_000)
        pub.bind(self.rundir.endpoint("events"))
        self.events = EventBus(pub)
        for name in ("frontend", "backend", "control", "events"):
            os.chmod(self.rundir.file(f"{name}.ipc"), 0o600)
        self.rundir.write_admin_capability(self.admin.to_bytes())

        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self.poller = zmq.Poller()
        self.poller.register(self.frontend, zmq.POLLIN)
        self.poller.register(self.backend, zmq.POLLIN)
        self.poller.register(self.control, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)

        self.spawner = Spawner(
            cfg,
            {"backend": self.rundir.endpoint("backend"), "control": self.rundir.endpoint("control")},
        )
        self.spawner.warm_up()
        self.metrics.bind_source(self.metrics_snapshot)
        for spec in cfg.tenants:
            self._register(spec, None, None)
        self._refill_pool()

    def _select_backend(self) -> None:
        """Pick the compute backend (``auto``: cuda when a driver and device work, else stub)."""
        from supervisor.backend_select import select_backend

        choice = select_backend(self.config)
        self.backend_name = choice.name
        self.backend_reason = choice.reason
        self.backend_options = choice.options
        log_event(_log, logging.INFO, "supervisor.backend", backend=choice.name, reason=choice.reason)

    def _signal_ready(self) -> None:
        if self.ready:
            return
        self.ready = True
        set_process_name("twt-supervisor")
        self.rundir.write_ready(
            {
                "pid": os.getpid(),
                "version": proto.PROTOCOL_VERSION,
                "registry_id": self.registry.registry_id,
                "backend": self.backend_name,
                "frontend": self.rundir.endpoint("frontend"),
                "events": self.rundir.endpoint("events"),
                "started": self._started,
            }
        )
        log_event(
            _log,
            logging.INFO,
            "supervisor.ready",
            run_dir=self.rundir.path,
            pid=os.getpid(),
            backend=self.backend_name,
            start_method=self.config.start_method,
            tenants=len(self.tenants),
        )
        if self.on_ready is not None:
            self.on_ready(self)

    # ================================================================= loop

    def request_stop(self) -> None:
        """Begin a graceful stop (safe from a signal handler or another thread)."""
        self._stopping = True
        try:
            os.write(self._wake_w, b"\0")
        except (OSError, AttributeError):
            pass

    def run(self) -> int:
        """Set up, serve until stopped, tear down. Returns the process exit code."""
        prev: dict[int, Any] = {}

        def on_signal(signum: int, frame: Any) -> None:
            log_event(_log, logging.INFO, "supervisor.signal", signal=signum)
            self.request_stop()

        self.rundir.acquire()  # RunDirLocked: another supervisor owns it - touch nothing
        for sig in (signal.SIGTERM, signal.SIGINT):
            prev[int(sig)] = signal.signal(sig, on_signal)
        try:
            self._setup()
            self._maybe_ready()
            self._loop()
        finally:
            self._teardown()
            for signum, handler in prev.items():
                signal.signal(signum, handler)
        return 0

    def _loop(self) -> None:
        poll = self.poller.poll
        frontend, backend, control, wake = self.frontend, self.backend, self.control, self._wake_r
        by_sentinel = self.by_sentinel
        next_tick = time.monotonic()
        while True:
            now = time.monotonic()
            timeout = max(0.0, next_tick - now)
            if self._timers:
                timeout = min(timeout, max(0.0, self._timers[0].when - now))
            for sock, _ in poll(int(timeout * 1000)):
                if sock is backend:
                    self._on_backend()
                elif sock is frontend:
                    self._on_frontend()
                elif sock is control:
                    self._on_control()
                elif sock == wake:
                    try:
                        os.read(wake, 4096)
                    except BlockingIOError:
                        pass
                elif sock in by_sentinel:
                    self._on_death(by_sentinel[sock])
            now = time.monotonic()
            self._run_timers(now)
            if now >= next_tick:
                next_tick = now + TICK_S
                self._housekeeping(now)
            if self._stopping:
                if self._stop_started is None:
                    self._begin_shutdown(now)
                if not self.workers or now - self._stop_started > self.config.stop_timeout_s + 2 * self.config.kill_grace_s:  # type: ignore[operator]
                    return

    # ============================================================== timers

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

    def _housekeeping(self, now: float) -> None:
        cfg = self.config
        # request deadlines (heap; stale entries skipped)
        dl = self._deadlines
        while dl and dl[0][0] <= now:
            _, rid, worker = heapq.heappop(dl)
            pending = worker.in_flight.get(rid)
            if pending is None or worker.state is WorkerState.DEAD:
                continue
            self._expire(worker, rid, pending)
        # heartbeats out, liveness in
        if now - self._last_beat >= cfg.heartbeat_interval_s:
            self._last_beat = now
            beat = proto.encode_control("hb")
            silent_after = cfg.heartbeat_interval_s * cfg.heartbeat_liveness
            for worker in list(self.workers.values()):
                if worker.state is WorkerState.DEAD:
                    continue
                if worker.control_hello:
                    self._send_control(worker, beat)
                    if worker.kill_at is None and now - worker.last_heartbeat > silent_after:
                        self._kill(worker, f"missed heartbeats for {now - worker.last_heartbeat:.1f} s", "heartbeat")
                elif worker.kill_at is None and now - worker.spawned_at > HELLO_TIMEOUT_S:
                    self._kill(worker, "never said hello", "startup")
        # SIGKILL escalation
        for worker in list(self.workers.values()):
            if worker.kill_at is not None and now >= worker.kill_at and worker.state is not WorkerState.DEAD:
                kill_tree(worker.pid, signal.SIGKILL)
                worker.kill_at = float("inf")
        # parked requests past their deadline
        for rt in self.tenants.values():
            while rt.parked and rt.parked[0].deadline <= now:
                p = rt.parked.popleft()
                self._reply_error(
                    p.client, p.rid, KernelTimeout(p.deadline - p.started, p.op,
                                                   message=f"no instance of {rt.tenant_id!r} became ready within "
                                                   f"{p.deadline - p.started:g} s")
                )
                self.metrics.request_done(rt.tenant_id, p.op, "kernel_timeout", now - p.started)
        # RSS backstop and quota-refusal events
        if now - self._last_rss_check >= RSS_CHECK_INTERVAL_S:
            self._last_rss_check = now
            self._check_rss()
            self._scan_refusals()
        if not self._stopping:
            self._refill_pool()

    # ============================================================ frontend

    def _on_frontend(self) -> None:
        recv = self.frontend.recv_multipart
        for _ in range(FRONTEND_BATCH):
            try:
                frames = recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle_client(frames)

    def _handle_client(self, frames: list[zmq.Frame]) -> None:
        client = frames[0].bytes
        if len(frames) not in (2, 3):
            rid = proto.peek_rid(frames[1].bytes) if len(frames) > 1 else None
            if rid is not None:
                self._reply_error(client, rid, ProtocolError(f"expected 1 or 2 frames, got {len(frames) - 1}"))
            return
        header = frames[1].bytes
        try:
            rid, op, cap_raw, args = proto.decode_client_header(header, self.config.max_header_bytes)
        except ProtocolError as exc:
            rid2 = proto.peek_rid(header)
            if rid2 is not None:
                self._reply_error(client, rid2, exc)
            return
        body = frames[2] if len(frames) == 3 else None
        try:
            if op in proto.TENANT_OPS:
                self._tenant_request(client, rid, op, cap_raw, args, body)
            else:
                self._admin_request(client, rid, op, cap_raw, args, body)
        except TensorWasmError as exc:
            self._reply_error(client, rid, exc)
        except (TypeError, ValueError, KeyError) as exc:
            self._reply_error(client, rid, InvalidArgument(f"{op}: {exc}"))
        except Exception as exc:  # noqa: BLE001 - nothing a client sends may crash the loop
            _log.exception("supervisor.request_failed op=%s", op)
            self._reply_error(client, rid, TensorWasmError(f"internal error handling {op!r}: {exc!r}"))

    def _reply(self, client: bytes | None, rid: int, result: Any, body: Any = None) -> None:
        if client is None:
            return
        header = proto.encode_reply(rid, True, result)
        try:
            if body is None:
                self.frontend.send_multipart([client, header], zmq.NOBLOCK)
            else:
                self.frontend.send_multipart([client, header, body], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # EHOSTUNREACH (client gone) / EAGAIN (client not reading)
            log_event(_log, logging.DEBUG, "supervisor.reply_dropped", rid=rid, error=exc.strerror)

    def _reply_error(self, client: bytes | None, rid: int, exc: TensorWasmError) -> None:
        self._reply_raw_error(client, rid, exc.to_dict())

    def _reply_raw_error(self, client: bytes | None, rid: int, err: dict[str, Any]) -> None:
        if client is None:
            return
        try:
            self.frontend.send_multipart([client, proto.encode_reply(rid, False, err)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log_event(_log, logging.DEBUG, "supervisor.reply_dropped", rid=rid, error=exc.strerror)

    # -------------------------------------------------------- tenant ops

    def _tenant_request(
        self, client: bytes, rid: int, op: str, cap_raw: bytes | None, args: dict[str, Any], body: Any
    ) -> None:
        if cap_raw is None:
            raise TenantIsolationViolation(None, f"op {op!r} (no capability)")
        cap = TenantCapability.from_bytes(cap_raw)
        tid = self.registry.verify(cap)
        rt = self.tenants.get(tid)
        if rt is None or rt.state is TenantState.EVICTING:
            raise UnknownTenant(tid)
        if op == "quota":
            self._reply(client, rid, rt.block.snapshot().to_dict())
            return
        if op == "put_module":
            self._reply(client, rid, {"digest": self._put_module(rt, body)})
            return
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
            rt.parked.append(
                Parked(client, rid, op, args, body, now, now + self._deadline_s(rt, op, args), pinned)
            )
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
        while len(rt.modules) > MAX_MODULES_PER_TENANT or sum(map(len, rt.modules.values())) > MAX_MODULE_BYTES_PER_TENANT:
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
            run_s = min(float(t), rt.spec.wasm_timeout_s) if isinstance(t, (int, float)) and t > 0 else rt.spec.wasm_timeout_s
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
        out["fuel"] = min(fuel, spec.wasm_fuel) if isinstance(fuel, int) and not isinstance(fuel, bool) and fuel > 0 else spec.wasm_fuel
        out["timeout_s"] = (
            min(float(timeout), spec.wasm_timeout_s) if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0 else spec.wasm_timeout_s
        )
        return out

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

    def _expire(self, worker: WorkerHandle, rid: int, pending: Pending) -> None:
        """A request outlived its deadline: answer it, then kill the stuck worker."""
        del worker.in_flight[rid]
        rt = self.tenants.get(pending.tenant)
        if rt is not None and pending.client is not None:
            rt.in_flight -= 1
        timeout = pending.deadline - pending.started
        exc = KernelTimeout(timeout, pending.op,
                            message=f"{pending.op} on {pending.tenant}/{pending.instance} exceeded its deadline of "
                            f"{timeout:g} s; the worker is being restarted")
        if pending.callback is not None:
            pending.callback(False, exc.to_dict())
        else:
            self._reply_error(pending.client, pending.client_rid, exc)
            self.metrics.request_done(pending.tenant, pending.op, exc.code, time.monotonic() - pending.started)
        self._kill(worker, f"request {pending.op!r} exceeded its deadline of {timeout:g} s", "deadline")

    # ------------------------------------------------------------ admin ops

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

    def _register(self, spec: TenantSpec, client: bytes | None, rid: int | None) -> None:
        cap = self.registry.register_with_capability(self.admin, spec)
        block = self.registry.block(self.admin, spec.tenant_id)
        rt = TenantRuntime(spec, block, cap.generation)
        rt.device = spec.cuda_device_index if spec.cuda_device_index is not None else 0
        rt.slots = [InstanceSlot(i) for i in range(spec.instances)]
        self.tenants[spec.tenant_id] = rt
        rt.register_waiters.append((client, rid, cap.to_bytes(), time.monotonic() + self.config.register_timeout_s))
        self.events.emit("register", tenant=spec.tenant_id, instances=spec.instances, generation=cap.generation)
        for slot in rt.slots:
            self._start_instance(rt, slot)
        self._after(self.config.register_timeout_s, lambda: self._register_timeout(rt))
        self._check_registered(rt)

    def _check_registered(self, rt: TenantRuntime) -> None:
        rt.refresh_state()
        if not rt.register_waiters:
            return
        if rt.state is TenantState.RUNNING:
            waiters, rt.register_waiters = rt.register_waiters, []
            for client, rid, cap_raw, _ in waiters:
                if client is not None:
                    self._reply(client, rid, {"capability": cap_raw, "tenant": self._tenant_record(rt)})
            self._maybe_ready()

    def _register_timeout(self, rt: TenantRuntime) -> None:
        if rt.register_waiters and self.tenants.get(rt.tenant_id) is rt:
            self._fail_registration(rt, KernelTimeout(self.config.register_timeout_s, "register"))

    def _fail_registration(self, rt: TenantRuntime, exc: TensorWasmError) -> None:
        waiters, rt.register_waiters = rt.register_waiters, []
        log_event(_log, logging.ERROR, "tenant.register_failed", tenant=rt.tenant_id, error=str(exc))
        self._evict(rt.tenant_id, None, None)
        for client, rid, _, _ in waiters:
            self._reply_error(client, rid, exc)
        self._maybe_ready()

    def _maybe_ready(self) -> None:
        """Write the ready file once every configured tenant is up (or failed)."""
        if not self.ready and all(not rt.register_waiters for rt in self.tenants.values()):
            self._signal_ready()

    def _evict(self, tid: str, client: bytes | None, rid: int | None) -> None:
        rt = self.tenants.get(tid)
        if rt is None:
            raise UnknownTenant(tid)
        rt.state = TenantState.EVICTING
        self.registry.unregister(self.admin, tid)  # revokes capabilities, unlinks the block
        del self.tenants[tid]
        for p in rt.parked:
            self._reply_error(p.client, p.rid, WorkerLost(tid, p.instance or 0, reason="tenant evicted"))
        rt.parked.clear()
        workers = [s.worker for s in rt.slots if s.worker is not None and s.worker.state is not WorkerState.DEAD]
        for worker in workers:
            self._stop_worker(worker, "evicted")
        self.events.emit("evict", tenant=tid, workers=[w.pid for w in workers])
        if client is None:
            return
        pids = [w.pid for w in workers]
        remaining = {w.worker_id for w in workers}
        if not remaining:
            self._reply(client, rid or 0, {"evicted": tid, "pids": pids})
            return

        def on_dead(worker: WorkerHandle) -> None:
            remaining.discard(worker.worker_id)
            if not remaining:
                self._reply(client, rid or 0, {"evicted": tid, "pids": pids})

        for worker in workers:
            worker.death_waiters.append(on_dead)

    def _set_quota(self, client: bytes, rid: int, args: dict[str, Any]) -> None:
        tid = str(args.get("tenant"))
        if tid not in self.tenants:
            raise UnknownTenant(tid)
        changes = {k: args[k] for k in ("memory_quota_bytes", "gpu_memory_bytes_cap", "recorded_cuda_mem_pool_quota") if k in args}
        if not changes:
            raise InvalidArgument("set_quota needs at least one of memory_quota_bytes, gpu_memory_bytes_cap, recorded_cuda_mem_pool_quota")
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

    def _drain(self, worker: WorkerHandle) -> None:
        """Stop routing to a worker; stop it once its in-flight requests are answered."""
        worker.state = WorkerState.DRAINING
        if not worker.in_flight:
            self._stop_worker(worker, "scaled down")

    def _inject_fault(self, client: bytes, rid: int, args: dict[str, Any]) -> None:
        tid = str(args.get("tenant"))
        rt = self.tenants.get(tid)
        if rt is None:
            raise UnknownTenant(tid)
        kind = args.get("kind")
        if kind not in ("crash", "segfault", "exit", "hang", "slow", "oom", "corrupt", "drop", "leak"):
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

    # ============================================================= backend

    def _on_backend(self) -> None:
        recv = self.backend.recv_multipart
        for _ in range(FRONTEND_BATCH):
            try:
                frames = recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            worker = self.workers.get(frames[0].bytes)
            if worker is None or worker.state is WorkerState.DEAD:
                continue
            try:
                rid, ok, payload = proto.decode_worker_reply(frames[1].bytes)
            except (ProtocolError, IndexError) as exc:
                self._kill(worker, f"malformed reply ({exc})", "protocol")
                continue
            if rid == 0:
                self._on_data_hello(worker, payload)
                continue
            pending = worker.in_flight.pop(rid, None)
            if pending is None:
                continue  # answered already (deadline) - drop the late reply
            worker.served += 1
            body = frames[2] if len(frames) > 2 else None
            if not ok and not isinstance(payload, dict):
                payload = TensorWasmError("worker sent an unusable error").to_dict()
            if pending.callback is not None:
                pending.callback(ok, payload)
            else:
                rt = self.tenants.get(pending.tenant)
                if rt is not None:
                    rt.in_flight -= 1
                if ok:
                    self._reply(pending.client, pending.client_rid, payload, body)
                else:
                    self._reply_raw_error(pending.client, pending.client_rid, payload)
                self.metrics.request_done(
                    pending.tenant, pending.op, "ok" if ok else str(payload.get("code")), time.monotonic() - pending.started
                )
            if worker.state is WorkerState.DRAINING and not worker.in_flight:
                self._stop_worker(worker, "scaled down")

    def _on_data_hello(self, worker: WorkerHandle, payload: Any) -> None:
        if not isinstance(payload, dict) or payload.get("token") != worker.token or worker.data_hello:
            self._kill(worker, "bad hello on the data socket", "protocol")
            return
        worker.data_hello = True
        self._on_connected(worker)

    # ============================================================= control

    def _on_control(self) -> None:
        for _ in range(FRONTEND_BATCH):
            try:
                ident, data = self.control.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue  # wrong frame count
            try:
                kind, args = proto.decode_control(data)
            except ProtocolError:
                continue
            worker = self.workers.get(ident)
            if worker is None or worker.state is WorkerState.DEAD:
                continue
            now = time.monotonic()
            if kind == "hello":
                if args.get("token") != worker.token or worker.control_hello:
                    self._kill(worker, "bad hello on the control socket", "protocol")
                    continue
                worker.control_hello = True
                worker.last_heartbeat = now
                self._on_connected(worker)
            elif kind == "hb":
                worker.last_heartbeat = now
            elif kind == "fault_ack":
                worker.last_heartbeat = now
                if worker.fault_waiters:
                    worker.fault_waiters.pop(0)(dict(args))

    def _send_control(self, worker: WorkerHandle, data: bytes) -> None:
        try:
            self.control.send_multipart([worker.ident, data], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # dying or flooded: the heartbeat check handles it

    # ====================================================== worker lifecycle

    def _spawn(self) -> WorkerHandle:
        worker = self.spawner.spawn()
        self.workers[worker.ident] = worker
        self.by_token[worker.token] = worker
        self.by_sentinel[worker.sentinel] = worker
        self.poller.register(worker.sentinel, zmq.POLLIN)
        self.events.emit("spawn", worker=worker.worker_id, pid=worker.pid, method=self.spawner.method)
        return worker

    def _refill_pool(self) -> None:
        want = self.config.pool_size
        if self._pool_failures and time.monotonic() < self._pool_retry_at:
            return
        if self._pool_failures:
            self._pool_retry_at = time.monotonic() + min(30.0, 0.1 * 2 ** min(self._pool_failures, 9))
        while len(self.pool) + self.pool_starting < want:
            worker = self._spawn()
            worker.tenant = None
            self.pool_starting += 1

    def _start_instance(self, rt: TenantRuntime, slot: InstanceSlot) -> None:
        """Give a slot a worker: a warm one from the pool, else a fresh process."""
        slot.restart_at = None
        slot.incarnation += 1
        worker = self.pool.pop() if self.pool else None
        if worker is None:
            worker = self._spawn()
            worker.tenant = rt.tenant_id
            worker.instance = slot.index
            slot.worker = worker
            return  # bound when its hellos arrive
        worker.tenant = rt.tenant_id
        worker.instance = slot.index
        slot.worker = worker
        self._bind(rt, slot, worker)
        self._refill_pool()

    def _on_connected(self, worker: WorkerHandle) -> None:
        if not worker.connected:
            return
        if worker.tenant is None:
            self.pool_starting -= 1
            worker.state = WorkerState.IDLE
            worker.ready_at = time.monotonic()
            self.pool.append(worker)
            self.events.emit("ready", worker=worker.worker_id, pid=worker.pid, pool=True)
            return
        rt = self.tenants.get(worker.tenant)
        slot = rt.slots[worker.instance] if rt is not None and worker.instance is not None and worker.instance < len(rt.slots) else None
        if rt is None or slot is None or slot.worker is not worker:
            self._stop_worker(worker, "tenant gone before bind")
            return
        self._bind(rt, slot, worker)

    def _bind(self, rt: TenantRuntime, slot: InstanceSlot, worker: WorkerHandle) -> None:
        worker.state = WorkerState.BINDING
        worker.incarnation = slot.incarnation
        args = {
            "spec": rt.spec.to_dict(),
            "instance": slot.index,
            "incarnation": slot.incarnation,
            "segment": rt.block.name,
            "backend": self.backend_name,
            "backend_options": self._backend_options_for(rt),
        }
        now = time.monotonic()

        def done(ok: bool, payload: Any) -> None:
            self._on_bound(rt, slot, worker, ok, payload)

        pending = Pending(None, 0, "bind", rt.tenant_id, slot.index, now, now + self.config.register_timeout_s, done)
        try:
            self._send_to_worker(worker, "bind", args, None, pending)
        except TensorWasmError as exc:
            done(False, exc.to_dict())

    def _backend_options_for(self, rt: TenantRuntime) -> dict[str, Any]:
        opts = dict(self.backend_options)
        opts.setdefault("device_index", rt.device)
        opts["device_index"] = rt.device
        return opts

    def _on_bound(self, rt: TenantRuntime, slot: InstanceSlot, worker: WorkerHandle, ok: bool, payload: Any) -> None:
        if self.tenants.get(rt.tenant_id) is not rt or slot.worker is not worker:
            self._stop_worker(worker, "tenant gone during bind")
            return
        if not ok:
            err = payload if isinstance(payload, dict) else {}
            log_event(_log, logging.ERROR, "worker.bind_failed", tenant=rt.tenant_id, instance=slot.index, error=err.get("message"))
            from shared.errors import error_from_dict

            exc = error_from_dict(err)
            self._kill(worker, f"bind failed: {exc}", "bind")
            if rt.register_waiters:
                self._fail_registration(rt, exc)
            return
        worker.state = WorkerState.READY
        worker.ready_at = time.monotonic()
        self.events.emit(
            "ready",
            tenant=rt.tenant_id,
            instance=slot.index,
            worker=worker.worker_id,
            pid=worker.pid,
            incarnation=slot.incarnation,
            startup_ms=round((worker.ready_at - worker.spawned_at) * 1000, 3),
        )
        rt.refresh_state()
        self._check_registered(rt)
        self._dispatch_parked(rt)

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

    def _stop_worker(self, worker: WorkerHandle, reason: str) -> None:
        """Planned stop: ``stop`` on control (SIGTERM if it never connected), SIGKILL after the timeout."""
        if worker.state in (WorkerState.DEAD, WorkerState.STOPPING):
            return
        worker.state = WorkerState.STOPPING
        worker.expected_exit = True
        worker.kill_reason = worker.kill_reason or reason
        if worker in self.pool:
            self.pool.remove(worker)
        if worker.control_hello:
            self._send_control(worker, proto.encode_control("stop"))
        else:
            kill_tree(worker.pid, signal.SIGTERM)
        worker.kill_at = time.monotonic() + self.config.stop_timeout_s

    def _kill(self, worker: WorkerHandle, reason: str, cause: str) -> None:
        """Forced stop: SIGTERM now, SIGKILL of the whole tree after ``kill_grace_s``."""
        if worker.state is WorkerState.DEAD or worker.killed:
            return
        worker.killed = True
        if not worker.expected_exit:
            worker.kill_reason = reason
        log_event(_log, logging.WARNING, "worker.kill", worker=worker.worker_id, pid=worker.pid,
                  tenant=worker.tenant, instance=worker.instance, reason=reason, cause=cause)
        self.events.emit("kill", worker=worker.worker_id, pid=worker.pid, tenant=worker.tenant,
                         instance=worker.instance, reason=reason)
        worker.state = WorkerState.STOPPING
        if worker in self.pool:
            self.pool.remove(worker)
        kill_tree(worker.pid, signal.SIGTERM)
        worker.kill_at = time.monotonic() + self.config.kill_grace_s

    def _on_death(self, worker: WorkerHandle) -> None:
        """The sentinel fired: answer, reclaim, publish, restart."""
        self.poller.unregister(worker.sentinel)
        del self.by_sentinel[worker.sentinel]
        self.workers.pop(worker.ident, None)
        self.by_token.pop(worker.token, None)
        was_pool = worker.tenant is None
        if was_pool and worker.state is WorkerState.STARTING:
            self.pool_starting -= 1
        if worker in self.pool:
            self.pool.remove(worker)
        expected = worker.expected_exit
        worker.state = WorkerState.DEAD
        code, sig = exit_status(worker.process)
        if worker.process.exitcode is not None:
            worker.process.close()
        reason = worker.kill_reason or ("killed by signal %d" % sig if sig else f"exited with code {code}")
        tid, index = worker.tenant, worker.instance
        # 1. every in-flight request gets a typed answer
        rt = self.tenants.get(tid) if tid else None
        for rid, pending in list(worker.in_flight.items()):
            if worker.rss_exceeded is not None:
                rss, limit = worker.rss_exceeded
                exc: TensorWasmError = MemoryExhausted(pending.tenant, rss, limit, rss,
                    message=f"worker {pending.tenant}/{pending.instance} was killed: RSS {rss:,} B above "
                    f"its limit of {limit:,} B (memory quota + allowance)")
            else:
                exc = WorkerLost(pending.tenant, pending.instance, code, sig, reason)
            if pending.callback is not None:
                pending.callback(False, exc.to_dict())
            else:
                if rt is not None:
                    rt.in_flight -= 1
                self._reply_error(pending.client, pending.client_rid, exc)
                self.metrics.request_done(pending.tenant, pending.op, exc.code, time.monotonic() - pending.started)
        worker.in_flight.clear()
        # 2. its share of the quota comes back (the driver freed its GPU memory)
        reclaimed = (0, 0)
        if rt is not None and index is not None and not rt.block.closed:
            reclaimed = rt.block.reclaim_instance(index)
            self._after_reclaim(rt, reclaimed)
        # 3. tell the world
        cause = "rss" if worker.rss_exceeded else ("stop" if expected else ("signal" if sig else "exit"))
        self.metrics.worker_exit(tid, cause)
        self.events.emit(
            "exit",
            worker=worker.worker_id,
            pid=worker.pid,
            tenant=tid,
            instance=index,
            exit_code=code,
            signal=sig,
            reason=reason,
            expected=expected,
            reclaimed_cpu=reclaimed[0],
            reclaimed_gpu=reclaimed[1],
        )
        for waiter in worker.fault_waiters:
            waiter({"exited": True, "exit_code": code, "signal": sig})
        worker.fault_waiters.clear()
        for on_dead in worker.death_waiters:
            on_dead(worker)
        worker.death_waiters.clear()
        if was_pool and not expected and worker.ready_at is None:
            self._pool_failures += 1  # a worker that cannot even start: back off refilling
        elif was_pool:
            self._pool_failures = 0
        # 4. restart policy
        if rt is None or index is None or index >= len(rt.slots):
            return
        slot = rt.slots[index]
        if slot.worker is not worker:
            return
        slot.worker = None
        slot.last_exit = {"exit_code": code, "signal": sig, "reason": reason, "at": time.time()}
        if slot.draining or self._stopping or rt.state is TenantState.EVICTING:
            if slot.draining and index == len(rt.slots) - 1:
                while rt.slots and rt.slots[-1].draining and rt.slots[-1].worker is None:
                    rt.slots.pop()
            rt.refresh_state()
            return
        if rt.register_waiters and worker.ready_at is None:
            self._fail_registration(rt, WorkerLost(rt.tenant_id, index, code, sig, f"died while starting: {reason}"))
            return
        if not rt.should_restart(code, sig):
            rt.refresh_state()
            self._fail_parked_for(rt, index, code, sig, reason)
            return
        if not rt.note_restart(time.monotonic()):
            self._mark_failed(rt, f"{len(rt.restart_times)} restarts within {rt.spec.restart_window_s:g} s")
            return
        delay = rt.backoff_s()
        slot.restarts += 1
        self.metrics.restart(rt.tenant_id)
        self.events.emit("restart", tenant=rt.tenant_id, instance=index, delay_s=delay, restarts=slot.restarts)
        rt.refresh_state()
        if delay <= 0:
            self._start_instance(rt, slot)
        else:
            slot.restart_at = time.monotonic() + delay
            self._after(delay, lambda: self._restart_due(rt, slot))

    def _after_reclaim(self, rt: TenantRuntime, reclaimed: tuple[int, int]) -> None:
        """Hook for the device budget (bytes of a dead instance come back to its device too)."""

    def _restart_due(self, rt: TenantRuntime, slot: InstanceSlot) -> None:
        if self.tenants.get(rt.tenant_id) is rt and slot.restart_at is not None and slot.worker is None and not self._stopping:
            self._start_instance(rt, slot)

    def _fail_parked_for(self, rt: TenantRuntime, index: int, code: int | None, sig: int | None, reason: str) -> None:
        """Instance ``index`` is not coming back: answer what can only go there."""
        restarting = any(s.worker is not None or s.restart_at is not None for s in rt.slots if not s.draining)
        keep = []
        for p in rt.parked:
            if p.instance == index or not restarting:
                self._reply_error(p.client, p.rid, WorkerLost(rt.tenant_id, index, code, sig,
                                                             f"{reason}; not restarted (restart={rt.spec.restart.value})"))
            else:
                keep.append(p)
        rt.parked.clear()
        rt.parked.extend(keep)

    def _mark_failed(self, rt: TenantRuntime, why: str) -> None:
        rt.state = TenantState.FAILED
        rt.failed_reason = why
        self.events.emit("failed", tenant=rt.tenant_id, reason=why, restarts=rt.restarts_total)
        exc = TenantFailed(rt.tenant_id, len(rt.restart_times), rt.spec.restart_window_s)
        while rt.parked:
            p = rt.parked.popleft()
            self._reply_error(p.client, p.rid, exc)
        for slot in rt.slots:
            if slot.worker is not None:
                self._stop_worker(slot.worker, "tenant failed")
        if rt.register_waiters:
            self._fail_registration(rt, exc)

    # ============================================================ backstops

    def _check_rss(self) -> None:
        allowance = self.config.rss_allowance_bytes
        for rt in self.tenants.values():
            limit = rt.spec.memory_quota_bytes + allowance
            for slot in rt.slots:
                worker = slot.worker
                if worker is None or worker.state is not WorkerState.READY:
                    continue
                try:
                    rss = psutil.Process(worker.pid).memory_info().rss
                except psutil.Error:
                    continue
                if rss > limit:
                    worker.rss_exceeded = (rss, limit)
                    self._kill(worker, f"RSS {rss:,} B above {limit:,} B (memory quota + allowance)", "rss")

    def _scan_refusals(self) -> None:
        for rt in self.tenants.values():
            if rt.block.closed:
                continue
            snap = rt.block.snapshot()
            total = snap.cpu_refusals + snap.gpu_refusals
            if total > rt.seen_refusals:
                self.events.emit("quota_refusal", tenant=rt.tenant_id, new=total - rt.seen_refusals,
                                 cpu_refusals=snap.cpu_refusals, gpu_refusals=snap.gpu_refusals)
                rt.seen_refusals = total

    # =============================================================== status

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
                "pool": {"idle": len(self.pool), "starting": self.pool_starting, "size": self.config.pool_size,
                         "pids": [w.pid for w in self.pool]},
                "workers": len(self.workers),
                "rss_bytes": psutil.Process().memory_info().rss,
            },
            "tenants": [self._tenant_record(rt) for _, rt in sorted(self.tenants.items())],
        }

    def metrics_snapshot(self) -> dict[str, Any]:
        """Per-tenant gauges for the exporter (called from its thread: only reads)."""
        out = {}
        for tid, rt in list(self.tenants.items()):
            try:
                snap = rt.block.snapshot()
            except TensorWasmError:
                continue
            out[tid] = {"quota": snap, "instances_up": len(rt.live_slots()), "state": rt.state.value}
        return out

    # ============================================================= shutdown

    def _begin_shutdown(self, now: float) -> None:
        self._stop_started = now
        log_event(_log, logging.INFO, "supervisor.stopping", workers=len(self.workers))
        for worker in list(self.workers.values()):
            self._stop_worker(worker, "shutdown")

    def _teardown(self) -> None:
        # Anything still alive now gets SIGKILL; then wait (bounded) for the sentinels.
        deadline = time.monotonic() + 5.0
        for worker in list(self.workers.values()):
            kill_tree(worker.pid, signal.SIGKILL)
        for worker in list(self.workers.values()):
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.exitcode is not None:
                worker.process.close()
        self.workers.clear()
        try:
            self.registry.close()
        finally:
            if self._zctx is not None:
                self._zctx.destroy(linger=0)
            for fd in (getattr(self, "_wake_r", None), getattr(self, "_wake_w", None)):
                if fd is not None:
                    os.close(fd)
            self.metrics.close()
            self.rundir.release()
            log_event(_log, logging.INFO, "supervisor.stopped")
