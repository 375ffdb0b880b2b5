"""A parked instance's buffers as one file, so that its next worker restores them with one copy.

    <run dir>/parked/          0700: the host copies of parked instances' buffers
        p<128 random bits>     0600, one file per parked instance: its buffers end to end

Parking (supervisor.lifecycle.parking) copies an instance's buffers out chunk
by chunk into the file (:meth:`ParkedBytes.write`: one ``pwrite`` of each
chunk as it arrives); the activating worker is handed the file's path
(``import_mapped``), maps it and writes each buffer from the mapping straight
into the backend's buffer: each byte is copied once on the way back, with no
message, socket or intermediate bytes object in between (the stub backend's
restore is then a memcpy; the cuda backend's a host-to-device copy from the
mapping).

What a parked tenant holds: a file, never a file descriptor (the descriptor
the export writes through is closed once the copy is whole, :meth:`seal`), a
mapping, or a ``/dev/shm`` segment. The file lives in the run directory: on a
tmpfs (``XDG_RUNTIME_DIR``) its pages are memory, as a ``bytearray`` would be,
and are charged to the tenant's memory quota the same way; on a disk its pages
may be written back and dropped under memory pressure, and come back from the
page cache or the disk.

The file goes (:meth:`ParkedBytes.close`) once the activation is confirmed, a
park is cancelled, or the record is dropped (its tenant evicted: a finalizer).
A supervisor killed meanwhile leaves its files behind, as it leaves its
sockets: the next start on the run dir removes them (:func:`remove_stale`) -
host copies never survive a restart (docs/OPERATIONS.md).

Owns: its file and, while the export writes, its descriptor. Loop thread only (the worker
only reads the file).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import weakref
from typing import Final

__all__ = ["PARKED_DIR", "PARKED_NAME", "ParkedBytes", "ParkedSpan", "remove_stale"]

#: the run dir's subdirectory of parked instances' files
PARKED_DIR: Final = "parked"
#: a parked file's name: what a worker accepts as one (never a path of the client's choosing)
PARKED_NAME: Final = re.compile(r"p[0-9a-f]{32}")


def _close(fd: list[int], path: str) -> None:
    """Unlink, and close the descriptor if the export still held it; neither step may raise."""
    with contextlib.suppress(OSError):
        os.unlink(path)
    if fd:
        with contextlib.suppress(OSError):
            os.close(fd.pop())


class ParkedBytes:
    """One parked instance's buffers, end to end, in one file of ``<run dir>/parked/``."""

    __slots__ = ("path", "nbytes", "_fd", "_finalizer", "__weakref__")

    def __init__(self, path: str, nbytes: int, fd: int) -> None:
        """Internal: use :meth:`create`."""
        self.path = path
        self.nbytes = nbytes
        self._fd = [fd]  # shared with the finalizer: empty once sealed
        self._finalizer = weakref.finalize(self, _close, self._fd, path)

    @classmethod
    def create(cls, run_dir: str, nbytes: int) -> ParkedBytes:
        """A new file of ``nbytes`` (> 0) under ``run_dir``'s parked directory, its space taken,
        open for :meth:`write` until :meth:`seal`. OSError (no space, no descriptor) when it
        cannot be made: the caller keeps the copy in its own memory instead."""
        if nbytes <= 0:
            raise ValueError(f"a parked file holds at least one byte, not {nbytes}")
        directory = os.path.join(run_dir, PARKED_DIR)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        path = os.path.join(directory, "p" + secrets.token_hex(16))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            try:  # take the space now: a full tmpfs refuses here, not half-way through the copy
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        return cls(path, nbytes, fd)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def sealed(self) -> bool:
        """The copy is whole: no descriptor is held (what a parked tenant may hold)."""
        return not self._fd

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Put ``data`` at ``offset`` (a chunk of a buffer, as the export brings it). OSError
        when the file cannot take it; ValueError outside the file or once sealed."""
        n = len(data)
        if offset < 0 or offset + n > self.nbytes:
            raise ValueError(f"[{offset}, {offset + n}) is outside the parked file's {self.nbytes} B")
        if not self._fd:
            raise ValueError("the parked file is sealed")
        view = memoryview(data).cast("B")
        done = 0
        while done < n:
            done += os.pwrite(self._fd[0], view[done:], offset + done)

    def seal(self) -> None:
        """The copy is whole: close the descriptor (idempotent); the file stays for the import."""
        if self._fd:
            os.close(self._fd.pop())

    def check(self) -> str | None:
        """Why the file cannot be imported, or None when it can: it is still there, a regular
        file of the size written and readable. Something outside the supervisor may have
        deleted, truncated, replaced or locked it (an operator cleaning the run dir); its
        buffers are then lost (parking answers their handles ``BufferLost``) rather than
        failing every activation. Opens and closes it: no descriptor is kept."""
        if self.closed:
            return "the parked file was removed"
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            return f"cannot open the parked file: {exc.strerror}"
        try:
            st = os.fstat(fd)
        except OSError as exc:
            return f"cannot read the parked file: {exc.strerror}"
        finally:
            os.close(fd)
        if not stat.S_ISREG(st.st_mode):
            return "the parked file is no longer a regular file"
        if st.st_size != self.nbytes:
            return f"the parked file holds {st.st_size} B, not the {self.nbytes} B written"
        return None

    def close(self) -> None:
        """Unlink the file (and close its descriptor, if still open); idempotent."""
        self._finalizer()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "sealed" if self.sealed else "open"
        return f"<ParkedBytes {self.name} {self.nbytes} B {state}>"


class ParkedSpan:
    """One buffer's place in its instance's parked file: what a ParkedBuffer holds instead of
    a bytearray (its length for the listings, its chunks written through to the file)."""

    __slots__ = ("file", "offset", "nbytes")

    def __init__(self, file: ParkedBytes, offset: int, nbytes: int) -> None:
        self.file = file
        self.offset = offset
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Chunk ``data`` of this buffer at ``offset`` into the file."""
        if offset < 0 or offset + len(data) > self.nbytes:
            raise ValueError(f"[{offset}, {offset + len(data)}) is outside the buffer's {self.nbytes} B")
        self.file.write(self.offset + offset, data)


def remove_stale(run_dir: str) -> int:
    """Remove the parked files a previous supervisor on ``run_dir`` left behind (killed while
    tenants were parked); returns how many. Called at start, before any park."""
    directory = os.path.join(run_dir, PARKED_DIR)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return 0
    removed = 0
    for name in names:
        if PARKED_NAME.fullmatch(name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
                removed += 1
    return removed
