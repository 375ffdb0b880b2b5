"""The fork server's heap with its holes filled (worker.fork_heap): a worker forked after the preload
allocates one block after another in memory of its own, not in free slots scattered over pages it
shares with the fork server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import timeouts

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]

#: a preloaded process (as the fork server) forks a child that makes 300 small allocations of each
#: allocator in a row and reports the share of them that follow the one before at once
_SCRIPT = r'''
import ctypes, json, os, sys
import worker.preload  # noqa: F401 - the fork server's preload
alloc = ctypes.pythonapi.PyObject_Malloc
alloc.restype = ctypes.c_void_p
alloc.argtypes = [ctypes.c_size_t]
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
n = 300
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    out = {}
    # obmalloc's 64-byte blocks; malloc's 200-byte requests are 208-byte chunks
    for name, fn, size, stride in (("obmalloc", alloc, 64, 64), ("malloc", libc.malloc, 200, 208)):
        got = [0] * n
        for i in range(n):
            got[i] = fn(size)
        out[name] = sum(1 for a, b in zip(got, got[1:]) if b - a == stride) / (n - 1)
    os.write(w, json.dumps(out).encode())
    os._exit(0)
os.close(w)
data = b""
while chunk := os.read(r, 4096):
    data += chunk
os.waitpid(pid, 0)
print(data.decode())
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the C library's malloc is read on Linux")
def test_a_worker_forked_after_the_preload_allocates_one_block_after_another() -> None:
    """Before the fill, the forked child's allocations went to the preload's holes first: 18-28 % of
    them followed the one before; after it, from fresh pools and the top of the heap (a pool's or
    the test's own few leftovers aside)."""
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, capture_output=True, text=True,
                          timeout=timeouts.scaled(60))
    assert proc.returncode == 0, proc.stderr
    shares = json.loads(proc.stdout.strip().splitlines()[-1])
    assert shares["obmalloc"] >= 0.9, shares
    assert shares["malloc"] >= 0.9, shares


def test_the_fill_takes_the_holes_once_and_leaves_the_process_working() -> None:
    """A second fill finds only what came and went since the first (the loop's own objects); one
    that cannot read obmalloc's table (no memory file: a sandbox) leaves it as it is and raises
    nothing; the process allocates and frees as before."""
    code = ("import json, os, worker.fork_heap as f\n"
            "first = f.fill_holes(); second = f.fill_holes()\n"
            "def refused(*a, **k): raise OSError(38, 'no memfd here')\n"
            "os.memfd_create = refused\n"
            "third = f.fill_holes()\n"
            "junk = [bytes(200) for _ in range(10000)]; del junk\n"
            "print(json.dumps([first, second, third]))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=timeouts.scaled(60))
    assert proc.returncode == 0, proc.stderr
    first, second, third = json.loads(proc.stdout.strip().splitlines()[-1])
    if sys.platform.startswith("linux"):
        assert first[0] > 0 and first[1] >= 0
        assert second[1] <= first[1]
        assert third[0] == 0
