"""The negative error codes of the ``tensorwasm`` host ABI (docs/WASM-ABI.md).

In ``shared`` because both sides need them: the worker's host returns them
to guests, and supervisor-side tools (``twt demo``, ``twt chaos``) read them
back out of guest results.
"""

from __future__ import annotations

import enum

__all__ = ["ErrorCode"]


class ErrorCode(enum.IntEnum):
    """What a host import returns instead of a result (docs/WASM-ABI.md has the table)."""

    OK = 0
    #: an argument is out of its domain (size <= 0, negative count, NaN-free checks ...)
    INVALID = -1
    #: the handle was never issued in this run, or was freed already
    BAD_HANDLE = -2
    #: a guest pointer + length reaches past the guest's linear memory
    MEMORY_BOUNDS = -3
    #: an offset + length (or a count of elements) reaches past the buffer
    BUFFER_BOUNDS = -4
    #: the tenant's GPU byte cap refused the allocation (nothing was allocated)
    GPU_QUOTA = -5
    #: the device (or the device-wide budget) had no memory for it
    DEVICE_OOM = -6
    #: free() of a buffer the run did not allocate (a client buffer passed in)
    NOT_OWNED = -7
    #: the guest exports no linear memory named "memory"
    NO_MEMORY = -8
    #: log() dropped the message (per-run or per-worker rate limit)
    RATE_LIMITED = -9
    #: the run already holds MAX_LIVE_HANDLES buffers
    TOO_MANY_HANDLES = -10
    #: the backend failed the operation (e.g. a CUDA error); the run may go on
    BACKEND = -11
    #: a bug in the host; logged with a traceback
    INTERNAL = -12
