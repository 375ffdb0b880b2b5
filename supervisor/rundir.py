"""The run directory: ipc sockets, the admin capability, the lock, the ready file.

    <run dir>/            0700, created if missing
        supervisor.lock   flock()ed by the running supervisor: a second one refuses to start
        frontend.ipc      clients (ROUTER)
        backend.ipc       workers' data sockets (ROUTER)
        control.ipc       workers' control sockets (ROUTER)
        events.ipc        lifecycle events (PUB)
        admin.cap         0600, the admin capability for the CLI
        supervisor.json   written last: pid, version, endpoints - "ready"

The lock is an ``flock`` on an open file, so it disappears with the process
(even SIGKILL): a restarted supervisor on the same run dir starts at once,
removing the dead one's stale sockets and files.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from typing import Any

from shared.capability import capability_bytes_from_text, capability_from_bytes, capability_to_text
from shared.errors import RunDirLocked  # raised here; defined with the rest of the error tree

__all__ = ["RunDir", "RunDirLocked", "read_admin_capability", "read_ready"]

SOCKETS = ("frontend", "backend", "control", "events")
READY_FILE = "supervisor.json"
ADMIN_CAP_FILE = "admin.cap"
LOCK_FILE = "supervisor.lock"


class RunDir:
    """Owns a run directory for the lifetime of one supervisor."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self._lock_fd: int | None = None

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def endpoint(self, name: str) -> str:
        return "ipc://" + self.file(f"{name}.ipc")

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
        os.chmod(self.path, 0o700)
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

    def write_ready(self, info: dict[str, Any]) -> None:
        tmp = self.file(READY_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(info, f)
        os.chmod(tmp, 0o600)
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


def read_ready(run_dir: str) -> dict[str, Any] | None:
    """The ready record of a supervisor on ``run_dir``, or None (PermissionError when not ours)."""
    if os.path.isdir(run_dir) and not os.access(run_dir, os.R_OK | os.X_OK):
        raise PermissionError(f"run dir {run_dir} is not accessible to this user (it is 0700 and belongs to its supervisor)")
    try:
        with open(os.path.join(run_dir, READY_FILE), encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def read_admin_capability(run_dir: str) -> bytes:
    """The admin capability bytes from ``<run_dir>/admin.cap`` (hex text or legacy raw bytes).

    Refuses a file readable by group or others.
    """
    path = os.path.join(run_dir, ADMIN_CAP_FILE)
    st = os.stat(path)
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PermissionError(f"{path} is readable by others (mode {oct(st.st_mode & 0o777)}); refusing to use it")
    with open(path, "rb") as f:
        return capability_bytes_from_text(f.read())
