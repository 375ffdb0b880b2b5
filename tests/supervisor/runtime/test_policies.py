"""The supervisor's policies, without processes or sockets: a fake clock, fake workers, real parts.

Restart policy and backoff, pool retry back-off, instance choice, the
deadline rule, the pending table (the one place a request is finished),
parking limits, timers and the metrics hand-off.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any

import psutil
import pytest

from shared import protocol as proto
from shared.errors import BufferLost, InvalidArgument, Overloaded, TenantStopped, WorkerLost
from shared.records import ExitRecord
from shared.spec import DEADLINE_GRACE_S, TenantSpec
from supervisor.observe.event_log import EventLog
from supervisor.admission.frontend import Frontend, Handlers, Holdings, Routes, Sockets
from supervisor.routing.dispatcher import Dispatcher, lost_buffer, pinned_instance, slot_for, with_wasm_limits
from supervisor.runtime.loop import Handoff, Loop, Timers
from supervisor.observe.metrics import Metrics
from supervisor.routing.pending import PendingTable
from supervisor.routing.regions import RegionTable
from supervisor.runtime.requests import Pending
from supervisor.runtime.tenants import InstanceSlot, TenantRuntime, TenantState
from supervisor.runtime.workers import Spawner, WorkerHandle, WorkerState
from supervisor.lifecycle.workerset import pool_retry_delay_s


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeBlock:
    name = "twt-fake"
    closed = False


class FakeReplies:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes | None, int, bool, Any]] = []
        self.released = 0

    def ok(self, client: bytes | None, rid: int, result: Any, body: Any = None, *,
           tenant: str = "", held: int = 0) -> None:
        self.sent.append((client, rid, True, result))
        self.released += held

    def release(self, tenant: str, kind: str, n: int) -> None:
        self.released += n

    def error(self, client: bytes | None, rid: int, err: dict[str, Any]) -> None:
        self.sent.append((client, rid, False, err))

    def queued_bytes(self, client: bytes) -> int:
        return 0


class CountingMetrics(Metrics):
    def __init__(self) -> None:
        self.done: list[tuple[str, str, str]] = []

    def request_done(self, tenant: str, op: str, outcome: str, seconds: float) -> None:
        self.done.append((tenant, op, outcome))


def _worker(n: int, state: WorkerState = WorkerState.READY) -> WorkerHandle:
    return WorkerHandle(f"w{n}", "token", None, 1000 + n, -1, 0.0, state=state)  # type: ignore[arg-type]


def _runtime(spec: TenantSpec | None = None, instances: int = 1, ready: bool = True) -> TenantRuntime:
    spec = spec or TenantSpec("acme")
    rt = TenantRuntime(spec, FakeBlock(), 1)  # type: ignore[arg-type]
    rt.slots = tuple(InstanceSlot(i, worker=_worker(i) if ready else None) for i in range(instances))
    return rt


# ------------------------------------------------------------------ restart policy
# (the decision itself: tests/supervisor/runtime/test_restart_policy.py)


def test_the_runtime_keeps_the_restarts_of_its_window() -> None:
    rt = _runtime(TenantSpec("acme", max_restarts=3, restart_window_s=10.0))
    for t in (0.0, 1.0, 2.0, 15.0):
        rt.record_restart(t)
    assert list(rt.restart_times) == [15.0] and rt.restarts_total == 4  # the window forgets, the total not


def test_pool_retry_backs_off_to_30_s() -> None:
    assert [pool_retry_delay_s(n) for n in (1, 2, 3)] == [0.2, 0.4, 0.8]
    assert pool_retry_delay_s(100) == 30.0


# ------------------------------------------------------------------ instance choice


def test_least_loaded_instance_wins() -> None:
    rt = _runtime(instances=3)
    for i, load in enumerate((2, 0, 1)):
        w = rt.slots[i].worker
        assert w is not None
        w.in_flight.update({k: None for k in range(load)})  # type: ignore[misc]
    assert all(rt.pick_slot() is rt.slots[1] for _ in range(6))


def test_ties_go_round_robin_and_unready_instances_are_skipped() -> None:
    rt = _runtime(instances=3)
    picks = collections.Counter(rt.pick_slot().index for _ in range(30))  # type: ignore[union-attr]
    assert picks == {0: 10, 1: 10, 2: 10}
    rt.slots[1].draining = True
    w2 = rt.slots[2].worker
    assert w2 is not None
    w2.state = WorkerState.BINDING
    assert {rt.pick_slot().index for _ in range(6)} == {0}  # type: ignore[union-attr]
    rt.slots[0].worker = None
    assert rt.pick_slot() is None


def test_a_handle_pins_its_instance() -> None:
    rt = _runtime(instances=3)
    h = proto.make_handle(2, 1, 7)
    assert pinned_instance(rt, "read", {"handle": h}) == 2
    assert slot_for(rt, 2) is rt.slots[2]
    assert pinned_instance(rt, "run_wasm", {"args": [1, {"handle": h}]}) == 2
    assert pinned_instance(rt, "alloc", {"nbytes": 1}) is None
    assert pinned_instance(rt, "alloc", {"nbytes": 1, "instance": 1}) == 1  # alloc may name its instance
    with pytest.raises(InvalidArgument, match=r"different instances \(0:1 on acme/0; 2:7 on acme/2\).*"
                                              r"twt alloc acme SIZE --instance N"):
        pinned_instance(rt, "run_wasm", {"args": [{"handle": h}, {"handle": proto.make_handle(0, 1, 1)}]})
    with pytest.raises(InvalidArgument):
        pinned_instance(rt, "free", {"handle": True})
    with pytest.raises(InvalidArgument, match="instance 5, which 'acme' does not run \\(its instances: 0, 1, 2\\)"):
        pinned_instance(rt, "alloc", {"nbytes": 1, "instance": 5})
    with pytest.raises(InvalidArgument, match="instance must be a non-negative int"):
        pinned_instance(rt, "alloc", {"nbytes": 1, "instance": -1})
    rt.slots[2].draining = True
    assert slot_for(rt, 2) is None
    with pytest.raises(InvalidArgument, match="does not run"):
        pinned_instance(rt, "read", {"handle": h})


def test_a_handle_from_an_earlier_incarnation_is_a_lost_buffer() -> None:
    rt = _runtime(instances=2)
    for slot in rt.slots:
        slot.incarnation = 3
    alive = proto.make_handle(1, 3, 7)
    assert lost_buffer(rt, "read", {"handle": alive}) is None
    stale = proto.make_handle(1, 2, 7)  # made by incarnation 2; instance 1 restarted since
    lost = lost_buffer(rt, "run_wasm", {"args": [{"handle": alive}, {"handle": stale}]})
    assert isinstance(lost, BufferLost) and not lost.is_retryable()
    assert str(lost).startswith("buffer 1:7 lived on acme/1, which restarted")
    rt.slots[1].worker = None  # died; its restart is pending (the incarnation moves when it starts)
    assert isinstance(lost_buffer(rt, "free", {"handle": alive}), BufferLost)
    assert lost_buffer(rt, "alloc", {"nbytes": 1, "instance": 1}) is None  # names no buffer


def test_handle_text_round_trip() -> None:
    h = proto.make_handle(1, 9, 7)
    assert proto.format_handle(h) == "1:7"
    assert proto.parse_handle_text(" 1:7 ") == (1, 7)
    for bad in ("17", "1:", ":7", "a:b", "-1:2", "256:1", "1:2:3"):
        with pytest.raises(ValueError, match="INSTANCE:SEQ"):
            proto.parse_handle_text(bad)


# ------------------------------------------------------------------ the deadline rule


def test_deadline_rule() -> None:
    spec = TenantSpec("acme", request_timeout_s=5.0, wasm_timeout_s=10.0)
    assert proto.OPS["alloc"].deadline_s(spec) == 5.0
    assert proto.OPS["run_wasm"].deadline_s(spec) == 10.0 + DEADLINE_GRACE_S
    assert proto.OPS["run_wasm"].deadline_s(spec, 1.0) == 5.0  # never below request_timeout_s
    assert proto.OPS["run_wasm"].deadline_s(spec, 4.0) == 4.0 + DEADLINE_GRACE_S
    assert proto.OPS["run_wasm"].deadline_s(spec, 99.0) == 10.0 + DEADLINE_GRACE_S  # capped by the spec
    assert proto.OPS["run_wasm"].deadline_s(spec, True) == proto.OPS["run_wasm"].deadline_s(spec)  # a bool is no timeout
    limited = with_wasm_limits(_runtime(spec), {"fuel": 10**30, "timeout_s": -1})
    assert limited["fuel"] == spec.wasm_fuel and limited["timeout_s"] == spec.wasm_timeout_s


# ------------------------------------------------------------------ the pending table


def _table() -> tuple[PendingTable, FakeReplies, CountingMetrics, FakeClock, dict[str, TenantRuntime]]:
    replies, metrics, clock = FakeReplies(), CountingMetrics(), FakeClock()
    tenants = {"acme": _runtime()}
    return PendingTable(replies, metrics, tenants, clock), replies, metrics, clock, tenants  # type: ignore[arg-type]


def test_reply_deadline_and_late_reply() -> None:
    table, replies, metrics, clock, tenants = _table()
    w = _worker(0)
    for client_rid in (1, 2):
        rid = table.new_rid()
        table.add(w, rid, Pending(b"c", client_rid, "alloc", "acme", 0, clock.now, clock.now + 5.0))
    assert tenants["acme"].in_flight == 2 and len(table) == 2
    assert table.on_reply(w, 1, True, {"handle": 1}, None)
    clock.now += 4.9
    assert table.expire(clock.now) == []
    clock.now += 0.2
    expired = table.expire(clock.now)
    assert [p.client_rid for _, p in expired] == [2]
    assert not table.on_reply(w, 2, True, {}, None)  # late: answered already, dropped
    assert [(rid, ok) for _, rid, ok, _ in replies.sent] == [(1, True), (2, False)]
    assert replies.sent[1][3]["code"] == "kernel_timeout"
    assert tenants["acme"].in_flight == 0 and len(table) == 0 and w.in_flight == {}
    assert metrics.done == [("acme", "alloc", "ok"), ("acme", "alloc", "kernel_timeout")]


def test_answered_entries_leave_the_deadline_heap() -> None:
    table, _, _, clock, _ = _table()
    w = _worker(0)
    for k in range(10_000):
        rid = table.new_rid()
        table.add(w, rid, Pending(b"c", k, "ping", "acme", 0, clock.now, clock.now + 60.0))
        table.on_reply(w, rid, True, {}, None)
    assert len(table) == 0
    assert table.heap_size <= 2 * len(table) + 65


def test_worker_death_answers_everything_once() -> None:
    table, replies, _, clock, tenants = _table()
    w = _worker(0)
    seen: list[bool] = []
    rid = table.new_rid()
    table.add(w, rid, Pending(None, 0, "bind", "acme", 0, clock.now, clock.now + 5, lambda ok, p: seen.append(ok)))
    table.add(w, table.new_rid(), Pending(b"c", 9, "ping", "acme", 0, clock.now, clock.now + 5))
    table.fail_worker(w, lambda p: WorkerLost(p.tenant, p.instance, None, 9, "killed"))
    assert seen == [False] and [(r, ok) for _, r, ok, _ in replies.sent] == [(9, False)]
    assert tenants["acme"].in_flight == 0
    clock.now += 10
    assert table.expire(clock.now) == []  # nothing answered twice


# ------------------------------------------------------------------ parking


class _FakeLoop:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def register(self, sock: Any, handler: Any) -> None:
        pass


class _FakeRegistry:
    def verify(self, cap: Any) -> str:
        return "acme"


def test_requests_park_while_no_instance_is_ready_bounded_by_max_in_flight() -> None:
    table, replies, _, clock, tenants = _table()
    rt = _runtime(TenantSpec("acme", max_in_flight=3, request_timeout_s=2.0), ready=False)
    rt.slots[0].restart_at = clock.now + 0.1  # restarting: worth waiting for
    tenants["acme"] = rt
    fe, cap = _frontend(table, replies, clock, tenants, rt)
    for rid in (1, 2, 3):
        fe._tenant_request(b"c", rid, "ping", cap, {}, None)
    assert len(rt.parked) == 3 and not replies.sent
    with pytest.raises(Overloaded):
        fe._tenant_request(b"c", 4, "ping", cap, {}, None)
    clock.now += 2.5
    fe.dispatcher.expire_parked(clock.now)
    assert not rt.parked
    assert [(rid, ok, err["code"]) for _, rid, ok, err in replies.sent] == [(i, False, "kernel_timeout")
                                                                           for i in (1, 2, 3)]



def test_a_parked_request_expires_at_its_deadline_behind_one_with_a_later_deadline() -> None:
    """The parked queue is in arrival order, not deadline order: a guest run (its run time plus
    grace) parked before a ping (``request_timeout_s``) must not hold the ping past its deadline."""
    table, replies, _, clock, tenants = _table()
    rt = _runtime(TenantSpec("acme", request_timeout_s=2.0), ready=False)
    rt.slots[0].restart_at = clock.now + 0.1  # restarting: worth waiting for
    tenants["acme"] = rt
    fe, cap = _frontend(table, replies, clock, tenants, rt)
    fe._tenant_request(b"c", 1, "run_wasm", cap, {"export": "run", "timeout_s": 20.0}, b"\0asm")
    fe._tenant_request(b"c", 2, "ping", cap, {}, None)
    fe._tenant_request(b"c", 3, "run_wasm", cap, {"export": "run", "timeout_s": 20.0}, b"\0asm")
    assert len(rt.parked) == 3 and not replies.sent
    clock.now += 2.5  # past the ping's deadline, well before the runs'
    fe.dispatcher.expire_parked(clock.now)
    assert [(rid, ok, err["code"]) for _, rid, ok, err in replies.sent] == [(2, False, "kernel_timeout")]
    assert [p.rid for p in rt.parked] == [1, 3]  # the runs wait on, in their order
    clock.now += 30.0
    fe.dispatcher.expire_parked(clock.now)
    assert not rt.parked and [rid for _, rid, _, _ in replies.sent] == [2, 1, 3]


class _Untouchable:
    """A registered tenant that nothing waits for: the tick's expiry must not read it."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a tenant with nothing parked was looked at ({name})")


def test_the_parked_expiry_looks_only_at_tenants_with_requests_parked() -> None:
    """Each tick expires parked requests: it looks at the tenants a request was parked for, not
    at every registered tenant (at 10,000 tenants, ~5 ms of loop a tick that requests waited on)."""
    table, replies, _, clock, tenants = _table()
    rt = _runtime(TenantSpec("acme", request_timeout_s=2.0), ready=False)
    rt.slots[0].restart_at = clock.now + 0.1
    tenants["acme"] = rt
    fe, cap = _frontend(table, replies, clock, tenants, rt)
    tenants.update({f"p{i:04d}": _Untouchable() for i in range(1000)})  # type: ignore[misc]
    fe._tenant_request(b"c", 1, "ping", cap, {}, None)
    fe.dispatcher.expire_parked(clock.now)  # not due: kept
    assert len(rt.parked) == 1
    clock.now += 2.5
    fe.dispatcher.expire_parked(clock.now)
    assert not rt.parked and [(rid, err["code"]) for _, rid, _, err in replies.sent] == [(1, "kernel_timeout")]
    fe.dispatcher.expire_parked(clock.now)  # its queue found empty: no longer looked at
    fe._tenant_request(b"c", 2, "ping", cap, {}, None)  # parked again: looked at again
    clock.now += 2.5
    fe.dispatcher.expire_parked(clock.now)
    assert [rid for _, rid, _, _ in replies.sent] == [1, 2]


def _new_frontend(table: PendingTable, replies: FakeReplies, clock: FakeClock, tenants: dict[str, TenantRuntime],
                  sock: Any = None, tcp_sock: Any = None) -> Frontend:
    """A frontend and its dispatcher over the fake parts (no worker set: nothing is sent)."""
    from shared.config import SupervisorConfig
    from supervisor.admission.guard import FrontendGuard
    from supervisor.control import ops

    cfg = SupervisorConfig()
    guard = FrontendGuard(cfg)
    regions = RegionTable("policytest")
    dispatcher = Dispatcher(cfg, clock=clock, pending=table, sender=None, held=guard.held,  # type: ignore[arg-type]
                            regions=regions, tenants=tenants)
    admin = {name: lambda client, rid, args: None for name, spec in proto.OPS.items() if spec.admin}
    return Frontend(cfg, loop=_FakeLoop(clock), sockets=Sockets(sock, tcp_sock), guard=guard,  # type: ignore[arg-type]
                    routes=Routes(table, replies, dispatcher, regions),  # type: ignore[arg-type]
                    holdings=Holdings(_FakeRegistry(), tenants, {}, b"admin", EventLog(16)),  # type: ignore[arg-type]
                    handlers=Handlers(admin, ops.local_handlers(), ops.either_handlers()))


def _frontend(table: PendingTable, replies: FakeReplies, clock: FakeClock, tenants: dict[str, TenantRuntime],
              rt: TenantRuntime) -> tuple[Frontend, bytes]:
    fe = _new_frontend(table, replies, clock, tenants)
    cap = b"x"
    fe._verified_caps[cap] = rt
    return fe, cap


def test_a_request_on_one_frontend_socket_is_read_within_a_few_messages_of_a_flood_on_the_other() -> None:
    """ipc and TCP are one source: libzmq fair-queues the peers of one socket only, so a
    flood on the TCP socket must not keep a request on the ipc socket unread for a whole batch. Real
    sockets (inproc) with 12 queued flood requests and one victim's: the victim is served right after
    the first YIELD_EVERY, and nothing of the flood is lost or reordered.

    Each wake-up's turns are run until nothing waits: a batch served at once stops at its time
    quantum (the host's clock) and queues the rest, so how much one call serves depends on the
    host's load; the order everything is served in does not."""
    import zmq

    from supervisor.admission import frontend as fe_mod

    table, replies, _, clock, tenants = _table()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ipc, tcp = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    victim, flooder = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        ipc.bind("inproc://policies-ipc")
        tcp.bind("inproc://policies-tcp")
        victim.connect("inproc://policies-ipc")
        flooder.connect("inproc://policies-tcp")
        fe = _new_frontend(table, replies, clock, tenants, ipc, tcp)
        fe._verified_caps[b"x"] = tenants["acme"]
        served: list[tuple[bytes, int]] = []
        fe.serve = lambda msg: served.append((msg.client[:1], msg.rid))  # type: ignore[method-assign]
        for rid in range(1, 13):
            flooder.send(proto.encode_request(rid, "ping", b"x", {}))
        victim.send(proto.encode_request(99, "ping", b"x", {}))
        assert tcp.poll(10_000) and ipc.poll(10_000)

        def wake_up() -> None:  # one of the loop's wake-ups on the TCP socket, and its turns
            fe._on_readable(tcp, fe_mod._TCP)
            while fe.guard.fair.backlog:
                fe.end_turn()

        wake_up()
        n = fe_mod.YIELD_EVERY
        assert served == [(fe_mod._TCP, rid) for rid in range(1, n + 1)] + [(fe_mod._IPC, 99)]
        for _ in range(12):  # the rest of the flood, as the loop's next wake-ups read it
            wake_up()
        assert served == ([(fe_mod._TCP, rid) for rid in range(1, n + 1)] + [(fe_mod._IPC, 99)]
                          + [(fe_mod._TCP, rid) for rid in range(n + 1, 13)])
    finally:
        for sock in (victim, flooder, ipc, tcp):
            sock.close(0)
        ctx.term()


def test_requests_never_wait_for_an_instance_that_is_not_coming() -> None:
    table, replies, _, clock, tenants = _table()
    rt = _runtime(TenantSpec("acme", restart="never"), instances=2, ready=False)
    rt.slots[1].last_exit = ExitRecord(exit_code=3, signal=None, reason="exit code 3", at=5.0)
    rt.refresh_state()
    tenants["acme"] = rt
    fe, cap = _frontend(table, replies, clock, tenants, rt)
    # gone for good (restart=never): answered at once, naming why
    with pytest.raises(WorkerLost, match=r"no instance of 'acme' is running or restarting \(restart=never; "
                                         r"last exit of acme/1: exit code 3\); `twt scale acme N`"):
        fe._tenant_request(b"c", 1, "ping", cap, {}, None)
    # instance 0 is restarting: an unpinned request waits for it, one pinned to instance 1 does not
    rt.slots[0].restart_at = clock.now + 0.1
    fe._tenant_request(b"c", 2, "ping", cap, {}, None)
    assert len(rt.parked) == 1
    with pytest.raises(WorkerLost, match="instance 1 of 'acme' is not running or restarting"):
        fe._tenant_request(b"c", 3, "alloc", cap, {"nbytes": 1, "instance": 1}, None)


def test_a_stopped_tenant_is_answered_at_once() -> None:
    table, replies, _, clock, tenants = _table()
    rt = _runtime(instances=1)
    rt.slots[0].draining = True  # scaled to 0
    rt.refresh_state()
    assert rt.state is TenantState.STOPPED and not rt.coming_up()
    tenants["acme"] = rt
    fe, cap = _frontend(table, replies, clock, tenants, rt)
    with pytest.raises(TenantStopped, match="scaled to 0 instances; `twt scale acme N`") as info:
        fe._tenant_request(b"c", 1, "run_wasm", cap, {"export": "main"}, b"(module)")
    assert not info.value.is_retryable() and not rt.parked


# ------------------------------------------------------------------ loop plumbing


def test_timers_run_in_order_on_an_injected_clock() -> None:
    clock = FakeClock()
    timers = Timers(clock)
    ran: list[str] = []
    timers.after(2.0, lambda: ran.append("b"))
    timers.after(1.0, lambda: ran.append("a"))
    timers.after(1.0, lambda: ran.append("a2")).cancel()
    assert timers.next_due() == clock.now + 1.0
    assert timers.run_due(clock.now) == 0
    clock.now += 5
    assert timers.run_due(clock.now) == 2 and ran == ["a", "b"]
    assert timers.next_due() is None


@pytest.mark.parametrize(("wait_s", "timer_in_s", "want_ms"), [
    (0.0, None, 0), (0.05, None, 50), (0.07, None, 70), (0.0004, None, 1), (0.0491, None, 50), (1.0, 0.0003, 1),
    (1.0, -1.0, 0),
])
def test_the_loop_never_polls_for_less_than_it_must_wait(wait_s: float, timer_in_s: float | None,
                                                         want_ms: int) -> None:
    """A wait is polled in whole milliseconds rounded up: rounded down, the last fraction of a
    millisecond before each tick polled with 0 and the idle loop spun (3216 turns in 10 s, not 267)."""
    clock = FakeClock()
    loop = Loop(clock)
    asked: list[int | None] = []

    def poll(timeout: int | None = None) -> list[Any]:
        asked.append(timeout)
        return []

    loop.poller.poll = poll  # type: ignore[method-assign]
    try:
        if timer_in_s is not None:
            loop.timers.after(timer_in_s, lambda: None)
        assert loop.poll(wait_s) == []
        assert asked == [want_ms]
    finally:
        loop.close()


def test_handoff_answers_a_request_with_the_next_publish() -> None:
    woken = threading.Event()
    handoff = Handoff(woken.set, {"old": True})
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(handoff.request(10.0)))
    t.start()
    assert woken.wait(10)
    assert handoff.wanted()
    handoff.publish({"new": True})
    t.join(10)
    assert got == [{"new": True}] and not handoff.wanted()
    assert handoff.request(0.0) == {"new": True}  # nobody publishes: the last value


def test_shutdown_answers_clients_and_drops_its_own_requests() -> None:
    table, replies, _, clock, tenants = _table()
    w = _worker(0)
    own: list[bool] = []
    table.add(w, table.new_rid(), Pending(None, 0, "bind", "acme", 0, clock.now, clock.now + 5, own.append))
    table.add(w, table.new_rid(), Pending(b"c", 3, "alloc", "acme", 0, clock.now, clock.now + 5))
    table.abandon([w], "the supervisor is stopping")
    assert own == [] and [(rid, ok, err["code"]) for _, rid, ok, err in replies.sent] == [(3, False, "worker_lost")]
    assert len(table) == 0 and tenants["acme"].in_flight == 0


def test_a_scale_down_answers_what_waited_for_the_instances_it_took_away() -> None:
    from supervisor.control.admin import _scaled_away
    from supervisor.runtime.requests import Parked

    rt = _runtime(instances=2, ready=False)
    pinned = Parked(b"c", 1, "read", {"handle": proto.make_handle(1, 1, 1)}, None, 0.0, 5.0, 1)
    free = Parked(b"c", 2, "ping", {}, None, 0.0, 5.0, None)
    rt.slots[1].draining = True  # scale 2 -> 1
    refused = _scaled_away(rt, pinned)
    assert isinstance(refused, InvalidArgument) and "instance 1 of 'acme'" in str(refused)
    assert _scaled_away(rt, free) is None  # instance 0 may still come up
    rt.slots[0].draining = True  # scale 1 -> 0
    assert isinstance(_scaled_away(rt, free), TenantStopped)


def test_loop_polls_plain_fds_through_one_epoll_and_sockets_directly() -> None:
    """64 worker sentinels must not make every poll 64 entries longer (scale)."""
    import os

    import zmq

    from supervisor.runtime.loop import Loop

    loop = Loop()
    pipes = [os.pipe() for _ in range(64)]
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://loop-test")
        b.connect("inproc://loop-test")
        fired: list[object] = []
        for i, (r, _) in enumerate(pipes):
            loop.register(r, lambda i=i: fired.append(i))
        loop.register(b, lambda: fired.append("sock"))
        assert len(loop.poller.sockets) <= 3  # the wake pipe, the epoll, the socket
        assert loop.poll(0) == []
        os.write(pipes[7][1], b"x")
        os.write(pipes[42][1], b"x")
        a.send(b"m")
        for handler in loop.poll(1.0):
            handler()
        assert sorted(map(str, fired)) == ["42", "7", "sock"]
        os.read(pipes[42][0], 1)
        loop.unregister(pipes[7][0])  # still readable: no longer reported
        os.close(pipes[42][0])
        loop.unregister(pipes[42][0])  # closed first: still fine
        b.recv()
        loop.wake()
        handlers = loop.poll(1.0)
        assert [h.__name__ for h in handlers] == ["_drain_wake"]
    finally:
        a.close(0)
        b.close(0)
        ctx.term()
        for r, w in pipes:
            for fd in (r, w):
                try:
                    os.close(fd)
                except OSError:
                    pass
        loop.close()


def test_the_rss_backstop_reads_what_psutil_reads_and_none_for_a_gone_process() -> None:
    """Spawner.rss reads /proc/PID/statm itself (once a second per worker, without a psutil.Process)."""
    from shared.config import SupervisorConfig

    spawner = Spawner(SupervisorConfig(), {})
    me = WorkerHandle("w1", "t", process=None, pid=os.getpid(), sentinel=-1, spawned_at=0.0)  # type: ignore[arg-type]
    block = bytearray(32 << 20)  # resident: both reads below see it
    ours, theirs = spawner.rss(me), psutil.Process().memory_info().rss
    assert ours is not None and abs(ours - theirs) < (8 << 20) and ours > len(block)
    with open("/proc/sys/kernel/pid_max") as f:
        never = int(f.read())  # pids stay below pid_max: no process has this one
    assert spawner.rss(WorkerHandle("w2", "t", process=None, pid=never, sentinel=-1, spawned_at=0.0)) is None  # type: ignore[arg-type]


def test_a_tenant_holds_no_rare_record_until_it_sets_one() -> None:
    """What only some tenants set (restarts, a failure, a rolling restart, refusals seen) is read
    as its default without a record; writing a default makes none; writing a value makes it."""
    rt = TenantRuntime(TenantSpec("acme"), None, 1)  # type: ignore[arg-type]  # no block needed here
    assert rt.restarts_total == 0 and rt.failed_reason is None and rt.rolling_slot is None and not rt.restoring
    assert rt.slots == () and not rt.waiters and rt.rolling_left == 0
    rt.restoring = False
    rt.seen_refusals = 0
    assert rt._rare is None
    rt.failed_reason = "boom"
    rt.restarts_total += 1
    assert rt._rare is not None and (rt.failed_reason, rt.restarts_total) == ("boom", 1)
    other = TenantRuntime(TenantSpec("beta"), None, 1)  # type: ignore[arg-type]
    assert other.failed_reason is None and other.restarts_total == 0  # the defaults are never written
    rt.ready_waiters = []
    assert not rt.waiters
