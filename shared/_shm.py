"""POSIX shared-memory segments with explicit ownership.

Why not plain :class:`multiprocessing.shared_memory.SharedMemory` everywhere:
on Python 3.11/3.12 *attaching* registers the segment with the resource
tracker (gh-82300), and spawned/forkserver children share their parent's
tracker, so a worker that attaches and exits can make the tracker unlink the
supervisor's segment, or print "leaked shared_memory" warnings. Here:

* :func:`create` is for the one owner (the supervisor, or a test). It uses
  ``SharedMemory(create=True)``, which *is* tracked: if the owner is killed,
  its resource tracker unlinks the segment, and a later supervisor on the
  same run dir removes anything left with
  :func:`shared.quota.cleanup_stale_segments` (names carry the run dir's
  namespace, so it never removes another supervisor's).
* :func:`attach` is for everybody else and never touches the tracker
  (``track=False`` on 3.13+, ``_posixshmem`` + ``mmap`` before that).
"""

from __future__ import annotations

import mmap
import os
import sys
from multiprocessing import shared_memory
from typing import Protocol

__all__ = ["SHM_DIR", "Segment", "attach", "create", "list_segments", "reserve", "unlink"]

SHM_DIR = "/dev/shm"


class Segment(Protocol):
    """What the quota code needs of a mapped segment."""

    @property
    def name(self) -> str: ...
    @property
    def buf(self) -> memoryview: ...
    @property
    def size(self) -> int: ...
    def close(self) -> None: ...


class _Owned:
    """A created segment (tracked by the resource tracker of the creating process)."""

    def __init__(self, shm: shared_memory.SharedMemory, *, keep_fd: bool = False) -> None:
        self._shm = shm
        # The mapping is all most segments need: the shm fd would cost the supervisor one
        # more descriptor each for nothing (SharedMemory keeps it only for close()). A
        # segment whose size is checked before it is touched (:meth:`truncated`) keeps it.
        # That check needs no descriptor of its own: CPython's mmap keeps a duplicate of the
        # segment's fd, and ``mmap.size()`` is an fstat of it - one fd per segment either way.
        fd = getattr(shm, "_fd", -1)
        self._sized: mmap.mmap | None = getattr(shm, "_mmap", None) if keep_fd else None
        if isinstance(fd, int) and fd >= 0:
            os.close(fd)
            shm._fd = -1  # type: ignore[attr-defined]
        self.name: str = shm.name
        self.size: int = shm.size
        self.buf: memoryview = shm.buf  # type: ignore[assignment]

    def truncated(self) -> bool:
        """Has someone shrunk the segment under our mapping (``ftruncate`` by a process of
        our uid)? Touching the pages past its end would be a SIGBUS. False without a kept fd."""
        if self._sized is None:
            return False
        try:
            return int(self._sized.size()) < self.size
        except (OSError, ValueError):  # ValueError: the mapping is closed
            return True

    def close(self) -> None:
        self._sized = None
        self._shm.close()

    def unlink(self) -> None:
        try:
            self._shm.unlink()
        except FileNotFoundError:
            # Someone else removed the name (stale cleanup, an operator): still
            # drop our tracker registration, or the tracker warns about a
            # "leaked" segment at exit and tries to unlink the name again.
            from multiprocessing import resource_tracker

            resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
            raise


class _Attached:
    """An attached segment the resource tracker never hears about."""

    def __init__(self, name: str) -> None:
        self.name = name
        if sys.version_info >= (3, 13):
            self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(
                name=name, track=False
            )
            self.size = self._shm.size
            self.buf: memoryview = self._shm.buf  # type: ignore[assignment]
            self._mmap: mmap.mmap | None = None
            return
        self._mmap = None
        import _posixshmem  # type: ignore[import-not-found]  # CPython's module behind SharedMemory

        self._shm = None
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self.size = os.fstat(fd).st_size
            if self.size == 0:
                raise ValueError("segment is empty")
            mapping = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self._mmap = mapping
        self.buf = memoryview(mapping)

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            return
        self.buf.release()
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None


def create(name: str, size: int, *, keep_fd: bool = False,
           reserve: tuple[tuple[int, int], ...] | None = None) -> _Owned:
    """Create (exclusively) and map a segment of ``size`` bytes, zero-filled, its pages reserved.

    ``posix_fallocate`` gives the segment its memory before anything is written: a full
    ``/dev/shm`` then refuses it here with :class:`~shared.errors.SegmentError` (nothing
    left behind), instead of a SIGBUS at the first write into a page the tmpfs cannot
    supply. ``keep_fd``: keep a descriptor for :meth:`_Owned.truncated`. ``reserve``: only these
    ``(offset, length)`` ranges get their memory now - a segment whose far part is used only as it
    fills (the GPU-time board's tenant lines) reserves the rest with :func:`reserve` before touching it.
    """
    from shared.errors import SegmentError

    shm = shared_memory.SharedMemory(name=name, create=True, size=size)
    try:
        for offset, length in ((0, size),) if reserve is None else reserve:
            _reserve(shm._fd, offset, min(length, size - offset))  # type: ignore[attr-defined]
    except OSError as exc:
        shm.close()
        shm.unlink()
        raise SegmentError(name, f"no room in {SHM_DIR} for {size:,} B ({exc.strerror}); free some "
                                 "(released regions, evicted tenants) or enlarge it") from None
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    return _Owned(shm, keep_fd=keep_fd)


def _reserve(fd: int, offset: int, length: int) -> None:
    """The seam tests use to stand in for a full /dev/shm where they cannot mount a small one."""
    if length > 0:
        os.posix_fallocate(fd, offset, length)


def reserve(name: str, offset: int, length: int) -> None:
    """Give ``length`` bytes from ``offset`` of a segment created with a partial ``reserve`` their
    memory before they are touched: :class:`~shared.errors.SegmentError` when /dev/shm is full
    (instead of a SIGBUS at the first write). Opens the segment only for the call: no fd is kept."""
    from shared.errors import SegmentError

    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise SegmentError(name, f"cannot open to reserve memory ({exc.strerror})") from None
    try:
        _reserve(fd, offset, length)
    except OSError as exc:
        raise SegmentError(name, f"no room in {SHM_DIR} for {length:,} B more ({exc.strerror}); free some "
                                 "(released regions, evicted tenants) or enlarge it") from None
    finally:
        os.close(fd)


def attach(name: str) -> _Attached:
    """Map an existing segment without registering it anywhere.

    Raises ``FileNotFoundError`` when it does not exist.
    """
    return _Attached(name)


def unlink(name: str) -> None:
    """Unlink a segment by name without mapping it (stale-segment cleanup)."""
    import _posixshmem  # type: ignore[import-not-found, unused-ignore]  # typeshed has it only on some versions

    _posixshmem.shm_unlink("/" + name)


def list_segments(prefix: str) -> list[str]:
    """Names of the segments in ``/dev/shm`` starting with ``prefix`` (Linux)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []
