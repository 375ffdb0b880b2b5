"""Many registered tenants on one supervisor: ``status`` in pages with a summary of them all,
/metrics bounded per tenant (a tenant without a worker is counted by state, not exported alone),
``max_tenants`` at its default, and a restart that brings every stored tenant back.

Each test asserts what is served, never how fast (``twt bench density`` measures that).
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from shared.config import SupervisorConfig
from shared.errors import CapacityExhausted, InvalidArgument
from shared.records import STATUS_PAGE_MAX, StatusRecord
from shared.spec import TenantSpec
from supervisor.client.launch import SupervisorHandle, launch
from supervisor.control.admin import AdminOps
from tests.helpers import zygote
from tests.helpers.cluster import FAST, wait_for
from tests.helpers.tmp import short_temp_dir

pytestmark = pytest.mark.timeout(600)

#: tenants registered with instances = 0 (state stopped: no worker), and with one worker each
STOPPED = 1500
RUNNING = 2


def _register_many(sup: SupervisorHandle, names: list[str], instances: int, clients: int = 8) -> None:
    admin = sup.client.admin
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            with sup.connect(timeout_s=300.0) as client:
                for name in names[k::clients]:
                    client.register(admin, TenantSpec(name, instances=instances), timeout_s=300.0)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


@pytest.fixture(scope="module")
def many() -> Iterator[tuple[SupervisorHandle, str]]:
    """A supervisor (metrics on) holding STOPPED stopped tenants and RUNNING running ones; its run dir.
    The running ones sort last: a restart brings back tenants without a worker first."""
    run_dir = tempfile.mkdtemp(prefix="twt-d", dir=short_temp_dir())
    try:
        with launch({"supervisor": {**FAST, "log_level": "warning"}, "tenant": []}, run_dir=run_dir,
                    metrics_addr="127.0.0.1:0", ready_timeout_s=300) as sup:
            _register_many(sup, [f"s{i:04d}" for i in range(STOPPED)], 0)
            _register_many(sup, [f"x{i}" for i in range(RUNNING)], 1, clients=RUNNING)
            yield sup, run_dir
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _pages(sup: SupervisorHandle, limit: int, state: str | None = None) -> list[StatusRecord]:
    pages = [sup.client.status(limit=limit, state=state)]
    while pages[-1].next is not None:
        pages.append(sup.client.status(limit=limit, after=pages[-1].next, state=state))
    return pages


def test_paging_sees_every_tenant_once_in_order_and_the_summary_counts_them_all(
        many: tuple[SupervisorHandle, str]) -> None:
    sup, _ = many
    every = sorted([f"s{i:04d}" for i in range(STOPPED)] + [f"x{i}" for i in range(RUNNING)])
    pages = _pages(sup, 97)
    seen = [t.tenant_id for p in pages for t in p.tenants]
    assert seen == every  # each exactly once, by id
    assert all(len(p.tenants) == 97 for p in pages[:-1]) and 0 < len(pages[-1].tenants) <= 97
    summary = pages[0].summary
    assert summary is not None
    assert summary.tenants == STOPPED + RUNNING
    assert summary.states == {"running": RUNNING, "stopped": STOPPED}
    assert summary.instances == RUNNING and summary.ready == RUNNING
    # the state filter pages too; the summary still counts every tenant
    running = _pages(sup, 1, state="running")
    assert [t.tenant_id for p in running for t in p.tenants] == ["x0", "x1"]
    assert running[0].summary == summary
    # without a limit the client joins the pages: what callers of status() always got
    full = sup.client.status()
    assert [t.tenant_id for t in full.tenants] == every and full.next is None
    # with no limit named, a page holds the default: every tenant here
    assert len(StatusRecord.from_wire(sup.client.call("status", sup.client.admin)).tenants) == STATUS_PAGE_MAX


def test_a_tenant_registered_or_evicted_between_pages_shifts_no_other(many: tuple[SupervisorHandle, str]) -> None:
    sup, _ = many
    first = sup.client.status(limit=500)
    assert first.next is not None
    sup.client.register(None, TenantSpec("a-new", instances=0))  # sorts before the cursor
    sup.client.register(None, TenantSpec("z-new", instances=0))  # sorts after it
    try:
        rest = []
        cursor: str | None = first.next
        while cursor is not None:
            page = sup.client.status(limit=500, after=cursor)
            rest += [t.tenant_id for t in page.tenants]
            cursor = page.next
        seen = [t.tenant_id for t in first.tenants] + rest
        assert len(seen) == len(set(seen))
        assert set(seen) >= {f"s{i:04d}" for i in range(STOPPED)} | {"x0", "x1", "z-new"}
    finally:
        sup.client.evict(None, "a-new")
        sup.client.evict(None, "z-new")


def test_page_edges(many: tuple[SupervisorHandle, str]) -> None:
    """Past the last id: an empty page, no next. A last page that is exactly full names no next
    (no empty page to fetch). A state no tenant is in: an empty page, the summary still whole."""
    sup, _ = many
    past = sup.client.status(limit=10, after="zzz")
    assert past.tenants == () and past.next is None
    exact = sup.client.status(limit=RUNNING, after="w")  # the running ones sort last: x0, x1
    assert [t.tenant_id for t in exact.tenants] == ["x0", "x1"] and exact.next is None
    failed = sup.client.status(limit=10, state="failed")
    assert failed.tenants == () and failed.next is None
    assert failed.summary is not None and failed.summary.tenants == STOPPED + RUNNING


@pytest.mark.parametrize(("args", "match"), [
    ({"limit": 0}, "limit"), ({"limit": STATUS_PAGE_MAX + 1}, "limit"), ({"state": "sleeping"}, "state"),
    ({"limit": "10"}, "limit"), ({"after": 3}, "after")])
def test_bad_paging_arguments_are_refused_typed(many: tuple[SupervisorHandle, str], args: dict[str, Any],
                                                match: str) -> None:
    sup, _ = many
    with pytest.raises(InvalidArgument, match=match):
        sup.client.call("status", sup.client.admin, args)


def test_twt_status_shows_the_summary_and_a_page_and_all_with_all(many: tuple[SupervisorHandle, str]) -> None:
    sup, run_dir = many

    def twt(*args: str) -> str:
        done = zygote.run([sys.executable, "-m", "supervisor", "status", "--run-dir", run_dir, *args],
                          timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout

    first = twt()
    assert f"tenants {STOPPED + RUNNING} (running {RUNNING}, stopped {STOPPED})" in first
    rows = [line for line in first.splitlines() if re.match(r"^[sx]\d+ ", line)]
    assert len(rows) == 100
    assert "more after 's0099'" in first
    assert len([line for line in twt("--all").splitlines() if re.match(r"^[sx]\d+ ", line)]) == STOPPED + RUNNING
    assert [line.split()[0] for line in twt("--state", "running").splitlines()
            if re.match(r"^[sx]\d+ ", line)] == ["x0", "x1"]


def test_metrics_export_tenants_with_workers_and_count_the_rest_by_state(many: tuple[SupervisorHandle, str]) -> None:
    sup, _ = many
    url = sup.info["metrics_url"]

    def body() -> str:
        with urllib.request.urlopen(url, timeout=60) as r:
            text: str = r.read().decode()
        return text

    def counted() -> str:
        text = body()
        return text if f'twt_tenants_by_state{{state="stopped"}} {STOPPED}.0' in text else ""

    text = wait_for(counted, what="a render with every tenant")
    assert f"twt_tenants {STOPPED + RUNNING}.0" in text
    assert f'twt_tenants_by_state{{state="running"}} {RUNNING}.0' in text
    labelled = {m for m in re.findall(r'tenant="([^"]+)"', text) if m != "-"}
    assert len(labelled) == RUNNING  # the running tenants' pseudonyms only
    # bounded per registered tenant: a stopped tenant adds nothing (each running one ~4 KB)
    assert len(text.encode()) < 100_000 + 8_000 * RUNNING
    assert len(text.encode()) / (STOPPED + RUNNING) < 100


def test_a_restart_restores_every_stored_tenant(many: tuple[SupervisorHandle, str]) -> None:
    sup, run_dir = many
    before = {t.tenant_id: t.generation for t in sup.client.status().tenants}
    sup.process.terminate()
    sup.process.wait(timeout=120)
    with tempfile.TemporaryFile() as log:
        with launch({"supervisor": {**FAST, "log_level": "info"}, "tenant": []}, run_dir=run_dir,
                    ready_timeout_s=300, stderr=log) as again:
            # ready is every stored tenant back with its first worker ready; on a loaded host that
            # worker may be restarting a moment later (its heartbeat late past FAST's 2.5 s
            # liveness: the tenant degraded) - its state comes back to running, the event waited for
            want = {"stopped": STOPPED, "running": RUNNING}

            def states() -> dict[str, int] | None:
                summary = again.client.status(limit=1).summary
                return summary.states if summary is not None and summary.states == want else None

            wait_for(states, 60.0, what=f"the restored tenants' states to come to {want}")
            status = again.client.status()
            assert {t.tenant_id: t.generation for t in status.tenants} == before
            assert status.summary is not None
            assert status.summary.states == want
        log.seek(0)
        ready = [line for line in log.read().decode().splitlines() if "supervisor.ready" in line]
    # ready once the last stored tenant is back, not the first (each settles on its own)
    assert len(ready) == 1 and f"tenants={STOPPED + RUNNING}" in ready[0], ready


def test_max_tenants_defaults_to_16384_and_past_it_registration_is_refused() -> None:
    cfg = SupervisorConfig()
    assert cfg.max_tenants == 16_384
    full = SimpleNamespace(config=cfg, tenants=dict.fromkeys(range(16_384)))
    with pytest.raises(CapacityExhausted) as info:
        AdminOps.check_capacity(full, tenants=1, workers=0)  # type: ignore[arg-type]
    assert info.value.fields() == {"what": "tenants", "in_use": 16_384, "wanted": 1, "limit": 16_384,
                                   "setting": "max_tenants", "retry_after_s": None}
    AdminOps.check_capacity(SimpleNamespace(config=cfg, tenants=dict.fromkeys(range(16_383))),  # type: ignore[arg-type]
                            tenants=1, workers=0)


class _Untouchable:
    """A registered tenant without a worker whose block was read after its last worker went: the
    loop's once-a-second scans must not read it again."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a quiet tenant was looked at ({name})")


def _block(gpu_ns: int = 0, refusals: int = 0) -> Any:
    return SimpleNamespace(closed=False, gpu_time_ns=gpu_ns, refusals=lambda: (refusals, 0))


def _scanned(quiet: set[str]) -> tuple[dict[str, Any], Any]:
    """1,000 quiet tenants, ``busy`` (a worker serves it) and ``gone`` (its last worker went since
    the last look: unread)."""
    tenants: dict[str, Any] = {tid: _Untouchable() for tid in quiet}
    tenants["busy"] = SimpleNamespace(tenant_id="busy", block=_block(5, 2), seen_refusals=0)
    tenants["gone"] = SimpleNamespace(tenant_id="gone", block=_block(7, 1), seen_refusals=0)
    return tenants, SimpleNamespace(serving_tenants=lambda: {"busy"})


def test_the_gpu_time_sample_reads_only_tenants_served_or_not_quiet_yet() -> None:
    """The GPU-time sample (every second) reads the tenants a worker serves and, once, those whose
    last worker went: never the quiet ones (at 10,000 parked tenants a pass over them all held the
    loop tens of ms each second, and the requests arriving then with it)."""
    from supervisor.control.records import Records

    quiet = {f"q{i:04d}" for i in range(1000)}
    tenants, workers = _scanned(quiet)
    seen: list[tuple[str, int]] = []
    fake: Any = SimpleNamespace(_unread_sampled={"gone", "evicted"}, tenants=tenants, workers=workers,
                                gpu_share=SimpleNamespace(observe=lambda tid, now, ns: seen.append((tid, ns))),
                                loop=SimpleNamespace(timers=SimpleNamespace(after=lambda *_: None)), sample_gpu_time=None)
    fake.to_read = lambda unread: Records.to_read(fake, unread)
    Records.sample_gpu_time(fake)
    assert sorted(seen) == [("busy", 5), ("gone", 7)]
    assert fake._unread_sampled == {"busy"}  # gone and evicted are read: no longer unread
    Records.sample_gpu_time(fake)  # gone is quiet now: read once only
    assert sorted(seen) == [("busy", 5), ("busy", 5), ("gone", 7)]


def test_the_refusal_scan_reads_only_tenants_served_or_not_quiet_yet() -> None:
    from supervisor.control.records import Records
    from supervisor.supervisor import Supervisor

    quiet = {f"q{i:04d}" for i in range(1000)}
    tenants, workers = _scanned(quiet)
    emitted: list[tuple[str, int]] = []
    records: Any = SimpleNamespace(unread_refusals={"gone", "evicted"}, tenants=tenants, workers=workers)
    records.to_read = lambda unread: Records.to_read(records, unread)
    fake: Any = SimpleNamespace(parts=SimpleNamespace(records=records, workers=workers), tenants=tenants,
                                events=SimpleNamespace(emit=lambda kind, tenant, new, **_: emitted.append((tenant, new))))
    Supervisor._scan_refusals(fake)
    assert sorted(emitted) == [("busy", 2), ("gone", 1)]
    assert records.unread_refusals == {"busy"}
    Supervisor._scan_refusals(fake)  # gone is quiet now: read once only
    assert sorted(emitted) == [("busy", 2), ("gone", 1)]


def test_the_rss_backstop_reads_only_ready_workers() -> None:
    """The RSS backstop (every second) passes over the workers, never over every registered
    tenant: a tenant without a worker is not looked at, a pool or stopping worker is not read,
    and a ready worker above its tenant's quota plus the allowance is killed."""
    from supervisor.lifecycle.workerset import WorkerSet
    from supervisor.runtime.workers import WorkerState

    quiet = {f"q{i:04d}" for i in range(1000)}
    tenants: dict[str, Any] = {tid: _Untouchable() for tid in quiet}
    big = SimpleNamespace(state=WorkerState.READY, tenant="big", instance=0, rss_exceeded=None, rss=900)
    small = SimpleNamespace(state=WorkerState.READY, tenant="small", instance=0, rss_exceeded=None, rss=100)
    pool = SimpleNamespace(state=WorkerState.IDLE, tenant=None, instance=None, rss=10**9)
    stopping = SimpleNamespace(state=WorkerState.STOPPING, tenant="big", instance=1, rss=10**9)
    for w in (big, small):
        tenants[w.tenant] = SimpleNamespace(spec=SimpleNamespace(memory_quota_bytes=400),
                                            slots=[SimpleNamespace(worker=w)])
    read: list[object] = []
    killed: list[tuple[object, str]] = []

    def rss(worker: Any) -> int:
        read.append(worker)
        return int(worker.rss)

    fake: Any = SimpleNamespace(config=SimpleNamespace(rss_allowance_bytes=100), tenants=tenants,
                                workers={b"1": big, b"2": small, b"3": pool, b"4": stopping},
                                spawner=SimpleNamespace(rss=rss),
                                kill=lambda worker, reason, cause: killed.append((worker, cause)))
    WorkerSet.check_rss(fake)
    assert read == [big, small]
    assert killed == [(big, "rss")] and big.rss_exceeded == (900, 500)
