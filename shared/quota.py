"""Per-tenant CPU and GPU byte quotas in one shared-memory segment.

The supervisor creates one :class:`QuotaBlock` per tenant and is its only
owner (it unlinks it). Every worker instance of that tenant attaches to the
same block and consumes/releases on it directly, lock-free, through the C
helper ``shared._atomics``; the supervisor reads it for status and metrics,
changes limits live, and reclaims a dead instance's share.

Layout (little-endian ``uint64`` fields, each hot counter on its own 64-byte
cache line; measured: two processes on separate lines scale ~2x, on one line
they gain nothing)::

    line 0   header   magic | version | kind | owner pid | owner start (ms since boot) |
                      generation | segment size | max instances
    line 1   label    tenant id, NUL-padded (<= 63 bytes)
    line 2   cpu      (unused) | limit | high water | refusals | underflows
    line 3   gpu      (unused) | limit | high water | refusals | underflows
    line 4   settings recorded cuda mem pool quota | share slots in use
    line 5+i instance i's share: cpu bytes | gpu bytes   (i < MAX_INSTANCES)
    line 5+MAX_INSTANCES  the unattributed share (holders without an instance: the owner, in-process use)

A tenant's use is *derived*: the sum of the shares (``_atomics.ShareCounter``).
A worker instance only ever writes its own share, so when it dies - SIGKILL
at any instruction included - its share is exactly what it held, and the
supervisor reclaims it with one exchange. (The earlier layout kept a tenant counter and
mirrored each change into the share in a second step; a kill between the two
left the reclaim one allocation off. ``tests/helpers/quota_share_model.py``
checks both schemes with a kill at every step.)

A limit of ``UINT64_MAX`` means "no limit" (``gpu_memory_bytes_cap=None``:
operator trust, counted but never refused). The magic is written last, so an
attacher that sees it sees initialised fields.

Hot path: ``block.consume_gpu_bytes`` *is* the C method of a bound
``_atomics.Counter`` (set per instance in ``__init__``), so a call costs one C
call with no Python frame; the typed errors are built by callbacks only when a
call is refused.
"""

from __future__ import annotations

import enum
import hashlib
from bisect import bisect_left
import logging
import os
import re
import secrets
from dataclasses import dataclass, fields
from functools import partial
from typing import Final
from collections.abc import Callable, Sequence

from shared import _atomics, _shm
from shared._segment import MappedSegment
from shared.checks import is_int
from shared.errors import GpuMemoryExhausted, MemoryExhausted, SegmentError
from shared.ids import TenantId
from shared.log import get_logger, log_event
from shared.sizes import check_size_range
from shared.wire import Record

__all__ = [
    "DEFAULT_QUOTA_BYTES",
    "GPU_WAIT_BUCKETS_S",
    "MAX_INSTANCES",
    "NAME_MAX",
    "SEGMENT_PREFIX",
    "UNCHANGED",
    "QuotaBlock",
    "QuotaCounters",
    "QuotaSnapshot",
    "SegmentHeader",
    "Unchanged",
    "cleanup_stale_segments",
    "is_legacy_name",
    "namespace_of",
    "process_alive",
    "process_start_ms",
    "read_header",
    "segment_namespace",
    "stale_segments",
    "unfinished_segments",
]

_log = get_logger("quota")

DEFAULT_QUOTA_BYTES: Final = 8 << 30
SEGMENT_PREFIX: Final = "twt-"
#: the longest segment name: a /dev/shm file name (Linux NAME_MAX; shm_open's name less its "/")
NAME_MAX: Final = 255
# A run dir's namespace token: "ns" and 12 hex digits. "n" and "s" are no hex digits, so no name an
# older version made (``twt-<hex>-...``) reads as namespaced.
_NS_MARK: Final = "ns"
_NS_HEX: Final = 12
_NAMESPACE = re.compile(rf"{_NS_MARK}[0-9a-f]{{{_NS_HEX}}}\Z")
# What a supervisor before namespaces named its segments: a per-start 8-hex prefix, then a
# quota slot, a device (``dev<i>``) or a region (``r<128 bits>``).
_LEGACY_NAME = re.compile(r"twt-[0-9a-f]{8}-(?:[0-9]+|dev[0-9]+|r[0-9a-f]{32})\Z")
MAX_INSTANCES: Final = 64
UNLIMITED: Final = (1 << 64) - 1

_LINE = 64
MAGIC: Final = int.from_bytes(b"TWTQUOTA", "little")
#: The header's version stays 1: the derived-share layout is told apart by its size (8 KiB,
#: 65 share lines); a 4 KiB segment of the earlier mirrored layout is refused as too small.
#: Kept so that test runs of other builds sharing /dev/shm recognise (and leave alone)
#: these segments; workers always come from the supervisor's own install.
LAYOUT_VERSION: Final = 1
KIND_TENANT: Final = 1
KIND_DEVICE: Final = 2
KIND_REGION: Final = 3  # a data region (shared.region): header page, then bytes
KIND_GPU_TIME: Final = 4  # a device's GPU-time lease board (shared.gpu_time)

# header fields
_H_MAGIC, _H_VERSION, _H_KIND, _H_PID, _H_START, _H_GEN, _H_SIZE, _H_MAXINST = (
    8 * i for i in range(8)
)
_LABEL = 1 * _LINE
_CPU = 2 * _LINE
_GPU = 3 * _LINE
_SETTINGS = 4 * _LINE
_S_POOL_QUOTA = _SETTINGS + 0
_S_NSLOTS = _SETTINGS + 8
_INSTANCES = 5 * _LINE
_UNATTRIBUTED = MAX_INSTANCES  # the share slot of holders without an instance
_LAYOUT_BYTES = _INSTANCES + (MAX_INSTANCES + 1) * _LINE
SEGMENT_BYTES: Final = (_LAYOUT_BYTES + 4095) // 4096 * 4096
# GPU time (shared.gpu_time), in the page's spare lines after the shares, written by the worker
# holding the device: accounted ns | ops (chunks) | waits | wait ns | throttled, then the
# wait histogram's bins (non-cumulative counts, GPU_WAIT_BUCKETS_S and +Inf).
_GPU_TIME = _LAYOUT_BYTES
_GT_NS, _GT_OPS, _GT_WAITS, _GT_WAIT_NS, _GT_THROTTLED = (_GPU_TIME + 8 * i for i in range(5))
_GT_BINS = _GPU_TIME + _LINE
#: upper bounds (seconds) of the GPU wait histogram (``twt_tenant_gpu_wait_seconds``); +Inf follows
GPU_WAIT_BUCKETS_S: Final = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_GT_BOUNDS_NS = tuple(round(b * 1e9) for b in GPU_WAIT_BUCKETS_S)
assert _GT_BINS + 8 * (len(GPU_WAIT_BUCKETS_S) + 1) <= SEGMENT_BYTES

class Unchanged(enum.Enum):
    """The "not given" default of a live limit change (there ``None`` means "no limit")."""

    TOKEN = 0


UNCHANGED: Final = Unchanged.TOKEN


def _instance_off(index: int) -> int:
    return _INSTANCES + index * _LINE


def _granted(share_sum: int, high_water: int) -> int:
    """The bytes in use to report: the sum of the shares, at most the high-water mark.

    A consume publishes its share *before* it checks the limit and withdraws
    it when refused (the Dekker scheme in ``_atomics.c``), so a reader's sum
    may include a tentative share that is never granted, and read past the
    cap while refused consumes race at it. Granted bytes never exceed the
    high water (every grant raises it to the total it saw, which includes
    every share granted before it), so the minimum counts granted bytes only;
    a grant shows once its high-water update is done, a few instructions after
    its sum. Quiescent, the two agree exactly.
    """
    return min(share_sum, high_water)


def _check_amount(value: object, what: str) -> int:
    if not is_int(value):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    return check_size_range(value, what)


def _limit_to_raw(value: int | None, what: str) -> int:
    return UNLIMITED if value is None else _check_amount(value, what)


def _raw_to_limit(raw: int) -> int | None:
    return None if raw == UNLIMITED else raw


def _proc_stat(pid: int) -> tuple[bytes, int] | None:
    """(state, start in ms since boot) of ``pid`` from /proc, or None when it is gone.

    The start comes from ``starttime`` (clock ticks since boot), not from a
    wall-clock time: psutil's ``create_time()`` adds the boot time, which the
    kernel derives from the current wall clock, so it shifts when the clock is
    stepped and a live owner would look dead (its segments then unlinked).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # fields 3.. of proc(5); comm may hold spaces
    return fields[0], int(fields[19]) * 1000 // _CLOCK_TICKS


_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")


_own_start: tuple[int, int] | None = None  # (pid, start): constant for this process


def _process_start_ms(pid: int) -> int:
    global _own_start
    if _own_start is not None and _own_start[0] == pid:
        return _own_start[1]
    found = _proc_stat(pid)
    if found is None:
        raise ProcessLookupError(pid)
    if pid == os.getpid():
        _own_start = (pid, found[1])
    return found[1]


def _owner_alive(pid: int, start_ms: int) -> bool:
    """True when ``pid`` runs and started at ``start_ms`` (ms since boot; not a reused pid)."""
    if pid <= 0:
        return False
    try:
        found = _proc_stat(pid)
    except PermissionError:
        return True  # cannot tell (hidepid): never remove what might be live
    except (OSError, ValueError, IndexError):
        return True
    if found is None:
        return False
    state, started = found
    return state not in (b"Z", b"X") and started == start_ms


def process_start_ms(pid: int) -> int:
    """When ``pid`` started (ms since boot, pid-reuse safe); ProcessLookupError when it is gone.

    With :func:`process_alive`, how owners of shared resources are recorded and
    checked (quota segments by their supervisor, data regions by their client).
    """
    return _process_start_ms(pid)


def process_alive(pid: int, start_ms: int) -> bool:
    """True when ``pid`` runs and is the process that started at ``start_ms`` (not a zombie)."""
    return _owner_alive(pid, start_ms)


@dataclass(frozen=True)
class SegmentHeader:
    """The header of a ``twt-*`` segment, as read by :func:`read_header`."""

    name: str
    kind: int
    owner_pid: int
    owner_start_ms: int
    generation: int
    label: str

    def owner_alive(self) -> bool:
        return _owner_alive(self.owner_pid, self.owner_start_ms)


@dataclass(frozen=True, slots=True)
class QuotaSnapshot(Record):
    """Every counter of a block at one moment (each field read atomically); a wire record
    (the ``quota`` reply, ``TenantRecord.quota``)."""

    tenant_id: str
    name: str
    generation: int
    bytes_in_use: int
    memory_quota_bytes: int
    cpu_high_water: int
    cpu_refusals: int
    cpu_underflows: int
    gpu_bytes_in_use: int
    gpu_memory_bytes_cap: int | None
    gpu_high_water: int
    gpu_refusals: int
    gpu_underflows: int
    cuda_mem_pool_quota_bytes: int | None
    #: (instance index, cpu bytes, gpu bytes) for every instance holding bytes
    instance_shares: tuple[tuple[int, int, int], ...]
    #: GPU time accounted to the tenant (all devices, all instances), ns; see shared.gpu_time
    gpu_time_ns: int = 0
    #: device chunks run, waits for the device observed and their total, cap throttles
    gpu_ops: int = 0
    gpu_waits: int = 0
    gpu_wait_ns: int = 0
    gpu_throttled: int = 0
    #: the wait histogram: a count per GPU_WAIT_BUCKETS_S bound and +Inf (not cumulative)
    gpu_wait_bins: tuple[int, ...] = (0,) * (len(GPU_WAIT_BUCKETS_S) + 1)

    def to_dict(self) -> dict[str, object]:
        """The wire map (what :meth:`Record.to_wire` gives), written out field by field: the frontend
        answers a ``quota`` request with it, and ``dataclasses.asdict``'s deep copy cost 25 us a call,
        half of what a ``quota`` answer cost during a quota flood."""
        d = {name: getattr(self, name) for name in _SNAPSHOT_FIELDS}
        d["instance_shares"] = [list(t) for t in self.instance_shares]
        d["gpu_wait_bins"] = list(self.gpu_wait_bins)
        return d


_SNAPSHOT_FIELDS: Final = tuple(f.name for f in fields(QuotaSnapshot))


def write_header(buf: memoryview, kind: int, label: str, generation: int, size: int) -> None:
    """Initialise a fresh segment's header; the magic goes in last."""
    pid = os.getpid()
    _atomics.store(buf, _H_VERSION, LAYOUT_VERSION)
    _atomics.store(buf, _H_KIND, kind)
    _atomics.store(buf, _H_PID, pid)
    _atomics.store(buf, _H_START, _process_start_ms(pid))
    _atomics.store(buf, _H_GEN, generation)
    _atomics.store(buf, _H_SIZE, size)
    _atomics.store(buf, _H_MAXINST, MAX_INSTANCES)
    raw = label.encode()
    buf[_LABEL : _LABEL + len(raw)] = raw
    _atomics.store(buf, _H_MAGIC, MAGIC)


def check_header(name: str, buf: memoryview, kind: int) -> str:
    """Validate a mapped segment's header; return its label. Raises SegmentError."""
    if len(buf) < _LAYOUT_BYTES:
        raise SegmentError(name, f"too small for a quota segment ({len(buf)} bytes)")
    if _atomics.load(buf, _H_MAGIC) != MAGIC:
        raise SegmentError(name, "not a tensor-wasm-tenant segment (bad magic)")
    version = _atomics.load(buf, _H_VERSION)
    if version != LAYOUT_VERSION:
        raise SegmentError(name, f"layout version {version}, this build reads {LAYOUT_VERSION}")
    found = _atomics.load(buf, _H_KIND)
    if found != kind:
        raise SegmentError(name, f"segment kind {found}, expected {kind}")
    return bytes(buf[_LABEL : _LABEL + _LINE]).split(b"\0", 1)[0].decode(errors="replace")


def new_segment_name(prefix: str | None = None, slot: int | str = 0) -> str:
    """``twt-<prefix>-<slot>``; a random prefix when none is given.

    A supervisor's prefix starts with its run dir's namespace
    (``<namespace>-<per-start hex>``, see :func:`segment_namespace`).
    """
    name = f"{SEGMENT_PREFIX}{prefix or secrets.token_hex(6)}-{slot}"
    if len(name.encode()) > NAME_MAX:
        raise ValueError(f"segment name of {len(name.encode())} bytes exceeds NAME_MAX ({NAME_MAX}): {name[:40]!r}...")
    return name


def segment_namespace(run_dir: str) -> str:
    """The namespace of the segments of every supervisor that runs on ``run_dir``.

    ``ns`` and 12 hex digits of the SHA-256 of the run dir's real path: the
    same for each restart on that directory (so a restart finds what a killed
    predecessor left), different for another run dir on the host (so one
    supervisor's start never removes, or reports, another's segments). A
    supervisor names its segments ``twt-<namespace>-<per-start hex>-<slot>``.
    """
    real = os.path.realpath(run_dir)
    return _NS_MARK + hashlib.sha256(os.fsencode(real)).hexdigest()[:_NS_HEX]


def namespace_of(name: str) -> str | None:
    """The run-dir namespace a segment name carries, or None (an older version's name, an
    in-process registry's, a test's)."""
    if not name.startswith(SEGMENT_PREFIX):
        return None
    token = name[len(SEGMENT_PREFIX) :].split("-", 1)[0]
    return token if _NAMESPACE.match(token) else None


def is_legacy_name(name: str) -> bool:
    """True for a name as a supervisor made it before namespaces (``twt-<8 hex>-<slot>``).

    A supervisor's start removes such segments too when their owner is dead,
    as every start did before: a host upgraded after a crash is cleaned up.
    """
    return _LEGACY_NAME.match(name) is not None


class QuotaCounters:
    """Everything a tenant's block holds, without the segment: what a tenant with no worker keeps.

    A block's state is its limits, its high-water marks, refusal and underflow counts, the
    shares (normally only the unattributed one - the supervisor's own charges - once every
    instance is reclaimed) and the GPU-time figures. :meth:`QuotaBlock.counters` reads them and
    ``QuotaBlock.create(counters=...)`` writes them into a fresh segment, so a block taken down
    and made again reads the same :meth:`snapshot`. Meanwhile the supervisor charges and
    releases here (:meth:`consume_bytes` and friends, the block's rules in Python: refused past
    the limit with the typed error and a refusal counted, an over-release saturates and counts
    an underflow). Slotted and small: a parked tenant's whole quota footprint is this object.
    """

    __slots__ = ("generation", "memory_quota_bytes", "gpu_memory_bytes_cap", "cuda_mem_pool_quota_bytes",
                 "cpu_high_water", "cpu_refusals", "cpu_underflows", "gpu_high_water", "gpu_refusals",
                 "gpu_underflows", "cpu_held", "gpu_held", "instance_shares", "gpu_time")

    def __init__(self, *, generation: int, memory_quota_bytes: int, gpu_memory_bytes_cap: int | None,
                 cuda_mem_pool_quota_bytes: int | None) -> None:
        self.generation = _check_amount(generation, "generation")
        self.memory_quota_bytes = _check_amount(memory_quota_bytes, "memory_quota_bytes")
        _limit_to_raw(gpu_memory_bytes_cap, "gpu_memory_bytes_cap")
        _limit_to_raw(cuda_mem_pool_quota_bytes, "recorded_cuda_mem_pool_quota")
        self.gpu_memory_bytes_cap = gpu_memory_bytes_cap
        self.cuda_mem_pool_quota_bytes = cuda_mem_pool_quota_bytes
        self.cpu_high_water = self.cpu_refusals = self.cpu_underflows = 0
        self.gpu_high_water = self.gpu_refusals = self.gpu_underflows = 0
        #: the unattributed share (the supervisor's charges: parked buffers' host copies, regions)
        self.cpu_held = self.gpu_held = 0
        #: (instance, cpu, gpu) of instances still holding bytes (none once every worker is reclaimed)
        self.instance_shares: tuple[tuple[int, int, int], ...] = ()
        #: (ns, ops, waits, wait ns, throttled, *wait bins), or None while all are zero
        self.gpu_time: tuple[int, ...] | None = None

    def copy(self) -> QuotaCounters:
        """An equal record of its own (records are shared between tenants until one changes)."""
        twin = QuotaCounters.__new__(QuotaCounters)
        for name in QuotaCounters.__slots__:
            setattr(twin, name, getattr(self, name))
        return twin

    # the use, derived as on the block: the sum of the shares
    @property
    def bytes_in_use(self) -> int:
        return self.cpu_held + sum(c for _, c, _ in self.instance_shares)

    @property
    def gpu_bytes_in_use(self) -> int:
        return self.gpu_held + sum(g for _, _, g in self.instance_shares)

    @property
    def gpu_time_ns(self) -> int:
        return self.gpu_time[0] if self.gpu_time else 0

    def snapshot(self, tenant_id: str, name: str = "") -> QuotaSnapshot:
        """The block's snapshot as it would read (``name``: no segment, "")."""
        gt = self.gpu_time or (0,) * (5 + len(GPU_WAIT_BUCKETS_S) + 1)
        return QuotaSnapshot(
            tenant_id=tenant_id, name=name, generation=self.generation,
            bytes_in_use=self.bytes_in_use, memory_quota_bytes=self.memory_quota_bytes,
            cpu_high_water=self.cpu_high_water, cpu_refusals=self.cpu_refusals,
            cpu_underflows=self.cpu_underflows, gpu_bytes_in_use=self.gpu_bytes_in_use,
            gpu_memory_bytes_cap=self.gpu_memory_bytes_cap, gpu_high_water=self.gpu_high_water,
            gpu_refusals=self.gpu_refusals, gpu_underflows=self.gpu_underflows,
            cuda_mem_pool_quota_bytes=self.cuda_mem_pool_quota_bytes, instance_shares=self.instance_shares,
            gpu_time_ns=gt[0], gpu_ops=gt[1], gpu_waits=gt[2], gpu_wait_ns=gt[3], gpu_throttled=gt[4],
            gpu_wait_bins=tuple(gt[5:]),
        )

    def set_limits(self, *, memory_quota_bytes: int | Unchanged = UNCHANGED,
                   gpu_memory_bytes_cap: int | None | Unchanged = UNCHANGED,
                   recorded_cuda_mem_pool_quota: int | None | Unchanged = UNCHANGED) -> None:
        """As :meth:`QuotaBlock.set_limits` (validated all first: nothing half-applied)."""
        mem = None if memory_quota_bytes is UNCHANGED else _check_amount(memory_quota_bytes, "memory_quota_bytes")
        if gpu_memory_bytes_cap is not UNCHANGED:
            _limit_to_raw(gpu_memory_bytes_cap, "gpu_memory_bytes_cap")
        if recorded_cuda_mem_pool_quota is not UNCHANGED:
            _limit_to_raw(recorded_cuda_mem_pool_quota, "recorded_cuda_mem_pool_quota")
        if mem is not None:
            self.memory_quota_bytes = mem
        if gpu_memory_bytes_cap is not UNCHANGED:
            self.gpu_memory_bytes_cap = gpu_memory_bytes_cap
        if recorded_cuda_mem_pool_quota is not UNCHANGED:
            self.cuda_mem_pool_quota_bytes = recorded_cuda_mem_pool_quota

    def consume_bytes(self, n: int, tenant_id: str) -> None:
        """Charge ``n`` host bytes to the unattributed share, or MemoryExhausted (a refusal counted)."""
        n = _check_amount(n, "n")
        used = self.bytes_in_use
        if used + n > self.memory_quota_bytes:
            self.cpu_refusals += 1
            raise MemoryExhausted(tenant_id, n, self.memory_quota_bytes, used)
        self.cpu_held += n
        self.cpu_high_water = max(self.cpu_high_water, used + n)

    def consume_gpu_bytes(self, n: int, tenant_id: str) -> None:
        """Charge ``n`` GPU bytes to the unattributed share, or GpuMemoryExhausted (a refusal counted)."""
        n = _check_amount(n, "n")
        used = self.gpu_bytes_in_use
        cap = self.gpu_memory_bytes_cap
        if cap is not None and used + n > cap:
            self.gpu_refusals += 1
            raise GpuMemoryExhausted(tenant_id, n, cap, used)
        self.gpu_held += n
        self.gpu_high_water = max(self.gpu_high_water, used + n)

    def release_bytes(self, n: int, tenant_id: str) -> None:
        """Give back ``n`` host bytes of the unattributed share; more than it holds saturates at 0
        and counts (and logs) an underflow, as the block does."""
        n = _check_amount(n, "n")
        if n > self.cpu_held:
            self.cpu_underflows += 1
            log_event(_log, logging.WARNING, "quota.underflow", tenant=tenant_id, resource="cpu", released=n,
                      in_use=self.bytes_in_use, segment="")
        self.cpu_held = max(0, self.cpu_held - n)

    def release_gpu_bytes(self, n: int, tenant_id: str) -> None:
        """As :meth:`release_bytes` for GPU bytes."""
        n = _check_amount(n, "n")
        if n > self.gpu_held:
            self.gpu_underflows += 1
            log_event(_log, logging.WARNING, "quota.underflow", tenant=tenant_id, resource="gpu", released=n,
                      in_use=self.gpu_bytes_in_use, segment="")
        self.gpu_held = max(0, self.gpu_held - n)

    def reclaim_instance(self, index: int) -> tuple[int, int]:
        """Take an instance's share out (what :meth:`QuotaBlock.reclaim_instance` does)."""
        if not 0 <= index < MAX_INSTANCES:
            raise ValueError(f"instance {index} out of range 0..{MAX_INSTANCES - 1}")
        found = [(c, g) for i, c, g in self.instance_shares if i == index]
        self.instance_shares = tuple(t for t in self.instance_shares if t[0] != index)
        return found[0] if found else (0, 0)


class QuotaBlock(MappedSegment):
    """One tenant's CPU and GPU byte quotas, shared by its processes.

    Create with :meth:`create` (the owner) or :meth:`attach` (a worker). The
    four quota methods are C methods bound per block; they raise
    :class:`MemoryExhausted` / :class:`GpuMemoryExhausted` on refusal
    (nothing is consumed then), ``TypeError`` / ``ValueError`` for a bad
    amount, and :class:`SegmentError` once the block is closed.
    """

    _what = "quota block"
    consume_bytes: Callable[[int], None]
    release_bytes: Callable[[int], None]
    consume_gpu_bytes: Callable[[int], None]
    release_gpu_bytes: Callable[[int], None]

    def __init__(self, segment: _shm.Segment, tenant_id: str, *, owner: bool, instance: int | None) -> None:
        """Internal: use :meth:`create` or :meth:`attach`."""
        self._map(segment, owner=owner)
        self._instance = instance
        self.tenant_id = TenantId(tenant_id)
        name = segment.name
        tid = self.tenant_id

        def refuse_cpu(n: int, used: int, limit: int) -> BaseException:
            return MemoryExhausted(tid, n, limit, used)

        def refuse_gpu(n: int, used: int, limit: int) -> BaseException:
            return GpuMemoryExhausted(tid, n, limit, used)

        def underflow(resource: str) -> Callable[[int, int], None]:
            def warn(n: int, used: int) -> None:
                log_event(
                    _log,
                    logging.WARNING,
                    "quota.underflow",
                    tenant=tid,
                    resource=resource,
                    released=n,
                    in_use=used,
                    segment=name,
                )

            return warn

        closed = self._on_closed()
        slot = _UNATTRIBUTED if instance is None else instance
        self._cpu = _atomics.ShareCounter(
            self._buf, _CPU, _INSTANCES, _LINE, _S_NSLOTS, slot, _UNATTRIBUTED,
            refuse_cpu, underflow("cpu"), closed,
        )
        self._gpu = _atomics.ShareCounter(
            self._buf, _GPU, _INSTANCES + 8, _LINE, _S_NSLOTS, slot, _UNATTRIBUTED,
            refuse_gpu, underflow("gpu"), closed,
        )
        self.consume_bytes = self._cpu.consume
        self.release_bytes = self._cpu.release
        self.consume_gpu_bytes = self._gpu.consume
        self.release_gpu_bytes = self._gpu.release
        self._bind_counters(self._cpu, self._gpu)

    # ------------------------------------------------------------ lifecycle

    @classmethod
    def create(
        cls,
        tenant_id: str,
        *,
        memory_quota_bytes: int = DEFAULT_QUOTA_BYTES,
        gpu_memory_bytes_cap: int | None = None,
        recorded_cuda_mem_pool_quota: int | None = None,
        name: str | None = None,
        generation: int = 0,
        counters: QuotaCounters | None = None,
    ) -> QuotaBlock:
        """Create the tenant's segment; this process owns it and must :meth:`unlink` it.

        ``gpu_memory_bytes_cap=None`` means operator trust: GPU bytes are
        counted, never refused. ``name`` defaults to a fresh ``twt-<hex>-0``.
        ``counters`` (what :meth:`counters` read from an earlier block of the tenant) are written
        into the new segment before anyone can attach: limits, marks, counts, shares, GPU time
        (the limit and generation arguments are then ignored).
        """
        if counters is not None:
            memory_quota_bytes = counters.memory_quota_bytes
            gpu_memory_bytes_cap = counters.gpu_memory_bytes_cap
            recorded_cuda_mem_pool_quota = counters.cuda_mem_pool_quota_bytes
            generation = counters.generation
        tid = TenantId(tenant_id)
        cpu_limit = _check_amount(memory_quota_bytes, "memory_quota_bytes")
        gpu_limit = _limit_to_raw(gpu_memory_bytes_cap, "gpu_memory_bytes_cap")
        pool_quota = _limit_to_raw(recorded_cuda_mem_pool_quota, "recorded_cuda_mem_pool_quota")
        _check_amount(generation, "generation")
        seg_name = name or new_segment_name()
        if not seg_name.startswith(SEGMENT_PREFIX):
            raise ValueError(f"segment name must start with {SEGMENT_PREFIX!r}: {seg_name!r}")
        # fd kept: the owner checks the size before touching (a same-uid ftruncate is no SIGBUS)
        seg = _shm.create(seg_name, SEGMENT_BYTES, keep_fd=True)
        try:
            buf = seg.buf
            _atomics.store(buf, _CPU + _atomics.F_LIMIT, cpu_limit)
            _atomics.store(buf, _GPU + _atomics.F_LIMIT, gpu_limit)
            _atomics.store(buf, _S_POOL_QUOTA, pool_quota)
            if counters is not None:
                _restore(buf, counters)
            write_header(buf, KIND_TENANT, tid, generation, SEGMENT_BYTES)
            return cls(seg, tid, owner=True, instance=None)
        except BaseException:
            seg.close()
            seg.unlink()
            raise

    @classmethod
    def attach(cls, name: str, *, instance: int | None = None) -> QuotaBlock:
        """Attach to an existing block without owning it (never unlinks, never warns).

        With ``instance``, this process's consumption is also recorded as that
        instance's share, which the supervisor reclaims if the process dies.
        """
        if instance is not None:
            if not is_int(instance):
                raise TypeError(f"instance must be an int, not {type(instance).__name__}")
            if not 0 <= instance < MAX_INSTANCES:
                raise ValueError(f"instance {instance} out of range 0..{MAX_INSTANCES - 1}")
        if not isinstance(name, str) or not name.startswith(SEGMENT_PREFIX) or "/" in name:
            raise SegmentError(str(name), f"not a quota segment name (expected {SEGMENT_PREFIX}...)")
        seg = _attach(name, "does not exist (tenant evicted or supervisor gone?)")
        try:
            label = check_header(name, seg.buf, KIND_TENANT)
            try:
                tenant = TenantId(label)
            except ValueError:
                raise SegmentError(name, f"header names no valid tenant ({label!r:.80})") from None
            return cls(seg, tenant, owner=False, instance=instance)
        except BaseException:
            seg.close()
            raise

    @property
    def instance(self) -> int | None:
        return self._instance

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        role = "owner" if self._owner else f"attached instance={self._instance}"
        return f"<QuotaBlock {self.tenant_id!r} {self.name} {role} {state}>"

    # ----------------------------------------------------------------- reads

    def _load(self, off: int) -> int:
        if self._closed:
            raise SegmentError(self.name, "quota block is closed")
        return _atomics.load(self._buf, off)

    def _shares(self) -> list[tuple[int, int, int]]:
        """(slot, cpu, gpu) of every slot holding bytes: one bulk read (aligned
        8-byte loads are not torn on x86-64/arm64) instead of 130 atomic calls."""
        if self._closed:  # before the bulk read, which bypasses _load's check
            raise SegmentError(self.name, "quota block is closed")
        return self._shares_checked()

    def _shares_checked(self) -> list[tuple[int, int, int]]:
        """:meth:`_shares` once the caller has checked ``_closed``."""
        raw = self._buf[_INSTANCES:_LAYOUT_BYTES].cast("Q")
        step = _LINE // 8
        try:
            words = raw.tolist()  # one copy of the 65 lines, then plain list slicing (3x faster than indexing)
        finally:
            raw.release()
        return [(i, cpu, gpu) for i, (cpu, gpu) in enumerate(zip(words[0::step], words[1::step])) if cpu or gpu]

    @property
    def bytes_in_use(self) -> int:
        """Host bytes in use: the sum of every holder's share, granted bytes only (:func:`_granted`)."""
        high_water = self._load(_CPU + _atomics.F_HIGH_WATER)  # SegmentError once closed
        return _granted(self._cpu.load(), high_water)

    @property
    def gpu_bytes_in_use(self) -> int:
        """GPU bytes in use: the sum of every holder's share, granted bytes only (:func:`_granted`)."""
        high_water = self._load(_GPU + _atomics.F_HIGH_WATER)  # SegmentError once closed
        return _granted(self._gpu.load(), high_water)

    @property
    def memory_quota_bytes(self) -> int:
        return self._load(_CPU + _atomics.F_LIMIT)

    @property
    def gpu_memory_bytes_cap(self) -> int | None:
        return _raw_to_limit(self._load(_GPU + _atomics.F_LIMIT))

    @property
    def cuda_mem_pool_quota_bytes(self) -> int | None:
        return _raw_to_limit(self._load(_S_POOL_QUOTA))

    @property
    def generation(self) -> int:
        return self._load(_H_GEN)

    def instance_share(self, index: int) -> tuple[int, int]:
        """(cpu bytes, gpu bytes) currently held by worker instance ``index``."""
        if not 0 <= index < MAX_INSTANCES:
            raise ValueError(f"instance {index} out of range 0..{MAX_INSTANCES - 1}")
        off = _instance_off(index)
        return self._load(off), self._load(off + 8)

    def refusals(self) -> tuple[int, int]:
        """(cpu, gpu) refusal counts: two loads, for the supervisor's look each second at every
        tenant a worker serves (a whole :meth:`snapshot` is ~35 us: 70 of them held its loop for
        2-7 ms each second)."""
        return self._load(_CPU + _atomics.F_REFUSALS), self._load(_GPU + _atomics.F_REFUSALS)

    def snapshot(self) -> QuotaSnapshot:
        """Every counter, high-water mark, refusal and underflow count."""
        # closed / truncated checked once for the whole snapshot: ``_load`` checks it each time,
        # and the truncation check is an fstat - 29 of them made a snapshot cost ~35 us
        if self._closed:
            raise SegmentError(self.name, "quota block is closed")
        load = partial(_atomics.load, self._buf)
        slots = self._shares_checked()
        shares = [t for t in slots if t[0] != _UNATTRIBUTED]
        cpu_high_water = load(_CPU + _atomics.F_HIGH_WATER)
        gpu_high_water = load(_GPU + _atomics.F_HIGH_WATER)
        return QuotaSnapshot(
            tenant_id=self.tenant_id,
            name=self.name,
            generation=load(_H_GEN),
            bytes_in_use=_granted(sum(cpu for _, cpu, _ in slots), cpu_high_water),
            memory_quota_bytes=load(_CPU + _atomics.F_LIMIT),
            cpu_high_water=cpu_high_water,
            cpu_refusals=load(_CPU + _atomics.F_REFUSALS),
            cpu_underflows=load(_CPU + _atomics.F_UNDERFLOWS),
            gpu_bytes_in_use=_granted(sum(gpu for _, _, gpu in slots), gpu_high_water),
            gpu_memory_bytes_cap=_raw_to_limit(load(_GPU + _atomics.F_LIMIT)),
            gpu_high_water=gpu_high_water,
            gpu_refusals=load(_GPU + _atomics.F_REFUSALS),
            gpu_underflows=load(_GPU + _atomics.F_UNDERFLOWS),
            cuda_mem_pool_quota_bytes=_raw_to_limit(load(_S_POOL_QUOTA)),
            instance_shares=tuple(shares),
            gpu_time_ns=load(_GT_NS),
            gpu_ops=load(_GT_OPS),
            gpu_waits=load(_GT_WAITS),
            gpu_wait_ns=load(_GT_WAIT_NS),
            gpu_throttled=load(_GT_THROTTLED),
            gpu_wait_bins=tuple(load(_GT_BINS + 8 * i) for i in range(len(GPU_WAIT_BUCKETS_S) + 1)),
        )

    def counters(self) -> QuotaCounters:
        """Every counter, as a :class:`QuotaCounters` a later block of the tenant is created from
        (read when no worker holds the block: a share that changed meanwhile would be lost)."""
        snap = self.snapshot()
        c = QuotaCounters(generation=snap.generation, memory_quota_bytes=snap.memory_quota_bytes,
                          gpu_memory_bytes_cap=snap.gpu_memory_bytes_cap,
                          cuda_mem_pool_quota_bytes=snap.cuda_mem_pool_quota_bytes)
        c.cpu_high_water, c.cpu_refusals, c.cpu_underflows = snap.cpu_high_water, snap.cpu_refusals, snap.cpu_underflows
        c.gpu_high_water, c.gpu_refusals, c.gpu_underflows = snap.gpu_high_water, snap.gpu_refusals, snap.gpu_underflows
        off = _instance_off(_UNATTRIBUTED)
        c.cpu_held, c.gpu_held = self._load(off), self._load(off + 8)
        c.instance_shares = snap.instance_shares
        gt = (snap.gpu_time_ns, snap.gpu_ops, snap.gpu_waits, snap.gpu_wait_ns, snap.gpu_throttled, *snap.gpu_wait_bins)
        c.gpu_time = gt if any(gt) else None
        return c

    # ------------------------------------------------------------ GPU time

    @property
    def gpu_time_ns(self) -> int:
        """GPU time accounted to the tenant so far (ns, every instance and device)."""
        return self._load(_GT_NS)

    def charge_gpu_time(self, ns: int, ops: int = 1) -> None:
        """Add ``ns`` of measured device time (a worker, after an op chunk ran on the device)."""
        if self._closed:
            raise SegmentError(self.name, "quota block is closed")
        _atomics.fetch_add(self._buf, _GT_NS, ns)
        _atomics.fetch_add(self._buf, _GT_OPS, ops)

    def observe_gpu_wait(self, ns: int) -> None:
        """Record one op's wait for the device (0 when its worker already held the lease)."""
        if self._closed:
            raise SegmentError(self.name, "quota block is closed")
        buf = self._buf
        _atomics.fetch_add(buf, _GT_WAITS, 1)
        _atomics.fetch_add(buf, _GT_WAIT_NS, ns)
        _atomics.fetch_add(buf, _GT_BINS + 8 * bisect_left(_GT_BOUNDS_NS, ns), 1)  # the first bound >= ns

    def observe_gpu_waits(self, waits: Sequence[int]) -> None:
        """Record many ops' waits at once (a batch of small ops launched together): the same
        counters as one :meth:`observe_gpu_wait` each, one atomic add per bin touched."""
        if self._closed:
            raise SegmentError(self.name, "quota block is closed")
        if not waits:
            return
        bounds = _GT_BOUNDS_NS
        bins: dict[int, int] = {}
        for ns in waits:
            i = bisect_left(bounds, ns)  # the first bound >= ns, as in observe_gpu_wait
            bins[i] = bins.get(i, 0) + 1
        buf = self._buf
        _atomics.fetch_add(buf, _GT_WAITS, len(waits))
        _atomics.fetch_add(buf, _GT_WAIT_NS, sum(waits))
        for i, n in bins.items():
            _atomics.fetch_add(buf, _GT_BINS + 8 * i, n)

    def count_gpu_throttled(self) -> None:
        """One more time the tenant's ``gpu_time_cap`` held it back."""
        if self._closed:
            raise SegmentError(self.name, "quota block is closed")
        _atomics.fetch_add(self._buf, _GT_THROTTLED, 1)

    # ---------------------------------------------------------------- admin

    def set_limits(
        self,
        *,
        memory_quota_bytes: int | Unchanged = UNCHANGED,
        gpu_memory_bytes_cap: int | None | Unchanged = UNCHANGED,
        recorded_cuda_mem_pool_quota: int | None | Unchanged = UNCHANGED,
    ) -> None:
        """Change limits live; omitted ones stay. ``None`` removes the GPU cap.

        Lowering a limit below current use refuses further consumption until
        usage falls under it; nothing already consumed is taken away.
        """
        updates: list[tuple[int, int]] = []
        if memory_quota_bytes is not UNCHANGED:
            updates.append((_CPU + _atomics.F_LIMIT, _check_amount(memory_quota_bytes, "memory_quota_bytes")))
        if gpu_memory_bytes_cap is not UNCHANGED:
            updates.append((_GPU + _atomics.F_LIMIT, _limit_to_raw(gpu_memory_bytes_cap, "gpu_memory_bytes_cap")))
        if recorded_cuda_mem_pool_quota is not UNCHANGED:
            updates.append(
                (_S_POOL_QUOTA, _limit_to_raw(recorded_cuda_mem_pool_quota, "recorded_cuda_mem_pool_quota"))
            )
        if self._closed:
            raise SegmentError(self.name, "quota block is closed")
        for off, value in updates:  # validated all first: nothing half-applied
            _atomics.store(self._buf, off, value)

    def reclaim_instance(self, index: int) -> tuple[int, int]:
        """Return a dead instance's share to the tenant; (cpu, gpu) bytes reclaimed.

        Called by the supervisor after the instance's process is gone (the
        driver frees a dead process's GPU memory), so its share cannot change.
        """
        if not 0 <= index < MAX_INSTANCES:
            raise ValueError(f"instance {index} out of range 0..{MAX_INSTANCES - 1}")
        if self._closed:
            raise SegmentError(self.name, "quota block is closed")
        off = _instance_off(index)
        # The tenant's use is the sum of shares: zeroing this one is the whole reclaim.
        cpu = _atomics.exchange(self._buf, off, 0)
        gpu = _atomics.exchange(self._buf, off + 8, 0)
        return cpu, gpu

    def reset_gpu(self, instance: int | None = None) -> int:
        """Zero GPU usage: of one dead ``instance`` (its share), or all of it; returns bytes reclaimed."""
        if instance is not None:
            return self.reclaim_instance_gpu(instance)
        if self._closed:
            raise SegmentError(self.name, "quota block is closed")
        return sum(_atomics.exchange(self._buf, _instance_off(i) + 8, 0) for i in range(MAX_INSTANCES + 1))

    def reclaim_instance_gpu(self, index: int) -> int:
        """Like :meth:`reclaim_instance` for the GPU share only."""
        if not 0 <= index < MAX_INSTANCES:
            raise ValueError(f"instance {index} out of range 0..{MAX_INSTANCES - 1}")
        if self._closed:
            raise SegmentError(self.name, "quota block is closed")
        return _atomics.exchange(self._buf, _instance_off(index) + 8, 0)


def _restore(buf: memoryview, c: QuotaCounters) -> None:
    """Write ``c``'s marks, counts, shares and GPU time into a fresh block (before its magic)."""
    store = partial(_atomics.store, buf)
    for line, (hw, refusals, underflows) in ((_CPU, (c.cpu_high_water, c.cpu_refusals, c.cpu_underflows)),
                                             (_GPU, (c.gpu_high_water, c.gpu_refusals, c.gpu_underflows))):
        store(line + _atomics.F_HIGH_WATER, hw)
        store(line + _atomics.F_REFUSALS, refusals)
        store(line + _atomics.F_UNDERFLOWS, underflows)
    off = _instance_off(_UNATTRIBUTED)
    store(off, c.cpu_held)
    store(off + 8, c.gpu_held)
    for index, cpu, gpu in c.instance_shares:
        store(_instance_off(index), cpu)
        store(_instance_off(index) + 8, gpu)
    if c.instance_shares:
        store(_S_NSLOTS, max(i for i, _, _ in c.instance_shares) + 1)
    if c.gpu_time is not None:
        for k, off in enumerate((_GT_NS, _GT_OPS, _GT_WAITS, _GT_WAIT_NS, _GT_THROTTLED)):
            store(off, c.gpu_time[k])
        for i, v in enumerate(c.gpu_time[5:]):
            store(_GT_BINS + 8 * i, v)


def _attach(name: str, missing: str) -> _shm._Attached:
    """Map an existing segment; :class:`SegmentError` saying ``missing`` when there is none."""
    try:
        return _shm.attach(name)
    except FileNotFoundError:
        raise SegmentError(name, missing) from None
    except (OSError, ValueError) as exc:
        raise SegmentError(name, f"cannot be mapped: {exc}") from None


def read_header(name: str) -> SegmentHeader:
    """Read a ``twt-*`` segment's header without owning or tracking it."""
    seg = _attach(name, "does not exist")
    try:
        buf = seg.buf
        if len(buf) < _LAYOUT_BYTES or _atomics.load(buf, _H_MAGIC) != MAGIC:
            raise SegmentError(name, "not a tensor-wasm-tenant segment (bad magic)")
        kind = _atomics.load(buf, _H_KIND)
        label = check_header(name, buf, kind)
        return SegmentHeader(
            name=name,
            kind=kind,
            owner_pid=_atomics.load(buf, _H_PID),
            owner_start_ms=_atomics.load(buf, _H_START),
            generation=_atomics.load(buf, _H_GEN),
            label=label,
        )
    finally:
        seg.close()


def _check_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not _NAMESPACE.match(namespace):
        raise ValueError(f"not a segment namespace (ns + {_NS_HEX} hex digits): {namespace!r}")
    return namespace


def stale_segments(prefix: str = SEGMENT_PREFIX, *, namespace: str | None = None) -> list[SegmentHeader]:
    """The headers of the ``twt-*`` segments whose recorded owner process is dead.

    With ``namespace``: only that run dir's segments (:func:`segment_namespace`)
    and names an older version made (:func:`is_legacy_name`); without: every
    segment under ``prefix`` on the host. Segments of live owners, and
    anything that is not our layout, are never listed.
    """
    if not prefix.startswith(SEGMENT_PREFIX):
        raise ValueError(f"prefix must start with {SEGMENT_PREFIX!r}")
    if namespace is not None:
        _check_namespace(namespace)
    found = []
    for name in _shm.list_segments(prefix):
        if namespace is not None and namespace_of(name) != namespace and not is_legacy_name(name):
            continue
        try:
            header = read_header(name)
        except SegmentError:
            continue
        if not header.owner_alive():
            found.append(header)
    return found


def _unfinished(name: str) -> bool:
    """Was this segment created and never given its header? Its creator died between
    ``shm_open`` and the magic (:func:`write_header` writes the magic last): a segment still
    empty (never sized), or sized but with no magic yet. Anything else - a complete header, a
    foreign magic, a segment too small to hold one - is not called unfinished."""
    try:
        seg = _shm.attach(name)
    except FileNotFoundError:
        return False
    except ValueError:  # "segment is empty" / "cannot mmap an empty file": never sized
        return True
    except OSError:
        return False
    try:
        buf = seg.buf
        return len(buf) >= _H_MAGIC + 8 and _atomics.load(buf, _H_MAGIC) == 0
    finally:
        seg.close()


def unfinished_segments(namespace: str, prefix: str = SEGMENT_PREFIX) -> list[str]:
    """The names of ``namespace``'s segments whose creation never finished (no header: no owner
    recorded, so :func:`stale_segments` cannot tell whether their owner lives).

    Only the supervisor of a run dir creates that run dir's segments, so a caller that holds the
    run dir's lock (a supervisor's start, before it creates any) knows every such segment's
    creator is dead: a whole process tree killed while a segment was being made leaves one.
    Anyone else must not remove them - a live supervisor's segment is unfinished for a moment.
    """
    _check_namespace(namespace)
    if not prefix.startswith(SEGMENT_PREFIX):
        raise ValueError(f"prefix must start with {SEGMENT_PREFIX!r}")
    return [name for name in _shm.list_segments(prefix) if namespace_of(name) == namespace and _unfinished(name)]


def cleanup_stale_segments(prefix: str = SEGMENT_PREFIX, *, namespace: str | None = None,
                           run_dir_locked: bool = False) -> list[str]:
    """Unlink the segments :func:`stale_segments` lists; return their names.

    A supervisor's start passes its run dir's ``namespace``: it removes what a
    killed predecessor on the same run dir left, never another run dir's
    segments (that supervisor's own restart reclaims and reports those).
    Without ``namespace`` every dead owner's segment on the host goes:
    ``twt cleanup --all-run-dirs``, an operator's act.

    ``run_dir_locked``: the caller holds the lock of the run dir of ``namespace`` and has
    created no segment yet (a supervisor's start): the namespace's unfinished segments
    (:func:`unfinished_segments`) go too, their creator being dead.
    """
    if run_dir_locked and namespace is None:
        raise ValueError("run_dir_locked needs the namespace of the locked run dir")
    removed = []
    for header in stale_segments(prefix, namespace=namespace):
        name = header.name
        try:
            _shm.unlink(name)
        except FileNotFoundError:
            continue
        removed.append(name)
        log_event(
            _log,
            logging.INFO,
            "quota.stale_segment_removed",
            segment=name,
            owner_pid=header.owner_pid,
            label=header.label,
            namespace=namespace_of(name),
        )
    if run_dir_locked:
        assert namespace is not None
        for name in unfinished_segments(namespace, prefix):
            try:
                _shm.unlink(name)
            except FileNotFoundError:
                continue
            removed.append(name)
            log_event(_log, logging.INFO, "quota.unfinished_segment_removed", segment=name, namespace=namespace)
    return removed
