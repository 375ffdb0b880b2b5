"""The dispatcher: a verified, admitted tenant request to one of its tenant's workers, now or later.

The frontend (:mod:`supervisor.admission.frontend`) decides *whether* a request
is served - capability, rates, fairness, ``max_in_flight``; this part decides
*where and when*::

    Frontend ── route(rt, request) ──► Dispatcher ─┬─► a ready instance: forwarded (WorkerSet.send_request)
                                                   ├─► every ready instance (``OpSpec.merge``): fanned out, merged
                                                   ├─► none ready, one coming: parked in ``rt.parked``, bounded
                                                   │   by max_in_flight, the held-byte budgets and its deadline
                                                   └─► none coming: refused at once (TenantStopped, WorkerLost)
    an instance ready ... dispatch_parked(rt)    what waited for it is sent (not while parking moves buffers)
    housekeeping ........ expire_parked(now)     parked past its deadline: KernelTimeout
    instance gone ....... refuse_all_parked(rt)  parked requests that can only go there: answered

A request names no worker: the least-loaded ready instance of its tenant
serves it, or the instance that holds the buffer handles it names (buffer
affinity; ``alloc`` may name an instance). A handle from an earlier
incarnation of its instance is answered :class:`~shared.errors.BufferLost` at
once. A request for a *parked* tenant (:mod:`supervisor.lifecycle.parking`)
waits the same way and wakes it (``wake``); nothing is sent while its buffers
move (``TenantRuntime.park`` set). The instance choice itself is pure policy
(the functions at the end), tested without sockets.

Owns: the tenants' parked-request queues (``TenantRuntime.parked``) and the
request sent to a worker (its :class:`~supervisor.runtime.requests.Pending`, its
deadline, a run's fuel and time). May touch: the pending table (every answer
goes through it), the held-byte budgets (reserved for a reply and a parked
body), the worker set (to send: :class:`Sender`), the shared-memory regions
(a released one unmapped from the workers). Loop thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import zmq

from shared import protocol as proto
from shared.checks import is_int
from shared.config import SupervisorConfig
from shared.errors import (
    BufferLost,
    InvalidArgument,
    KernelTimeout,
    TenantStopped,
    TensorWasmError,
    WorkerLost,
)
from shared.spec import DEADLINE_GRACE_S
from supervisor.routing.budgets import HeldBytes
from supervisor.routing.pending import PendingTable
from supervisor.routing.regions import RegionTable
from supervisor.runtime.loop import Clock
from supervisor.runtime.requests import Parked, Pending
from supervisor.runtime.tenants import InstanceSlot, ParkPhase, ParkRecord, TenantRuntime, TenantState
from supervisor.runtime.workers import WorkerHandle

__all__ = ["Body", "Dispatcher", "Sender", "expected_reply_bytes", "lost_buffer", "parked_buffers", "pinned_instance",
           "request_handles", "slot_for", "with_wasm_limits"]

#: a request's body: its frame as received, or a module put_module stored (a run by digest)
Body = zmq.Frame | bytes | None


class Sender(Protocol):
    """What the dispatcher sends with (the worker set: :meth:`~supervisor.lifecycle.workerset.WorkerSet.send_request`)."""

    def send_request(self, worker: WorkerHandle, op: str, args: dict[str, object],
                     body: zmq.Frame | bytes | memoryview | None, pending: Pending) -> None: ...


def _ignore_reply(ok: bool, payload: object) -> None:
    """Callback of the supervisor's own fire-and-forget worker requests."""


def _ignore_wake(rt: TenantRuntime) -> None:
    """``wake`` of a supervisor without parking (it never parks a tenant)."""


class Dispatcher:
    """Tenant requests to workers: forwarded, fanned out or parked (see the module docstring)."""

    def __init__(self, config: SupervisorConfig, *, clock: Clock, pending: PendingTable, sender: Sender,
                 held: HeldBytes, regions: RegionTable, tenants: Mapping[str, TenantRuntime],
                 wake: Callable[[TenantRuntime], None] = _ignore_wake) -> None:
        """``wake(rt)``: a request needs a worker of the parked tenant ``rt`` (parking activates it)."""
        self.config = config
        self.clock = clock
        self.pending = pending
        self.sender = sender
        self.held = held
        self.regions = regions
        self.tenants = tenants
        self.wake = wake
        #: the tenants a request was parked for since their queue was last seen empty: what
        #: :meth:`expire_parked` looks at each tick, instead of every registered tenant
        self._waiting: dict[str, TenantRuntime] = {}

    def route(self, rt: TenantRuntime, client: bytes, rid: int, op: str, args: dict[str, object], body: Body,
              *, in_flight: int, max_in_flight: int) -> None:
        """Send, fan out or park one admitted request of ``rt`` (``in_flight``: its tenant's
        requests in flight and parked, bounded by ``max_in_flight``). Raises a typed error to refuse it."""
        spec = proto.OPS[op]
        tid = rt.tenant_id
        if spec.merge is not None:
            if spec.lists_buffers and rt.park is not None and rt.park.phase is not ParkPhase.EXPORTING:
                self.pending.answer(client, rid, op, parked_buffers(rt.park), tenant=tid)  # no activation
                return
            self._fan_out(rt, client, rid, op, spec.merge)
            return
        pinned = pinned_instance(rt, op, args)
        if pinned is not None:
            lost = lost_buffer(rt, op, args)
            if lost is not None:
                raise lost
        # a parked tenant: the request waits (below) while parking activates the tenant
        slot = slot_for(rt, pinned) if rt.park is None else None
        now = self.clock()
        if rt.park is not None:
            self.wake(rt)
            slot = slot_for(rt, pinned) if rt.park is None else None  # a park cancelled: serve at once
        if slot is None and rt.park is None:
            if not (rt.coming_up() if pinned is None else rt.slots[pinned].coming_up):
                raise _nothing_coming_up(rt, pinned)
        # What the supervisor will hold for this request, reserved before it holds it
        # (supervisor.routing.budgets): a read's reply, and a parked request's body.
        held = self.held
        reply = spec.reply_body_bytes(args, self.config.max_message_bytes)
        held.reserve(tid, "replies", reply, in_flight=in_flight, max_in_flight=max_in_flight)
        try:
            if slot is None:
                # no ready instance, but one is starting or restarting: wait for it, bounded
                size = len(body) if body is not None else 0
                held.reserve(tid, "parked", size, in_flight=in_flight, max_in_flight=max_in_flight)
                rt.parked.append(Parked(client, rid, op, args, body, now,
                                        now + spec.deadline_s(rt.spec, args.get("timeout_s")), pinned,
                                        held_reply=reply, held_body=size))
                self._waiting[tid] = rt
                return
            self._forward(rt, slot, client, rid, op, args, body, now, held=reply)
        except BaseException:
            held.release(tid, "replies", reply)
            raise

    def _forward(
        self,
        rt: TenantRuntime,
        slot: InstanceSlot,
        client: bytes,
        rid: int,
        op: str,
        args: dict[str, object],
        body: Body,
        now: float,
        *,
        started: float | None = None,
        deadline: float | None = None,
        held: int = 0,
    ) -> None:
        """Send to the slot's worker. A request that waited (parked) keeps its
        original start and deadline; a run is shortened to fit what is left.
        ``held``: reply bytes reserved for it, handed to its Pending (raises: not taken)."""
        worker = slot.worker
        assert worker is not None
        spec = proto.OPS[op]
        if spec.guest_run:
            args = with_wasm_limits(rt, args, None if deadline is None else deadline - now - DEADLINE_GRACE_S)
        own = now + spec.deadline_s(rt.spec, args.get("timeout_s"))
        deadline = own if deadline is None else min(own, deadline)
        pending = Pending(client, rid, op, rt.tenant_id, slot.index, started if started is not None else now, deadline,
                          held=held)
        self.sender.send_request(worker, op, args, body, pending)

    def _fan_out(self, rt: TenantRuntime, client: bytes, rid: int, op: str,
                 merge: Callable[[list[Mapping[str, object]]], object]) -> None:
        """An op sent to every ready instance of the tenant (``OpSpec.merge``): the first error, or
        every instance's reply merged into one."""
        slots = rt.live_slots()
        if not slots:
            raise WorkerLost(rt.tenant_id, 0, reason=f"no ready instance to send {op} to")
        now = self.clock()
        deadline = now + rt.spec.request_timeout_s
        remaining = {slot.index for slot in slots}
        parts: list[Mapping[str, object]] = []  # each instance's reply
        errors: list[object] = []
        request = Pending(client, rid, op, rt.tenant_id, 0, now, deadline)

        def collect(index: int) -> Callable[[bool, object], None]:
            def done(ok: bool, payload: object) -> None:
                if index not in remaining:
                    return
                remaining.discard(index)
                if ok and isinstance(payload, dict):
                    parts.append(payload)
                else:
                    errors.append(payload)
                if remaining:
                    return
                if errors:
                    self.pending.finish(request, False, errors[0])
                else:
                    self.pending.finish(request, True, merge(parts))

            return done

        for slot in slots:
            assert slot.worker is not None
            done = collect(slot.index)
            part = Pending(None, 0, op, rt.tenant_id, slot.index, now, deadline, done)
            try:
                self.sender.send_request(slot.worker, op, {}, None, part)
            except TensorWasmError as exc:
                done(False, exc.to_dict())

    # ------------------------------------------------------------ regions

    def unmap_region(self, rt: TenantRuntime, name: str) -> None:
        """Tell the tenant's live workers to unpin and unmap a released region (best effort:
        a worker that misses it unmaps at exit, and the name is unlinked already)."""
        now = self.clock()
        for slot in rt.live_slots():
            assert slot.worker is not None
            part = Pending(None, 0, "region_drop", rt.tenant_id, slot.index, now,
                           now + rt.spec.request_timeout_s, _ignore_reply)
            try:
                self.sender.send_request(slot.worker, "region_drop", {"name": name}, None, part)
            except TensorWasmError:
                pass  # dying or flooded: its mapping ends with it

    def reap_regions(self) -> None:
        """Housekeeping: reclaim the regions whose client process died."""
        for owned in self.regions.reap():
            rt = self.tenants.get(owned.tenant_id)
            if rt is not None:
                self.unmap_region(rt, owned.name)

    # ------------------------------------------------------------ parked requests

    def dispatch_parked(self, rt: TenantRuntime) -> None:
        """An instance became ready: send what waited for one (not while the tenant's buffers are
        moving: parking sends them once it is active, supervisor.lifecycle.parking)."""
        if rt.park is not None:
            return
        now = self.clock()
        keep: list[Parked] = []
        while rt.waiting:
            p = rt.parked.popleft()
            slot = slot_for(rt, p.instance)
            if slot is None:
                keep.append(p)
                continue
            lost = lost_buffer(rt, p.op, p.args) if p.instance is not None else None
            if lost is not None:  # its instance restarted while it waited: the buffer went with it
                self.pending.refuse_parked(rt.tenant_id, p, lost)
                continue
            # the body leaves the parked budget: it goes to the worker now
            self.held.release(rt.tenant_id, "parked", p.held_body)
            p.held_body = 0
            try:
                self._forward(rt, slot, p.client, p.rid, p.op, p.args, p.body, now,
                              started=p.started, deadline=p.deadline, held=p.held_reply)
            except TensorWasmError as exc:
                self.pending.refuse_parked(rt.tenant_id, p, exc)
        if keep:
            rt.parked.extend(keep)

    @property
    def any_parked(self) -> bool:
        """Some tenant may have a request parked (a tenant is looked at by :meth:`expire_parked` until
        a tick finds its queue empty): the supervisor's housekeeping keeps its short tick meanwhile."""
        return bool(self._waiting)

    def expire_parked(self, now: float) -> None:
        """Parked requests whose deadline passed get :class:`KernelTimeout` (every tick: one look
        per tenant that had a request parked since the last tick that found its queue empty - not
        one per registered tenant, which at 10,000 tenants held every request up ~5 ms a tick)."""
        for tid, rt in list(self._waiting.items()):
            if not rt.waiting or self.tenants.get(tid) is not rt:
                del self._waiting[tid]  # nothing waits (or the tenant went): its next parked request adds it
                continue
            # the whole queue, not its head: it is in arrival order, and deadlines differ by op (a
            # guest run's is its run time plus grace) - a run parked before a ping must not hold the
            # ping past its deadline. A queue is bounded by the tenant's max_in_flight.
            queue = rt.parked
            due = [p for p in queue if p.deadline <= now]
            if not due:
                continue
            kept = [p for p in queue if p.deadline > now]
            queue.clear()
            queue.extend(kept)
            for p in due:
                waited = p.deadline - p.started
                self.pending.refuse_parked(rt.tenant_id, p, KernelTimeout(
                    waited, p.op, message=f"no instance of {rt.tenant_id!r} became ready within {waited:g} s"))

    def refuse_all_parked(self, rt: TenantRuntime, exc_of: Callable[[Parked], TensorWasmError | None]) -> None:
        """Answer the parked requests for which ``exc_of`` gives an error; keep the others."""
        keep = []
        while rt.waiting:
            p = rt.parked.popleft()
            exc = exc_of(p)
            if exc is None:
                keep.append(p)
            else:
                self.pending.refuse_parked(rt.tenant_id, p, exc)
        if keep:
            rt.parked.extend(keep)


# ------------------------------------------------------------ instance choice (pure policy)


def request_handles(op: str, args: dict[str, object]) -> list[int]:
    """The buffer handles a request names (``OpSpec.handles``: ``handle``, or the ``{handle}`` items of its list)."""
    return proto.OPS[op].handles(args)


def pinned_instance(rt: TenantRuntime, op: str, args: dict[str, object]) -> int | None:
    """The instance a request must go to: the one holding the buffers it names, or the one its
    ``instance_arg`` names (``alloc``'s ``instance``).

    InvalidArgument when its buffers live on different instances (naming them),
    or when the instance is not one the tenant runs.
    """
    spec = proto.OPS[op]
    if not spec.pins:
        return None  # the hot path (ping, quota-free ops): nothing to look at
    if spec.instance_arg is not None:
        pinned = args.get(spec.instance_arg)
        if pinned is not None and (not is_int(pinned) or pinned < 0):
            raise InvalidArgument(f"{op}: {spec.instance_arg} must be a non-negative int")
        what = f"{op} names"
    else:
        handles = spec.handles(args)
        where: dict[int, list[str]] = {}
        for h in handles:
            where.setdefault(proto.handle_instance(h), []).append(proto.format_handle(h))
        if len(where) > 1:
            held = "; ".join(f"{', '.join(names)} on {rt.tenant_id}/{i}" for i, names in sorted(where.items()))
            raise InvalidArgument(
                f"{op}: its buffers live on different instances ({held}); a run sees the buffers of one instance: "
                f"allocate them on one (twt alloc {rt.tenant_id} SIZE --instance N, or alloc(cap, n, instance=N))"
            )
        pinned = next(iter(where), None)
        what = "buffer handle names"
    if pinned is not None and (pinned >= len(rt.slots) or rt.slots[pinned].draining):
        running = ", ".join(str(s.index) for s in rt.wanted_slots()) or "none"
        raise InvalidArgument(f"{what} instance {pinned}, which {rt.tenant_id!r} does not run "
                              f"(its instances: {running})")
    return pinned


def lost_buffer(rt: TenantRuntime, op: str, args: dict[str, object]) -> BufferLost | None:
    """:class:`BufferLost` for the first handle whose instance restarted since (or died with it), else None.

    A handle is alive while its slot's worker is the incarnation that made it;
    a slot with no worker lost it (a restart is pending), one with a newer
    incarnation restarted.
    """
    for h in request_handles(op, args):
        index = proto.handle_instance(h)
        if index >= len(rt.slots):
            continue  # refused by pinned_instance
        slot = rt.slots[index]
        gone = slot.worker is None and rt.park is None  # a parked slot's buffers wait in the supervisor
        if (gone or slot.incarnation & 0xFFFF != proto.handle_incarnation(h)
                or (slot.lost is not None and h in slot.lost)):  # its parked file was lost
            return BufferLost(rt.tenant_id, proto.format_handle(h), index, slot.incarnation)
    return None


def parked_buffers(park: ParkRecord) -> dict[str, object]:
    """The answer of an op that lists buffers (``OpSpec.lists_buffers``) for a parked tenant, from
    its host copies (it is not activated for it)."""
    listed = sorted((b.handle, len(b.data)) for bufs in park.buffers.values() for b in bufs)
    return {"buffers": listed, "bytes": sum(n for _, n in listed)}


def expected_reply_bytes(op: str, args: dict[str, object], limit: int) -> int:
    """The reply body a request will bring back (``OpSpec.reply_body_bytes``: a ``read``'s ``nbytes``, at most ``limit``)."""
    return proto.OPS[op].reply_body_bytes(args, limit)


def _nothing_coming_up(rt: TenantRuntime, pinned: int | None) -> TensorWasmError:
    """The answer when no instance (or not the pinned one) is ready or coming (so waiting is useless)."""
    wanted = rt.wanted_slots()
    if not wanted:
        return TenantStopped(rt.tenant_id)
    gone = rt.slots[pinned] if pinned is not None else max(wanted, key=lambda s: s.last_exit.at if s.last_exit else 0.0)
    last = gone.last_exit
    who = f"instance {gone.index} of {rt.tenant_id!r} is not" if pinned is not None else f"no instance of {rt.tenant_id!r} is"
    reason = (f"{who} running or restarting (restart={rt.spec.restart.value}; "
              f"last exit of {rt.tenant_id}/{gone.index}: {last.reason if last else 'unknown'})")
    again = (f"`twt restart {rt.tenant_id}` runs it again" if rt.state is TenantState.COMPLETED
             else f"`twt scale {rt.tenant_id} N` starts instances again")
    return WorkerLost(rt.tenant_id, gone.index, last.exit_code if last else None, last.signal if last else None, reason,
                      message=f"{reason}; {again}")


def slot_for(rt: TenantRuntime, pinned: int | None) -> InstanceSlot | None:
    """The ready instance to send to (least loaded, or the pinned one), None when none is ready."""
    if pinned is None:
        return rt.pick_slot()
    if pinned < len(rt.slots) and rt.slots[pinned].ready:
        return rt.slots[pinned]
    return None


def with_wasm_limits(rt: TenantRuntime, args: dict[str, object], left_s: float | None = None) -> dict[str, object]:
    """A run's fuel and time: defaults from the spec, and never above it (nor above ``left_s``,
    what a parked request has left of its deadline, if given)."""
    spec = rt.spec
    fuel = args.get("fuel")
    out = dict(args)
    out["fuel"] = (
        min(fuel, spec.wasm_fuel)
        if is_int(fuel) and fuel > 0
        else spec.wasm_fuel
    )
    timeout_s = spec.wasm_run_s(args.get("timeout_s"))
    out["timeout_s"] = timeout_s if left_s is None or left_s >= timeout_s else max(0.001, left_s)
    return out
