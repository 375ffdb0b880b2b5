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

import heapq
import hmac
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import zmq

from shared import protocol as proto
from shared.errors import (
    InvalidArgument,
    KernelTimeout,
    ProtocolError,
    TensorWasmError,
)
from shared.log import get_logger, log_event
from shared.quota import cleanup_stale_segments
from supervisor.admin import _Admin
from supervisor.core import (
    FRONTEND_BATCH,
    HELLO_TIMEOUT_S,
    RSS_CHECK_INTERVAL_S,
    TICK_S,
)
from supervisor.connections import FrontendConnections
from supervisor.events import EventBus
from supervisor.fdlimit import raise_fd_limit
from supervisor.guard import FrontendGuard
from supervisor.workers import (
    Spawner,
    WorkerHandle,
    WorkerState,
    kill_tree,
)

__all__ = ["Supervisor"]

_log = get_logger("supervisor")

#: messages libzmq may queue from one client before the loop reads them
FRONTEND_RCVHWM = 64
#: messages read per turn while the unauthenticated backlog is full
FRONTEND_BATCH_BACKLOGGED = 16


class Supervisor(_Admin):
    """Runs until :meth:`request_stop` (or SIGTERM/SIGINT in :meth:`run`)."""

    def _setup(self) -> None:
        cfg = self.config
        self.fd_soft_limit, self.fd_hard_limit = raise_fd_limit()
        removed = cleanup_stale_segments()
        if removed:
            log_event(_log, logging.INFO, "supervisor.stale_segments_removed", count=len(removed))
        self._select_backend()
        self._zctx = zmq.Context()
        z = self._zctx

        def router(name: str, max_msg: int, hwm: int, rcvhwm: int | None = None) -> zmq.Socket[Any]:
            s = z.socket(zmq.ROUTER)
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.MAXMSGSIZE, max_msg)
            s.setsockopt(zmq.SNDHWM, hwm)
            s.setsockopt(zmq.RCVHWM, hwm if rcvhwm is None else rcvhwm)
            s.bind(self.rundir.endpoint(name))
            return s

        # libzmq queues a peer's *incoming* messages up to RCVHWM before the loop reads
        # them: keep that small, so a flood waits in its sender, not in our memory
        # (set before bind: a listener copies the options its connections get).
        self.frontend = router("frontend", cfg.max_message_bytes, 10_000, FRONTEND_RCVHWM)
        self.connections = FrontendConnections(self.frontend, self.rundir.file("frontend.ipc"))
        self.guard = FrontendGuard(cfg, self.connections)
        self.backend = router("backend", cfg.max_message_bytes, 10_000)
        self.control = router("control", 1 << 20, 10_000)
        pub = z.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 10_000)
        pub.bind(self.rundir.endpoint("events"))
        self.events = EventBus(pub)
        self.rundir.secure_sockets()
        self.rundir.write_admin_capability(self.admin.to_bytes())

        # Tracked frames (big reply bodies, see _Core._reply) need pyzmq's garbage-collector
        # thread and context; start it now so the process's fds are stable from the start.
        zmq.Frame(bytes(1 << 17), track=True)  # large enough for pyzmq's zero-copy (tracked) path
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self.poller = zmq.Poller()
        self.poller.register(self.frontend, zmq.POLLIN)
        self.poller.register(self.connections.monitor, zmq.POLLIN)
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

        from supervisor.placement import Placement

        choice = select_backend(self.config)
        self.backend_name = choice.name
        self.backend_reason = choice.reason
        self.backend_options = choice.options
        self.placement = Placement.create(
            choice.name,
            choice.devices,
            reserve_bytes=self.config.device_reserve_bytes,
            policy=self.config.placement,
            segment_prefix=self.registry.segment_prefix,
            no_mps_dir=os.path.join(self.rundir.path, "no-mps"),
        )
        log_event(_log, logging.INFO, "supervisor.backend", backend=choice.name, reason=choice.reason,
                  devices=self.placement.indexes)

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
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
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
        monitor = self.connections.monitor
        by_sentinel = self.by_sentinel
        next_tick = time.monotonic()
        while True:
            now = time.monotonic()
            timeout = max(0.0, next_tick - now)
            if self._timers:
                timeout = min(timeout, max(0.0, self._timers[0].when - now))
            backlog = bool(self.guard.fair.backlog)
            if backlog:
                timeout = 0.0  # unauthenticated requests wait for their turn: serve them next
            served_frontend = False
            for sock, _ in poll(int(timeout * 1000)):
                try:
                    if sock is backend:
                        self._on_backend()
                    elif sock is frontend:
                        served_frontend = True
                        self._on_frontend()
                    elif sock is control:
                        self._on_control()
                    elif sock is monitor:
                        self.connections.on_readable()
                    elif sock == wake:
                        try:
                            os.read(wake, 4096)
                        except BlockingIOError:
                            pass
                    elif sock in by_sentinel:
                        self._on_death(by_sentinel[sock])
                except Exception:  # noqa: BLE001 - a bug in one handler must not take every tenant down
                    self._internal_error("dispatch")
            if backlog and not served_frontend:
                try:
                    self._on_frontend()
                except Exception:  # noqa: BLE001 - as above
                    self._internal_error("dispatch")
            if self._metrics_wanted.is_set():
                self._metrics_wanted.clear()
                self._refresh_metrics()
            now = time.monotonic()
            try:
                self._run_timers(now)
                if now >= next_tick:
                    next_tick = now + TICK_S
                    self._housekeeping(now)
            except Exception:  # noqa: BLE001 - as above
                self._internal_error("housekeeping")
            if self._stopping:
                if self._stop_started is None:
                    self._stop_started = now
                    self._begin_shutdown(now)
                waited = now - self._stop_started
                if not self.workers or waited > self.config.stop_timeout_s + 2 * self.config.kill_grace_s:
                    return

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
                    p.client,
                    p.rid,
                    KernelTimeout(
                        p.deadline - p.started,
                        p.op,
                        message=f"no instance of {rt.tenant_id!r} became ready within {p.deadline - p.started:g} s",
                    ),
                )
                self.metrics.request_done(rt.tenant_id, p.op, "kernel_timeout", now - p.started)
        # RSS backstop and quota-refusal events
        if now - self._last_rss_check >= RSS_CHECK_INTERVAL_S:
            self._last_rss_check = now
            self._prune_reply_queues()
            self.connections.refresh_limit()
            self._check_rss()
            self._scan_refusals()
        if not self._stopping:
            self._refill_pool()

    def _internal_error(self, where: str) -> None:
        """Log a bug with its traceback and keep serving (counted in status as internal_errors)."""
        self.internal_errors += 1
        _log.error("supervisor.internal_error", exc_info=True, extra={"twt_fields": {"where": where}})

    def _on_frontend(self) -> None:
        # Drain what is queued (asking ZMQ_EVENTS between messages: a recv that
        # fails with EAGAIN costs ~5 us here, the query ~1.6 us), then serve the
        # turn's messages in a fair order (supervisor.fairness): verified tenants
        # round robin, then unauthenticated peers round robin under a budget.
        sock = self.frontend
        recv, events = sock.recv_multipart, sock.getsockopt
        turn: list[tuple[bool, Any, _ClientMsg]] = []
        # a full backlog of unauthenticated requests: read only a few (a flood then
        # waits in its sender; verified clients still get through, libzmq reads peers in turn)
        for _ in range(FRONTEND_BATCH_BACKLOGGED if self.guard.fair.backlog_full else FRONTEND_BATCH):
            try:
                frames = recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            msg = self._decode_client(frames)
            if msg is not None:
                turn.append((msg.key is not None, msg.key if msg.key is not None else msg.client, msg))
            if not int(events(zmq.EVENTS)) & zmq.POLLIN:
                break
        for msg in self.guard.fair.order(turn):
            self._serve_client(msg)

    def _decode_client(self, frames: list[zmq.Frame]) -> _ClientMsg | None:
        """Decode one client message (None: unanswerable, dropped) and note whose it is:
        ``key`` is the tenant (or "admin") when its capability was verified before."""
        client = frames[0].bytes
        if len(frames) not in (2, 3):
            rid = proto.peek_rid(frames[1].bytes) if len(frames) > 1 else None
            if rid is None:
                return None
            return _ClientMsg(client, rid, "", None, {}, None,
                              ProtocolError(f"expected 1 or 2 frames, got {len(frames) - 1}"))
        header = frames[1].bytes
        try:
            rid, op, cap_raw, args = proto.decode_client_header(header, self.config.max_header_bytes)
        except ProtocolError as exc:
            rid2 = proto.peek_rid(header)
            # without its traceback: its frames would reach this turn's list, which holds
            # the message - a cycle that keeps every flooded header alive until a full GC
            return None if rid2 is None else _ClientMsg(client, rid2, "", None, {}, None, exc.with_traceback(None))
        body = frames[2] if len(frames) == 3 else None
        msg = _ClientMsg(client, rid, op, cap_raw, args, body, None, size=len(header) + (len(body) if body else 0))
        msg.key = self._verified_key(cap_raw)
        return msg

    def _verified_key(self, cap_raw: bytes | None) -> str | None:
        """The tenant whose verified capability these exact bytes are ("admin" for the
        admin capability), or None: never verified (forged, foreign, new or absent)."""
        if cap_raw is None:
            return None
        rt = self._verified_caps.get(cap_raw)
        if rt is not None and self.tenants.get(rt.tenant_id) is rt:
            return rt.tenant_id
        if hmac.compare_digest(cap_raw, self._admin_raw):
            return "admin"
        return None

    def _serve_client(self, msg: _ClientMsg) -> None:
        client, rid, op = msg.client, msg.rid, msg.op
        if msg.error is not None:
            self._refused(client, rid, op, msg.error, None)
            return
        try:
            if op in proto.TENANT_OPS:
                self._tenant_request(client, rid, op, msg.cap_raw, msg.args, msg.body)
            else:
                self._admin_request(client, rid, op, msg.cap_raw, msg.args, msg.body)
        except TensorWasmError as exc:
            self._refused(client, rid, op, exc, msg.cap_raw)
        except (TypeError, ValueError, KeyError) as exc:
            self._refused(client, rid, op, InvalidArgument(f"{op}: {exc}"), msg.cap_raw)
        except Exception as exc:  # noqa: BLE001 - nothing a client sends may crash the loop
            _log.error("supervisor.request_failed", exc_info=True, extra={"twt_fields": {"op": op}})
            self._refused(client, rid, op, TensorWasmError(f"internal error handling {op!r}: {exc!r}"), msg.cap_raw)

    def _refused(self, client: bytes, rid: int, op: str, exc: TensorWasmError, cap_raw: bytes | None) -> None:
        """Answer a request the supervisor itself refused (and count it).

        Only a verified capability earns a full answer and a metric label of
        its tenant; anything else gets a short error within its peer's error
        budget, counted under one label (a forged token's tenant name never
        becomes a label).
        """
        key = self._verified_key(cap_raw)
        if key is None:
            err = self.guard.unauthenticated_error(client, exc)
            if err is not None:
                try:
                    frame = zmq.Frame(proto.encode_reply(rid, False, err), track=True)
                    tracker = self.frontend.send_multipart([client, frame], zmq.NOBLOCK, copy=False, track=True)
                    self.guard.errors.sent(client, tracker)
                except zmq.ZMQError:
                    pass  # gone, or not reading at all: nothing queued
            if op in proto.TENANT_OPS:
                self.metrics.request_done("", op, exc.code, 0.0)
            return
        self._reply_error(client, rid, exc)
        if op in proto.TENANT_OPS:
            self.metrics.request_done(key, op, exc.code, 0.0)

    def _on_backend(self) -> None:
        sock = self.backend
        recv, events = sock.recv_multipart, sock.getsockopt
        for n in range(FRONTEND_BATCH):
            if n and not int(events(zmq.EVENTS)) & zmq.POLLIN:
                return
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
                    pending.tenant,
                    pending.op,
                    "ok" if ok else str(payload.get("code")),
                    time.monotonic() - pending.started,
                )
            if worker.state is WorkerState.DRAINING and not worker.in_flight:
                self._stop_worker(worker, "scaled down")

    def _on_data_hello(self, worker: WorkerHandle, payload: Any) -> None:
        if not isinstance(payload, dict) or not _token_ok(payload.get("token"), worker.token) or worker.data_hello:
            self._kill(worker, "bad hello on the data socket", "protocol")
            return
        worker.data_hello = True
        self._on_connected(worker)

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
                if not _token_ok(args.get("token"), worker.token) or worker.control_hello:
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
            placement = getattr(self, "placement", None)
            if placement is not None:
                placement.close()  # unlink the device budget segments
            self.rundir.release()
            log_event(_log, logging.INFO, "supervisor.stopped")


def _token_ok(given: Any, token: str) -> bool:
    """The worker's proof of its spawn secret, compared in constant time."""
    return isinstance(given, str) and hmac.compare_digest(given.encode(), token.encode())


@dataclass(eq=False)
class _ClientMsg:
    """One decoded client message of a loop turn (``error``: answer it with this)."""

    client: bytes
    rid: int
    op: str
    cap_raw: bytes | None
    args: dict[str, Any]
    body: Any
    error: TensorWasmError | None
    key: str | None = None
    size: int = 0
