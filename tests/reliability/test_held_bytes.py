"""Bytes the supervisor holds for a tenant are bounded per tenant and in total.

Before: a tenant with an 8 MiB GPU cap pipelined 4 MiB reads from four client
identities that never read their replies (+1 GiB in the supervisor), and 60
writes of 16 MiB parked while its instance was down (+731 MiB): the byte
limit on unread replies was checked at admission only and per identity, and
parking was bounded by count. Now every reply and parked body is reserved
against ``max_tenant_held_bytes`` and ``max_held_bytes`` at admission, and
past them the answer is ``Overloaded``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import pytest
import zmq

from shared import protocol as proto
from supervisor.client.launch import SupervisorHandle, launch
from tests.helpers.cluster import FAST, default_start_method, supervisor, tenant, wait_for
from tests.helpers.raw_client import dealer as _dealer, request as _req
from tests.helpers.timeouts import scaled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MiB = 1 << 20
HELD = 32 * MiB


#: glibc's malloc, told to map every block of 1 MiB or more on its own (a fixed threshold: no
#: dynamic raising) so that a freed body goes back to the system at once. With the default, a freed
#: 16 MiB block raises the threshold and later bodies come from the heap, which keeps what was freed
#: as a cache: how much of it is still resident depends on how the bodies' lifetimes interleaved
#: (a loaded host's scheduling), not on what the supervisor holds - the supervisor's RSS grew by
#: 32 or 64 MiB from run to run for the same 32 MiB held, and more beside heavy load.
RETURN_FREED_BLOCKS = {"MALLOC_MMAP_THRESHOLD_": str(1 * MiB)}


@contextmanager
def _supervisor_whose_rss_is_what_it_holds(tenants: list[dict[str, Any]], **settings: Any) -> Iterator[SupervisorHandle]:
    """A supervisor (as :func:`supervisor`) whose large blocks leave its RSS once freed, so that
    an RSS bound measures the bodies it holds and not the allocator's cache."""
    with launch({"supervisor": {**FAST, **settings}, "tenant": tenants}, start_method=default_start_method(),
                env={**os.environ, **RETURN_FREED_BLOCKS}) as handle:
        yield handle


def _codes(sock: zmq.Socket[Any], expected: int, timeout_s: float | None = None) -> list[str]:
    """Read replies until ``expected`` arrived (or ``timeout_s`` passed: a poll's slice; without it
    a hang guard, scaled as every one is)."""
    out: list[str] = []
    deadline = time.monotonic() + (scaled(30.0) if timeout_s is None else timeout_s)
    while len(out) < expected and time.monotonic() < deadline:
        if sock.poll(200):
            _, ok, payload = proto.decode_reply(sock.recv_multipart()[0])
            out.append("ok" if ok else payload["code"])
    return out


def _unanswered_told(status: Any) -> str:
    """Every count of the supervisor's that could explain a missing answer: requests dropped
    unanswered (refused past the refusals' answers; without a verified capability, by reason),
    refusals by what was exceeded, what is parked and in flight, held bytes, and the instance's
    restarts and last exit."""
    sup, t = status.supervisor, tenant(status, "down")
    inst = t.instances[0]
    return (f"; admission_unanswered {sup.admission_unanswered}, refused_by {sup.admission_refused_by}, "
            f"unauthenticated_dropped {sup.unauthenticated_dropped} {sup.unauthenticated_dropped_by}, "
            f"parked {t.parked}, in_flight {t.in_flight}, held {sup.held_bytes}, restarts {t.restarts}, "
            f"instance {inst.state} last_exit {inst.last_exit}")


def test_slow_readers_on_many_identities_are_bounded_per_tenant() -> None:
    tenants = [{"name": "reader", "gpu_memory_bytes_cap": "8MiB", "max_in_flight": 512}, {"name": "other"}]
    with supervisor(tenants, log_level="error", max_tenant_held_bytes=HELD) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "reader")
        handle = c.alloc(cap, 4 * MiB)
        proc = psutil.Process(sup.pid)
        rss0 = proc.memory_info().rss
        socks = [_dealer(sup.run_dir, RCVHWM=1, RCVBUF=4096) for _ in range(4)]
        try:
            for sock in socks:
                for rid in range(1, 65):
                    sock.send(_req(rid, "read", cap, {"handle": handle, "offset": 0, "nbytes": 4 * MiB}))
            wait_for(lambda: tenant(c.status(), "reader").in_flight == 0, timeout_s=60, what="reads answered")
            held = c.status().supervisor.held_bytes
            assert held["total"] <= HELD
            growth = proc.memory_info().rss - rss0
            assert growth < HELD + 64 * MiB, f"supervisor grew {growth >> 20} MiB for 256 unread 4 MiB reads"
            # the readers start reading: what was held arrives, the rest was refused typed
            codes = [code for sock in socks for code in _codes(sock, 64)]
            assert len(codes) == 4 * 64
            assert set(codes) <= {"ok", "overloaded"} and codes.count("overloaded") >= 4 * 64 - HELD // (4 * MiB) - 8
        finally:
            for sock in socks:
                sock.close(0)
        wait_for(lambda: c.status().supervisor.held_bytes["total"] == 0, what="held bytes released")
        assert c.ping(c.tenant_capability(None, "other")).tenant == "other"


def test_parked_bodies_are_bounded_in_bytes() -> None:
    """Requests wait (parked) while the tenant's only instance restarts; their bodies are
    held by the supervisor. A restart backoff keeps it down for seconds: 60 run_wasm with
    16 MiB bodies arrive meanwhile."""
    tenants = [{"name": "down", "restart": "always", "max_restarts": 50, "restart_window_s": 300,
                "request_timeout_s": 20, "max_in_flight": 128}]
    with _supervisor_whose_rss_is_what_it_holds(tenants, log_level="error", max_tenant_held_bytes=HELD) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "down")

        def ready() -> bool:
            inst = tenant(c.status(), "down").instances[0]
            return bool(inst.state == "ready")

        # each crash in the window backs the next restart off further: 0, 50 ms ... 1.6 s, 3.2 s
        for _ in range(8):
            wait_for(ready, timeout_s=30, what="instance ready")
            c.inject_fault(None, "down", "crash")
        wait_for(lambda: not ready(), what="instance down, restarting later")
        proc = psutil.Process(sup.pid)
        rss0 = proc.memory_info().rss
        sock = _dealer(sup.run_dir)
        body = bytes(16 * MiB)  # not a module: the worker refuses it once it gets it
        try:
            for rid in range(1, 61):
                sock.send_multipart([_req(rid, "run_wasm", cap, {"export": "run"}), body], copy=False)
            # the refused ones are answered at once; what waits is bounded by the held bytes. The
            # figures are read once every request was answered or parked (or the instance is back,
            # and sent what waited): a read after the parked ones were answered would find them gone
            # whatever bound held them
            codes: list[str] = []
            # the RSS is read only while the instance is down (before and after the reading): once it
            # is back, the bodies that waited are on their way to the worker, in the supervisor's
            # sockets' queues - memory it sends, not what it holds (a loop starved for the 3.2 s
            # back-off reads the instance back before every request arrived)
            peak = [0]

            def admitted() -> bool:
                codes.extend(_codes(sock, 60 - len(codes), timeout_s=0.1))
                if not ready():
                    rss = proc.memory_info().rss
                    if not ready():
                        peak[0] = max(peak[0], rss - rss0)
                return len(codes) + tenant(c.status(), "down").parked >= 60 or ready()

            wait_for(admitted, timeout_s=60, what="every request answered or parked")
            status = c.status()
            assert tenant(status, "down").parked <= HELD // (16 * MiB)
            assert status.supervisor.held_bytes["parked"] <= HELD
            assert peak[0] < HELD + 96 * MiB, f"supervisor grew {peak[0] >> 20} MiB parking 60 x 16 MiB"
            codes += _codes(sock, 60 - len(codes))  # the parked ones go to the worker once it is back
            # every request answered; the held bytes' bound refused some (how many depends on how many
            # of the 960 MiB arrived before the instance was back: those after it are sent, not parked -
            # the bound itself is asserted above, on what waited)
            said = "" if len(codes) == 60 else _unanswered_told(c.status())
            assert len(codes) == 60 and codes.count("overloaded") >= 1, f"{len(codes)} answers {codes}{said}"
            # nothing dropped unanswered: these requests carried a valid capability (their client's
            # first, pipelined before the first was served: the supervisor verified it then)
            late = c.status().supervisor
            assert late.unauthenticated_dropped == 0 and late.admission_unanswered == 0, _unanswered_told(c.status())
            assert set(codes) <= {"overloaded", "wasm_compile", "kernel_timeout", "worker_lost"}
            assert "wasm_compile" in codes, codes  # parked, then sent once the instance was back
        finally:
            sock.close(0)
        wait_for(lambda: c.status().supervisor.held_bytes["total"] == 0, what="held bytes released")
