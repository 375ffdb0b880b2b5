"""State that survives a restart: one SQLite database in the state directory.

What it holds, and why each piece must outlive the process::

    schema_version   one row: the layout of this file (migrations below)
    key_material     named secrets: the registry's key and id (capabilities verify
                     across restarts), the CURVE key pair of the TCP frontend, ...
    retired_keys     registry ids replaced by ``rotate-key``: their capabilities
                     are refused as *revoked*, not as foreign
    tenants          each tenant's spec as registered (file or runtime) and as
                     changed since, its generation, failed state and reason, origin;
                     parked or not, and a parked tenant's quota counters (its marks,
                     refusals and GPU time come back exactly after a restart)
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
(``wal_checkpoint(TRUNCATE)``) after the first start's key creation and once
admin writes pause (the supervisor's ``CHECKPOINT_DELAY_S``), so ``state.db``
alone then holds all acknowledged state. Until then (or while a reader's
snapshot keeps the checkpoint from finishing) the last commits are in the WAL
only: losing it loses them, which the commit counter below detects.

The marker: once the registry key is stored, ``state.initialized`` is written
beside the database. A start that then finds the database missing, empty or
without its registry key refuses with one :class:`StateError` line instead
of silently starting afresh with a new key and no tenants (restore a backup,
or remove the marker to start afresh on purpose).

Lost commits: every write transaction also bumps the ``commits`` counter, and
once it is committed the new count is written to ``state.commits`` beside the
database before the change is answered (and fdatasynced right after, on a
thread of its own). A start whose database holds fewer commits than that
file names lost acknowledged transactions - a truncated or deleted
``state.db-wal``, or a ``state.db`` replaced by an older copy - and refuses
with one :class:`StateError` naming the recovery (``twt state restore
BACKUP``), on a read-only connection, instead of serving without them.
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

A backup of a running supervisor, a restore, a check without writing:
:mod:`supervisor.store.backup` (``twt state backup|restore|check``).
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, TypeVar

from shared.errors import StateError, UnknownTenant
from shared.log import get_logger, log_event
from shared.quota import QuotaCounters, QuotaSnapshot
from shared.spec import TenantSpec
from supervisor.store._schema import (
    _KEY_REGISTRY_ID,
    _KEY_REGISTRY_SECRET,
    SCHEMA_VERSION,
    _check_before_writing,
    _connect,
    _fsync_dir,
    _migrate,
    _open_commits,
    _read_commits,
    _seq_of,
    _write_commits,
)
from supervisor.store.tenant_quota import kept_counters, kept_counters_json

__all__ = [
    "COMMITS_FILE",
    "MARKER_FILE",
    "SCHEMA_VERSION",
    "STATE_FILE",
    "Origin",
    "RegistryKey",
    "StateStore",
    "StoredTenant",
]

T = TypeVar("T")
_log = get_logger("supervisor")

STATE_FILE = "state.db"
LOCK_FILE = "state.lock"
#: written beside the database once it holds a registry key (see the module docstring)
MARKER_FILE = "state.initialized"
#: the commit counter acknowledged so far, outside the database (see "Lost commits")
COMMITS_FILE = "state.commits"
Origin = Literal["file", "runtime"]
_ORIGINS = ("file", "runtime")


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
    #: it was parked when last written: restored without starting a worker
    parked: bool = False
    #: a parked tenant's quota counters as it parked (its spec's limits, nothing held: see
    #: supervisor.store.tenant_quota.kept_counters); None for an active tenant, or one parked by
    #: a version that did not keep them
    quota: QuotaCounters | None = None

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
        # state.commits is synced by a thread of its own, off the answer's path (see _count_commit)
        self._sync_cond = threading.Condition()
        self._sync_wanted = False
        self._sync_stop = False
        self._syncer: threading.Thread | None = None

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
        self._stop_syncer()
        try:
            self._conn.close()
        finally:
            if self._commits_fd is not None:
                self._sync_commits()
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
        """``state.commits`` := ``seq`` before the change is answered, synced to the disk right
        after (by the syncer thread, off the answer's path: an fdatasync here cost a registration
        ~0.5 ms more). The write alone already survives the process (SIGKILL, OOM, abort); the
        sync makes it survive the machine within milliseconds - until then a power loss can only
        leave the file *behind* the database, the safe side. A failure leaves it behind too, so
        the committed change is not reported as failed; it is logged."""
        fd = self._commits_fd
        if fd is None:
            return
        try:
            _write_commits(fd, self._commits_path, seq, sync=False)
        except StateError as exc:
            log_event(_log, logging.WARNING, "state.commits_not_counted", error=str(exc), seq=seq)
            return
        with self._sync_cond:
            self._sync_wanted = True
            if self._syncer is None:
                self._syncer = threading.Thread(target=self._run_syncer, name="twt-state-sync", daemon=True)
                self._syncer.start()
            self._sync_cond.notify()

    def _run_syncer(self) -> None:
        """Sync ``state.commits`` whenever a commit was counted (several commits, one sync)."""
        while True:
            with self._sync_cond:
                self._sync_cond.wait_for(lambda: self._sync_wanted or self._sync_stop)
                if not self._sync_wanted:
                    return
                self._sync_wanted = False
            self._sync_commits()

    def _sync_commits(self) -> None:
        fd = self._commits_fd
        if fd is None:
            return
        try:
            os.fdatasync(fd)
        except OSError as exc:
            log_event(_log, logging.WARNING, "state.commits_not_synced", error=exc.strerror or str(exc))

    def _stop_syncer(self) -> None:
        with self._sync_cond:
            self._sync_stop = True
            self._sync_cond.notify()
            syncer, self._syncer = self._syncer, None
        if syncer is not None:
            syncer.join()

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
                "updated_at, parked, parked_quota FROM tenants ORDER BY tenant_id"
            ).fetchall()
        ignored: dict[str, list[str]] = {}
        for tid, spec, registered, origin, gen, failed, reg_at, upd_at, parked, parked_quota in rows:
            try:
                now_spec, unknown = _split_spec(spec)
                # most tenants run the spec they registered with: one parse (a restore reads 10,000)
                registered_spec, unknown_registered = (now_spec, unknown) if registered == spec else \
                    _split_spec(registered)
                keys = tuple(sorted({*unknown, *unknown_registered}))
                quota = None
                if parked and parked_quota is not None:
                    quota = kept_counters(str(parked_quota), generation=int(gen),
                                          memory_quota_bytes=now_spec.memory_quota_bytes,
                                          gpu_memory_bytes_cap=now_spec.gpu_memory_bytes_cap,
                                          cuda_mem_pool_quota_bytes=now_spec.recorded_cuda_mem_pool_quota)
                record = StoredTenant(
                    spec=now_spec,
                    registered_spec=registered_spec,
                    origin=origin,
                    generation=int(gen),
                    failed_reason=failed,
                    registered_at=float(reg_at),
                    updated_at=float(upd_at),
                    unknown_keys=keys,
                    parked=bool(parked),
                    quota=quota,
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

    def tenant_generations(self) -> dict[str, int]:
        """The generation of each stored tenant (one query, no spec parsed: cheap at 10,000)."""
        with self._use:
            rows = self._conn.execute("SELECT tenant_id, generation FROM tenants").fetchall()
        return {str(t): int(g) for t, g in rows}

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

    def set_parked(self, tenant_id: str, parked: bool, quota: QuotaSnapshot | None = None) -> None:
        """The tenant was parked, or activated (a tenant evicted meanwhile: nothing to do).

        ``quota``: a parked tenant's counters, kept in the same transaction as the flag so a
        restart finds both or neither (:func:`~supervisor.store.tenant_quota.kept_counters_json`);
        an activation clears them (its live counters are in its segment again)."""
        kept = kept_counters_json(quota) if parked and quota is not None else None
        with self._tx() as c:
            c.execute("UPDATE tenants SET parked = ?, parked_quota = ? WHERE tenant_id = ?",
                      (int(parked), kept, tenant_id))

    def set_parked_many(self, tenant_ids: Sequence[str], parked: bool) -> None:
        """:meth:`set_parked` for many tenants in one transaction (one fsync): what a supervisor that
        parked them all would have stored (``twt bench density`` prepares its parked tenants so)."""
        with self._tx() as c:
            c.executemany("UPDATE tenants SET parked = ?, parked_quota = NULL WHERE tenant_id = ?",
                          [(int(parked), t) for t in tenant_ids])

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


