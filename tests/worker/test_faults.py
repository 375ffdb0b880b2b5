"""FaultState is shared by the control thread (arms) and the executor (consumes): no lost updates."""

from __future__ import annotations

import threading

import pytest

from shared.errors import InvalidArgument
from shared.protocol import FAULT_KINDS
from worker.faults import FaultState


def test_counters_survive_two_threads() -> None:
    faults = FaultState()
    n = 20_000
    taken = {"drop": 0, "corrupt": 0, "oom": 0}
    armed = threading.Event()

    def arm() -> None:
        for _ in range(n):
            for kind in ("drop", "corrupt", "oom"):
                faults.apply(kind, {"count": 1})
        armed.set()

    def consume() -> None:
        while True:
            done = armed.is_set()
            got = [faults.take_drop(), faults.take_corrupt(), faults.take_oom()]
            for kind, ok in zip(("drop", "corrupt", "oom"), got):
                taken[kind] += ok
            if done and not any(got):
                return

    threads = [threading.Thread(target=arm), threading.Thread(target=consume)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert taken == {"drop": n, "corrupt": n, "oom": n}
    assert (faults.drop_next, faults.corrupt_next, faults.oom_remaining) == (0, 0, 0)


def test_unknown_kind_names_the_known_ones() -> None:
    with pytest.raises(InvalidArgument, match=", ".join(FAULT_KINDS)):
        FaultState().apply("meteor", {})
