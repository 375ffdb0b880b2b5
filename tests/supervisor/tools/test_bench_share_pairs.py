"""The paired estimates of ``twt bench share`` (``--mix``'s heavy vs control; scheduler on vs off
and together vs alone): blocks of two kinds in A B B A order, each kind's load paused while the other
runs, neighbouring blocks paired (one ratio each), and a distribution-free confidence interval of
the pairs' median (supervisor.tools.bench.share)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import pytest

from supervisor.tools.bench.share import Valve, abba, median_ci, paired_blocks, pair_ratios

pytestmark = pytest.mark.timeout(30)


def _block(device: int, rate: float) -> dict[str, object]:
    return {"device": device, "rate": rate}


def test_neighbouring_blocks_are_paired_in_either_order() -> None:
    blocks = [_block(0, 100.0), _block(1, 90.0), _block(1, 45.0), _block(0, 50.0), _block(0, 200.0), _block(1, 220.0)]
    assert pair_ratios(blocks) == pytest.approx([0.9, 0.9, 1.1])


def test_a_pair_without_both_kinds_or_with_a_zero_control_is_left_out() -> None:
    assert pair_ratios([_block(0, 100.0), _block(0, 90.0), _block(0, 0.0), _block(1, 5.0)]) == []
    assert pair_ratios([_block(0, 100.0), _block(1, 90.0), _block(1, 45.0)]) == pytest.approx([0.9])  # odd one out


def test_the_median_interval_is_the_sign_tests_order_statistics() -> None:
    xs = [float(i) for i in range(1, 26)]  # n = 25: [x_8, x_18] (P(Binomial(25, 1/2) <= 7) = 0.0216)
    assert median_ci(xs) == (8.0, 18.0)
    assert median_ci(list(reversed(xs))) == (8.0, 18.0)  # order does not matter
    n, j = 25, 8
    below = sum(math.comb(n, i) for i in range(j)) / 2 ** n
    assert below <= 0.025 < below + math.comb(n, j) / 2 ** n


def test_few_values_give_their_range_and_none_give_zeros() -> None:
    assert median_ci([3.0, 1.0, 2.0]) == (1.0, 3.0)
    assert median_ci([0.9]) == (0.9, 0.9)
    assert median_ci([]) == (0.0, 0.0)
    assert median_ci([float(i) for i in range(6)]) == (0.0, 5.0)  # n = 6: P(X = 0) = 1/64 <= 0.025: j = 1


# -- the paired rows of ``twt bench share`` (scheduler on / off, together / alone): short blocks A B B A


def test_abba_alternates_the_order_pair_by_pair() -> None:
    assert abba(4) == [0, 1, 1, 0, 0, 1, 1, 0]
    assert abba(0) == []
    order = abba(5)
    assert [sorted(order[i:i + 2]) for i in range(0, 10, 2)] == [[0, 1]] * 5  # each pair one of each kind


def test_a_closed_valve_waits_for_the_runs_in_flight_and_a_stopped_one_ends_its_loops() -> None:
    valve = Valve()
    ran: list[str] = []
    release = threading.Event()

    def loop() -> None:
        while valve.enter():
            try:
                ran.append("start")
                release.wait(5)
                ran.append("end")
            finally:
                valve.leave()

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    time.sleep(0.05)
    assert ran == []  # closed at first: no run
    valve.open()
    deadline = time.monotonic() + 5
    while not ran and time.monotonic() < deadline:
        time.sleep(0.005)
    closer = threading.Thread(target=valve.close, daemon=True)
    closer.start()
    time.sleep(0.05)
    assert closer.is_alive()  # a run is in flight: close() waits for it
    release.set()
    closer.join(5)
    assert not closer.is_alive() and ran[-1] == "end"
    n = len(ran)
    time.sleep(0.05)
    assert len(ran) == n  # closed: no new run
    valve.stop()
    th.join(5)
    assert not th.is_alive()


def test_paired_blocks_run_each_kind_alone_in_abba_order_and_pair_neighbours() -> None:
    valves = {0: Valve(), 1: Valve()}
    running: dict[int, int] = {0: 0, 1: 0}
    overlaps: list[int] = []
    stop = threading.Event()

    def loop(kind: int) -> None:
        while valves[kind].enter():
            try:
                running[kind] += 1
                if running[1 - kind]:
                    overlaps.append(kind)
                time.sleep(0.002)
                running[kind] -= 1
            finally:
                valves[kind].leave()

    threads = [threading.Thread(target=loop, args=(k,), daemon=True) for k in (0, 1, 0, 1)]
    for th in threads:
        th.start()
    probes: list[float] = []

    def probe() -> Callable[[float], dict[str, float]]:
        return lambda wall: probes.append(wall) or {"wall": wall}  # type: ignore[func-returns-value]

    try:
        blocks = paired_blocks(valves, {0: lambda t0, t1: 100.0, 1: lambda t0, t1: 90.0}, 3, 0.02, settle_s=0.005,
                               warm_s=0.005, probe=probe)
    finally:
        stop.set()
        for v in valves.values():
            v.stop()
        for th in threads:
            th.join(5)
    assert [b["device"] for b in blocks] == abba(3)
    assert all(b["t1"] - b["t0"] >= 0.02 and b["probe"]["wall"] == b["t1"] - b["t0"] for b in blocks)
    assert [b["rate"] for b in blocks] == [100.0, 90.0, 90.0, 100.0, 100.0, 90.0]
    assert pair_ratios(blocks) == pytest.approx([0.9, 0.9, 0.9])
    assert all(b0["t1"] <= b1["t0"] for b0, b1 in zip(blocks, blocks[1:]))
    assert overlaps == []  # one kind's loops never ran while the other's did
    assert len(probes) == 6
