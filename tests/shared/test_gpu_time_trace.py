"""The handover trace: off by default; on, both sides of a real handover write rows that join.

A real board on the real clock (CLOCK_MONOTONIC, what every process shares): a holder lends the
device to a waiter sleeping in ``acquire`` on another thread, and the rows of both sides are
joined into the legs of that one handover by ``twt bench share``'s reader.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.gpu_time import HANDOVER_TRACE_ENV, GpuTimeBoard
from supervisor.tools.bench.share import HANDOVER_LEGS, handover_legs

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def board() -> Iterator[GpuTimeBoard]:
    b = GpuTimeBoard.create(0, quantum_s=0.005)
    try:
        yield b
    finally:
        b.unlink()
        b.close()


def test_the_trace_is_off_by_default(board: GpuTimeBoard, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HANDOVER_TRACE_ENV, raising=False)
    w = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant())
    try:
        assert w.trace is None
    finally:
        w.close()


def test_a_handover_is_traced_from_both_sides_and_joined(board: GpuTimeBoard, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HANDOVER_TRACE_ENV, str(tmp_path))
    wa = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant())
    wb = GpuTimeBoard.attach(board.name, tenant_slot=board.add_tenant())
    assert wa.trace is not None and wb.trace is not None
    try:
        assert wa.try_acquire(time.monotonic_ns())  # busy: wb must wait
        got = threading.Event()

        def waiter() -> None:
            wb.acquire()
            assert wb.trace is not None and wb.worker_slot is not None
            wb.trace.launch(wb.worker_slot, time.monotonic_ns())  # what the gate does at its launch
            got.set()

        th = threading.Thread(target=waiter)
        th.start()
        while board.snapshot().waiting == 0:  # the waiter has marked itself waiting
            got.wait(0.001)
        assert wa.finish(20_000, last=True, idle=True)  # lent to the waiter: a handover by this process
        assert got.wait(30)
        th.join(30)
        wa.trace.flush()
        wb.trace.flush()
        with open(tmp_path / "1.handover", "w", encoding="ascii") as f:  # a worker killed mid-row
            f.write("G 12 34 5x 6 7 0 1 h\nA 1")
        legs = handover_legs(str(tmp_path))
        assert (legs["given"], legs["joined"]) == (1, 1)
        table = legs["legs"]
        assert isinstance(table, dict)
        for name in (HANDOVER_LEGS[1], HANDOVER_LEGS[4], HANDOVER_LEGS[5], HANDOVER_LEGS[6]):
            assert table[name]["n"] == 1 and table[name]["p50_us"] >= 0, name
        # the wake legs are timed when the grantee was asleep at the grant, else it is counted awake
        assert table[HANDOVER_LEGS[2]]["n"] + legs["grantee_awake"] == 1
    finally:
        wb.close()
        wa.close()
