"""The parked flag in the state database: written, read back, and added to a database of the
schema before it (the migration keeps every tenant, not parked)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from shared.spec import TenantSpec
from supervisor.store.state import SCHEMA_VERSION, STATE_FILE, RegistryKey, StateStore

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
    conn = sqlite3.connect(tmp_path / STATE_FILE)  # turn it back into a database of the version before
    try:
        conn.execute("ALTER TABLE tenants DROP COLUMN parked")
        conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION - 1,))
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
