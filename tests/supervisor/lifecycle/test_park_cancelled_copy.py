"""A park cancelled while one of its copies is on the way: the chunk that comes back after the
cancel is dropped (its parked file is gone), nothing fails on the supervisor's loop, and the
tenant's host charge is what it was before the park (fake workers, fake clock).

A request for a tenant whose buffers are still being copied cancels the park at once (the tenant
simply stays active); the worker's answer to the chunk it was copying then arrives for a copy
that no longer exists. Seen on a starved host as an internal error at dispatch ("the parked file
is sealed") that also skipped the rest of that reply's handling.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shared import protocol as proto
from tests.helpers.fake_workers import FakeWorker
from tests.supervisor.lifecycle.test_lifecycle_inprocess import Harness

pytestmark = pytest.mark.timeout(60)

NBYTES = 4096
HANDLE = 7


def _exporting_worker(worker: FakeWorker, held: list[int]) -> None:
    """``worker`` lists one buffer for the park, keeps every ``export_chunk`` unanswered (its rid
    in ``held``) and answers the rest as a fake worker does."""

    def on_data() -> None:
        for rid, op, args, _frames in worker.requests():
            if op == "export_buffers":
                worker.data.send(proto.encode_worker_reply(rid, True, {"buffers": [[HANDLE, NBYTES]], "seq": 1}))
            elif op == "export_chunk":
                assert args == {"handle": HANDLE, "offset": 0, "nbytes": NBYTES}
                held.append(rid)
            else:
                result: dict[str, Any] = {}
                if op == "ping":
                    result = {"pid": worker.process.pid, "tenant": worker.tenant, "instance": worker.instance,
                              "requests": len(worker.received), "uptime_s": 0.0}
                elif op == "bind":
                    worker.tenant = args["spec"]["tenant_id"]
                    worker.instance = int(args["instance"])
                    result = {"pid": worker.process.pid, "backend": args.get("backend")}
                worker.data.send(proto.encode_worker_reply(rid, True, result))

    loop = worker.spawner.loop
    loop.unregister(worker.data)
    loop.register(worker.data, on_data)


def test_a_chunk_answered_after_its_park_was_cancelled_is_dropped(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    try:
        cap = h.register("sleepy", instances=1, idle_timeout_s=1.0)
        h.until(lambda: h.tenant("sleepy")["state"] == "running")
        (worker,) = h.spawner.of("sleepy")
        held: list[int] = []
        _exporting_worker(worker, held)
        before = h.call("quota", {}, cap)["bytes_in_use"]
        h.tick(3.0)  # idle past its timeout: the park begins, its one chunk is asked for and held
        h.until(lambda: bool(held))
        assert h.tenant("sleepy")["state"] != "parked"
        assert h.call("quota", {}, cap)["bytes_in_use"] == before + NBYTES  # the host copy is charged
        # a request now cancels the park: the tenant stays active and is served
        assert h.call("ping", {}, cap)["pid"] == worker.process.pid
        assert h.call("quota", {}, cap)["bytes_in_use"] == before  # the charge released with the cancel
        # the chunk that was on its way arrives for a copy that no longer exists
        worker.data.send_multipart([proto.encode_worker_reply(held[0], True, {"nbytes": NBYTES}),
                                    b"\xa5" * NBYTES])
        h.settle()
        assert h.call("ping", {}, cap)["pid"] == worker.process.pid
        assert h.sup.internal_errors == 0
        assert h.call("quota", {}, cap)["bytes_in_use"] == before
        assert h.tenant("sleepy")["state"] == "running"
        assert not list((tmp_path / "run" / "parked").glob("p*"))  # the cancelled copy's file is gone
    finally:
        h.close()
