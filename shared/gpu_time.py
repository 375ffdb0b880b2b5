"""GPU-time shares: one lease board per device, scheduled lock-free in shared memory.

Without MPS, contexts of different processes never run kernels at the same
time: a device's time is a serial resource. Every launch a tenant makes
passes through our host functions, so the workers of all tenants on a device
take turns through this board, and each turn is charged exactly::

    worker (tenant t)                 board (shared memory, one per device)
    ─────────────────                 ──────────────────────────────────────
    acquire()  ── owner word == mine? ──► yes: run (fast path: one CAS, no syscall)
               ── else: mark waiting, try_acquire / futex_wait on the wake sequence
    op chunk (<= ~2 ms of device time)
    finish(ns) ── pass[t] += ns / weight[t]; used[t] += ns; cap bucket -= ns
               ── someone waits? ──► op end, host gaps long next to its ops: *lend* it now
                                     (a sibling first); else pick(): at the quantum's end
                                     min pass among eligible waiters *and* the holder, inside
                                     it only a waiter a quantum behind or one that lent it;
                                     hand the owner word over (CAS, then the grant), wake the grantee
    (guest code) an idle holder past its grace (4x its op length, >= 100 us) is stolen from;
               retaking an idle lease while others wait charges the idle span to its pass
    release()  ── end of the run: hand over (or free) the device

The policy is stride scheduling on ``used / weight`` ("pass", in ns at weight
1) with a quantum: the holder keeps the device for at least one quantum, then
at the next chunk boundary the device goes to the runnable tenant with the
smallest pass. Idle tenants are skipped (only waiters are candidates), so the
policy is work-conserving; a tenant returning from idle gets its pass raised to
at least ``vclock - quantum / weight`` (``vclock``: the pass of the last tenant
granted the device, or of the holder while it runs alone), so being idle banks
at most one quantum of priority. A tenant with a
``cap`` is not runnable while its token bucket (refilled at ``cap`` device
seconds per second, burst four quanta) is empty - a hard, non-work-conserving
ceiling.

Every decision is made by whoever sees the device change hands: the holder
at a chunk boundary, a waiter that finds the device free or held idle past
the holder's grace (it may *steal* it: the holder is between ops, in guest
code), or the supervisor when the holder died. Why lending, stealing and the
idle charge (a chatty tenant held an idle device and a heavy one got 5-7 %
of it): docs/GPU-QUOTAS.md, "Tenants that differ".

Mode ``off`` (``gpu_time_scheduler = false``) keeps the same leases and
quanta but picks the longest-waiting worker, whatever its weight, and ignores
caps: the driver's own time-slicing of contexts, the benchmark's baseline. All scheduler state is written only
by the current holder (or by the one process that just won the owner word
with a CAS), so the only atomic read-modify-writes are the owner word, the
waiting count and each worker's own waiting stamp. No supervisor round trip
per quantum: ``twt bench share`` measures both costs (docs/GPU-QUOTAS.md).

Owner word: ``0`` free, else ``(worker slot + 1) << 1 | busy``; ``busy`` is set
while a chunk runs. Waiters sleep with a futex (``_atomics.futex_wait_bits``, GIL
released, so the worker's heartbeats go on) on a wake sequence that grows
each time the owner word changes hands, each with its worker's wake bit: a
change of hands wakes only the worker it names (see :func:`_wake`); their timeout is
the holder's quantum end, when they may steal an idle lease; the one next
up yields the CPU in a loop from about a chunk before that end, so that it is
running when the device passes to it.

Layout (``uint64`` words; lines 0-1 are :mod:`shared.quota`'s header and label)::

    line 2        control  owner | grant ns | vclock | waiting | grants | steals | handoffs | workers high
    line 3        config   device | quantum ns | mode (1 on, 0 off) | tenant slots T | worker slots W |
                           last chunk end ns | wake sequence | tenants high (max slot ever used + 1)
    line 4        lease    busy since ns (when the running chunk began: written by the worker that set the
                           busy bit, read by the supervisor when that worker dies mid-chunk) | layout mark |
                           handover gap ns | handovers timed (the device idle from a grant another
                           process made to the grantee's first chunk: what a handover costs) |
                           held idle ns (the device held idle before each steal: from the holder's
                           last chunk end, or its grant, to the steal)
    line 5+t      tenant t active | weight (1e-6) | cap (ppm, 0 none) | pass | used ns | credit (+2**62) |
                           credit stamp ns | throttled
    line 5+T+w    worker w claimed | pid | start ms | tenant + 1 | waiting since ns | idle charged ns |
                           lent (gave the device up for host work) | grace ns

Capacity: the owner sizes the board (``tenants``, ``workers``: the supervisor takes them from
its config, ``max_tenants`` and ``max_workers``); a worker reads T and W from line 3. Every scan
is bounded by a high-water mark, not by the capacity: ``workers high`` (one past the highest
worker slot ever claimed) for :meth:`GpuTimeBoard.pick` and the death sweep, ``tenants high``
for snapshots and slot allocation - a board of 4,096 tenant slots costs a launch what a board
of 64 does (``tests/shared/test_gpu_time.py``, docs/PERFORMANCE.md). Its /dev/shm memory is
reserved for the header, the worker lines and the first ``TENANT_RESERVE_CHUNK`` tenant lines at
creation, and for the next chunk when ``tenants high`` reaches it (:meth:`GpuTimeBoard.add_tenant`:
a full /dev/shm refuses that slot, never a SIGBUS later): a board sized for 32,768 tenants costs a
supervisor's start what one of 2,048 does.

Death: a worker that dies holding the device loses it as soon as the
supervisor sees the death (:meth:`GpuTimeBoard.reclaim_dead`, called where
the quota shares are reclaimed); a hung op is bounded by the run's deadline,
after which the supervisor kills the worker. A worker killed mid-chunk never
reports that chunk, so the reclaim charges its tenant the time from the
chunk's start (the lease line's ``busy since``) to the reclaim, at most one
quantum: the device may have run it all that time (a kernel is not stopped by
its process's death before the context is torn down), and a tenant must not
get device time free by dying inside its chunks.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import EllipsisType
from typing import TYPE_CHECKING, Final, Protocol

from shared import _atomics, _shm
from shared._segment import MappedSegment
from shared.checks import is_int, is_number
from shared.errors import InvalidArgument, SegmentError
from shared.quota import (
    KIND_GPU_TIME,
    SEGMENT_BYTES as QUOTA_SEGMENT_BYTES,
    SEGMENT_PREFIX,
    _attach,
    _owner_alive,
    _process_start_ms,
    check_header,
    new_segment_name,
    write_header,
)

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

__all__ = [
    "DEFAULT_QUANTUM_S",
    "GatedLaunch",
    "KIND_GPU_TIME",
    "DEFAULT_TENANT_SLOTS",
    "DEFAULT_WORKER_SLOTS",
    "LIMIT_TENANT_SLOTS",
    "LIMIT_WORKER_SLOTS",
    "MAX_WEIGHT",
    "GpuTimeBoard",
    "GpuTimeSnapshot",
    "check_gpu_time_cap",
    "check_gpu_time_weight",
]

#: the default lease: a handoff costs ~0.1 ms on an idle host, up to ~1 ms on a loaded one: 10 ms keeps
#: that under 3 %, and a light tenant still waits at most ~2 quanta
DEFAULT_QUANTUM_S: Final = 0.010
#: a board's size when the creator names none (tests, tools); the supervisor sizes it from its config
DEFAULT_TENANT_SLOTS: Final = 64
DEFAULT_WORKER_SLOTS: Final = 256
#: the largest board: 2**17 tenants and 2**18 workers (a 24 MiB segment)
LIMIT_TENANT_SLOTS: Final = 1 << 17
LIMIT_WORKER_SLOTS: Final = 1 << 18
MAX_WEIGHT: Final = 1e6
_MICRO: Final = 1_000_000
_BIAS: Final = 1 << 62
_MASK32: Final = 0xFFFFFFFF
#: tenant lines get their /dev/shm memory this many at a time, as ``tenants high`` reaches them: a board
#: sized for 2 x max_tenants (32,768 slots, 2 MiB at the default) reserves 64 KiB of them at its start
TENANT_RESERVE_CHUNK: Final = 1024
_ADD_MINUS_ONE: Final = (1 << 64) - 1

_LINE = 64
_CTRL = 2 * _LINE
_OWNER, _GRANT_NS, _VCLOCK, _WAITING, _GRANTS, _STEALS, _HANDOFFS, _HIGH = (_CTRL + 8 * i for i in range(8))
_CONF = 3 * _LINE
_C_DEVICE, _C_QUANTUM, _C_MODE, _C_TENANTS, _C_WORKERS, _LAST_END, _SEQ, _T_HIGH = (_CONF + 8 * i for i in range(8))
_LEASE = 4 * _LINE
_BUSY_SINCE, _LAYOUT_MARK, _GAP_NS, _GAP_N, _STOLEN_IDLE_NS = (_LEASE + 8 * i for i in range(5))
#: this build's board layout, written by its creator and checked by every attach: a worker of another
#: build (an in-place upgrade while a supervisor runs) must not read tenant lines at the wrong offsets.
#: "twtgt" and a version: larger than any weight word, which a board without this line has there
_LAYOUT = (0x7477_7467_74 << 16) | 2
_TENANTS = 5 * _LINE
_T_ACTIVE, _T_WEIGHT, _T_CAP, _T_PASS, _T_USED, _T_CREDIT, _T_STAMP, _T_THROTTLED = (8 * i for i in range(8))
_W_CLAIMED, _W_PID, _W_START, _W_TENANT, _W_WAITING, _W_IDLE, _W_LENT, _W_GRACE = (8 * i for i in range(8))
#: the gap estimate (EWMA) starts at 0: a new worker is assumed busy until it shows host gaps
_GAP_EWMA_SHIFT = 2


def _layout_bytes(tenants: int, workers: int) -> int:
    """Bytes of a board with ``tenants`` tenant slots and ``workers`` worker slots (before page rounding)."""
    return _TENANTS + (tenants + workers) * _LINE


def segment_bytes(tenants: int = DEFAULT_TENANT_SLOTS, workers: int = DEFAULT_WORKER_SLOTS) -> int:
    """The segment size of a board of that capacity (whole pages; at least a quota segment's, whose
    header check every segment of ours passes)."""
    return max(QUOTA_SEGMENT_BYTES, (_layout_bytes(tenants, workers) + 4095) // 4096 * 4096)


SEGMENT_BYTES: Final = segment_bytes()

#: a waiter's longest sleep between looks at the board (a lost wake-up costs at most this)
_MAX_SLEEP_NS = 20_000_000
_MIN_SLEEP_NS = 50_000
#: a holder idle (in guest code, no chunk running) this long after its op may lose the device to
#: any waiter, whatever the passes and the quantum: a lease is never held through a tenant's host
#: work while another waits; a next op already on its way (a GEMM loop's next call, ~10-50 us
#: through the WASM host) comes within it
_HANDOVER_GRACE_NS = 100_000
#: a holder whose host gap between ops (an average) is longer than this hands the device over at
#: an op's end when another worker waits, rather than hold it idle until stolen from: below the
#: grace, so a tenant looping with 0.1 ms of host work between ops lends it; a GEMM loop through
#: the WASM host (~20-60 us between ops on a loaded 2-core host) keeps it
_LEND_GAP_NS = 75_000
#: a sibling (an instance of the holder's tenant) takes the device at a quantum's end once it has
#: waited this many quanta: a rotation costs the device a wake-up, instances need no finer turns
_SIBLING_WAIT_QUANTA = 4
#: a waiter looks at a held device at least this often (an idle holder past its grace is stolen from)
_POLL_NS = 1_000_000
#: inside the holder's quantum a waiter with a claim (it lent the device, or is a quantum behind) takes
#: it at the holder's last chunk boundary before it would have waited this fraction of a quantum (the
#: holder's next chunk, as long as its recent ones, would end past it), not at the very next boundary:
#: its ops queue meanwhile (worker.device_time) and run as one stretch, so the holder pays one handover
#: per batch instead of one per chunk, and the claimant's op still waits under one quantum (this
#: fraction, a wake-up, and a quarter of a quantum of margin for a holder descheduled mid-chunk). Each
#: batch costs the device two wake-ups (~120 us each on a 2-core host): a claim served at a quarter of
#: a quantum gave a chatty tenant ~270 batches a second, at half ~170 (4 % of the device idle)
_CLAIM_SERVE_NUM, _CLAIM_SERVE_DEN = 3, 4
#: a busy holder whose grace is at most this fraction of a quantum runs short stretches (a chatty
#: tenant): the policy's pick yields the CPU in a loop instead of sleeping, to take the device at once
_SHORT_HOLD_QUANTUM_DIV = 8
#: a capped tenant's token bucket holds this many quanta: over any span W it gets at most
#: ``cap * W`` plus this burst; a bucket of one quantum lost credit to every wake-up that came late
_CAP_BURST_QUANTA = 4
#: the next holder stops sleeping this long before the holder's quantum ends and yields the CPU
#: in a loop instead (about one chunk), at most _MAX_SPIN times per wait
_SPIN_NS = 2_000_000
_MAX_SPIN = 20_000

#: a directory in this variable turns the handover trace on (:class:`HandoverTrace`; off by default)
HANDOVER_TRACE_ENV: Final = "TWT_HANDOVER_TRACE"


class HandoverTrace:
    """Timestamps of every handover, from both sides, for measuring where its device idle goes.

    On only where :data:`HANDOVER_TRACE_ENV` names a directory when a worker attaches (a tool
    sets it: ``twt bench share --mix --handover-trace DIR``); off, each hook costs one ``is None``.
    Each process appends rows to ``DIR/<pid>.handover`` (CLOCK_MONOTONIC ns, which every process
    shares), flushed every :attr:`FLUSH` rows and at exit; a process killed loses its unflushed tail.
    Rows (``grant`` joins the two sides: the board's grant stamp, which the giver writes and the
    grantee reads on success)::

        G grant cas woken last_end chunk_end giver nxt kind   giver: its CAS won at ``cas``, the wake
                                                              syscall returned at ``woken``; ``kind`` h
                                                              (handoff) or s (a steal for ``nxt``)
        A grant wait0 wake acq slot wakes                     grantee: waited from ``wait0``; its last
                                                              futex return ``wake``; holds it at ``acq``
        L grant launch slot                                   grantee: its first op's launch began
        S wake slot                                           a futex return that did not acquire

    :func:`supervisor.tools.bench.share.handover_legs` joins them into the legs of a handover.
    """

    FLUSH = 2048

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, f"{os.getpid()}.handover")
        self.rows: list[tuple[object, ...]] = []
        #: the device thread's last chunk end (set by the gate; a giver's G row carries it)
        self.chunk_end = 0
        #: a grant this worker waited for whose first launch is not recorded yet (0: none)
        self.pending_grant = 0
        import atexit

        atexit.register(self.flush)

    @classmethod
    def from_env(cls) -> HandoverTrace | None:
        directory = os.environ.get(HANDOVER_TRACE_ENV, "")
        return cls(directory) if directory and os.path.isdir(directory) else None

    def add(self, *row: object) -> None:
        self.rows.append(row)
        if len(self.rows) >= self.FLUSH:
            self.flush()

    def launch(self, slot: int, now: int) -> None:
        """The device thread begins a launch: the first since a grant it waited for closes that grant."""
        if self.pending_grant:
            self.add("L", self.pending_grant, now, slot)
            self.pending_grant = 0

    def flush(self) -> None:
        rows, self.rows = self.rows, []
        if rows:
            try:
                with open(self.path, "a", encoding="ascii") as f:
                    f.write("".join(" ".join(map(str, r)) + "\n" for r in rows))
            except OSError:
                pass  # a trace is a measurement aid: a full disk loses rows, never an op


#: a directory in this variable turns the work trace on (:class:`WorkTrace`; off by default)
WORK_TRACE_ENV: Final = "TWT_WORK_TRACE"


class WorkTrace:
    """Per worker, when it had device work and when the device ran it: the intervals whose unions
    across workers say how busy the device was *while any tenant had work* (``twt bench share --mix``).

    On only where :data:`WORK_TRACE_ENV` names a directory when a worker attaches (``twt bench
    share --mix`` sets it); off, each hook in the gate costs one ``is None``. A row is three
    little-endian int64 (kind, start ns, end ns; CLOCK_MONOTONIC, which every process shares),
    appended to ``DIR/<pid>.work``; rows are written at each run's end (the gate's ``release``),
    every :attr:`FLUSH` rows, and at exit. Kinds:

    * :data:`WORK` - the worker had an op its guest submitted that had not finished: from the
      submit into an empty queue (or a synchronous op's call) until the queue ran empty again
      (or the op returned): queued, waiting for the lease and on the device all count.
    * :data:`BUSY` - the device ran this worker's work: on a backend whose device is the host's
      CPU (the stub), each launch's charged time (the device thread's CPU time) ending at the
      launch's end; on cuda, each settled chunk's event time placed at its launch, after the
      chunk before it on the stream.
    * :data:`LAUNCH` - a host-synchronous launch's wall span (the stub; a sync op): the device
      held and in a launch. On the stub the span less its busy time is the device thread waiting
      for a core (the host's CPUs, not the lease); not written for cuda's asynchronous launches.
    * :data:`CORE` - as :data:`BUSY`, for a chunk the stub's executor ran on its device's one CPU
      (``stub_device_cpus``): every worker's executor of that device shares the CPU, so no two such
      rows ran at once, and a reader lays overlapping ones end to end (each is its CPU time placed at
      its launch's end: two executors sharing the core - a giver's last launched chunk beside the
      grantee's first - would otherwise overlap and their union count less than the core ran).
    """

    WORK: Final = 0
    BUSY: Final = 1
    LAUNCH: Final = 2
    CORE: Final = 3
    FLUSH = 3 * 8192

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, f"{os.getpid()}.work")
        self.rows = array("q")
        self._lock = threading.Lock()
        import atexit

        atexit.register(self.flush)

    @classmethod
    def from_env(cls) -> WorkTrace | None:
        directory = os.environ.get(WORK_TRACE_ENV, "")
        return cls(directory) if directory and os.path.isdir(directory) else None

    def add(self, *rows: int) -> None:
        """Intervals, each ``kind, start ns, end ns`` (one call for a launch's two rows: ~0.9 us a
        call). The executor and device threads both add: under a lock, so that a flush on the other
        thread never takes the array from under a row."""
        with self._lock:
            kept = self.rows
            kept.extend(rows)
            full = len(kept) >= self.FLUSH
        if full:
            self.flush()

    def flush(self) -> None:
        """Append the rows kept so far to the file (never raises: a full disk loses rows, never an op)."""
        with self._lock:
            rows, self.rows = self.rows, array("q")
            if not rows:
                return
            try:
                if sys.byteorder != "little":
                    rows.byteswap()
                with open(self.path, "ab") as f:
                    rows.tofile(f)
            except OSError:
                pass


def read_work_trace(directory: str) -> dict[int, NDArray[np.int64]]:
    """Every :class:`WorkTrace` row in ``directory``: the intervals of each kind (``WorkTrace.WORK``,
    ``BUSY``, ``LAUNCH``, ``CORE``; all workers together) as (n, 2) arrays of (start, end) ns - a full
    ``twt bench share --mix`` writes millions; a file's last row cut short (a worker killed while it
    wrote) is left out, and so is a backwards row or one of an unknown kind. numpy is imported here,
    by the bench, never by a worker."""
    import glob

    import numpy

    parts: dict[int, list[NDArray[np.int64]]] = {WorkTrace.WORK: [], WorkTrace.BUSY: [], WorkTrace.LAUNCH: [],
                                                 WorkTrace.CORE: []}
    for path in glob.glob(os.path.join(directory, "*.work")):
        with open(path, "rb") as f:
            data = f.read()
        rows = numpy.frombuffer(data[:len(data) // 24 * 24], dtype="<i8").reshape(-1, 3).astype(numpy.int64)
        for kind, kept in parts.items():
            mine = rows[(rows[:, 0] == kind) & (rows[:, 2] >= rows[:, 1])]
            kept.append(mine[:, 1:])
    return {kind: numpy.concatenate(kept) if kept else numpy.empty((0, 2), numpy.int64)
            for kind, kept in parts.items()}


class GatedLaunch(Protocol):
    """A launch made before a wait for the lease, started by the device itself the moment the owner
    word names its worker (the stub's executor: ``worker.backends.stub_executor``). :meth:`GpuTimeBoard.acquire`
    arms it once its fast path failed and resolves it when the wait is over."""

    def arm(self, buf: memoryview, owner_off: int, busy_off: int, mine: int) -> bool:
        """Launch, gated on the uint64 owner word at ``buf[owner_off]``: started only under ``mine | 1``
        (a grant's ``mine`` taken busy with a CAS of the device's own, ``buf[busy_off]`` stamped then).
        False: not launched (the caller launches after the wait, as without a gate)."""
        ...

    def resolve(self, *, cancel: bool) -> bool:
        """The wait is over (``cancel``: refused). Whether the launch runs: with ``cancel``, True means
        the device took the lease for it first - the waiter holds it busy after all."""
        ...


def _t_off(t: int) -> int:
    return _TENANTS + t * _LINE


def _slots(value: object, key: str, limit: int) -> int:
    if not is_int(value) or not 1 <= value <= limit:
        raise ValueError(f"{key} must be an int in 1..{limit}, got {value!r}")
    return value


def check_gpu_time_weight(value: object, key: str = "gpu_time_weight") -> float:
    """A valid weight (a number > 0 and <= 1e6) as a float; :class:`InvalidArgument` naming ``key``."""
    if not is_number(value):
        raise InvalidArgument(f"{key} must be a number > 0, not {type(value).__name__}")
    number = float(value)
    if not (math.isfinite(number) and 0 < number <= MAX_WEIGHT):
        raise InvalidArgument(f"{key} must be a number in (0, {MAX_WEIGHT:g}], got {value!r}")
    return number


def check_gpu_time_cap(value: object, key: str = "gpu_time_cap") -> float | None:
    """A valid cap (None, or a fraction in (0, 1]) as a float; :class:`InvalidArgument` naming ``key``."""
    if value is None:
        return None
    if not is_number(value):
        raise InvalidArgument(f"{key} must be a fraction in (0, 1] or none, not {type(value).__name__}")
    number = float(value)
    if not (math.isfinite(number) and 0 < number <= 1):
        raise InvalidArgument(f"{key} must be a fraction in (0, 1] or none, got {value!r}")
    return number


def _weight_micro(weight: float) -> int:
    return max(1, round(weight * _MICRO))


def _cap_ppm(cap: float | None) -> int:
    return 0 if cap is None else max(1, round(cap * _MICRO))


@dataclass(frozen=True)
class GpuTimeSnapshot:
    """A board at one moment: the lease, and per tenant slot its policy and accounted time."""

    name: str
    device_index: int
    scheduler: bool
    quantum_s: float
    #: worker slot holding the device (None: free) and whether a chunk runs right now
    holder: int | None
    #: the holding worker's pid (0 when free)
    holder_pid: int
    busy: bool
    waiting: int
    grants: int
    steals: int
    handoffs: int
    #: tenant slot -> {weight, cap, used_ns, pass, throttled}
    tenants: dict[int, dict[str, float | None]]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class GpuTimeBoard(MappedSegment):
    """The lease board of one device; see the module docstring.

    :meth:`create` (the supervisor: the owner, which sets tenant policies and
    reclaims dead workers) or :meth:`attach` (a worker: claims a worker slot
    for its tenant slot and takes leases; or a reader with ``tenant_slot=None``).
    ``clock`` (ns, monotonic, the same in every process: CLOCK_MONOTONIC) is
    injectable so that the policy is tested on a fake clock.
    """

    _what = "gpu time board"

    def __init__(self, segment: _shm.Segment, device_index: int, *, owner: bool, worker: int | None,
                 tenant: int | None, clock: Callable[[], int]) -> None:
        """Internal: use :meth:`create` or :meth:`attach`."""
        self._map(segment, owner=owner)
        self.device_index = device_index
        #: the board's capacity (line 3): tenant slots, worker slots; worker lines follow the tenant lines
        self.tenant_slots = _atomics.load(self._buf, _C_TENANTS)
        self.worker_slots = _atomics.load(self._buf, _C_WORKERS)
        self._wbase = _TENANTS + self.tenant_slots * _LINE
        self._worker = worker
        self._tenant = tenant
        self._clock = clock
        self._mine = 0 if worker is None else (worker + 1) << 1
        self._waiting_since = 0
        #: tenant lines below this have their memory (the owner reserves more in :meth:`add_tenant`)
        self.reserved_tenants = self.tenant_slots
        #: owner: every tenant slot below this is active (where :meth:`add_tenant` starts looking)
        self._free_from = 0
        #: this worker's last chunk end (0: none since its last op began), whether that chunk's op
        #: goes on (more chunks follow), and its host gap between ops (EWMA, ns): see finish()
        self._last_end = 0
        self._op_open = False
        self._gap_ns = 0
        #: this worker's device time per op (EWMA, ns; the chunks of one op summed) and the op so far
        self._op_ns = 0
        self._op_sum = 0
        #: this worker's chunks' wall time, start to end (EWMA, ns)
        self._chunk_ns = 0
        self._grace_ns = 0
        #: the grant under which this worker last started a chunk (a new one at a chunk start: the
        #: device was handed to it by another process since, and the gap is timed)
        self._grant_seen = 0
        #: this holder's last :meth:`finish` inside its quantum passed nothing on, and no boundary can
        #: before this time while as many workers wait under the same grant (see :meth:`quiet`): the
        #: quantum's end, or before it the earliest claim of another tenant's waiter could come due
        self._quiet_until = 0
        self._quiet_waiting = 0
        self._quiet_grant = 0
        #: the last :meth:`pick` with a holder: when the longest-waiting worker of another tenant began
        #: to wait (0: only the holder's own tenant's workers wait; -1: not known)
        self._claim_from = -1
        #: the last :meth:`pick`'s choice with the holder left out (-1: none eligible): the waiter a holder
        #: that keeps the device idle wakes (:meth:`finish`)
        self._best = -1
        #: a waiter may yield the CPU in a loop to be running when the device passes to it (see
        #: :meth:`acquire`). False where the device *is* this host's CPU (the stub): a spinning waiter
        #: is then a third runnable thread beside the holder's device thread and the guests, and
        #: takes its CPU share from the device itself (set by the worker's gate)
        self.spin = True
        #: the handover trace (None: off; see :class:`HandoverTrace`)
        self.trace: HandoverTrace | None = HandoverTrace.from_env() if worker is not None else None
        #: the work trace (None: off; see :class:`WorkTrace`)
        self.work: WorkTrace | None = WorkTrace.from_env() if worker is not None else None
        self._bind_counters()

    # ------------------------------------------------------------ lifecycle

    @classmethod
    def create(cls, device_index: int, *, quantum_s: float = DEFAULT_QUANTUM_S, scheduler: bool = True,
               name: str | None = None, generation: int = 0, tenants: int = DEFAULT_TENANT_SLOTS,
               workers: int = DEFAULT_WORKER_SLOTS,
               clock: Callable[[], int] = time.monotonic_ns) -> GpuTimeBoard:
        """The board of ``device_index`` with ``tenants`` tenant slots and ``workers`` worker slots
        (this process owns it and must :meth:`unlink` it)."""
        if isinstance(device_index, bool) or not isinstance(device_index, int) or device_index < 0:
            raise ValueError(f"device_index must be an int >= 0, got {device_index!r}")
        quantum_ns = _quantum_ns(quantum_s)
        tenants = _slots(tenants, "tenants", LIMIT_TENANT_SLOTS)
        workers = _slots(workers, "workers", LIMIT_WORKER_SLOTS)
        seg_name = name or new_segment_name(None, f"gt{device_index}")
        if not seg_name.startswith(SEGMENT_PREFIX):
            raise ValueError(f"segment name must start with {SEGMENT_PREFIX!r}: {seg_name!r}")
        size = segment_bytes(tenants, workers)
        reserved = min(tenants, TENANT_RESERVE_CHUNK)
        # the header, the first chunk of tenant lines and every worker line now; more tenant lines as used
        seg = _shm.create(seg_name, size, reserve=((0, _t_off(reserved)), (_t_off(tenants), workers * _LINE)))
        try:
            buf = seg.buf
            _atomics.store(buf, _C_DEVICE, device_index)
            _atomics.store(buf, _C_QUANTUM, quantum_ns)
            _atomics.store(buf, _C_MODE, 1 if scheduler else 0)
            _atomics.store(buf, _C_TENANTS, tenants)
            _atomics.store(buf, _C_WORKERS, workers)
            _atomics.store(buf, _LAYOUT_MARK, _LAYOUT)
            write_header(buf, KIND_GPU_TIME, f"gpu time {device_index}", generation, size)
            board = cls(seg, device_index, owner=True, worker=None, tenant=None, clock=clock)
            board.reserved_tenants = reserved
            return board
        except BaseException:
            seg.close()
            seg.unlink()
            raise

    @classmethod
    def attach(cls, name: str, *, tenant_slot: int | None,
               clock: Callable[[], int] = time.monotonic_ns) -> GpuTimeBoard:
        """Attach without owning. With ``tenant_slot`` (a worker) a worker slot is claimed,
        recorded with this process's pid so the supervisor frees it when the process dies."""
        if not isinstance(name, str) or not name.startswith(SEGMENT_PREFIX) or "/" in name:
            raise SegmentError(str(name), f"not a gpu time board name (expected {SEGMENT_PREFIX}...)")
        seg = _attach(name, "does not exist (supervisor gone?)")
        try:
            check_header(name, seg.buf, KIND_GPU_TIME)
            buf = seg.buf
            tenants = _atomics.load(buf, _C_TENANTS) if len(buf) >= _TENANTS else 0
            workers = _atomics.load(buf, _C_WORKERS) if len(buf) >= _TENANTS else 0
            if not (1 <= tenants <= LIMIT_TENANT_SLOTS and 1 <= workers <= LIMIT_WORKER_SLOTS
                    and len(buf) >= _layout_bytes(tenants, workers) and _atomics.load(buf, _LAYOUT_MARK) == _LAYOUT):
                raise SegmentError(name, "gpu time board layout does not match this build")
            device = _atomics.load(buf, _C_DEVICE)
            worker = None
            if tenant_slot is not None:
                if not 0 <= tenant_slot < tenants:
                    raise ValueError(f"tenant slot {tenant_slot} out of range 0..{tenants - 1}")
                worker = _claim_worker(name, buf, tenant_slot, _TENANTS + tenants * _LINE, workers)
            return cls(seg, device, owner=False, worker=worker, tenant=tenant_slot, clock=clock)
        except BaseException:
            seg.close()
            raise

    def close(self) -> None:
        """Give the device back if held, free this worker's slot, unmap."""
        if self._closed:
            return
        if self._worker is not None:
            try:
                self.release()
                off = self._w_off(self._worker)
                _atomics.store(self._buf, off + _W_TENANT, 0)
                _atomics.store(self._buf, off + _W_PID, 0)
                _atomics.store(self._buf, off + _W_CLAIMED, 0)
            except (SegmentError, ValueError):
                pass
        super().close()

    def __repr__(self) -> str:
        role = "owner" if self._owner else f"worker={self._worker} tenant={self._tenant}"
        return f"<GpuTimeBoard device={self.device_index} {self.name} {role}{' closed' if self._closed else ''}>"

    def _w_off(self, w: int) -> int:
        return self._wbase + w * _LINE

    def _tenant_index(self, tenant: object) -> int:
        if not is_int(tenant) or not 0 <= tenant < self.tenant_slots:
            raise ValueError(f"tenant slot must be an int in 0..{self.tenant_slots - 1}, got {tenant!r}")
        return tenant

    @property
    def worker_slot(self) -> int | None:
        return self._worker

    @property
    def tenant_slot(self) -> int | None:
        return self._tenant

    def _check(self) -> memoryview:
        if self._closed:
            raise SegmentError(self.name, "gpu time board is closed")
        return self._buf

    # ------------------------------------------------------------- settings

    @property
    def scheduler(self) -> bool:
        return _atomics.load(self._check(), _C_MODE) == 1

    @property
    def quantum_ns(self) -> int:
        return _atomics.load(self._check(), _C_QUANTUM)

    def configure(self, *, quantum_s: float | None = None, scheduler: bool | None = None) -> None:
        """Change the quantum or the mode live (owner)."""
        buf = self._check()
        if quantum_s is not None:
            _atomics.store(buf, _C_QUANTUM, _quantum_ns(quantum_s))
        if scheduler is not None:
            _atomics.store(buf, _C_MODE, 1 if scheduler else 0)
        _wake(buf)

    # ------------------------------------------------------ tenants (owner)

    def free_tenant_slots(self) -> int:
        """Tenant slots :meth:`add_tenant` could give out now (owner; O(slots used))."""
        buf = self._check()
        high = _atomics.load(buf, _T_HIGH)
        named = self._named_tenants(buf)
        used = sum(1 for t in range(high) if _atomics.load(buf, _t_off(t) + _T_ACTIVE) or t in named)
        return self.tenant_slots - used

    def _named_tenants(self, buf: memoryview) -> set[int]:
        """Tenant slots a claimed worker still names (a stopping worker of an evicted tenant)."""
        high = _atomics.load(buf, _HIGH)
        words = buf[self._wbase:self._wbase + high * _LINE].cast("Q")
        try:
            step = _LINE // 8
            return {words[w * step + 3] - 1 for w in range(high) if words[w * step]}
        finally:
            words.release()

    def add_tenant(self, weight: float = 1.0, cap: float | None = None) -> int:
        """A free tenant slot, set to ``weight`` and ``cap``; SegmentError when all are taken.

        O(slots used), not O(capacity): slots below ``tenants high`` are reused
        first, then the next never-used one is taken.
        """
        buf = self._check()
        w, c = _weight_micro(check_gpu_time_weight(weight)), _cap_ppm(check_gpu_time_cap(cap))
        named = self._named_tenants(buf)  # a slot an evicted tenant's stopping worker still names is not given out yet
        high = _atomics.load(buf, _T_HIGH)
        # the scan starts at the lowest slot that may be free (every one below it is active): a
        # restore of 10,000 tenants is then O(n), not O(n^2)
        start = min(self._free_from, high)
        for t in range(start, min(high + 1, self.tenant_slots)):
            off = _t_off(t)
            if _atomics.load(buf, off + _T_ACTIVE) or t in named:
                if t == start and t not in named:
                    start += 1
                continue
            if t == high:
                if t >= self.reserved_tenants:  # SegmentError (nothing changed) when /dev/shm is full
                    more = min(TENANT_RESERVE_CHUNK, self.tenant_slots - self.reserved_tenants)
                    _shm.reserve(self.name, _t_off(self.reserved_tenants), more * _LINE)
                    self.reserved_tenants += more
                _atomics.store(buf, _T_HIGH, high + 1)
            now = self._clock()
            for field, value in ((_T_WEIGHT, w), (_T_CAP, c), (_T_PASS, _atomics.load(buf, _VCLOCK)),
                                 (_T_USED, 0), (_T_CREDIT, _BIAS + _CAP_BURST_QUANTA * self.quantum_ns), (_T_STAMP, now),
                                 (_T_THROTTLED, 0)):
                _atomics.store(buf, off + field, value)
            _atomics.store(buf, off + _T_ACTIVE, 1)
            self._free_from = start + 1 if t == start else start
            return t
        self._free_from = start
        raise SegmentError(self.name, f"all {self.tenant_slots} tenant slots of device {self.device_index} are taken")

    def set_policy(self, tenant: int, *, weight: float | None = None, cap: float | None | EllipsisType = ...) -> None:
        """Change a tenant slot's weight and/or cap live (``cap=None`` removes it; omitted: unchanged)."""
        buf = self._check()
        off = _t_off(self._tenant_index(tenant))
        if weight is not None:
            _atomics.store(buf, off + _T_WEIGHT, _weight_micro(check_gpu_time_weight(weight)))
        if cap is not ...:
            _atomics.store(buf, off + _T_CAP, _cap_ppm(check_gpu_time_cap(cap)))
        _wake(buf)  # a throttled waiter re-reads its cap

    def remove_tenant(self, tenant: int) -> None:
        """Free a tenant slot (its workers are gone: evicted)."""
        buf = self._check()
        _atomics.store(buf, _t_off(self._tenant_index(tenant)) + _T_ACTIVE, 0)
        self._free_from = min(self._free_from, tenant)

    def policy(self, tenant: int) -> tuple[float, float | None]:
        """(weight, cap) of a tenant slot."""
        buf = self._check()
        off = _t_off(self._tenant_index(tenant))
        cap = _atomics.load(buf, off + _T_CAP)
        return _atomics.load(buf, off + _T_WEIGHT) / _MICRO, (cap / _MICRO if cap else None)

    def used_ns(self, tenant: int) -> int:
        return _atomics.load(self._check(), _t_off(self._tenant_index(tenant)) + _T_USED)

    # ------------------------------------------------------------ the policy

    def _credit(self, buf: memoryview, t_off: int, cap: int, now: int) -> int:
        """The cap bucket of a tenant at ``now``: refilled at ``cap`` ppm, at most a few quanta."""
        credit = _atomics.load(buf, t_off + _T_CREDIT) - _BIAS
        stamp = _atomics.load(buf, t_off + _T_STAMP)
        burst = _CAP_BURST_QUANTA * _atomics.load(buf, _C_QUANTUM)
        return min(burst, credit + max(0, now - stamp) * cap // _MICRO)

    def _effective_pass(self, buf: memoryview, t_off: int, vclock: int, quantum: int) -> int:
        weight = _atomics.load(buf, t_off + _T_WEIGHT) or 1
        return max(_atomics.load(buf, t_off + _T_PASS), vclock - quantum * _MICRO // weight)

    def pick(self, now: int, *, holder_tenant: int | None = None, quantum_over: bool = True,
             prefer_tenant: int | None = None, next_ns: int = 0) -> int | None:
        """The waiting worker slot whose tenant should run next, or None.

        Candidates: workers waiting for this device whose tenant is not held
        back by its cap. The tenant with the smallest effective pass
        wins (ties: the longest waiting); among its workers the longest
        waiting. With ``holder_tenant`` (the holder at a chunk boundary) that
        tenant competes too, and None means "the holder keeps it":

        - its quantum over (``quantum_over``): the holder keeps the device while
          its pass is the smallest, except against a sibling (an instance of the
          same tenant: the same pass, a tie that would keep the holder for ever):
          siblings rotate by quanta;
        - inside its quantum: only a waiter behind the holder by at least the
          holder's quantum of pass takes it (a tenant back from host work, a
          chatty one) - two busy tenants keep alternating by whole quanta -
          or a waiter with a smaller pass that *lent* the device (gave it up
          at an op's end, or had it stolen, for its host work only).

        ``next_ns``: how long the holder's next chunk is expected to last (its recent chunks' wall
        time): a claim inside the quantum is served at the last boundary before the claimant's wait
        would pass its bound, so the chunk that would carry it past is not started.

        With ``prefer_tenant`` (a lend at an op's end) a waiting worker of that
        tenant, if any, gets the device: a sibling covers the lender's gap and
        the tenant keeps its share.
        """
        buf = self._check()
        self._claim_from = -1
        self._best = -1
        vclock = _atomics.load(buf, _VCLOCK)
        quantum = _atomics.load(buf, _C_QUANTUM)
        high = _atomics.load(buf, _HIGH)
        words = buf[self._wbase:self._wbase + high * _LINE].cast("Q")
        try:
            step = _LINE // 8
            waiting = [(words[w * step + 4], w, words[w * step + 3] - 1) for w in range(high)
                       if words[w * step + 4] and words[w * step + 3]]
            lent = {w for _, w, _ in waiting if words[w * step + 6]}
        finally:
            words.release()
        if _atomics.load(buf, _C_MODE) != 1:
            # scheduler off: the driver's time-slicing - round robin by arrival, no weights, no caps
            active = [w for since, w, t in sorted(waiting) if 0 <= t < self.tenant_slots]
            self._best = active[0] if active else -1
            if holder_tenant is not None and not quantum_over:
                return None
            return active[0] if active else None
        best: tuple[int, int, int, int] | None = None  # (pass, since, worker, tenant)
        lender: dict[int, bool] = {}  # tenant -> one of its waiting workers lent the device
        seen: dict[int, int | None] = {}
        for since, w, t in sorted(waiting):
            if t in seen:
                continue
            t_off = _t_off(t)
            # a slot left (eviction, a move to another device) still serves the workers that name it
            # until they exit: they wait for their runs to end, never for ever
            eligible = 0 <= t < self.tenant_slots
            if eligible:
                cap = _atomics.load(buf, t_off + _T_CAP)
                eligible = not cap or self._credit(buf, t_off, cap, now) > 0
            seen[t] = w if eligible else None
            lender[t] = lender.get(t, False) or w in lent
            if eligible:
                p = self._effective_pass(buf, t_off, vclock, quantum)
                if best is None or (p, since) < best[:2]:
                    best = (p, since, w, t)
        if best is None:
            return None
        self._best = best[2]
        if holder_tenant is not None:
            self._claim_from = min((since for since, _, t in waiting if t != holder_tenant), default=0)
        if prefer_tenant is not None and seen.get(prefer_tenant) is not None:
            return seen[prefer_tenant]  # a lend within the tenant: its share stays its own
        if holder_tenant is not None and 0 <= holder_tenant < self.tenant_slots:
            if best[3] == holder_tenant:
                # a sibling: the same pass; it gets the device at a quantum's end once it waited a few
                # (each rotation costs a wake-up; instances of a tenant need no finer fairness)
                return best[2] if quantum_over and now - best[1] >= _SIBLING_WAIT_QUANTA * quantum else None
            t_off = _t_off(holder_tenant)
            held = _atomics.load(buf, t_off + _T_PASS)  # busy all along: not raised like a returning waiter
            if quantum_over:
                if held <= best[0]:
                    return None
            elif now - best[1] + next_ns < quantum * _CLAIM_SERVE_NUM // _CLAIM_SERVE_DEN:
                return None  # inside the quantum a claim is served in batches (see _CLAIM_SERVE_NUM)
            elif lender.get(best[3]) and held > best[0]:
                pass  # it gave the device up between two of its ops, not for its pass: it takes it back
            elif held - best[0] < quantum * _MICRO // (_atomics.load(buf, t_off + _T_WEIGHT) or 1):
                return None
        return best[2]

    def _grant(self, buf: memoryview, worker: int, now: int, *, sibling: bool = False) -> None:
        """Bookkeeping of a new lease for ``worker``, by the process that just won the owner word for
        it with a CAS (never before: a lost race must not renew a grant or move the virtual clock).

        The granted worker may already be running when this runs, so the pass and the virtual clock
        only grow, by CAS (a store could undo the charge of its first chunk). ``sibling``: the device
        passes between two workers of one tenant, which was busy all along - its pass is not raised
        to the floor of a tenant back from idle (that would cut its credit at every rotation).
        """
        _atomics.store(buf, self._w_off(worker) + _W_LENT, 0)
        t = _atomics.load(buf, self._w_off(worker) + _W_TENANT) - 1
        if 0 <= t < self.tenant_slots:
            t_off = _t_off(t)
            vclock = _atomics.load(buf, _VCLOCK)
            if sibling:
                floor = _atomics.load(buf, t_off + _T_PASS)
            else:
                floor = self._effective_pass(buf, t_off, vclock, _atomics.load(buf, _C_QUANTUM))
            p = _raise_to(buf, t_off + _T_PASS, floor)
            _raise_to(buf, _VCLOCK, p)
        _atomics.store(buf, _GRANT_NS, now)
        _atomics.fetch_add(buf, _GRANTS, 1)

    def _give(self, buf: memoryview, current: int, nxt: int, now: int, counter: int) -> bool:
        """Move the owner word from ``current`` to worker ``nxt`` (idle); on success its grant,
        the ``counter`` (handoffs or steals) and a wake-up. False: someone else changed it first."""
        if not _atomics.compare_exchange(buf, _OWNER, current, (nxt + 1) << 1):
            return False
        trace = self.trace
        cas = time.monotonic_ns() if trace is not None else 0
        held = _atomics.load(buf, self._w_off((current >> 1) - 1) + _W_TENANT) if current else 0
        self._grant(buf, nxt, now, sibling=held != 0 and held == _atomics.load(buf, self._w_off(nxt) + _W_TENANT))
        _atomics.fetch_add(buf, counter, 1)
        bit = _wake_bit(nxt)
        _wake(buf, bit)  # the grantee alone: the other waiters have nothing to take (see _wake)
        _atomics.futex_wake_bits(buf, _OWNER, bit)  # a gated launch of the grantee's (GatedLaunch) starts now
        if trace is not None:
            trace.add("G", now, cas, time.monotonic_ns(), _atomics.load(buf, _LAST_END),
                      trace.chunk_end if current == self._mine else 0, (current >> 1) - 1, nxt,
                      "h" if counter == _HANDOFFS else "s")
        return True

    def _steal(self, buf: memoryview, current: int, nxt: int, now: int) -> None:
        """Take the device from an idle holder (owner word ``current``) for ``nxt``; the holder
        lent it (its next op may take it back at a chunk boundary, pass permitting)."""
        idle = self._held_idle(buf, now)
        if self._give(buf, current, nxt, now, _STEALS):
            _atomics.fetch_add(buf, _STOLEN_IDLE_NS, idle)
            victim = (current >> 1) - 1
            if 0 <= victim < self.worker_slots:
                _atomics.store(buf, self._w_off(victim) + _W_LENT, 1)

    def _hand_over(self, buf: memoryview, current: int, now: int) -> None:
        """Give the device from owner word ``current`` (idle) to the pick, or free it; wake waiters."""
        nxt = self.pick(now)
        if nxt is None:
            if _atomics.compare_exchange(buf, _OWNER, current, 0) and _atomics.load(buf, _WAITING):
                # a free device while workers wait (each held back by its cap, or one whose mark the
                # pick did not see yet): every waiter looks, whoever may take it does
                _wake(buf)
            return
        self._give(buf, current, nxt, now, _HANDOFFS)

    # ------------------------------------------------------- worker: leases

    def _need_worker(self) -> tuple[memoryview, int]:
        buf = self._check()
        if self._worker is None:
            raise SegmentError(self.name, "this board handle holds no worker slot")
        return buf, self._worker

    def others_waiting(self) -> bool:
        """True when a worker other than this one waits for the device (one atomic load)."""
        buf, _ = self._need_worker()
        return _atomics.load(buf, _WAITING) - (1 if self._waiting_since else 0) > 0

    def quiet(self) -> bool:
        """True when a chunk boundary of this holder now could not pass the device on: its last
        :meth:`finish`, inside its quantum, passed nothing on, and the earliest time :meth:`pick` could
        have since has not come - the quantum's end (a sibling's turn) or, before it, when the claim
        of the longest-waiting worker of another tenant falls due - under the same grant, with as many
        workers waiting as then (a clock read and two atomic loads). A holder's device thread skips the
        boundaries that would only ask the policy again (``worker.device_time``); a waiter that
        arrives changes the count, and the next boundary asks."""
        if not self._quiet_until:
            return False
        buf, _ = self._need_worker()
        if (self._clock() < self._quiet_until and _atomics.load(buf, _WAITING) == self._quiet_waiting
                and _atomics.load(buf, _GRANT_NS) == self._quiet_grant):
            return True
        self._quiet_until = 0
        return False

    def holds(self) -> bool:
        """True while this worker holds the device (idle or busy)."""
        buf, _ = self._need_worker()
        return _atomics.load(buf, _OWNER) >> 1 == self._mine >> 1

    def want(self, now: int) -> None:
        """Mark this worker as waiting for the device (idempotent)."""
        buf, w = self._need_worker()
        if not self._waiting_since:
            self._waiting_since = max(1, now)
            _atomics.store(buf, self._w_off(w) + _W_WAITING, self._waiting_since)
            _atomics.fetch_add(buf, _WAITING, 1)

    def unwant(self) -> None:
        buf, w = self._need_worker()
        if self._waiting_since:
            self._waiting_since = 0
            _atomics.store(buf, self._w_off(w) + _W_WAITING, 0)
            _atomics.fetch_add(buf, _WAITING, _ADD_MINUS_ONE)

    def _stealable(self, buf: memoryview, owner: int, now: int) -> bool:
        """An idle holder (another worker, between ops) that may lose the device now: idle past the
        grace after an op it ran, or never started within its quantum (a granted worker that did
        not wake, or died)."""
        if owner & 1:
            return False
        grant = _atomics.load(buf, _GRANT_NS)
        last = _atomics.load(buf, _LAST_END)
        if last > grant:
            grace = _atomics.load(buf, self._w_off((owner >> 1) - 1) + _W_GRACE) or _HANDOVER_GRACE_NS
            return now - last >= grace
        return now - grant >= _atomics.load(buf, _C_QUANTUM)

    def _timed_handover(self, buf: memoryview, now: int) -> None:
        """At a chunk start on a lease this worker held idle: when another process granted it since
        this worker's last chunk start, the device sat idle from that grant to now - added to the
        board's handover gap (:meth:`handover_gap`)."""
        grant = _atomics.load(buf, _GRANT_NS)
        if grant != self._grant_seen:
            self._grant_seen = grant
            if 0 < grant <= now:
                _atomics.fetch_add(buf, _GAP_NS, now - grant)
                _atomics.fetch_add(buf, _GAP_N, 1)

    def handover_gap(self) -> tuple[int, int, int]:
        """(ns, count, held idle ns): the device's idle time from each grant another process made
        (a handoff, a steal for another worker, the reclaim of a dead holder) to the grantee's first
        chunk - what handovers cost the device, summed - how many such handovers were timed, and
        the idle time holders kept the device before it was stolen from them (their grace)."""
        buf = self._check()
        return _atomics.load(buf, _GAP_NS), _atomics.load(buf, _GAP_N), _atomics.load(buf, _STOLEN_IDLE_NS)

    @staticmethod
    def _held_idle(buf: memoryview, now: int) -> int:
        """How long an idle holder has kept the device idle by ``now``: since its last chunk's end,
        or since its grant when it has run none under it."""
        return max(0, now - max(_atomics.load(buf, _LAST_END), _atomics.load(buf, _GRANT_NS)))

    def _began(self, now: int) -> None:
        """Bookkeeping when this worker starts a chunk it asked for at ``now``: the host gap
        since its last op (its request, not its grant: a wait for the device is no host gap),
        an estimate of the next one - :meth:`finish` hands over at an op's end when it is long."""
        if self._op_open or not self._last_end:
            self._op_open = False
            return
        gap = max(0, now - self._last_end)
        self._gap_ns += (gap - self._gap_ns) >> _GAP_EWMA_SHIFT if self._gap_ns else gap
        self._last_end = 0

    def _charge_idle(self, buf: memoryview, now: int) -> None:
        """This worker kept the device idle between two ops while others waited: that hold is
        charged to its tenant's pass (not to its used time: no device work was done)."""
        t = self._tenant
        if t is None or not self._last_end or self._op_open or _atomics.load(buf, _GRANT_NS) > self._last_end:
            return  # no op ended under this lease (it was granted since: it held nothing idle)
        idle = now - self._last_end
        if idle <= 0:
            return
        t_off = _t_off(t)
        weight = _atomics.load(buf, t_off + _T_WEIGHT) or 1
        _atomics.fetch_add(buf, t_off + _T_PASS, idle * _MICRO // weight)
        _atomics.fetch_add(buf, self._w_off(self._worker or 0) + _W_IDLE, idle)

    def try_acquire(self, now: int) -> bool:
        """One attempt to start a chunk: True when this worker now holds the device, busy
        (and no longer counts as waiting).

        Non-blocking; :meth:`acquire` loops on it. A worker that is not the
        policy's pick may still *decide* for the pick (hand a free device to
        it, or steal an idle one for it), which is how a free device reaches a
        sleeping waiter. Every grant is written only after the CAS that won the
        owner word succeeded.
        """
        buf, w = self._need_worker()
        mine = self._mine
        owner = _atomics.load(buf, _OWNER)
        if owner == mine or owner == mine | 1:
            if owner == mine | 1 or _atomics.compare_exchange(buf, _OWNER, mine, mine | 1):
                if owner == mine:
                    _atomics.store(buf, _BUSY_SINCE, now)
                    self._timed_handover(buf, now)
                else:  # taken busy for this worker by its gated launch (GatedLaunch), at "busy since"
                    self._timed_handover(buf, _atomics.load(buf, _BUSY_SINCE))
                if owner == mine and _atomics.load(buf, _WAITING) - (1 if self._waiting_since else 0) > 0:
                    self._charge_idle(buf, now)
                self._began(self._waiting_since or now)
                self.unwant()
                return True
            return False
        free = owner == 0
        if not (free or self._stealable(buf, owner, now)):
            return False
        self.want(now)
        nxt = self.pick(now)
        if nxt is None:
            return False
        if nxt != w:
            if free:
                self._hand_over(buf, 0, now)
            else:
                self._steal(buf, owner, nxt, now)
            return False
        idle = 0 if free else self._held_idle(buf, now)
        if _atomics.compare_exchange(buf, _OWNER, owner, mine | 1):
            _atomics.store(buf, _BUSY_SINCE, now)
            self._grant(buf, w, now)
            self._grant_seen = now  # its own grant: no handover gap
            if not free:
                _atomics.fetch_add(buf, _STEALS, 1)
                _atomics.fetch_add(buf, _STOLEN_IDLE_NS, idle)
                victim = (owner >> 1) - 1
                if 0 <= victim < self.worker_slots:
                    _atomics.store(buf, self._w_off(victim) + _W_LENT, 1)
            self._began(self._waiting_since or now)
            self.unwant()
            return True
        return False

    def acquire(self, deadline_ns: int | None = None, gated: GatedLaunch | None = None) -> int:
        """Block until this worker may run a chunk; the ns it waited (0 on the fast path).

        Raises :class:`TimeoutError` past ``deadline_ns`` (the run's deadline,
        ``clock`` time), leaving nothing held. ``gated``: the chunk, launched before the wait when the
        fast path fails, and started by the device the moment a grant names this worker (its own CAS
        on the owner word, idle to busy) - a handover then costs the device no wake-up of this
        thread; resolved before this returns or raises (a refused wait cancels it unless the device
        took the lease first: then this returns, holding it).
        """
        buf, w = self._need_worker()
        mine = self._mine
        if _atomics.compare_exchange(buf, _OWNER, mine, mine | 1):
            now = self._clock()
            _atomics.store(buf, _BUSY_SINCE, now)
            self._timed_handover(buf, now)
            if self._last_end and not self._op_open:
                if _atomics.load(buf, _WAITING):
                    self._charge_idle(buf, now)
                self._began(now)
            else:
                self._op_open = False
            return 0
        clock = self._clock
        t0 = clock()
        self.want(t0)
        spun = 0
        trace = self.trace
        woke = wakes = 0
        armed = gated is not None and gated.arm(buf, _OWNER, _BUSY_SINCE, mine)
        try:
            while True:
                seq = _atomics.load(buf, _SEQ)  # before looking: a wake-up after this cuts the sleep short
                now = clock()
                if self.try_acquire(now):
                    if armed:
                        armed = False
                        assert gated is not None
                        gated.resolve(cancel=False)
                    if trace is not None:
                        grant = _atomics.load(buf, _GRANT_NS)
                        trace.add("A", grant, t0, woke, time.monotonic_ns(), w, wakes)
                        trace.pending_grant = grant
                    return now - t0
                if trace is not None and woke:
                    trace.add("S", woke, w)
                    woke = 0
                if deadline_ns is not None and now >= deadline_ns:
                    if armed:
                        armed = False
                        assert gated is not None
                        if gated.resolve(cancel=True):
                            continue  # the device took the lease for it first: held busy, returned next look
                    raise TimeoutError(f"no GPU time on device {self.device_index} before the run's deadline")
                owner = _atomics.load(buf, _OWNER)
                if self.spin and spun < _MAX_SPIN and self._next_up(buf, owner, now):
                    # the device passes to us within a chunk: be on a CPU when it does, not a
                    # scheduler wake-up later (measured: ~1 ms per handoff on a loaded host)
                    os.sched_yield()
                    spun += 1
                    continue
                sleep = self._sleep_ns(buf, owner, now)
                if deadline_ns is not None:
                    sleep = min(sleep, max(deadline_ns - now, _MIN_SLEEP_NS))
                _atomics.futex_wait_bits(buf, _SEQ, seq & _MASK32, sleep, _wake_bit(w))
                if trace is not None:
                    woke = time.monotonic_ns()
                    wakes += 1
        finally:
            if armed:  # (an exception inside the wait: the launch must not outlive it)
                assert gated is not None
                gated.resolve(cancel=True)
            self.unwant()

    def _next_up(self, buf: memoryview, owner: int, now: int) -> bool:
        """True when a busy holder's quantum ends within a chunk, or it runs short ops (a chatty
        holder: it hands the device back within a grace), and this worker is the pick."""
        if not owner & 1:
            return False
        holder = self._w_off((owner >> 1) - 1)
        grace = _atomics.load(buf, holder + _W_GRACE)
        quantum = _atomics.load(buf, _C_QUANTUM)
        if grace and (grace <= _HANDOVER_GRACE_NS or (
                grace <= quantum // _SHORT_HOLD_QUANTUM_DIV and self._tenant is not None
                and _atomics.load(buf, holder + _W_TENANT) != self._tenant + 1)):
            # a short-stretch holder of another tenant (a sibling's turns come by quanta)
            return self.pick(now) == self._worker
        left = _atomics.load(buf, _GRANT_NS) + quantum - now
        if left > _SPIN_NS or left < -2 * _SPIN_NS:  # not yet; or a chunk overran: its end wakes us
            return False
        # the holder's own pick at its quantum's end: a sibling that has not waited its quanta yet, or
        # a tenant whose pass is not the smaller, would yield the CPU for nothing
        held = _atomics.load(buf, holder + _W_TENANT) - 1
        return self.pick(now + max(0, left), holder_tenant=held if held >= 0 else None,
                         quantum_over=True) == self._worker

    def _sleep_ns(self, buf: memoryview, owner: int, now: int) -> int:
        """How long a waiter sleeps before looking again (a wake-up cuts it short)."""
        quantum = _atomics.load(buf, _C_QUANTUM)
        sleep = _MAX_SLEEP_NS
        if owner:
            grant = _atomics.load(buf, _GRANT_NS)
            last = _atomics.load(buf, _LAST_END)
            if not owner & 1 and last > grant:
                # idle between ops: stolen from once its grace is over
                grace = _atomics.load(buf, self._w_off((owner >> 1) - 1) + _W_GRACE) or _HANDOVER_GRACE_NS
                sleep = last + grace - now
            else:
                # busy (its chunk end may hand over and wake us; if it then idles, we look again
                # within a poll), or granted and not started yet (stolen from at its quantum end)
                sleep = grant + quantum - now - (_SPIN_NS if owner & 1 else 0)
                if sleep <= 0:
                    sleep = _POLL_NS
                sleep = min(sleep, _POLL_NS) if owner & 1 else sleep
        if self._tenant is not None:
            t_off = _t_off(self._tenant)
            cap = _atomics.load(buf, t_off + _T_CAP)
            if cap:
                credit = self._credit(buf, t_off, cap, now)
                if credit <= 0:
                    sleep = max(sleep, (1 - credit) * _MICRO // cap)
        return int(min(_MAX_SLEEP_NS, max(_MIN_SLEEP_NS, sleep)))

    def finish(self, charged_ns: int, now: int | None = None, *, last: bool = True, idle: bool = False,
               chunk_from: int = 0) -> bool:
        """End a chunk that ran ``charged_ns`` on the device: charge it, maybe hand the device over.

        ``last``: the chunk ends an op (False: another chunk of the same op follows at once, so
        the device is not given up for idleness). Returns True when the device was given up:
        a waiter with a better claim (see :meth:`pick`), this tenant's cap ran out
        (``throttled`` is counted then), or - at an op's end, while another worker waits - this
        worker's host gaps between ops are longer than the grace (it would hold the device
        idle: it hands over now rather than be stolen from later). ``idle`` (with ``last``): the
        holder has nothing queued to run next (a worker's queue ran empty: the end of a stretch of
        queued work), so it lends the device to a waiter now whatever its host gaps. ``chunk_from``:
        where the last chunk began when the holder ran several since its last ``finish`` (it skipped
        the boundaries between them: :meth:`quiet`) - the chunk's wall time, which decides when a
        claim is served, is then the last one's, not theirs together.
        """
        buf, w = self._need_worker()
        now = self._clock() if now is None else now
        mine = self._mine
        t = self._tenant
        self._quiet_until = 0
        capped_out = self._charge(buf, charged_ns, now)
        # the chunk's wall time (its start to now): what the next one will likely take, for a claim's
        # deadline (see pick's next_ns) - the larger of the last and the average, a claim errs early
        chunk = max(0, now - max(_atomics.load(buf, _BUSY_SINCE), chunk_from))
        self._chunk_ns += (chunk - self._chunk_ns) >> _GAP_EWMA_SHIFT if self._chunk_ns else chunk
        self._op_open = not last
        self._last_end = now
        self._op_sum += max(0, charged_ns)
        if last:
            self._op_ended(buf, w)
        _atomics.store(buf, _LAST_END, now)
        if not _atomics.compare_exchange(buf, _OWNER, mine | 1, mine):
            return True  # not ours any more (the supervisor took it: should not happen while alive)
        if capped_out:
            assert t is not None
            _atomics.fetch_add(buf, _t_off(t) + _T_THROTTLED, 1)
            self._hand_over(buf, mine, now)
            return True
        waiting = _atomics.load(buf, _WAITING)
        if not waiting:
            return False
        if last and self._lends(idle):
            nxt = self.pick(now, prefer_tenant=t)  # not the holder: it has no op to run now
            if nxt is not None:
                _atomics.store(buf, self._w_off(w) + _W_LENT, 1)
        else:
            grant = _atomics.load(buf, _GRANT_NS)
            quantum = _atomics.load(buf, _C_QUANTUM)
            quantum_over = now - grant >= quantum
            nxt = self.pick(now, holder_tenant=t, quantum_over=quantum_over, next_ns=max(chunk, self._chunk_ns))
            if nxt is None:
                if quantum_over:
                    _atomics.store(buf, _GRANT_NS, now)  # the holder's pass is still the smallest: renew
                    self._grant_seen = now
                elif self._claim_from >= 0:
                    # a sibling's turn comes with the quantum's end, another tenant's claim when it is due
                    # (pick: its wait plus the next chunk reaching the claim's fraction of a quantum; the
                    # chunk counted twice, as the next may run longer): the boundaries before need not ask
                    until = grant + quantum
                    if self._claim_from:
                        until = min(until, self._claim_from + quantum * _CLAIM_SERVE_NUM // _CLAIM_SERVE_DEN
                                    - 2 * max(chunk, self._chunk_ns))
                    if until > now:
                        self._quiet_until, self._quiet_waiting, self._quiet_grant = until, waiting, grant
                if last and self._best >= 0:
                    # the op ended and the holder keeps the device, idle, within its grace: the waiter
                    # that would take it (the pick, the holder left out), asleep until its next look (a
                    # busy holder's: every 1 ms at most), looks now and sleeps to the grace's end, when
                    # an idle holder is stolen from (_sleep_ns); any other waiter would steal for it
                    _wake(buf, _wake_bit(self._best))
                return False
        if nxt is None:
            return False
        self._give(buf, mine, nxt, now, _HANDOFFS)
        return True

    def charge(self, charged_ns: int) -> None:
        """Charge device time that ran under this worker's lease but ended after the ``finish`` that
        told its stretch (the stub's executor: launched chunks still running when the device went on,
        ``worker.device_time``): the tenant's pass, used time and cap credit, as ``finish`` charges;
        the lease is not touched (a cap run out is enforced at the next ``finish``)."""
        buf, _ = self._need_worker()
        self._charge(buf, charged_ns, self._clock())

    def _charge(self, buf: memoryview, charged_ns: int, now: int) -> bool:
        """The tenant's pass, used time and cap credit for ``charged_ns``; True: its cap ran out."""
        t = self._tenant
        capped_out = False
        if t is not None and charged_ns > 0:
            t_off = _t_off(t)
            weight = _atomics.load(buf, t_off + _T_WEIGHT) or 1
            passed = _atomics.fetch_add(buf, t_off + _T_PASS, charged_ns * _MICRO // weight)
            passed += charged_ns * _MICRO // weight
            if not _atomics.load(buf, _WAITING) and passed > _atomics.load(buf, _VCLOCK):
                # alone on the device: the virtual clock moves with it, so a tenant back from idle
                # catches up at most one quantum (idle time is not banked)
                _atomics.store(buf, _VCLOCK, passed)
            _atomics.fetch_add(buf, t_off + _T_USED, charged_ns)
            cap = _atomics.load(buf, t_off + _T_CAP)
            if cap:
                credit = self._credit(buf, t_off, cap, now) - charged_ns
                _atomics.store(buf, t_off + _T_CREDIT, _BIAS + credit)
                _atomics.store(buf, t_off + _T_STAMP, now)
                capped_out = credit <= 0 and _atomics.load(buf, _C_MODE) == 1
        return capped_out

    def _lends(self, idle: bool) -> bool:
        """At an op's end while others wait: whether this holder hands the device over now (``idle``:
        nothing queued behind the op; or its host gaps are long next to its grace)."""
        return idle or self._gap_ns > max(_LEND_GAP_NS, self._grace_ns * 3 // 4)

    def _op_ended(self, buf: memoryview, w: int) -> None:
        """An op of this worker ended: its length joins the average, and the grace follows it."""
        op, self._op_sum = self._op_sum, 0
        self._op_ns += (op - self._op_ns) >> _GAP_EWMA_SHIFT if self._op_ns else op
        # the idle time this worker may hold between ops before a waiter takes the device: four
        # times its ops' length, at least the grace. Lending costs the lender up to a chunk at
        # its next op and hands its idle time to whoever waits, whatever the passes: right for a
        # tenant mostly idle (a chatty one: 20 us ops, 0.1-1 ms gaps), wrong for one that keeps
        # the device busy between host hiccups (GEMMs of 0.3 ms, 0.3-1 ms apart on a loaded
        # 2-core host: lending to them turned 7:3 into 58:42 - weights no longer decided)
        grace = min(max(_HANDOVER_GRACE_NS, 4 * self._op_ns), _atomics.load(buf, _C_QUANTUM) // 2)
        if grace != self._grace_ns:
            self._grace_ns = grace
            _atomics.store(buf, self._w_off(w) + _W_GRACE, grace)

    def end_op(self, *, idle: bool = False) -> bool:
        """The op this worker's last :meth:`finish` left open (``last=False``: a chunk boundary) ended
        without another chunk - a queued stretch whose last op ended at a boundary it already told,
        the lease held idle since. The board hears of the op's end as :meth:`finish` with ``last``
        would have told it: while others wait, the device is lent now (``idle``, or long host gaps),
        else the waiters are woken to time their sleep to this holder's grace. Without it the board
        took the op as still running: no host gap measured at the next request, no idle hold
        charged, and the waiters asleep to their next poll. True when the device was handed over;
        nothing when no op is open or the device is not held idle by this worker."""
        buf, w = self._need_worker()
        if not self._op_open:
            return False
        mine = self._mine
        if _atomics.load(buf, _OWNER) != mine:
            return False  # busy again (its next chunk), or not ours: that chunk's finish ends the op
        self._op_open = False
        self._op_ended(buf, w)
        if not _atomics.load(buf, _WAITING):
            return False
        if self._lends(idle):
            now = self._clock()
            nxt = self.pick(now, prefer_tenant=self._tenant)
            if nxt is not None and self._give(buf, mine, nxt, now, _HANDOFFS):
                _atomics.store(buf, self._w_off(w) + _W_LENT, 1)
                return True
            return False
        self._wake_pick(buf)
        return False

    def _wake_pick(self, buf: memoryview) -> None:
        """The holder keeps the device idle within its grace: wake the waiter that would take it (the
        pick, the holder left out) to time its sleep to the grace's end (finish's rule)."""
        nxt = self.pick(self._clock())
        if nxt is not None:
            _wake(buf, _wake_bit(nxt))

    def release(self) -> None:
        """Give the device up at the end of a run (handed to the pick, or freed)."""
        buf, _ = self._need_worker()
        self.unwant()
        self._op_open = False
        self._last_end = 0  # the time to the next run is no host gap of this run's: not measured
        mine = self._mine
        owner = _atomics.load(buf, _OWNER)
        if owner == mine | 1:  # interrupted mid-chunk (an exception): not busy any more
            _atomics.compare_exchange(buf, _OWNER, owner, mine)
            owner = mine
        if owner == mine:
            self._hand_over(buf, mine, self._clock())

    def throttled_wait_ns(self, now: int | None = None) -> int:
        """How long this worker's tenant must still wait for its cap (0: not throttled)."""
        buf, _ = self._need_worker()
        if self._tenant is None:
            return 0
        t_off = _t_off(self._tenant)
        cap = _atomics.load(buf, t_off + _T_CAP)
        if not cap:
            return 0
        credit = self._credit(buf, t_off, cap, self._clock() if now is None else now)
        return 0 if credit > 0 else (1 - credit) * _MICRO // cap

    # ------------------------------------------------------ supervisor: death

    def reclaim_dead(self) -> list[tuple[int, int, bool]]:
        """Free the slot of every dead worker; ``[(worker slot, pid, held the device)]``.

        A dead holder's lease goes to the next pick at once (or the device is
        freed). A holder that died mid-chunk (the busy bit set) never reported
        that chunk: its tenant is charged the time from the chunk's start to
        now, at most one quantum (:meth:`_charge_in_flight`). This reads
        ``/proc`` for every live worker on the board: the supervisor's periodic
        safety net; a death it saw is reclaimed by :meth:`reclaim_pid`.
        """
        buf = self._check()
        found = []
        for w in range(_atomics.load(buf, _HIGH)):
            off = self._w_off(w)
            if not _atomics.load(buf, off + _W_CLAIMED):
                continue
            pid = _atomics.load(buf, off + _W_PID)
            if pid == 0 or _owner_alive(pid, _atomics.load(buf, off + _W_START)):
                continue
            found.append((w, pid, self._free_dead(buf, w, off)))
        return found

    def reclaim_pid(self, pid: int) -> list[tuple[int, int, bool]]:
        """Free the slots of one process the supervisor saw die (it reaped it); as :meth:`reclaim_dead`.

        Only the slots that name ``pid`` are looked at, and only that pid's ``/proc`` entry is read
        (a reused pid is told apart by its start time): a death costs one read, not one per live
        worker - at tens of workers the full scan held the supervisor's loop for tens of ms."""
        buf = self._check()
        found: list[tuple[int, int, bool]] = []
        if pid <= 0:
            return found
        for w in range(_atomics.load(buf, _HIGH)):
            off = self._w_off(w)
            if not _atomics.load(buf, off + _W_CLAIMED) or _atomics.load(buf, off + _W_PID) != pid:
                continue
            if _owner_alive(pid, _atomics.load(buf, off + _W_START)):
                continue
            found.append((w, pid, self._free_dead(buf, w, off)))
        return found

    def _free_dead(self, buf: memoryview, w: int, off: int) -> bool:
        """Free worker slot ``w`` (at ``off``) of a dead process; whether it held the device (then
        the lease passes on, and a chunk it was running is charged to its tenant)."""
        tenant = _atomics.load(buf, off + _W_TENANT) - 1
        _atomics.store(buf, off + _W_TENANT, 0)
        if _atomics.exchange(buf, off + _W_WAITING, 0):
            _atomics.fetch_add(buf, _WAITING, _ADD_MINUS_ONE)
        owner = _atomics.load(buf, _OWNER)
        held = owner != 0 and (owner >> 1) - 1 == w
        if held:
            now = self._clock()
            if owner & 1:
                # it died mid-chunk: nobody will finish that chunk, so it is charged here (once:
                # only the reclaim that clears the busy bit charges; the owner word may have
                # moved since it was read)
                if _atomics.compare_exchange(buf, _OWNER, owner, owner & ~1):
                    self._charge_in_flight(buf, tenant, now)
                owner &= ~1
            self._hand_over(buf, owner, now)
        elif owner == 0:
            if _atomics.load(buf, _WAITING):
                _wake(buf)  # it may have died between freeing the device and its wake
        elif not owner & 1:
            # it may have died between a hand-over's CAS and its wake: the grantee the word names wakes
            bit = _wake_bit((owner >> 1) - 1)
            _wake(buf, bit)
            _atomics.futex_wake_bits(buf, _OWNER, bit)
        _atomics.store(buf, off + _W_PID, 0)
        _atomics.store(buf, off + _W_START, 0)
        _atomics.store(buf, off + _W_CLAIMED, 0)
        return held

    def _charge_in_flight(self, buf: memoryview, tenant: int, now: int) -> int:
        """Charge ``tenant`` (a dead holder's) for the chunk it was running: from the chunk's start
        to ``now``, at most one quantum; the ns charged.

        The start is the lease line's ``busy since``, raised to the last chunk end and the grant
        (a holder killed between its CAS and that store leaves the previous chunk's start there:
        the running chunk began after both). Charged like :meth:`finish` charges a chunk: pass,
        used time, the cap's bucket - but the device is not handed over here (the caller does).
        """
        start = max(_atomics.load(buf, _BUSY_SINCE), _atomics.load(buf, _LAST_END), _atomics.load(buf, _GRANT_NS))
        ns = min(max(0, now - start), _atomics.load(buf, _C_QUANTUM))
        if ns <= 0 or not 0 <= tenant < self.tenant_slots:
            return 0
        t_off = _t_off(tenant)
        if not _atomics.load(buf, t_off + _T_ACTIVE):
            return 0  # the tenant left (evicted): nothing to charge
        weight = _atomics.load(buf, t_off + _T_WEIGHT) or 1
        _atomics.fetch_add(buf, t_off + _T_PASS, ns * _MICRO // weight)
        _atomics.fetch_add(buf, t_off + _T_USED, ns)
        cap = _atomics.load(buf, t_off + _T_CAP)
        if cap:
            _atomics.store(buf, t_off + _T_CREDIT, _BIAS + self._credit(buf, t_off, cap, now) - ns)
            _atomics.store(buf, t_off + _T_STAMP, now)
        _atomics.store(buf, _LAST_END, now)
        return ns

    # ----------------------------------------------------------------- reads

    def snapshot(self) -> GpuTimeSnapshot:
        buf = self._check()
        load = _atomics.load
        owner = load(buf, _OWNER)
        tenants = {}
        for t in range(load(buf, _T_HIGH)):
            off = _t_off(t)
            if not load(buf, off + _T_ACTIVE):
                continue
            cap = load(buf, off + _T_CAP)
            tenants[t] = {
                "weight": load(buf, off + _T_WEIGHT) / _MICRO,
                "cap": cap / _MICRO if cap else None,
                "used_ns": load(buf, off + _T_USED),
                "pass": load(buf, off + _T_PASS),
                "throttled": load(buf, off + _T_THROTTLED),
            }
        return GpuTimeSnapshot(
            name=self.name,
            device_index=self.device_index,
            scheduler=load(buf, _C_MODE) == 1,
            quantum_s=load(buf, _C_QUANTUM) / 1e9,
            holder=(owner >> 1) - 1 if owner else None,
            holder_pid=load(buf, self._w_off((owner >> 1) - 1) + _W_PID) if owner else 0,
            busy=bool(owner & 1),
            waiting=load(buf, _WAITING),
            grants=load(buf, _GRANTS),
            steals=load(buf, _STEALS),
            handoffs=load(buf, _HANDOFFS),
            tenants=tenants,
        )


#: a wake naming every waiter (a policy changed; a device freed while workers wait)
_WAKE_ALL: Final = _MASK32


def _wake_bit(worker: int) -> int:
    """The wake bit of worker slot ``worker``: a waiter sleeps on the wake sequence with it, a wake that
    names the worker sets it (slots 32 apart share one: a wake-up for nothing, never a lost one)."""
    return 1 << (worker & 31)


def _wake(buf: memoryview, bits: int = _WAKE_ALL) -> None:
    """Bump the wake sequence and wake the waiters ``bits`` names (:func:`_wake_bit`; all by default).

    Waiters sleep on the wake sequence, not on the owner word itself: the owner
    word can return to the value a waiter saw (free, taken again by the same
    worker for its next chunk), and a futex on it would then sleep through the
    change (ABA). The sequence only grows. Every change of the board a waiter must see bumps it,
    so a waiter that read the sequence before the change and has not slept yet returns at once and
    looks again; of the sleepers only those named wake. One wake per change of hands: a grant wakes
    its grantee (the others have nothing to take: a grant to another worker leaves them waiting, and
    their sleeps, timed to their steal deadlines, do not grow with it), a holder that keeps the
    device idle wakes the waiter that would take it, and only a policy change or a device freed
    while workers wait wakes every one. Waking every waiter at each change of hands cost ~5.6
    wake-ups a handover that found nothing to do, each preempting a busy thread on the host's CPUs.
    The rule, and that no waiter sleeps while the lease is free or names it, are model-checked
    (``tests/helpers/gated_launch_model.py``).
    """
    _atomics.fetch_add(buf, _SEQ, 1)
    _atomics.futex_wake_bits(buf, _SEQ, bits)


def _raise_to(buf: memoryview, offset: int, floor: int) -> int:
    """Raise the word at ``offset`` to at least ``floor`` (a CAS loop: concurrent adds are kept); its value."""
    while True:
        value = _atomics.load(buf, offset)
        if value >= floor or _atomics.compare_exchange(buf, offset, value, floor):
            return max(value, floor)


def _quantum_ns(quantum_s: object) -> int:
    if isinstance(quantum_s, bool) or not isinstance(quantum_s, (int, float)) or not math.isfinite(quantum_s):
        raise ValueError(f"quantum must be a number of seconds, got {quantum_s!r}")
    if not 0.0001 <= quantum_s <= 1.0:
        raise ValueError(f"quantum must be in 0.0001..1 s, got {quantum_s!r}")
    return round(quantum_s * 1e9)


def _claim_worker(name: str, buf: memoryview, tenant: int, base: int, slots: int) -> int:
    """Claim the first free worker slot (of ``slots`` lines from ``base``) for this process."""
    pid = os.getpid()
    start = _process_start_ms(pid)
    for w in range(slots):
        off = base + w * _LINE
        if _atomics.load(buf, off + _W_CLAIMED):
            continue
        if _atomics.exchange(buf, off + _W_CLAIMED, 1) == 0:  # test-and-set: slot w is ours
            _atomics.store(buf, off + _W_WAITING, 0)
            _atomics.store(buf, off + _W_IDLE, 0)
            _atomics.store(buf, off + _W_LENT, 0)
            _atomics.store(buf, off + _W_GRACE, 0)
            _atomics.store(buf, off + _W_START, start)
            _atomics.store(buf, off + _W_PID, pid)
            _atomics.store(buf, off + _W_TENANT, tenant + 1)
            while True:  # the scan bound: workers_high = max claimed + 1
                high = _atomics.load(buf, _HIGH)
                if high > w or _atomics.compare_exchange(buf, _HIGH, high, w + 1):
                    break
            return w
    raise SegmentError(name, f"all {slots} worker slots are held by live workers")
