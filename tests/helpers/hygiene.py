"""Process and shared-memory hygiene checks used after every test.

A leak is a ``twt-*`` segment in /dev/shm, or a tensor-wasm-tenant process
(worker processes name themselves ``twt-worker``, supervisors
``twt-supervisor``; see ``shared.proctitle``) that appeared during the test
and is still there after a grace period.

Several test runs may share one machine (and /dev/shm). Only what belongs to
*this* run counts, so one run never reports, kills or unlinks another run's
live workers and segments: a process is ours when it is a descendant of this
one or carries this run's :data:`SESSION_ENV` marker in its environment
(inherited by spawned children); a segment is ours unless its recorded owner
is a live process that is not ours. Segments of dead owners and segments not
of our layout count as ours.
"""

from __future__ import annotations

import os
import secrets
import struct
import time
from dataclasses import dataclass

import psutil

from shared.errors import SegmentError
from shared.quota import MAGIC, _owner_alive, read_header

PROCESS_NAMES = ("twt-worker", "twt-supervisor")
SHM_DIR = "/dev/shm"
#: Not TWT_-prefixed: that prefix belongs to the product's configuration.
SESSION_ENV = "PYTEST_TWT_SESSION"


def mark_session() -> str:
    """Tag this test run (inherited by every child process); idempotent."""
    return os.environ.setdefault(SESSION_ENV, secrets.token_hex(8))


def _process_is_ours(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        if any(c.pid == pid for c in psutil.Process().children(recursive=True)):
            return True
        env = psutil.Process(pid).environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    marker = os.environ.get(SESSION_ENV)
    return marker is not None and env.get(SESSION_ENV) == marker


def _raw_owner(name: str) -> tuple[int, int] | None:
    """(owner pid, owner start) from any layout version's header (the first line is the
    same in all), or None when the file is not a tensor-wasm-tenant segment."""
    try:
        with open(os.path.join(SHM_DIR, name), "rb") as f:
            head = f.read(40)
    except OSError:
        return None
    if len(head) < 40:
        return None
    magic, _version, _kind, pid, start = struct.unpack("<5Q", head)
    return (pid, start) if magic == MAGIC else None


def _segment_is_ours(name: str) -> bool:
    try:
        header = read_header(name)
    except SegmentError:
        # Another layout version (a run of another build on this machine) or not
        # ours at all: judge by the recorded owner when there is one.
        owner = _raw_owner(name)
        if owner is None or not _owner_alive(*owner):
            return True
        return _process_is_ours(owner[0])
    if not header.owner_alive():
        return True
    return _process_is_ours(header.owner_pid)


def twt_segments() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith("twt-")}
    except FileNotFoundError:
        return set()


def twt_processes() -> set[tuple[int, float]]:
    found = set()
    for proc in psutil.process_iter(["name", "create_time", "status"]):
        info = proc.info
        if info["name"] in PROCESS_NAMES and info["status"] != psutil.STATUS_ZOMBIE:
            found.add((proc.pid, info["create_time"]))
    return found


@dataclass
class Baseline:
    segments: set[str]
    processes: set[tuple[int, float]]


def baseline() -> Baseline:
    return Baseline(twt_segments(), twt_processes())


def leaks(before: Baseline, grace_s: float = 5.0) -> tuple[set[str], set[tuple[int, float]]]:
    """Segments and processes new since ``before`` that outlive ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while True:
        segs = {n for n in twt_segments() - before.segments if _segment_is_ours(n)}
        procs = {p for p in twt_processes() - before.processes if _process_is_ours(p[0])}
        if (not segs and not procs) or time.monotonic() >= deadline:
            return segs, procs
        time.sleep(0.05)


def kill_processes(procs: set[tuple[int, float]]) -> None:
    for pid, _ in procs:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


def unlink_segments(names: set[str]) -> None:
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass
