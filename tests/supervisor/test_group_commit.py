"""Registrations that arrive together share one durable commit (issue 25, durable admin ops at the floor).

Eight ``register`` requests pipelined on one socket are read in one turn of the loop; their state
rows are written in one transaction (one fsync), logged as ``state.group_commit``; every one is
answered only after that commit, and every one survives a restart. Real supervisor, stub backend.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from shared import protocol as proto
from shared.spec import TenantSpec
from supervisor.launch import launch
from supervisor.rundir import read_admin_capability
from tests.helpers.cluster import FAST
from tests.helpers.raw_client import dealer

pytestmark = pytest.mark.timeout(180)

N = 8


def test_a_burst_of_registrations_is_one_commit_and_all_of_it_is_durable(tmp_path: Path) -> None:
    run_dir = tempfile.mkdtemp(prefix="twt-g", dir="/tmp")
    log = tmp_path / "supervisor.log"
    try:
        with open(log, "wb") as err:
            with launch({"supervisor": {**FAST, "pool_size": N}, "tenant": []}, run_dir=run_dir,
                        log_level="info", stderr=err) as sup:
                admin = read_admin_capability(run_dir)
                sock = dealer(run_dir, RCVTIMEO=60_000)
                try:
                    frames = [proto.encode_request(i + 1, "register", admin,
                                                   {"spec": TenantSpec(f"g{i}").to_dict()}) for i in range(N)]
                    sup.process.send_signal(signal.SIGSTOP)  # all queued before the supervisor reads any
                    try:
                        for frame in frames:
                            sock.send(frame)
                    finally:
                        sup.process.send_signal(signal.SIGCONT)
                    answered = {}
                    for _ in range(N):
                        rid, ok, payload = proto.decode_reply(sock.recv_multipart()[0])
                        answered[rid] = ok
                    assert answered == {i + 1: True for i in range(N)}
                finally:
                    sock.close(0)
        text = log.read_text(errors="replace")
        grouped = [line for line in text.splitlines() if "state.group_commit" in line]
        assert any(f"tenants={N}" in line for line in grouped), "no group commit of all: " + text[-3000:]
        with launch({"supervisor": {**FAST}, "tenant": []}, run_dir=run_dir) as sup:
            assert sorted(t["tenant_id"] for t in sup.client.status()["tenants"]) == [f"g{i}" for i in range(N)]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
