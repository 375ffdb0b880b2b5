"""The fd guard: a connection flood never aborts the supervisor, even while its loop lags.

libzmq's ipc accept aborts the process at EMFILE. The loop's gate sheds connections past the fd
budget, but only while the loop reads the monitors; these tests stall the loop (a SIGUSR2 handler
that sleeps, installed by tests/helpers/stall_site/sitecustomize.py on the supervisor's
PYTHONPATH) and flood the ipc paths from another process, so nothing here depends on who is
faster: the flood waits for the guard's pause (the paths gone) before it goes past it.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from supervisor.admission.connections import FrontendConnections
from supervisor.admission.fd_guard import PAUSE_DIR, pause_at, resume_at
from supervisor.admission.peers import ConnectionGate
from supervisor.client.api import SupervisorClient
from supervisor.client.launch import SupervisorHandle, launch
from tests.helpers.cluster import FAST, wait_for
from tests.helpers.timeouts import scaled

pytestmark = pytest.mark.timeout(240)

#: the supervisor's fd limit in these tests (as a small host would have it)
LIMIT = 1024
STALL_SITE = str(Path(__file__).resolve().parents[2] / "helpers" / "stall_site")

#: connect WAIT_AT raw unix connections over PATHS (alternating; a connect that finds no path is
#: retried: the guard may pause and resume below its threshold while it catches up) or fewer: a
#: guard that lags pauses from a quarter of the budget, and once it paused above HELD_AT (where it
#: resumes) with every connection accepted (the supervisor's greeting read) it stays paused while
#: they are held, so the loop ends at a connect that finds no path then (it waited out WAIT_S
#: before); then wait until the paths are gone, then try TOTAL - WAIT_AT more, counting those
#: that fail (each wait ends after WAIT_S at most: a hang guard). Blocking connects (a full
#: backlog waits for the accept, SO_SNDTIMEO bounds it): a flood that outruns the accepts must
#: not fail for that. Each sends a ZMTP 3.0 greeting (NULL) and READY as a DEALER, so libzmq's
#: 30 s handshake timer never closes it while the flood waits
_FLOOD = r"""
import os, select, socket, struct, sys, time
ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
hello = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32) + bytes([4, len(ready)]) + ready
paths, total, wait_at, held_at = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
wait_s = float(sys.argv[5])
socks, failed = [], 0

def connect(path):
    s = socket.socket(socket.AF_UNIX)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 10, 0))
    try:
        s.connect(path)
        s.sendall(hello)
    except OSError:
        s.close()
        return None
    return s

def accepted(deadline):
    # until the supervisor greeted every connection (libzmq accepted it: its ACCEPTED event was
    # queued for the guard before), or the deadline
    poll, left = select.poll(), {s.fileno() for s in socks}
    for fd in left:
        poll.register(fd, select.POLLIN)
    while left and time.monotonic() < deadline:
        for fd, _ in poll.poll(100):
            left.discard(fd)
            poll.unregister(fd)
    return not left

deadline, i = time.monotonic() + wait_s, 0
while len(socks) < wait_at and time.monotonic() < deadline:
    s = connect(paths[i % len(paths)])
    i += 1
    if s is None:
        if len(socks) > held_at and accepted(deadline) and not any(os.path.exists(p) for p in paths):
            break  # paused above where it resumes, every connection counted: it stays paused
        time.sleep(0.01)
    else:
        socks.append(s)
deadline = time.monotonic() + wait_s
while any(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
    time.sleep(0.01)
for i in range(total - wait_at):
    s = connect(paths[i % len(paths)])
    if s is None:
        failed += 1
    else:
        socks.append(s)
print(len(socks), failed, flush=True)
sys.stdin.readline()
for s in socks:
    s.close()
"""


@contextmanager
def _flood(paths: list[str], total: int, budget: int) -> Iterator[subprocess.Popen[str]]:
    """The flood (``_FLOOD``) against a frontend whose connection budget is ``budget``: up to its
    pause, then to ``total``."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _FLOOD, ",".join(paths), str(total), str(pause_at(budget)), str(resume_at(budget)),
         str(scaled(20))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (4 * LIMIT, 4 * LIMIT)),
    )
    try:
        yield proc
    finally:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write("\n")
            proc.stdin.close()
        except BrokenPipeError:
            pass
        proc.wait(scaled(30))
        proc.stdout.close()


@contextmanager
def _guard_alone(tmp_path: Any, budget: int) -> Iterator[tuple[FrontendConnections, str, list[socket.socket]]]:
    """A ROUTER bound on ``<tmp_path>/f.ipc`` whose connections a guard thread counts against
    ``budget`` with no loop reading the monitor; the connections, the path and a list the test puts
    its raw connections in (closed at the end, then the guard stopped)."""
    ctx: zmq.Context[Any] = zmq.Context()
    path = str(tmp_path / "f.ipc")
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    conns = FrontendConnections(router, path)
    router.bind("ipc://" + path)
    conns.gate.budget = budget
    socks: list[socket.socket] = []
    try:
        yield conns, path, socks
    finally:
        for s in socks:
            s.close()
        conns.close()
        assert not conns.guard.is_alive()
        router.close(0)
        ctx.term()


def _limited(sup: SupervisorHandle) -> int:
    """Lower the supervisor's fd limit to LIMIT; the connection budget it then uses."""
    resource.prlimit(sup.pid, resource.RLIMIT_NOFILE, (LIMIT, LIMIT))
    st = wait_for(lambda: (s := sup.client.status().supervisor).fd_limit == LIMIT and s, timeout_s=15,
                  what="the lowered limit seen")
    assert st and st.connection_budget is not None
    return st.connection_budget


def test_the_guard_pauses_near_the_budget_resumes_below_it_and_stops_with_close(tmp_path: Any) -> None:
    """The guard thread alone (no loop reads the monitor): the path is renamed into .paused at
    pause_at (or before it: a guard that lags pauses from a quarter of the budget, and once it
    counts more than resume_at it stays paused), accepted connections keep working, and it comes
    back at resume_at."""
    with _guard_alone(tmp_path, 16) as (conns, path, socks):
        while len(socks) < pause_at(16):
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(path)
            except OSError:  # paused: resumed below the threshold once the guard caught up, or held
                s.close()
                wait_for(lambda: os.path.exists(path) or (conns.guard.paused and len(conns.guard._live) > resume_at(16)),
                         what="the path back, or the guard paused past resume_at")
                if os.path.exists(path):
                    continue
                break
            socks.append(s)
        wait_for(lambda: conns.guard.paused, what="paused")
        assert not os.path.exists(path) and os.path.exists(tmp_path / PAUSE_DIR / "f.ipc")
        assert oct(os.stat(tmp_path / PAUSE_DIR).st_mode & 0o777) == "0o700"
        with socket.socket(socket.AF_UNIX) as late, pytest.raises(FileNotFoundError):
            late.connect(path)
        while len(socks) > resume_at(16):
            socks.pop().close()
        wait_for(lambda: not conns.guard.paused, what="resumed")
        assert os.path.exists(path) and not os.path.exists(tmp_path / PAUSE_DIR)
        assert conns.guard.pauses >= 1 and conns.status()["frontend_pauses"] == conns.guard.pauses


def test_the_guard_outlives_an_error_in_one_event_and_pauses_at_the_next(tmp_path: Any) -> None:
    """An error while handling one event (here the first pause's rename) is logged and the guard
    goes on: a dead guard would leave the loop's gate without events - nothing counted, nothing shed."""
    with _guard_alone(tmp_path, 16) as (conns, path, socks):
        guard = conns.guard
        real, failed = guard._rename, []

        def failing_once(pause: bool) -> None:
            if not failed:
                failed.append(pause)
                raise RuntimeError("the first rename fails")
            real(pause)

        guard._rename = failing_once  # type: ignore[method-assign]
        while not guard.paused and len(socks) < 16:
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(path)
            except OSError:  # paused meanwhile
                s.close()
                break
            socks.append(s)
            wait_for(lambda: len(guard._live) >= len(socks), what="the guard counted it")
        wait_for(lambda: guard.paused, what="paused after the failed one")
        assert failed == [True] and guard.is_alive()
        assert not os.path.exists(path)


def test_settle_reads_a_tcp_accept_the_guard_has_not_forwarded_yet(tmp_path: Any) -> None:
    """A message on a TCP connection proves libzmq reported its ACCEPTED; the loop then settles to
    know the connection (the per-source cap, the idle rule). The event passes through the guard
    thread: settle must wait for the guard to forward what it holds, not read only what is forwarded
    (a lagging guard here: each event's handling starts 0.3 s late)."""
    import time

    ctx = zmq.Context()
    ipc = ctx.socket(zmq.ROUTER)
    ipc.setsockopt(zmq.LINGER, 0)
    conns = FrontendConnections(ipc, str(tmp_path / "f.ipc"))
    ipc.bind("ipc://" + str(tmp_path / "f.ipc"))
    guard = conns.guard
    real = guard._drain

    def lagging(*args: Any) -> None:
        time.sleep(0.3)
        real(*args)

    guard._drain = lagging  # type: ignore[method-assign]
    tcp = ctx.socket(zmq.ROUTER)
    tcp.setsockopt(zmq.LINGER, 0)
    conns.watch_tcp(tcp)
    port = tcp.bind_to_random_port("tcp://127.0.0.1")
    conns.tcp_ports.add(port)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"hello")
        assert tcp.poll(scaled(30_000)), "the message never came"
        tcp.recv_multipart()  # its connection's ACCEPTED is with libzmq's monitor or the guard now
        conns.settle()
        assert conns.gate.tcp == 1
    finally:
        dealer.close(0)
        conns.close()
        tcp.close(0)
        ipc.close(0)
        ctx.term()


def _paths(run_dir: str) -> list[str]:
    return [os.path.join(run_dir, "frontend.ipc"), os.path.join(run_dir, "small.ipc")]


def test_a_flood_while_the_loop_stalls_pauses_the_paths_and_never_aborts(tmp_path: Any) -> None:
    """Before: the loop stalled, libzmq accepted the flood until EMFILE and aborted the process
    (``Too many open files (src/ipc_listener.cpp:297)``). Now the guard thread renames the paths
    away at seven eighths of the budget; a client connected before keeps working, a client made
    during the pause is served once the flood is gone, and nothing is left behind."""
    flag = str(tmp_path / "stall")
    run_dir = str(tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": STALL_SITE, "PYTEST_TWT_STALL_FLAG": flag}
    with launch({"supervisor": dict(FAST), "tenant": [{"name": "bystander"}]}, run_dir=run_dir,
                log_level="error", env=env) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "bystander")
        assert c.ping(cap).tenant == "bystander"
        budget = _limited(sup)
        open(flag, "w").close()
        os.kill(sup.pid, signal.SIGUSR2)
        wait_for(lambda: os.path.exists(flag + ".stalled"), what="the loop stalled")
        paths = _paths(run_dir)
        with _flood(paths, LIMIT + 200, budget) as flood:
            assert flood.stdout is not None
            connected, failed = map(int, flood.stdout.readline().split())
            assert sup.process.poll() is None, "the supervisor died (EMFILE in libzmq's ipc accept)"
            assert failed > 0 and connected < LIMIT
            assert not any(os.path.exists(p) for p in paths)  # paused: renamed away
            assert psutil.Process(sup.pid).num_fds() < LIMIT
            os.unlink(flag)  # the loop goes on
            st = wait_for(lambda: (s := c.status().supervisor).frontend_paused and s, what="paused in status")
            assert st and st.frontend_pauses >= 1
            assert c.ping(cap).tenant == "bystander"  # connected before the pause: served
            # a client made during the pause finds no path: libzmq retries until the path is back
            answers: list[object] = []
            late = SupervisorClient(run_dir, timeout_s=scaled(60))
            waiter = threading.Thread(target=lambda: answers.append(late.ping(cap).tenant))
            waiter.start()
            assert not answers  # no path, no answer
        try:
            waiter.join(scaled(90))
            assert answers == ["bystander"]
        finally:
            late.close()
        wait_for(lambda: not c.status().supervisor.frontend_paused, what="resumed")
        assert all(os.path.exists(p) for p in paths)
        assert not os.path.exists(os.path.join(run_dir, PAUSE_DIR))
        assert sup.process.poll() is None
    assert not os.path.exists(os.path.join(run_dir, PAUSE_DIR))
    assert not any(os.path.exists(p) for p in paths)


def test_a_stale_paused_path_is_cleaned_at_start_and_a_stop_while_paused_leaves_none(tmp_path: Any) -> None:
    run_dir = str(tmp_path / "run")
    stale = os.path.join(run_dir, PAUSE_DIR)
    os.makedirs(stale, mode=0o700)
    Path(stale, "frontend.ipc").write_text("left by a crashed supervisor")
    with launch({"supervisor": dict(FAST), "tenant": []}, run_dir=run_dir, log_level="error") as sup:
        assert not os.path.exists(stale)
        budget = _limited(sup)
        paths = _paths(run_dir)
        with _flood(paths, LIMIT + 200, budget) as flood:
            assert flood.stdout is not None
            flood.stdout.readline()
            assert sup.process.poll() is None
            wait_for(lambda: sup.client.status().supervisor.frontend_paused, what="paused in status")
            assert os.path.exists(os.path.join(stale, "small.ipc"))
            sup.process.send_signal(signal.SIGTERM)  # stop while paused
            sup.process.wait(scaled(60))
    assert sup.process.returncode == 0
    assert not os.path.exists(stale)
    assert not any(os.path.exists(p) for p in paths)


def test_the_frontend_resumes_above_what_tcp_may_hold_and_below_its_pause() -> None:
    """Remote connections alone never keep the ipc paths paused: with TCP holding all it may and a
    local client connected, the count is still at or below ``resume_at`` (it was exactly at it,
    so one local client kept the paths away while the remote connections stayed)."""
    for budget in range(16, 5_000):
        tcp = ConnectionGate(budget).tcp_budget
        assert tcp + 1 <= resume_at(budget) < pause_at(budget), budget
