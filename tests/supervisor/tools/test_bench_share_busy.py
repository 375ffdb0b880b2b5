"""``twt bench share --mix``'s own measure of the issue's goal: the device busy while any tenant has
work, from every worker's work and busy intervals (unions across workers, clipped to the rounds'
windows). The interval arithmetic on hand-made intervals, and the trace's file format read back.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from shared.gpu_time import WorkTrace, read_work_trace
from supervisor.tools.bench.share import (IDLE_CAUSES, busy_while_work, covered, end_to_end, idle_causes, intersect,
                                           read_work_trace_by_worker, union, work_spans)

pytestmark = pytest.mark.timeout(30)

W, B, L, C = WorkTrace.WORK, WorkTrace.BUSY, WorkTrace.LAUNCH, WorkTrace.CORE


def test_union_merges_overlaps_nesting_and_touching_spans_and_drops_empty_ones() -> None:
    assert union([]) == []
    assert union([(5, 5), (7, 6)]) == []  # empty and backwards: nothing
    assert union([(10, 20), (0, 5), (15, 30)]) == [(0, 5), (10, 30)]  # any order, overlap
    assert union([(0, 100), (10, 20), (30, 40)]) == [(0, 100)]  # nested in one
    assert union([(0, 10), (10, 20)]) == [(0, 20)]  # touching: one span
    assert union([(0, 10), (11, 20)]) == [(0, 10), (11, 20)]


def test_covered_clips_to_the_window() -> None:
    spans = union([(0, 10), (20, 30), (40, 50)])
    assert covered(spans, 0, 50) == 30
    assert covered(spans, 5, 45) == 5 + 10 + 5
    assert covered(spans, 10, 20) == 0  # between spans
    assert covered(spans, 25, 26) == 1  # inside one
    assert covered(spans, 60, 70) == 0 and covered([], 0, 100) == 0


def test_intersect_of_two_unions() -> None:
    a = union([(0, 10), (20, 30)])
    b = union([(5, 25), (28, 40)])
    assert intersect(a, b) == [(5, 10), (20, 25), (28, 30)]
    assert intersect(a, []) == [] and intersect([], b) == []
    assert intersect([(0, 100)], [(10, 20), (30, 40)]) == [(10, 20), (30, 40)]  # nested


def test_the_vectorised_arithmetic_matches_a_point_by_point_count() -> None:
    """Random intervals on a small integer line: the unions, their intersection and the covered
    lengths equal what counting every unit point gives (a full run unions millions of intervals
    with numpy; this checks that arithmetic against the definition)."""
    rng = random.Random(7)
    for _ in range(200):
        a = [(s, s + rng.randint(-2, 12)) for s in (rng.randint(0, 100) for _ in range(rng.randint(0, 12)))]
        b = [(s, s + rng.randint(-2, 12)) for s in (rng.randint(0, 100) for _ in range(rng.randint(0, 12)))]
        in_a = {p for s, e in a for p in range(s, e)}
        in_b = {p for s, e in b for p in range(s, e)}
        ua, ub, both = union(a), union(b), intersect(a, b)
        assert {p for s, e in ua for p in range(s, e)} == in_a and {p for s, e in ub for p in range(s, e)} == in_b
        assert all(x[1] < y[0] for x, y in zip(ua, ua[1:]))  # sorted, disjoint, not touching
        assert {p for s, e in both for p in range(s, e)} == in_a & in_b
        t0, t1 = sorted((rng.randint(0, 120), rng.randint(0, 120)))
        assert covered(ua, t0, t1) == len({p for p in in_a if t0 <= p < t1})
        rows = {W: a, B: b}
        got = busy_while_work(rows, [(t0, t1)])
        w = len({p for p in in_a if t0 <= p < t1})
        assert got["busy"] == (pytest.approx(len({p for p in in_a & in_b if t0 <= p < t1}) / w) if w else None)
        assert busy_while_work(work_spans(rows), [(t0, t1)]) == got  # the spans made once, for many windows


def test_busy_while_work_counts_each_instant_once_across_workers() -> None:
    # two workers' work overlapping (0-60 and 40-100): any tenant has work 0-100, counted once
    rows = {W: [(0, 60), (40, 100)],
            # the device busy 0-20 (worker 1) and 50-70 (worker 2), and 150-160 with no work at all
            # (outside every work span: not counted), launches around each busy span
            B: [(0, 20), (50, 70), (150, 160)],
            L: [(0, 25), (50, 75)]}
    got = busy_while_work(rows, [(0, 200)])
    assert got["any_work"] == pytest.approx(100 / 200)
    assert got["busy"] == pytest.approx(40 / 100)
    assert got["launched"] == pytest.approx(50 / 100)
    # windows are pooled: 0-50 (work 50, busy 20 + 0) and 50-100 (work 50, busy 20)
    got = busy_while_work(rows, [(0, 50), (50, 100)])
    assert got["busy"] == pytest.approx(40 / 100) and got["any_work"] == pytest.approx(1.0)
    # a window that cuts a busy span: only its part inside counts
    assert busy_while_work(rows, [(10, 60)])["busy"] == pytest.approx((10 + 10) / 50)


def test_busy_while_work_without_work_is_none_and_without_launch_rows_says_so() -> None:
    assert busy_while_work({W: [], B: [(0, 10)]}, [(0, 100)]) == {"any_work": None, "busy": None, "launched": None}
    assert busy_while_work({W: [(0, 10)]}, [(20, 30)])["busy"] is None  # no work in the window
    got = busy_while_work({W: [(0, 10)], B: [(0, 10)]}, [(0, 10)])  # cuda: busy rows, no launch rows
    assert got["busy"] == pytest.approx(1.0) and got["launched"] is None


def test_the_device_cores_chunks_are_laid_end_to_end_not_counted_once_where_they_overlap_as_placed() -> None:
    """Two executors on the device's one CPU, a giver's last chunk beside the grantee's first: each
    row is its CPU time placed at its launch's end, so the two overlap as placed although the core
    ran them one after the other - the union counted 700 of the 1,000 ns the core was busy. CORE
    rows are laid end to end (each ends at its own end or where the later one begins), BUSY rows
    (ops on other threads) keep their place; rows that do not overlap are not moved."""
    assert end_to_end([(300, 800), (500, 1000)]).tolist() == [[0, 500], [500, 1000]]
    assert end_to_end([(0, 100), (200, 300)]).tolist() == [[0, 100], [200, 300]]
    assert end_to_end([(500, 1000), (300, 800), (1200, 1300), (1250, 1400)]).tolist() == [
        [0, 500], [500, 1000], [1150, 1250], [1250, 1400]]
    work = {W: [(0, 1000)], L: [(0, 800), (200, 1000)]}
    assert busy_while_work({**work, C: [(300, 800), (500, 1000)]}, [(0, 1000)])["busy"] == pytest.approx(1.0)
    assert busy_while_work({**work, B: [(300, 800), (500, 1000)]}, [(0, 1000)])["busy"] == pytest.approx(0.7)
    # a host-synchronous op's row (another thread, another CPU) beside a core row: counted as placed
    got = busy_while_work({W: [(0, 1000)], B: [(0, 100)], C: [(50, 400)]}, [(0, 1000)])
    assert got["busy"] == pytest.approx(0.4)
    causes = idle_causes({1: {W: [(0, 1000)], L: [(0, 800)], C: [(300, 800)]},
                          2: {W: [(0, 1000)], L: [(200, 1000)], C: [(500, 1000)]}}, [(0, 1000)])
    assert causes[IDLE_CAUSES[0]]["share"] == pytest.approx(0.0)  # no launch time without busy time


def test_the_trace_file_is_read_back_by_kind_and_a_row_cut_short_left_out(tmp_path: Path) -> None:
    trace = WorkTrace(str(tmp_path))
    trace.add(W, 100, 200)
    trace.add(B, 120, 150)
    trace.flush()
    trace.add(L, 110, 160)
    trace.add(7, 1, 2)  # an unknown kind: left out
    trace.flush()
    trace.flush()  # nothing more: nothing written
    with open(tmp_path / "1.work", "wb") as f:  # another worker, killed mid-row
        f.write((0).to_bytes(8, "little") + (5).to_bytes(8, "little") + (9).to_bytes(8, "little") + b"\x00" * 10)
    rows = read_work_trace(str(tmp_path))
    assert sorted(rows) == [W, B, L, C]
    assert sorted(map(tuple, rows[W].tolist())) == [(5, 9), (100, 200)]  # (files in any order)
    assert rows[B].tolist() == [[120, 150]] and rows[L].tolist() == [[110, 160]]


@pytest.mark.timeout(180)
def test_a_supervisors_workers_trace_their_queued_work_end_to_end(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a real supervisor on the stub: two tenants' GEMM loops (queued ops, the lease between
    them) - every worker writes its work and busy intervals, every busy span lies inside some work,
    and the work has time outside any launch (ops queued behind the other tenant's lease)."""
    import threading

    from shared.gpu_time import WORK_TRACE_ENV
    from shared.spec import TenantSpec
    from supervisor.tools.demo import guest_path
    from tests.helpers.cluster import supervisor

    monkeypatch.setenv(WORK_TRACE_ENV, str(tmp_path))  # the workers inherit it
    guest = guest_path("share").read_bytes()
    errors: list[BaseException] = []
    with supervisor(start_method="spawn") as sup:
        caps = [sup.client.register(sup.admin_capability, TenantSpec.from_dict(
            {"tenant_id": f"t{i}", "wasm_timeout_s": 120.0, "request_timeout_s": 120.0})) for i in range(2)]

        def loop(cap: object) -> None:
            client = sup.connect(timeout_s=120.0)
            try:
                digest = client.put_module(cap, guest)  # type: ignore[arg-type]
                for _ in range(3):
                    client.run_wasm(cap, digest, "gemm_loop", [128, 16])  # type: ignore[arg-type]
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
            finally:
                client.close()

        threads = [threading.Thread(target=loop, args=(cap,)) for cap in caps]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
    assert not errors, errors
    files = list(tmp_path.glob("*.work"))
    assert len(files) >= 2  # one per worker process (both tenants' workers)
    rows = read_work_trace(str(tmp_path))
    work, busy, launches = union(rows[W]), union(rows[B]), union(rows[L])
    assert work and busy and launches
    assert all(any(s <= b0 and b1 <= e for s, e in work) for b0, b1 in busy)
    span = (work[0][0], work[-1][1])
    got = busy_while_work(rows, [span])
    assert got["busy"] is not None and 0.0 < got["busy"] < 1.0
    assert got["launched"] is not None and got["launched"] < 1.0


# -- where the device was not busy while any tenant had work, by cause (idle_causes)


def _worker(work: list[tuple[int, int]], launches: list[tuple[int, int]],
            busy: list[tuple[int, int]] | None = None) -> dict[int, list[tuple[int, int]]]:
    return {W: work, L: launches, B: launches if busy is None else busy}


def test_idle_causes_name_each_stretch_by_the_launches_on_either_side() -> None:
    us = 1_000
    a = _worker([(0, 21 * us), (30 * us, 60 * us)], [(0, 10 * us), (12 * us, 20 * us), (31 * us, 40 * us)],
                busy=[(0, 10 * us), (12 * us, 18 * us), (31 * us, 40 * us)])  # 2 us of a launch not busy
    b = _worker([(5 * us, 100 * us)], [(25 * us, 29 * us), (45 * us, 100 * us)])
    causes = idle_causes({1: a, 2: b}, [(0, 100 * us)])
    assert set(causes) == set(IDLE_CAUSES)

    def ns(cause: str) -> float:
        return causes[cause]["share"] * 100 * us  # work: any worker's, 0-100 us

    assert ns("in a launch, not busy") == pytest.approx(2 * us)
    assert ns("between one worker's ops") == pytest.approx(2 * us)  # a: 10-12
    assert ns("a handover at the giver's work end") == pytest.approx(5 * us)  # a -> b, 20-25: a's work ends at 21
    assert ns("a handover inside the giver's work") == pytest.approx(2 * us + 5 * us)  # b -> a 29-31, a -> b 40-45
    assert ns("a worker's gap in its own work") == 0
    assert causes["between one worker's ops"]["per_s"] == pytest.approx(1 / 100e-6)
    assert causes["a handover inside the giver's work"]["mean_us"] == pytest.approx(3.5)


def test_a_worker_holding_across_a_gap_in_its_own_work_and_the_windows() -> None:
    us = 1_000
    a = _worker([(0, 10 * us), (15 * us, 30 * us)], [(0, 10 * us), (15 * us, 30 * us)])  # its work pauses 10-15
    b = _worker([(2 * us, 40 * us)], [(30 * us, 40 * us)])  # b waits meanwhile
    causes = idle_causes({1: a, 2: b}, [(0, 40 * us)])
    assert causes["a worker's gap in its own work"]["share"] * 40 * us == pytest.approx(5 * us)
    assert sum(c["share"] for c in causes.values()) == pytest.approx(5 / 40)
    # only the windows count, and nothing traced gives nothing
    assert idle_causes({1: a, 2: b}, [(20 * us, 40 * us)])["a worker's gap in its own work"]["share"] == 0
    assert idle_causes({}, [(0, 10)]) == {} and idle_causes({1: a}, [(50 * us, 60 * us)]) == {}


def test_the_trace_read_back_by_worker(tmp_path: Path) -> None:
    import numpy

    for pid, rows in ((11, [(W, 0, 10), (L, 1, 5), (B, 1, 4)]), (12, [(W, 3, 8), (W, 9, 7)])):
        numpy.array(rows, dtype="<i8").tofile(tmp_path / f"{pid}.work")
    (tmp_path / "x.work").write_bytes(b"")
    got = read_work_trace_by_worker(str(tmp_path))
    assert sorted(got) == [11, 12]
    assert got[11][W].tolist() == [[0, 10]] and got[11][L].tolist() == [[1, 5]] and got[11][B].tolist() == [[1, 4]]
    assert got[12][W].tolist() == [[3, 8]] and len(got[12][L]) == 0  # a backwards row is left out


def test_without_launch_rows_nothing_is_named() -> None:
    """cuda's launches are asynchronous and leave no launch rows: no stretch can be named."""
    causes = idle_causes({1: {W: [(0, 100)], B: [(10, 50)]}}, [(0, 100)])
    assert causes == {}
