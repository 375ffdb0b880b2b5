"""What a worker's threads were doing when it was killed for silence, read from procfs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from supervisor.runtime.stall import run_delay_ns, thread_report

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs procfs")]


def _entries(report: str) -> dict[int, list[str]]:
    return {int(part.split(":", 1)[0]): part.split(":") for part in report.split()}


def test_a_stopped_process_shows_every_thread_stopped() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        for _ in range(1000):  # the stop is delivered asynchronously: wait for the state it means
            report = thread_report(child.pid)
            if report and all(e[2] == "T" for e in _entries(report).values()):
                break
        entries = _entries(report)
        assert child.pid in entries
        assert all(e[2] == "T" for e in entries.values()), report
    finally:
        child.kill()
        child.wait()


def test_a_sleeping_thread_is_named_with_its_state_and_its_wait_since_a_baseline() -> None:
    release = threading.Event()
    started = threading.Event()
    tid: list[int] = []

    def sleeper() -> None:
        tid.append(threading.get_native_id())
        started.set()
        release.wait()

    t = threading.Thread(target=sleeper)
    t.start()
    try:
        assert started.wait(30)
        base = run_delay_ns(os.getpid())
        assert base is not None
        entries = _entries(thread_report(os.getpid(), base))
        assert tid[0] in entries
        name, state, wchan = entries[tid[0]][1:4]
        assert name and state in "RS" and wchan
        assert entries[tid[0]][4].startswith("waited=") and entries[tid[0]][4].endswith("ms")
        assert all(len(e) == 4 for e in _entries(thread_report(os.getpid())).values())  # no baseline: no wait
    finally:
        release.set()
        t.join()


def test_a_process_that_is_gone_reports_nothing() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert thread_report(child.pid) == ""
