"""The parked flag and a parked tenant's quota counters in the state database: written, read
back, and added to a database of the schemas before them (the migrations keep every tenant)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from shared.errors import StateError
from shared.quota import GPU_WAIT_BUCKETS_S, QuotaCounters
from shared.spec import TenantSpec
from supervisor.store.state import SCHEMA_VERSION, STATE_FILE, RegistryKey, StateStore
from supervisor.store.tenant_quota import kept_counters, kept_counters_json

pytestmark = pytest.mark.timeout(60)

KEY = RegistryKey(b"r" * 16, b"s" * 32)


def test_the_parked_flag_round_trips_and_a_new_registration_clears_it(tmp_path: Path) -> None:
    with StateStore.open(str(tmp_path)) as store:
        store.put_registry_key(KEY)
        store.register(TenantSpec("acme", idle_timeout_s=5), 1, "runtime")
        store.register(TenantSpec("beta"), 1, "runtime")
        store.set_parked("acme", True)
        store.set_parked("gone", True)  # evicted meanwhile: nothing to do, no error
    with StateStore.open(str(tmp_path)) as store:
        by_id = {t.tenant_id: t for t in store.tenants()}
        assert by_id["acme"].parked and not by_id["beta"].parked
        assert by_id["acme"].spec.idle_timeout_s == 5
        store.set_parked("acme", False)
        assert not store.tenant("acme").parked  # type: ignore[union-attr]
        store.set_parked("acme", True)
        store.register(TenantSpec("acme"), 2, "runtime")  # registered again: a new tenant, active
        assert not store.tenant("acme").parked  # type: ignore[union-attr]


def test_a_database_of_the_schema_before_gains_the_flag(tmp_path: Path) -> None:
    with StateStore.open(str(tmp_path)) as store:
        store.put_registry_key(KEY)
        store.register(TenantSpec("old"), 3, "runtime")
        store.set_parked("old", True)
    conn = sqlite3.connect(tmp_path / STATE_FILE)  # turn it back into a database of version 2
    try:
        conn.execute("ALTER TABLE tenants DROP COLUMN parked_quota")
        conn.execute("ALTER TABLE tenants DROP COLUMN parked")
        conn.execute("UPDATE schema_version SET version = ?", (2,))
        conn.commit()
    finally:
        conn.close()
    with StateStore.open(str(tmp_path)) as store:
        (old,) = store.tenants()
        assert old.tenant_id == "old" and old.generation == 3 and not old.parked
    conn = sqlite3.connect(tmp_path / STATE_FILE)
    try:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    finally:
        conn.close()


def _counters(spec: TenantSpec, generation: int) -> QuotaCounters:
    """A parked tenant's record with every kind of counter set, and bytes still held."""
    c = QuotaCounters(generation=generation, memory_quota_bytes=spec.memory_quota_bytes,
                      gpu_memory_bytes_cap=spec.gpu_memory_bytes_cap,
                      cuda_mem_pool_quota_bytes=spec.recorded_cuda_mem_pool_quota)
    c.cpu_high_water, c.cpu_refusals, c.cpu_underflows = 5000, 2, 1
    c.gpu_high_water, c.gpu_refusals, c.gpu_underflows = 7000, 3, 4
    c.cpu_held, c.gpu_held = 4096, 1024  # the host copies' charge: not kept
    c.instance_shares = ((0, 10, 20),)
    c.gpu_time = (123_456, 7, 6, 9_999, 1, *range(1, len(GPU_WAIT_BUCKETS_S) + 2))
    return c


_HELD = ("bytes_in_use", "gpu_bytes_in_use", "instance_shares")


def test_a_parked_tenants_quota_counters_round_trip_with_the_flag(tmp_path: Path) -> None:
    spec = TenantSpec("acme", idle_timeout_s=5, gpu_memory_bytes_cap=1 << 20)
    snap = _counters(spec, 4).snapshot("acme", "seg")
    with StateStore.open(str(tmp_path)) as store:
        store.put_registry_key(KEY)
        store.register(spec, 4, "runtime")
        store.register(TenantSpec("beta"), 1, "runtime")
        store.set_parked("acme", True, snap)
    with StateStore.open(str(tmp_path)) as store:
        by_id = {t.tenant_id: t for t in store.tenants()}
        assert by_id["beta"].quota is None
        kept = by_id["acme"].quota
        assert kept is not None
        back = kept.snapshot("acme", "seg")
        held = {k: getattr(back, k) for k in _HELD}
        assert held == {"bytes_in_use": 0, "gpu_bytes_in_use": 0, "instance_shares": ()}
        same = {k: v for k, v in back.to_dict().items() if k not in _HELD}
        assert same == {k: v for k, v in snap.to_dict().items() if k not in _HELD}
        store.set_parked("acme", False)  # activated: its counters are in its segment again
        assert store.tenant("acme").quota is None  # type: ignore[union-attr]
        store.set_parked("acme", True)  # parked without counters (none to keep)
        assert store.tenant("acme").quota is None  # type: ignore[union-attr]


def test_kept_counters_take_the_specs_limits_and_refuse_what_they_cannot_read() -> None:
    raw = kept_counters_json(_counters(TenantSpec("a"), 1).snapshot("a"))
    c = kept_counters(raw, generation=9, memory_quota_bytes=77, gpu_memory_bytes_cap=None,
                      cuda_mem_pool_quota_bytes=None)
    assert (c.generation, c.memory_quota_bytes, c.gpu_memory_bytes_cap, c.gpu_refusals) == (9, 77, None, 3)
    for bad in ("[", "[]", '{"form": 2}', '{"form": 1, "cpu_refusals": -1}', '{"form": 1, "gpu_ops": true}',
                '{"form": 1, "gpu_wait_bins": {}}', '{"form": 1, "gpu_wait_bins": ["x"]}'):
        with pytest.raises(ValueError, match="kept quota counter"):
            kept_counters(bad, generation=1, memory_quota_bytes=1, gpu_memory_bytes_cap=None,
                          cuda_mem_pool_quota_bytes=None)
    # another histogram width (its buckets changed): the totals stay, the histogram starts empty
    c = kept_counters('{"form": 1, "gpu_time_ns": 5, "gpu_wait_bins": [1, 2]}', generation=1,
                      memory_quota_bytes=1, gpu_memory_bytes_cap=None, cuda_mem_pool_quota_bytes=None)
    assert c.gpu_time is not None and c.gpu_time_ns == 5 and not any(c.gpu_time[5:])


def test_unreadable_kept_counters_refuse_the_start_naming_the_tenant(tmp_path: Path) -> None:
    with StateStore.open(str(tmp_path)) as store:
        store.put_registry_key(KEY)
        store.register(TenantSpec("acme"), 1, "runtime")
        store.set_parked("acme", True, _counters(TenantSpec("acme"), 1).snapshot("acme"))
    conn = sqlite3.connect(tmp_path / STATE_FILE)
    try:
        conn.execute("UPDATE tenants SET parked_quota = '{\"form\": 1, \"cpu_refusals\": \"many\"}'")
        conn.commit()
    finally:
        conn.close()
    with StateStore.open(str(tmp_path)) as store, pytest.raises(StateError, match="'acme' does not parse"):
        store.tenants()


def test_a_database_of_version_3_keeps_its_parked_tenants_parked_without_counters(tmp_path: Path) -> None:
    with StateStore.open(str(tmp_path)) as store:
        store.put_registry_key(KEY)
        store.register(TenantSpec("old"), 2, "runtime")
        store.set_parked("old", True, _counters(TenantSpec("old"), 2).snapshot("old"))
    conn = sqlite3.connect(tmp_path / STATE_FILE)
    try:
        conn.execute("ALTER TABLE tenants DROP COLUMN parked_quota")
        conn.execute("UPDATE schema_version SET version = 3")
        conn.commit()
    finally:
        conn.close()
    with StateStore.open(str(tmp_path)) as store:
        (old,) = store.tenants()
        assert old.parked and old.quota is None  # parked by a version that did not keep them
