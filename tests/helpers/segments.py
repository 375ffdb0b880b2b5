"""Fabricated ``twt-*`` segments for tests of stale-segment cleanup: the header a real
segment has, naming an owner that is dead (or any owner), written straight into /dev/shm
without the resource tracker hearing of it (so only a cleanup removes it)."""

from __future__ import annotations

import os
import secrets
import struct
import subprocess
import sys

from shared import quota

SHM_DIR = "/dev/shm"


def dead_owner() -> tuple[int, int]:
    """(pid, start) of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        start = quota.process_start_ms(proc.pid)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)
    return proc.pid, start


def write_stale(name: str, owner: tuple[int, int], *, kind: int = quota.KIND_TENANT, label: bytes = b"ghost") -> str:
    """Create segment ``name`` with a valid header naming ``owner`` (pid, start); returns ``name``."""
    data = bytearray(quota.SEGMENT_BYTES)
    struct.pack_into("<8Q", data, 0, quota.MAGIC, quota.LAYOUT_VERSION, kind, owner[0], owner[1], 0,
                     quota.SEGMENT_BYTES, quota.MAX_INSTANCES)
    data[64 : 64 + len(label)] = label
    fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return name


def namespaced_name(namespace: str, slot: str = "0") -> str:
    """A name as a supervisor on that namespace's run dir makes it (``twt-<ns>-<per start>-<slot>``)."""
    return f"{quota.SEGMENT_PREFIX}{namespace}-{secrets.token_hex(4)}-{slot}"


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def remove(*names: str) -> None:
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass
