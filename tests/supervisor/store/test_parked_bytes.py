"""A parked instance's buffers as one file of the run dir (supervisor.store.parked_bytes): written
chunk by chunk through its spans, no descriptor once sealed, the file gone on close or when
dropped, and a dead supervisor's files removed at the next start."""

from __future__ import annotations

import gc
import os
import stat
from pathlib import Path

import pytest

from supervisor.store.parked_bytes import PARKED_DIR, ParkedBytes, ParkedSpan, remove_stale

pytestmark = pytest.mark.timeout(60)


def _fds(under: Path) -> int:
    """Descriptors of this process open on files below ``under`` (the test's own: a count of all of
    them moved with whatever other tests in the same process opened or closed meanwhile)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor among them)
        n += target.startswith(str(under))
    return n


def test_a_parked_file_takes_its_buffers_chunks_and_holds_no_descriptor_once_sealed(tmp_path: Path) -> None:
    fds = _fds(tmp_path)
    parked = ParkedBytes.create(str(tmp_path), 10)
    try:
        info = os.stat(parked.path)
        assert info.st_size == 10 and stat.S_IMODE(info.st_mode) == 0o600
        assert stat.S_IMODE(os.stat(tmp_path / PARKED_DIR).st_mode) == 0o700
        a, b = ParkedSpan(parked, 0, 4), ParkedSpan(parked, 4, 6)
        assert (len(a), len(b)) == (4, 6)
        a.write(0, b"abcd")
        b.write(2, memoryview(b"wxyz"))
        for span, offset, data in ((a, 2, b"xyz"), (b, -1, b"x")):
            with pytest.raises(ValueError, match="outside"):
                span.write(offset, data)
        assert not parked.sealed and _fds(tmp_path) == fds + 1  # the export writes through its descriptor
        parked.seal()
        parked.seal()  # idempotent
        assert parked.sealed and _fds(tmp_path) == fds  # parked: no descriptor
        assert Path(parked.path).read_bytes() == b"abcd\0\0wxyz"  # what the worker maps
        with pytest.raises(ValueError, match="sealed"):
            a.write(0, b"z")
    finally:
        parked.close()
    assert parked.closed and not os.path.exists(parked.path) and _fds(tmp_path) == fds
    parked.close()  # idempotent
    with pytest.raises(ValueError):
        ParkedBytes.create(str(tmp_path), 0)


def test_a_parked_file_closed_or_dropped_before_its_seal_leaves_neither_file_nor_descriptor(tmp_path: Path) -> None:
    fds = _fds(tmp_path)
    closed = ParkedBytes.create(str(tmp_path), 64)
    closed.close()
    dropped = ParkedBytes.create(str(tmp_path), 4096)
    path = dropped.path
    ParkedSpan(dropped, 0, 16).write(0, bytes(16))
    del dropped
    gc.collect()
    assert not os.path.exists(closed.path) and not os.path.exists(path) and _fds(tmp_path) == fds


def test_a_dead_supervisors_parked_files_are_removed_and_nothing_else(tmp_path: Path) -> None:
    assert remove_stale(str(tmp_path)) == 0  # no directory yet
    left = [ParkedBytes.create(str(tmp_path), 8) for _ in range(2)]
    paths = [p.path for p in left]
    other = tmp_path / PARKED_DIR / "not-ours"
    other.write_bytes(b"x")
    assert remove_stale(str(tmp_path)) == 2
    assert not any(os.path.exists(p) for p in paths) and other.exists()
    for parked in left:
        parked.close()  # already unlinked: closing still closes its descriptor, without an error


def test_check_says_why_a_parked_file_changed_from_outside_cannot_be_imported(tmp_path: Path) -> None:
    fds = _fds(tmp_path)
    whole = ParkedBytes.create(str(tmp_path), 8)
    whole.write(0, b"12345678")
    whole.seal()
    assert whole.check() is None and _fds(tmp_path) == fds  # opened and closed: no descriptor kept
    cut = ParkedBytes.create(str(tmp_path), 8)
    cut.seal()
    os.truncate(cut.path, 3)
    assert "holds 3 B, not the 8 B" in str(cut.check())
    gone = ParkedBytes.create(str(tmp_path), 8)
    gone.seal()
    os.unlink(gone.path)
    assert "cannot open" in str(gone.check())
    swapped = ParkedBytes.create(str(tmp_path), 8)
    swapped.seal()
    os.unlink(swapped.path)
    os.mkfifo(swapped.path)  # not a regular file (opened without blocking)
    assert "regular file" in str(swapped.check())
    closed = ParkedBytes.create(str(tmp_path), 8)
    closed.close()
    assert "removed" in str(closed.check())
    for parked in (whole, cut, gone, swapped):
        parked.close()
    assert _fds(tmp_path) == fds and not os.listdir(tmp_path / PARKED_DIR)
