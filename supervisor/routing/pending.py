"""The pending-request table: THE one place a request is finished.

Every answer the supervisor gives a client goes through :meth:`PendingTable.finish`:

    worker reply ............ WorkerSet._on_backend  -> PendingTable.on_reply   -> finish
    worker death ............ WorkerSet.on_death     -> PendingTable.fail_worker -> finish
    deadline passed ......... housekeeping           -> PendingTable.expire      -> finish
    parked too long / never . Dispatcher             -> PendingTable.refuse_parked -> finish
    refused on arrival ...... Frontend, an op's Reply -> PendingTable.refuse     -> finish
    answered by the loop .... Frontend, an op's Reply -> PendingTable.answer     -> finish
    supervisor stopping ..... Supervisor._teardown   -> PendingTable.abandon     -> finish

``finish`` replies (or calls the supervisor's own callback, e.g. a bind),
keeps the tenant's ``in_flight`` count, and records the request's metric.

Owns: the requests forwarded to workers and not answered yet - indexed per
worker in ``WorkerHandle.in_flight`` (which only this table mutates; its
length is an instance's load) - the request-id counter and the deadline
heap. Answered requests are skipped when their heap entry comes up, and the
heap is rebuilt without them once they outnumber the live entries, so it
never holds more than about twice what is in flight.

May touch: :class:`supervisor.routing.replies.Replies` (to answer), the metrics
hooks, and ``TenantRuntime.in_flight`` of the request's tenant. Loop thread only.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol
from collections.abc import Callable

from shared import protocol as proto
from shared.errors import KernelTimeout, TensorWasmError, WorkerLost
from supervisor.runtime.loop import Clock
from supervisor.routing.replies import Replies
from supervisor.runtime.requests import Parked, Pending
from supervisor.runtime.tenants import TenantRuntime
from supervisor.runtime.workers import WorkerHandle

if TYPE_CHECKING:
    import zmq

__all__ = ["PendingTable", "RequestMetrics"]

#: rebuild the deadline heap when it holds this many more entries than are live
_COMPACT_SLACK = 64


class RequestMetrics(Protocol):
    """Where a finished request is counted (:class:`supervisor.observe.metrics.Metrics`)."""

    def request_done(self, tenant: str, op: str, outcome: str, seconds: float) -> None: ...


@dataclass(eq=False)
class PendingTable:
    """In-flight requests, their deadlines, and the one ``finish`` (see the module docstring)."""

    replies: Replies
    metrics: RequestMetrics
    tenants: Mapping[str, TenantRuntime]
    clock: Clock = time.monotonic
    #: ``alloc``s answered OK whose reply could not be sent (the client is gone or not reading):
    #: ``(tenant, handle)``, taken by the worker set right after it handed in the reply
    #: (:meth:`take_undelivered`) and freed, so no allocation outlives its request unless its
    #: client was told of it
    undelivered: list[tuple[str, int]] = field(default_factory=list, init=False)
    _rid: int = field(default=0, init=False)
    _live: int = field(default=0, init=False)  # requests in flight (the heap also holds answered ones)
    _deadlines: list[tuple[float, int, WorkerHandle]] = field(default_factory=list, init=False)

    # ------------------------------------------------------------ in flight

    def new_rid(self) -> int:
        self._rid += 1
        return self._rid

    def add(self, worker: WorkerHandle, rid: int, pending: Pending) -> None:
        """``pending`` was sent to ``worker`` as ``rid``: it is in flight until finished."""
        worker.in_flight[rid] = pending
        pending.forwarded = True
        self._live += 1
        if pending.callback is None:
            rt = self.tenants.get(pending.tenant)
            if rt is not None:
                rt.in_flight += 1
        heapq.heappush(self._deadlines, (pending.deadline, rid, worker))
        if len(self._deadlines) > 2 * self._live + _COMPACT_SLACK:
            self._compact()

    def __len__(self) -> int:
        return self._live

    @property
    def heap_size(self) -> int:
        """Entries in the deadline heap, answered ones included (bounded by about twice ``len``)."""
        return len(self._deadlines)

    def _take(self, worker: WorkerHandle, rid: int) -> Pending | None:
        pending = worker.in_flight.pop(rid, None)
        if pending is not None:
            self._live -= 1
        return pending

    def on_reply(self, worker: WorkerHandle, rid: int, ok: bool, payload: object, body: zmq.Frame | None) -> bool:
        """A worker answered ``rid``; False when it was answered already (a late reply, dropped)."""
        pending = self._take(worker, rid)
        if pending is None:
            return False
        if not ok and not isinstance(payload, dict):
            payload = TensorWasmError("worker sent an unusable error").to_dict()
        self.finish(pending, ok, payload, body)
        return True

    def fail_worker(self, worker: WorkerHandle, error_of: Callable[[Pending], TensorWasmError]) -> None:
        """The worker died: every request it held is answered with ``error_of(request)``."""
        for rid in list(worker.in_flight):
            pending = self._take(worker, rid)
            assert pending is not None
            self.finish(pending, False, error_of(pending).to_dict())

    def expire(self, now: float) -> list[tuple[WorkerHandle, Pending]]:
        """Answer every request past its deadline (:class:`KernelTimeout`); returns them with their
        workers, which the caller kills (a worker that missed a deadline is stuck)."""
        heap = self._deadlines
        out: list[tuple[WorkerHandle, Pending]] = []
        while heap and heap[0][0] <= now:
            _, rid, worker = heapq.heappop(heap)
            pending = self._take(worker, rid)
            if pending is None:
                continue  # answered already
            timeout = pending.deadline - pending.started
            exc = KernelTimeout(
                timeout,
                pending.op,
                message=f"{pending.op} on {pending.tenant}/{pending.instance} exceeded its deadline of "
                f"{timeout:g} s; the worker is being restarted",
            )
            self.finish(pending, False, exc.to_dict())
            out.append((worker, pending))
        return out

    def _compact(self) -> None:
        self._deadlines = [e for e in self._deadlines if e[1] in e[2].in_flight]
        heapq.heapify(self._deadlines)

    def abandon(self, workers: Iterable[WorkerHandle], reason: str) -> None:
        """Shutdown: every client request still in flight is answered :class:`WorkerLost`; the
        supervisor's own requests (a bind) are dropped: nothing acts on their outcome any more."""
        for worker in workers:
            for rid in list(worker.in_flight):
                pending = self._take(worker, rid)
                assert pending is not None
                if pending.callback is None:
                    exc = WorkerLost(pending.tenant, pending.instance, reason=reason)
                    self.finish(pending, False, exc.to_dict())

    # ------------------------------------------------------------ answered by the loop itself

    def answer(self, client: bytes | None, rid: int, op: str, result: object, *, tenant: str = "") -> None:
        """The loop answered a request itself (admin ops, ``quota``, ``put_module``)."""
        now = self.clock()
        self.finish(Pending(client, rid, op, tenant, 0, now, now), True, result)

    def refuse(self, client: bytes | None, rid: int, op: str, exc: TensorWasmError, *, tenant: str = "") -> None:
        """The loop refused a request before it reached a worker."""
        now = self.clock()
        self.finish(Pending(client, rid, op, tenant, 0, now, now), False, exc.to_dict())

    def answer_error(self, client: bytes | None, rid: int, op: str, err: dict[str, object], *, tenant: str = "") -> None:
        """The loop answers an error it was handed as a wire dict (a worker's fault ack)."""
        now = self.clock()
        self.finish(Pending(client, rid, op, tenant, 0, now, now), False, err)

    def refuse_parked(self, tenant: str, parked: Parked, exc: TensorWasmError) -> None:
        """A parked request will not be sent (deadline passed, instance gone, tenant failed or evicted)."""
        pending = Pending(parked.client, parked.rid, parked.op, tenant, parked.instance or 0,
                          parked.started, parked.deadline, held=parked.held_reply)
        self.replies.release(tenant, "parked", parked.held_body)
        parked.held_body = 0
        self.finish(pending, False, exc.to_dict())

    def take_undelivered(self) -> list[tuple[str, int]]:
        """The allocations answered but never told since the last call (see ``undelivered``)."""
        taken, self.undelivered = self.undelivered, []
        return taken

    def count_refusal(self, tenant: str, op: str, code: str) -> None:
        """A refusal answered (or dropped) without a Pending: only its metric (unauthenticated
        requests count under the empty tenant label)."""
        if op in proto.METERED_OPS:
            self.metrics.request_done(tenant, op, code, 0.0)

    # ------------------------------------------------------------ THE place

    def finish(self, pending: Pending, ok: bool, payload: object,
               body: zmq.Frame | bytes | memoryview | None = None) -> None:
        """Finish one request: its callback or its client's reply, its tenant's count, its metric."""
        if pending.callback is not None:
            self.replies.release(pending.tenant, "replies", pending.held)
            pending.held = 0
            if ok and pending.on_body is not None:
                pending.on_body(body)
            pending.callback(ok, payload)
            return
        if pending.forwarded:
            rt = self.tenants.get(pending.tenant)
            if rt is not None:
                rt.in_flight -= 1
        held, pending.held = pending.held, 0
        if ok:
            told = self.replies.ok(pending.client, pending.client_rid, payload, body, tenant=pending.tenant,
                                   held=held)
            if not told and _makes_handle(pending.op):
                handle = payload.get("handle") if isinstance(payload, dict) else None
                if isinstance(handle, int) and not isinstance(handle, bool):
                    self.undelivered.append((pending.tenant, handle))
        else:
            self.replies.error(pending.client, pending.client_rid, payload)
            self.replies.release(pending.tenant, "replies", held)
        if pending.client is not None and pending.op in proto.METERED_OPS:
            outcome = "ok" if ok else str(payload.get("code") if isinstance(payload, dict) else "error")
            self.metrics.request_done(pending.tenant, pending.op, outcome, self.clock() - pending.started)


def _makes_handle(op: str) -> bool:
    """Its reply's ``handle`` names a buffer made for it (``OpSpec.makes_handle``)."""
    spec = proto.OPS.get(op)
    return spec is not None and spec.makes_handle
