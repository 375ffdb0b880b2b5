"""The run directory as a client reads it: where things are, and whom to trust.

    <run dir>/            0700 (0710 with a client_group)
        frontend.ipc      clients (ROUTER): requests with frames of any size (bulk bodies)
        small.ipc         clients (ROUTER): requests whose frames are all small (docs/PROTOCOL.md)
        events.ipc        lifecycle events (PUB)
        admin/admin.cap   0600 in a 0700 directory: the admin capability for the CLI
        supervisor.json   written last by the supervisor: pid, version, endpoints - "ready"

The supervisor makes and owns the directory (:mod:`supervisor.store.rundir`); a client -
``SupervisorClient``, ``launch()``, any program on the host - only reads it, and trusts it only
when it, its sockets and its files belong to the expected user (the supervisor's: by default
their own) and nobody else can write to them (:func:`verify_run_dir`): a directory pre-created by
another user (``/tmp/twt-<uid>`` when ``XDG_RUNTIME_DIR`` is unset) would otherwise receive
capabilities and modules and could answer with forged results (docs/SECURITY.md).
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from typing import Any

from shared.capability import capability_bytes_from_text
from shared.errors import UntrustedRunDir

__all__ = [
    "ADMIN_CAP_FILE",
    "ADMIN_DIR",
    "LOCK_FILE",
    "READY_FILE",
    "MAX_TEMP_PARENT",
    "SOCKETS",
    "read_admin_capability",
    "read_ready",
    "temp_parent",
    "verify_admin_dir",
    "verify_run_dir",
]

SOCKETS = ("frontend", "small", "backend", "control", "events")
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
    for name in ("frontend", "small", "events"):
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
