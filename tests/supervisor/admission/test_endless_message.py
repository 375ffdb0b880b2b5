"""A message that never ends: a peer that sends frames with the MORE flag and never a last one.

libzmq hands a message to the application only once complete, and bounds a frame
(``MAXMSGSIZE``), not a message: without the memory guard the supervisor read such a
peer's frames into memory without end (~1 GiB/s over one ipc connection). With it
(``frontend_memory_bytes``, low here so the test stays small), the connection is shed
once memory passes the bound, memory comes back under it, a client connected before
(idle) is served again (libzmq reconnects it) and a bystander tenant keeps being served.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import psutil
import pytest

from supervisor.client.api import SupervisorClient
from supervisor.client.launch import launch
from tests.helpers.cluster import FAST, wait_for
from tests.helpers.timeouts import scaled

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
#: the bound the supervisor is given
BOUND = 64 * MiB

#: a raw ZMTP 3.0 NULL client (READY as a DEALER) on argv[1] that sends 64 KiB frames, each with
#: the MORE flag, until argv[2] bytes are sent or the supervisor closes the connection; prints
#: the bytes sent and whether it was shed
_ENDLESS = r"""
import socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(30)
s.connect(sys.argv[1])
ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
s.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32) + bytes([4, len(ready)]) + ready)
s.recv(64)
frame = b"\x03" + struct.pack(">Q", 65536) + b"x" * 65536
sent, limit, shed = 0, int(sys.argv[2]), False
try:
    while sent < limit:
        s.sendall(frame)
        sent += len(frame)
except OSError:
    shed = True
print(sent, int(shed), flush=True)
"""


def _attack(path: str, limit: int) -> tuple[int, bool]:
    out = subprocess.run([sys.executable, "-c", _ENDLESS, path, str(limit)], capture_output=True, text=True,
                         timeout=scaled(60), check=True).stdout.split()
    return int(out[0]), bool(int(out[1]))


@pytest.mark.parametrize("socket_name", ["frontend.ipc", "small.ipc"])
def test_a_message_that_never_ends_is_shed_and_memory_comes_back(tmp_path: Any, socket_name: str) -> None:
    run_dir = str(tmp_path / "run")
    config = {"supervisor": {**FAST, "frontend_memory_bytes": BOUND}, "tenant": [{"name": "bystander"}]}
    with launch(config, run_dir=run_dir, log_level="error") as sup:
        c = sup.client
        cap = c.tenant_capability(None, "bystander")
        assert c.ping(cap).tenant == "bystander"
        idle = SupervisorClient(run_dir, timeout_s=scaled(30))  # connected before the attack, then idle
        try:
            assert idle.ping(cap).tenant == "bystander"
            proc = psutil.Process(sup.pid)
            before = proc.memory_info().rss
            sent, shed = _attack(os.path.join(run_dir, socket_name), 4 * BOUND)
            assert sup.process.poll() is None
            assert shed and sent < 4 * BOUND, f"not shed after {sent >> 20} MiB"
            st = wait_for(lambda: (s := c.status().supervisor).connections_shed_by.get("memory") and s,
                          timeout_s=scaled(10), what="the memory shed counted")
            assert st and st.connections_shed >= st.connections_shed_by["memory"] >= 1
            assert c.ping(cap).tenant == "bystander"  # the bystander is served
            assert idle.ping(cap).tenant == "bystander"  # shed with the attacker or not: served again
            wait_for(lambda: proc.memory_info().rss < before + BOUND, timeout_s=scaled(10),
                     what="memory back under the bound")
        finally:
            idle.close()
