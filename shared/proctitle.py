"""Name this process (``/proc/<pid>/comm``) so operators and tests can find it.

``ps -o comm``, ``top`` and ``psutil.Process.name()`` show ``twt-worker`` /
``twt-supervisor`` instead of ``python3``. Linux only; silently a no-op
elsewhere, because a name is a convenience, never a requirement.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["set_process_name"]

_PR_SET_NAME = 15


def set_process_name(name: str) -> bool:
    """Set the kernel's short name of this process (<= 15 bytes); True when it worked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return bool(libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False
