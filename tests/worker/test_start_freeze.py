"""A worker's start is frozen out of the collector's walks once its warm-up is over or dropped at the
bind (worker.server.freeze_start): a later full collection walks only what the worker made since, not
its ~40,000 start objects (35-80 ms on an op while it may hold the device's lease). Each case runs in a
fresh interpreter: a freeze is for the process's life, and this one's collector must stay as it is."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

_CASE = textwrap.dedent("""
    import gc
    import zmq
    from worker.faults import FaultState
    from worker.server import WorkerServer

    kept = [{"made": "at the start"}]  # what a worker's start keeps for its life
    sock = zmq.Context().socket(zmq.DEALER)  # unconnected: the ``warmed`` notice is dropped, not sent
    server = WorkerServer(sock, FaultState())

    def work():
        yield

    server.idle_work = work()
    if BOUND:
        server.context = object()  # a bind that came before the warm-up ended
    while server.idle_work is not None:
        server._idle_step()
    later = [{"made": "after"}]
    walked = {id(o) for o in gc.get_objects()}
    print(id(kept) in walked, id(kept[0]) in walked, id(later) in walked, gc.get_freeze_count() > 0)
    sock.close(0)
""")


@pytest.mark.parametrize("bound", [False, True], ids=["warm-up over", "bound first"])
def test_the_start_is_frozen_once_the_warm_up_ends(bound: bool) -> None:
    proc = subprocess.run([sys.executable, "-c", f"BOUND = {bound}\n" + _CASE],
                          capture_output=True, text=True, timeout=100, check=False)
    assert proc.returncode == 0, proc.stderr
    kept_walked, kept_item_walked, later_walked, frozen = proc.stdout.split()
    assert (kept_walked, kept_item_walked, frozen) == ("False", "False", "True")
    assert later_walked == "True"  # what the worker makes after (a tenant's state) is still collected
