"""The state database's format: schema versions and migrations, the checks a file must pass
before anything is written to it, and the commit counter kept beside it (``state.commits``).

Private to :mod:`supervisor.store` (the store, :mod:`~supervisor.store.state`, and the offline
tools, :mod:`~supervisor.store.backup`, share it); what each rule is for is told in
:mod:`supervisor.store.state`'s docstring.
"""

from __future__ import annotations

import logging
import os
import sqlite3

from shared.errors import StateError
from shared.log import get_logger, log_event

__all__ = ["OLDEST_READER", "SCHEMA_VERSION"]

_log = get_logger("supervisor")

SCHEMA_VERSION = 4
#: the oldest schema version whose code may open a database of this version (see "Newer schemas")
OLDEST_READER = 2
#: ``state.commits`` holds the count as this many decimal digits and a newline (one in-place write)
_COMMITS_WIDTH = 20
#: the connection's page cache (KiB; SQLite's default is 2,000): a registration writes a few pages
#: at the end of a table and a start reads each table once, so a small cache serves them as fast,
#: and the default's 2 MiB would be ~190 B of the supervisor's RSS per tenant at 10,000 tenants
CACHE_KIB = 256

#: names in ``key_material`` the store owns; other names are free for callers
#: (e.g. ``curve.public`` / ``curve.secret`` for the TCP frontend)
_KEY_REGISTRY_ID = "registry.id"
_KEY_REGISTRY_SECRET = "registry.secret"

#: version -> the statements that bring version-1 to it (applied in order, each
#: migration one transaction together with its version bump; a first start's, all of them one)
_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        "CREATE TABLE key_material (name TEXT PRIMARY KEY, material BLOB NOT NULL, updated_at REAL NOT NULL)",
        "CREATE TABLE retired_keys (registry_id BLOB PRIMARY KEY, retired_at REAL NOT NULL)",
        """CREATE TABLE tenants (
            tenant_id TEXT PRIMARY KEY,
            spec TEXT NOT NULL,
            registered_spec TEXT NOT NULL,
            origin TEXT NOT NULL CHECK (origin IN ('file', 'runtime')),
            generation INTEGER NOT NULL,
            failed_reason TEXT,
            registered_at REAL NOT NULL,
            updated_at REAL NOT NULL)""",
        "CREATE TABLE generations (tenant_id TEXT PRIMARY KEY, generation INTEGER NOT NULL)",
    ),
    # the commit counter (lost-WAL detection) and the oldest reader (rollback rule); a version-1
    # supervisor refuses this file by its version alone
    2: (
        "CREATE TABLE commits (seq INTEGER NOT NULL)",
        "INSERT INTO commits (seq) VALUES (0)",
        "ALTER TABLE schema_version ADD COLUMN oldest_reader INTEGER NOT NULL DEFAULT 1",
        "UPDATE schema_version SET oldest_reader = 2",
    ),
    # parked tenants come back parked (supervisor.lifecycle.parking); a version-2 supervisor reads
    # this file as it is (the column has a default), so the oldest reader stays 2
    3: ("ALTER TABLE tenants ADD COLUMN parked INTEGER NOT NULL DEFAULT 0",),
    # a parked tenant's quota counters (supervisor.store.tenant_quota.kept_counters_json), so a
    # restart brings them back; NULL for an active tenant. Only added: the oldest reader stays 2
    4: ("ALTER TABLE tenants ADD COLUMN parked_quota TEXT",),
}
_TABLES = frozenset({"schema_version", "key_material", "retired_keys", "tenants", "generations", "commits"})


_LOST = ("{what}, but this state directory was initialized before ({marker} exists): its data is lost or "
         "was not restored with it (a copy without its -wal file?); restore a backup (docs/OPERATIONS.md, "
         "\"Backing up the state\"), or remove the marker to start afresh with a new key and no tenants")


_LOST_COMMITS = ("{what}, but {n} were acknowledged ({file}): committed changes are lost - its -wal file was "
                 "truncated or deleted, or it was replaced by an older copy (a copy of state.db alone). Nothing "
                 "was changed. Put the lost -wal file back, or restore a backup on purpose with "
                 "'twt state restore BACKUP' (docs/OPERATIONS.md, \"Backing up the state\")")


def _seq_of(conn: sqlite3.Connection, path: str) -> int:
    """The committed-transaction counter of an opened (migrated) database."""
    try:
        rows = conn.execute("SELECT seq FROM commits").fetchall()
    except sqlite3.Error as exc:
        raise StateError(path, f"unreadable commit counter ({exc})") from None
    if len(rows) != 1 or not isinstance(rows[0][0], int) or rows[0][0] < 0:
        raise StateError(path, f"the commits table must hold one integer row >= 0; found {rows!r:.80}")
    return int(rows[0][0])


def _read_commits(path: str) -> int | None:
    """The acknowledged commit count in ``state.commits``; None when there is no such file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(256)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(path, f"cannot read the commit counter: {exc.strerror}") from None
    text = raw.decode("ascii", errors="replace").strip()
    if not text.isdigit():
        raise StateError(path, f"the commit counter is unreadable ({text[:40]!r}); it holds one decimal "
                               "number - check the state with 'twt state check', or restore a backup")
    return int(text)


def _fsync_dir(state_dir: str, path: str) -> None:
    """Make a new file's name durable."""
    try:
        dfd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        raise StateError(path, f"cannot sync the state directory: {exc.strerror}") from None


def _open_commits(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise StateError(path, f"cannot open the commit counter: {exc.strerror}") from None


def _write_commits(fd: int, path: str, seq: int, *, sync: bool = True) -> None:
    """One fixed-width write in place (no new blocks, a single sector), then fdatasync (``sync``)."""
    try:
        os.pwrite(fd, f"{seq:0{_COMMITS_WIDTH}d}\n".encode(), 0)
        if sync:
            os.fdatasync(fd)
    except OSError as exc:
        raise StateError(path, f"cannot write the commit counter: {exc.strerror}") from None


def _registry_key_of(conn: sqlite3.Connection) -> bytes | None:
    row = conn.execute("SELECT material FROM key_material WHERE name = ?", (_KEY_REGISTRY_SECRET,)).fetchone()
    return None if row is None else bytes(row[0])


def _connect(path: str) -> sqlite3.Connection:
    """Connect without writing anything (a new file is created 0600 first)."""
    if not os.path.exists(path):
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            pass
        except OSError as exc:
            raise StateError(path, f"cannot create: {exc.strerror}") from None
    elif not os.path.isfile(path):
        raise StateError(path, "is not a regular file")
    try:
        # isolation_level=None: transactions are explicit (_tx), nothing is begun behind our back
        return sqlite3.connect(path, isolation_level=None, timeout=5.0, check_same_thread=False)
    except sqlite3.Error as exc:
        raise StateError(path, f"cannot open: {exc}") from None


def _check_before_writing(path: str, marker: str | None, acknowledged: int | None, commits_path: str) -> int:
    """Every refusal of a start, on a read-only connection: closing a read-write one would fold
    what is left of a WAL into ``state.db`` (and delete it) - a write to a state being refused.
    Creates an empty file on a first start. Returns the schema version (0: a first start)."""
    if not os.path.exists(path):
        if marker is not None:
            raise StateError(path, _LOST.format(what="is missing", marker=marker))
        _connect(path).close()  # creates the file 0600; nothing written into it
    elif not os.path.isfile(path):
        raise StateError(path, "is not a regular file")
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    except sqlite3.Error as exc:
        raise StateError(path, f"cannot open: {exc}") from None
    try:
        version = _validate(conn, path, marker)
        if version > 0 and marker is not None and _registry_key_of(conn) is None:
            raise StateError(path, _LOST.format(what="holds no registry key", marker=marker))
        seq = _seq_of(conn, path) if version >= 2 else 0
        # an empty file without the marker is a first start (or one afresh on purpose: the
        # marker removed), whatever an earlier state's counter said
        if version > 0 and acknowledged is not None and seq < acknowledged:
            raise StateError(path, _LOST_COMMITS.format(
                what=f"holds {seq} committed transaction(s)", n=acknowledged, file=commits_path))
    except sqlite3.Error as exc:
        raise StateError(path, f"not a usable SQLite database ({exc}); restore a backup or move it away") from None
    finally:
        conn.close()
    return version


def _validate(conn: sqlite3.Connection, path: str, marker: str | None, *, warn: bool = True) -> int:
    """Read-only checks of an opened database, before anything is written to it (then
    :func:`_migrate`); its schema version (0: empty, a first start). ``marker``: the state was
    initialized before, so an empty file is a loss, not a first start. ``warn``: log a newer
    schema that this version may open (the start does; a check reports it)."""
    try:
        check = conn.execute("PRAGMA quick_check").fetchall()
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as exc:
        raise StateError(path, f"not a usable SQLite database ({exc}); restore a backup or move it away") from None
    if check != [("ok",)]:
        detail = "; ".join(str(r[0]) for r in check[:3])
        raise StateError(path, f"corrupt (quick_check: {detail}); restore a backup or move it away")
    version = 0
    if not tables and marker is not None:
        raise StateError(path, _LOST.format(what="is empty", marker=marker))
    if tables:
        if "schema_version" not in tables:
            raise StateError(path, f"not a tensor-wasm-tenant state database (tables: {', '.join(sorted(tables))})")
        try:
            rows = conn.execute("SELECT version FROM schema_version").fetchall()
        except sqlite3.DatabaseError as exc:
            raise StateError(path, f"unreadable schema_version ({exc})") from None
        if len(rows) != 1 or not isinstance(rows[0][0], int):
            raise StateError(path, f"schema_version must hold one integer row; found {rows!r:.80}")
        version = rows[0][0]
        if version > SCHEMA_VERSION:
            oldest = _oldest_reader(conn, path)
            if oldest > SCHEMA_VERSION:
                raise StateError(
                    path,
                    f"schema version {version} is newer than this supervisor's ({SCHEMA_VERSION}) and needs "
                    f"at least version {oldest} to open; run the newer version, or restore a backup made "
                    "for this one ('twt state restore BACKUP')",
                )
            if warn:
                log_event(_log, logging.WARNING, "state.newer_schema", state=path, version=version,
                          ours=SCHEMA_VERSION, oldest_reader=oldest,
                          detail="opened as it is: its additions are kept and ignored, nothing is migrated")
        missing = sorted(t for t in _TABLES if t not in tables and _created_by(t) <= version)
        if missing:
            raise StateError(path, f"schema version {version} but table(s) missing: {', '.join(missing)}")
    return int(version)


def _migrate(conn: sqlite3.Connection, path: str, version: int) -> None:
    """WAL mode, then every migration from ``version`` on, each one transaction with its version bump
    (a first start, ``version`` 0: all of them one transaction)."""
    try:
        conn.execute("PRAGMA journal_mode = WAL").fetchone()
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute(f"PRAGMA cache_size = {-CACHE_KIB}")
        if 0 < version < SCHEMA_VERSION:
            log_event(_log, logging.INFO, "state.migrate", state=path, version=version, to=SCHEMA_VERSION)
        # a first start makes the whole schema in one transaction: all or nothing, as each step is,
        # and one commit (one sync of the WAL) where a transaction per step costs one each
        steps = [range(1, SCHEMA_VERSION + 1)] if version == 0 else [range(t, t + 1) for t in
                                                                      range(version + 1, SCHEMA_VERSION + 1)]
        for step in steps:
            conn.execute("BEGIN IMMEDIATE")
            for target in step:
                if target == 1:
                    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
                    conn.execute("INSERT INTO schema_version (version) VALUES (0)")
                for statement in _MIGRATIONS[target]:
                    conn.execute(statement)
                conn.execute("UPDATE schema_version SET version = ?", (target,))
            conn.execute("COMMIT")
    except sqlite3.Error as exc:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise StateError(path, f"cannot prepare the database: {exc}") from None


def _oldest_reader(conn: sqlite3.Connection, path: str) -> int:
    """``schema_version.oldest_reader`` (1 where the column predates it)."""
    columns = {r[1] for r in conn.execute("PRAGMA table_info(schema_version)")}
    if "oldest_reader" not in columns:
        return 1
    row = conn.execute("SELECT oldest_reader FROM schema_version").fetchone()
    if row is None or not isinstance(row[0], int):
        raise StateError(path, f"schema_version.oldest_reader must be an integer; found {row!r:.80}")
    return int(row[0])


def _created_by(table: str) -> int:
    """The schema version that introduced ``table``."""
    if table == "schema_version":
        return 1
    for version, statements in sorted(_MIGRATIONS.items()):
        if any(f"CREATE TABLE {table} " in s for s in statements):
            return version
    return SCHEMA_VERSION + 1
