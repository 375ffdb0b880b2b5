"""A registered tenant's runtime state in the supervisor: instances, restarts, waiting requests.

What happens to an instance after its worker exits - nothing, a successor, a restart now or
after a back-off, or the tenant marked ``failed`` - is decided by
:func:`supervisor.runtime.restart_policy.after_exit` (a pure function: the policy as a table);
this module keeps the state it reads (``restart_times``, the slots). An instance whose worker
exited 0 and is not restarted is *completed*; a tenant whose instances all are is
``completed``, a terminal state that is no failure (``twt status`` exits 0 for it).

A tenant scaled to 0 instances is ``stopped``: its requests are refused at
once with :class:`~shared.errors.TenantStopped`. Requests wait (are parked)
only while a wanted instance is starting or restarting
(:meth:`TenantRuntime.coming_up`).

A tenant with ``idle_timeout_s`` is *parked* after that long without a request
(:mod:`supervisor.lifecycle.parking`): ``TenantRuntime.park`` then holds its
buffers' host copies and the phase of the move (:class:`ParkRecord`), and its
state is ``parked``. Mind the two meanings: ``TenantRuntime.parked`` is the queue
of *waiting requests* (:class:`~supervisor.runtime.requests.Parked` records, a
name older than parking tenants); ``TenantState.PARKED`` / ``TenantRuntime.park``
are the tenant's own parked state.
"""

from __future__ import annotations

import collections
import enum
import time
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

from shared.records import ExitRecord
from shared.spec import TenantSpec
from supervisor.runtime.completion import Completion
from supervisor.runtime.requests import Parked
from supervisor.store.parked_bytes import ParkedSpan
from supervisor.store.tenant_quota import TenantQuota
from supervisor.runtime.workers import WorkerHandle, WorkerState

__all__ = ["InstanceSlot", "ParkPhase", "ParkRecord", "ParkedBuffer", "TenantRuntime", "TenantState"]

class TenantState(str, enum.Enum):
    STARTING = "starting"  # registered, no instance ready yet
    RUNNING = "running"  # every wanted instance ready
    DEGRADED = "degraded"  # some instance restarting
    FAILED = "failed"  # restart intensity exceeded
    STOPPED = "stopped"  # scaled to 0 instances: requests refused at once (TenantStopped)
    EVICTING = "evicting"
    #: every wanted instance ended cleanly (exit 0) and its restart policy (on-failure, never) keeps it
    #: ended: the tenant's work is done - terminal and healthy, not an alert (``twt restart`` runs it
    #: again)
    COMPLETED = "completed"
    PARKED = "parked"  # idle: no worker, its buffers held by the supervisor (supervisor.lifecycle.parking)


class ParkPhase(str, enum.Enum):
    """Where a tenant is in parking or activation (:mod:`supervisor.lifecycle.parking`)."""

    EXPORTING = "exporting"  # its buffers are copied to the supervisor; its workers still serve nothing new
    STOPPING = "stopping"  # the copy is whole; its workers were told to exit
    PARKED = "parked"  # no worker; the host copy is all there is
    ACTIVATING = "activating"  # workers bound with the old incarnation; the buffers go back in


@dataclass(eq=False)
class ParkedBuffer:
    """One buffer's host copy (filled chunk by chunk while exporting): its own bytearray, or its
    span of the instance's parked file (supervisor.store.parked_bytes)."""

    handle: int
    data: bytearray | ParkedSpan


@dataclass(eq=False)
class ParkRecord:
    """A parked (or parking, or activating) tenant's buffers and progress."""

    phase: ParkPhase
    since: float
    #: instance index -> its buffers' host copies, and the sequence of its last handle
    buffers: dict[int, list[ParkedBuffer]] = field(default_factory=dict)
    seqs: dict[int, int] = field(default_factory=dict)
    #: host bytes charged to the tenant's memory quota for the copies (the supervisor's share)
    charged: int = 0
    #: instance indexes whose export (or import) is not done yet
    todo: set[int] = field(default_factory=set)
    #: the instance indexes an import is running on, with the worker doing it
    importing: dict[int, object] = field(default_factory=dict)
    #: a request came while the workers were stopping: activate once they are gone
    wanted: bool = False

    @property
    def host_bytes(self) -> int:
        return sum(len(b.data) for bufs in self.buffers.values() for b in bufs)


@dataclass(eq=False, slots=True)
class InstanceSlot:
    index: int
    worker: WorkerHandle | None = None
    incarnation: int = 0
    restarts: int = 0
    restart_at: float | None = None  # scheduled restart (monotonic)
    last_exit: ExitRecord | None = None
    draining: bool = False  # being scaled away
    replace: bool = False  # start a new worker when the current one (stopped on purpose) exits
    #: its buffers are parked: the next worker keeps the incarnation their handles carry
    keep_incarnation: bool = False
    #: its worker exited 0 and the restart policy left it so (on-failure, never): done, not down
    completed: bool = False
    #: handles of this incarnation whose bytes are gone without a restart (a parked file lost
    #: before its import): they answer BufferLost; None while there are none, emptied by a restart
    lost: set[int] | None = None

    @property
    def ready(self) -> bool:
        return self.worker is not None and self.worker.state is WorkerState.READY and not self.draining

    @property
    def coming_up(self) -> bool:
        """Ready, starting, or due to restart: worth waiting for."""
        return not self.draining and (self.worker is not None or self.restart_at is not None)


T = TypeVar("T")


@dataclass(eq=False, slots=True)
class _Rare:
    """What only some tenants ever hold - a restart, a rolling restart, a failure, a module sent,
    a reset waiting - kept apart from :class:`TenantRuntime` and made at its first write: ten
    thousand parked tenants hold none (8 B a field each otherwise)."""

    restarts_total: int = 0
    failed_reason: str | None = None
    seen_refusals: int = 0
    rr: int = 0
    restoring: bool = False
    rolling_slot: InstanceSlot | None = None
    rolling_incarnation: int = 0
    restart_times: collections.deque[float] | None = None
    modules: collections.OrderedDict[str, bytes] | None = None
    rolling: collections.deque[int] | None = None
    ready_waiters: list[Completion[dict[str, object]]] | None = None


#: the values a tenant without its own :class:`_Rare` reads (never written)
_NO_RARE: Final = _Rare()


class _RareField(Generic[T]):
    """A :class:`TenantRuntime` attribute kept in its :class:`_Rare` (read: the default while it
    has none; written: the record is made, unless the value written is the default)."""

    __slots__ = ("name",)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, rt: TenantRuntime, owner: type | None = None) -> T:
        value: T = getattr(rt._rare or _NO_RARE, self.name)
        return value

    def __set__(self, rt: TenantRuntime, value: T) -> None:
        if rt._rare is None and value == getattr(_NO_RARE, self.name):
            return  # its default: nothing to hold
        setattr(rt.own_rare(), self.name, value)


@dataclass(eq=False, slots=True)
class TenantRuntime:
    """A registered tenant in the supervisor's loop.

    Small, because ten thousand registered tenants, most of them parked, must cost the
    supervisor little more than their records (docs/PERFORMANCE.md, "Ten thousand tenants"):
    slotted; its queues made on first use (``parked``, ``restart_times``, ``rolling``,
    ``modules``, ``register_waiters``, ``ready_waiters``: an empty deque costs 760 B); what
    only some tenants ever set (restarts, a rolling restart, a failure, refusals seen) kept in
    a :class:`_Rare` made at its first write; and ``slots`` a tuple (``()`` for a tenant without
    instances: shared). Read them all freely; only a tenant that uses one pays for it. It is
    also the registry's entry of the tenant (:meth:`~supervisor.store.registry.TenantRegistry.register_entry`):
    one record a tenant, not two.
    """

    spec: TenantSpec
    block: TenantQuota
    generation: int
    registered_at: float = field(default_factory=time.time)
    state: TenantState = TenantState.STARTING
    #: its instances by index; replaced, never changed in place (a scale builds a new tuple)
    slots: tuple[InstanceSlot, ...] = ()
    in_flight: int = 0
    device: int = 0
    #: where the tenant came from: the config file ("file") or a register request ("runtime")
    origin: str = "runtime"
    #: the loop clock of the last tenant request (0: none yet): the idle time before parking
    last_request: float = 0.0
    #: parked, parking or activating (supervisor.lifecycle.parking); None: active
    park: ParkRecord | None = None
    # the containers behind the properties below: None until first used
    _parked: collections.deque[Parked] | None = None
    _register_waiters: list[tuple[Completion[dict[str, object]], bytes]] | None = None
    _rare: _Rare | None = None

    restarts_total = _RareField[int]()
    failed_reason = _RareField[str | None]()
    #: quota refusals already reported (``quota_refusal`` events)
    seen_refusals = _RareField[int]()
    rr = _RareField[int]()  # round-robin start for pick_slot
    #: brought back from the state at start: a failure to start marks it failed, never evicts it
    restoring = _RareField[bool]()
    rolling_slot = _RareField[InstanceSlot | None]()
    rolling_incarnation = _RareField[int]()

    def own_rare(self) -> _Rare:
        """The tenant's own :class:`_Rare` (made now if it has none)."""
        if self._rare is None:
            self._rare = _Rare()
        return self._rare

    @property
    def register_waiters(self) -> list[tuple[Completion[dict[str, object]], bytes]]:
        """(client, rid, capability bytes) of register requests answered once every instance is
        ready. Assigning an empty list drops the list (it is made again when next used)."""
        if self._register_waiters is None:
            self._register_waiters = []
        return self._register_waiters

    @register_waiters.setter
    def register_waiters(self, value: list[tuple[Completion[dict[str, object]], bytes]]) -> None:
        self._register_waiters = value or None

    @property
    def ready_waiters(self) -> list[Completion[dict[str, object]]]:
        """(client, rid, op) of reset/restart requests answered once the tenant runs (ServiceOps).
        Assigning an empty list drops the list (it is made again when next used)."""
        rare = self.own_rare()
        if rare.ready_waiters is None:
            rare.ready_waiters = []
        return rare.ready_waiters

    @ready_waiters.setter
    def ready_waiters(self, value: list[Completion[dict[str, object]]]) -> None:
        if value or self._rare is not None:
            self.own_rare().ready_waiters = value or None

    @property
    def waiters(self) -> bool:
        """Whether a register, reset or restart request waits for the tenant (read without making
        the lists)."""
        return bool(self._register_waiters) or (self._rare is not None and bool(self._rare.ready_waiters))

    @property
    def restart_times(self) -> collections.deque[float]:
        """When the restarts within ``restart_window_s`` happened (the restart intensity)."""
        rare = self.own_rare()
        if rare.restart_times is None:
            rare.restart_times = collections.deque()
        return rare.restart_times

    @property
    def parked(self) -> collections.deque[Parked]:
        """Requests waiting for an instance (or an activation), in arrival order."""
        if self._parked is None:
            self._parked = collections.deque()
        return self._parked

    @property
    def waiting(self) -> int:
        """How many requests wait in :attr:`parked` (read without making the queue)."""
        return len(self._parked) if self._parked is not None else 0

    @property
    def rolling_left(self) -> int:
        """How many instances a rolling restart still has to replace (read without making the queue)."""
        rolling = self._rare.rolling if self._rare is not None else None
        return len(rolling) if rolling is not None else 0

    @property
    def modules(self) -> collections.OrderedDict[str, bytes]:
        """Modules sent with put_module (digest -> bytes), least recently used first."""
        rare = self.own_rare()
        if rare.modules is None:
            rare.modules = collections.OrderedDict()
        return rare.modules

    @property
    def rolling(self) -> collections.deque[int]:
        """A rolling restart: the instance indexes still to replace (``rolling_slot``: the one
        being replaced)."""
        rare = self.own_rare()
        if rare.rolling is None:
            rare.rolling = collections.deque()
        return rare.rolling

    @property
    def tenant_id(self) -> str:
        return self.spec.tenant_id

    def live_slots(self) -> list[InstanceSlot]:
        return [s for s in self.slots if s.ready]

    def wanted_slots(self) -> list[InstanceSlot]:
        """The instances the tenant should run (not being scaled away)."""
        return [s for s in self.slots if not s.draining]

    def coming_up(self) -> bool:
        """Is a wanted instance ready, starting or due to restart? (Only then may a request wait.)"""
        return any(s.coming_up for s in self.slots)

    def pick_slot(self) -> InstanceSlot | None:
        """The least-loaded ready instance; ties go round-robin."""
        best: InstanceSlot | None = None
        best_load = 0
        n = len(self.slots)
        if n == 1:
            return self.slots[0] if self.slots[0].ready else None
        rr = self.rr = (self.rr + 1) % max(n, 1)  # (kept in the tenant's rare record: read once)
        slots = self.slots
        for k in range(n):
            slot = slots[(rr + k) % n]
            if slot.ready:
                assert slot.worker is not None
                load = len(slot.worker.in_flight)
                if best is None or load < best_load:
                    best, best_load = slot, load
        return best

    def record_restart(self, now: float) -> None:
        """Count a restart the policy decided (:mod:`supervisor.runtime.restart_policy`): the
        window keeps the restarts of the last ``restart_window_s``."""
        window = self.spec.restart_window_s
        self.restart_times.append(now)
        while self.restart_times and now - self.restart_times[0] > window:
            self.restart_times.popleft()
        self.restarts_total += 1

    def refresh_state(self) -> None:
        if self.state in (TenantState.FAILED, TenantState.EVICTING):
            return
        if self.park is not None and self.park.phase is not ParkPhase.EXPORTING:
            self.state = TenantState.STARTING if self.park.phase is ParkPhase.ACTIVATING else TenantState.PARKED
            return
        wanted = self.wanted_slots()
        ready = [s for s in wanted if s.ready]
        done = [s for s in wanted if s.completed and s.worker is None and s.restart_at is None]
        if not wanted:
            self.state = TenantState.STOPPED
        elif len(ready) == len(wanted):
            self.state = TenantState.RUNNING
        elif len(ready) + len(done) == len(wanted):
            # the rest ended cleanly and stay ended: running while one serves, else completed
            self.state = TenantState.RUNNING if ready else TenantState.COMPLETED
        elif any(s.last_exit is not None for s in wanted):
            self.state = TenantState.DEGRADED
        else:
            self.state = TenantState.STARTING
