"""State that cannot be lost silently: the commit counter, restore, newer schemas and keys, the preflight check.

In-process on the store (no supervisor): a snapshot of a live state directory's files is what a crash
leaves (nothing is written between the copy and the open), so each way of losing the WAL is exact.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
from pathlib import Path

import pytest

from shared.errors import StateError
from shared.spec import TenantSpec
from supervisor.store.backup import backup, check, restore
from supervisor.store.state import COMMITS_FILE, MARKER_FILE, SCHEMA_VERSION, STATE_FILE, RegistryKey, StateStore

KEY = RegistryKey(b"r" * 16, b"s" * 32)


def _crash_copy(live: Path, dest: Path, files: tuple[str, ...] = (STATE_FILE, STATE_FILE + "-wal", COMMITS_FILE,
                                                                   MARKER_FILE)) -> Path:
    """The state directory as a SIGKILL would leave it (the store stays open: its WAL is not folded in)."""
    dest.mkdir(mode=0o700)
    for name in files:
        if (live / name).exists():
            shutil.copyfile(live / name, dest / name)
    return dest


def _live_with_unfolded_commits(tmp_path: Path) -> tuple[Path, StateStore]:
    live = tmp_path / "live"
    store = StateStore.open(str(live))
    store.put_registry_key(KEY)  # checkpointed: the key is in state.db itself
    store.register(TenantSpec("acme"), 1, "runtime")  # these three only in the WAL
    store.register(TenantSpec("gone"), 1, "runtime")
    store.evict("gone")
    assert (live / (STATE_FILE + "-wal")).stat().st_size > 0
    return live, store


@pytest.mark.parametrize("loss", ["wal truncated", "wal deleted", "wal cut in half", "state.db copied alone"])
def test_a_start_that_lost_acknowledged_commits_stops_with_the_recovery(tmp_path: Path, loss: str) -> None:
    live, store = _live_with_unfolded_commits(tmp_path)
    try:
        main_file_alone = (live / STATE_FILE).read_bytes()  # what `cp state.db` takes while it runs
        crashed = _crash_copy(live, tmp_path / "crashed")
    finally:
        store.close()
    wal = crashed / (STATE_FILE + "-wal")
    if loss == "wal truncated":
        os.truncate(wal, 0)
    elif loss == "wal deleted":
        wal.unlink()
    elif loss == "wal cut in half":
        os.truncate(wal, wal.stat().st_size // 2)
    else:  # the supervisor stopped cleanly (all folded in), then a copy of state.db alone was put back
        shutil.rmtree(crashed)
        crashed = _crash_copy(live, tmp_path / "crashed")
        assert not wal.exists()
        (crashed / STATE_FILE).write_bytes(main_file_alone)
    db_before = (crashed / STATE_FILE).read_bytes()
    for _ in range(2):  # every time, not once
        with pytest.raises(StateError) as info:
            StateStore.open(str(crashed))
        text = str(info.value)
        assert "committed changes are lost" in text and "twt state restore" in text and "\n" not in text
        assert "but 4 were acknowledged" in text, text
    assert (crashed / STATE_FILE).read_bytes() == db_before  # nothing was written
    report = check(str(crashed))
    assert not report.ok and any("committed changes are lost" in p for p in report.problems)


def test_the_same_crash_with_its_wal_keeps_every_answered_change(tmp_path: Path) -> None:
    live, store = _live_with_unfolded_commits(tmp_path)
    try:
        crashed = _crash_copy(live, tmp_path / "crashed")
    finally:
        store.close()
    with StateStore.open(str(crashed)) as again:
        assert [t.tenant_id for t in again.tenants()] == ["acme"] and again.commits == 4
    assert check(str(crashed)).ok


def test_a_database_ahead_of_its_counter_is_a_crash_between_commit_and_count_and_is_accepted(tmp_path: Path) -> None:
    with StateStore.open(str(tmp_path)) as store:
        store.put_registry_key(KEY)
        store.register(TenantSpec("acme"), 1, "runtime")
        assert store.commits == 2
    (tmp_path / COMMITS_FILE).write_text("1\n")
    with StateStore.open(str(tmp_path)) as store:
        assert store.commits == 2
    assert int((tmp_path / COMMITS_FILE).read_text()) == 2


def test_a_fresh_directory_starts_and_an_operator_may_start_afresh_on_purpose(tmp_path: Path) -> None:
    with StateStore.open(str(tmp_path)) as store:
        assert store.commits == 0 and store.registry_key() is None
        store.put_registry_key(KEY)
    assert int((tmp_path / COMMITS_FILE).read_text()) == 1
    assert check(str(tmp_path / "nothing-here")).ok
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / (STATE_FILE + suffix)).unlink(missing_ok=True)
    with pytest.raises(StateError, match="initialized before"):
        StateStore.open(str(tmp_path))
    (tmp_path / MARKER_FILE).unlink()  # on purpose: the counter of the old state does not hold it back
    with StateStore.open(str(tmp_path)) as store:
        assert store.registry_key() is None and store.commits == 0


def test_an_unreadable_counter_is_refused_by_name(tmp_path: Path) -> None:
    StateStore.open(str(tmp_path)).close()
    (tmp_path / COMMITS_FILE).write_text("garbage\n")
    with pytest.raises(StateError, match="commit counter is unreadable"):
        StateStore.open(str(tmp_path))


# ----------------------------------------------------------------------- backup and restore


def test_backup_and_restore_round_trip(tmp_path: Path) -> None:
    live = tmp_path / "state"
    with StateStore.open(str(live)) as store:
        store.put_registry_key(KEY)
        store.register(TenantSpec("acme").with_memory_quota_bytes("64MiB"), 3, "runtime")
        info = backup(str(live), str(tmp_path / "b.db"))  # acme only in the WAL: the backup API sees it
        assert info["tenants"] == 1
        store.register(TenantSpec("later"), 1, "runtime")
        with pytest.raises(StateError, match="in use by another supervisor"):
            restore(str(live), str(tmp_path / "b.db"))  # never under a running supervisor
    db_before = (live / STATE_FILE).read_bytes()
    with pytest.raises(StateError, match="not a backup|not a tensor-wasm-tenant"):
        (tmp_path / "junk.db").write_bytes(b"")
        sqlite3.connect(tmp_path / "junk.db").execute("CREATE TABLE x (y)").connection.commit()
        restore(str(live), str(tmp_path / "junk.db"))
    assert (live / STATE_FILE).read_bytes() == db_before  # a bad backup replaces nothing
    out = restore(str(live), str(tmp_path / "b.db"))
    assert out["tenants"] == 1 and out["commits"] == 2 and out["replaced"]
    assert Path(str(out["replaced"])).exists()  # the state it replaced is kept beside it
    with StateStore.open(str(live)) as store:
        assert store.registry_key() == KEY
        assert [(t.tenant_id, t.spec.memory_quota_bytes, t.generation) for t in store.tenants()] == [
            ("acme", 64 << 20, 3)]
        assert store.generations() == {"acme": 3}
    assert check(str(live)).ok


# ----------------------------------------------------------------------- newer versions, older versions


def test_a_stored_tenant_with_a_field_of_a_newer_version_is_kept_and_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with StateStore.open(str(tmp_path)) as store:
        store.register(TenantSpec("acme"), 1, "file")
        store.register(TenantSpec("beta"), 1, "file")
        future = json.dumps({**TenantSpec("acme").to_dict(), "future_field": {"x": 1}})
        store._conn.execute("UPDATE tenants SET spec = ?, registered_spec = ? WHERE tenant_id = 'acme'",
                            (future, future))
    with caplog.at_level(logging.WARNING, logger="twt"):
        with StateStore.open(str(tmp_path)) as store:
            records = {r.tenant_id: r for r in store.tenants()}
            store.tenants()
            assert records["acme"].spec == TenantSpec("acme") and records["acme"].unknown_keys == ("future_field",)
            store.update_spec(TenantSpec("acme").with_memory_quota_bytes("1MiB"),
                              registered_spec=TenantSpec("acme"))
            row = store._conn.execute("SELECT spec, registered_spec FROM tenants WHERE tenant_id = 'acme'").fetchone()
    warned = [r for r in caplog.records if "unknown_keys" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    for raw in row:
        assert json.loads(raw)["future_field"] == {"x": 1}  # kept for the newer version
    assert json.loads(row[0])["memory_quota_bytes"] == 1 << 20
    report = check(str(tmp_path))
    assert report.ok and any("future_field" in n for n in report.notes)


def test_a_newer_schema_that_keeps_this_version_as_a_reader_is_opened(tmp_path: Path) -> None:
    with StateStore.open(str(tmp_path)) as store:
        store.register(TenantSpec("acme"), 1, "runtime")
    conn = sqlite3.connect(tmp_path / STATE_FILE)
    conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    conn.execute("CREATE TABLE something_new (x INTEGER)")
    conn.commit()
    conn.close()
    with StateStore.open(str(tmp_path)) as store:
        assert [t.tenant_id for t in store.tenants()] == ["acme"]
        store.register(TenantSpec("beta"), 1, "runtime")  # and it writes, counted
    conn = sqlite3.connect(tmp_path / STATE_FILE)
    assert conn.execute("SELECT version FROM schema_version").fetchone()[0] == SCHEMA_VERSION + 1  # not touched
    conn.close()
    assert check(str(tmp_path)).ok


_V1 = (
    "CREATE TABLE schema_version (version INTEGER NOT NULL)",
    "INSERT INTO schema_version (version) VALUES (1)",
    "CREATE TABLE key_material (name TEXT PRIMARY KEY, material BLOB NOT NULL, updated_at REAL NOT NULL)",
    "CREATE TABLE retired_keys (registry_id BLOB PRIMARY KEY, retired_at REAL NOT NULL)",
    """CREATE TABLE tenants (tenant_id TEXT PRIMARY KEY, spec TEXT NOT NULL, registered_spec TEXT NOT NULL,
        origin TEXT NOT NULL CHECK (origin IN ('file', 'runtime')), generation INTEGER NOT NULL,
        failed_reason TEXT, registered_at REAL NOT NULL, updated_at REAL NOT NULL)""",
    "CREATE TABLE generations (tenant_id TEXT PRIMARY KEY, generation INTEGER NOT NULL)",
)


def test_a_version_1_database_is_migrated_forward_and_counted_from_then_on(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / STATE_FILE)
    for statement in _V1:
        conn.execute(statement)
    spec = json.dumps(TenantSpec("old").to_dict())
    conn.execute("INSERT INTO tenants VALUES ('old', ?, ?, 'runtime', 2, NULL, 0, 0)", (spec, spec))
    conn.commit()
    conn.close()
    os.chmod(tmp_path, 0o700)
    report = check(str(tmp_path))
    assert report.ok and any("migrates it to" in n for n in report.notes)
    with StateStore.open(str(tmp_path)) as store:
        assert [(t.tenant_id, t.generation) for t in store.tenants()] == [("old", 2)]
        assert store.commits == 0
        store.set_failed("old", "x")
        assert store.commits == 1
    conn = sqlite3.connect(tmp_path / STATE_FILE)
    assert conn.execute("SELECT version, oldest_reader FROM schema_version").fetchone() == (SCHEMA_VERSION, 2)
    conn.close()


# ----------------------------------------------------------------------- preflight


def test_check_lists_every_problem_at_once_and_writes_nothing(tmp_path: Path) -> None:
    live, store = _live_with_unfolded_commits(tmp_path)
    try:
        store._conn.execute("UPDATE tenants SET spec = '{\"tenant_id\": \"acme\", \"instances\": \"many\"}'")
        store.register(TenantSpec("beta"), 1, "runtime")
        store._conn.execute("UPDATE tenants SET spec = '[1]' WHERE tenant_id = 'beta'")
        crashed = _crash_copy(live, tmp_path / "crashed")
    finally:
        store.close()
    os.truncate(crashed / (STATE_FILE + "-wal"), 0)
    files = {p.name: p.read_bytes() for p in crashed.iterdir() if not p.name.endswith("-shm")}
    report = check(str(crashed))
    assert not report.ok
    assert any("committed changes are lost" in p for p in report.problems), report
    assert {p.name: p.read_bytes() for p in crashed.iterdir() if not p.name.endswith("-shm")} == files  # read-only
    good = check(str(live))
    bad_rows = [p for p in good.problems if "does not parse" in p]
    assert len(bad_rows) == 2 and "'acme'" in bad_rows[0] and "'beta'" in bad_rows[1], good


def test_check_names_a_file_a_start_would_refuse_and_restore_refuses_what_it_cannot_open(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage"
    garbage.mkdir(mode=0o700)
    (garbage / STATE_FILE).write_bytes(b"not a database at all\n" * 300)
    report = check(str(garbage))
    assert not report.ok and "not a usable SQLite database" in report.problems[0]
    live = tmp_path / "live"
    with StateStore.open(str(live)) as store:
        store.put_registry_key(KEY)
    newer = tmp_path / "newer.db"
    backup(str(live), str(newer))
    conn = sqlite3.connect(newer)
    conn.execute("UPDATE schema_version SET version = ?, oldest_reader = ?", (SCHEMA_VERSION + 1, SCHEMA_VERSION + 1))
    conn.commit()
    conn.close()
    before = (live / STATE_FILE).read_bytes()
    with pytest.raises(StateError, match="needs at least version"):
        restore(str(live), str(newer))
    with pytest.raises(StateError, match="no such backup file"):
        restore(str(live), str(tmp_path / "nothing.db"))
    assert (live / STATE_FILE).read_bytes() == before and not list(live.glob("*.replaced-*"))
    assert not list(live.glob("*.restoring"))
