"""The flood bench's per-thread scheduler figures (supervisor.tools.bench.route_sched): parsing and the split."""

from __future__ import annotations

import os
import threading

import pytest

from supervisor.tools.bench import route_sched
from supervisor.tools.bench.route_sched import ThreadTimes

pytestmark = pytest.mark.timeout(30)


def test_a_schedstat_line_is_run_and_wait() -> None:
    assert route_sched.parse_schedstat("97403 152022 2\n") == (97403, 152022)
    with pytest.raises(ValueError):
        route_sched.parse_schedstat("")


def test_proc_stat_busy_leaves_out_idle_and_iowait() -> None:
    busy, total = route_sched.parse_proc_stat("cpu  10 1 5 100 4 2 3 7 0 0\ncpu0 1 2 3\n")
    assert (busy, total) == (28, 132)
    with pytest.raises(ValueError):
        route_sched.parse_proc_stat("intr 1 2 3\n")


def test_the_split_is_per_role_and_per_ping_and_leaves_out_threads_seen_once() -> None:
    before = {(1, 1): ThreadTimes("python", 1_000, 500), (1, 2): ThreadTimes("ZMQbg/IO/0", 0, 0),
              (2, 2): ThreadTimes("twt-supervisor", 5_000, 0), (3, 9): ThreadTimes("gone", 0, 0)}
    after = {(1, 1): ThreadTimes("python", 11_000, 4_500), (1, 2): ThreadTimes("ZMQbg/IO/0", 10_000, 2_000),
             (2, 2): ThreadTimes("twt-supervisor", 25_000, 10_000), (3, 10): ThreadTimes("new", 99_000, 99_000)}
    rows = route_sched.split(before, after, {"client": [1], "supervisor": [2], "worker": [3]}, pings=10,
                             seconds=0.001)
    by = {r.role: r for r in rows}
    assert by["client"].threads == 2
    assert by["client"].run_us == pytest.approx(2.0)  # 20,000 ns over 10 pings
    assert by["client"].wait_us == pytest.approx(0.6)
    assert by["client"].cpu_share == pytest.approx(0.02)
    assert by["supervisor"].run_us == pytest.approx(2.0) and by["supervisor"].wait_us == pytest.approx(1.0)
    assert by["worker"].threads == 0 and by["worker"].run_us == 0.0


def test_a_snapshot_of_this_process_names_every_live_thread() -> None:
    if not os.path.exists("/proc/self/task"):
        pytest.skip("no /proc")
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, name="helper", daemon=True)
    helper.start()
    try:
        snap = route_sched.snapshot([os.getpid(), 2**22 + 1])  # the second pid is no process: left out
        tids = {tid for pid, tid in snap if pid == os.getpid()}
        assert threading.get_native_id() in tids and helper.native_id in tids
        assert all(t.run_ns >= 0 and t.wait_ns >= 0 for t in snap.values())
        host0 = route_sched.host_snapshot()
        assert host0 is not None and host0.total_ticks >= host0.busy_ticks >= 0
    finally:
        stop.set()
        helper.join(5)


@pytest.mark.process
@pytest.mark.timeout(120)
def test_the_flood_bench_reports_each_roles_figures_with_sched(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from supervisor.tools.bench import flood

    status = flood.main(["--flood", "--kinds", "quota", "--pings", "20", "--sched", "--json"])
    assert status in (0, 4)  # 4: a target missed - timing is not this test's business
    got = json.loads(capsys.readouterr().out)
    sched = got["sched"]
    for window in ("quiet", "quota"):
        for role in ("victim client", "supervisor", "victim worker", "flooder"):
            assert f"{window}/{role}" in sched
        assert sched[f"{window}/supervisor"]["run_us"] > 0
    assert sched["quiet/flooder"]["cpus"] == 0.0
    assert sched["quota/flooder"]["run_us"] > 0
