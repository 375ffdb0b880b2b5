"""State that survives a restart: one SQLite database in the state directory.

What it holds, and why each piece must outlive the process::

    schema_version   one row: the layout of this file (migrations below)
    key_material     named secrets: the registry's key and id (capabilities verify
                     across restarts), the CURVE key pair of the TCP frontend, ...
    retired_keys     registry ids replaced by ``rotate-key``: their capabilities
                     are refused as *revoked*, not as foreign
    tenants          each tenant's spec as registered (file or runtime) and as
                     changed since, its generation, failed state and reason, origin
    generations      the last generation issued per tenant id, kept after an
                     eviction so a re-registered tenant never reuses one (the
                     evicted tenant's capabilities stay revoked)

Durability: WAL with ``synchronous=FULL``; every admin change is exactly one
``BEGIN IMMEDIATE ... COMMIT`` transaction, so a SIGKILL at any instant leaves
the old state or the new one, never a mix. Only the supervisor loop writes,
and only on admin operations (never on the request path) - directly, or
through :meth:`StateStore.submit`: one writer thread on which a registration's
commit (and the checkpoint) runs while the loop goes on serving; a lock keeps
the connection to one user at a time.

Bad state is never reset behind the operator's back: a file that is not a
SQLite database, fails ``quick_check``, is not ours, or has a newer schema
raises :class:`~shared.errors.StateError` naming the file and the problem,
before anything is written to it. A missing file is a first start. The
directory is 0700 and owned by us; the files are 0600; a ``state.lock``
(``flock``) keeps a second supervisor off the same state.

Checkpoints: the WAL is folded into ``state.db`` and truncated
(``wal_checkpoint(TRUNCATE)``) after the first start's key creation and after
every admin write, so ``state.db`` alone holds all acknowledged state - a
copy of it without its WAL, or a lost WAL, loses nothing.

The marker: once the registry key is stored, ``state.initialized`` is written
beside the database. A start that then finds the database missing, empty or
without its registry key refuses with one :class:`StateError` line instead
of silently starting afresh with a new key and no tenants (restore a backup,
or remove the marker to start afresh on purpose).

A backup of a running supervisor: ``twt state backup DEST`` (SQLite's online
backup API, :func:`backup`), or ``sqlite3 state.db ".backup copy.db"`` (see
docs/OPERATIONS.md).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, TypeVar

from shared.errors import StateError, UnknownTenant
from shared.spec import TenantSpec

__all__ = [
    "MARKER_FILE",
    "SCHEMA_VERSION",
    "STATE_FILE",
    "backup",
    "Origin",
    "RegistryKey",
    "StateStore",
    "StoredTenant",
]

T = TypeVar("T")

STATE_FILE = "state.db"
LOCK_FILE = "state.lock"
#: written beside the database once it holds a registry key (see the module docstring)
MARKER_FILE = "state.initialized"
SCHEMA_VERSION = 2
Origin = Literal["file", "runtime"]
_ORIGINS = ("file", "runtime")

#: names in ``key_material`` this module owns; other names are free for callers
#: (e.g. ``curve.public`` / ``curve.secret`` for the TCP frontend)
_KEY_REGISTRY_ID = "registry.id"
_KEY_REGISTRY_SECRET = "registry.secret"

#: version -> the statements that bring version-1 to it (applied in order, each
#: migration one transaction together with its version bump)
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
    # parked tenants come back parked (supervisor.lifecycle.parking)
    2: ("ALTER TABLE tenants ADD COLUMN parked INTEGER NOT NULL DEFAULT 0",),
}
_TABLES = frozenset({"schema_version", "key_material", "retired_keys", "tenants", "generations"})


@dataclass(frozen=True)
class RegistryKey:
    """The registry's identity: public id (16 bytes) and HMAC secret (32 bytes)."""

    registry_id: bytes
    secret: bytes

    @classmethod
    def fresh(cls) -> RegistryKey:
        """A new random identity (16-byte id, 32-byte secret)."""
        return cls(secrets.token_bytes(16), secrets.token_bytes(32))

    def __repr__(self) -> str:  # never print the secret
        return f"<RegistryKey {self.registry_id.hex()[:8]}>"


@dataclass(frozen=True)
class StoredTenant:
    """One tenant as stored: what to restore it to after a restart."""

    spec: TenantSpec  # as it is now (set_quota, scale, reload applied)
    registered_spec: TenantSpec  # as registered, or as the config file last said
    origin: Origin
    generation: int
    failed_reason: str | None = None
    registered_at: float = 0.0
    updated_at: float = 0.0
    #: it was parked when last written: restored without starting a worker
    parked: bool = False

    @property
    def tenant_id(self) -> str:
        return self.spec.tenant_id

    @property
    def failed(self) -> bool:
        return self.failed_reason is not None


def _spec_json(spec: TenantSpec) -> str:
    return json.dumps(spec.to_dict(), sort_keys=True, separators=(",", ":"))


class StateStore:
    """The supervisor's durable state (see the module docstring). Loop thread only.

    Open with :meth:`open`; every mutating method is one transaction.
    """

    def __init__(self, conn: sqlite3.Connection, path: str, lock_fd: int) -> None:
        """Internal: use :meth:`open`."""
        self._conn = conn
        self.path = path
        self._lock_fd: int | None = lock_fd
        self._use = threading.RLock()  # the connection: the loop thread, or the writer thread
        self._writer: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------- opening

    @classmethod
    def open(cls, state_dir: str) -> StateStore:
        """Open (or create, on a first start) ``<state_dir>/state.db``.

        Raises :class:`StateError` when the directory or the file cannot be
        used; the file is then left exactly as it was.
        """
        state_dir = os.path.abspath(state_dir)
        path = os.path.join(state_dir, STATE_FILE)
        try:
            os.makedirs(state_dir, mode=0o700, exist_ok=True)
            st = os.stat(state_dir)
        except OSError as exc:
            raise StateError(state_dir, f"cannot create the state directory: {exc.strerror}") from None
        if st.st_uid != os.getuid():
            raise StateError(state_dir, f"the state directory belongs to uid {st.st_uid}, not to us")
        os.chmod(state_dir, 0o700)
        lock_fd = _lock(state_dir)
        try:
            marker = os.path.join(state_dir, MARKER_FILE)
            if os.path.exists(marker) and not os.path.exists(path):
                raise StateError(path, _LOST.format(what="is missing", marker=marker))
            conn = _connect(path)
            try:
                _check_and_migrate(conn, path, marker if os.path.exists(marker) else None)
                if os.path.exists(marker) and _registry_key_of(conn) is None:
                    raise StateError(path, _LOST.format(what="holds no registry key", marker=marker))
            except BaseException:
                conn.close()
                raise
        except BaseException:
            os.close(lock_fd)
            raise
        for suffix in ("", "-wal", "-shm"):
            try:
                os.chmod(path + suffix, 0o600)
            except FileNotFoundError:
                pass
        return cls(conn, path, lock_fd)

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Run ``fn(*args)`` (a method of this store) on its one writer thread, in submission order."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="twt-state")
        return self._writer.submit(fn, *args)

    def close(self) -> None:
        """Finish what was submitted, close the database (a clean WAL checkpoint), drop the lock. Idempotent."""
        if self._lock_fd is None:
            return
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        try:
            self._conn.close()
        finally:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: all of it is committed, or none of it (StateError)."""
        conn = self._conn
        with self._use:
            try:
                conn.execute("BEGIN IMMEDIATE")
                yield conn
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise StateError(self.path, f"write failed: {exc}") from None
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    # -------------------------------------------------------- key material

    def get_key(self, name: str) -> bytes | None:
        """Named key material (e.g. ``curve.secret``), or None when never stored."""
        with self._use:
            row = self._conn.execute("SELECT material FROM key_material WHERE name = ?", (name,)).fetchone()
        return None if row is None else bytes(row[0])

    def put_key(self, name: str, material: bytes) -> None:
        """Store (or replace) named key material; one transaction.

        Names starting with ``registry.`` belong to this module (use
        :meth:`put_registry_key`).
        """
        if not isinstance(name, str) or not name or name.startswith("registry."):
            raise ValueError(f"key name must be a non-empty str not starting with 'registry.'; got {name!r}")
        if not isinstance(material, bytes):
            raise TypeError(f"key material must be bytes, not {type(material).__name__}")
        with self._tx() as c:
            _put_key(c, name, material)

    def delete_key(self, name: str) -> None:
        if name.startswith("registry."):
            raise ValueError("the registry key is replaced with put_registry_key, never deleted")
        with self._tx() as c:
            c.execute("DELETE FROM key_material WHERE name = ?", (name,))

    def registry_key(self) -> RegistryKey | None:
        """The stored registry identity, or None on a first start."""
        rid = self.get_key(_KEY_REGISTRY_ID)
        secret = self.get_key(_KEY_REGISTRY_SECRET)
        if rid is None or secret is None:
            return None
        return RegistryKey(rid, secret)

    def put_registry_key(self, key: RegistryKey, *, retire: bytes | None = None) -> None:
        """Store the registry identity; ``retire``: the id it replaces (``rotate-key``)."""
        with self._tx() as c:
            _put_key(c, _KEY_REGISTRY_ID, key.registry_id)
            _put_key(c, _KEY_REGISTRY_SECRET, key.secret)
            if retire is not None and retire != key.registry_id:
                c.execute(
                    "INSERT OR REPLACE INTO retired_keys (registry_id, retired_at) VALUES (?, ?)",
                    (retire, time.time()),
                )
        self.checkpoint()
        self._write_marker(key)

    def _write_marker(self, key: RegistryKey) -> None:
        """``state.initialized`` beside the database (durable: file and directory fsynced)."""
        state_dir = os.path.dirname(self.path)
        marker = os.path.join(state_dir, MARKER_FILE)
        if os.path.exists(marker):
            return
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, f"tensor-wasm-tenant state, first registry id {key.registry_id.hex()}\n".encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            dfd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            raise StateError(marker, f"cannot write the marker: {exc.strerror}") from None

    def checkpoint(self) -> None:
        """Fold the WAL into ``state.db`` and truncate it (``wal_checkpoint(TRUNCATE)``).

        Raises :class:`StateError` when SQLite cannot (a full disk); a checkpoint that is
        only *busy* (a reader such as ``twt state backup`` holds a snapshot) is not an error:
        the commit is durable in the WAL, and the next checkpoint folds it in.
        """
        try:
            with self._use:
                self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        except sqlite3.Error as exc:
            raise StateError(self.path, f"checkpoint failed: {exc}") from None

    def retired_registry_ids(self) -> frozenset[bytes]:
        with self._use:
            return frozenset(bytes(r[0]) for r in self._conn.execute("SELECT registry_id FROM retired_keys"))

    # -------------------------------------------------------------- tenants

    def tenants(self) -> list[StoredTenant]:
        """Every stored tenant, by id. Raises :class:`StateError` for a row that does not parse."""
        out = []
        with self._use:
            rows = self._conn.execute(
                "SELECT tenant_id, spec, registered_spec, origin, generation, failed_reason, registered_at, "
                "updated_at, parked FROM tenants ORDER BY tenant_id"
            ).fetchall()
        for tid, spec, registered, origin, gen, failed, reg_at, upd_at, parked in rows:
            try:
                record = StoredTenant(
                    spec=TenantSpec.from_dict(json.loads(spec)),
                    registered_spec=TenantSpec.from_dict(json.loads(registered)),
                    origin=origin,
                    generation=int(gen),
                    failed_reason=failed,
                    registered_at=float(reg_at),
                    updated_at=float(upd_at),
                    parked=bool(parked),
                )
            except (ValueError, TypeError) as exc:
                raise StateError(self.path, f"tenant {tid!r} does not parse: {exc}") from None
            if record.tenant_id != tid or origin not in _ORIGINS:
                raise StateError(self.path, f"tenant row {tid!r} is inconsistent")
            out.append(record)
        return out

    def tenant(self, tenant_id: str) -> StoredTenant | None:
        return next((r for r in self.tenants() if r.tenant_id == tenant_id), None)

    def generations(self) -> dict[str, int]:
        """The last generation issued per tenant id (evicted ones included)."""
        with self._use:
            rows = self._conn.execute("SELECT tenant_id, generation FROM generations").fetchall()
        return {str(t): int(g) for t, g in rows}

    def register(self, spec: TenantSpec, generation: int, origin: Origin) -> StoredTenant:
        """A tenant was registered (or restored after an eviction): one transaction."""
        return self.register_many([(spec, generation, origin)])[0]

    def register_many(self, batch: list[tuple[TenantSpec, int, Origin]]) -> list[StoredTenant]:
        """Several registrations in one transaction (group commit: one fsync for all of them).

        Statements are the same text every time, so SQLite's statement cache keeps them prepared.
        """
        for _, _, origin in batch:
            if origin not in _ORIGINS:
                raise ValueError(f"origin must be one of {_ORIGINS}; got {origin!r}")
        if not batch:
            return []
        now = time.time()
        rows = [(spec.tenant_id, _spec_json(spec), origin, generation, now) for spec, generation, origin in batch]
        with self._tx() as c:
            c.executemany(
                "INSERT OR REPLACE INTO tenants (tenant_id, spec, registered_spec, origin, generation, "
                "failed_reason, registered_at, updated_at) VALUES (?1, ?2, ?2, ?3, ?4, NULL, ?5, ?5)",
                rows,
            )
            c.executemany(
                "INSERT OR REPLACE INTO generations (tenant_id, generation) VALUES (?, ?)",
                [(spec.tenant_id, generation) for spec, generation, _ in batch],
            )
        return [StoredTenant(spec, spec, origin, generation, None, now, now) for spec, generation, origin in batch]

    def update_spec(self, spec: TenantSpec, *, registered_spec: TenantSpec | None = None) -> None:
        """A live change (set_quota, scale, reload); ``registered_spec``: what the file now says."""
        sets = ["spec = ?", "updated_at = ?"]
        values: list[object] = [_spec_json(spec), time.time()]
        if registered_spec is not None:
            sets.append("registered_spec = ?")
            values.append(_spec_json(registered_spec))
        with self._tx() as c:
            cur = c.execute(f"UPDATE tenants SET {', '.join(sets)} WHERE tenant_id = ?", (*values, spec.tenant_id))
            if cur.rowcount != 1:
                raise UnknownTenant(spec.tenant_id)

    def set_failed(self, tenant_id: str, reason: str | None) -> None:
        """Mark a tenant failed (restart intensity exceeded), or clear it (``reset``)."""
        with self._tx() as c:
            cur = c.execute(
                "UPDATE tenants SET failed_reason = ?, updated_at = ? WHERE tenant_id = ?",
                (reason, time.time(), tenant_id),
            )
            if cur.rowcount != 1:
                raise UnknownTenant(tenant_id)

    def set_parked(self, tenant_id: str, parked: bool) -> None:
        """The tenant was parked, or activated (a tenant evicted meanwhile: nothing to do)."""
        with self._tx() as c:
            c.execute("UPDATE tenants SET parked = ? WHERE tenant_id = ?", (int(parked), tenant_id))

    def evict(self, tenant_id: str) -> None:
        """The tenant is gone; its generation is kept (its capabilities stay revoked)."""
        with self._tx() as c:
            c.execute("DELETE FROM tenants WHERE tenant_id = ?", (tenant_id,))

    def __repr__(self) -> str:
        return f"<StateStore {self.path}>"


# ------------------------------------------------------------------ helpers


def _put_key(c: sqlite3.Connection, name: str, material: bytes) -> None:
    c.execute(
        "INSERT OR REPLACE INTO key_material (name, material, updated_at) VALUES (?, ?, ?)",
        (name, material, time.time()),
    )


_LOST = ("{what}, but this state directory was initialized before ({marker} exists): its data is lost or "
         "was not restored with it (a copy without its -wal file?); restore a backup (docs/OPERATIONS.md, "
         "\"Backing up the state\"), or remove the marker to start afresh with a new key and no tenants")


def _registry_key_of(conn: sqlite3.Connection) -> bytes | None:
    row = conn.execute("SELECT material FROM key_material WHERE name = ?", (_KEY_REGISTRY_SECRET,)).fetchone()
    return None if row is None else bytes(row[0])


def backup(state_dir: str, dest: str) -> dict[str, object]:
    """Copy the state database to ``dest`` with SQLite's online backup API.

    Safe while a supervisor runs (a read transaction: it never takes ``state.lock``
    and sees one consistent snapshot, WAL included). ``dest`` must not exist; it is
    written 0600 as a single self-contained file (rollback journal, no WAL), checked
    with ``quick_check`` and fsynced. Returns what was copied (path, bytes, tenants).
    Raises :class:`StateError`.
    """
    path = os.path.join(os.path.abspath(state_dir), STATE_FILE)
    dest = os.path.abspath(dest)
    if not os.path.isfile(path):
        raise StateError(path, "no state database to back up")
    if os.path.lexists(dest):
        raise StateError(dest, "exists already; the backup never overwrites a file")
    try:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
    except OSError as exc:
        raise StateError(dest, f"cannot create: {exc.strerror}") from None
    try:
        src = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)
        try:
            dst = sqlite3.connect(dest, isolation_level=None)
            try:
                src.backup(dst)
                dst.execute("PRAGMA journal_mode = DELETE").fetchone()
                check = dst.execute("PRAGMA quick_check").fetchall()
                tenants = dst.execute("SELECT COUNT(*) FROM tenants").fetchone()[0]
                has_key = _registry_key_of(dst) is not None
            finally:
                dst.close()
        finally:
            src.close()
        if check != [("ok",)]:
            raise StateError(dest, f"the copy fails quick_check: {check[:3]!r}")
        fd = os.open(dest, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except sqlite3.Error as exc:
        _remove_quietly(dest)
        raise StateError(path, f"backup failed: {exc}") from None
    except BaseException:
        _remove_quietly(dest)
        raise
    return {"source": path, "backup": dest, "bytes": os.path.getsize(dest), "tenants": int(tenants),
            "registry_key": has_key}


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _lock(state_dir: str) -> int:
    path = os.path.join(state_dir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        try:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip()
        finally:
            os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            who = f" (pid {owner})" if owner.isdigit() else ""
            raise StateError(path, f"in use by another supervisor{who}") from None
        raise StateError(path, f"cannot lock: {exc.strerror}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


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


def _check_and_migrate(conn: sqlite3.Connection, path: str, marker: str | None = None) -> None:
    """Validate read-only first; write (WAL, migrations) only once the file is known good.
    ``marker``: the state was initialized before, so an empty file is a loss, not a first start."""
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
            raise StateError(
                path,
                f"schema version {version} is newer than this supervisor's ({SCHEMA_VERSION}); "
                "run the newer version, or restore a backup made for this one",
            )
        missing = sorted(t for t in _TABLES if t not in tables and _created_by(t) <= version)
        if missing:
            raise StateError(path, f"schema version {version} but table(s) missing: {', '.join(missing)}")
    try:
        conn.execute("PRAGMA journal_mode = WAL").fetchone()
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA foreign_keys = ON")
        for target in range(version + 1, SCHEMA_VERSION + 1):
            conn.execute("BEGIN IMMEDIATE")
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


def _created_by(table: str) -> int:
    """The schema version that introduced ``table``."""
    if table == "schema_version":
        return 1
    for version, statements in sorted(_MIGRATIONS.items()):
        if any(f"CREATE TABLE {table} " in s for s in statements):
            return version
    return SCHEMA_VERSION + 1
