"""File descriptors are a bounded resource, never an abort."""

from __future__ import annotations

import resource
from collections.abc import Iterator
from typing import Any
from contextlib import contextmanager

from supervisor.host.fdlimit import fd_budget, open_fds, raise_fd_limit
from tests.helpers.cluster import supervisor
from tests.helpers.timeouts import scaled


def _limits(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return int(soft), int(hard)
    raise AssertionError("no 'Max open files' line")


@contextmanager
def soft_nofile(soft: int) -> Iterator[None]:
    """This process's soft RLIMIT_NOFILE lowered (children inherit it), restored after."""
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, open_fds() + 64), old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


def test_the_supervisor_raises_its_soft_limit_to_the_hard_limit() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    with soft_nofile(300):
        with supervisor() as sup:
            soft_now, hard_now = _limits(sup.pid)
    assert hard_now == hard or hard == resource.RLIM_INFINITY
    assert soft_now == hard_now  # raised as far as it may go


def test_raise_fd_limit_in_process() -> None:
    with soft_nofile(300):
        soft, hard = raise_fd_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)
        assert soft >= 300
    assert fd_budget(1024) < 1024 - 256 and fd_budget(10) == 16


def test_a_quota_block_costs_the_owner_one_fd_not_two() -> None:
    from shared.quota import QuotaBlock

    blocks = [QuotaBlock.create("fd-warm")]  # the first may start the resource tracker (a pipe)
    before = open_fds()
    blocks += [QuotaBlock.create(f"fd{i}") for i in range(20)]
    try:
        assert open_fds() - before <= 20  # the mapping's descriptor only
    finally:
        for b in blocks:
            b.close()
            b.unlink()


def test_connections_past_the_budget_are_shed_and_connected_clients_keep_working(tmp_path: Any) -> None:
    import time

    import zmq

    from supervisor.admission.connections import FrontendConnections

    ctx = zmq.Context()
    fds0 = open_fds()
    path = str(tmp_path / "f.ipc")
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("ipc://" + path)
    conns = FrontendConnections(router, path, pause=False)  # the gate alone (the pause: test_fd_guard.py)
    conns.gate.budget = 5
    clients = []
    try:
        legit = ctx.socket(zmq.DEALER)
        legit.setsockopt(zmq.LINGER, 0)
        legit.connect("ipc://" + path)
        clients.append(legit)

        def round_trip() -> None:
            legit.send(b"ping")
            while not router.poll(100):
                if conns.monitor.poll(0):
                    conns.on_readable()
            ident, msg = router.recv_multipart()
            assert msg == b"ping"
            router.send_multipart([ident, b"pong"])
            assert legit.poll(5000) and legit.recv() == b"pong"

        round_trip()  # connected before the flood
        for _ in range(40):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect("ipc://" + path)
            clients.append(s)
        deadline = time.monotonic() + scaled(60)  # a hang guard: a loaded machine takes its time
        while conns.gate.shed < 30:
            assert time.monotonic() < deadline, (conns.gate.connected, conns.gate.shed)
            if conns.monitor.poll(100):
                conns.on_readable()
        round_trip()  # connected before the flood: still served
        # the 41 clients' own fds (a mailbox and a connection each) plus what the router
        # kept: its budget, and shed ones retrying at that moment - not one fd per client
        assert open_fds() - fds0 < 41 * 2 + 5 + 20  # without shedding: 41 * 3
    finally:
        for s in clients:
            s.close(0)
        conns.close()
        router.close(0)
        ctx.term()
