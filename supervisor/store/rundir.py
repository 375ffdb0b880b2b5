"""The run directory: ipc sockets, the admin capability, the lock, the ready file.

    <run dir>/            0700, created if missing
        supervisor.lock   flock()ed by the running supervisor: a second one refuses to start
        frontend.ipc      clients (ROUTER)
        backend.ipc       workers' data sockets (ROUTER)
        control.ipc       workers' control sockets (ROUTER)
        events.ipc        lifecycle events (PUB)
        admin/            0700: what only the operator may reach
            admin.cap     0600, the admin capability for the CLI
        supervisor.json   written last: pid, version, endpoints - "ready"

Clients trust a run dir only when it, its sockets and its files belong to
the expected user (the supervisor's: by default their own) and nobody else
can write to them (:func:`verify_run_dir`): a directory pre-created by
another user (``/tmp/twt-<uid>`` when ``XDG_RUNTIME_DIR`` is unset) would
otherwise receive capabilities and modules and could answer with forged
results. The admin capability lives in its own 0700 directory, so the run dir
itself may be opened to a group of tenant-only clients without opening the
admin capability to them (docs/SECURITY.md).

The lock is an ``flock`` on an open file, so it disappears with the process
(even SIGKILL): a restarted supervisor on the same run dir starts at once,
removing the dead one's stale sockets and files.

The run dir also names its supervisors' shared-memory segments: their names
carry its *namespace* (a hash of its real path, :attr:`RunDir.segment_namespace`),
so a start removes the dead segments of its own run dir only, never those of
another supervisor on the host (docs/OPERATIONS.md "Shared-memory segments").
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import stat
import tempfile
from collections.abc import Mapping
from typing import Any

from shared.capability import capability_bytes_from_text, capability_from_bytes, capability_to_text
from shared.errors import RunDirLocked, UntrustedRunDir  # raised here; defined with the rest of the error tree
from shared.quota import segment_namespace

__all__ = ["RunDir", "RunDirLocked", "read_admin_capability", "read_ready", "verify_admin_dir", "verify_run_dir"]

SOCKETS = ("frontend", "backend", "control", "events")
READY_FILE = "supervisor.json"
ADMIN_DIR = "admin"
ADMIN_CAP_FILE = os.path.join(ADMIN_DIR, "admin.cap")
LOCK_FILE = "supervisor.lock"
#: the longest temp directory a temporary run dir may be made in: a fresh run dir's name (~12
#: chars) and its longest socket name stay well inside a unix socket path's 107 bytes
MAX_TEMP_PARENT = 40


def temp_parent() -> str:
    """Where temporary run dirs go: ``$TMPDIR`` (:func:`tempfile.gettempdir`) when it is short
    enough for the run dir's unix sockets, else ``/tmp``.

    Honouring ``$TMPDIR`` lets a test run (``make test``) keep everything it makes in its own
    fresh directory; the fallback keeps a long ``$TMPDIR`` (macOS-style) from breaking ipc paths.
    """
    parent = tempfile.gettempdir()
    return parent if len(parent) <= MAX_TEMP_PARENT else "/tmp"


def _group_id(group: str | int) -> int:
    import grp

    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise ValueError(f"client_group {group!r}: no such group") from None


class RunDir:
    """Owns a run directory for the lifetime of one supervisor.

    ``client_group``: the group of tenant-only clients running as other users.
    They may then traverse the run dir (0710), connect to ``frontend.ipc``
    (0660) and read ``supervisor.json`` (0640) - never enter ``admin/``.
    """

    def __init__(self, path: str, client_group: str | int | None = None) -> None:
        self.path = os.path.abspath(path)
        self._lock_fd: int | None = None
        self._gid = None if client_group is None else _group_id(client_group)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def endpoint(self, name: str) -> str:
        return "ipc://" + self.file(f"{name}.ipc")

    @property
    def segment_namespace(self) -> str:
        """The namespace of this run dir's ``twt-*`` segments (:func:`shared.quota.segment_namespace`):
        the same for every supervisor started on it, another for every other run dir."""
        return segment_namespace(self.path)

    def new_segment_prefix(self) -> str:
        """A segment prefix for one supervisor start: ``<namespace>-<8 random hex>``.

        Per start, because a killed predecessor's segments may still exist
        (names are created exclusively); under the namespace, because the
        start-up cleanup and ``twt cleanup`` find a run dir's segments by it.
        """
        return f"{self.segment_namespace}-{secrets.token_hex(4)}"

    @property
    def locked(self) -> bool:
        """True once :meth:`acquire` succeeded (until :meth:`release`)."""
        return self._lock_fd is not None

    def acquire(self) -> None:
        """Create (0700) and lock the directory; clean what a dead supervisor left.

        Idempotent: ``twt supervise`` locks the run dir before it binds any
        port and hands the locked one to the loop, whose own call is then a
        no-op. Each failure is one sentence naming the directory (an
        ``OSError`` without the ``[Errno N]`` noise, or :class:`RunDirLocked`).
        """
        if self._lock_fd is not None:
            return
        if os.path.lexists(self.path) and not os.path.isdir(self.path):
            raise NotADirectoryError(
                errno.ENOTDIR, f"run dir {self.path} exists and is not a directory; remove it or use another --run-dir"
            )
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            st = os.stat(self.path)
        except PermissionError:
            raise PermissionError(
                errno.EACCES, f"cannot create run dir {self.path}: permission denied; create it for this user "
                "or use another --run-dir"
            ) from None
        except NotADirectoryError:
            raise NotADirectoryError(
                errno.ENOTDIR, f"cannot create run dir {self.path}: a part of the path is a file, not a directory"
            ) from None
        if st.st_uid != os.getuid():
            raise PermissionError(
                errno.EACCES, f"run dir {self.path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}); "
                "run as its owner or use another --run-dir"
            )
        if self._gid is None:
            os.chmod(self.path, 0o700)
        else:
            os.chown(self.path, -1, self._gid)
            os.chmod(self.path, 0o710)
        admin_dir = self.file(ADMIN_DIR)
        os.makedirs(admin_dir, mode=0o700, exist_ok=True)
        ast = os.lstat(admin_dir)
        if not stat.S_ISDIR(ast.st_mode) or ast.st_uid != os.getuid():
            raise PermissionError(errno.EACCES, f"{admin_dir} is not a directory of this user; remove it")
        os.chmod(admin_dir, 0o700)
        fd = os.open(self.file(LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RunDirLocked(self.path, self._ready_pid()) from None
            raise
        self._lock_fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        for name in (READY_FILE, ADMIN_CAP_FILE, *(f"{s}.ipc" for s in SOCKETS)):
            try:
                os.unlink(self.file(name))
            except FileNotFoundError:
                pass

    def _ready_pid(self) -> int | None:
        try:
            with open(self.file(LOCK_FILE)) as f:
                return int(f.read().strip() or 0) or None
        except (OSError, ValueError):
            return None

    def write_admin_capability(self, raw: bytes) -> None:
        """Write the admin token in the one capability text form (hex and a newline), mode 0600."""
        path = self.file(ADMIN_CAP_FILE)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, (capability_to_text(capability_from_bytes(raw)) + "\n").encode("ascii"))
        finally:
            os.close(fd)

    def secure_sockets(self, names: tuple[str, ...] = SOCKETS) -> None:
        """After binding: every socket 0600, except ``frontend.ipc`` for the client group (0660)."""
        for name in names:
            path = self.file(f"{name}.ipc")
            if name == "frontend" and self._gid is not None:
                os.chown(path, -1, self._gid)
                os.chmod(path, 0o660)
            else:
                os.chmod(path, 0o600)

    def write_ready(self, info: Mapping[str, object]) -> None:
        tmp = self.file(READY_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(info, f)
        if self._gid is None:
            os.chmod(tmp, 0o600)
        else:
            os.chown(tmp, -1, self._gid)
            os.chmod(tmp, 0o640)
        os.replace(tmp, self.file(READY_FILE))

    def release(self) -> None:
        """Remove sockets and files, then drop the lock (the directory itself stays)."""
        if self._lock_fd is None:
            return  # never acquired: the files belong to someone else
        for name in (READY_FILE, ADMIN_CAP_FILE, *(f"{s}.ipc" for s in SOCKETS)):
            try:
                os.unlink(self.file(name))
            except FileNotFoundError:
                pass
        if self._lock_fd is not None:
            try:
                os.unlink(self.file(LOCK_FILE))
            except FileNotFoundError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = None


def _check_owned(path: str, kind: str, uid: int, *, private: bool = False) -> os.stat_result | None:
    """lstat ``path``: None when missing; raises UntrustedRunDir unless it is a ``kind``
    (never a symlink), owned by ``uid`` and not writable (``private``: not accessible) by others."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    want = {"dir": stat.S_ISDIR, "file": stat.S_ISREG, "socket": stat.S_ISSOCK}[kind]
    if not want(st.st_mode):
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a " + kind
        raise UntrustedRunDir(path, f"it is {what}")
    if st.st_uid != uid:
        raise UntrustedRunDir(path, f"it belongs to uid {st.st_uid}, not to the expected uid {uid} "
                                    "(another user may have created it to intercept your requests)")
    mode = stat.S_IMODE(st.st_mode)
    # A socket's write bit is the right to connect: a group of tenant-only clients
    # may have it (``client_group``); nobody else may.
    if mode & (0o077 if private else 0o002 if kind == "socket" else 0o022):
        raise UntrustedRunDir(path, f"its mode {oct(mode)} lets other users "
                                    f"{'read or change' if private else 'change'} it")
    return st


def verify_admin_dir(run_dir: str, expected_uid: int | None = None) -> None:
    """Refuse (``UntrustedRunDir``) an admin directory or capability that is not the
    expected user's alone."""
    uid = os.getuid() if expected_uid is None else expected_uid
    verify_run_dir(run_dir, uid)
    _check_owned(os.path.join(run_dir, ADMIN_DIR), "dir", uid, private=True)
    _check_owned(os.path.join(run_dir, ADMIN_CAP_FILE), "file", uid, private=True)


def verify_run_dir(run_dir: str, expected_uid: int | None = None) -> None:
    """Refuse (``UntrustedRunDir``) a run dir, socket or ready file not owned by
    ``expected_uid`` (default: ours) or writable by others. Missing parts pass:
    whoever looks for them reports that."""
    uid = os.getuid() if expected_uid is None else expected_uid
    if _check_owned(run_dir, "dir", uid) is None:
        return
    _check_owned(os.path.join(run_dir, READY_FILE), "file", uid)
    for name in ("frontend", "events"):
        _check_owned(os.path.join(run_dir, f"{name}.ipc"), "socket", uid)


def read_ready(run_dir: str, expected_uid: int | None = None) -> dict[str, Any] | None:  # JSON as written
    """The ready record of a supervisor on ``run_dir``, or None.

    PermissionError when the run dir is not accessible to us; UntrustedRunDir
    when it (or what is in it) is not the expected user's.

    Only the right to *traverse* the run dir is needed (names are known, never
    listed): a ``client_group`` member gets 0710 - traverse, no read - and must
    be able to use it.
    """
    if os.path.isdir(run_dir) and not os.access(run_dir, os.X_OK):
        raise PermissionError(f"run dir {run_dir} is not accessible to this user (it is 0700 and belongs to its "
                              "supervisor; a supervisor with client_group opens it to that group)")
    verify_run_dir(run_dir, expected_uid)
    try:
        fd = os.open(os.path.join(run_dir, READY_FILE), os.O_RDONLY | os.O_NOFOLLOW)
        with open(fd, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def read_admin_capability(run_dir: str, expected_uid: int | None = None) -> bytes:
    """The admin capability bytes from ``<run_dir>/admin/admin.cap`` (hex text or legacy raw bytes).

    Refused (UntrustedRunDir) unless the run dir, the admin directory and the
    file belong to ``expected_uid`` (default: ours) and only it can read them.
    """
    verify_admin_dir(run_dir, expected_uid)
    path = os.path.join(run_dir, ADMIN_CAP_FILE)
    if not os.path.lexists(path):
        raise FileNotFoundError(path)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with open(fd, "rb") as f:
        return capability_bytes_from_text(f.read(4096))
