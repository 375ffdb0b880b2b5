"""The host's own request latency during a campaign, per phase: what the latency check allows for.

A chaos campaign compares the healthy tenants' p99 in the fault phase with the fault-free
baseline. On a shared machine (CI beside other jobs, two CPU burners) the fault phase is also
the phase in which workers die and restart - processes that take CPU from everything else on
the host, the healthy tenants' clients and workers included - and the campaign's own client
threads share one interpreter lock with the nemesis. That is not a failure of isolation: no
supervisor can give a tenant CPU the host does not have. A supervisor loop that waits on a
faulty tenant, on the other hand, delays the healthy tenants and nothing else.

So a raw two-hop relay (:mod:`supervisor.tools.bench._relay`: the same hops as a request -
client, relay, echo, relay, client - and no supervisor) is pinged from a thread of the campaign's
own process all along, one ping at a time like a client. Its p99 per phase is the host's own
request latency; the latency check allows the healthy tenants' p99 to grow by what the relay's
grew, on top of ``factor`` times the baseline, and reports both. A campaign that does not check
latency (``--latency-factor 0``) starts no relay: its two processes and a ping every 2 ms were
~2 s of CPU in a 16 s campaign, for an allowance nothing used.
"""

from __future__ import annotations


import shutil
import tempfile
import threading
import time
from collections.abc import Callable

import zmq

from supervisor.tools.bench._relay import RawRelay
from supervisor.tools.chaos.recorder import percentile

__all__ = ["RelayProbe"]

#: pause between two pings, about a chaos client's own pace between requests
PAUSE_S = 0.002
#: a ping not answered within this is recorded at this (the relay is never this slow unless the
#: host stopped it; the probe must not hang the campaign)
PING_TIMEOUT_S = 2.0


class RelayProbe:
    """Round trips through a raw relay, one at a time, tagged with the campaign's phase."""

    def __init__(self, phase: Callable[[], str]) -> None:
        self._phase = phase
        self._samples: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dir = ""
        self._relay: RawRelay | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None

    def start(self) -> None:
        # ipc paths are limited to 107 bytes: a short directory of our own under the temp dir
        self._dir = tempfile.mkdtemp(prefix="twt-relay-")
        self._relay = RawRelay(self._dir)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self._relay.frontend)
        self._thread = threading.Thread(target=self._run, name="chaos-relay-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            t0 = time.perf_counter()
            sock.send(b"ping")
            if poller.poll(int(PING_TIMEOUT_S * 1000)):
                sock.recv()
            rtt = time.perf_counter() - t0
            phase = self._phase()
            with self._lock:
                self._samples.setdefault(phase, []).append(rtt)
            self._stop.wait(PAUSE_S)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        if self._relay is not None and self._sock is not None:
            self._relay.close(self._sock)
        if self._sock is not None:
            self._sock.close(0)
        if self._ctx is not None:
            self._ctx.term()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._relay, self._sock, self._ctx, self._dir = None, None, None, ""

    def p99_ms(self, phase: str) -> float | None:
        """The relay's p99 round trip in ``phase`` (ms); None when it has no sample there."""
        with self._lock:
            values = list(self._samples.get(phase, ()))
        p99 = percentile(values, 0.99)
        return None if p99 is None else round(p99 * 1000, 3)

    def __enter__(self) -> RelayProbe:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

