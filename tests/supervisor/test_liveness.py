"""``hello`` without a capability: the liveness probe that needs no secret and tells nothing of tenants."""

from __future__ import annotations

import msgpack
import pytest

from shared import protocol as proto
from tests.helpers.cluster import supervisor, wait_for
from tests.helpers.raw_client import dealer


def test_alive_answers_the_version_and_readiness_only() -> None:
    with supervisor([{"name": "secret-tenant"}], log_level="error") as sup:
        alive = sup.client.alive()
        assert alive == {"protocol": proto.PROTOCOL_VERSION, "ready": True}
        assert "secret-tenant" not in repr(alive) and str(sup.pid) not in repr(alive)


@pytest.mark.parametrize("op", ["hello", "status"])  # a probe, and a refusal (no capability for an admin op)
def test_a_flood_of_unread_probes_is_bounded_like_unauthenticated_errors(op: str) -> None:
    """A peer that never reads its answers gets at most 64 of them queued beyond what the socket
    buffers hold (then they are dropped and counted, as refusals to unauthenticated peers are), and
    everyone else keeps being served."""
    with supervisor(log_level="error") as sup:
        flood = dealer(sup.run_dir, SNDHWM=0, RCVHWM=1, RCVBUF=4096)
        try:
            header = proto.encode_request(1, op, None, {})
            for _ in range(30_000):  # more small replies than the socket buffers hold
                flood.send(header)
            wait_for(lambda: sup.client.status()["supervisor"]["unauthenticated_dropped"] > 0, timeout_s=60,
                     what="unread probes dropped")
            assert sup.client.alive()["ready"] is True  # a bystander is still answered
            got = []
            while flood.poll(2000):
                got.append(msgpack.unpackb(flood.recv(), raw=False))
            assert 1 <= len(got) < 30_000
            probe = {"protocol": proto.PROTOCOL_VERSION, "ready": True}
            for version, rid, ok, payload in got:
                assert (version, rid) == (proto.PROTOCOL_VERSION, 1)
                assert (ok, payload) == (True, probe) if op == "hello" else payload["code"] == "isolation_violation"
        finally:
            flood.close(0)
