"""``hello`` without a capability: the liveness probe that needs no secret and tells nothing of tenants."""

from __future__ import annotations

import msgpack

from shared import protocol as proto
from shared.records import AliveInfo
from tests.helpers.cluster import supervisor
from tests.helpers.raw_client import dealer


def test_alive_answers_the_version_and_readiness_only() -> None:
    with supervisor([{"name": "secret-tenant"}], log_level="error") as sup:
        assert sup.client.alive() == AliveInfo(protocol=proto.PROTOCOL_VERSION, ready=True)
        alive = sup.client.call("hello", None)  # the raw reply: these two keys and nothing else
        assert alive == {"protocol": proto.PROTOCOL_VERSION, "ready": True}
        assert "secret-tenant" not in repr(alive) and str(sup.pid) not in repr(alive)


def test_a_flood_of_unread_probes_leaves_the_supervisor_serving() -> None:
    """30,000 probes from a peer that does not read: every answer that arrives says only
    ``{protocol, ready}``, and a bystander is served meanwhile."""
    with supervisor(log_level="error") as sup:
        flood = dealer(sup.run_dir, SNDHWM=0, RCVHWM=1, RCVBUF=4096)
        try:
            header = proto.encode_request(1, "hello", None, {})
            for _ in range(30_000):  # more small replies than the socket buffers hold
                flood.send(header)
            assert sup.client.alive().ready is True  # a bystander is answered
            assert sup.client.hello().pid == sup.pid
            got = []
            while flood.poll(2000):
                got.append(msgpack.unpackb(flood.recv(), raw=False))
            assert 1 <= len(got) <= 30_000
            probe = {"protocol": proto.PROTOCOL_VERSION, "ready": True}
            assert all(reply == [proto.PROTOCOL_VERSION, 1, True, probe] for reply in got)
        finally:
            flood.close(0)
