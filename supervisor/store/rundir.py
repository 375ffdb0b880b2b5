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
from collections.abc import Mapping

from shared.capability import capability_from_bytes, capability_to_text
from shared.errors import RunDirLocked  # raised here; defined with the rest of the error tree
from shared.quota import segment_namespace
from shared.rundir import (  # the client's side of the run dir, re-exported for the server's code
    ADMIN_CAP_FILE,
    ADMIN_DIR,
    LOCK_FILE,
    READY_FILE,
    SOCKETS,
    read_admin_capability,
    read_ready,
    temp_parent,
    verify_admin_dir,
    verify_run_dir,
)

__all__ = ["LOCK_FILE", "RunDir", "RunDirLocked", "read_admin_capability", "read_ready", "temp_parent", "verify_admin_dir",
           "verify_run_dir"]


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
        """After binding: every socket 0600, except the clients' (``frontend.ipc``, ``small.ipc``)
        for the client group (0660)."""
        for name in names:
            path = self.file(f"{name}.ipc")
            if name in ("frontend", "small") and self._gid is not None:
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
