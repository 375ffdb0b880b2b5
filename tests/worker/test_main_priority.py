"""A real worker process (worker.main.run) against a stand-in supervisor: an orderly stop's teardown
- which no request waits for - runs with every thread lowered, and the executor serves at its normal
priority up to the stop.

The worker runs in a child process (a raised nice value cannot be lowered again, and the worker
ends with ``os._exit``); the child wraps ``WorkerServer.close`` (the teardown's first step) to write
what every thread's nice value is at that moment to a file, read from ``/proc/self/task``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import zmq

from shared import protocol as proto
from shared.frames import encode_control
from shared.worker_link import WORKER_WARMED, BootMessage
from tests.helpers.tmp import short_temp_dir

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values: Linux")]

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, sys, threading
from shared.worker_link import BootMessage
import worker.server as server_mod
import worker.main

out = sys.argv[2]

def nices():
    seen = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                seen[tid] = int(f.read().rsplit(")", 1)[1].split()[16])
        except OSError:
            pass
    return seen

base = nices()[str(threading.get_native_id())]
close = server_mod.WorkerServer.close

def recording_close(self):
    with open(out, "w") as f:
        json.dump({"base": base, "at_close": nices(), "served": served}, f)
    close(self)

server_mod.WorkerServer.close = recording_close

ping = server_mod._OPS["ping"]
served = []  # the executor's (thread, nice) at each ping

def recording_ping(server, args, body):
    tid = threading.get_native_id()
    served.append((tid, nices()[str(tid)]))
    return ping(server, args, body)

server_mod._OPS["ping"] = recording_ping
worker.main.run(BootMessage.from_wire(json.loads(sys.argv[1])))
"""


def test_a_worker_serves_at_its_priority_and_tears_down_below_every_request() -> None:
    zctx = zmq.Context()
    data: zmq.Socket[Any] = zctx.socket(zmq.ROUTER)
    control: zmq.Socket[Any] = zctx.socket(zmq.ROUTER)
    with tempfile.TemporaryDirectory(dir=short_temp_dir()) as tmp:
        data.bind(f"ipc://{tmp}/data.ipc")
        control.bind(f"ipc://{tmp}/control.ipc")
        boot = BootMessage(worker_id="w-test", token="tok", routing_id="r-test",
                           data_endpoint=f"ipc://{tmp}/data.ipc", control_endpoint=f"ipc://{tmp}/control.ipc",
                           heartbeat_interval_s=0.5, heartbeat_liveness=20)
        out = os.path.join(tmp, "nices.json")
        proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(boot.to_wire()), out], cwd=ROOT,
                                stderr=subprocess.PIPE, text=True)
        try:
            ident, frame = data.recv_multipart()  # the hello
            assert proto.decode_worker_reply(frame)[:2] == (0, True)
            data.send_multipart([ident, proto.encode_worker_request(1, "ping", {})])
            replies = [proto.decode_worker_reply(data.recv_multipart()[1]) for _ in range(2)]
            assert (0, True, WORKER_WARMED) in replies and any(r[:2] == (1, True) for r in replies)
            cid = control.recv_multipart()[0]
            control.send_multipart([cid, encode_control("stop")])
            assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
            if proc.stderr is not None:
                proc.stderr.close()
            data.close(0)
            control.close(0)
            zctx.term()
        with open(out) as f:
            seen = json.load(f)
    from worker.priority import BACKGROUND_NICE, NICE_MAX

    base = int(seen["base"])
    at_close = {int(k): int(v) for k, v in seen["at_close"].items()}
    assert len(at_close) >= 2  # the executor and the control thread at least
    lowered = min(NICE_MAX, base + BACKGROUND_NICE)
    assert set(at_close.values()) == {lowered}, at_close  # every thread, before the teardown
    served = seen["served"]
    assert served and {nice for _, nice in served} == {base}, served  # the executor: the normal priority
