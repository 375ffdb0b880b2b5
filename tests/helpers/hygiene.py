"""Process and shared-memory hygiene checks used after every test.

A leak is a ``twt-*`` segment in /dev/shm, or a tensor-wasm-tenant process
(worker processes name themselves ``twt-worker``, supervisors
``twt-supervisor``; see ``shared.proctitle``) that appeared during the test
and is still there after a grace period.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil

PROCESS_NAMES = ("twt-worker", "twt-supervisor")
SHM_DIR = "/dev/shm"


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
        segs = twt_segments() - before.segments
        procs = twt_processes() - before.processes
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
