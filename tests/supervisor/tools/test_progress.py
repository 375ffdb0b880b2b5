"""Live progress of long commands: on a terminal only (tested with a pty), never with --json or when piped."""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from supervisor.tools.progress import LiveLine, progress_stream
from tests.helpers import zygote

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parents[3]


def _in_pty(*args: str, timeout_s: float = 120.0) -> tuple[int, str]:
    """Run ``twt ARGS`` with stdout and stderr on a pseudo-terminal; its exit status and everything it wrote."""
    master, slave = pty.openpty()
    # forked from the suite's zygote where it can be (a terminal is a descriptor it passes on), with
    # the checkout on PYTHONPATH as tests.helpers.cli.twt() sets it, so that `twt chaos`'s own
    # supervisor is a fork too (tests/helpers/zygote.py)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = zygote.popen([sys.executable, "-m", "supervisor", *args], cwd=ROOT, stdout=slave, stderr=slave,
                        stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        code = proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(master)
    return code, b"".join(chunks).decode(errors="replace")


def test_progress_stream_only_for_a_terminal() -> None:
    master, slave = pty.openpty()
    try:
        with open(slave, "w", closefd=False) as tty:
            err = io.StringIO()
            assert progress_stream(False, stdout=tty, stderr=err) is err
            assert progress_stream(True, stdout=tty, stderr=err) is None  # --json: silent
        read_fd, write_fd = os.pipe()
        with open(write_fd, "w") as piped:
            assert progress_stream(False, stdout=piped, stderr=io.StringIO()) is None  # piped: silent
        os.close(read_fd)
        assert progress_stream(False, stdout=io.StringIO()) is None
    finally:
        os.close(master)
        os.close(slave)
    out = io.StringIO()
    line = LiveLine(out)
    line.update("a 1")
    line.update("a 2")
    line.done()
    line.done()  # idempotent
    assert out.getvalue() == "\ra 1\x1b[K\ra 2\x1b[K\n"
    quiet = LiveLine(None)
    quiet.update("x")
    quiet.done("y")


def test_chaos_reports_its_fault_phase_once_a_second_on_a_terminal() -> None:
    # two tenants (one faulty, one healthy), one client each, are all the progress line needs: the chaos campaign's own
    # checks are tests/reliability/test_chaos.py's. The line is written in the fault phase (1.5 s: two
    # ticks); the baseline before it is only the campaign's reference latency, so half a second of it
    code, text = _in_pty("chaos", "--duration", "2", "--baseline", "0.5", "--seed", "2", "--rate", "2",
                         "--tenants", "2", "--clients", "2")
    # the verdict depends on the machine's load (a latency check); the progress line does not
    assert code in (0, 4), text[-2000:]
    ticks = re.findall(r"\rchaos: faults (\d+)/(\d+) delivered, (\d+) requests, (\d+) errors, \d+ s left\x1b\[K", text)
    assert ticks, text[-2000:]
    requests = [int(t[2]) for t in ticks]
    assert requests == sorted(requests) and requests[-1] > 0  # counts so far, growing
    assert all(int(t[0]) <= int(t[1]) for t in ticks)
    assert "all invariants hold" in text or "FAIL" in text


def test_bench_names_each_benchmark_on_a_terminal_only() -> None:
    fast = ("--repeat", "1", "--duration", "0.05", "--rounds", "1")
    code, text = _in_pty("bench", "quota", *fast)
    assert code in (0, 4), text[-2000:]
    assert "bench: quota (1/1) running ..." in text
    assert re.search(r"bench: quota \(1/1\) (done|exit 4) in \d+\.\d s", text), text[-2000:]
    piped = zygote.run([sys.executable, "-m", "supervisor", "bench", "quota", *fast], cwd=str(ROOT), timeout=120)
    assert piped.returncode in (0, 4) and "bench: quota" not in piped.stdout + piped.stderr
