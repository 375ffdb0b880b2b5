"""Keep this process's fault-signal handlers across a library that replaces them.

Why: wasmtime turns a guest's out-of-bounds access into a ``Trap`` with its own
SIGSEGV/SIGBUS handler, installed once per process when the first engine is made.
Ray's core worker, started in the test process by ``ray.init`` (the Ray tests'
driver), installs its failure-signal handlers over it, and ``ray.shutdown`` resets
them to the default; after either, a guest's wild store (SIGSEGV) or ``unreachable``
(SIGILL) in the same process kills it - xdist workers that ran the Ray tests and
then WASM tests died (``tests/sdk/test_hostile.py``, a wild store;
``tests/worker/wasm/test_wasm_host.py``, an ``unreachable``), and xdist then hung. Production never mixes the two:
workers are fresh processes that make their own engine. Tests share processes, so
the Ray fixture puts the previous handlers back once Ray is up and once it is down.

``signal.getsignal`` cannot see handlers installed from C, so the whole
``struct sigaction`` is saved and restored through libc, as opaque bytes.
"""

from __future__ import annotations

import ctypes
import signal
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["FAULT_SIGNALS", "kept_fault_handlers"]

#: the signals wasmtime handles for traps (and faulthandler reports)
FAULT_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)

#: bigger than any libc's struct sigaction (glibc x86_64: 152 bytes)
_SIGACTION_BYTES = 512

_libc = ctypes.CDLL(None, use_errno=True)  # libc: already in the process (no ldconfig run)
_libc.sigaction.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_libc.sigaction.restype = ctypes.c_int


def _sigaction(sig: int, new: ctypes.Array[ctypes.c_char] | None, old: ctypes.Array[ctypes.c_char] | None) -> None:
    if _libc.sigaction(int(sig), new, old) != 0:
        raise OSError(ctypes.get_errno(), f"sigaction({sig})")


@contextmanager
def kept_fault_handlers() -> Iterator[None]:
    """The fault signals' handlers as they were on entry, again on exit."""
    saved = {}
    for sig in FAULT_SIGNALS:
        buf = ctypes.create_string_buffer(_SIGACTION_BYTES)
        _sigaction(sig, None, buf)
        saved[sig] = buf
    try:
        yield
    finally:
        for sig, buf in saved.items():
            _sigaction(sig, buf, None)
