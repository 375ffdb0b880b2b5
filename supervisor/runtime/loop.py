"""Loop plumbing: the clock, timers, the poller and the wake pipe.

Owns: the ``zmq.Poller`` and which handler each socket or fd has, the timer
heap, and a non-blocking self-pipe registered in the poller so that signal
handlers and other threads can wake the loop (:meth:`Loop.wake`).

Touches nothing else: the parts of the supervisor register their sockets
and fds here and get called back on the loop thread. Plain fds (every
worker's sentinel) go into one ``epoll`` whose own fd sits in the zmq
poller: pyzmq rebuilds its poll list on every call, so 64 tenants' sentinels
cost each loop turn ~64 list entries (a ping was 1.19x slower with 64
tenants than with one); through epoll the poller's list stays a dozen long. Every method except
:meth:`Loop.wake` runs on the loop thread; ``wake`` is safe from a signal
handler or any thread (a single ``os.write`` to a non-blocking pipe).

The clock is injectable (``clock=``) so that timer- and deadline-driven
policies are tested without sleeping (trio's ``MockClock`` is the model).
"""

from __future__ import annotations

import heapq
import math
import os
import select
import threading
import time
from typing import Generic, TypeVar
from collections.abc import Callable

import zmq

__all__ = ["Clock", "Handoff", "Loop", "Timer", "Timers"]

T = TypeVar("T")

#: a monotonic clock in seconds (``time.monotonic`` unless a test injects one)
Clock = Callable[[], float]


class Timer:
    """A callback due at ``when``; :meth:`cancel` keeps it from running."""

    __slots__ = ("when", "seq", "fn", "cancelled")

    def __init__(self, when: float, seq: int, fn: Callable[[], None]) -> None:
        self.when = when
        self.seq = seq
        self.fn = fn
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def __lt__(self, other: Timer) -> bool:
        return (self.when, self.seq) < (other.when, other.seq)


class Timers:
    """A heap of one-shot timers on an injectable clock (ties run in the order they were set)."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self._heap: list[Timer] = []
        self._seq = 0

    def after(self, delay: float, fn: Callable[[], None]) -> Timer:
        self._seq += 1
        timer = Timer(self.clock() + delay, self._seq, fn)
        heapq.heappush(self._heap, timer)
        return timer

    def next_due(self) -> float | None:
        """When the earliest live timer is due (None: no timer)."""
        heap = self._heap
        while heap and heap[0].cancelled:
            heapq.heappop(heap)
        return heap[0].when if heap else None

    def run_due(self, now: float) -> int:
        """Run every timer due at ``now``; returns how many ran."""
        heap = self._heap
        ran = 0
        while heap and heap[0].when <= now:
            timer = heapq.heappop(heap)
            if not timer.cancelled:
                timer.fn()
                ran += 1
        return ran

    def __len__(self) -> int:
        return sum(1 for t in self._heap if not t.cancelled)


class Loop:
    """The poller, its handlers and the wake pipe (see the module docstring)."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self.timers = Timers(clock)
        self.poller = zmq.Poller()
        self._handlers: dict[zmq.Socket[bytes] | int, Callable[[], None]] = {}
        #: plain fds: level-triggered epoll, its fd polled with the sockets (None: not Linux)
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        self._fd_handlers: dict[int, Callable[[], None]] = {}
        if self._epoll is not None:
            self.poller.register(self._epoll.fileno(), zmq.POLLIN)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._closed = False
        self.register(self._wake_r, self._drain_wake)

    def register(self, sock_or_fd: zmq.Socket[bytes] | int, handler: Callable[[], None]) -> None:
        """Call ``handler`` on the loop thread whenever ``sock_or_fd`` is readable."""
        if isinstance(sock_or_fd, int) and self._epoll is not None and sock_or_fd != self._wake_r:
            self._epoll.register(sock_or_fd, select.EPOLLIN)
            self._fd_handlers[sock_or_fd] = handler
            return
        self.poller.register(sock_or_fd, zmq.POLLIN)
        self._handlers[sock_or_fd] = handler

    def unregister(self, sock_or_fd: zmq.Socket[bytes] | int) -> None:
        if isinstance(sock_or_fd, int) and sock_or_fd in self._fd_handlers:
            del self._fd_handlers[sock_or_fd]
            assert self._epoll is not None
            try:
                self._epoll.unregister(sock_or_fd)
            except OSError:
                pass  # closed already: the kernel dropped it from the set
            return
        self.poller.unregister(sock_or_fd)
        self._handlers.pop(sock_or_fd, None)

    def poll(self, timeout_s: float) -> list[Callable[[], None]]:
        """Wait up to ``timeout_s`` (shortened to the next timer); the handlers of what is readable."""
        due = self.timers.next_due()
        if due is not None:
            timeout_s = min(timeout_s, max(0.0, due - self.clock()))
        handlers = self._handlers
        out = []
        # whole milliseconds, rounded up: rounded down, the last fraction of a millisecond before a
        # tick or timer polled with 0 and the loop spun (~15 turns per 50 ms tick, idle)
        for s, _ in self.poller.poll(math.ceil(max(0.0, timeout_s) * 1000 - 1e-6)):
            handler = handlers.get(s)
            if handler is not None:
                out.append(handler)
            elif self._epoll is not None and s == self._epoll.fileno():
                fd_handlers = self._fd_handlers
                out.extend(fd_handlers[fd] for fd, _ in self._epoll.poll(0) if fd in fd_handlers)
        return out

    def wake(self) -> None:
        """Wake the loop from a signal handler or another thread (never blocks, never raises)."""
        if self._closed:
            return
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass  # pipe full: the loop is awake already

    def _drain_wake(self) -> None:
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self._epoll is not None:
            self._epoll.close()


class Handoff(Generic[T]):
    """A value the loop thread builds when another thread asks for it (the metrics snapshot).

    Threads: any thread calls :meth:`request`; only the loop thread calls
    :meth:`wanted` and :meth:`publish`. Everything is read and written under
    one condition variable, so a request never misses the publish it waits
    for (the generation number changes) and two scrapes in parallel are both
    answered by one rebuild. The value is replaced whole, never mutated.
    """

    def __init__(self, wake: Callable[[], None], initial: T) -> None:
        self._wake = wake
        self._cond = threading.Condition()
        self._wanted = False
        self._generation = 0
        self._value = initial

    def request(self, timeout_s: float) -> T:
        """Whichever thread: ask the loop for a fresh value; waits at most ``timeout_s``, then the last one."""
        with self._cond:
            generation = self._generation
            self._wanted = True
        self._wake()
        with self._cond:
            self._cond.wait_for(lambda: self._generation != generation, timeout_s)
            return self._value

    def wanted(self) -> bool:
        """Loop thread: has a thread asked since the last publish?

        Read without the lock (it is checked on every loop iteration): a bool read is atomic,
        and a request sets it before it wakes the loop, so the iteration after the wake-up
        sees it.
        """
        return self._wanted

    def publish(self, value: T) -> None:
        """Loop thread: hand over a new value and wake whoever waits."""
        with self._cond:
            self._value = value
            self._generation += 1
            self._wanted = False
            self._cond.notify_all()
