"""Worker process entry point: ``run(boot)`` is what the supervisor starts (spawn/forkserver).

Start-up order matters:

1. ``PR_SET_PDEATHSIG(SIGKILL)`` first, then check the parent is still there
   (it may have died before the prctl), so no worker outlives its supervisor;
2. name the process ``twt-worker`` (``ps``, ``top``, the tests' leak check);
3. connect the data socket (executor, this thread) and start the control
   thread (heartbeats, faults, stop) - both say hello with the one-time token;
4. serve until ``stop``; then free every buffer, destroy the context and exit 0.

Heavy imports (numpy, wasmtime, cuda) happen only when a request needs them. The start path's
own modules are imported with this one (the fork server preloads it: a forked worker's ``from ...
import`` statements in ``run`` cost ~0.3 ms of CPU and ~50 copy-on-write faults each start).
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal's C functions (no stub)
import logging
import os
import signal
import sys
import threading

import zmq

from shared.exitcodes import WORKER_CRASHED, WORKER_PARENT_GONE
from shared.frames import encode_worker_reply
from shared.log import configure_logging, get_logger, log_event
from shared.prctl import set_parent_death_signal, set_process_name
from shared.worker_link import BootMessage, WorkerHello
from worker.control import ControlThread
from worker.faults import FaultState
from worker.priority import lower_start
from worker.server import WorkerServer, warm_bind_path, wasm_warm_up

__all__ = ["run"]

#: the worker's GIL switch interval (s). CPython's default is 5 ms, and a worker's threads - the guest's
#: executor, the device thread that launches its next op, the control thread - hand the GIL over only at
#: a blocking call or when its holder has run that long: a device thread woken to launch the next op
#: could wait that long for a guest busy in Python (GPU-QUOTAS.md "Hand over first, and the GIL")
SWITCH_INTERVAL_S = 0.0002


def run(boot: BootMessage) -> None:
    """Serve one tenant instance (or wait in the pool to be bound to one)."""
    set_parent_death_signal(signal.SIGKILL)  # off Linux: heartbeats and the parent check end the worker
    # a pool worker's start yields to the work being served, until it is warmed or bound (restore_start)
    lower_start(boot.start_nice)
    expected_parent = boot.parent_pid
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(WORKER_PARENT_GONE)  # the supervisor died while we were starting
    # A worker ends on SIGTERM like on "stop"; SIGINT (a terminal's ^C) is the supervisor's to handle.
    # (``_signal``'s function: ``signal.signal`` maps the handler it replaces to an enum, and a
    # handler that is a function fails that map with an exception - cold code in a forked worker)
    _signal.signal(signal.SIGINT, _signal.SIG_IGN)  # its own SIG_IGN: the enum's is refused

    set_process_name("twt-worker")
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    configure_logging(boot.log_format, boot.log_level.upper())  # type: ignore[arg-type]
    log = get_logger("worker")

    zctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    data = zctx.socket(zmq.DEALER)
    data.setsockopt(zmq.ROUTING_ID, boot.routing_id.encode())
    data.setsockopt(zmq.LINGER, 0)
    data.setsockopt(zmq.MAXMSGSIZE, boot.max_message_bytes)
    data.setsockopt(zmq.RCVHWM, 1000)
    data.setsockopt(zmq.SNDHWM, 1000)
    data.connect(boot.data_endpoint)

    faults = FaultState()
    server = WorkerServer(data, faults)

    def on_sigterm(signum: int, frame: object) -> None:
        server.stop_event.set()

    _signal.signal(signal.SIGTERM, on_sigterm)
    control = ControlThread(zctx, boot, faults, server.stop_event, server)
    control.start()

    warm_bind_path()  # before the hello: a pool worker's bind is on a registration's critical path
    # after the hello, while it idles in the pool (never after the bind); it says ``warmed`` when
    # done, and the supervisor counts it ready only then (a bind may still come before: it wins)
    server.idle_work = wasm_warm_up()
    data.send(encode_worker_reply(0, True, WorkerHello(boot.token, os.getpid(), warming=True).to_wire()))
    log_event(log, logging.DEBUG, "worker.started", worker=boot.worker_id, pid=os.getpid())
    code = 0
    try:
        server.serve()
        code = server.exit_code if server.exit_code is not None else 0
    except BaseException:
        log.exception("worker.crashed")
        code = WORKER_CRASHED
    finally:
        server.close()
        control.closed.wait(2)
        if server.exit_code is not None:
            # the CudaError reply to the request that lost the context must get out before we exit:
            # linger, and let term() (bounded: it waits for every socket) flush it
            data.close(linger=1000)
            flusher = threading.Thread(target=zctx.term, daemon=True)
            flusher.start()
            flusher.join(2.0)
        else:
            data.close(0)  # no zctx.term(): it would wait for the control thread's socket
        logging.shutdown()
        sys.stderr.flush()
    os._exit(code)
