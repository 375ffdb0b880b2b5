"""Parking: an idle tenant's workers exit, its buffers wait in a file of the run dir, and come back.

    active ──idle_timeout_s without a request──► EXPORTING   export_buffers, export_chunk ... per instance
       ▲                                            │ the copy is whole (a request meanwhile: cancelled,
       │                                            │ the tenant stays active; no fit: park_refused)
       │                                            ▼
       │                                         STOPPING    its workers told to exit (an expected stop)
       │                                            │ every worker gone
       │                                            ▼
       │                                         PARKED      no process; the host copies, charged to
       │                                            │        the tenant's memory quota
       │                                            │ any request that needs a worker
       │                                            ▼
       └──────── every instance imported ─────── ACTIVATING  pool workers bound with the old incarnation;
                 (the host copy released;                    right behind each bind, not waiting for its
                  the waiting requests sent,                 answer: import_mapped (import_buffer chunks
                  then load_modules)                         for a copy kept in memory); requests wait
                                                             in order in ``TenantRuntime.parked``

The rules that keep bytes and quota whole:

* **Copy first, stop after.** The workers are told to exit only once every
  buffer is whole in host memory. A worker that dies while exporting takes its
  buffers with it exactly as an active tenant's crash would (its handles answer
  ``BufferLost``); the park is abandoned, the partial copy dropped and its
  charge released, and the restart policy handles the death as usual.
* **Keep the copy until the import is confirmed.** A worker that dies while
  importing is restarted by the restart policy with the *same* incarnation
  (``InstanceSlot.keep_incarnation``), and the import starts over from the host
  copy; the dead worker's partial imports are reclaimed with its quota share.
  "Confirmed" is every instance's import: an instance whose buffers are back
  but whose worker dies while another instance still imports goes back on the
  to-do list, and its replacement imports the host copy again (no request
  reached it in between, so the copy is exact).
* **Handles survive.** A handle encodes instance + incarnation + sequence
  (:func:`shared.protocol.make_handle`). A parked slot keeps its incarnation:
  the activating worker is bound with it, the buffers are imported under their
  old handles, and the allocator continues after the old sequence, so a freed
  handle never names a new buffer. An incarnation therefore is the life of a
  slot's buffers, not of a process: only a death that loses them bumps it.
* **Quota.** The host copies are charged to the tenant's memory quota (the
  supervisor's share of its block) from the moment the manifest is known until
  the import is confirmed; a park whose copies do not fit is refused with
  :class:`~shared.errors.MemoryExhausted` (event ``park_refused``) and the tenant
  stays active, its idle clock restarted. The GPU bytes leave the block when the
  stopped workers' shares are reclaimed and come back as the imports allocate.
  High-water marks, refusals, GPU time and the copies' charge move with the
  tenant's quota: once its last worker is gone the segment is taken down and
  every counter kept in the supervisor's record of it; the activation's first
  bind makes a fresh segment from that record before any worker attaches
  (:class:`~supervisor.store.tenant_quota.TenantQuota`; a parked tenant holds
  no segment and no descriptor). Whenever a tenant parks, its counters are stored
  with the parked flag (``persist``): a restart brings them back.

* **Where the copies are.** Each instance's copies are one file of the run dir
  (:class:`~supervisor.store.parked_bytes.ParkedBytes`): the export writes each
  chunk through to it, its descriptor is closed once the copy is whole, and the
  activating worker maps it and copies each buffer once (``import_mapped``). A
  file that cannot be made leaves the copies in the supervisor's memory
  (one ``bytearray`` per buffer, sent back in chunks). The file goes with the host copy:
  when the import is confirmed, the park cancelled, or the tenant evicted.

* **Compiled modules.** After its buffers, each instance hands over the
  wasmtime artifacts of the stored modules it compiled (``export_modules``);
  they are written to this tenant's own directory (supervisor.store.artifacts),
  and an activating instance gets them back after its buffers
  (``import_modules``: the worker holds them), so its first ``run_wasm`` does
  not compile; they are deserialized after the requests the activation was
  made for (``load_modules``) or at that run. The activation does not wait for
  the answer (the worker takes the artifacts before the requests sent after
  them); a worker that dies after its buffers
  were confirmed is an ordinary crash once the activation is done. Neither step
  can fail a park or an activation: what is missing is compiled at its run.

* **Room.** An activation starts workers only within ``max_active`` and each
  device's context bound; short of room it parks the least recently used idle
  tenants early and waits for their buffers to be copied out (``max_active``)
  or their workers to exit (a device's bound), or - nothing parkable - answers
  its requests ``CapacityExhausted`` with ``retry_after_s``. It never waits on
  a park that cannot happen. What ``max_active`` counts is the tenant workers
  alive *and in use*: a worker told to exit by a park whose copy is whole
  serves nothing more and its bytes are in the supervisor's host copy, so it
  no longer counts, and for the moments until it exits the processes may
  number ``max_active`` plus those stopping ones. A device's bound counts every
  worker until its process is gone (its context holds the device's memory).
  The parks that keep ``park_ahead`` places free, and idle tenants' parks, wait
  while an activation is out (:mod:`supervisor.lifecycle.quiet`: from
  :meth:`Parking.activate` until the requests it woke are answered), each to its
  bound; the one owed for room - no place free - does not.

Owns: every tenant's :class:`~supervisor.runtime.tenants.ParkRecord` and its
transitions. May touch: the worker set (requests, start, stop), the frontend's
waiting requests (sent once activation is done), the tenant's quota block (the
host copies' charge), the parked files (supervisor.store.parked_bytes), events
and the state store (the parked flag and counters, written on its writer
thread). Loop thread only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Final

import zmq

from shared.errors import CapacityExhausted, MemoryExhausted, TensorWasmError
from shared.log import get_logger, log_event
from shared.quota import QuotaSnapshot
from supervisor.lifecycle.module_artifacts import ModuleArtifacts
from supervisor.lifecycle.signals import Stage, TenantSignals
from supervisor.lifecycle.workerset import WorkerSet
from supervisor.store.parked_bytes import ParkedBytes, ParkedSpan
from supervisor.observe.events import EventBus
from supervisor.runtime.requests import Pending
from supervisor.runtime.tenants import InstanceSlot, ParkedBuffer, ParkPhase, ParkRecord, TenantRuntime, TenantState
from supervisor.runtime.workers import WorkerHandle, WorkerState

__all__ = ["IMPORT_WINDOW", "PARK_CHUNK_BYTES", "Parking", "RETRY_AFTER_UNKNOWN_S"]

_log = get_logger("supervisor")

#: the largest chunk of a buffer one export or import message carries
PARK_CHUNK_BYTES: Final = 4 << 20
#: import chunks in flight per instance at most: the supervisor's sends, the socket and the
#: worker's copies overlap instead of waiting for each other chunk by chunk
IMPORT_WINDOW: Final = 4
#: a refused activation's ``retry_after_s`` when no active tenant will park by itself (none has an
#: ``idle_timeout_s``): room comes only from an eviction or a tenant going idle, which nothing predicts
RETRY_AFTER_UNKNOWN_S: Final = 1.0
#: a tenant whose park was refused (its copies do not fit its memory quota) is not parked early
#: again for this long: it would be refused again, and the activation that waits for it should be
#: answered instead
EARLY_PARK_BACKOFF_S: Final = 5.0
#: without a ``park_ahead`` setting, 1/this of ``max_active`` is kept free (0 below this many)
PARK_AHEAD_DIV: Final = 16
#: a park ahead (the place an activation took, made free again) waits while an activation is out
#: (supervisor.lifecycle.quiet), as long as a place is still free for the next activation - an
#: export round trip and a worker's exit (~5 ms of CPU) ran across the woken tenant's restore and
#: first requests on a 2-core host - at most this long from when it was first held (the
#: housekeeping tick's look comes as often); one owed for room (no place free) begins at once
ROOM_HOLD_MAX_S: Final = 0.05
#: an idle tenant's park waits while an activation is out, at most this long (its idle timeout is
#: seconds or more: this is a small part of it, and no request waits for it)
IDLE_HOLD_MAX_S: Final = 0.25


class Parking:
    """Parks idle tenants and activates them on their next request (see the module docstring)."""

    def __init__(self, *, tenants: Mapping[str, TenantRuntime], workers: WorkerSet, events: EventBus,
                 signals: TenantSignals, clock: Callable[[], float],
                 persist: Callable[[str, bool, QuotaSnapshot | None], None] | None = None,
                 stopping: Callable[[], bool] = lambda: False, max_active: int | None = None,
                 device_bounds: Mapping[int, int] | None = None, artifacts: ModuleArtifacts | None = None,
                 run_dir: str | None = None, park_ahead: int | None = None) -> None:
        """``signals``: the tenant signals - parking hears of a ready instance first (an activation
        puts the buffers back before any request is sent) and of a stopped activation last, and
        tells them when a tenant serves again (a park cancelled, an activation done: what a ready
        instance means, ``TenantSignals.serving``: its waiting requests are sent, its waiters
        answered). ``persist(tenant, parked, quota)``: record the parked flag durably, and a parked
        tenant's quota counters with it (None: not recorded). ``stopping()``: the supervisor is
        stopping (nothing is activated then).
        ``max_active``: the most tenant workers alive at once (None: unbounded); ``park_ahead``: how
        many of those places are kept free by parking idle tenants ahead (None: ``max_active // 16``,
        see :meth:`_park_ahead`); ``device_bounds``:
        the same per device, where its memory budget over a worker's context cost bounds it.
        ``artifacts``: the tenants' compiled modules kept across a park (None: they compile after
        an activation). ``run_dir``: where the host copies are kept, a file per instance that its
        next worker restores with one copy (supervisor.store.parked_bytes; None: in the
        supervisor's memory, restored in chunks through the socket)."""
        self.tenants = tenants
        self.workers = workers
        self.events = events
        self.on_active = signals.serving
        self.clock = clock
        self.persist = persist
        self.stopping = stopping
        #: parks and activations done, and parks refused (status and tests read them)
        self.parks = 0
        self.activations = 0
        self.refusals = 0
        self.max_active = max_active
        self.park_ahead = (park_ahead if park_ahead is not None
                           else (max_active // PARK_AHEAD_DIV if max_active is not None else 0))
        #: parks begun to keep room free ahead of activations (status and tests read it)
        self.ahead_parks = 0
        self.artifacts = artifacts
        #: compiled modules an activation put back without a compile, by tenant (its ``activate`` event)
        self._artifacts_loaded: dict[str, int] = {}
        #: ``import_modules`` sent and not answered yet, by tenant; an ``activate`` event waiting
        #: for those answers (its other fields)
        self._modules_pending: dict[str, int] = {}
        self._activate_events: dict[str, dict[str, object]] = {}
        #: an activation in progress, by tenant: how each instance got its worker (warm, starting,
        #: spawned: WorkerSet.start_instance) and when the last instance's import began (its
        #: ``activate`` event splits activate_ms into bind_ms and restore_ms from these)
        self._how: dict[str, dict[str, int]] = {}
        self._bound_at: dict[str, float] = {}
        #: a woken tenant whose activation could not begin at once - it waits for room under
        #: ``max_active``, or for its own park to end - by tenant: since when (its ``activate``
        #: event's ``waited_ms``, the time before ``activate_ms`` began)
        self._waiting_since: dict[str, float] = {}
        self._waited_ms: dict[str, float] = {}
        #: the workers an activation handed compiled modules to, by tenant: told to load them
        #: (``load_modules``) after the requests the activation was made for
        self._load_after: dict[str, list[tuple[InstanceSlot, WorkerHandle]]] = {}
        self.device_bounds = dict(device_bounds or {})
        self.run_dir = run_dir
        #: the parked files of instances, by tenant and instance (see _host_copies)
        self._files: dict[str, dict[int, ParkedBytes]] = {}
        #: buffers an activation in progress found lost with their parked file, by tenant (its
        #: ``activate`` event's ``lost``)
        self._lost: dict[str, int] = {}
        #: parks begun to make room (before the tenant's idle time), and activations refused for room
        self.early_parks = 0
        self.capacity_refusals = 0
        #: parked tenants whose activation waits for the room early parks are making, in arrival order
        self._room_waiters: list[TenantRuntime] = []
        self._early: set[str] = set()
        #: of those, the parks begun to keep ``park_ahead`` places free (not for a waiting activation)
        self._ahead: set[str] = set()
        #: when each tenant's last park was refused (see EARLY_PARK_BACKOFF_S)
        self._refused_at: dict[str, float] = {}
        self._retrying = False
        #: while an activation is out, parks ahead and idle parks wait (ROOM_HOLD_MAX_S,
        #: IDLE_HOLD_MAX_S at most); the worker set's refills wait at the same gate
        self.quiet = workers.quiet
        #: the death watches of an export in progress, by tenant: taken off when it ends
        self._watches: dict[str, list[tuple[WorkerHandle, Callable[[WorkerHandle], None]]]] = {}
        signals.on_bind_sent(self._on_bind_sent)
        signals.on_instance_ready(Stage.BUFFERS, self._on_instance_ready)
        signals.on_instance_not_restarted(Stage.AFTER, lambda rt, *_: self.activation_stopped(rt))
        signals.on_tenant_failed(Stage.AFTER, lambda rt, _why: self.activation_stopped(rt))

    def _on_instance_ready(self, rt: TenantRuntime) -> None:
        self.instance_ready(rt)  # its answer is for activate(); the signals go on to the other stages

    def _on_bind_sent(self, rt: TenantRuntime, slot: InstanceSlot, worker: WorkerHandle) -> None:
        """A worker's bind to an instance being activated is on its way: the instance's import
        follows it at once, without waiting for the bind's answer (the worker serves them in
        order). The activation then waits for one answer (the import's) instead of two, one
        after the other - on a loaded host each answer is a wait for the worker to get a CPU,
        and then for the supervisor to. A bind that fails fails the import behind it too; that
        worker is killed for it and its replacement imports again (see :meth:`_import_start`)."""
        rec = rt.park
        if (rec is None or rec.phase is not ParkPhase.ACTIVATING or slot.index not in rec.todo
                or rec.importing.get(slot.index) is worker or slot.worker is not worker):
            return
        rec.importing[slot.index] = worker
        self._import_start(rt, rec, slot, worker)

    # ------------------------------------------------------------ parking

    def check_idle(self, now: float) -> None:
        """Housekeeping: park every tenant idle past its ``idle_timeout_s``; activations waiting
        for room look again (room also comes from evictions and deaths)."""
        self._retry_room_waiters()
        working = self._keep_room()
        for tid in [t for t in self._files if (o := self.tenants.get(t)) is None or o.park is None]:
            self._drop_files(tid)  # evicted while parked (or parking): its files go with it
        if self._refused_at:
            self._refused_at = {t: at for t, at in self._refused_at.items() if now - at < EARLY_PARK_BACKOFF_S}
        if self.quiet.held("idle") or not self.quiet.hold("idle", self._park_idle_held, IDLE_HOLD_MAX_S):
            return  # an activation is out: the idle parks wait for it (IDLE_HOLD_MAX_S at most)
        self._park_idle(now, working)

    def _park_idle_held(self) -> None:
        if not self.stopping():
            self._park_idle(self.clock(), None)

    def _park_idle(self, now: float, working: list[TenantRuntime] | None) -> None:
        """Park every tenant idle past its ``idle_timeout_s`` (``working``: the tenants a live
        worker serves, when the caller has them)."""
        for rt in working if working is not None else self._working():  # only a tenant a worker serves can park
            timeout = rt.spec.idle_timeout_s
            if timeout is None or rt.park is not None:
                continue
            if rt.last_request == 0.0:
                rt.last_request = now  # the idle clock starts with the first look at its workers
                continue
            if now - rt.last_request >= timeout and _parkable(rt):
                self.park(rt, now)

    def park(self, rt: TenantRuntime, now: float) -> None:
        """Begin parking ``rt``: ask each instance for its buffer list."""
        rec = ParkRecord(ParkPhase.EXPORTING, now)
        rt.park = rec
        for slot in rt.wanted_slots():
            worker = slot.worker
            assert worker is not None  # _parkable: every wanted slot is ready
            rec.todo.add(slot.index)

            def died(w: WorkerHandle, rt: TenantRuntime = rt, rec: ParkRecord = rec) -> None:
                self._died_exporting(rt, rec, w)

            worker.death_waiters.append(died)
            self._watches.setdefault(rt.tenant_id, []).append((worker, died))
            self._send(rt, slot, worker, "export_buffers", {}, None, self._manifest_of(rt, rec, slot))
        log_event(_log, logging.INFO, "tenant.parking", tenant=rt.tenant_id, instances=len(rec.todo))

    def _manifest_of(self, rt: TenantRuntime, rec: ParkRecord, slot: InstanceSlot) -> Callable[[bool, object], None]:
        def done(ok: bool, payload: object) -> None:
            self._on_manifest(rt, rec, slot, ok, payload)

        return done

    def _current(self, rt: TenantRuntime, rec: ParkRecord, phase: ParkPhase) -> bool:
        return self.tenants.get(rt.tenant_id) is rt and rt.park is rec and rec.phase is phase

    def _on_manifest(self, rt: TenantRuntime, rec: ParkRecord, slot: InstanceSlot, ok: bool, payload: object) -> None:
        if not self._current(rt, rec, ParkPhase.EXPORTING):
            return
        if not ok or not isinstance(payload, dict):
            self._abandon(rt, rec, f"export_buffers failed: {_message(payload)}")
            return
        listed = payload.get("buffers")
        seq = payload.get("seq")
        if not isinstance(listed, list) or not isinstance(seq, int):
            self._abandon(rt, rec, "export_buffers answered an unusable manifest")
            return
        sizes: list[tuple[int, int]] = []
        for entry in listed:
            if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, int) for x in entry)
                    and entry[1] > 0):
                self._abandon(rt, rec, "export_buffers answered an unusable manifest")
                return
            sizes.append((entry[0], entry[1]))
        need = sum(n for _, n in sizes)
        try:
            self._charge(rt, rec, need)  # before a byte of host memory is taken for the copies
            buffers = self._host_copies(rt, slot, sizes, need)
        except MemoryExhausted as exc:
            self._refuse(rt, rec, exc)
            return
        except MemoryError:  # within the quota, but the supervisor's host has not that much free
            snap = rt.block.snapshot()
            self._refuse(rt, rec, MemoryExhausted(
                rt.tenant_id, need, snap.memory_quota_bytes, snap.bytes_in_use,
                message=f"tenant {rt.tenant_id!r} was not parked: the supervisor could not take {need:,} B of "
                "host memory for its buffers; it stays active"))
            return
        rec.buffers[slot.index] = buffers
        rec.seqs[slot.index] = seq
        self._export_next(rt, rec, slot, 0, 0)

    def _host_copies(self, rt: TenantRuntime, slot: InstanceSlot, sizes: list[tuple[int, int]],
                     need: int) -> list[ParkedBuffer]:
        """The host copies of one instance's buffers: spans of one file in the run dir (restored
        with one copy), or - without a run dir, or when the file cannot be made (no space, no
        descriptor) - bytearrays (restored in chunks). MemoryError when neither fits."""
        if self.run_dir is not None and need > 0:
            try:
                parked = ParkedBytes.create(self.run_dir, need)
            except OSError as exc:
                log_event(_log, logging.WARNING, "tenant.park_file_failed", tenant=rt.tenant_id, nbytes=need,
                          error=str(exc), detail="its copy is kept in the supervisor's memory instead")
            else:
                self._files.setdefault(rt.tenant_id, {})[slot.index] = parked
                out = []
                offset = 0
                for handle, n in sizes:
                    out.append(ParkedBuffer(handle, ParkedSpan(parked, offset, n)))
                    offset += n
                return out
        return [ParkedBuffer(handle, bytearray(n)) for handle, n in sizes]

    def _drop_files(self, tid: str) -> None:
        """The host copies' files of ``tid`` go (the park cancelled, or the activation confirmed)."""
        for parked in self._files.pop(tid, {}).values():
            parked.close()

    def close(self) -> None:
        """The supervisor is stopping: every parked file goes (the host copies do not survive it,
        as documented; the next start would remove them anyway)."""
        for tid in list(self._files):
            self._drop_files(tid)

    def _charge(self, rt: TenantRuntime, rec: ParkRecord, need: int) -> None:
        """Charge ``need`` host bytes to the tenant's memory quota, or MemoryExhausted (nothing
        charged, no refusal counted: a park that does not fit is not the tenant's allocation)."""
        if need == 0:
            return
        snap = rt.block.snapshot()
        if snap.bytes_in_use + need > snap.memory_quota_bytes:
            raise MemoryExhausted(
                rt.tenant_id, need, snap.memory_quota_bytes, snap.bytes_in_use,
                message=f"tenant {rt.tenant_id!r} was not parked: its buffers need {need + rec.charged:,} B of host "
                f"memory and its memory quota has {max(0, snap.memory_quota_bytes - snap.bytes_in_use + rec.charged):,} B "
                f"free of {snap.memory_quota_bytes:,} B; it stays active (raise memory_quota_bytes or free buffers)",
            )
        rt.block.consume_bytes(need)
        rec.charged += need

    def _release(self, rt: TenantRuntime, rec: ParkRecord) -> None:
        if rec.charged and not rt.block.closed:
            rt.block.release_bytes(rec.charged)
        rec.charged = 0

    def _export_next(self, rt: TenantRuntime, rec: ParkRecord, slot: InstanceSlot, index: int, offset: int) -> None:
        """Copy the next chunk of instance ``slot``'s buffers (buffer ``index`` at ``offset``)."""
        buffers = rec.buffers[slot.index]
        if index >= len(buffers):
            self._export_modules(rt, rec, slot)
            return
        buf = buffers[index]
        n = min(PARK_CHUNK_BYTES, len(buf.data) - offset)
        worker = slot.worker
        if worker is None or worker.state is not WorkerState.READY:
            self._abandon(rt, rec, "an instance went away while its buffers were copied")
            return

        unwritten: list[str] = []

        def on_body(body: zmq.Frame | bytes | memoryview | None) -> None:
            if not self._current(rt, rec, ParkPhase.EXPORTING):
                return  # the park was cancelled (a request came) while this chunk was on its way: its file is gone
            data = memoryview(body.buffer if isinstance(body, zmq.Frame) else body or b"")
            if len(data) != n:
                return
            if isinstance(buf.data, bytearray):
                buf.data[offset:offset + n] = data
                return
            try:
                buf.data.write(offset, data)  # through to the instance's parked file
            except OSError as exc:
                unwritten.append(str(exc))

        def done(ok: bool, payload: object) -> None:
            if not self._current(rt, rec, ParkPhase.EXPORTING):
                return
            if not ok or not isinstance(payload, dict) or payload.get("nbytes") != n:
                self._abandon(rt, rec, f"export_chunk failed: {_message(payload)}")
                return
            if unwritten:
                self._abandon(rt, rec, f"the parked file could not take the copy: {unwritten[0]}")
                return
            if offset + n < len(buf.data):
                self._export_next(rt, rec, slot, index, offset + n)
            else:
                self._export_next(rt, rec, slot, index + 1, 0)

        self._send(rt, slot, worker, "export_chunk", {"handle": buf.handle, "offset": offset, "nbytes": n}, None,
                   done, on_body)

    def _export_modules(self, rt: TenantRuntime, rec: ParkRecord, slot: InstanceSlot) -> None:
        """The instance's buffers are whole: its compiled stored modules next, as artifacts kept in
        this tenant's own directory (module_artifacts). A failure costs only a compile later."""
        worker = slot.worker
        args = self.artifacts.export_args(rt) if self.artifacts is not None else None
        if args is None or worker is None or worker.state is not WorkerState.READY:
            self._slot_exported(rt, rec, slot)
            return
        got: list[bytes] = []

        def on_body(body: zmq.Frame | bytes | memoryview | None) -> None:
            got.append(body.bytes if isinstance(body, zmq.Frame) else bytes(body or b""))

        def done(ok: bool, payload: object) -> None:
            if not self._current(rt, rec, ParkPhase.EXPORTING):
                return
            if ok and self.artifacts is not None:
                self.artifacts.keep(rt, payload, got[0] if got else b"")
            self._slot_exported(rt, rec, slot)

        self._send(rt, slot, worker, "export_modules", args, None, done, on_body)

    def _slot_exported(self, rt: TenantRuntime, rec: ParkRecord, slot: InstanceSlot) -> None:
        rec.todo.discard(slot.index)
        if not rec.todo:
            self._exported(rt, rec)

    def _exported(self, rt: TenantRuntime, rec: ParkRecord) -> None:
        """Every buffer is whole in host memory: now the workers may go."""
        self._unwatch(rt)
        for parked in self._files.get(rt.tenant_id, {}).values():
            parked.seal()  # a parked tenant holds no descriptor
        rec.phase = ParkPhase.STOPPING
        workers = []
        for slot in rt.wanted_slots():
            slot.keep_incarnation = True
            if slot.worker is not None and slot.worker.state is not WorkerState.DEAD:
                workers.append(slot.worker)
        remaining = {w.worker_id for w in workers}
        rt.refresh_state()

        def gone(worker: WorkerHandle) -> None:
            remaining.discard(worker.worker_id)
            if not remaining and self.tenants.get(rt.tenant_id) is rt and rt.park is rec:
                self._parked(rt, rec)

        for worker in workers:
            worker.death_waiters.append(gone)
            self.workers.stop_worker(worker, "parked")
        if not workers:
            self._parked(rt, rec)
        else:
            self._retry_room_waiters()  # its stopping workers take no room in all now (see _alive)

    def _parked(self, rt: TenantRuntime, rec: ParkRecord) -> None:
        rec.phase = ParkPhase.PARKED
        rt.refresh_state()
        self.parks += 1
        early = rt.tenant_id in self._early
        ahead = rt.tenant_id in self._ahead
        self._early.discard(rt.tenant_id)
        self._ahead.discard(rt.tenant_id)
        self.events.emit("park", tenant=rt.tenant_id, buffers=sum(len(b) for b in rec.buffers.values()),
                         host_bytes=rec.host_bytes, park_ms=round((self.clock() - rec.since) * 1000, 3), early=early,
                         ahead=ahead)
        self._persist_parked(rt)
        if (rec.wanted or rt.waiting) and not self.stopping() and self._make_room(rt) is True:
            self.activate(rt)
        self._retry_room_waiters()  # its workers' room is free now

    def _persist_parked(self, rt: TenantRuntime) -> None:
        """Store that ``rt`` is parked, with its quota counters as they are now (its workers are
        gone: nothing changes them until it is activated, see supervisor.store.tenant_quota)."""
        if self.persist is None or rt.block.closed:
            return
        self.persist(rt.tenant_id, True, rt.block.snapshot())

    def _died_exporting(self, rt: TenantRuntime, rec: ParkRecord, worker: WorkerHandle) -> None:
        """A worker died while its buffers were copied: they went with it, as in any crash."""
        if self._current(rt, rec, ParkPhase.EXPORTING):
            self._abandon(rt, rec, f"worker {worker.worker_id} died while its buffers were copied")

    def _abandon(self, rt: TenantRuntime, rec: ParkRecord, why: str) -> None:
        """The park did not happen: the tenant stays active, its idle clock restarted."""
        log_event(_log, logging.WARNING, "tenant.park_abandoned", tenant=rt.tenant_id, reason=why)
        self._cancel(rt, rec)

    def _refuse(self, rt: TenantRuntime, rec: ParkRecord, exc: MemoryExhausted) -> None:
        self.refusals += 1
        self._refused_at[rt.tenant_id] = self.clock()
        self.events.emit("park_refused", tenant=rt.tenant_id, error=exc.to_dict())
        self._cancel(rt, rec)

    def _cancel(self, rt: TenantRuntime, rec: ParkRecord) -> None:
        self._unwatch(rt)
        self._release(rt, rec)
        rec.buffers.clear()
        self._drop_files(rt.tenant_id)
        rt.park = None
        rt.last_request = self.clock()
        rt.refresh_state()
        self._early.discard(rt.tenant_id)
        self._ahead.discard(rt.tenant_id)
        self.on_active(rt)
        self._retry_room_waiters()  # a park that was making room did not: they look elsewhere, or are refused

    def _unwatch(self, rt: TenantRuntime) -> None:
        for worker, watch in self._watches.pop(rt.tenant_id, ()):
            if worker.state is not WorkerState.DEAD and watch in worker.death_waiters:  # a dead one's are being run
                worker.death_waiters.remove(watch)

    # ------------------------------------------------------------ activation

    def wake(self, rt: TenantRuntime) -> None:
        """A request that needs a worker came for a parked (or parking) tenant; it waits in
        ``rt.parked`` until this is done. Raises CapacityExhausted when there is no room for its
        workers (``max_active``) and none can be made: the request is refused, not queued."""
        rec = rt.park
        if rec is None:
            return
        if rec.phase is ParkPhase.EXPORTING:  # nothing stopped yet: the tenant simply stays active
            self._cancel(rt, rec)
        elif rec.phase is ParkPhase.STOPPING:
            rec.wanted = True  # activated once its workers are gone
            self._waiting_since.setdefault(rt.tenant_id, self.clock())
        elif rec.phase is ParkPhase.PARKED and not self.stopping() and rt not in self._room_waiters:
            room = self._make_room(rt)
            if room is True:
                self.activate(rt)
            elif isinstance(room, CapacityExhausted):
                raise room
            else:
                self._waiting_since.setdefault(rt.tenant_id, self.clock())  # for room

    # ------------------------------------------------------------ room (max_active)

    def _working(self) -> list[TenantRuntime]:
        """The tenants that a live worker serves (starting, binding, ready or stopping), each once.

        The only tenants that can be parked, be parking or take room: a parked or stopped tenant
        has no worker. One pass over the workers (``max_active``, the pool and the stopping ones)
        instead of over every registered tenant: at 10,000 tenants that pass cost the loop
        ~10 ms a housekeeping tick and again after each activation, while requests waited."""
        seen: dict[str, TenantRuntime] = {}
        for worker in self.workers.workers.values():
            tid = worker.tenant
            if tid is not None and tid not in seen and worker.state is not WorkerState.DEAD:
                rt = self.tenants.get(tid)
                if rt is not None:
                    seen[tid] = rt
        return list(seen.values())

    def _alive(self) -> tuple[int, dict[int, int]]:
        """Tenant workers that take room now, in all (``max_active``) and per device
        (:meth:`_census`)."""
        total, per, _ = self._census()
        return total, per

    def _census(self) -> tuple[int, dict[int, int], list[TenantRuntime]]:
        """One pass over the workers for what room needs: the tenant workers that take room now,
        in all and per device, and the tenants a live worker serves (:meth:`_working`, in the
        same order). Two passes before, after every activation and at every housekeeping tick.

        In all: every worker bound to a tenant and not dead (starting, ready, stopping) except
        the stopping workers of a tenant whose buffers are already whole in host memory (its
        park in STOPPING): such a worker serves nothing more, holds nothing the tenant needs
        back, and only has to exit - an activation waiting for it would wait out a process exit
        for no reason. Per device: every one of them, stopping or not, since a worker's device
        context takes the device's memory until its process is gone."""
        total = 0
        per: dict[int, int] = {}
        seen: dict[str, TenantRuntime] = {}
        tenants = self.tenants
        dead = WorkerState.DEAD
        for worker in self.workers.workers.values():
            tid = worker.tenant
            if tid is None or worker.state is dead:
                continue
            owner = seen.get(tid)
            if owner is None:
                owner = tenants.get(tid)
                if owner is None:
                    total += 1  # its tenant is gone (being evicted): it takes room until it exits
                    continue
                seen[tid] = owner
            per[owner.device] = per.get(owner.device, 0) + 1
            if not _leaving(owner, worker):
                total += 1
        return total, per, list(seen.values())

    def _make_room(self, rt: TenantRuntime) -> bool | CapacityExhausted:
        """Whether parked ``rt`` may start its workers now (True), waits for the room early parks
        are making (False: queued in ``_room_waiters``), or cannot be placed (the error; the
        requests that waited for it are answered with it)."""
        bound = self.device_bounds.get(rt.device)
        if self.max_active is None and bound is None:
            return True
        need = len(rt.wanted_slots())
        total, per, working = self._census()
        short_all = total + need - self.max_active if self.max_active is not None else 0
        short_dev = per.get(rt.device, 0) + need - bound if bound is not None else 0
        if short_all <= 0 and short_dev <= 0:
            return True
        for other in working:  # parks in progress free their workers' room soon
            if other is not rt and other.park is not None and other.park.phase in (ParkPhase.EXPORTING,
                                                                                   ParkPhase.STOPPING):
                n = sum(1 for s in other.slots if s.worker is not None and s.worker.state is not WorkerState.DEAD)
                if other.park.phase is ParkPhase.EXPORTING:  # a STOPPING one's are not counted in all
                    short_all -= n
                short_dev -= n if other.device == rt.device else 0
        if short_all > 0 or short_dev > 0:
            now = self.clock()
            victims = self._idle_lru(working, now, rt)  # the least recently used first
            while short_all > 0 or short_dev > 0:  # (looked at only while room is still short)
                victim = next(victims, None)
                if victim is None:
                    break
                same = victim.device == rt.device
                if short_dev > 0 and not same and (short_all <= 0 or bound is not None):
                    continue  # it would not free this device
                n = len(victim.wanted_slots())
                self._early.add(victim.tenant_id)
                self.early_parks += 1
                log_event(_log, logging.INFO, "tenant.park_early", tenant=victim.tenant_id, for_tenant=rt.tenant_id)
                self.park(victim, now)
                short_all -= n
                short_dev -= n if same else 0
        if short_all > 0 or short_dev > 0:
            return self._refuse_room(rt, need, total, per.get(rt.device, 0), bound)
        if rt not in self._room_waiters:
            self._room_waiters.append(rt)
        return False

    def _idle_lru(self, working: list[TenantRuntime], now: float,
                  exclude: TenantRuntime | None) -> Iterator[TenantRuntime]:
        """The tenants of ``working`` an early park may take, least recently used first: not
        parking, with an ``idle_timeout_s``, idle and whole (:func:`_parkable`), not refused a
        park within ``EARLY_PARK_BACKOFF_S``. Looked at lazily, in that order: a caller takes one
        or two, and :func:`_parkable` (its quota block's look included: a syscall) is asked only
        of those, not of every active tenant after every activation at the bound (~60 looks,
        ~1 ms of the loop each time at ``max_active`` 64)."""
        for o in sorted((o for o in working
                         if o is not exclude and o.park is None and o.spec.idle_timeout_s is not None),
                        key=lambda o: o.last_request):
            if _parkable(o) and now - self._refused_at.get(o.tenant_id, -math.inf) >= EARLY_PARK_BACKOFF_S:
                yield o

    def _keep_room_held(self) -> None:
        self._keep_room(held=True)

    def _keep_room(self, *, held: bool = False) -> list[TenantRuntime] | None:
        """Keep ``park_ahead`` of ``max_active``'s places free: park the least recently used idle
        tenants past ``max_active - park_ahead``, after an activation took a place and at each
        housekeeping look, so that the next activation binds at once. Without it, every activation
        at the bound waited for an early park of another tenant (its export round trip and its
        workers' stop: ~15 ms quiet, a p50 of 20 ms at the density bench's 10,000 tenants).
        While an activation is out, only the park owed for room - no place free - begins; the
        rest wait for the quiet gate (ROOM_HOLD_MAX_S at most; ``held``: this is that look, and
        parks them all). Returns the tenants a live worker serves as it found them
        (:meth:`_census`; the same tenants after its parks, which only begin), None when it did
        not look."""
        ahead = self.park_ahead
        if self.max_active is None or ahead <= 0 or self.stopping() or self._room_waiters:
            return None  # (room waiters: _make_room is making room for them)
        total, _, working = self._census()
        free = self.max_active - total
        for other in working:  # an export in progress frees its workers' places soon
            if other.park is not None and other.park.phase is ParkPhase.EXPORTING:
                free += sum(1 for s in other.slots if s.worker is not None and s.worker.state is not WorkerState.DEAD)
        if free >= ahead:
            return working
        want = ahead
        if not held and not self.quiet.quiet:
            if not self.quiet.held("room"):
                self.quiet.hold("room", self._keep_room_held, ROOM_HOLD_MAX_S)
            want = 1  # a place for the next activation: owed now; the rest as the gate opens
        now = self.clock()
        victims = self._idle_lru(working, now, None)  # the least recently used first
        while free < want:  # (looked at only while places are still short)
            victim = next(victims, None)
            if victim is None:
                break
            self._early.add(victim.tenant_id)
            self._ahead.add(victim.tenant_id)
            self.ahead_parks += 1
            log_event(_log, logging.INFO, "tenant.park_ahead", tenant=victim.tenant_id, free=free, ahead=ahead)
            self.park(victim, now)
            free += len(victim.wanted_slots())
        return working

    def _refuse_room(self, rt: TenantRuntime, need: int, total: int, on_device: int,
                     bound: int | None) -> CapacityExhausted:
        """No room and none can be made: the waiting requests are answered, the tenant stays parked."""
        self._waiting_since.pop(rt.tenant_id, None)
        if self.max_active is not None and (bound is None or total + need - self.max_active > 0):
            in_use, limit, setting = total, self.max_active, "max_active"
        else:
            assert bound is not None
            in_use, limit, setting = on_device, bound, f"device {rt.device}'s context bound"
        retry = self._retry_after()
        exc = CapacityExhausted(
            "workers", in_use, need, limit, setting, retry_after_s=retry,
            message=f"tenant {rt.tenant_id!r} cannot be activated: {in_use} tenant workers alive of at most {limit} "
            f"({setting}), {need} more wanted, and no idle tenant can be parked to make room; retry after "
            f"{retry:g} s (or give more tenants an idle_timeout_s)")
        self.capacity_refusals += 1
        self.events.emit("activation_refused", tenant=rt.tenant_id, error=exc.to_dict())
        while rt.waiting:
            self.workers.pending.refuse_parked(rt.tenant_id, rt.parked.popleft(), exc)
        return exc

    def _retry_after(self) -> float:
        """When room may come: the soonest an active tenant reaches its idle timeout (it parks then,
        if idle), at least 0.1 s; RETRY_AFTER_UNKNOWN_S when no active tenant ever parks."""
        now = self.clock()
        due = [rt.last_request + rt.spec.idle_timeout_s - now for rt in self.tenants.values()
               if rt.park is None and rt.spec.idle_timeout_s is not None]
        return round(max(0.1, min(due)), 3) if due else RETRY_AFTER_UNKNOWN_S

    def _retry_room_waiters(self) -> None:
        """Activations waiting for room look again, in order: activated, still waiting, or refused.
        One whose requests all expired or were answered stops waiting (its next request wakes it)."""
        if self._retrying or not self._room_waiters:
            return
        self._retrying = True
        try:
            for rt in list(self._room_waiters):
                self._room_waiters.remove(rt)
                rec = rt.park
                if (self.tenants.get(rt.tenant_id) is not rt or rec is None or rec.phase is not ParkPhase.PARKED
                        or not rt.waiting or self.stopping()):
                    self._waiting_since.pop(rt.tenant_id, None)
                    continue
                if self._make_room(rt) is True:
                    self.activate(rt)
        finally:
            self._retrying = False

    def activate(self, rt: TenantRuntime) -> None:
        """Bind a worker to each instance (a warm one from the pool, else a fresh one), keeping
        the incarnation; :meth:`instance_ready` restores the buffers."""
        rec = rt.park
        assert rec is not None
        rec.phase = ParkPhase.ACTIVATING
        rec.since = self.clock()
        self.quiet.out(rt.tenant_id)  # held work waits until its requests are answered
        woken = self._waiting_since.pop(rt.tenant_id, None)
        self._waited_ms[rt.tenant_id] = round((rec.since - woken) * 1000, 3) if woken is not None else 0.0
        rec.wanted = False
        rec.todo = {slot.index for slot in rt.wanted_slots()}
        rec.importing.clear()
        rt.refresh_state()
        how = self._how[rt.tenant_id] = {}
        self._bound_at.pop(rt.tenant_id, None)
        for slot in rt.wanted_slots():
            slot.keep_incarnation = True
            # a worker that is DEAD here is one whose death is being handled (its death waiters
            # run before the slot is emptied): the slot is free; the rest of that handling sees
            # the slot taken and leaves it
            if slot.worker is None or slot.worker.state is WorkerState.DEAD:
                got = self.workers.start_instance(rt, slot)
                how[got] = how.get(got, 0) + 1
        if not rec.todo:
            self._activated(rt, rec)
        else:
            self.instance_ready(rt)  # a slot whose worker was still there (none today) imports at once

    def instance_ready(self, rt: TenantRuntime) -> bool:
        """An instance of ``rt`` became ready: during an activation, its buffers go back in first.
        True when this was parking's business (the caller then sends nothing yet)."""
        rec = rt.park
        if rec is None:
            return False
        if rec.phase is ParkPhase.PARKED:  # started by something else (scale, reset): activate it now
            rec.phase = ParkPhase.ACTIVATING
            rec.since = self.clock()
            rec.todo = {slot.index for slot in rt.wanted_slots()}
        if rec.phase is not ParkPhase.ACTIVATING:
            return False
        for slot in rt.wanted_slots():
            worker = slot.worker
            if slot.index not in rec.todo or not slot.ready or worker is None:
                continue
            self._bound_at[rt.tenant_id] = self.clock()  # the last instance's bind answered
            if rec.importing.get(slot.index) is not worker:  # its import was not sent behind the bind
                rec.importing[slot.index] = worker
                self._import_start(rt, rec, slot, worker)
        return True

    def _import_start(self, rt: TenantRuntime, rec: ParkRecord, slot: InstanceSlot, worker: WorkerHandle) -> None:
        """Send instance ``slot``'s buffers back, chunk by chunk, up to IMPORT_WINDOW chunks in
        flight (the worker takes them in order: a buffer's first chunk allocates it), then its
        compiled modules. An instance without buffers gets only its handle sequence.

        Sent right behind the worker's bind (:meth:`_on_bind_sent`), before its answer: a refusal
        from a worker that is not ``READY`` then is its failed bind's (it is being killed for
        it, and its replacement imports again), not the import's."""
        seq = rec.seqs.get(slot.index, 0)
        parked = self._files.get(rt.tenant_id, {}).get(slot.index)
        if parked is not None:
            why = parked.check()
            if why is not None:  # deleted or changed from outside while parked: its buffers are gone
                self._lose_file(rt, rec, slot, why)
                parked = None
        chunks = [] if parked is not None else [
            (buf, offset, min(PARK_CHUNK_BYTES, len(buf.data) - offset))
            for buf in rec.buffers.get(slot.index, []) for offset in range(0, len(buf.data), PARK_CHUNK_BYTES)]
        sent = 0
        in_flight = 0
        failed = False

        def done(ok: bool, payload: object) -> None:
            nonlocal in_flight, failed
            if not (self.tenants.get(rt.tenant_id) is rt and rt.park is rec and rec.phase is ParkPhase.ACTIVATING
                    and rec.importing.get(slot.index) is worker) or failed:
                return
            in_flight -= 1
            if not ok:
                failed = True
                # a dead one is restarted, and one whose bind failed is killed: the import starts
                # over in the next worker then
                if worker.state is WorkerState.READY:
                    self._activation_failed(rt, rec, payload)
                elif rec.importing.get(slot.index) is worker:
                    del rec.importing[slot.index]
                return
            if sent == len(chunks) and in_flight == 0:
                self._import_modules(rt, rec, slot, worker)
            else:
                pump()

        def pump() -> None:
            nonlocal sent, in_flight
            while sent < len(chunks) and in_flight < IMPORT_WINDOW and not failed:
                buf, offset, n = chunks[sent]
                assert isinstance(buf.data, bytearray)  # chunks are only sent of copies in memory
                sent += 1
                in_flight += 1
                self._send(rt, slot, worker, "import_buffer",
                           {"handle": buf.handle, "nbytes": len(buf.data), "offset": offset, "seq": seq},
                           memoryview(buf.data)[offset:offset + n], done)

        if parked is not None:  # one message: the worker maps the file and copies each buffer once
            in_flight = 1
            entries: list[list[int]] = []
            offset = 0
            for buf in rec.buffers.get(slot.index, []):
                entries.append([buf.handle, len(buf.data), offset])
                offset += len(buf.data)
            file = parked

            def mapped(ok: bool, payload: object) -> None:
                # the worker could not open or map the file: lost from outside since the check (a
                # race), or not (no address space for the mapping: the activation fails as before)
                if (not ok and isinstance(payload, dict) and payload.get("code") == "segment_error"
                        and self.tenants.get(rt.tenant_id) is rt and rt.park is rec
                        and rec.phase is ParkPhase.ACTIVATING and rec.importing.get(slot.index) is worker):
                    why = file.check()
                    if why is not None:
                        self._lose_file(rt, rec, slot, why)
                        self._send(rt, slot, worker, "import_buffer", {"handle": None, "seq": seq}, None, done)
                        return
                done(ok, payload)

            self._send(rt, slot, worker, "import_mapped", {"path": parked.path, "buffers": entries, "seq": seq},
                       None, mapped)
        elif not chunks:
            in_flight = 1
            self._send(rt, slot, worker, "import_buffer", {"handle": None, "seq": seq}, None, done)
        else:
            pump()

    def _lose_file(self, rt: TenantRuntime, rec: ParkRecord, slot: InstanceSlot, why: str) -> None:
        """Instance ``slot``'s parked file cannot be imported (``why``: deleted, truncated or made
        unreadable from outside): its buffers are lost, the rest of the tenant is not. Their
        handles answer ``BufferLost`` (``InstanceSlot.lost``, until the slot's next incarnation);
        the instance is imported without them (its handle sequence still restored, so no new
        handle equals a lost one), their host charge is released now and the file's name goes."""
        tid = rt.tenant_id
        lost = rec.buffers.pop(slot.index, [])
        files = self._files.get(tid, {})
        parked = files.pop(slot.index, None)
        if parked is not None:
            parked.close()
        if not files:
            self._files.pop(tid, None)
        nbytes = sum(len(b.data) for b in lost)
        if lost:
            if slot.lost is None:
                slot.lost = set()
            slot.lost.update(b.handle for b in lost)
        give_back = min(nbytes, rec.charged)
        if give_back and not rt.block.closed:
            rt.block.release_bytes(give_back)
            rec.charged -= give_back
        self._lost[tid] = self._lost.get(tid, 0) + len(lost)
        log_event(_log, logging.WARNING, "tenant.parked_file_lost", tenant=tid, instance=slot.index,
                  buffers=len(lost), nbytes=nbytes, error=why,
                  detail="its buffers' handles answer BufferLost; the tenant activates without them")

    def _import_modules(self, rt: TenantRuntime, rec: ParkRecord, slot: InstanceSlot, worker: WorkerHandle) -> None:
        """The instance's buffers are back: its tenant's own artifacts next, so the first run does
        not compile. They are off the activation's path: the instance counts as imported when they
        are sent, and the worker takes them before any request sent after them (its requests are
        served in order), so a ``ping`` that woke the tenant does not wait for their answer. A
        worker's refusal is never the activation's (the module compiles at its run); the
        ``activate`` event waits for the answers to count the artifacts handed over. The worker
        only holds them: ``load_modules``, sent after the waiting requests (:meth:`_activated`),
        deserializes them, or each module's first run does."""
        artifacts = self.artifacts
        message = artifacts.message(rt) if artifacts is not None else None
        if artifacts is None or message is None:
            self._slot_imported(rt, rec, slot)
            return
        args, body, sent = message
        tid = rt.tenant_id
        self._modules_pending[tid] = self._modules_pending.get(tid, 0) + 1

        def done(ok: bool, payload: object) -> None:
            if ok and self.tenants.get(tid) is rt:
                loaded = artifacts.settle(rt, payload, sent)
                self._artifacts_loaded[tid] = self._artifacts_loaded.get(tid, 0) + loaded
            left = self._modules_pending.get(tid, 1) - 1
            if left > 0:
                self._modules_pending[tid] = left
                return
            self._modules_pending.pop(tid, None)
            fields = self._activate_events.pop(tid, None)
            if fields is not None:
                self._emit_activate(tid, fields)

        self._send(rt, slot, worker, "import_modules", args, body, done)
        self._load_after.setdefault(tid, []).append((slot, worker))
        self._slot_imported(rt, rec, slot)

    def _emit_activate(self, tid: str, fields: dict[str, object]) -> None:
        self.events.emit("activate", tenant=tid, **fields, artifacts=self._artifacts_loaded.pop(tid, 0))

    def _slot_imported(self, rt: TenantRuntime, rec: ParkRecord, slot: InstanceSlot) -> None:
        rec.todo.discard(slot.index)
        worker = rec.importing.pop(slot.index, None)
        if not rec.todo:
            self._activated(rt, rec)
            return
        # Other instances still import. Should this one's worker die before they are done, its
        # replacement keeps the incarnation (the client's handles name it) and must get the
        # buffers again from the host copy, which is kept until every instance is confirmed: no
        # request has reached the instance since, so the copy is still exact.
        if isinstance(worker, WorkerHandle):
            def lost(_w: WorkerHandle, rt: TenantRuntime = rt, rec: ParkRecord = rec, index: int = slot.index) -> None:
                if self._current(rt, rec, ParkPhase.ACTIVATING):
                    rec.todo.add(index)

            worker.death_waiters.append(lost)

    def _activated(self, rt: TenantRuntime, rec: ParkRecord) -> None:
        """Every instance holds its buffers again: the host copy goes, the waiting requests are sent."""
        self._release(rt, rec)
        restored = sum(len(b) for b in rec.buffers.values())
        host_bytes = rec.host_bytes
        rec.buffers.clear()
        self._drop_files(rt.tenant_id)
        for slot in rt.slots:
            slot.keep_incarnation = False
        rt.park = None
        rt.last_request = self.clock()
        rt.refresh_state()
        self.activations += 1
        now = self.clock()
        bound_at = self._bound_at.pop(rt.tenant_id, now)
        fields: dict[str, object] = {"buffers": restored, "host_bytes": host_bytes,
                                     "activate_ms": round((now - rec.since) * 1000, 3),
                                     # before it began: room being made, or the tenant's own park ending
                                     "waited_ms": self._waited_ms.pop(rt.tenant_id, 0.0),
                                     # its phases: workers bound (a warm one: the bind; else the
                                     # process start too), then the buffers imported
                                     "bind_ms": round((bound_at - rec.since) * 1000, 3),
                                     "restore_ms": round((now - bound_at) * 1000, 3),
                                     # buffers whose parked file was lost from outside (BufferLost)
                                     "lost": self._lost.pop(rt.tenant_id, 0),
                                     "workers": self._how.pop(rt.tenant_id, {})}
        if self._modules_pending.get(rt.tenant_id):  # emitted with the artifacts' count once answered
            self._activate_events[rt.tenant_id] = fields
        else:
            self._emit_activate(rt.tenant_id, fields)
        if self.persist is not None:
            self.persist(rt.tenant_id, False, None)
        before = {id(s.worker): set(s.worker.in_flight) for s in rt.slots if s.worker is not None}
        self.on_active(rt)  # its waiting requests are sent: they go first
        self._gate_sent(rt, before)  # held work waits for their answers
        for slot, worker in self._load_after.pop(rt.tenant_id, ()):
            if slot.worker is worker and worker.state is WorkerState.READY:
                self._send(rt, slot, worker, "load_modules", {}, None, lambda _ok, _payload: None)
        self._keep_room()  # the place this activation took: made again ahead of the next one

    def _gate_sent(self, rt: TenantRuntime, before: dict[int, set[int]]) -> None:
        """``rt``'s waiting requests went out (``before``: each worker's requests in flight before
        they did, by ``id``): the quiet gate holds its work until they are answered."""
        rids: set[int] = set()
        for slot in rt.slots:
            worker = slot.worker
            if worker is None:
                continue
            new = worker.in_flight.keys() - before.get(id(worker), set())
            if new:
                worker.gated = True
                rids |= new
        self.quiet.sent(rt.tenant_id, rids)

    def _activation_failed(self, rt: TenantRuntime, rec: ParkRecord, payload: object) -> None:
        """An import was refused (the GPU cap was lowered below the buffers while parked): the
        tenant goes back to parked with its host copy, and what waited is answered the error."""
        exc = _error(payload)
        self._forget_activation(rt.tenant_id)
        log_event(_log, logging.WARNING, "tenant.activation_failed", tenant=rt.tenant_id, error=str(exc))
        rec.phase = ParkPhase.STOPPING
        rec.importing.clear()
        workers = [s.worker for s in rt.wanted_slots() if s.worker is not None and s.worker.state is not WorkerState.DEAD]
        remaining = {w.worker_id for w in workers}

        def gone(worker: WorkerHandle) -> None:
            remaining.discard(worker.worker_id)
            if not remaining and self.tenants.get(rt.tenant_id) is rt and rt.park is rec:
                rec.phase = ParkPhase.PARKED
                rt.refresh_state()
                self._persist_parked(rt)  # the refused import counted against its quota

        for worker in workers:
            worker.death_waiters.append(gone)
            self.workers.stop_worker(worker, "activation failed")
        if not workers:
            rec.phase = ParkPhase.PARKED
            self._persist_parked(rt)
        rt.refresh_state()
        while rt.waiting:
            self.workers.pending.refuse_parked(rt.tenant_id, rt.parked.popleft(), exc)

    def activation_stopped(self, rt: TenantRuntime) -> None:
        """The tenant failed, or an instance is not restarted, during an activation: it stays
        parked with its host copy (the next request, or ``twt reset``, activates it again)."""
        rec = rt.park
        self._forget_activation(rt.tenant_id)
        if rec is not None and rec.phase is ParkPhase.ACTIVATING:
            rec.importing.clear()
            if not any(s.coming_up for s in rt.wanted_slots()):
                rec.phase = ParkPhase.PARKED
                if rt.state is not TenantState.FAILED:
                    rt.refresh_state()

    def _forget_activation(self, tid: str) -> None:
        """An activation ended without being done: what its ``activate`` event would have said
        goes, and it is no longer out (the quiet gate)."""
        self.quiet.done(tid)
        self._artifacts_loaded.pop(tid, None)
        self._lost.pop(tid, None)
        self._how.pop(tid, None)
        self._bound_at.pop(tid, None)
        self._waited_ms.pop(tid, None)
        self._load_after.pop(tid, None)

    # ------------------------------------------------------------ sending

    def _send(self, rt: TenantRuntime, slot: InstanceSlot, worker: WorkerHandle, op: str, args: dict[str, object],
              body: memoryview | None, done: Callable[[bool, object], None],
              on_body: Callable[[zmq.Frame | bytes | memoryview | None], None] | None = None) -> None:
        now = self.clock()
        pending = Pending(None, 0, op, rt.tenant_id, slot.index, now, now + rt.spec.request_timeout_s, done,
                          on_body=on_body)
        try:
            self.workers.send_request(worker, op, args, body, pending)
        except TensorWasmError as exc:
            done(False, exc.to_dict())


def _parkable(rt: TenantRuntime) -> bool:
    """Idle and whole: running, nothing in flight or waiting, no registration or rolling restart."""
    wanted = rt.wanted_slots()
    return (rt.state is TenantState.RUNNING and rt.in_flight == 0 and not rt.waiting and not rt.waiters
            and not rt.rolling_left and rt.rolling_slot is None and bool(wanted)
            and all(s.ready and s.worker is not None and not s.worker.in_flight for s in wanted)
            and all(s.worker is None for s in rt.slots if s.draining) and not rt.block.closed)


def _leaving(owner: TenantRuntime | None, worker: WorkerHandle) -> bool:
    """``worker`` is being stopped by a park whose copy is whole (see ``Parking._alive``)."""
    rec = owner.park if owner is not None else None
    return (rec is not None and rec.phase is ParkPhase.STOPPING and worker.expected_exit
            and worker.state is WorkerState.STOPPING)


def _message(payload: object) -> str:
    return str(payload.get("message")) if isinstance(payload, dict) else repr(payload)


def _error(payload: object) -> TensorWasmError:
    from shared.errors import error_from_dict

    return error_from_dict(payload if isinstance(payload, dict) else {"message": repr(payload)})
