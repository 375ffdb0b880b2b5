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
    commits          one row: how many write transactions this state has committed
                     (the commit counter, see "Lost commits" below)

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

Lost commits: every write transaction also bumps the ``commits`` counter, and
once it is committed the new count is written (and fdatasynced) to
``state.commits`` beside the database, before the change is answered. A start
whose database holds fewer commits than that file names lost acknowledged
transactions - a truncated or deleted ``state.db-wal``, or a ``state.db``
replaced by an older copy - and refuses with one :class:`StateError` naming
the recovery (``twt state restore BACKUP``), instead of serving without them.
A database *ahead* of the file (a crash between the commit and the file's
write) is fine: the file is brought up to it. ``twt state restore`` sets the
file to the restored copy's count (an older state on purpose).

Newer schemas: ``schema_version`` also records ``oldest_reader``, the oldest
schema version whose code may open the file. A migration that only adds (a
table, a column with a default, a spec key) keeps it; one that changes the
meaning of what is there raises it. An older supervisor opens a newer file
whose ``oldest_reader`` it meets (with one warning, nothing migrated); past
it, it refuses with :class:`StateError`. A stored tenant spec with keys this
version does not know is restored without them (one warning per start) and
they are kept in the row across later changes.

A backup of a running supervisor: ``twt state backup DEST`` (SQLite's online
backup API, :func:`backup`), or ``sqlite3 state.db ".backup copy.db"`` (see
docs/OPERATIONS.md).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, TypeVar

from shared.errors import StateError, UnknownTenant
from shared.log import get_logger, log_event
from shared.spec import TenantSpec

__all__ = [
    "COMMITS_FILE",
    "MARKER_FILE",
    "SCHEMA_VERSION",
    "STATE_FILE",
    "backup",
    "Origin",
    "RegistryKey",
    "StateStore",
    "StoredTenant",
    "CheckReport",
    "check",
    "restore",
]

T = TypeVar("T")
_log = get_logger("supervisor")

STATE_FILE = "state.db"
LOCK_FILE = "state.lock"
#: written beside the database once it holds a registry key (see the module docstring)
MARKER_FILE = "state.initialized"
#: the commit counter acknowledged so far, outside the database (see "Lost commits")
COMMITS_FILE = "state.commits"
SCHEMA_VERSION = 2
#: the oldest schema version whose code may open a database of this version (see "Newer schemas")
OLDEST_READER = 2
_COMMITS_WIDTH = 20
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
    # the commit counter (lost-WAL detection) and the oldest reader (rollback rule); a version-1
    # supervisor refuses this file by its version alone
    2: (
        "CREATE TABLE commits (seq INTEGER NOT NULL)",
        "INSERT INTO commits (seq) VALUES (0)",
        "ALTER TABLE schema_version ADD COLUMN oldest_reader INTEGER NOT NULL DEFAULT 1",
        "UPDATE schema_version SET oldest_reader = 2",
    ),
}
_TABLES = frozenset({"schema_version", "key_material", "retired_keys", "tenants", "generations", "commits"})


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
    #: spec keys a newer version stored that this one does not know (kept in the row, ignored here)
    unknown_keys: tuple[str, ...] = ()

    @property
    def tenant_id(self) -> str:
        return self.spec.tenant_id

    @property
    def failed(self) -> bool:
        return self.failed_reason is not None


def _spec_json(spec: TenantSpec, keep: Mapping[str, object] | None = None) -> str:
    """The spec as stored; ``keep``: keys a newer version stored that this one carries along unread."""
    data = {**(keep or {}), **spec.to_dict()}
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def _split_spec(raw: str) -> tuple[TenantSpec, dict[str, object]]:
    """A stored spec and the keys of it this version does not know (a newer version's fields).

    ValueError / TypeError when what is left does not make a spec.
    """
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise TypeError(f"a stored spec must be an object, not {type(data).__name__}")
    known = set(TenantSpec.field_names()) | {"name"}
    unknown = {k: v for k, v in data.items() if k not in known}
    return TenantSpec.from_dict({k: v for k, v in data.items() if k in known}), unknown


class StateStore:
    """The supervisor's durable state (see the module docstring). Loop thread only.

    Open with :meth:`open`; every mutating method is one transaction.
    """

    def __init__(self, conn: sqlite3.Connection, path: str, lock_fd: int, seq: int, commits_fd: int) -> None:
        """Internal: use :meth:`open`."""
        self._conn = conn
        self.path = path
        self._lock_fd: int | None = lock_fd
        self._use = threading.RLock()  # the connection: the loop thread, or the writer thread
        self._writer: ThreadPoolExecutor | None = None
        self._seq = seq  # the commit counter as committed (one writer: the lock keeps others off)
        self._commits_fd: int | None = commits_fd
        self._warned_unknown = False

    @property
    def commits(self) -> int:
        """How many write transactions this state has committed (see "Lost commits")."""
        return self._seq

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
            commits_path = os.path.join(state_dir, COMMITS_FILE)
            acknowledged = _read_commits(commits_path)
            version = _check_before_writing(path, marker if os.path.exists(marker) else None, acknowledged,
                                            commits_path)
            conn = _connect(path)
            try:
                _migrate(conn, path, version)
                seq = _seq_of(conn, path)
                commits_fd = _open_commits(commits_path)
                try:
                    if acknowledged != seq:  # a first start, or a crash between a commit and its count
                        _write_commits(commits_fd, commits_path, seq)
                    if acknowledged is None:
                        _fsync_dir(state_dir, commits_path)
                except BaseException:
                    os.close(commits_fd)
                    raise
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
        return cls(conn, path, lock_fd, seq, commits_fd)

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
            if self._commits_fd is not None:
                os.close(self._commits_fd)
                self._commits_fd = None
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
                seq = self._seq + 1
                conn.execute("UPDATE commits SET seq = ?", (seq,))
                conn.execute("COMMIT")
                self._seq = seq
                self._count_commit(seq)
            except sqlite3.Error as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise StateError(self.path, f"write failed: {exc}") from None
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def _count_commit(self, seq: int) -> None:
        """``state.commits`` := ``seq``, durably, before the change is answered. A failure here
        leaves the file behind the database - the safe side (a start then raises it again) -
        so the committed change is not reported as failed; it is logged."""
        fd = self._commits_fd
        if fd is None:
            return
        try:
            _write_commits(fd, self._commits_path, seq)
        except StateError as exc:
            log_event(_log, logging.WARNING, "state.commits_not_counted", error=str(exc), seq=seq)

    @property
    def _commits_path(self) -> str:
        return os.path.join(os.path.dirname(self.path), COMMITS_FILE)

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
        """Every stored tenant, by id. Raises :class:`StateError` for a row that does not parse.

        Spec keys a newer version stored are left out of the spec (``unknown_keys``
        names them) and logged once per store, not refused: a rollback keeps serving.
        """
        out = []
        with self._use:
            rows = self._conn.execute(
                "SELECT tenant_id, spec, registered_spec, origin, generation, failed_reason, registered_at, "
                "updated_at FROM tenants ORDER BY tenant_id"
            ).fetchall()
        ignored: dict[str, list[str]] = {}
        for tid, spec, registered, origin, gen, failed, reg_at, upd_at in rows:
            try:
                now_spec, unknown = _split_spec(spec)
                registered_spec, unknown_registered = _split_spec(registered)
                keys = tuple(sorted({*unknown, *unknown_registered}))
                record = StoredTenant(
                    spec=now_spec,
                    registered_spec=registered_spec,
                    origin=origin,
                    generation=int(gen),
                    failed_reason=failed,
                    registered_at=float(reg_at),
                    updated_at=float(upd_at),
                    unknown_keys=keys,
                )
            except (ValueError, TypeError) as exc:
                raise StateError(self.path, f"tenant {tid!r} does not parse: {exc}") from None
            if record.tenant_id != tid or origin not in _ORIGINS:
                raise StateError(self.path, f"tenant row {tid!r} is inconsistent")
            if keys:
                ignored[tid] = list(keys)
            out.append(record)
        if ignored and not self._warned_unknown:
            self._warned_unknown = True
            log_event(_log, logging.WARNING, "state.unknown_keys_ignored", state=self.path, tenants=ignored,
                      detail="stored by a newer version; kept in the state, ignored by this one")
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
        """A live change (set_quota, scale, reload); ``registered_spec``: what the file now says.

        Keys of the stored spec this version does not know (a newer version's) are kept.
        """
        with self._tx() as c:
            row = c.execute("SELECT spec, registered_spec FROM tenants WHERE tenant_id = ?",
                            (spec.tenant_id,)).fetchone()
            if row is None:
                raise UnknownTenant(spec.tenant_id)
            sets = ["spec = ?", "updated_at = ?"]
            values: list[object] = [_spec_json(spec, _unknown_of(row[0])), time.time()]
            if registered_spec is not None:
                sets.append("registered_spec = ?")
                values.append(_spec_json(registered_spec, _unknown_of(row[1])))
            c.execute(f"UPDATE tenants SET {', '.join(sets)} WHERE tenant_id = ?", (*values, spec.tenant_id))

    def set_failed(self, tenant_id: str, reason: str | None) -> None:
        """Mark a tenant failed (restart intensity exceeded), or clear it (``reset``)."""
        with self._tx() as c:
            cur = c.execute(
                "UPDATE tenants SET failed_reason = ?, updated_at = ? WHERE tenant_id = ?",
                (reason, time.time(), tenant_id),
            )
            if cur.rowcount != 1:
                raise UnknownTenant(tenant_id)

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


_LOST_COMMITS = ("{what}, but {n} were acknowledged ({file}): committed changes are lost - its -wal file was "
                 "truncated or deleted, or it was replaced by an older copy (a copy of state.db alone). Nothing "
                 "was changed. Put the lost -wal file back, or restore a backup on purpose with "
                 "'twt state restore BACKUP' (docs/OPERATIONS.md, \"Backing up the state\")")


def _unknown_of(raw: str) -> dict[str, object]:
    """The keys of a stored spec this version does not know (kept across a rewrite)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    known = set(TenantSpec.field_names()) | {"name"}
    return {k: v for k, v in data.items() if k not in known}


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


def _write_commits(fd: int, path: str, seq: int) -> None:
    """One fixed-width write in place (no new blocks, a single sector), then fdatasync."""
    try:
        os.pwrite(fd, f"{seq:0{_COMMITS_WIDTH}d}\n".encode(), 0)
        os.fdatasync(fd)
    except OSError as exc:
        raise StateError(path, f"cannot write the commit counter: {exc.strerror}") from None


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


def restore(state_dir: str, source: str) -> dict[str, object]:
    """Put a backup (``twt state backup``) in place of the state: an older state, on purpose.

    Only while no supervisor holds the state (``state.lock``). The backup is
    checked first (a tensor-wasm-tenant database this version can open, with
    its registry key); nothing is replaced when it is not usable. The state it
    replaces is kept beside it (``state.db.replaced-<time>``, with its ``-wal``)
    rather than deleted; ``state.commits`` is set to the backup's commit count,
    so the next start accepts it (the commits made after the backup are lost by
    choice). Returns what was restored. Raises :class:`StateError`.
    """
    state_dir = os.path.abspath(state_dir)
    source = os.path.abspath(source)
    path = os.path.join(state_dir, STATE_FILE)
    if not os.path.isfile(source):
        raise StateError(source, "no such backup file")
    try:
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise StateError(state_dir, f"cannot create the state directory: {exc.strerror}") from None
    lock_fd = _lock(state_dir)  # StateError while a supervisor runs on it
    staged = os.path.join(state_dir, STATE_FILE + ".restoring")
    try:
        _remove_quietly(staged)
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        try:
            src = sqlite3.connect(f"file:{source}?mode=ro", uri=True, timeout=10.0)
            try:
                version = _validate(src, source, None, warn=False)
                if version == 0:
                    raise StateError(source, "is empty: not a backup of a state")
                if _registry_key_of(src) is None:
                    raise StateError(source, "holds no registry key: not a backup of a started supervisor")
                dst = sqlite3.connect(staged, isolation_level=None)
                try:
                    src.backup(dst)
                    dst.execute("PRAGMA journal_mode = DELETE").fetchone()
                    seq = _seq_of(dst, source) if version >= 2 else 0
                    tenants = int(dst.execute("SELECT COUNT(*) FROM tenants").fetchone()[0])
                finally:
                    dst.close()
            finally:
                src.close()
            with open(staged, "rb") as f:
                os.fsync(f.fileno())
        except sqlite3.Error as exc:
            raise StateError(source, f"not a usable backup: {exc}") from None
        replaced = None
        if os.path.exists(path):
            replaced = f"{path}.replaced-{time.strftime('%Y%m%dT%H%M%S')}"
            for suffix in ("", "-wal"):
                if os.path.exists(path + suffix):
                    os.rename(path + suffix, replaced + suffix)
        _remove_quietly(path + "-wal")
        _remove_quietly(path + "-shm")
        os.rename(staged, path)
        commits_path = os.path.join(state_dir, COMMITS_FILE)
        commits_fd = _open_commits(commits_path)
        try:
            os.ftruncate(commits_fd, 0)
            _write_commits(commits_fd, commits_path, seq)
        finally:
            os.close(commits_fd)
        marker = os.path.join(state_dir, MARKER_FILE)
        if not os.path.exists(marker):
            with open(marker, "w", encoding="ascii") as f:
                f.write("tensor-wasm-tenant state, restored from a backup\n")
                f.flush()
                os.fsync(f.fileno())
        _fsync_dir(state_dir, path)
    except OSError as exc:
        raise StateError(path, f"restore failed: {exc.strerror}") from None
    finally:
        _remove_quietly(staged)
        os.close(lock_fd)
    return {"state": path, "backup": source, "tenants": tenants, "commits": seq, "schema_version": version,
            "replaced": replaced}


@dataclass(frozen=True)
class CheckReport:
    """What :func:`check` found: ``problems`` stop a start; ``notes`` do not."""

    path: str
    problems: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def check(state_dir: str) -> CheckReport:
    """Everything a start would refuse about ``state_dir``, listed at once, without writing.

    The preflight of ``twt state check``: the directory (owner, mode), the
    database (SQLite, ``quick_check``, ours, schema version), a lost database
    or lost commits (marker, ``state.commits``), and every tenant row. Safe
    while a supervisor runs (a read-only snapshot; the lock is not taken).
    """
    state_dir = os.path.abspath(state_dir)
    path = os.path.join(state_dir, STATE_FILE)
    problems: list[str] = []
    notes: list[str] = []
    if not os.path.exists(state_dir):
        return CheckReport(path, (), (f"{state_dir} does not exist: a first start creates it",))
    try:
        st = os.stat(state_dir)
    except OSError as exc:
        return CheckReport(path, (f"{state_dir}: cannot stat: {exc.strerror}",), ())
    if not os.path.isdir(state_dir):
        return CheckReport(path, (f"{state_dir}: not a directory",), ())
    if st.st_uid != os.getuid():
        problems.append(f"{state_dir}: the state directory belongs to uid {st.st_uid}, not to us")
    if st.st_mode & 0o077:
        notes.append(f"{state_dir}: mode {st.st_mode & 0o777:o} (a start makes it 0700)")
    marker = os.path.join(state_dir, MARKER_FILE)
    commits_path = os.path.join(state_dir, COMMITS_FILE)
    try:
        acknowledged = _read_commits(commits_path)
    except StateError as exc:
        problems.append(str(exc))
        acknowledged = None
    if not os.path.exists(path):
        if os.path.exists(marker):
            problems.append(str(StateError(path, _LOST.format(what="is missing", marker=marker))))
        else:
            notes.append(f"{path} does not exist: a first start creates it")
        return CheckReport(path, tuple(problems), tuple(notes))
    if _lock_held(state_dir):
        notes.append("a supervisor holds the state now (checked a read-only snapshot)")
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)
    except sqlite3.Error as exc:
        problems.append(f"{path}: cannot open read-only: {exc}")
        return CheckReport(path, tuple(problems), tuple(notes))
    try:
        version = _validate(conn, path, marker if os.path.exists(marker) else None, warn=False)
        if version == 0:
            notes.append(f"{path} is empty: a first start initializes it")
            return CheckReport(path, tuple(problems), tuple(notes))
        if version > SCHEMA_VERSION:
            notes.append(f"schema version {version} is newer than this version's ({SCHEMA_VERSION}); "
                         "this version opens it and ignores the additions")
        elif version < SCHEMA_VERSION:
            notes.append(f"schema version {version}: a start migrates it to {SCHEMA_VERSION} "
                         "(back it up first to keep a copy older versions open)")
        if os.path.exists(marker) and _registry_key_of(conn) is None:
            problems.append(str(StateError(path, _LOST.format(what="holds no registry key", marker=marker))))
        seq = _seq_of(conn, path) if version >= 2 else 0
        if acknowledged is not None and seq < acknowledged:
            problems.append(str(StateError(path, _LOST_COMMITS.format(
                what=f"holds {seq} committed transaction(s)", n=acknowledged, file=commits_path))))
        rows = conn.execute("SELECT tenant_id, spec, registered_spec, origin FROM tenants ORDER BY tenant_id")
        count = 0
        for tid, spec, registered, origin in rows:
            count += 1
            try:
                now_spec, unknown = _split_spec(spec)
                _, unknown_registered = _split_spec(registered)
            except (ValueError, TypeError) as exc:
                problems.append(f"{path}: tenant {tid!r} does not parse: {exc}")
                continue
            if now_spec.tenant_id != tid or origin not in _ORIGINS:
                problems.append(f"{path}: tenant row {tid!r} is inconsistent")
            keys = sorted({*unknown, *unknown_registered})
            if keys:
                notes.append(f"tenant {tid!r}: key(s) {', '.join(map(repr, keys))} from a newer version "
                             "are kept and ignored")
        notes.append(f"{count} tenant(s), {seq} commit(s), schema version {version}")
    except StateError as exc:
        problems.append(str(exc))
    except sqlite3.Error as exc:
        problems.append(f"{path}: cannot read: {exc}")
    finally:
        conn.close()
    return CheckReport(path, tuple(problems), tuple(notes))


def _lock_held(state_dir: str) -> bool:
    """Whether a supervisor holds ``state.lock`` (probed without keeping it)."""
    try:
        fd = os.open(os.path.join(state_dir, LOCK_FILE), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


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
    """WAL mode, then every migration from ``version`` on, each one transaction with its version bump."""
    try:
        conn.execute("PRAGMA journal_mode = WAL").fetchone()
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA foreign_keys = ON")
        if 0 < version < SCHEMA_VERSION:
            log_event(_log, logging.INFO, "state.migrate", state=path, version=version, to=SCHEMA_VERSION)
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
