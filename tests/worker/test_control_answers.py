"""The worker's control thread answers the supervisor's beats and keeps no clock of its own.

Each beat is answered at once; a hung worker (the ``hang`` fault) answers none. A real ROUTER
stands in for the supervisor; the interval is far longer than the test, so an answer can only be
an answer (a beat sent on the worker's own clock would come 1,000 s later).
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from shared.protocol import decode_control, encode_control
from shared.worker_link import BootMessage
from worker import control
from worker.faults import FaultState

pytestmark = pytest.mark.timeout(60)

#: a hang guard: an answer comes at once, and a missing one fails the test after this long
ANSWER_WAIT_MS = 30_000


def _next_kind(router: zmq.Socket[bytes]) -> str:
    assert router.poll(ANSWER_WAIT_MS), "no message from the worker's control thread"
    return str(decode_control(router.recv_multipart()[1])[0])


def test_the_control_thread_answers_each_beat_and_a_hung_one_answers_none() -> None:
    zctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = zctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = "inproc://control-answers"
    router.bind(endpoint)
    boot = BootMessage(worker_id="w", token="t" * 32, routing_id="r" * 32, data_endpoint="inproc://unused",
                       control_endpoint=endpoint, heartbeat_interval_s=1000.0, heartbeat_liveness=3,
                       supervisor_pid=os.getpid(), supervisor_started=None)
    faults = FaultState()
    stats: Any = SimpleNamespace(requests=7)
    thread = control.ControlThread(zctx, boot, faults, threading.Event(), stats)
    thread.start()
    try:
        ident, hello = router.recv_multipart()
        assert decode_control(hello)[0] == "hello"
        for _ in range(3):
            router.send_multipart([ident, encode_control("hb")])
            assert router.poll(ANSWER_WAIT_MS), "a beat went unanswered"
            kind, args = decode_control(router.recv_multipart()[1])
            assert (kind, args) == ("hb", {"requests": 7})
        # hung: the beat is not answered, though the thread still serves the control socket (the
        # fault order after it is acknowledged, and nothing came before that ack)
        faults.hang.set()
        router.send_multipart([ident, encode_control("hb")])
        router.send_multipart([ident, encode_control("fault", {"kind": "nonsense"})])
        assert _next_kind(router) == "fault_ack"
        faults.hang.clear()
        router.send_multipart([ident, encode_control("hb")])
        assert _next_kind(router) == "hb"
    finally:
        router.send_multipart([ident, encode_control("stop")])
        thread.join(30)
        router.close(0)
        zctx.term()
    assert not thread.is_alive()
