"""The worker's control thread: heartbeats both ways, faults, stop, and parent watching.

Runs beside the executor on its own DEALER socket to the supervisor's control
ROUTER, so a long request never starves heartbeats (Paranoid Pirate: the
worker beats every ``interval``; when the supervisor is silent for
``interval * liveness`` the worker assumes it is gone and exits). A worker
must never outlive its supervisor: besides heartbeats it checks that its
parent is still the process that started it (``PR_SET_PDEATHSIG`` covers the
rest, see :mod:`worker.main`).

Threads: this thread owns its control socket and nothing else. It shares
with the executor thread (:class:`worker.server.WorkerServer`) only
``stop_event`` (a ``threading.Event``), the :class:`worker.faults.FaultState`
(whose counters are changed under its own lock) and a read of the server's
``requests`` counter for the heartbeat (an int read whole; a stale value is
harmless). It never touches the data socket: ZMQ sockets are not thread-safe.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import zmq

from shared.errors import ProtocolError, TensorWasmError
from shared.exitcodes import WORKER_PARENT_GONE, WORKER_SUPERVISOR_SILENT
from shared.log import get_logger, log_event
from shared.protocol import decode_control, encode_control
from shared.records import BootMessage, FaultAck, FaultOrder, WorkerHello
from worker.faults import FaultState

__all__ = ["ControlThread", "EXIT_PARENT_GONE", "EXIT_SUPERVISOR_SILENT"]

_log = get_logger("worker.control")

EXIT_SUPERVISOR_SILENT = WORKER_SUPERVISOR_SILENT  # defined in shared.exitcodes
EXIT_PARENT_GONE = WORKER_PARENT_GONE


class ControlThread(threading.Thread):
    def __init__(
        self,
        zctx: zmq.Context[Any],
        boot: BootMessage,
        faults: FaultState,
        stop_event: threading.Event,
        stats: Any,
    ) -> None:
        super().__init__(name="twt-control", daemon=True)
        self.zctx = zctx
        self.boot = boot
        self.faults = faults
        self.stop_event = stop_event
        self.stats = stats
        self.parent_pid = os.getppid()
        self.closed = threading.Event()

    def run(self) -> None:
        sock = self.zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self.boot.routing_id.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        sock.setsockopt(zmq.SNDHWM, 100)
        sock.connect(self.boot.control_endpoint)
        try:
            sock.send(encode_control("hello", WorkerHello(self.boot.token, os.getpid()).to_wire()))
            self._loop(sock)
        finally:
            sock.close(0)
            self.closed.set()

    def _loop(self, sock: zmq.Socket[Any]) -> None:
        last_heard = time.monotonic()
        interval = self.boot.heartbeat_interval_s
        silent_after = interval * self.boot.heartbeat_liveness
        next_beat = last_heard + interval
        while not self.stop_event.is_set():
            now = time.monotonic()
            if sock.poll(max(0, int((next_beat - now) * 1000)) + 1):
                try:
                    kind, args = decode_control(sock.recv())
                except ProtocolError as exc:
                    log_event(_log, logging.WARNING, "control.bad_message", error=str(exc))
                    continue
                last_heard = time.monotonic()
                self._on_message(sock, kind, args)
            now = time.monotonic()
            if now >= next_beat:
                if not self.faults.hang.is_set():
                    sock.send(encode_control("hb", {"requests": self.stats.requests}), zmq.NOBLOCK)
                next_beat = now + interval
            if now - last_heard > silent_after:
                log_event(_log, logging.ERROR, "worker.supervisor_silent", silent_s=round(now - last_heard, 2))
                os._exit(EXIT_SUPERVISOR_SILENT)
            if os.getppid() != self.parent_pid:
                log_event(_log, logging.ERROR, "worker.parent_gone", parent=self.parent_pid)
                os._exit(EXIT_PARENT_GONE)

    def _on_message(self, sock: zmq.Socket[Any], kind: str, args: dict[str, Any]) -> None:
        if kind == "stop":
            log_event(_log, logging.INFO, "worker.stop_requested")
            self.stop_event.set()
        elif kind == "fault":
            try:
                order = FaultOrder.from_wire(args)
                ack = FaultAck(True, armed=self.faults.apply(str(order.kind), dict(order.params or {})))
            except (TensorWasmError, TypeError) as exc:  # ProtocolError, InvalidArgument; params not a map
                err = exc if isinstance(exc, TensorWasmError) else ProtocolError(f"bad fault order: {exc}")
                ack = FaultAck(False, error=err.to_dict())
            sock.send(encode_control("fault_ack", ack.to_wire()), zmq.NOBLOCK)
