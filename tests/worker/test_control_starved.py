"""The worker's control thread, itself starved, does not take the supervisor for slow.

A poll that timed out just before the supervisor's beat came, then a thread that waited seconds
for a CPU (or the interpreter) before it looked at the clock: the beat is queued, unread. The
thread reads what is queued before it judges the supervisor, so no ``worker.supervisor_slow``.
A real ROUTER stands in for the supervisor; the starvation is a clock that jumps at that poll.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from shared.log import _fields_of
from shared.protocol import decode_control, encode_control
from shared.worker_link import BootMessage
from worker import control
from worker.faults import FaultState

pytestmark = pytest.mark.timeout(60)


def test_a_starved_control_thread_reads_the_queued_beat_before_judging_the_supervisor(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    zctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = zctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = "inproc://control-starved"
    router.bind(endpoint)
    offset = [0.0]
    real_monotonic = time.monotonic
    starve = threading.Event()  # set: the next timed poll "times out" and the thread starves
    polling = threading.Event()  # the thread is in that poll
    sent = threading.Event()  # the supervisor's beat is queued for it
    real_poll = zmq.Socket.poll

    def poll(self: zmq.Socket[bytes], timeout: int | None = None, flags: int = zmq.POLLIN) -> int:
        if starve.is_set() and timeout and threading.current_thread().name == "twt-control":
            starve.clear()
            polling.set()
            assert sent.wait(30)  # the beat came while it waited ...
            offset[0] += 30.0  # ... and the thread ran again 30 s later (the window: 10 s)
            return 0
        return int(real_poll(self, timeout, flags))

    monkeypatch.setattr(zmq.Socket, "poll", poll)
    monkeypatch.setattr(control, "time", SimpleNamespace(monotonic=lambda: real_monotonic() + offset[0]))
    boot = BootMessage(worker_id="w", token="t" * 32, routing_id="r" * 32, data_endpoint="inproc://unused",
                       control_endpoint=endpoint, heartbeat_interval_s=0.2, heartbeat_liveness=50,
                       supervisor_pid=os.getpid(), supervisor_started=None)
    stop = threading.Event()
    stats: Any = SimpleNamespace(requests=0)
    thread = control.ControlThread(zctx, boot, FaultState(), stop, stats)
    caplog.set_level(logging.INFO)
    thread.start()
    try:
        ident, hello = router.recv_multipart()
        assert decode_control(hello)[0] == "hello"
        router.send_multipart([ident, encode_control("hb")])
        starve.set()
        assert polling.wait(30)
        router.send_multipart([ident, encode_control("hb")])
        sent.set()
        # its answers to the next beats: it has run its judgement after the starvation by then
        for n in range(3):
            if n:
                router.send_multipart([ident, encode_control("hb")])
            while decode_control(router.recv_multipart()[1])[0] != "hb":
                pass
    finally:
        stop.set()
        thread.join(30)
        router.close(0)
        zctx.term()
    assert not thread.is_alive()
    assert [(r.getMessage(), _fields_of(r)) for r in caplog.records if "supervisor_slow" in r.getMessage()] == []
