"""The durable state store: layout, permissions, transactions, bad files, SIGKILL mid-write."""

from __future__ import annotations

import os
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shared.errors import StateError, UnknownTenant
from shared.spec import TenantSpec
from supervisor.store.backup import backup
from supervisor.store.state import MARKER_FILE, SCHEMA_VERSION, STATE_FILE, RegistryKey, StateStore
from tests.helpers.timeouts import scaled

KEY = RegistryKey(b"r" * 16, b"s" * 32)


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_first_start_creates_a_private_directory_and_file(tmp_path: Path) -> None:
    state_dir = tmp_path / "a" / "state"
    with StateStore.open(str(state_dir)) as store:
        assert store.registry_key() is None and store.tenants() == [] and store.generations() == {}
        store.put_registry_key(KEY)
    assert _mode(state_dir) == 0o700
    for name in os.listdir(state_dir):
        assert _mode(state_dir / name) == 0o600, name
    conn = sqlite3.connect(state_dir / STATE_FILE)
    try:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    finally:
        conn.close()


def _wal_commits(wal: Path) -> int:
    """How many transactions a WAL file holds: its frames whose header names the database's size
    after a commit (SQLite's WAL format: a 32-byte header with the page size at bytes 8-11, then per
    frame a 24-byte header, whose bytes 4-7 are non-zero only on a commit's last frame, and a page)."""
    data = wal.read_bytes()
    page = int.from_bytes(data[8:12], "big")
    commits, at = 0, 32
    while at + 24 + page <= len(data):
        commits += int.from_bytes(data[at + 4:at + 8], "big") != 0
        at += 24 + page
    return commits


def test_a_first_start_makes_the_whole_schema_in_one_transaction(tmp_path: Path) -> None:
    """All or nothing, and one commit (one sync of the WAL) where each migration step's own would be
    one each: a new state directory is every supervisor start's in the test suite."""
    state_dir = tmp_path / "state"
    with StateStore.open(str(state_dir)) as store:
        assert _wal_commits(state_dir / (STATE_FILE + "-wal")) == 1
        assert store.commits == 0 and store.registry_key() is None
    conn = sqlite3.connect(state_dir / STATE_FILE)
    try:
        assert conn.execute("SELECT version, oldest_reader FROM schema_version").fetchall() == [(SCHEMA_VERSION, 2)]
        assert conn.execute("SELECT seq FROM commits").fetchall() == [(0,)]
        columns = [r[1] for r in conn.execute("PRAGMA table_info(tenants)")]
        assert columns[-2:] == ["parked", "parked_quota"]  # the last steps' columns, in their order
    finally:
        conn.close()


def test_everything_round_trips_through_a_reopen(tmp_path: Path) -> None:
    spec = TenantSpec("acme").with_memory_quota_bytes("1MiB").with_instances(2)
    with StateStore.open(str(tmp_path)) as store:
        store.put_registry_key(KEY)
        store.put_key("curve.secret", b"\x00curve")
        store.register(spec, 1, "file")
        store.register(TenantSpec("beta"), 3, "runtime")
        store.update_spec(spec.with_gpu_memory_bytes_cap("1GiB"))
        store.set_failed("beta", "6 restarts within 60 s")
        store.register(TenantSpec("gone"), 2, "runtime")
        store.evict("gone")
        with pytest.raises(UnknownTenant):
            store.update_spec(TenantSpec("nobody"))
        with pytest.raises(UnknownTenant):
            store.set_failed("nobody", None)
    with StateStore.open(str(tmp_path)) as store:
        assert store.registry_key() == KEY and "s" * 4 not in repr(store.registry_key())
        assert store.get_key("curve.secret") == b"\x00curve" and store.get_key("curve.public") is None
        acme, beta = store.tenants()
        assert acme.spec == spec.with_gpu_memory_bytes_cap("1GiB") and acme.registered_spec == spec
        assert (acme.origin, acme.generation, acme.failed) == ("file", 1, False)
        assert (beta.origin, beta.generation, beta.failed_reason) == ("runtime", 3, "6 restarts within 60 s")
        assert store.generations() == {"acme": 1, "beta": 3, "gone": 2}  # evicted: generation kept
        store.set_failed("beta", None)
        store.update_spec(spec, registered_spec=spec.with_instances(1))
        store.delete_key("curve.secret")
    with StateStore.open(str(tmp_path)) as store:
        acme = store.tenant("acme")
        assert acme is not None and acme.registered_spec.instances == 1 and acme.spec == spec
        assert store.tenant("beta") is not None and not store.tenant("beta").failed  # type: ignore[union-attr]
        assert store.get_key("curve.secret") is None


def test_key_rotation_records_the_retired_id(tmp_path: Path) -> None:
    with StateStore.open(str(tmp_path)) as store:
        store.put_registry_key(KEY)
        new = RegistryKey(b"n" * 16, b"t" * 32)
        store.put_registry_key(new, retire=KEY.registry_id)
        assert store.registry_key() == new and store.retired_registry_ids() == {KEY.registry_id}


def test_named_key_material_guards_its_names(tmp_path: Path) -> None:
    with StateStore.open(str(tmp_path)) as store:
        with pytest.raises(ValueError, match="registry"):
            store.put_key("registry.secret", b"x")
        with pytest.raises(ValueError):
            store.put_key("", b"x")
        with pytest.raises(TypeError):
            store.put_key("curve.public", "text")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            store.delete_key("registry.id")


def test_a_second_supervisor_is_kept_off(tmp_path: Path) -> None:
    with StateStore.open(str(tmp_path)):
        with pytest.raises(StateError, match=f"in use by another supervisor \\(pid {os.getpid()}\\)"):
            StateStore.open(str(tmp_path))
    StateStore.open(str(tmp_path)).close()  # the lock went with the first


def _untouched(path: Path, action: object) -> StateError:
    before = (path.read_bytes(), os.stat(path).st_mtime_ns)
    with pytest.raises(StateError) as info:
        StateStore.open(str(path.parent))
    assert (path.read_bytes(), os.stat(path).st_mtime_ns) == before, action
    assert info.value.path.endswith(STATE_FILE) and str(path) in str(info.value)
    return info.value


def test_garbage_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / STATE_FILE
    path.write_bytes(b"not a database at all\n" * 300)
    err = _untouched(path, "garbage")
    assert "not a usable SQLite database" in err.detail


def test_a_truncated_database_is_refused(tmp_path: Path) -> None:
    with StateStore.open(str(tmp_path)) as store:
        for i in range(200):
            store.register(TenantSpec(f"t{i}").with_memory_quota_bytes(1 + i), 1, "runtime")
    path = tmp_path / STATE_FILE
    data = path.read_bytes()
    assert len(data) > 8192
    path.write_bytes(data[: len(data) // 2])
    err = _untouched(path, "truncated")
    assert "corrupt" in err.detail or "not a usable" in err.detail


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    StateStore.open(str(tmp_path)).close()
    path = tmp_path / STATE_FILE
    conn = sqlite3.connect(path)
    conn.execute("UPDATE schema_version SET version = ?, oldest_reader = ?", (SCHEMA_VERSION + 1, SCHEMA_VERSION + 1))
    conn.commit()
    conn.close()
    err = _untouched(path, "newer")
    assert f"schema version {SCHEMA_VERSION + 1} is newer" in err.detail
    assert f"needs at least version {SCHEMA_VERSION + 1}" in err.detail and "twt state restore" in err.detail


def test_someone_elses_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / STATE_FILE
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.commit()
    conn.close()
    err = _untouched(path, "foreign")
    assert "not a tensor-wasm-tenant state database" in err.detail


def test_a_row_that_does_not_parse_is_an_error_not_a_crash(tmp_path: Path) -> None:
    with StateStore.open(str(tmp_path)) as store:
        store.register(TenantSpec("acme"), 1, "file")
        store._conn.execute("UPDATE tenants SET spec = '{\"tenant_id\": \"acme\", \"instances\": \"many\"}'")
        with pytest.raises(StateError, match="tenant 'acme' does not parse"):
            store.tenants()


def test_a_state_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.getuid() == 0:
        pytest.skip("root owns everything")
    with pytest.raises(StateError, match="cannot create|belongs to"):
        StateStore.open("/proc/twt-state")


# ------------------------------------------------------- SIGKILL mid-write

_WRITER = textwrap.dedent(
    """
    import sys
    from shared.spec import TenantSpec
    from supervisor.store.state import StateStore

    store = StateStore.open(sys.argv[1])
    base = TenantSpec("main").with_memory_quota_bytes(1 << 20)
    if store.tenant("main") is None:
        store.register(base, 1, "file")
    i = 0
    while True:
        i += 1
        # one admin change = one transaction (set_quota), then a register of two rows
        store.update_spec(base.with_memory_quota_bytes((1 << 20) + i))
        store.register(TenantSpec(f"t{i % 50}").with_memory_quota_bytes(4096 + i), i, "runtime")
        print(i, flush=True)
    """
)


@pytest.mark.parametrize("round_", range(3))
def test_sigkill_in_the_middle_of_admin_writes_leaves_old_or_new_state(tmp_path: Path, round_: int) -> None:
    """A writer is SIGKILLed at an arbitrary moment; the file holds a state it committed, whole."""
    repo = Path(__file__).resolve().parents[3]
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path)],
        stdout=subprocess.PIPE,
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    assert proc.stdout is not None
    last = 0
    deadline = time.monotonic() + scaled(60)
    want = 20 + 17 * round_  # kill at a different point in each round
    try:
        while last < want and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            last = int(line)
        proc.send_signal(signal.SIGKILL)
        rest = proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert last >= want, "the writer did not get going"
    printed = [int(x) for x in rest.split()]
    last = max([last, *printed])  # committed for sure
    with StateStore.open(str(tmp_path)) as store:
        main = store.tenant("main")
        assert main is not None
        quota = main.spec.memory_quota_bytes - (1 << 20)
        assert quota in (last, last + 1), (quota, last)  # the old state or the new, nothing else
        generations = store.generations()
        for record in store.tenants():
            if record.tenant_id != "main":
                # register wrote two rows in one transaction: both or neither
                assert generations[record.tenant_id] == record.generation
                assert record.spec.memory_quota_bytes == 4096 + record.generation
        newest = max(g for t, g in generations.items() if t != "main")
        assert newest in (last, last + 1)


def test_state_dir_setting(tmp_path: Path) -> None:
    from shared.config import SupervisorConfig, load_config

    run_dir = str(tmp_path / "run")
    assert SupervisorConfig(run_dir=run_dir).state_path == os.path.join(run_dir, "state")
    cfg_file = tmp_path / "twt.toml"
    cfg_file.write_text(f'[supervisor]\nrun_dir = "{run_dir}"\nstate_dir = "{tmp_path / "file"}"\n')
    cfg = load_config(cfg_file, environ={})
    assert cfg.state_path == str(tmp_path / "file") and cfg.config_file == str(cfg_file)
    cfg = load_config(cfg_file, environ={"TWT_STATE_DIR": str(tmp_path / "env")})
    assert cfg.state_path == str(tmp_path / "env")
    cfg = load_config(cfg_file, environ={"TWT_STATE_DIR": "x"}, overrides={"state_dir": str(tmp_path / "flag")})
    assert cfg.state_path == str(tmp_path / "flag")
    assert "config_file" not in cfg.to_dict()
    with pytest.raises(ValueError, match="state_dir"):
        SupervisorConfig(run_dir=run_dir, state_dir="")
    bad = tmp_path / "bad.toml"
    bad.write_text('[supervisor]\nconfig_file = "/etc/x"\n')
    with pytest.raises(ValueError, match="unknown \\[supervisor\\] key"):
        load_config(bad, environ={})


# ----------------------------------------------------------------------- WAL, marker, backup


def test_the_key_and_every_admin_write_reach_the_database_file_without_the_wal(tmp_path: Path) -> None:
    """A copy of state.db alone (its WAL lost) holds the registry key: put_registry_key checkpoints,
    and an explicit checkpoint (what the supervisor runs once admin writes pause) folds the rest in."""
    with StateStore.open(str(tmp_path)) as store:
        store.put_registry_key(KEY)
        wal = tmp_path / (STATE_FILE + "-wal")
        assert not wal.exists() or wal.stat().st_size == 0
        store.register_many([(TenantSpec("a"), 1, "runtime"), (TenantSpec("b"), 2, "file")])
        store.checkpoint()
        assert not wal.exists() or wal.stat().st_size == 0
        copy = tmp_path / "copy"
        copy.mkdir(mode=0o700)
        (copy / STATE_FILE).write_bytes((tmp_path / STATE_FILE).read_bytes())  # the file alone
    with StateStore.open(str(copy)) as again:
        assert again.registry_key() == KEY
        assert [t.tenant_id for t in again.tenants()] == ["a", "b"] and again.generations() == {"a": 1, "b": 2}


@pytest.mark.parametrize("loss", ["deleted", "emptied", "no key"])
def test_a_lost_database_is_refused_where_one_was_initialized(tmp_path: Path, loss: str) -> None:
    with StateStore.open(str(tmp_path)) as store:
        store.put_registry_key(KEY)
    assert (tmp_path / MARKER_FILE).exists() and _mode(tmp_path / MARKER_FILE) == 0o600
    db = tmp_path / STATE_FILE
    if loss == "deleted":
        db.unlink()
    elif loss == "emptied":
        db.write_bytes(b"")
    else:
        conn = sqlite3.connect(db)
        conn.execute("DELETE FROM key_material")
        conn.commit()
        conn.close()
    with pytest.raises(StateError, match="was initialized before") as info:
        StateStore.open(str(tmp_path))
    assert "\n" not in str(info.value) and MARKER_FILE in str(info.value)
    if loss == "deleted":
        assert not db.exists()  # refused before anything was created
    elif loss == "emptied":
        assert db.read_bytes() == b""  # refused before anything was written
    (tmp_path / MARKER_FILE).unlink()  # the operator's way to start afresh on purpose
    with StateStore.open(str(tmp_path)) as store:
        assert store.registry_key() is None


def test_backup_copies_a_live_store_into_one_self_contained_file(tmp_path: Path) -> None:
    live = tmp_path / "live"
    with StateStore.open(str(live)) as store:  # the supervisor holds it (lock, connection) meanwhile
        store.put_registry_key(KEY)
        store.register(TenantSpec("acme"), 4, "runtime")  # in the WAL only: no checkpoint yet
        info = backup(str(live), str(tmp_path / "b.db"))
        assert info["tenants"] == 1 and info["registry_key"] is True
        with pytest.raises(StateError, match="exists already"):
            backup(str(live), str(tmp_path / "b.db"))
    assert _mode(tmp_path / "b.db") == 0o600
    assert not (tmp_path / "b.db-wal").exists()
    restored = tmp_path / "restored"
    restored.mkdir(mode=0o700)
    os.replace(tmp_path / "b.db", restored / STATE_FILE)
    with StateStore.open(str(restored)) as store:
        assert store.registry_key() == KEY and store.generations() == {"acme": 4}
    with pytest.raises(StateError, match="no state database"):
        backup(str(tmp_path / "nowhere"), str(tmp_path / "c.db"))
    assert not (tmp_path / "c.db").exists()
