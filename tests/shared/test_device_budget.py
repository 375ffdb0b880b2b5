"""A device budget's per-pid reclaim: the supervisor frees one dead worker's share by its pid,
reading that pid's ``/proc`` entry only - not every live owner's, as the full scan does."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from shared import _atomics
from tests.helpers.proc_reads import count_proc_reads
from shared.device_budget import _S_PID, _S_START, DeviceBudget, _slot_off

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


def _dead_pid() -> int:
    """A pid whose process has exited and been reaped."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def _name_owner(owner: DeviceBudget, handle: DeviceBudget, pid: int, start: int | None = None) -> None:
    """Make ``handle``'s slot name ``pid`` (and a start time) as its owner."""
    assert handle.slot is not None
    off = _slot_off(handle.slot)
    _atomics.store(owner._buf, off + _S_PID, pid)
    if start is not None:
        _atomics.store(owner._buf, off + _S_START, start)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every pid whose ``/proc`` entry is read (the liveness check's one read)."""
    yield count_proc_reads(monkeypatch)


def test_a_reclaim_by_pid_reads_only_that_pids_proc_entry_and_frees_its_share(reads: list[int]) -> None:
    with DeviceBudget.create(0, 64 * MiB) as owner:
        handles = [DeviceBudget.attach(owner.name) for _ in range(4)]
        try:
            for i, h in enumerate(handles):
                h.consume((i + 1) * MiB)
            dead = _dead_pid()
            _name_owner(owner, handles[1], dead)
            # the others name pids that are gone too (a full scan would read and free them all)
            others = [_dead_pid() for _ in range(2)]
            _name_owner(owner, handles[2], others[0])
            _name_owner(owner, handles[3], others[1])
            reads.clear()
            assert owner.reclaim_pid(dead) == [(handles[1].slot, dead, 2 * MiB)]
            assert reads == [dead]  # no other owner's /proc entry
            assert owner.used_bytes == (1 + 3 + 4) * MiB
            assert all(h[0] != handles[1].slot for h in owner.snapshot().holders)  # the slot is free
            reads.clear()
            assert owner.reclaim_pid(dead) == []  # once
            assert owner.reclaim_pid(0) == [] and owner.reclaim_pid(-5) == []
            assert reads == []  # no slot names it: nothing read
            # the full scan (the periodic net) still frees every owner gone
            assert sorted(p for _, p, _ in owner.reclaim_dead()) == sorted(others)
            assert owner.used_bytes == MiB
        finally:
            for h in handles:
                h.close()


def test_a_live_owner_and_a_reused_pid_are_told_apart_by_the_start_time(reads: list[int]) -> None:
    with DeviceBudget.create(0, 64 * MiB) as owner:
        live, reused = DeviceBudget.attach(owner.name), DeviceBudget.attach(owner.name)
        try:
            live.consume(MiB)
            reused.consume(2 * MiB)
            assert owner.reclaim_pid(os.getpid()) == []  # alive: kept
            # a slot naming this pid with another start time was a process now gone (its pid reused)
            _name_owner(owner, reused, os.getpid(), start=1)
            assert owner.reclaim_pid(os.getpid()) == [(reused.slot, os.getpid(), 2 * MiB)]
            assert owner.used_bytes == MiB
            assert set(reads) == {os.getpid()}
        finally:
            live.close()
            reused.close()


def test_a_closed_budget_refuses_a_reclaim_by_pid() -> None:
    from shared.errors import SegmentError

    owner = DeviceBudget.create(0, MiB)
    owner.unlink()
    owner.close()
    with pytest.raises(SegmentError):
        owner.reclaim_pid(1)


def test_the_bulk_reads_find_the_claimed_slots_and_a_pids_slots_at_both_ends_of_the_table() -> None:
    """The supervisor's scans read the slot lines in bulk (``_claimed_slots``; ``_slots_of`` for a
    death): they must agree with the slots read one by one, the first and the last included; a
    slot that still names a pid but is no longer claimed is not reclaimed."""
    from shared.device_budget import MAX_SLOTS, _claimed_slots, _slots_of

    with DeviceBudget.create(0, 64 * MiB) as owner:
        buf = owner._buf
        dead = _dead_pid()
        for i in (0, 7, MAX_SLOTS - 1):
            off = _slot_off(i)
            _atomics.consume(buf, off, 1)
            _atomics.store(buf, off + _S_PID, dead)
            _atomics.store(buf, off + _S_START, 1)
        _atomics.store(buf, _slot_off(9) + _S_PID, dead)  # unclaimed: a stale owner word
        assert _claimed_slots(buf) == [0, 7, MAX_SLOTS - 1]
        assert _slots_of(buf, dead) == [0, 7, 9, MAX_SLOTS - 1]
        assert _slots_of(buf, dead + 1) == []
        assert sorted(slot for slot, _, _ in owner.reclaim_pid(dead)) == [0, 7, MAX_SLOTS - 1]
        assert _claimed_slots(buf) == []
