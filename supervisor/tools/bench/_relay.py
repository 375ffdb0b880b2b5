"""The raw relay: the least a two-hop request path can be, as a bench's baseline.

Client DEALER -> relay ROUTER|ROUTER -> echo DEALER, the relay and the echo
each a process, frames forwarded as they come (the client identity travels as
an envelope frame, the least a relay can do to route the answer back). No
decode, no capability, no admission: what is left is the hops - wake-ups,
copies, sockets - that any request path on this host pays.

``twt bench route`` sets the supervisor's ping against it on a quiet host;
``twt bench route --flood`` pings it in turn with the victim during each flood,
which shows the host's own latency under the same load (what no admission
policy of the supervisor can take away).
"""

from __future__ import annotations


import zmq

from supervisor.client.launch import SupervisorHandle
from supervisor.tools.bench._children import forked_context

__all__ = ["RawRelay", "local_endpoint"]


def local_endpoint(sup: SupervisorHandle) -> str:
    """Where a local client sends small requests: ``small.ipc`` (``frontend.ipc`` on a supervisor without it)."""
    return f"ipc://{sup.run_dir}/small.ipc" if "small_frontend" in sup.info else f"ipc://{sup.run_dir}/frontend.ipc"

#: the helpers are forks of a preloaded fork server (supervisor.tools.bench._children)
_CTX = forked_context(__name__)


def _relay(frontend: str, backend: str) -> None:
    ctx = zmq.Context()
    f = ctx.socket(zmq.ROUTER)
    b = ctx.socket(zmq.ROUTER)
    f.bind(frontend)
    b.bind(backend)
    peer = b.recv_multipart()[0]  # the echo's hello
    poller = zmq.Poller()
    poller.register(f, zmq.POLLIN)
    poller.register(b, zmq.POLLIN)
    while True:
        for sock, _ in poller.poll():
            if sock is f:
                frames = f.recv_multipart(copy=False)
                if frames[1].bytes == b"quit":
                    b.send_multipart([peer, b"quit"])
                    return
                b.send_multipart([peer, *frames], copy=False)
            else:
                frames = b.recv_multipart(copy=False)
                f.send_multipart(frames[1:], copy=False)


def _echo(backend: str) -> None:
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.connect(backend)
    d.send(b"hello")
    while True:
        frames = d.recv_multipart(copy=False)
        if frames[0].bytes == b"quit":
            return
        d.send_multipart(frames, copy=False)


class RawRelay:
    """The relay and echo processes, listening under ``directory`` (``frontend`` is the
    endpoint to connect a DEALER to); :meth:`close` with that socket ends both."""

    def __init__(self, directory: str) -> None:
        self.frontend = f"ipc://{directory}/relay-front.ipc"
        backend = f"ipc://{directory}/relay-back.ipc"
        self.procs = [_CTX.Process(target=_relay, args=(self.frontend, backend), daemon=True),
                      _CTX.Process(target=_echo, args=(backend,), daemon=True)]
        for p in self.procs:
            p.start()

    def close(self, sock: zmq.Socket[bytes]) -> None:
        sock.send(b"quit")
        for p in self.procs:
            p.join(5)
            if p.exitcode is None:
                p.kill()
                p.join()
