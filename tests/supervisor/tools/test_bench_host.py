"""``twt bench host``: the probes see the time they did not run, alone and on every CPU."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from supervisor.tools.bench import BENCHES
from supervisor.tools.bench.host import main, probe

pytestmark = pytest.mark.timeout(120)


def test_a_probe_sees_the_time_another_thread_held_the_interpreter() -> None:
    """A busy thread beside the probe takes the GIL for its switch interval (5 ms) again and
    again: each turn is a pause the probe did not run - counted, with the clock it lost."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    other = threading.Thread(target=spin, daemon=True)
    other.start()
    try:
        got = probe(time.time(), 0.2)
    finally:
        stop.set()
        other.join(10)
    assert got["seconds"] >= 0.2
    assert got["pauses"] >= 1 and got["long_pauses"] >= 1 and got["longest_ms"] > 3.0
    assert 0 < got["lost_ms"] <= got["seconds"] * 1000


def test_alone_nothing_is_counted_that_did_not_happen() -> None:
    got = probe(time.time(), 0.05)
    assert got["seconds"] >= 0.05 and got["long_pauses"] <= got["pauses"]
    assert got["lost_ms"] <= got["seconds"] * 1000 and got["longest_ms"] >= 0


def test_the_bench_runs_a_probe_alone_then_one_per_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--seconds", "0.1", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code in (0, 4)  # the verdict is the host's: either is a correct answer
    cpus = len(os.sched_getaffinity(0))
    assert data["cpus"] == cpus and len(data["alone"]) == 1 and len(data["busy"]) == cpus
    assert all(r["seconds"] >= 0.1 for r in data["alone"] + data["busy"])
    assert 0 <= data["lost_busy"] <= 1 and 0 <= data["lost_alone"] <= 1
    (target,) = data["targets"]
    assert target["passed"] == (code == 0) and target["limit"] == 2.0


def test_all_runs_the_host_first() -> None:
    assert next(iter(BENCHES)) == "host"
