"""The device budget: one shared-memory counter per GPU that every tenant on it draws from.

Each tenant's :class:`~shared.quota.QuotaBlock` caps that tenant; nothing
there stops ten tenants with 20 GiB caps from over-committing one 80 GiB
device. The device budget does: the supervisor creates one segment per
managed device (``twt-<prefix>-dev<index>``) whose limit is the device's
capacity minus a reserve, and every worker placed on that device attaches it
and consumes from it *after* its tenant's counter::

    worker alloc(n):  tenant block.consume_gpu_bytes(n)   refused -> nothing else happens
                      budget.consume(n)                   refused -> tenant bytes released again
                      driver alloc                        OOM     -> both released again
    worker free(n):   tenant block released at once; the budget only for what the backend's pool
                      has given back to the device (worker.allocator: a pool keeps freed memory
                      until a synchronize or trim, and credited earlier the budget would admit an
                      allocation the driver then refuses)

Layout (``uint64`` fields; lines 0-1 are :mod:`shared.quota`'s header and
label, written and checked by its helpers with ``KIND_DEVICE``)::

    line 0        header   (shared.quota.write_header)
    line 1        label    "device <index>"
    line 2        counter  used | limit | high water | refusals | underflows   (shared._atomics)
    line 3        info     device index | capacity bytes | reserve bytes | slots
    line 4+i      slot i   claim counter (used 0/1, limit 1) | owner pid | owner start | bytes

Slots make crash recovery exact. An attaching worker claims a free slot (a
``consume(1)`` against a limit of 1 is an atomic test-and-set) and records
its pid and start time there; its counter mirrors every consume/release into
the slot. When a worker dies - SIGKILL included, or after its tenant was
evicted - the supervisor calls :meth:`DeviceBudget.reclaim_dead`, which
returns the share of every slot whose owner is gone and frees the slot. The
driver has freed a dead process's GPU memory, so its share must come back.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import asdict, dataclass
from typing import Final
from collections.abc import Callable

from shared import _atomics, _shm
from shared._segment import MappedSegment
from shared.checks import is_int
from shared.errors import GpuMemoryExhausted, SegmentError
from shared.log import get_logger, log_event
from shared.quota import (
    KIND_DEVICE,
    SEGMENT_PREFIX,
    _attach,
    _owner_alive,
    _process_start_ms,
    check_header,
    new_segment_name,
    write_header,
)
from shared.sizes import MAX_SIZE

__all__ = ["MAX_SLOTS", "DeviceBudget", "DeviceBudgetSnapshot"]

_log = get_logger("device_budget")

_LINE = 64  # lines 0 and 1 belong to shared.quota's header helpers
_COUNTER = 2 * _LINE
_INFO = 3 * _LINE
_I_DEVICE, _I_CAPACITY, _I_RESERVE, _I_SLOTS = (_INFO + 8 * i for i in range(4))
_SLOTS = 4 * _LINE
#: worker processes that can hold bytes on one device at the same time
MAX_SLOTS: Final = 1024
# within a slot line: the claim counter (a 40-byte _atomics span), then owner and share
_S_PID = _atomics.COUNTER_SPAN
_S_START = _S_PID + 8
_S_SHARE = _S_START + 8
assert _S_SHARE + 8 <= _LINE
_LAYOUT_BYTES = _SLOTS + MAX_SLOTS * _LINE
SEGMENT_BYTES: Final = (_LAYOUT_BYTES + 4095) // 4096 * 4096


def _slot_off(i: int) -> int:
    return _SLOTS + i * _LINE


def _claimed_slots(buf: memoryview) -> list[int]:
    """Indexes of the claimed slots, in one bulk read of the claim words.

    The supervisor scans on every status and scrape; 1024 atomic-load calls cost ~0.5 ms on the
    loop, a Python pass over the 1,024 words of one cast read ~60 us; this ~25 us: the claim words
    of one cast read taken as a list and the claimed ones picked out, both in C. A claim seen here
    is then re-read atomically by the caller, so a torn view cannot matter (aligned 8-byte loads
    are not torn on x86-64/arm64 anyway).
    """
    words = buf[_SLOTS:_LAYOUT_BYTES].cast("Q")
    try:
        claims = words[::_LINE // 8].tolist()
    finally:
        words.release()
    return list(itertools.compress(range(MAX_SLOTS), claims))


def _slots_of(buf: memoryview, pid: int) -> list[int]:
    """Indexes of the slots whose owner word holds ``pid`` (claimed or not: the caller re-reads
    the claim atomically). A worker's death looks only at its own slots: the owner words of every
    slot in one cast read, found by ``list.index`` in C (~20 us), where a pass over every claimed
    slot read two words of each through the atomics (~100 us at 70 workers, on the loop at every
    death)."""
    words = buf[_SLOTS:_LAYOUT_BYTES].cast("Q")
    try:
        owners = words[_S_PID // 8::_LINE // 8].tolist()
    finally:
        words.release()
    found: list[int] = []
    at = -1
    while True:
        try:
            at = owners.index(pid, at + 1)
        except ValueError:
            return found
        found.append(at)


def _amount(value: object, what: str) -> int:
    if not is_int(value):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    if not 0 <= value <= MAX_SIZE:
        raise ValueError(f"{what} must be in 0..2**63-1, got {value}")
    return value


@dataclass(frozen=True)
class DeviceBudgetSnapshot:
    """A device budget at one moment (each field read atomically)."""

    name: str
    device_index: int
    capacity_bytes: int
    reserve_bytes: int
    limit_bytes: int
    used_bytes: int
    free_bytes: int
    high_water: int
    refusals: int
    underflows: int
    #: (slot, owner pid, bytes) of every claimed slot
    holders: tuple[tuple[int, int, int], ...]

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["holders"] = [list(h) for h in self.holders]
        return d


class DeviceBudget(MappedSegment):
    """The shared GPU byte budget of one device; see the module docstring.

    :meth:`create` (the supervisor, which unlinks it) or :meth:`attach` (a
    worker, which claims a slot). ``consume`` / ``release`` are the C methods
    of a bound :class:`shared._atomics.Counter`, like
    :class:`~shared.quota.QuotaBlock`'s: a refusal raises
    :class:`GpuMemoryExhausted` and consumes nothing.
    """

    _what = "device budget"  # a worker's claimed slot stays claimed after close, until its death is seen
    consume: Callable[[int], None]
    release: Callable[[int], None]

    def __init__(self, segment: _shm.Segment, device_index: int, *, owner: bool, slot: int | None) -> None:
        """Internal: use :meth:`create` or :meth:`attach`."""
        self._map(segment, owner=owner)
        self._slot = slot
        self.device_index = device_index
        name = segment.name

        def refuse(n: int, used: int, limit: int) -> BaseException:
            return GpuMemoryExhausted(
                "",
                n,
                limit,
                used,
                message=f"device {device_index} budget exhausted: requested {n:,} B with {used:,} B in use "
                f"of {limit:,} B (all tenants on the device together; capacity minus reserve)",
            )

        def underflow(n: int, used: int) -> None:
            log_event(_log, logging.WARNING, "device_budget.underflow", device=device_index, released=n,
                      in_use=used, segment=name)

        mirror = None if slot is None else _slot_off(slot) + _S_SHARE
        self._counter = _atomics.Counter(self._buf, _COUNTER, refuse, underflow, self._on_closed(), mirror)
        self.consume = self._counter.consume
        self.release = self._counter.release
        self._bind_counters(self._counter)

    # ------------------------------------------------------------ lifecycle

    @classmethod
    def create(
        cls,
        device_index: int,
        capacity_bytes: int,
        *,
        reserve_bytes: int = 0,
        name: str | None = None,
        generation: int = 0,
    ) -> DeviceBudget:
        """Create the budget of ``device_index``: limit = ``capacity_bytes - reserve_bytes`` (>= 0)."""
        _amount(device_index, "device_index")
        capacity = _amount(capacity_bytes, "capacity_bytes")
        reserve = _amount(reserve_bytes, "reserve_bytes")
        seg_name = name or new_segment_name(None, f"dev{device_index}")
        if not seg_name.startswith(SEGMENT_PREFIX):
            raise ValueError(f"segment name must start with {SEGMENT_PREFIX!r}: {seg_name!r}")
        seg = _shm.create(seg_name, SEGMENT_BYTES, keep_fd=True)  # size checked before touching
        try:
            buf = seg.buf
            _atomics.store(buf, _COUNTER + _atomics.F_LIMIT, max(0, capacity - reserve))
            _atomics.store(buf, _I_DEVICE, device_index)
            _atomics.store(buf, _I_CAPACITY, capacity)
            _atomics.store(buf, _I_RESERVE, reserve)
            _atomics.store(buf, _I_SLOTS, MAX_SLOTS)
            for i in range(MAX_SLOTS):
                _atomics.store(buf, _slot_off(i) + _atomics.F_LIMIT, 1)
            write_header(buf, KIND_DEVICE, f"device {device_index}", generation, SEGMENT_BYTES)
            return cls(seg, device_index, owner=True, slot=None)
        except BaseException:
            seg.close()
            seg.unlink()
            raise

    @classmethod
    def attach(cls, name: str, *, claim_slot: bool = True) -> DeviceBudget:
        """Attach without owning (never unlinks). A worker claims a slot (the default) so that
        the supervisor can return its share if it dies; a reader passes ``claim_slot=False``."""
        if not isinstance(name, str) or not name.startswith(SEGMENT_PREFIX) or "/" in name:
            raise SegmentError(str(name), f"not a device budget segment name (expected {SEGMENT_PREFIX}...)")
        seg = _attach(name, "does not exist (supervisor gone?)")
        try:
            check_header(name, seg.buf, KIND_DEVICE)
            if len(seg.buf) < _LAYOUT_BYTES or _atomics.load(seg.buf, _I_SLOTS) != MAX_SLOTS:
                raise SegmentError(name, "device budget layout does not match this build")
            device = _atomics.load(seg.buf, _I_DEVICE)
            slot = _claim_slot(name, seg.buf) if claim_slot else None
            return cls(seg, device, owner=False, slot=slot)
        except BaseException:
            seg.close()
            raise

    @property
    def slot(self) -> int | None:
        """The slot this process claimed (None for the owner and readers)."""
        return self._slot

    def __repr__(self) -> str:
        role = "owner" if self._owner else f"attached slot={self._slot}"
        return f"<DeviceBudget device={self.device_index} {self.name} {role}{' closed' if self._closed else ''}>"

    # ----------------------------------------------------------------- reads

    def _load(self, off: int) -> int:
        if self._closed:
            raise SegmentError(self.name, "device budget is closed")
        return _atomics.load(self._buf, off)

    @property
    def used_bytes(self) -> int:
        return self._load(_COUNTER)

    @property
    def limit_bytes(self) -> int:
        return self._load(_COUNTER + _atomics.F_LIMIT)

    @property
    def free_bytes(self) -> int:
        return max(0, self.limit_bytes - self.used_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self._load(_I_CAPACITY)

    @property
    def reserve_bytes(self) -> int:
        return self._load(_I_RESERVE)

    def snapshot(self) -> DeviceBudgetSnapshot:
        load = self._load
        holders = []
        for i in _claimed_slots(self._buf):
            off = _slot_off(i)
            if load(off):
                holders.append((i, load(off + _S_PID), load(off + _S_SHARE)))
        used, limit = load(_COUNTER), load(_COUNTER + _atomics.F_LIMIT)
        return DeviceBudgetSnapshot(
            name=self.name,
            device_index=self.device_index,
            capacity_bytes=load(_I_CAPACITY),
            reserve_bytes=load(_I_RESERVE),
            limit_bytes=limit,
            used_bytes=used,
            free_bytes=max(0, limit - used),
            high_water=load(_COUNTER + _atomics.F_HIGH_WATER),
            refusals=load(_COUNTER + _atomics.F_REFUSALS),
            underflows=load(_COUNTER + _atomics.F_UNDERFLOWS),
            holders=tuple(holders),
        )

    # ---------------------------------------------------------------- admin

    def set_capacity(self, capacity_bytes: int, reserve_bytes: int | None = None) -> None:
        """Change capacity (and reserve) live; lowering below use refuses until use falls."""
        capacity = _amount(capacity_bytes, "capacity_bytes")
        reserve = self.reserve_bytes if reserve_bytes is None else _amount(reserve_bytes, "reserve_bytes")
        if self._closed:
            raise SegmentError(self.name, "device budget is closed")
        _atomics.store(self._buf, _I_CAPACITY, capacity)
        _atomics.store(self._buf, _I_RESERVE, reserve)
        _atomics.store(self._buf, _COUNTER + _atomics.F_LIMIT, max(0, capacity - reserve))

    def reclaim_dead(self) -> list[tuple[int, int, int]]:
        """Return the share of every slot whose owner process is gone; ``[(slot, pid, bytes)]``.

        Reads ``/proc`` for every live owner: the supervisor's periodic safety
        net; a worker death it saw is reclaimed by :meth:`reclaim_pid`. A slot
        whose owner has not recorded its pid yet (it is between claiming and
        recording) is left alone.
        """
        if self._closed:
            raise SegmentError(self.name, "device budget is closed")
        buf = self._buf
        found = []
        for i in _claimed_slots(buf):
            off = _slot_off(i)
            if not _atomics.load(buf, off):
                continue
            pid = _atomics.load(buf, off + _S_PID)
            if pid == 0 or _owner_alive(pid, _atomics.load(buf, off + _S_START)):
                continue
            found.append((i, pid, self._free_dead(buf, off)))
        return found

    def reclaim_pid(self, pid: int) -> list[tuple[int, int, int]]:
        """Return the share of the slots owned by ``pid``, a process the supervisor saw die (it
        reaped it); as :meth:`reclaim_dead`.

        Called after a worker dies (its GPU memory was freed by the driver). Only
        that pid's ``/proc`` entry is read (a reused pid is told apart by its start
        time), not every live owner's: at tens of workers the full scan held the
        supervisor's loop for tens of ms at each death.
        """
        if self._closed:
            raise SegmentError(self.name, "device budget is closed")
        buf = self._buf
        found: list[tuple[int, int, int]] = []
        if pid <= 0:
            return found
        for i in _slots_of(buf, pid):
            off = _slot_off(i)
            if not _atomics.load(buf, off) or _atomics.load(buf, off + _S_PID) != pid:
                continue
            if _owner_alive(pid, _atomics.load(buf, off + _S_START)):
                continue
            found.append((i, pid, self._free_dead(buf, off)))
        return found

    def _free_dead(self, buf: memoryview, off: int) -> int:
        """Free the slot at ``off`` of a dead owner; its share (released from the counter)."""
        share = _atomics.exchange(buf, off + _S_SHARE, 0)
        if share:
            under = _atomics.release(buf, _COUNTER, share)
            if under is not None:
                log_event(_log, logging.WARNING, "device_budget.underflow", device=self.device_index,
                          released=share, in_use=under, segment=self.name)
        _atomics.store(buf, off + _S_PID, 0)
        _atomics.store(buf, off + _S_START, 0)
        _atomics.release(buf, off, 1)  # the slot is free again
        return share


def _claim_slot(name: str, buf: memoryview) -> int:
    """Claim the first free slot. The claim words are read in bulk first (a worker's bind claims
    one, and at 70 bound workers a load per claimed slot cost ~30 us of the bind); a slot seen
    free is then taken with a test-and-set, and one taken meanwhile is passed over."""
    pid = os.getpid()
    start = _process_start_ms(pid)
    words = buf[_SLOTS:_LAYOUT_BYTES].cast("Q")
    try:
        claims = words[::_LINE // 8].tolist()
    finally:
        words.release()
    i = -1
    while True:
        try:
            i = claims.index(0, i + 1)
        except ValueError:
            break
        off = _slot_off(i)
        if _atomics.consume(buf, off, 1) is None:  # test-and-set: we own slot i now
            _atomics.store(buf, off + _S_SHARE, 0)
            _atomics.store(buf, off + _S_START, start)
            _atomics.store(buf, off + _S_PID, pid)  # last: a pid means the start is valid
            return i
    raise SegmentError(name, f"all {MAX_SLOTS} slots are held by live workers")


