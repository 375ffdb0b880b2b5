"""A process that can reach backend.ipc / control.ipc cannot squat a worker's identity.

Worker labels (``w<nonce>-<n>``) are published on the events socket and are
predictable; the ZeroMQ identity a worker connects with used to be that
label, so a squatter connecting first with the next labels shut the real
workers out and the tenant never came up. Identities are now 128 random
bits that are never published, and a worker proves its per-spawn secret in
its hello before it is bound.
"""

from __future__ import annotations

import os
import re
import time

import zmq

from shared import protocol as proto
from shared.spec import TenantSpec
from supervisor.observe.events import TOPIC_PREFIX, decode_event
from tests.helpers.cluster import supervisor, tenant, wait_for


def test_squatting_the_next_worker_labels_does_not_shut_out_real_workers() -> None:
    with supervisor() as sup:
        c = sup.client
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC_PREFIX + b"spawn")
        sub.connect("ipc://" + os.path.join(sup.run_dir, "events.ipc"))
        squatters: list[zmq.Socket] = []  # type: ignore[type-arg]
        label = ""

        def spawned() -> bool:
            nonlocal label
            c.register(None, TenantSpec(f"first-{time.monotonic_ns()}"))
            if sub.poll(2000):
                label = decode_event(sub.recv_multipart())["worker"]
            return bool(label)

        wait_for(spawned, timeout_s=30, what="a spawn event")  # a SUB joins asynchronously
        sub.close(0)
        m = re.fullmatch(r"(w[0-9a-f]+)-(\d+)", label)
        assert m, label
        try:
            for n in range(int(m.group(2)) + 1, int(m.group(2)) + 9):
                for name in ("backend", "control"):
                    s = ctx.socket(zmq.DEALER)
                    s.setsockopt(zmq.LINGER, 0)
                    s.setsockopt(zmq.ROUTING_ID, f"{m.group(1)}-{n}".encode())
                    s.connect("ipc://" + os.path.join(sup.run_dir, f"{name}.ipc"))
                    if name == "backend":
                        s.send(proto.encode_worker_reply(0, True, {"token": "0" * 32, "pid": 1}))
                    else:
                        s.send(proto.encode_control("hello", {"token": "0" * 32}))
                    squatters.append(s)
            cap = c.register(None, TenantSpec("second").with_instances(2), timeout_s=30)
            assert c.ping(cap)
            rec = tenant(c.status(), "second")
            assert rec.state == "running" and len(rec.pids) == 2
            # the identities in use are not the published labels
            for s in squatters:
                assert not s.poll(0)  # nothing was routed to a squatter
        finally:
            for s in squatters:
                s.close(0)
