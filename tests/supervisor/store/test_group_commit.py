"""Registrations that arrive while a commit runs share one durable commit (admin ops at the floor).

A registration's commit runs on the state's writer thread while the loop serves on. Here the first
one's commit is held up on purpose - this test holds SQLite's write lock on the state database - while
seven more registrations arrive: the loop keeps serving (``status`` answers, all eight tenants are
applied), nobody is answered before being durable, and once the lock is released the rows waiting
go in one transaction (logged as ``state.group_commit``, one fsync). Every one survives a
restart. Deterministic: no timing is assumed. Real supervisor, stub backend.
"""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
from pathlib import Path

import pytest

from shared import protocol as proto
from shared.spec import TenantSpec
from supervisor.client.launch import launch
from supervisor.store.rundir import read_admin_capability
from tests.helpers.cluster import FAST, wait_for
from tests.helpers.raw_client import dealer
from tests.helpers.tmp import short_temp_dir

pytestmark = pytest.mark.timeout(180)

N = 8


def test_registrations_arriving_during_a_commit_are_one_commit_and_all_durable(tmp_path: Path) -> None:
    run_dir = tempfile.mkdtemp(prefix="twt-g", dir=short_temp_dir())
    log = tmp_path / "supervisor.log"
    try:
        with open(log, "wb") as err:
            with launch({"supervisor": {**FAST, "pool_size": N}, "tenant": []}, run_dir=run_dir,
                        log_level="info", stderr=err) as sup:
                admin = read_admin_capability(run_dir)
                wait_for(lambda: sup.client.status().supervisor.pool.idle >= N, timeout_s=120,
                         what="a full warm pool")
                holder = sqlite3.connect(Path(run_dir) / "state" / "state.db", isolation_level=None, timeout=30)
                holder.execute("BEGIN IMMEDIATE")  # the writer's next commit waits for this
                sock = dealer(run_dir)
                try:
                    for i in range(N):
                        sock.send(proto.encode_request(i + 1, "register", admin,
                                                       {"spec": TenantSpec(f"g{i}").to_dict()}))
                    # the loop is not blocked by the held commit: all eight applied, none answered
                    wait_for(lambda: len(sup.client.status().tenants) == N, timeout_s=4,
                             what="eight registrations applied while the commit waits")
                    assert not sock.poll(0), "a registration was answered before it was durable"
                    holder.execute("ROLLBACK")
                    answered = {}
                    for _ in range(N):
                        assert sock.poll(60_000), f"only {len(answered)} of {N} answered"
                        rid, ok, payload = proto.decode_reply(sock.recv_multipart()[0])
                        answered[rid] = (ok, payload)
                    assert all(ok for ok, _ in answered.values()), answered
                    assert sorted(answered) == list(range(1, N + 1))
                finally:
                    sock.close(0)
                    holder.close()
        grouped = [line for line in log.read_text(errors="replace").splitlines() if "state.group_commit" in line]
        # the rows the writer took before it blocked went in one transaction, the rest in the next:
        # one of the two holds at least half of them
        sizes = [int(line.split("tenants=")[1].split()[0]) for line in grouped]
        assert sizes and max(sizes) >= N // 2, grouped
        with launch({"supervisor": {**FAST}, "tenant": []}, run_dir=run_dir) as sup:
            assert sorted(t.tenant_id for t in sup.client.status().tenants) == [f"g{i}" for i in range(N)]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
