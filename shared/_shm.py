"""POSIX shared-memory segments with explicit ownership.

Why not plain :class:`multiprocessing.shared_memory.SharedMemory` everywhere:
on Python 3.11/3.12 *attaching* registers the segment with the resource
tracker (gh-82300), and spawned/forkserver children share their parent's
tracker, so a worker that attaches and exits can make the tracker unlink the
supervisor's segment, or print "leaked shared_memory" warnings. Here:

* :func:`create` is for the one owner (the supervisor, or a test). Its segment
  *is* tracked, as ``SharedMemory(create=True)``'s is (one message to the
  tracker each at create and unlink, :func:`_tell_tracker`, without the probe
  ``SharedMemory`` writes before each): if the owner is killed,
  its resource tracker unlinks the segment, and a later supervisor on the
  same run dir removes anything left with
  :func:`shared.quota.cleanup_stale_segments` (names carry the run dir's
  namespace, so it never removes another supervisor's).
* :func:`attach` is for everybody else and never touches the tracker
  (``track=False`` on 3.13+, ``_posixshmem`` + ``mmap`` before that).
* A created segment's unlink removes the name only while it still names
  that segment (device and inode compared): once someone else removed it, a
  new segment may carry the name, and it is not this object's to remove.
  The owners' garbage-collection / exit cleanup (:mod:`shared._segment`)
  unlinks only in the process that made the segment, never in a child that
  inherited the object through ``fork()``.
"""

from __future__ import annotations

import errno
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

    def __init__(self, name: str, mapping: mmap.mmap, size: int, ident: tuple[int, int], *,
                 keep_fd: bool = False) -> None:
        # The mapping is all most segments need: no shm fd is kept (it would cost the supervisor
        # one more descriptor each for nothing). A segment whose size is checked before it is
        # touched (:meth:`truncated`) needs none of its own either: CPython's mmap keeps a
        # duplicate of the segment's fd, and ``mmap.size()`` is an fstat of it.
        self._mmap: mmap.mmap | None = mapping
        self._sized: mmap.mmap | None = mapping if keep_fd else None
        self.name: str = name
        self.size: int = size
        self.buf: memoryview = memoryview(mapping)
        #: (st_dev, st_ino) of the segment made: its name may later name another one (below)
        self._ident = ident
        self._creator = os.getpid()
        self._tracked = True

    @property
    def created_here(self) -> bool:
        """Whether this process made the segment - not a child that inherited this object
        through ``fork()``: such a child exiting (atexit runs the owners' finalizers) or
        collecting its copy must leave its parent's segment alone."""
        return os.getpid() == self._creator

    def names_this(self) -> bool:
        """Whether the name still names the segment this object made. Once someone else removed
        it (stale-segment cleanup, an operator), a new segment may carry the same name (a
        registry's numbered slots, a test's fixed name): that one is not ours to remove."""
        try:
            st = os.stat(os.path.join(SHM_DIR, self.name))
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._ident

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
        self.buf.release()
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None

    def unlink(self) -> None:
        import _posixshmem  # type: ignore[import-not-found, unused-ignore]  # CPython's module behind SharedMemory

        try:
            if not self.names_this():
                raise FileNotFoundError(errno.ENOENT, "no longer names the segment this object made",
                                        "/" + self.name)
            _posixshmem.shm_unlink("/" + self.name)
        finally:
            # Removed here or by someone else (stale cleanup, an operator: FileNotFoundError,
            # raised): either way off the tracker's books, or it warns about a "leaked" segment
            # at exit and tries to unlink the name again.
            if self._tracked:
                self._tracked = False
                _untrack(self.name)


#: names this process made and has not unlinked, with how many of its objects hold each. The
#: resource tracker keeps a *set* of names: when a name was removed by someone else and made again
#: here, two objects hold it, and the tracker must hear UNREGISTER only when the last one lets go.
_made: dict[str, int] = {}


def _track(name: str) -> None:
    held = _made.get(name, 0)
    _made[name] = held + 1
    if not held:
        _tell_tracker("REGISTER", name)


def _untrack(name: str) -> None:
    held = _made.pop(name, 1) - 1
    if held:
        _made[name] = held
    else:
        _tell_tracker("UNREGISTER", name)


def _tell_tracker(cmd: str, name: str) -> None:
    """``REGISTER`` or ``UNREGISTER`` segment ``name`` with this process's resource tracker: one
    write to its pipe.

    ``resource_tracker.register`` / ``unregister`` write a probe to the pipe before each message
    (``ensure_running``: is the tracker still there?), so every message woke the tracker process
    twice; a supervisor sends two per tenant activation (its quota segment made at the bind,
    removed when its last worker is gone), on its loop. The message itself is that probe here:
    once the tracker runs, it is written straight to the pipe (under ``PIPE_BUF``: atomic), and
    only a failed write - the tracker is gone, or none was started yet - goes through
    ``multiprocessing``'s own call, which starts it again first."""
    from multiprocessing import resource_tracker

    fd = getattr(getattr(resource_tracker, "_resource_tracker", None), "_fd", None)
    if isinstance(fd, int):
        try:
            os.write(fd, f"{cmd}:/{name}:shared_memory\n".encode("ascii"))
            return
        except OSError:
            pass  # the tracker is gone: the call below starts a new one
    if cmd == "REGISTER":
        resource_tracker.register("/" + name, "shared_memory")
    else:
        resource_tracker.unregister("/" + name, "shared_memory")


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
        import _posixshmem  # type: ignore[import-not-found, unused-ignore]  # CPython's module behind SharedMemory

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

    import _posixshmem  # type: ignore[import-not-found, unused-ignore]  # CPython's module behind SharedMemory

    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    _track(name)  # from here on: a killed owner's tracker unlinks it
    try:
        try:
            st = os.fstat(fd)
            os.ftruncate(fd, size)
            for offset, length in ((0, size),) if reserve is None else reserve:
                _reserve(fd, offset, min(length, size - offset))
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)  # the mapping keeps its own duplicate
    except OSError as exc:
        _unlink_created(name)
        raise SegmentError(name, f"no room in {SHM_DIR} for {size:,} B ({exc.strerror}); free some "
                                 "(released regions, evicted tenants) or enlarge it") from None
    except BaseException:
        _unlink_created(name)
        raise
    return _Owned(name, mapping, size, (st.st_dev, st.st_ino), keep_fd=keep_fd)


def _unlink_created(name: str) -> None:
    """Take back a segment whose creation failed half-way."""
    import _posixshmem  # type: ignore[import-not-found, unused-ignore]

    try:
        _posixshmem.shm_unlink("/" + name)
    finally:
        _untrack(name)


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
