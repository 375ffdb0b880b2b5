"""The lifecycle every ``twt-*`` segment object shares: map, bind counters, close, unlink.

:class:`~shared.quota.QuotaBlock` (one per tenant) and
:class:`~shared.device_budget.DeviceBudget` (one per device) differ in layout
and in what their counters mean, not in how they are owned: the creating
process unlinks; attached processes only unmap; an owner that forgets
``close()`` still unlinks at garbage collection or interpreter exit, without
a resource-tracker warning - in the process that made the segment only (a
child forked from it that exits normally runs the same finalizers) and only
while the name still names that segment; and the C counters hold buffer
exports, so they are closed before the mapping is.
"""

from __future__ import annotations

import logging
import weakref
from typing import ClassVar, Self
from collections.abc import Callable


from shared import _atomics, _shm
from shared.errors import SegmentError

__all__ = ["MappedSegment"]


class MappedSegment:
    """Base of the segment objects: the mapping, its counters and their shared lifecycle."""

    #: how error messages name the object ("quota block", "device budget")
    _what: ClassVar[str] = "segment"

    _segment: _shm.Segment
    _buf: memoryview
    _owner: bool
    _is_closed: bool
    _unlinked: bool
    _counters: tuple[_atomics.Counter | _atomics.ShareCounter, ...]
    _finalizer: weakref.finalize[[tuple[_atomics.Counter | _atomics.ShareCounter, ...], _shm.Segment], MappedSegment] | None

    def _map(self, segment: _shm.Segment, *, owner: bool) -> None:
        """Step 1 of ``__init__``: hold the mapping (counters are bound to ``self._buf`` next)."""
        self._segment = segment
        self._buf = segment.buf
        self._owner = owner
        self._closed = False
        self._unlinked = False
        self._counters = ()
        self._finalizer = None

    @property
    def _closed(self) -> bool:
        """Closed - or, for an owner that kept its fd, truncated under the mapping by another
        process of our uid: every method that checks this before touching the pages then
        raises SegmentError instead of taking a SIGBUS (see :meth:`_shm._Owned.truncated`)."""
        if self._is_closed:
            return True
        truncated = getattr(self._segment, "truncated", None)
        if truncated is not None and truncated():
            if not self._truncated_logged:
                self._truncated_logged = True
                from shared.log import get_logger, log_event

                log_event(get_logger("shared.segment"), logging.ERROR, "segment.truncated", segment=self.name,
                          what=self._what)
            return True
        return False

    @_closed.setter
    def _closed(self, value: bool) -> None:
        self._is_closed = value

    _truncated_logged = False

    def _bind_counters(self, *counters: _atomics.Counter | _atomics.ShareCounter) -> None:
        """Step 2: the C counters on this mapping; an owner also gets its GC/exit cleanup."""
        self._counters = counters
        if self._owner:
            self._finalizer = weakref.finalize(self, _finalize_owned, counters, self._segment)

    def _on_closed(self) -> Callable[[], BaseException]:
        """The counters' "closed" callback. A closure over the name, never over ``self``:
        the finalizer holds the counters, and a counter holding ``self`` would keep the
        object alive forever (no unlink at garbage collection)."""
        name, what = self._segment.name, self._what

        def closed() -> BaseException:
            return SegmentError(name, f"{what} is closed")

        return closed

    @property
    def name(self) -> str:
        """The segment's name (what other processes attach to)."""
        return self._segment.name

    @property
    def is_owner(self) -> bool:
        return self._owner

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unmap (idempotent). An owner should :meth:`unlink` too; leaving its ``with`` does both."""
        if self._is_closed:
            return
        self._closed = True
        if self._finalizer is not None:
            self._finalizer.detach()
        _close_only(self._counters, self._segment)
        self._buf = memoryview(b"")

    def unlink(self) -> None:
        """Remove the segment's name (owner only; idempotent). Mappings stay valid until closed."""
        if not self._owner:
            raise SegmentError(self.name, f"only the creating process unlinks a {self._what}")
        if self._unlinked:
            return
        self._unlinked = True
        if self._finalizer is not None:
            self._finalizer.detach()
            if not self._is_closed:  # keep closing at GC/exit if the caller forgets close()
                self._finalizer = weakref.finalize(self, _close_only, self._counters, self._segment)
        _unlink(self._segment)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._owner:
                self.unlink()
        finally:
            self.close()


def _close_only(counters: tuple[_atomics.Counter | _atomics.ShareCounter, ...], segment: _shm.Segment) -> None:
    for counter in counters:  # they hold buffer exports: before the mapping goes
        counter.close()
    segment.close()


def _unlink(segment: _shm.Segment) -> None:
    assert isinstance(segment, _shm._Owned)
    try:
        segment.unlink()
    except FileNotFoundError:
        pass


def _finalize_owned(counters: tuple[_atomics.Counter | _atomics.ShareCounter, ...], segment: _shm.Segment) -> None:
    """GC / interpreter-exit cleanup of an owned segment the caller forgot to close. In a child
    that inherited the object through ``fork()`` only the child's mapping goes: the segment is its
    parent's (a forked child that exits normally runs every pending finalizer at exit)."""
    _close_only(counters, segment)
    if isinstance(segment, _shm._Owned) and segment.created_here:
        _unlink(segment)
