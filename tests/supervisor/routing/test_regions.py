"""Shared-memory regions end to end: a real supervisor, workers and clients.

Round trips of many sizes through the region path (and the frame path for
the same data), concurrent writers, range checks, another tenant's region or
handle, quota accounting, clients and workers killed mid-transfer, eviction
and shutdown reclaiming everything.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import threading
from typing import Any

import numpy as np
import pytest

from shared import protocol as proto
from shared.capability import TenantCapability
from shared.errors import BufferLost, InvalidArgument, MemoryExhausted, WorkerLost
from shared.quota import SEGMENT_PREFIX
from shared.region import MIN_REGION_BYTES, Region
from shared.spec import TenantSpec
from supervisor.client.api import SupervisorClient
from tests.helpers.cluster import supervisor, tenant, wait_for

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
#: a small staging region, so modest payloads already take several chunks
REGION = 1 * MiB
CHUNK_SIZES = [0, 1, 4095, 4096, 256 << 10, (256 << 10) + 1, REGION, REGION + 7, 5 * REGION + 12345]


def _payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed + n).integers(0, 256, n, dtype=np.uint8).tobytes()


def _client(sup: Any, **kw: Any) -> SupervisorClient:
    kw.setdefault("bulk_threshold", 1)
    kw.setdefault("region_bytes", REGION)
    return SupervisorClient(sup.run_dir, **kw)


def _region_bytes(sup: Any, tid: str) -> tuple[int, int]:
    rec = tenant(sup.client.status(), tid)
    return len(rec.regions), sum(r.nbytes for r in rec.regions)


def _prefix(sup: Any, tid: str) -> str:
    """``twt-<this supervisor's segment prefix>`` (drawn per start), from a tenant's quota block."""
    return str(tenant(sup.client.status(), tid).quota.name).rsplit("-", 1)[0]


def _segments(sup: Any, tid: str = "acme") -> list[str]:
    prefix = _prefix(sup, tid)
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix + "-r"))


def test_round_trips_of_many_sizes_both_paths() -> None:
    with supervisor() as sup:
        cap = sup.client.register(None, TenantSpec("acme"))
        with _client(sup) as fast, _client(sup, regions=False) as frames:
            h = fast.alloc(cap, 6 * REGION)
            for i, n in enumerate(CHUNK_SIZES):
                data = _payload(n, i)
                assert fast.write(cap, h, data, offset=3) == n
                assert fast.read(cap, h, n, offset=3) == data
                assert frames.read(cap, h, n, offset=3) == data  # what the region path wrote is there
                out = bytearray(n)
                assert fast.read_into(cap, h, out, offset=3) == n and out == data
                frames.write(cap, h, data[::-1], offset=3)
                assert fast.read(cap, h, n, offset=3) == data[::-1]
            # the region path was taken: one staging region, charged to the tenant
            count, nbytes = _region_bytes(sup, "acme")
            assert count == 1 and nbytes == REGION
            assert sup.client.quota(cap).bytes_in_use == REGION
        assert _region_bytes(sup, "acme") == (0, 0)  # released when the client closed
        assert sup.client.quota(cap).bytes_in_use == 0


def test_numpy_put_get_and_zero_copy_views() -> None:
    with supervisor() as sup:
        cap = sup.client.register(None, TenantSpec("acme"))
        with _client(sup) as c:
            a = np.arange(300_000, dtype=np.float32).reshape(600, 500)
            h = c.put_array(cap, a)
            np.testing.assert_array_equal(c.get_array(cap, h, np.float32, (600, 500)), a)
            # any numpy array where bytes go: non-contiguous ones are sent in C order
            c.write(cap, h, a[:, ::2])
            got = c.get_array(cap, h, np.float32, (600, 250))
            np.testing.assert_array_equal(got, a[:, ::2])
            view = c.get_array(cap, h, np.float32, (600, 250), copy=False)
            np.testing.assert_array_equal(view, a[:, ::2])
            assert not view.flags.owndata
            leased = _region_bytes(sup, "acme")[0]
            assert leased == 2  # the staging region and the view's own region
            del view
            gc.collect()
            c.ping(cap)  # the next call releases the collected view's region
            wait_for(lambda: _region_bytes(sup, "acme")[0] == 1, what="the view's region released")
            empty = c.put_array(cap, np.zeros(0, np.int64))
            assert c.get_array(cap, empty, np.int64, 0).shape == (0,)
        assert sup.client.quota(cap).bytes_in_use == 0


def test_concurrent_writers_each_get_their_bytes() -> None:
    with supervisor() as sup:
        cap = sup.client.register(None, TenantSpec("acme"))
        errors: list[BaseException] = []

        def writer(k: int) -> None:
            try:
                with _client(sup) as c:
                    h = c.alloc(cap, 3 * REGION)
                    for r in range(3):
                        data = _payload(3 * REGION - k, 100 * k + r)
                        c.write(cap, h, data)
                        assert c.read(cap, h, len(data)) == data
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not errors, errors
        assert sup.client.quota(cap).bytes_in_use == 0


def test_out_of_range_and_bad_arguments_are_refused() -> None:
    with supervisor() as sup:
        cap = sup.client.register(None, TenantSpec("acme"))
        c = sup.client
        rec = c.region_create(cap, MIN_REGION_BYTES)
        h = c.alloc(cap, 1000)
        base = {"handle": h, "region": rec.region}
        for args in (
            {"offset": 0, "region_offset": -1, "nbytes": 1},
            {"offset": 0, "region_offset": rec.nbytes, "nbytes": 1},
            {"offset": 0, "region_offset": 0, "nbytes": rec.nbytes + 1},
            {"offset": 999, "region_offset": 0, "nbytes": 2},
            {"offset": 0, "region_offset": 0, "nbytes": "many"},
        ):
            for op in ("write_region", "read_region"):
                with pytest.raises(InvalidArgument):
                    c.call(op, cap, {**base, **args})
        for bad in ({"nbytes": 1, "pid": os.getpid()}, {"nbytes": 2 << 30, "pid": os.getpid()},
                    {"pid": os.getpid()}):
            with pytest.raises(InvalidArgument):
                c.call("region_create", cap, bad)
        with pytest.raises(InvalidArgument, match="unknown region"):
            c.call("write_region", cap, {"handle": h, "region": 10**6, "region_offset": 0, "nbytes": 1})
        # a region_name from the client is never used: the supervisor names the region itself
        c.call("write_region", cap, {**base, "region_name": "twt-evil-r00", "region_offset": 0, "nbytes": 1})
        assert c.call("region_release", cap, {"region": rec.region}) == {"released": rec.nbytes}
        with pytest.raises(InvalidArgument, match="unknown region"):
            c.call("region_release", cap, {"region": rec.region})
        assert c.quota(cap).bytes_in_use == 0


def test_regions_by_hand() -> None:
    """Triton's model through the client's own methods: create, map, write/read by descriptor, release."""
    with supervisor() as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("acme"))
        rec = c.region_create(cap, 100_000)
        assert rec.nbytes >= 100_000 and c.quota(cap).bytes_in_use == rec.nbytes
        region = Region.attach(rec.name, tenant_id="acme")
        try:
            h = c.alloc(cap, 4096)
            region.data[10:15] = b"hello"
            assert c.write_region(cap, h, rec.region, 5, offset=100, region_offset=10) == 5
            assert c.read(cap, h, 5, offset=100) == b"hello"
            assert c.read_region(cap, h, rec.region, 5, offset=100, region_offset=5000) == 5
            assert bytes(region.data[5000:5005]) == b"hello"
        finally:
            region.close()
        assert c.region_release(cap, rec.region) == rec.nbytes
        assert c.quota(cap).bytes_in_use == 0


def test_another_tenants_region_and_handle_are_refused() -> None:
    with supervisor() as sup:
        c = sup.client
        a = c.register(None, TenantSpec("alpha"))
        b = c.register(None, TenantSpec("beta"))
        ra = c.region_create(a, MIN_REGION_BYTES)
        rb = c.region_create(b, MIN_REGION_BYTES)
        ha = c.alloc(a, 100)
        c.alloc(b, 100)
        hb = c.alloc(b, 100)  # handles are per tenant: alpha has no buffer of this number
        c.write(b, hb, b"beta's secret")
        mine = Region.attach(ra.name)
        try:
            # beta names alpha's region (with its own handle): unknown to beta
            with pytest.raises(InvalidArgument, match="unknown region"):
                c.call("read_region", b, {"handle": hb, "region": ra.region, "region_offset": 0, "nbytes": 13})
            # alpha names beta's handle through its own region: the handle is not alpha's
            with pytest.raises(InvalidArgument):
                c.call("read_region", a, {"handle": hb, "region": ra.region, "region_offset": 0, "nbytes": 13})
            with pytest.raises(InvalidArgument, match="unknown region"):
                c.call("region_release", a, {"region": rb.region})
            assert bytes(mine.data[:13]) == bytes(13)
            c.call("read_region", a, {"handle": ha, "region": ra.region, "region_offset": 0, "nbytes": 13})
        finally:
            mine.close()
        assert c.read(b, hb, 13) == b"beta's secret"
        # names are unguessable, under the supervisor's prefix, mode 0600
        for rec in (ra, rb):
            assert rec.name.startswith(_prefix(sup, "alpha") + "-r") and rec.name.startswith(SEGMENT_PREFIX)
            assert len(rec.name.rsplit("-r", 1)[1]) == 32
            assert os.stat(f"/dev/shm/{rec.name}").st_mode & 0o777 == 0o600


def test_regions_count_against_the_host_quota() -> None:
    with supervisor() as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("small").with_memory_quota_bytes(3 * MiB))
        c.call("region_create", cap, {"nbytes": 2 * MiB, "pid": os.getpid()})
        with pytest.raises(MemoryExhausted):
            c.call("region_create", cap, {"nbytes": 2 * MiB, "pid": os.getpid()})
        assert c.quota(cap).bytes_in_use == 2 * MiB
        # a client refused a region still works, over frames
        with _client(sup, region_bytes=2 * MiB) as fast:
            h = fast.alloc(cap, 2 * MiB)
            data = _payload(2 * MiB)
            fast.write(cap, h, data)
            assert fast.read(cap, h, 2 * MiB) == data
        assert _region_bytes(sup, "small") == (1, 2 * MiB)


def test_evict_reclaims_regions_and_shutdown_unlinks_every_one() -> None:
    with supervisor() as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("acme"))
        other = c.register(None, TenantSpec("other"))
        for _ in range(3):
            c.call("region_create", cap, {"nbytes": MIN_REGION_BYTES, "pid": os.getpid()})
        c.call("region_create", other, {"nbytes": MIN_REGION_BYTES, "pid": os.getpid()})
        assert len(_segments(sup)) == 4
        prefix = _prefix(sup, "other")
        c.evict(None, "acme")
        assert len(_segments(sup, "other")) == 1
        last = _segments(sup, "other")[0]
    assert not os.path.exists(f"/dev/shm/{last}")  # none outlives the supervisor
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix + "-")]


def _write_forever(run_dir: str, cap: bytes, handle: int, started: Any) -> None:
    c = SupervisorClient(run_dir, bulk_threshold=1, region_bytes=REGION)
    data = b"x" * (8 * REGION)
    started.set()
    while True:
        c.write(TenantCapability.from_bytes(cap), handle, data)


def test_client_killed_mid_write_leaks_nothing() -> None:
    with supervisor() as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("acme"))
        h = c.alloc(cap, 8 * REGION)
        ctx = mp.get_context("spawn")
        started = ctx.Event()
        proc = ctx.Process(target=_write_forever, args=(sup.run_dir, cap.to_bytes(), h, started))
        proc.start()
        try:
            assert started.wait(60)
            wait_for(lambda: _region_bytes(sup, "acme")[0] == 1, timeout_s=30, what="the writer's region")
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        wait_for(lambda: _region_bytes(sup, "acme") == (0, 0), timeout_s=10, what="the dead client's region reclaimed")
        assert c.quota(cap).bytes_in_use == 0
        assert _segments(sup) == []
        c.write(cap, h, b"still works")
        assert c.read(cap, h, 11) == b"still works"


def test_worker_killed_mid_copy_leaks_nothing() -> None:
    with supervisor() as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("acme").with_gpu_memory_bytes_cap(64 * MiB))
        with _client(sup) as fast:
            h = fast.alloc(cap, 32 * MiB)
            pid = tenant(c.status(), "acme").pids[0]
            killer = threading.Timer(0.05, os.kill, (pid, signal.SIGKILL))
            killer.start()
            try:
                # killed while a chunk was in flight: WorkerLost; between two requests: the next
                # one names a handle of the dead incarnation (BufferLost)
                with pytest.raises((WorkerLost, BufferLost)):
                    for _ in range(1000):
                        fast.write(cap, h, b"y" * (32 * MiB))
            finally:
                killer.cancel()
            wait_for(lambda: tenant(c.status(), "acme").state == "running", timeout_s=30, what="restart")
            assert c.quota(cap).gpu_bytes_in_use == 0  # the dead instance's buffers reclaimed
            h2 = fast.alloc(cap, 3 * MiB)  # the staging region serves the new instance too
            data = _payload(3 * MiB)
            fast.write(cap, h2, data)
            assert fast.read(cap, h2, 3 * MiB) == data
        assert c.quota(cap).bytes_in_use == 0
        assert _segments(sup) == []


def test_unknown_ops_are_still_protocol_errors() -> None:
    assert {"region_create", "region_release", "write_region", "read_region"} <= proto.TENANT_OPS


def test_a_client_recovers_from_a_region_its_supervisor_dropped() -> None:
    with supervisor() as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("acme"))
        with _client(sup) as fast:
            h = fast.alloc(cap, REGION)
            fast.write(cap, h, _payload(REGION))
            regions = tenant(c.status(), "acme").regions
            c.call("region_release", cap, {"region": regions[0].region})  # behind the client's back
            data = _payload(REGION, 1)
            fast.write(cap, h, data)  # a new region, made on the spot
            assert fast.read(cap, h, REGION) == data
            assert len(tenant(c.status(), "acme").regions) == 1
        assert c.quota(cap).bytes_in_use == 0


def test_bench_data_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """``twt bench data`` as a program (its figures are not judged here: speed is not a test)."""
    import json

    from supervisor.tools.bench.data import main

    status = main(["--sizes", "1", "--rounds", "1", "--pings", "50", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status in (0, 4) and report["passed"] == (status == 0)
    assert set(report["gbps"]["1MiB"]) >= {"memcpy", "write regions", "read_into regions", "read regions",
                                          "write frames", "read frames"}
    assert all(v > 0 for v in report["gbps"]["1MiB"].values())
    assert any(t["name"].startswith("ping p50") for t in report["targets"])


def test_chunks_refused_for_max_in_flight_are_sent_again() -> None:
    """A tenant that allows one request in flight: the pipeline's extra chunks come back
    Overloaded and are resent once the one before is answered - the transfer still completes."""
    with supervisor() as sup:
        c = sup.client
        cap = c.register(None, TenantSpec.from_dict({"name": "narrow", "max_in_flight": 1}))
        with _client(sup) as fast:
            h = fast.alloc(cap, 6 * REGION)
            data = _payload(6 * REGION + 5)[: 6 * REGION]
            fast.write(cap, h, data)
            out = bytearray(len(data))
            fast.read_into(cap, h, out)
            assert out == data


def test_a_view_falls_back_to_a_copy_when_no_region_is_granted() -> None:
    with supervisor() as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("small").with_memory_quota_bytes(MIN_REGION_BYTES))
        with _client(sup) as fast:
            a = np.arange(50_000, dtype=np.int32)  # 200 kB: more than the host quota
            h = fast.put_array(cap, a)
            got = fast.get_array(cap, h, np.int32, a.shape, copy=False)
            np.testing.assert_array_equal(got, a)
            assert got.flags.owndata  # a copy: the quota grants no region this size


# ------------------------------------------------------------------ the table, without processes


def test_region_table_binds_each_region_to_one_tenant_and_reaps_dead_clients() -> None:
    import subprocess
    import sys

    from shared.quota import QuotaBlock
    from supervisor.routing.dispatcher import pinned_instance
    from supervisor.routing.regions import RegionTable

    table = RegionTable(f"tbl{os.getpid()}", max_per_tenant=2)
    with QuotaBlock.create("acme", memory_quota_bytes=4 * MiB) as a, QuotaBlock.create("beta") as b:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            mine = table.create("acme", a, MIN_REGION_BYTES, os.getpid())
            theirs = table.create("beta", b, MIN_REGION_BYTES, child.pid)
            assert a.bytes_in_use == MIN_REGION_BYTES and b.bytes_in_use == MIN_REGION_BYTES
            assert table.resolve("acme", mine.region_id) is mine
            with pytest.raises(InvalidArgument, match="unknown region"):
                table.resolve("acme", theirs.region_id)  # beta's: as unknown as a released one
            with pytest.raises(MemoryExhausted):
                table.create("acme", a, 4 * MiB, os.getpid())
            table.create("acme", a, MIN_REGION_BYTES, os.getpid())
            with pytest.raises(InvalidArgument, match="holds 2 regions"):
                table.create("acme", a, MIN_REGION_BYTES, os.getpid())
            assert table.reap() == []
            child.kill()
            child.wait(10)
            assert table.reap() == [theirs] and b.bytes_in_use == 0
            assert not os.path.exists(f"/dev/shm/{theirs.name}")
            assert [r.region_id for r in table.release_tenant("acme")] == [mine.region_id, mine.region_id + 2]
            assert a.bytes_in_use == 0 and len(table) == 0
        finally:
            child.kill()
            child.wait(10)
            table.close()
    from supervisor.runtime.tenants import InstanceSlot, TenantRuntime

    rt = TenantRuntime(TenantSpec("acme"), None, 1)  # type: ignore[arg-type]  # no block needed here
    rt.slots = tuple(InstanceSlot(i) for i in range(4))
    assert pinned_instance(rt, "write_region", {"handle": proto.make_handle(3, 1, 7), "region": 1}) == 3
    assert pinned_instance(rt, "read_region", {"handle": proto.make_handle(0, 1, 7), "region": 1}) == 0


def test_arrays_that_live_in_a_region_are_written_without_a_staging_copy() -> None:
    with supervisor() as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("acme"))
        with _client(sup) as fast:
            a = fast.empty_array(cap, np.float64, (512, 300))
            a[:] = np.arange(a.size, dtype=np.float64).reshape(a.shape)
            assert _region_bytes(sup, "acme")[0] == 1  # the array's own region, nothing else
            h = fast.put_array(cap, a)
            assert _region_bytes(sup, "acme")[0] == 1  # written from where it lies: no staging region
            np.testing.assert_array_equal(fast.get_array(cap, h, np.float64, a.shape), a)
            fast.write(cap, h, a[100:200], offset=8)  # a contiguous slice, at its place in the region
            got = fast.get_array(cap, h, np.float64, (100, 300), offset=8)
            np.testing.assert_array_equal(got, a[100:200])
            view = fast.get_array(cap, h, np.float64, a.shape, copy=False)  # a lease can be written back
            h2 = fast.put_array(cap, view)
            np.testing.assert_array_equal(fast.get_array(cap, h2, np.float64, (512, 300)), view)
            count = _region_bytes(sup, "acme")[0]
            del a, view
            gc.collect()
            fast.ping(cap)
            wait_for(lambda: _region_bytes(sup, "acme")[0] == count - 2, what="both arrays' regions released")
        assert c.quota(cap).bytes_in_use == 0


def test_a_bulk_write_past_the_tenants_rate_waits_out_retry_after_and_lands_whole() -> None:
    """Chunks refused for the tenant's requests_per_s are sent again once the supervisor's
    retry_after_s has passed (none before it: nothing is dropped unanswered), and the data
    lands whole."""
    with supervisor([{"name": "acme", "requests_per_s": 4}], log_level="error") as sup:
        c = sup.client
        cap = c.tenant_capability(None, "acme")
        data = _payload(2 * REGION + 1)
        with _client(sup) as fast:
            h = fast.alloc(cap, len(data))
            fast.write(cap, h, data)  # a region lease and its chunks, past four requests a second
            status = c.status().supervisor
            assert status.admission_refused >= 1  # the rate did bind
            assert status.admission_unanswered == 0  # and every refusal was waited out, not retried at once
            assert fast.read(cap, h, len(data)) == data
