"""The supervisor's lifecycle without processes: workers that live on the supervisor's own loop.

:class:`FakeSpawner` plugs into ``Supervisor(spawner=...)``. Each "worker" it
starts is a pair of real DEALER sockets connected to the supervisor's real
backend and control sockets, registered on the supervisor's own
:class:`~supervisor.runtime.loop.Loop`, plus a pipe whose read end is the sentinel
the supervisor polls: closing the write end is the worker's death. Nothing
runs on another thread, and with a :class:`FakeClock` the test decides when
heartbeats, deadlines and restart backoffs fall due - so register, scale,
reset, rolling restart, crash and deadline paths run in milliseconds and the
same way on a loaded machine as on a quiet one.

A fake worker speaks the worker protocol (both hellos with the one-time
token, ``bind``, ``ping``, heartbeats, ``stop``, fault acks) and answers any
other op with an empty success, unless the test told it to ``hang`` (never
answer: the deadline path) or to die (``crash``). Signals arrive through
:meth:`FakeSpawner.signal`: SIGKILL always ends it, SIGTERM unless it was told
to ignore SIGTERM.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from shared import protocol as proto
from shared.config import SupervisorConfig
from shared.worker_link import WorkerHello
from supervisor.runtime.loop import Loop
from supervisor.runtime.workers import SpawnerFactory, WorkerHandle

__all__ = ["FakeClock", "FakeProcess", "FakeSpawner", "FakeWorker"]

#: fake pids start above Linux's pid_max (4,194,304): never a real process
_PID_BASE = 10_000_000


class FakeClock:
    """A monotonic clock that moves only when the test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class FakeProcess:
    """The process side of a fake worker: an exit code once it is dead, and the sentinel pipe."""

    pid: int
    read_fd: int
    write_fd: int
    exitcode: int | None = None
    closed: bool = False

    def join(self, timeout: float | None = None) -> None:
        """Dead or alive, nothing to wait for: a fake worker dies at once."""

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.read_fd)


@dataclass(eq=False)
class FakeWorker:
    """One worker on the supervisor's loop (see the module docstring)."""

    spawner: FakeSpawner
    handle: WorkerHandle
    process: FakeProcess
    data: zmq.Socket[Any]
    control: zmq.Socket[Any]
    #: ops it receives and never answers (a hung op: the deadline path)
    hang_ops: set[str] = field(default_factory=set)
    ignore_sigterm: bool = False
    #: stop answering heartbeats (a hung worker: the liveness path)
    silent: bool = False
    received: list[str] = field(default_factory=list)
    tenant: str | None = None
    instance: int | None = None
    signals: list[int] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.process.exitcode is None

    def say_hello(self) -> None:
        hello = WorkerHello(self.handle.token, self.process.pid).to_wire()
        self.data.send(proto.encode_worker_reply(0, True, hello))
        self.control.send(proto.encode_control("hello", hello))

    def requests(self) -> Iterator[tuple[int, str, Any, list[bytes]]]:
        """The requests waiting on its data socket, each decoded and noted in ``received``: what an
        ``on_data`` (this one, or a test's own) answers."""
        while self.alive:
            try:
                frames = self.data.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            rid, op, args = proto.decode_worker_request(frames[0])
            self.received.append(op)
            yield rid, op, args, frames

    def on_data(self) -> None:
        for rid, op, args, _frames in self.requests():
            if op in self.hang_ops:
                continue
            if op == "bind":
                self.tenant = args["spec"]["tenant_id"]
                self.instance = int(args["instance"])
                result: dict[str, Any] = {"pid": self.process.pid, "backend": args.get("backend")}
            elif op == "ping":
                result = {"pid": self.process.pid, "tenant": self.tenant, "instance": self.instance,
                          "requests": len(self.received), "uptime_s": 0.0}
            else:
                result = {}
            self.data.send(proto.encode_worker_reply(rid, True, result))

    def on_control(self) -> None:
        while self.alive:
            try:
                data = self.control.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            kind, args = proto.decode_control(data)
            if kind == "hb" and not self.silent:
                self.control.send(proto.encode_control("hb", {"requests": len(self.received)}))
            elif kind == "stop":
                self.exit(0)
            elif kind == "fault":
                self.control.send(proto.encode_control("fault_ack", {"ok": True, "armed": True}))

    def exit(self, code: int | None = None, sig: int | None = None) -> None:
        """Die now: sockets closed, sentinel readable, exit code (``-sig`` for a signal) set."""
        if not self.alive:
            return
        self.process.exitcode = -sig if sig is not None else (code or 0)
        loop = self.spawner.loop
        for sock in (self.data, self.control):
            loop.unregister(sock)
            sock.close(0)
        os.close(self.process.write_fd)  # the supervisor's poller sees the sentinel now

    def crash(self, sig: int = signal.SIGSEGV) -> None:
        self.exit(sig=sig)


class FakeSpawner:
    """``Supervisor(spawner=FakeSpawner.factory(loop))``: see the module docstring."""

    method = "fake"

    def __init__(self, loop: Loop, zctx: zmq.Context[Any], endpoints: dict[str, str]) -> None:
        self.loop = loop
        self.zctx = zctx
        self.endpoints = endpoints
        self.workers: list[FakeWorker] = []
        #: applied to each worker as it is spawned (e.g. ``lambda w: w.hang_ops.add("run")``)
        self.on_spawn: list[Callable[[FakeWorker], None]] = []
        self._seq = 0

    @classmethod
    def factory(cls, loop_of: Callable[[], Loop], holder: list[FakeSpawner]) -> SpawnerFactory:
        """A ``SpawnerFactory`` that builds the spawner when the supervisor knows its endpoints
        (inside ``Supervisor.start``, so ``loop_of`` can name the supervisor's loop) and hands it
        to the test through ``holder``."""

        def make(config: SupervisorConfig, endpoints: dict[str, str]) -> FakeSpawner:
            spawner = cls(loop_of(), zmq.Context.instance(), endpoints)
            holder.append(spawner)
            return spawner

        return make

    def warm_up(self) -> None:
        """Nothing to warm."""

    def spawn(self) -> WorkerHandle:
        self._seq += 1
        token = os.urandom(16).hex()
        routing_id = "r" + os.urandom(16).hex()
        read_fd, write_fd = os.pipe()
        process = FakeProcess(_PID_BASE + self._seq, read_fd, write_fd)
        handle = WorkerHandle(worker_id=f"fake-{self._seq}", token=token, process=process, pid=process.pid,
                              sentinel=read_fd, spawned_at=self.loop.clock(), routing_id=routing_id)
        socks = []
        for name in ("backend", "control"):
            sock: zmq.Socket[Any] = self.zctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.ROUTING_ID, routing_id.encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoints[name])
            socks.append(sock)
        worker = FakeWorker(self, handle, process, socks[0], socks[1])
        self.loop.register(worker.data, worker.on_data)
        self.loop.register(worker.control, worker.on_control)
        for hook in self.on_spawn:
            hook(worker)
        self.workers.append(worker)
        worker.say_hello()
        return handle

    def signal(self, handle: WorkerHandle, sig: int) -> None:
        worker = self.by_handle(handle)
        if worker is None or not worker.alive:
            return
        worker.signals.append(sig)
        if sig == signal.SIGKILL or (sig == signal.SIGTERM and not worker.ignore_sigterm):
            worker.exit(sig=sig)

    def rss(self, handle: WorkerHandle) -> int | None:
        worker = self.by_handle(handle)
        return 50 << 20 if worker is not None and worker.alive else None

    # ------------------------------------------------------------ for the tests

    def by_handle(self, handle: WorkerHandle) -> FakeWorker | None:
        return next((w for w in self.workers if w.handle is handle), None)

    def alive(self) -> Iterator[FakeWorker]:
        return (w for w in self.workers if w.alive)

    def of(self, tenant: str) -> list[FakeWorker]:
        """The live workers bound to ``tenant``, by instance."""
        return sorted((w for w in self.alive() if w.tenant == tenant), key=lambda w: w.instance or 0)

    def close(self) -> None:
        """Close what the supervisor's teardown left (sockets of workers it never killed; fds)."""
        for worker in self.workers:
            if worker.alive:
                worker.exit(sig=signal.SIGKILL)
            if not worker.process.closed:
                worker.process.close()
