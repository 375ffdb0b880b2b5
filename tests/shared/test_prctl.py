"""Process name and parent-death signal (shared/prctl.py), each in a fresh interpreter."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")]

#: runs in a child: records every process it would start (audit events), then calls both controls
_PROBE = r"""
import ctypes, signal, sys
started = []
sys.addaudithook(lambda event, args: started.append(args[0]) if event in ("subprocess.Popen", "os.posix_spawn", "os.exec", "os.fork") else None)
from shared.prctl import set_parent_death_signal, set_process_name
assert set_process_name("twt-probe-name-too-long")
assert set_parent_death_signal(signal.SIGTERM)
got = ctypes.c_int(0)
assert ctypes.CDLL(None).prctl(2, ctypes.byref(got), 0, 0, 0) == 0  # PR_GET_PDEATHSIG
print(open("/proc/self/comm").read().strip(), got.value, started)
"""


def test_name_and_parent_death_signal_are_set_without_starting_a_process() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=50, check=True)
    name, sig, started = out.stdout.split(" ", 2)
    assert name == "twt-probe-name-"  # the kernel keeps 15 bytes
    assert int(sig) == int(signal.SIGTERM)
    # ctypes.util.find_library would have run ``ldconfig -p`` here, in every worker and supervisor
    assert started.strip() == "[]"
