"""The fd guard: a thread that reads the frontend's connection monitors, pauses the ipc paths
near the fd budget, and sheds connections that feed a message that never ends.

:class:`supervisor.admission.connections.FrontendConnections` builds the monitors and hands
each to :class:`PathGuard`, which forwards every event to the loop's gate unchanged; what
the guard decides on its own, without the loop, is below.

The pause: what keeps the abort impossible when the loop lags. Shedding needs
the loop, and libzmq's I/O thread accepts whether the loop reads the monitors
or not (a loop that lags a few seconds on a busy host let a connection flood
reach the limit: ``Too many open files (src/ipc_listener.cpp:297)``; libzmq
4.3.5's ipc accept tolerates EAGAIN, EINTR, ECONNABORTED, EPROTO and ENFILE,
not EMFILE; its TCP accept reports EMFILE as a failed accept and goes on). So
a guard thread (:class:`PathGuard`), not the loop, reads the monitors: it
blocks on them, counts every live connection (ipc and TCP) and forwards each
event to the loop's gate unchanged. Once the connections reach
:func:`pause_at` (seven eighths of the budget) it renames ``frontend.ipc`` and
``small.ipc`` into ``<run dir>/.paused/`` (0700: a client-group peer cannot
reach them there); back at :func:`resume_at` (a sixteenth above the three
quarters TCP may hold) it renames them back. A unix socket's listening fd keeps its accepted
connections and its backlog across a rename: connected clients never notice,
and a connect that finds no path fails (ENOENT) and libzmq's client retries
every ``reconnect_ivl`` (100 ms), its messages queued meanwhile. Each ipc
listener's backlog is :data:`IPC_BACKLOG`.

Why no accept can meet EMFILE. The guard reads one event ahead: while another
waits unread, its count lags libzmq's by an unknown number, so it pauses from a
quarter of the budget (``B`` = :func:`~supervisor.host.fdlimit.fd_budget`, half
of the soft limit after the 256 reserved and the reservations); caught up, at
seven eighths of it (:func:`pause_at`), and it resumes only caught up. A flood
that outruns the guard past ``B/4`` is thereby throttled to the guard's own
pace (pauses and resumes alternate; each is counted). The rest of the process
keeps within the other half of the limit and the reserve, so a pause finds at
least ``256 + B/8`` fds free (caught up) or ``256 + 3B/4`` minus the events
still queued (lagging). After the rename, at most :data:`IPC_BACKLOG` + 1
connections per ipc listener can still be accepted (those already queued). So
an abort needs the I/O thread to accept more connections between the event
that made the pause and the rename (the queued events plus the guard's
reaction: woken by the monitor, the GIL taken back from the loop within its
switch interval, one ``rename``) than ``256 + B/8 - 2 x 33`` = ``190 + B/8``
(caught up: 238 at a 1,024-fd limit, 1,424 at a 20,000 one, 131,000 at 2**20).
The most measured under load (8 or 16 flood processes of greeted connections
beside two CPU burners, load 11: docs/SECURITY.md, the connection row) was 176,
backlog included: covered 8 times at 20,000 fds, hundreds of times at the
limits hosts often give (2**20), and only just at 1,024 (raise the hard limit). TCP
needs no pause (libzmq's TCP accept survives EMFILE) but counts: its
connections use the same fds.

A message that never ends. libzmq counts a multipart message once against RCVHWM and
``MAXMSGSIZE`` bounds a frame, not a message: a peer that sends frames with the MORE flag
and never a last one is read into memory without end (libzmq hands a message over only
once complete; its pipe takes an incomplete one's parts without limit, ~1 GiB/s over one
ipc connection), and libzmq has no option to bound a message's frames or bytes. So the
guard thread also samples the process's memory (``/proc/self/statm``) against
``frontend_memory_bytes`` over its baseline (its RSS when it started): every
:data:`MEMORY_SAMPLE_S` once memory could reach the bound before a later sample, and far below
the bound only as often as growth at :data:`MEMORY_GROWTH_BPS` could bring it that near
(:func:`memory_sample_delay`; at the default bound, 3 GiB, every 0.75 s while calm - an idle
supervisor's guard thread woke ten times a second for nothing). The frontend records, per connection (the ``ZMQ_SRCFD`` of each message it
reads), when its last message completed (:meth:`~supervisor.admission.connections.FrontendConnections.completed`); such
an attack's connection completes none while memory grows. Past the bound the guard
sheds (shuts down) every connection that completed no message since memory was last
below half the bound (a connection that completed none at all among them) - those with
no request in flight; then, each time memory has grown another quarter of the bound,
every connection that completed no message since the last shed, in flight or not
(their replies are lost: the client gets its typed timeout; an attacker that completed
one message just before its endless one is among them) - counted as
``connections_shed_by["memory"]``. The first rule needs memory to take longer than a
sample to grow from half the bound to the bound: a bound of a few hundred MiB or more
(libzmq's I/O thread read ~1 GiB/s from one connection here). Memory past the
bound but not growing is held for the clients (replies, parked bodies: up to
``max_held_bytes``), not a message that never ends: nothing more is shed for it. libzmq
drops a shed connection's partial message with its pipe; the guard then returns the
freed heap to the system (``malloc_trim``). A legitimate idle client is shed with them
and reconnects on its next request (libzmq's reconnect; a TCP client opens a new session
after an idle link anyway). The bound's default (``max_held_bytes`` + 1 GiB) is above
what the frontend may hold by its own bounds, plus room for libzmq's receive queues.

Owns: the guard thread, the monitors' own sockets (the guard's ends), its count of live
connections, the renames and the memory samples.
Threads: :meth:`PathGuard.adopt`, :meth:`PathGuard.sync` and :meth:`PathGuard.stop` from the
loop thread; everything else on the guard thread. It only reads the gate's ``budget`` (an
int, replaced whole, through the callable it is given) and the loop's table of completed
messages (:attr:`PathGuard.completed`).
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Collection, Container

import zmq

from shared.log import get_logger, log_event
from shared.zmq_monitor import monitor_event
from supervisor.admission.peers import shed, shed_tcp

__all__ = ["EVENTS_PER_TURN", "IPC_BACKLOG", "MEMORY_GROWTH_BPS", "MEMORY_SAMPLE_MAX_S", "MEMORY_SAMPLE_S", "PAUSE_DIR",
           "SYNC", "PathGuard", "clean_paused", "memory_sample_delay", "nobody", "pause_at", "resume_at", "rss_bytes"]

_log = get_logger("supervisor.admission.fd_guard")
#: monitor events handled per turn, by the guard and by the loop (the rest wait in the monitor's queue)
EVENTS_PER_TURN = 256
#: at most one log line per kind this often
_LOG_EVERY_S = 10.0
#: what the guard forwards on the TCP monitor's queue once it has read every event libzmq queued
#: before the loop asked for it (:meth:`PathGuard.sync`; never a libzmq event: one frame)
SYNC = b"twt-fd-guard-sync"
#: each ipc listener's ``ZMQ_BACKLOG`` (libzmq's default: 100): what it can still accept once paused
IPC_BACKLOG = 32
#: where a paused ipc socket waits (in the run dir, 0700)
PAUSE_DIR = ".paused"
#: how often the guard samples the process's memory near the bound (a bound set): at ~1 GiB/s of an
#: attack, the bound is passed by at most ~100 MiB before the shed
MEMORY_SAMPLE_S = 0.1
#: the fastest growth the samples further apart allow for (bytes/s): four times the ~1 GiB/s that
#: libzmq's I/O thread read from one connection here (:func:`memory_sample_delay`)
MEMORY_GROWTH_BPS = 4 << 30
#: the longest wait between two samples, however far below the bound
MEMORY_SAMPLE_MAX_S = 1.0
#: after a shed, while memory stays past half the bound, the freed heap is given back this often
#: (libzmq frees a shed connection's pipe on its I/O thread, some time after the shutdown)
_TRIM_EVERY_S = 1.0
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """The process's resident memory (``/proc/self/statm``: ~10 us, no psutil object); 0 where none."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` from the symbols already loaded (``CDLL(None)``, as :mod:`shared.prctl`:
    ``ctypes.util.find_library`` runs ``ldconfig -p`` in a subprocess, at every supervisor's start)."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


#: glibc's malloc_trim (None elsewhere): returns the freed heap of a shed message to the system
_TRIM = _malloc_trim()


def memory_sample_delay(bound: int, grown: int) -> float:
    """How long the guard may wait for its next memory sample, ``grown`` bytes over its baseline.

    As long as growth at :data:`MEMORY_GROWTH_BPS` cannot take memory past ``bound`` before it:
    so the bound is passed by no more between two samples than it is with a sample every
    :data:`MEMORY_SAMPLE_S` (the delay near the bound, and the shortest), for any attack up to
    that rate; at most :data:`MEMORY_SAMPLE_MAX_S`."""
    room = (bound - grown) / MEMORY_GROWTH_BPS
    return min(MEMORY_SAMPLE_MAX_S, max(MEMORY_SAMPLE_S, room))


def pause_at(budget: int) -> int:
    """Connections (ipc and TCP) at which the ipc paths are renamed away: seven eighths of ``budget``."""
    return budget - max(1, budget // 8)


def resume_at(budget: int) -> int:
    """Connections at or below which a paused frontend takes its paths back: thirteen sixteenths
    of ``budget``, a sixteenth above the three quarters TCP may hold
    (:attr:`~supervisor.admission.peers.ConnectionGate.tcp_budget`), so that remote connections
    alone never keep local clients out: at three quarters exactly, one local client connected
    kept the count past it for as long as the remote ones stayed (below a budget of 16 there is
    no room for both; the fd budget is never that small outside tests)."""
    return min(budget - budget // 4 + max(1, budget // 16), pause_at(budget) - 1)


def clean_paused(run_dir: str) -> None:
    """Remove ``<run_dir>/.paused`` and what a crashed supervisor left in it."""
    where = os.path.join(run_dir, PAUSE_DIR)
    try:
        names = os.listdir(where)
    except FileNotFoundError:
        return
    for name in names:
        try:
            os.unlink(os.path.join(where, name))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(where)
    except FileNotFoundError:
        pass


def nobody() -> Container[bytes]:
    """No client has a request in flight (the answer until the frontend gives its own)."""
    return ()


class PathGuard(threading.Thread):
    """The guard thread (see the module docstring): reads the monitors, counts, pauses, forwards.

    Threads: :meth:`adopt` and :meth:`stop` from the loop thread; everything else on the guard
    thread. A monitor is handed over through ``_pending`` (a list append), then the guard is
    woken through an inproc pair (the loop's end sends, the guard's end is in its poll: it
    blocks with no timeout). The guard's sockets are not the context's tracked ones
    (``zmq.Socket(ctx, ...)``): the supervisor's teardown (``Context.destroy``, which must not
    close a socket another thread polls) closes the tracked ones, the loop's end of the pair
    among them, and terminates the context; the guard's poll answers ETERM and it closes its own.
    """

    def __init__(self, budget: Callable[[], int], run_dir: str, pause: bool, memory_bytes: int = 0) -> None:
        super().__init__(name="twt-fd-guard", daemon=True)
        self._budget = budget
        #: the memory bound over :attr:`baseline` (0: none; see the module docstring)
        self.memory_bytes = memory_bytes
        #: the process's RSS when the guard started
        self.baseline = 0
        #: connections shed for memory (read by any thread)
        self.memory_shed = 0
        #: fd -> (when its last message completed, its socket's prefix, that message's routing-id
        #: frame): written by the loop thread (:meth:`~supervisor.admission.connections.FrontendConnections.completed`), read here
        self.completed: dict[int, tuple[float, bytes, zmq.Frame]] = {}
        #: the client keys with a request in flight (the frontend's answer; called from this thread)
        self.busy: Callable[[], Container[bytes]] = nobody
        #: the TCP listeners' ports (FrontendConnections.tcp_ports)
        self.tcp_ports: Collection[int] = ()
        #: per adopted monitor (by index): its ipc listener's path, None for TCP
        self._where: list[str | None] = []
        #: fd -> when the guard saw its last connection end (a completion before it was that one's)
        self._closed_at: dict[int, float] = {}
        self._shed_at = 0.0  # the last shed
        #: when memory was last sampled below half the bound; samples taken (read by any thread)
        self.calm_at = time.monotonic()
        self.samples = 0
        self._shed_rss = 0  # the RSS at the last shed
        self._passes = 0  # sheds since memory was last below half the bound
        self._trim_at = math.inf  # when the heap is next given back (after a shed)
        self._memory_logged = -_LOG_EVERY_S
        self.run_dir = run_dir
        self._pause = pause
        #: (monitor, forward) pairs for the guard to take over
        self._pending: list[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]] = []
        #: the ipc paths renamed away by a pause
        self.paths: list[str] = []
        self._live: set[tuple[int, int]] = set()
        self._stopping = threading.Event()
        #: read by any thread (a bool and ints, replaced whole)
        self.paused = False
        self.pauses = 0
        #: events the loop's gate did not get (its queue full)
        self.lost = 0
        #: the most connections accepted during a pause past the count that made it (the backlog and
        #: the events still queued: the guard's reaction, measured)
        self.overshoot = 0
        self._paused_with = 0
        self._logged = -_LOG_EVERY_S
        #: the wake pair (made with the first monitor): the loop's end, the guard's end
        self._wake: zmq.Socket[bytes] | None = None
        self._woken: zmq.Socket[bytes] | None = None

    def adopt(self, monitor: zmq.Socket[bytes], forward: zmq.Socket[bytes], path: str | None = None) -> None:
        """Take over ``monitor`` (its events forwarded to ``forward``); ``path``: its ipc listener's
        (None: TCP)."""
        self._where.append(path)
        if self._wake is None:
            ctx = monitor.context
            addr = f"inproc://twt-fd-guard-{id(self):x}-{time.monotonic_ns():x}"
            woken: zmq.Socket[bytes] = zmq.Socket(ctx, zmq.PAIR)
            woken.setsockopt(zmq.LINGER, 0)
            woken.bind(addr)
            self._woken = woken
            self._wake = ctx.socket(zmq.PAIR)
            self._wake.setsockopt(zmq.LINGER, 0)
            self._wake.connect(addr)
        self._pending.append((monitor, forward))
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.closed:
            try:
                self._wake.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # its queue full (the guard is awake) or the context gone

    def sync(self) -> bool:
        """(Loop thread) Ask the guard to read every event its monitors hold now and then forward
        :data:`SYNC` on the TCP monitor's queue. False: it cannot be asked (not started, stopping)."""
        if self._wake is None or self._wake.closed or self._stopping.is_set():
            return False
        try:
            self._wake.send(SYNC, zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def _sync(self, owned: dict[zmq.Socket[bytes], tuple[int, zmq.Socket[bytes]]]) -> None:
        """Drain every monitor (the events libzmq queued before the ask: an ACCEPTED precedes any
        message on its connection), then mark the TCP queue: what the loop reads before the mark is
        everything it asked about."""
        for monitor, (index, forward) in owned.items():
            while monitor.poll(0):
                self._drain(monitor, index, forward)
            if index < len(self._where) and self._where[index] is None:
                try:
                    forward.send(SYNC, zmq.NOBLOCK)
                except zmq.Again:
                    self.lost += 1

    def stop(self) -> None:
        self._stopping.set()
        self._poke()
        if self.is_alive():
            self.join()
        if self._wake is not None:
            self._wake.close(0)

    def run(self) -> None:
        poller = zmq.Poller()
        woken = self._woken
        assert woken is not None
        poller.register(woken, zmq.POLLIN)
        owned: dict[zmq.Socket[bytes], tuple[int, zmq.Socket[bytes]]] = {}
        self.baseline = rss_bytes()
        next_sample = time.monotonic()  # the first sample at once (memory_sample_delay)
        try:
            while not self._stopping.is_set():
                while self._pending:
                    monitor, forward = self._pending.pop(0)
                    owned[monitor] = (len(owned), forward)
                    poller.register(monitor, zmq.POLLIN)
                timeout = None
                if self.memory_bytes:
                    timeout = max(0, math.ceil((next_sample - time.monotonic()) * 1000))
                for sock, _ in poller.poll(timeout):
                    if sock is woken:
                        asked = False
                        while woken.poll(0):
                            asked = woken.recv() == SYNC or asked
                        if asked:
                            self._sync(owned)
                        continue
                    index, forward = owned[sock]
                    try:
                        self._drain(sock, index, forward)
                    except zmq.ContextTerminated:
                        raise
                    except Exception as exc:  # noqa: BLE001 - the guard must outlive any one event
                        log_event(_log, logging.ERROR, "supervisor.fd_guard_error", error=repr(exc))
                if self.memory_bytes:
                    now = time.monotonic()
                    if now >= next_sample:
                        next_sample = now + MEMORY_SAMPLE_S
                        try:
                            rss = self._check_memory(now)
                        except Exception as exc:  # noqa: BLE001 - the guard must outlive any one sample
                            log_event(_log, logging.ERROR, "supervisor.fd_guard_error", error=repr(exc))
                        else:
                            next_sample = now + memory_sample_delay(self.memory_bytes, rss - self.baseline)
        except zmq.ContextTerminated:
            pass  # the supervisor's teardown: close ours below
        finally:
            woken.close(0)
            for monitor, (_, forward) in owned.items():
                monitor.close(0)
                forward.close(0)
            for monitor, forward in self._pending:
                monitor.close(0)
                forward.close(0)
            if self.paused:
                clean_paused(self.run_dir)  # the listeners are closed or closing: nothing to take back
            if self.pauses:
                log_event(_log, logging.WARNING, "supervisor.frontend_pauses", pauses=self.pauses,
                          overshoot=self.overshoot, lost=self.lost)

    def _drain(self, monitor: zmq.Socket[bytes], index: int, forward: zmq.Socket[bytes]) -> None:
        try:
            frames: list[bytes] | None = monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        for turn in range(EVENTS_PER_TURN):
            assert frames is not None
            kind, fd = monitor_event(frames)
            if kind == zmq.EVENT_ACCEPTED:
                self._live.add((index, fd))  # a key held already: its DISCONNECTED was lost
            elif kind == zmq.EVENT_DISCONNECTED:
                self._live.discard((index, fd))
                self._closed_at[fd] = time.monotonic()
            try:  # the next one read first: one waiting means the count lags the I/O thread
                after: list[bytes] | None = monitor.recv_multipart(zmq.NOBLOCK) if turn + 1 < EVENTS_PER_TURN else None
            except zmq.Again:
                after = None
            if self._pause:
                self._decide(lagging=after is not None or turn + 1 == EVENTS_PER_TURN)
            try:
                forward.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                self.lost += 1
            frames = after
            if frames is None:
                return

    def _decide(self, lagging: bool) -> None:
        """Pause at :func:`pause_at`, or from a quarter of the budget while events wait unread (the I/O
        thread is ahead by an unknown count); resume at :func:`resume_at` once caught up."""
        live, budget = len(self._live), self._budget()
        if not self.paused:
            if live >= pause_at(budget) or (lagging and live >= budget // 4):
                self._rename(True)
                self._paused_with = live
                now = time.monotonic()
                if now - self._logged >= _LOG_EVERY_S:
                    self._logged = now
                    log_event(_log, logging.WARNING, "supervisor.frontend_paused", connections=live, budget=budget,
                              lagging=lagging, pauses=self.pauses, overshoot=self.overshoot)
        elif live <= resume_at(budget) and not lagging:
            self._rename(False)
        elif live - self._paused_with > self.overshoot:
            self.overshoot = live - self._paused_with

    def _check_memory(self, now: float) -> int:
        """Sample the process's memory; past the bound, shed the connections that completed no
        message since it was last below half the bound (see the module docstring). Returns the
        RSS read last."""
        rss = rss_bytes()
        self.samples += 1
        bound = self.memory_bytes
        if rss - self.baseline <= bound // 2:
            self.calm_at = now
            self._passes = 0
            self._trim_at = math.inf
            return rss
        if now >= self._trim_at and _TRIM is not None:  # the shed connections' messages freed: give them back
            self._trim_at = now + _TRIM_EVERY_S
            _TRIM(0)
            rss = rss_bytes()
        if rss - self.baseline <= bound:
            return rss
        if self._passes and rss < self._shed_rss + bound // 4:
            return rss  # not growing since the last shed: memory held for the clients, not a message
        self._shed_stale(now, rss, everyone=self._passes > 0)
        self._passes += 1
        self._trim_at = now
        return rss

    def _shed_stale(self, now: float, rss: int, everyone: bool) -> None:
        """Shed every connection that completed no message since memory was calm, those with a request
        in flight kept (for the next pass); ``everyone``: every one that completed none since the
        last shed, in flight or not (it sent one complete message just before its endless one)."""
        stale: list[tuple[int, int, bytes | None]] = []
        completed = self.completed
        since = max(self.calm_at, self._shed_at) if everyone else self.calm_at
        for index, fd in list(self._live):
            seen = completed.get(fd)
            if seen is None or seen[0] < self._closed_at.get(fd, -math.inf):  # none on this connection
                stale.append((index, fd, None))
            elif seen[0] < since:
                stale.append((index, fd, seen[1] + seen[2].bytes))
        busy = None if everyone or not any(c is not None for _, _, c in stale) else self._in_flight()
        shed_n = kept = 0
        for index, fd, client in stale:
            if not everyone and client is not None and (busy is None or client in busy):
                kept += 1
                continue
            where = self._where[index] if index < len(self._where) else None
            if shed(fd, where) if where is not None else shed_tcp(fd, self.tcp_ports):
                shed_n += 1
        self.memory_shed += shed_n
        self._shed_rss, self._shed_at = rss, now
        if now - self._memory_logged >= _LOG_EVERY_S:
            self._memory_logged = now
            log_event(_log, logging.WARNING, "supervisor.memory_shed", rss=rss, baseline=self.baseline,
                      bound=self.memory_bytes, shed=shed_n, kept_in_flight=kept, in_flight_too=everyone,
                      connections=len(self._live), memory_shed=self.memory_shed)

    def _in_flight(self) -> Container[bytes] | None:
        """The frontend's clients with a request in flight, read from this thread (None: the loop kept
        changing its tables as they were read)."""
        for _ in range(3):
            try:
                return self.busy()
            except RuntimeError:  # a dict changed size during iteration: the loop's turn
                continue
        return None

    def _rename(self, pause: bool) -> None:
        hidden_dir = os.path.join(self.run_dir, PAUSE_DIR)
        if pause:
            try:
                os.mkdir(hidden_dir, 0o700)
            except FileExistsError:
                pass
            except OSError as exc:  # the run dir unwritable: no pause, shedding still holds the budget
                log_event(_log, logging.ERROR, "supervisor.frontend_pause_failed", path=hidden_dir, pause=pause,
                          error=str(exc))
                return
            os.chmod(hidden_dir, 0o700)
        for path in self.paths:
            hidden = os.path.join(hidden_dir, os.path.basename(path))
            try:
                if pause:
                    os.replace(path, hidden)
                else:
                    os.replace(hidden, path)
            except FileNotFoundError:
                pass  # unlinked by a stop, or never bound
            except OSError as exc:  # the run dir unwritable: shedding still holds the budget
                log_event(_log, logging.ERROR, "supervisor.frontend_pause_failed", path=path, pause=pause,
                          error=str(exc))
        self.paused = pause
        if pause:
            self.pauses += 1
        else:
            try:
                os.rmdir(hidden_dir)  # empty unless a rename back failed: then the socket stays there
            except OSError:
                pass
