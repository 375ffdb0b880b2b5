"""WASI preview 1 for guests: what libc needs, and nothing of the host.

    guest libc                     this module / wasmtime's WASI
    ──────────                     ─────────────────────────────
    printf, puts, fwrite(stdout)   fd_write (ours)  ──► OutputLines ──► GuestRun.log_line (the log limits)
    fprintf(stderr, ...)           fd_write (ours)  ──► OutputLines ──► GuestRun.log_line
    isatty(0..2), stdio buffering  fd_fdstat_get (ours): fds 0-2 are terminals, others EBADF
    sleep, nanosleep, poll         poll_oneoff (ours): ENOTSUP, never blocks the worker
    clock_gettime, time            clock_time_get     (wasmtime)
    getrandom, arc4random          random_get         (wasmtime)
    exit, abort-free return        proc_exit          (wasmtime: ExitTrap -> the reply's exit_code)
    fopen, opendir, stat           path_* / fd_*      (wasmtime, no preopened directory: every path fails)
    getenv, argv                   environ_* / args_* (wasmtime: no environment, argv = [PROGRAM])
    socket calls                   sock_*             refused at compile time (WasmCompile)

Each WASI store gets a fresh :class:`wasmtime.WasiConfig` with no
preopened directory, no environment, no arguments beyond the program name,
and the default stdin (empty). Without a preopen, wasi-libc resolves no
path at all, so no file of the host can be named, let alone opened.

Why our own ``fd_write``: wasmtime-py 50's ``stdout_custom`` calls back on
wasmtime's tokio threads, after the write has returned to the guest (lines
arrive late, out of order, or after the run ended, and a callback during
interpreter shutdown aborts the process). ``fd_write`` here runs on the
guest's thread, inside the call: every line is counted against the run's
log limits before the guest continues. Its cost is bounded by the run, not
by the lines: every byte and newline is paid for from the store's fuel
before it is read, the run's deadline is checked between chunks of a call
(1,024 iovecs may name the same 4 GiB again and again), and lines past the
log limits are counted in bulk, never handled one by one. Why our own ``fd_fdstat_get``:
wasi-libc line-buffers stdout only on a terminal and otherwise keeps up to
a buffer's worth until ``exit`` - which a reactor never calls, so a
guest's ``printf`` lines would be lost at the end of each run. Fds 0-2
therefore describe themselves as character devices without seek or tell
(what ``isatty`` asks); no other fd can exist (nothing can be opened).
Why our own ``poll_oneoff``: a
guest sleeping inside a host call cannot be interrupted by the epoch
deadline, so sleeping is not offered (``ENOTSUP``), and the deadline stays
exact.

These replace wasmtime's definitions in the one linker of a host
(``allow_shadowing``); every other preview-1 function is wasmtime's.
"""

from __future__ import annotations

import ctypes
import struct
import time
from collections.abc import Callable
from typing import Literal, cast

import wasmtime

__all__ = [
    "CHUNK",
    "FUEL_PER_BYTE",
    "FUEL_PER_LINE",
    "PROGRAM",
    "WASI_FUNCTIONS",
    "WASI_MODULE",
    "WASI_REFUSED",
    "OutputLines",
    "OutputStopped",
    "define_wasi",
    "imports_wasi",
    "wasi_config",
]

#: the module name of WASI preview 1 imports
WASI_MODULE = "wasi_snapshot_preview1"
#: argv[0] of every guest (no other argument is ever passed)
PROGRAM = "tenant"

#: the preview-1 functions a guest may import (wasmtime's, or ours where marked above)
WASI_FUNCTIONS: frozenset[str] = frozenset({
    "args_get", "args_sizes_get", "environ_get", "environ_sizes_get",
    "clock_res_get", "clock_time_get", "random_get", "sched_yield", "proc_exit", "proc_raise",
    "poll_oneoff",
    "fd_advise", "fd_allocate", "fd_close", "fd_datasync", "fd_fdstat_get", "fd_fdstat_set_flags",
    "fd_fdstat_set_rights", "fd_filestat_get", "fd_filestat_set_size", "fd_filestat_set_times",
    "fd_pread", "fd_prestat_get", "fd_prestat_dir_name", "fd_pwrite", "fd_read", "fd_readdir",
    "fd_renumber", "fd_seek", "fd_sync", "fd_tell", "fd_write",
    "path_create_directory", "path_filestat_get", "path_filestat_set_times", "path_link", "path_open",
    "path_readlink", "path_remove_directory", "path_rename", "path_symlink", "path_unlink_file",
})
#: preview-1 functions refused at compile time: a tenant gets no network, not even an inherited socket
WASI_REFUSED: frozenset[str] = frozenset({"sock_accept", "sock_recv", "sock_send", "sock_shutdown"})

# preview-1 errno values (wasi_snapshot_preview1 ``errno``)
ERRNO_SUCCESS = 0
ERRNO_BADF = 8
ERRNO_FAULT = 21
ERRNO_INVAL = 28
ERRNO_IO = 29
ERRNO_NOTSUP = 58

# fdstat of a terminal: filetype CHARACTER_DEVICE, rights FD_READ (stdin) or FD_WRITE (stdout, stderr)
# with POLL_FD_READWRITE; no FD_SEEK / FD_TELL (wasi-libc's isatty checks for their absence)
_FILETYPE_CHARACTER_DEVICE = 2
_RIGHT_FD_READ = 1 << 1
_RIGHT_FD_WRITE = 1 << 6
_RIGHT_POLL_FD_READWRITE = 1 << 27

#: iovecs one fd_write may pass (POSIX IOV_MAX)
IOV_MAX = 1024
#: fuel a byte written to stdout / stderr costs (about what a guest instruction costs: the host's copy
#: and newline scan run at about a byte a nanosecond)
FUEL_PER_BYTE = 1
#: fuel a newline costs on top (a line's bookkeeping, even when it is dropped)
FUEL_PER_LINE = 100
#: bytes ``fd_write`` handles between two checks of the run's fuel and deadline
CHUNK = 256 << 10
_U32 = 0xFFFFFFFF
_STDOUT, _STDERR = 1, 2


def imports_wasi(module: wasmtime.Module) -> bool:
    """Whether ``module`` imports anything from WASI preview 1 (then its store gets a WASI context)."""
    return any(imp.module == WASI_MODULE for imp in module.imports)


def wasi_config() -> wasmtime.WasiConfig:
    """A WASI context that reaches nothing of the host: argv = [PROGRAM], no env, no preopens, no stdio."""
    config = wasmtime.WasiConfig()
    config.argv = [PROGRAM]
    return config


class OutputStopped(Exception):
    """Internal: ``fd_write`` ended the run (``reason``: ``"deadline"`` or ``"fuel"``).

    Raised inside the host call; wasmtime hands it back out of the guest's
    call unchanged, and the host turns it into ``KernelTimeout`` or a
    ``WasmTrap("out_of_fuel")`` - the same outcomes as the epoch deadline
    and fuel exhaustion in guest code.
    """

    def __init__(self, reason: Literal["deadline", "fuel"]) -> None:
        super().__init__(reason)
        self.reason: Literal["deadline", "fuel"] = reason


class OutputLines:
    """One guest stream (stdout or stderr) cut into lines, each handed to ``emit(raw, truncated)``.

    A line longer than ``max_bytes`` is cut there: the rest up to the next
    newline is dropped and the line is flagged as truncated (one line
    still). :meth:`close` emits a last line that had no newline.

    ``emit`` returns a false value (``None`` or ``0``: ``OK``) when it kept
    the line and a true one when it dropped it (over the run's or the
    worker's log limits). Once a line of one :meth:`write` is dropped, the
    rest of that write's complete lines are only counted (``bytes.count``,
    no Python work per line) and handed to ``drop(n)``: a write of a
    million newlines costs one scan of its bytes, not a million calls.

    ``deadline_ns`` (``time.monotonic_ns``) is the run's deadline, checked
    by ``fd_write`` between chunks of a call.
    """

    def __init__(self, emit: Callable[[bytes, bool], object], max_bytes: int, *,
                 drop: Callable[[int], object] | None = None, deadline_ns: int | None = None) -> None:
        self._emit = emit
        self._drop = drop
        self._max = max_bytes
        self._line = bytearray()
        self._truncated = False
        self.deadline_ns = deadline_ns
        #: lines counted as dropped in bulk (also handed to ``drop``)
        self.dropped = 0

    def write(self, data: bytes) -> None:
        end = data.find(b"\n")
        if end < 0:
            self._append(data, 0, len(data))
            return
        last = data.rfind(b"\n")
        self._append(data, 0, end)
        kept = self._flush()
        start = end + 1
        while kept and start <= last:
            end = data.find(b"\n", start)
            self._append(data, start, end)
            kept = self._flush()
            start = end + 1
        if start <= last:  # a line was dropped: the rest of this write's complete lines are too
            self._count_dropped(data.count(b"\n", start, last + 1))
            start = last + 1
        self._append(data, start, len(data))

    def _append(self, data: bytes, start: int, end: int) -> None:
        room = self._max - len(self._line)
        if end - start > room:
            self._truncated = True
            end = start + room
        if end > start:
            self._line += data[start:end]

    def _flush(self) -> bool:
        """Hand the line to ``emit``; whether it was kept."""
        raw, truncated = bytes(self._line), self._truncated
        self._line.clear()
        self._truncated = False
        return not self._emit(raw, truncated)

    def _count_dropped(self, n: int) -> None:
        self.dropped += n
        if self._drop is not None:
            self._drop(n)

    def close(self) -> None:
        if self._line or self._truncated:
            self._flush()


#: ``sink(fd) -> OutputLines`` of the run in progress, or None (no run: the call fails with EIO)
StreamOf = Callable[[int], OutputLines | None]


def _memory(caller: wasmtime.Caller) -> tuple[int, int] | None:
    """(address, size) of the caller's exported ``memory`` at this moment, or None."""
    mem = caller.get("memory")
    if not isinstance(mem, wasmtime.Memory):
        return None
    address = ctypes.cast(mem.data_ptr(caller), ctypes.c_void_p).value or 0
    return address, mem.data_len(caller)


def _charge(caller: wasmtime.Caller, amount: int) -> None:
    """Take ``amount`` fuel from the caller's store; ``OutputStopped("fuel")`` (fuel left at 0) when it has less."""
    # Inside a host call the Caller is its store's context: Store.get_fuel / set_fuel only use ``_context()``.
    store = cast(wasmtime.Store, caller)
    left = wasmtime.Store.get_fuel(store)
    if left < amount:
        wasmtime.Store.set_fuel(store, 0)
        raise OutputStopped("fuel")
    wasmtime.Store.set_fuel(store, left - amount)


def fd_write(stream_of: StreamOf, caller: wasmtime.Caller, fd: int, iovs: int, iovs_len: int,
             nwritten: int) -> int:
    """``fd_write(fd, iovs, iovs_len, nwritten_ptr) -> errno`` for fds 1 and 2, into the run's log.

    Every byte is reported written (a dropped or rate-limited line is the
    host's business, not an error libc would retry). Any other fd is
    ``EBADF``; an iovec outside linear memory is ``EFAULT`` before any byte
    is taken.

    What bounds one call (1,024 iovecs may name the same 4 GiB again and
    again): the bytes are handled in chunks of at most ``CHUNK`` bytes,
    each paid for before it is read - ``FUEL_PER_BYTE`` a byte and
    ``FUEL_PER_LINE`` a newline from the store's fuel - and the run's
    deadline is checked before each chunk. Past either the call raises
    :class:`OutputStopped` and the run ends as the guest's own code would
    (``out_of_fuel`` / ``KernelTimeout``). Lines past the log limits are
    counted per chunk, not handled one by one (:class:`OutputLines`).
    """
    stream = stream_of(fd)
    if stream is None:
        return ERRNO_BADF if fd not in (_STDOUT, _STDERR) else ERRNO_IO
    span = _memory(caller)
    if span is None:
        return ERRNO_FAULT
    base, size = span
    iovs &= _U32
    count = iovs_len & _U32
    out = nwritten & _U32
    if count > IOV_MAX:
        return ERRNO_INVAL
    if iovs + 8 * count > size or out + 4 > size:
        return ERRNO_FAULT
    vectors = list(struct.iter_unpack("<II", ctypes.string_at(base + iovs, 8 * count))) if count else []
    if any(ptr + length > size for ptr, length in vectors):
        return ERRNO_FAULT
    deadline = stream.deadline_ns
    total = 0
    for ptr, length in vectors:
        while length:
            if deadline is not None and time.monotonic_ns() >= deadline:
                raise OutputStopped("deadline")
            part = min(length, CHUNK)
            _charge(caller, part * FUEL_PER_BYTE)
            chunk = ctypes.string_at(base + ptr, part)
            lines = chunk.count(b"\n")
            if lines:
                _charge(caller, lines * FUEL_PER_LINE)
            stream.write(chunk)
            ptr += part
            length -= part
            total += part
    ctypes.memmove(base + out, ctypes.byref(ctypes.c_uint32(total & _U32)), 4)
    return ERRNO_SUCCESS


def fd_fdstat_get(caller: wasmtime.Caller, fd: int, out: int) -> int:
    """``fd_fdstat_get(fd, out_ptr) -> errno``: fds 0-2 are terminals (so stdio line-buffers); others EBADF."""
    if fd not in (0, _STDOUT, _STDERR):
        return ERRNO_BADF
    span = _memory(caller)
    if span is None:
        return ERRNO_FAULT
    base, size = span
    out &= _U32
    if out + 24 > size:
        return ERRNO_FAULT
    rights = (_RIGHT_FD_READ if fd == 0 else _RIGHT_FD_WRITE) | _RIGHT_POLL_FD_READWRITE
    # struct fdstat { u8 filetype; u16 flags (at 2); u64 rights_base (at 8); u64 rights_inheriting (at 16) }
    ctypes.memmove(base + out, struct.pack("<BxHxxxxQQ", _FILETYPE_CHARACTER_DEVICE, 0, rights, 0), 24)
    return ERRNO_SUCCESS


def poll_oneoff(caller: wasmtime.Caller, subscriptions: int, events: int, count: int, nevents: int) -> int:
    """``poll_oneoff -> ENOTSUP``: no sleeping or polling inside a host call the deadline cannot stop."""
    return ERRNO_NOTSUP


def define_wasi(linker: wasmtime.Linker, stream_of: StreamOf) -> list[object]:
    """Define WASI preview 1 in ``linker``: wasmtime's, with our ``fd_write``, ``fd_fdstat_get`` and ``poll_oneoff``.

    ``stream_of(fd)`` gives the current run's stream for fd 1 or 2. Returns
    the Python callables the linker holds (the caller keeps them alive).
    """
    i32 = wasmtime.ValType.i32
    linker.define_wasi()
    linker.allow_shadowing = True

    def write(caller: wasmtime.Caller, fd: int, iovs: int, iovs_len: int, nwritten: int) -> int:
        try:
            return fd_write(stream_of, caller, fd, iovs, iovs_len, nwritten)
        except OutputStopped:
            raise  # the end of the run (the host maps it), not a failed write
        except Exception:  # noqa: BLE001 - a host bug must not become the guest's trap
            return ERRNO_IO

    def fdstat(caller: wasmtime.Caller, fd: int, out: int) -> int:
        try:
            return fd_fdstat_get(caller, fd, out)
        except Exception:  # noqa: BLE001 - a host bug must not become the guest's trap
            return ERRNO_IO

    four = wasmtime.FuncType([i32(), i32(), i32(), i32()], [i32()])
    linker.define_func(WASI_MODULE, "fd_write", four, write, access_caller=True)
    linker.define_func(WASI_MODULE, "fd_fdstat_get", wasmtime.FuncType([i32(), i32()], [i32()]), fdstat,
                       access_caller=True)
    linker.define_func(WASI_MODULE, "poll_oneoff", four, poll_oneoff, access_caller=True)
    linker.allow_shadowing = False
    return [write, fdstat]
