"""Run a client as a real second user (created for the test, removed after), where the host allows.

The sandbox runs as root, and this interpreter lives under a 0700 home
(pyenv in ``/root``) that another user cannot reach. So the client runs in a
private mount namespace (``unshare --mount``) where the interpreter's prefix and the
checkout are bind-mounted at world-readable paths, then drops to the user with
``setpriv`` - nothing outside that one process sees the mount. Needs root,
``useradd``/``groupadd``, ``unshare`` and ``setpriv``; :func:`available`
says why not where they are missing (the only reason to skip).
"""

from __future__ import annotations

import contextlib
import functools
import grp
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from tests.helpers.tmp import short_temp_dir

REPO = Path(__file__).resolve().parents[2]

__all__ = ["OtherUser", "available", "other_user"]

_TOOLS = ("useradd", "userdel", "groupadd", "groupdel", "unshare", "setpriv")


@functools.cache
def available() -> str | None:
    """None when a second user can be made and run here, else why not."""
    if os.getuid() != 0:
        return "creating a second user needs root"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing tools: {', '.join(missing)}"
    from tests.helpers import private_mount

    return private_mount.available()


@dataclass(frozen=True)
class OtherUser:
    """A user made for one test, with a group of its own (to be named as a ``client_group``)."""

    name: str
    uid: int
    group: str
    gid: int
    mount_point: str  # where the interpreter's prefix is bind-mounted for it
    repo_mount: str  # where the checkout is bind-mounted for it

    def run_python(self, code: str, *args: str, groups: tuple[int, ...] | None = None,
                   timeout_s: float = 90.0) -> subprocess.CompletedProcess[str]:
        """Run ``code`` as this user (its own group, or ``groups``; the first is the primary).

        The checkout is bind-mounted too (at :attr:`repo_mount`), in the same private namespace:
        a clone under a 0700 directory (``mktemp -d``, a home directory) cannot be traversed by
        another user, so ``import shared`` would fail through its own path. The venv's
        site-packages below the checkout are named through that mount as well.
        """
        groups = (self.gid,) if groups is None else groups
        prefix = sys.base_prefix
        rel = os.path.relpath(os.path.realpath(_base_executable()), prefix)
        repo = str(REPO)
        site = [_through(p, repo, self.repo_mount) for p in sys.path if p.endswith("site-packages")]
        env = {"PATH": "/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8",
               "PYTHONPATH": os.pathsep.join([self.repo_mount, *site]), "PYTHONDONTWRITEBYTECODE": "1"}
        script = textwrap.dedent(code)
        cmd = [
            "unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount --bind "$1" "$2" && mount --bind "$3" "$4" && shift 4 && exec "$@"', "sh",
            prefix, self.mount_point, repo, self.repo_mount,
            "setpriv", f"--reuid={self.uid}", f"--regid={groups[0]}",
            f"--groups={','.join(str(g) for g in groups)}", "--",
            os.path.join(self.mount_point, rel), "-c", script, *args,
        ]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd="/", env=env)


def _through(path: str, repo: str, repo_mount: str) -> str:
    """``path`` as the second user reaches it: below the checkout, through its mount."""
    real = os.path.realpath(path)
    if real == repo or real.startswith(repo + os.sep):
        return os.path.join(repo_mount, os.path.relpath(real, repo))
    return path


def _base_executable() -> str:
    base = getattr(sys, "_base_executable", None) or sys.executable
    return str(base)


@contextlib.contextmanager
def other_user() -> Iterator[OtherUser]:
    """Create a user and its group (``twt<hex>``), yield it, remove both (and the mount point)."""
    name = "twt" + secrets.token_hex(4)
    subprocess.run(["groupadd", "--system", name], check=True, capture_output=True)
    try:
        subprocess.run(["useradd", "--system", "--no-create-home", "--gid", name, "--shell", "/usr/sbin/nologin",
                        name], check=True, capture_output=True)
        try:
            mount_point = tempfile.mkdtemp(prefix="twt-py-", dir=short_temp_dir())
            repo_mount = tempfile.mkdtemp(prefix="twt-repo-", dir=short_temp_dir())
            for point in (mount_point, repo_mount):
                os.chmod(point, 0o755)
            try:
                yield OtherUser(name, pwd.getpwnam(name).pw_uid, name, grp.getgrnam(name).gr_gid, mount_point,
                                repo_mount)
            finally:
                os.rmdir(mount_point)
                os.rmdir(repo_mount)
        finally:
            subprocess.run(["userdel", name], check=False, capture_output=True)
    finally:
        subprocess.run(["groupdel", name], check=False, capture_output=True)
