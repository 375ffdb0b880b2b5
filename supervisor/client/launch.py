"""``launch()``: start ``twt supervise`` as a child process and hand back a connected client.

    with supervisor.launch({"tenant": [{"name": "acme"}]}, backend="stub") as sup:
        cap = sup.client.register(sup.admin_capability, TenantSpec("beta"))
        ...

What embedders, ``twt demo``, ``twt chaos`` and the tests use. The supervisor
runs as ``python -m supervisor supervise`` in its own process, so the caller
is never forked or spawned from, and a crash on either side stays there.
On exit the supervisor gets SIGTERM (graceful: workers stopped, segments
unlinked, sockets removed) and SIGKILL if it has not finished in time.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from shared.capability import RegistryAdminCapability
from shared.config import SupervisorConfig, read_config_file
from shared.errors import SupervisorUnavailable
from supervisor.client.api import SupervisorClient
from shared.rundir import read_admin_capability, read_ready, temp_parent

__all__ = ["QUIET_LOG_LEVEL", "SupervisorHandle", "launch"]

#: the directory that holds the ``supervisor`` package (supervisor/client/launch.py is two below it):
#: a launched supervisor imports this checkout, whatever the caller's working directory
CHECKOUT = Path(__file__).resolve().parents[2]


@dataclass
class SupervisorHandle:
    """A running supervisor started by :func:`launch`."""

    process: subprocess.Popen[bytes]
    run_dir: str
    client: SupervisorClient
    admin_capability: RegistryAdminCapability
    info: dict[str, Any]  # supervisor.json as read (JSON: endpoints, keys, pids, urls)

    @property
    def pid(self) -> int:
        return self.process.pid

    def connect(self, timeout_s: float = 30.0) -> SupervisorClient:
        """Another client (one per thread)."""
        return SupervisorClient(self.run_dir, timeout_s=timeout_s)


def _config_arg(config_or_path: str | os.PathLike[str] | Mapping[str, object] | SupervisorConfig | None,
                run_dir: str) -> list[str]:
    if config_or_path is None:
        return []
    if isinstance(config_or_path, (str, os.PathLike)):
        return ["--config", os.fspath(config_or_path)]
    if isinstance(config_or_path, SupervisorConfig):
        doc: dict[str, object] = {"supervisor": {k: v for k, v in config_or_path.to_dict().items()
                                               if k not in ("tenants", "run_dir")},
                               "tenant": config_or_path.to_dict()["tenants"]}
    else:
        doc = dict(config_or_path)
    path = os.path.join(run_dir, "launch-config.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    return ["--config", path]


#: what an embedded supervisor logs unless asked for more
QUIET_LOG_LEVEL = "warning"


def _config_sets_log_level(config_or_path: str | os.PathLike[str] | Mapping[str, object] | SupervisorConfig | None) -> bool:
    if config_or_path is None:
        return False
    if isinstance(config_or_path, SupervisorConfig):
        return True  # a whole config object: its log_level is what the caller built
    if isinstance(config_or_path, (str, os.PathLike)):
        return "log_level" in read_config_file(config_or_path)
    section = config_or_path.get("supervisor")
    return isinstance(section, Mapping) and "log_level" in section


@contextmanager
def launch(
    config_or_path: str | os.PathLike[str] | Mapping[str, object] | SupervisorConfig | None = None,
    *,
    run_dir: str | None = None,
    backend: str | None = None,
    start_method: str | None = None,
    log_format: str | None = None,
    log_level: str | None = None,
    pool_size: int | None = None,
    metrics_addr: str | None = None,
    ready_timeout_s: float = 60.0,
    stop_timeout_s: float = 20.0,
    stderr: IO[bytes] | int | None = None,
    env: Mapping[str, str] | None = None,
    extra_args: list[str] | None = None,
) -> Iterator[SupervisorHandle]:
    """Start a supervisor, wait until it is ready, yield a handle, stop it on exit.

    ``config_or_path`` is a TOML/JSON path, a dict shaped like the TOML file
    (``{"supervisor": {...}, "tenant": [...]}``) or a :class:`SupervisorConfig`.
    Without ``run_dir`` a fresh temporary one is used and removed afterwards.

    An embedded supervisor is quiet: it logs at ``warning`` unless asked
    otherwise, by ``log_level``, ``$TWT_LOG_LEVEL`` or ``log_level`` in the config.
    """
    own_dir = run_dir is None
    rd = run_dir or tempfile.mkdtemp(prefix="twt-", dir=temp_parent())
    os.makedirs(rd, mode=0o700, exist_ok=True)
    cmd = [sys.executable, "-m", "supervisor", "supervise", "--run-dir", rd, *_config_arg(config_or_path, rd)]
    child_env = dict(os.environ if env is None else env)
    if log_level is None and not child_env.get("TWT_LOG_LEVEL") and not _config_sets_log_level(config_or_path):
        log_level = QUIET_LOG_LEVEL
    for flag, value in (("--backend", backend), ("--start-method", start_method), ("--log-format", log_format),
                        ("--log-level", log_level), ("--pool-size", pool_size), ("--metrics-addr", metrics_addr)):
        if value is not None:
            cmd += [flag, str(value)]
    cmd += extra_args or []
    # the child imports this very checkout, wherever the caller runs from
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CHECKOUT), child_env.get("PYTHONPATH", "")) if p)
    # told when it is ready, unless the caller gave the child a notification socket of its own
    listener = None if child_env.get("NOTIFY_SOCKET") else _ReadyListener.open(rd)
    if listener is not None:
        child_env["NOTIFY_SOCKET"] = listener.path
    client: SupervisorClient | None = None
    try:
        proc = subprocess.Popen(cmd, env=child_env, stderr=stderr, stdin=subprocess.DEVNULL)
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    try:
        deadline = time.monotonic() + ready_timeout_s
        info = None
        while True:
            info = read_ready(rd)
            if info is not None and info.get("pid") == proc.pid:
                break
            if proc.poll() is not None:
                raise SupervisorUnavailable(rd, f"supervisor exited with code {proc.returncode} before it was ready")
            left = deadline - time.monotonic()
            if left < 0:
                raise SupervisorUnavailable(rd, f"not ready within {ready_timeout_s:g} s")
            if listener is not None:
                listener.wait(min(left, _EXIT_CHECK_S))
            else:
                time.sleep(0.02)
        if listener is not None:
            listener.close()
            listener = None
        client = SupervisorClient(rd)
        admin = RegistryAdminCapability.from_bytes(read_admin_capability(rd))
        yield SupervisorHandle(proc, rd, client, admin, info)
    finally:
        if listener is not None:
            listener.close()
        if client is not None:
            client.close()
        _stop(proc, stop_timeout_s)
        if own_dir:
            shutil.rmtree(rd, ignore_errors=True)


#: while it waits for the ready notification, how often :func:`launch` looks whether the child exited
_EXIT_CHECK_S = 0.1
#: the longest ``AF_UNIX`` path (``sun_path`` is 108 bytes with its terminating NUL)
_MAX_SOCKET_PATH = 107


class _ReadyListener:
    """The supervisor's readiness, told rather than polled for: a datagram socket in the run dir
    named by ``NOTIFY_SOCKET`` in the child's environment, where the supervisor sends systemd's
    ``READY=1`` once it has written ``supervisor.json`` (:mod:`supervisor.observe.sd_notify`).
    Any datagram only wakes the wait, which then reads the ready file as before: the file (with
    the child's pid) stays the one proof of readiness. Without it (a run dir whose path is too
    long for a socket, or a caller that passes its own ``NOTIFY_SOCKET``) :func:`launch` polls
    the file every 20 ms, which cost the suite's test processes ~13 reads of it a start."""

    def __init__(self, sock: socket.socket, path: str) -> None:
        self.sock = sock
        self.path = path

    @classmethod
    def open(cls, run_dir: str) -> _ReadyListener | None:
        path = os.path.join(os.path.abspath(run_dir), "launch-notify.sock")
        if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a launch before this one on the same run dir
            sock.bind(path)
        except OSError:
            sock.close()
            return None
        return cls(sock, path)

    def wait(self, timeout_s: float) -> None:
        """Until a datagram comes (read and dropped) or ``timeout_s`` passes."""
        if select.select([self.sock], [], [], timeout_s)[0]:
            with contextlib.suppress(OSError):
                self.sock.recv(4096)

    def close(self) -> None:
        """No more notifications (the supervisor's later ones find no socket, which it ignores)."""
        self.sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _stop(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM (the supervisor drains what is in flight), a second SIGTERM after half of
    ``timeout_s`` (the drain ends: the workers stop, the segments are unlinked), SIGKILL at its end."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s / 2)
            return
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s / 2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
