"""The fork server's heap with its holes filled, so that a forked worker allocates in memory of its own.

A worker forked from the fork server shares every page of the fork server's heap until it writes
to one; the first write is a copy-on-write fault (a trap and a page copy, ~2.8 us on the 2-core
host: 40-50 % of a pool worker's start). The preload leaves both allocators' free memory scattered
between live objects: CPython's small-object allocator (obmalloc: ~360 KiB of free blocks spread
over the partially used pools of its 32 size classes) and the C library's ``malloc`` (~3 MB in
~270 free chunks; wasmtime's and zmq's allocations, Python's larger ones). Each allocator hands
out those holes first, so a forked worker's small allocations - its start, its warm-up, an
artifact's load, its first run - landed one here, one there, each in a page the fork server still
shared: a fault for every few allocations.

:func:`fill_holes` (the fork server's preload, last) takes every such hole once and never gives it
back: each size class's free blocks in its partially used pools (``PyObject_Malloc``, the counts
from ``sys._debugmallocstats``), and ``malloc``'s free chunks, the largest sizes first, until a
request is served from the top of the heap. A forked worker's allocations then come from fresh
pools and the top of the heap, one after another: a page per 4 KiB it allocates. Nothing of the
fork server is copied or grown - the holes were its heap already - and nothing is freed later
(the fork server serves starts until it exits). Where the interpreter or the C library is not
the one read here (``PYTHONMALLOC=malloc``, a C library without ``mallinfo2``) that part is left
as it is: an optimisation only.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys

__all__ = ["fill_holes"]

#: the sizes asked of ``malloc`` to take its free chunks, largest first (below its mmap threshold,
#: 128 KiB): a hole smaller than one size is taken by a later one; 24 B is its smallest chunk's
_MALLOC_SIZES = (1 << 16, 1 << 14, 1 << 12, 1 << 10, 256, 64, 24)
#: the most chunks taken (a bound on the loop, far above the ~1,000-1,400 the preload leaves)
_MALLOC_MAX = 200_000
#: a row of ``sys._debugmallocstats``' size-class table: class, size, pools, blocks in use, free blocks
_CLASS_ROW = re.compile(rb"^\s*\d+\s+(\d+)\s+\d+\s+\d+\s+(\d+)\s*$", re.MULTILINE)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _free_blocks() -> dict[int, int]:
    """obmalloc's free blocks in its used pools, by block size (``sys._debugmallocstats``, which
    writes to the C ``stderr``: read through a memory file put in its place for the call)."""
    stats = getattr(sys, "_debugmallocstats", None)
    if stats is None or not hasattr(os, "memfd_create"):
        return {}
    fd = os.memfd_create("twt-mallocstats")
    saved = os.dup(2)
    try:
        sys.stderr.flush()
        os.dup2(fd, 2)
        try:
            stats()
        finally:
            os.dup2(saved, 2)
        size = os.lseek(fd, 0, os.SEEK_END)
        text = os.pread(fd, size, 0)
    finally:
        os.close(saved)
        os.close(fd)
    return {int(block): int(free) for block, free in _CLASS_ROW.findall(text)}


def _fill_obmalloc() -> int:
    """Take every free block of obmalloc's used pools; how many."""
    blocks = _free_blocks()
    if not blocks:
        return 0
    alloc = ctypes.pythonapi.PyObject_Malloc  # a PyDLL's function: called with the GIL held
    alloc.restype = ctypes.c_void_p
    alloc.argtypes = [ctypes.c_size_t]
    taken = 0
    for size, free in blocks.items():
        for _ in range(free):
            if alloc(size) is None:
                return taken
            taken += 1
    return taken


def _fill_malloc() -> int:
    """Take ``malloc``'s free chunks of the main arena (the fork server has one thread); how many.

    A chunk served from the top of the heap starts at or past the top's start (the break less
    the top's size, ``mallinfo2().keepcost``): that one is freed again and the next smaller size
    goes on; any other came from a hole and is kept."""
    try:
        libc = ctypes.CDLL(None)
        mallinfo2, malloc, free, sbrk = libc.mallinfo2, libc.malloc, libc.free, libc.sbrk
    except (OSError, AttributeError):
        return 0
    mallinfo2.restype = _MallInfo2
    mallinfo2.argtypes = []
    malloc.restype = ctypes.c_void_p
    malloc.argtypes = [ctypes.c_size_t]
    free.restype = None
    free.argtypes = [ctypes.c_void_p]
    sbrk.restype = ctypes.c_void_p
    sbrk.argtypes = [ctypes.c_ssize_t]
    taken = 0
    for size in _MALLOC_SIZES:
        # the top stays where it is while holes serve (and is whole again once the chunk it served
        # is freed): read once a size (``mallinfo2`` walks every free list)
        brk = sbrk(0)
        if brk is None:
            return taken
        top = brk - mallinfo2().keepcost
        while taken < _MALLOC_MAX:
            chunk = malloc(size)
            if chunk is None:
                return taken
            if chunk >= top:
                free(chunk)
                break
            taken += 1
    return taken


def fill_holes() -> tuple[int, int]:
    """Fill this process's heap holes for good (the fork server's preload, last; see the module's
    docstring): ``(obmalloc blocks, malloc chunks)`` taken. ``malloc``'s first: its loop's own
    Python objects then come and go in one obmalloc block each, before obmalloc's are taken."""
    if not sys.platform.startswith("linux"):
        return 0, 0
    try:
        chunks = _fill_malloc()
    except (OSError, AttributeError, ValueError, TypeError):  # a C library read otherwise: left as it is
        chunks = 0
    try:
        blocks = _fill_obmalloc()
    except (OSError, AttributeError, ValueError, TypeError):  # no memfd (a sandbox), another allocator
        blocks = 0
    return blocks, chunks
