"""The worker's control thread: heartbeats both ways, faults, stop, and parent watching.

Runs beside the executor on its own DEALER socket to the supervisor's control
ROUTER, so a long request never starves heartbeats. The supervisor beats every
``interval``; the worker answers each beat at once and sends none on a clock of
its own, so an idle worker's thread wakes once per interval, and the
supervisor reads the answers of all its workers close together.

A worker ends when its supervisor is *gone*, never because it is merely
*slow*: a supervisor stopped with SIGSTOP, or starved on a loaded host, stays
silent for a while and then resumes, and its tenants' workers must still be
there. So silence alone (``interval * liveness`` without a message) is only
a reason to look: the worker exits (:data:`EXIT_SUPERVISOR_SILENT`) when the
supervisor process is dead or replaced (pid and start time from the boot
record), and otherwise keeps serving and logs ``worker.supervisor_slow``
once per stall (after reading what is already queued: a worker thread that
was itself starved finds the supervisor's beats waiting). Besides that, it
exits (:data:`EXIT_PARENT_GONE`) when its parent is no longer the process
that started it, and ``PR_SET_PDEATHSIG`` (see :mod:`worker.main`) kills it
with its parent.

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
from typing import TYPE_CHECKING

import zmq

from shared.errors import InvalidArgument, ProtocolError, TensorWasmError
from shared.exitcodes import WORKER_PARENT_GONE, WORKER_SUPERVISOR_SILENT
from shared.log import get_logger, log_event
from shared.frames import decode_control, encode_control
from shared.worker_link import BootMessage, FaultAck, FaultOrder, WorkerHello
from worker.faults import FaultState

if TYPE_CHECKING:
    from worker.server import WorkerServer

__all__ = ["ControlThread", "EXIT_PARENT_GONE", "EXIT_SUPERVISOR_SILENT", "supervisor_alive"]

_log = get_logger("worker.control")
#: how long the look for already-sent messages before a silence judgement waits (ms): not 0, so a
#: beat still on its way through libzmq's I/O thread (in the ipc socket, not yet in this socket's
#: queue: that thread was starved too) is seen as well; once per interval at most, when silent
_QUEUED_LOOK_MS = 50

EXIT_SUPERVISOR_SILENT = WORKER_SUPERVISOR_SILENT  # defined in shared.exitcodes
EXIT_PARENT_GONE = WORKER_PARENT_GONE


def supervisor_alive(pid: int | None, started: float | None) -> bool:
    """Is the supervisor (``pid``, created at ``started``, psutil's clock) still running?

    A zombie, a missing pid, or a pid reused by another process (its start
    time differs) all count as gone. Without a pid to check (an old boot
    record) the answer is "alive": the parent check and PDEATHSIG still hold.
    """
    if pid is None:
        return True
    import psutil  # imported here: the worker's start-up does not need it

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(proc.create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # cannot tell (permissions): do not kill a tenant's worker on a guess


class ControlThread(threading.Thread):
    def __init__(
        self,
        zctx: zmq.Context[zmq.Socket[bytes]],
        boot: BootMessage,
        faults: FaultState,
        stop_event: threading.Event,
        stats: WorkerServer,
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

    def _loop(self, sock: zmq.Socket[bytes]) -> None:
        last_heard = time.monotonic()
        interval = self.boot.heartbeat_interval_s
        silent_after = interval * self.boot.heartbeat_liveness
        next_look = last_heard  # when silence is next checked against the supervisor's process
        stalled = False  # logged supervisor_slow for the current silence
        sup_pid, sup_started = self.boot.supervisor_pid, self.boot.supervisor_started
        while not self.stop_event.is_set():
            # no clock of its own: the supervisor's beats wake it (each answered at once). Without
            # them it wakes for the silence's first look and then its looks, and every two
            # intervals at least (the parent check); never one interval after the last beat, which
            # the next beat, a little later than that, would follow with a second wake-up
            now = time.monotonic()
            due = last_heard + silent_after
            wake = min(due if now < due else next_look, now + 2 * interval)
            if sock.poll(max(0, int((wake - now) * 1000)) + 1):
                try:
                    kind, args = decode_control(sock.recv())
                except ProtocolError as exc:
                    log_event(_log, logging.WARNING, "control.bad_message", error=str(exc))
                    continue
                last_heard = time.monotonic()
                self._on_message(sock, kind, args)
            now = time.monotonic()
            silent = now - last_heard
            if silent > silent_after and now >= next_look and sock.poll(_QUEUED_LOOK_MS):
                # A message is waiting: this thread was itself starved (the poll timed out, then
                # it waited for a CPU or the interpreter while the supervisor's beats came in).
                # Read them before judging anyone slow.
                continue
            if silent > silent_after and now >= next_look:
                # Silent: gone, or only stalled? Look at the process, at most once per interval.
                next_look = now + interval
                if not supervisor_alive(sup_pid, sup_started):
                    log_event(_log, logging.ERROR, "worker.supervisor_silent", silent_s=round(silent, 2))
                    os._exit(EXIT_SUPERVISOR_SILENT)
                if not stalled:
                    stalled = True
                    log_event(_log, logging.WARNING, "worker.supervisor_slow", silent_s=round(silent, 2),
                              supervisor=sup_pid)
            elif silent <= silent_after:
                stalled = False
            if os.getppid() != self.parent_pid:
                log_event(_log, logging.ERROR, "worker.parent_gone", parent=self.parent_pid)
                os._exit(EXIT_PARENT_GONE)

    def _check_kernel_fault(self) -> None:
        """Refuse ``cuda-fault`` when it is ordered, not at the next request: armed on a backend
        that cannot fault, it would fail an unrelated request with an error that is not about that
        request (an ``InvalidArgument`` on a ``read`` of a live buffer, which a client may take
        for "this buffer is gone" and lose track of bytes still charged)."""
        context = getattr(self.stats, "context", None)
        backend = getattr(context, "backend", None)
        name = getattr(backend, "name", None)
        if name != "cuda":
            raise InvalidArgument(f"fault 'cuda-fault' needs the cuda backend (this worker runs "
                                  f"{name or 'no backend yet'!r})")

    def _on_message(self, sock: zmq.Socket[bytes], kind: str, args: dict[str, object]) -> None:
        if kind == "hb":  # answered, not sent on a clock of its own; a hung worker answers nothing
            if not self.faults.hang.is_set():
                sock.send(encode_control("hb", {"requests": self.stats.requests}), zmq.NOBLOCK)
        elif kind == "stop":
            log_event(_log, logging.INFO, "worker.stop_requested")
            self.stop_event.set()
        elif kind == "fault":
            try:
                order = FaultOrder.from_wire(args)
                if order.kind == "cuda-fault":
                    self._check_kernel_fault()
                ack = FaultAck(True, armed=self.faults.apply(str(order.kind), dict(order.params or {})))
            except (TensorWasmError, TypeError) as exc:  # ProtocolError, InvalidArgument; params not a map
                err = exc if isinstance(exc, TensorWasmError) else ProtocolError(f"bad fault order: {exc}")
                ack = FaultAck(False, error=err.to_dict())
            sock.send(encode_control("fault_ack", ack.to_wire()), zmq.NOBLOCK)
