"""Is NVIDIA MPS usable here? ``detect_mps()`` answers ``Mps(pipe_dir)`` or ``Fallback(reason)``.

MPS is used only when its control daemon is really alive: the pipe directory
(``$CUDA_MPS_PIPE_DIRECTORY``, else ``/tmp/nvidia-mps``) must hold a
``control`` unix socket, and either that socket accepts a connection (we
connect and close, sending nothing) or the pid in
``nvidia-cuda-mps-control.pid`` there is a live process. A socket file left
behind by a dead daemon is a ``Fallback``: a worker pointed at it would hang
or fail in ``cuInit``.

MPS gives each client its own address space and memory limit, but a fatal
GPU fault in one client reaches every client on that GPU; process isolation
(``isolation = "process"``) stays available for tenants that need it.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable, Mapping

from shared.log import get_logger, log_event

__all__ = ["DEFAULT_PIPE_DIR", "MPS_PROBE_MAX_AGE_S", "Fallback", "Mps", "MpsDecision", "detect_mps",
           "mps_or_fallback"]

DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
PID_FILE = "nvidia-cuda-mps-control.pid"
_log = get_logger("mps")


@dataclass(frozen=True)
class Mps:
    """A live MPS control daemon listens in ``pipe_dir``."""

    pipe_dir: str
    reason: str

    @property
    def active(self) -> bool:
        return True


@dataclass(frozen=True)
class Fallback:
    """MPS is not usable; tenants run with process isolation. ``reason`` says why."""

    reason: str

    @property
    def active(self) -> bool:
        return False


MpsDecision = Mps | Fallback


def _socket_accepts(path: str, timeout_s: float) -> bool:
    for kind in (socket.SOCK_STREAM, socket.SOCK_SEQPACKET):
        sock = socket.socket(socket.AF_UNIX, kind)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
            return True
        except OSError:
            continue
        finally:
            sock.close()
    return False


def _pid_alive(pid_file: str) -> int | None:
    try:
        with open(pid_file, encoding="ascii") as f:
            pid = int(f.read().strip() or "0")
    except (OSError, ValueError):
        return None
    if pid <= 0:
        return None
    import psutil

    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return None
    except psutil.NoSuchProcess:
        return None
    except psutil.AccessDenied:
        pass
    return pid


def detect_mps(environ: Mapping[str, str] | None = None, *, timeout_s: float = 0.2) -> MpsDecision:
    """Probe for a live MPS daemon (never raises; see the module docstring)."""
    env = os.environ if environ is None else environ
    configured = env.get("CUDA_MPS_PIPE_DIRECTORY")
    pipe_dir = configured or DEFAULT_PIPE_DIR
    if not os.path.isabs(pipe_dir):
        log_event(_log, logging.WARNING, "mps.relative_pipe_dir", value=pipe_dir)
        return Fallback(f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir!r} is relative; MPS needs an absolute path")
    source = "CUDA_MPS_PIPE_DIRECTORY" if configured else "default"
    if not os.path.isdir(pipe_dir):
        return Fallback(f"pipe directory {pipe_dir} ({source}) does not exist")
    control = os.path.join(pipe_dir, "control")
    try:
        mode = os.stat(control).st_mode
    except FileNotFoundError:
        return Fallback(f"no control socket in {pipe_dir}")
    except OSError as exc:
        return Fallback(f"cannot stat {control}: {exc.strerror}")
    if not stat.S_ISSOCK(mode):
        return Fallback(f"{control} is not a unix socket")
    if _socket_accepts(control, timeout_s):
        return Mps(pipe_dir, f"control socket {control} accepts connections")
    pid = _pid_alive(os.path.join(pipe_dir, PID_FILE))
    if pid is not None:
        return Mps(pipe_dir, f"MPS control daemon pid {pid} is alive")
    return Fallback(f"stale control socket {control}: no daemon accepts connections and no live pid")


#: how long one probe's answer is reused: a daemon started (or stopped) later is seen after this
MPS_PROBE_MAX_AGE_S = 1.0
_cache_lock = threading.Lock()
_cached: tuple[float, MpsDecision] | None = None


def mps_or_fallback(*, max_age_s: float = MPS_PROBE_MAX_AGE_S,
                    clock: Callable[[], float] = time.monotonic) -> MpsDecision:
    """:func:`detect_mps`, reusing an answer at most ``max_age_s`` old (0: always probe again).

    A probe costs a stat and a unix-socket connect with a short timeout; the
    short cache only spares callers that ask many times in a burst. It is
    never cached for the life of the process: an MPS daemon started after
    the supervisor is seen within ``max_age_s``.
    """
    global _cached
    now = clock()
    with _cache_lock:
        if _cached is not None and max_age_s > 0 and 0 <= now - _cached[0] < max_age_s:
            return _cached[1]
    decision = detect_mps()
    with _cache_lock:
        _cached = (now, decision)
    return decision
