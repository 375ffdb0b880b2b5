"""A client's first requests, read before its capability was ever verified, are not lost for it.

The frontend queues what carries a token it has not verified yet among the unauthenticated, whose
bytes waiting are bounded hard (supervisor.admission.fairness): one such message always fits,
the next big one is dropped unanswered. A client that pipelines several requests with big bodies
as its first contact has them read in one batch before the first is served (and its token
cached) whenever the loop is slow to read - a loaded host: all but one of them went unanswered,
though its capability was valid (the supervisor counted them as unauthenticated drops). Now a
message that bound would drop has its token verified there: a valid one's requests are its
tenant's; a forged one's are still dropped.

In process, with real (inproc) sockets and a registry's MAC check: the batch is exactly what a
slow loop reads.
"""

from __future__ import annotations

from typing import Any

import zmq

from shared import protocol as proto
from shared.capability import TenantCapability, mac_ok, mint
from shared.errors import TenantIsolationViolation
from supervisor.admission import frontend as fe_mod
from supervisor.admission.fairness import FairTurn
from tests.supervisor.runtime.test_policies import _new_frontend, _table

MiB = 1 << 20
_SECRET, _REGISTRY = b"s" * 32, b"r" * 16


class _MacRegistry:
    """A registry's tenant check: the token's MAC under its secret, or refused."""

    def verify(self, cap: Any) -> str:
        if not mac_ok(cap, _SECRET):
            raise TenantIsolationViolation(None, "not this registry's token", "forged")
        return str(cap.tenant_id)


def test_pipelined_big_first_requests_of_a_valid_capability_are_all_served() -> None:
    table, replies, _, clock, tenants = _table()
    good = mint(TenantCapability, _SECRET, _REGISTRY, 1, "acme").to_bytes()
    forged = mint(TenantCapability, b"f" * 32, _REGISTRY, 1, "acme").to_bytes()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ipc, client, intruder = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        ipc.bind("inproc://first-contact")
        client.connect("inproc://first-contact")
        intruder.connect("inproc://first-contact")
        fe = _new_frontend(table, replies, clock, tenants, ipc)
        fe.registry = _MacRegistry()  # type: ignore[assignment]
        served: list[tuple[bytes, int]] = []
        fe.serve = lambda msg: served.append((msg.cap_raw or b"", msg.rid))  # type: ignore[method-assign]
        body = bytes(16 * MiB)  # each one the whole byte bound of the unauthenticated backlog

        def read_all(sender: zmq.Socket[bytes], cap: bytes, n: int) -> None:
            for rid in range(1, n + 1):  # queued before the loop reads any: one batch
                sender.send_multipart([proto.encode_request(rid, "run_wasm", cap, {"export": "run"}), body],
                                      copy=False)
            assert ipc.poll(10_000)
            fe._on_readable(ipc, fe_mod._IPC)
            while fe.guard.fair.backlog:
                fe.end_turn()

        read_all(client, good, 3)
        assert served == [(good, 1), (good, 2), (good, 3)]
        assert fe.guard.fair.dropped == 0
        # the bound still holds for a token that does not verify: one waits, the rest is dropped
        read_all(intruder, forged, 3)
        assert served[3:] == [(forged, 1)]
        assert fe.guard.fair.dropped == 2
    finally:
        for sock in (client, intruder, ipc):
            sock.close(0)
        ctx.term()


def test_promoted_items_keep_their_order_ahead_of_their_tenants_and_leave_the_unauthenticated_bytes() -> None:
    fair: FairTurn[tuple[str, int, int]] = FairTurn(backlog_bytes_max=100, size_of=lambda item: item[2])
    assert fair.add(True, "acme", ("other client", 1, 10))
    assert fair.add(False, b"peer", ("good", 1, 60))
    assert fair.add(False, b"peer", ("forged", 1, 30))
    assert not fair.fits_unauthenticated(60)
    moved = fair.promote(b"peer", "acme", lambda item: item[0] == "good")
    assert moved == [("good", 1, 60)] and fair.queued == 3
    assert fair.add(True, "acme", ("good", 2, 60))  # its next one, verified meanwhile
    assert fair.take() == [("good", 1, 60), ("other client", 1, 10), ("good", 2, 60), ("forged", 1, 30)]
    assert fair.promote(b"nobody", "acme", lambda item: True) == []
