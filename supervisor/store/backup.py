"""Offline work on a state directory: a consistent backup, a restore, a check that writes nothing.

What ``twt state backup|restore|check`` runs (:mod:`supervisor.cli.state`), beside a
running supervisor (backup, check) or instead of one (restore). The layout, the
commit counter and the refusals they follow are :mod:`supervisor.store.state`'s.

    backup   SQLite's online backup API from a read-only connection: one snapshot, WAL
             included; the copy is one self-contained file (no -wal), 0600, checked, fsynced
    restore  under state.lock (never beside a supervisor): the backup checked first, the
             state it replaces kept beside it, state.commits set to the backup's count
    check    every refusal of a start, listed at once, on a read-only connection

Owns: nothing of its own; the state directory's files while it holds ``state.lock``
(restore only). Threads: any, one call at a time.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import time
from dataclasses import dataclass

from shared.errors import StateError
from supervisor.store._schema import (
    _LOST,
    _LOST_COMMITS,
    SCHEMA_VERSION,
    _fsync_dir,
    _open_commits,
    _read_commits,
    _registry_key_of,
    _seq_of,
    _validate,
    _write_commits,
)
from supervisor.store.state import (
    _ORIGINS,
    COMMITS_FILE,
    LOCK_FILE,
    MARKER_FILE,
    STATE_FILE,
    _lock,
    _split_spec,
)

__all__ = ["CheckReport", "backup", "check", "restore"]


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
