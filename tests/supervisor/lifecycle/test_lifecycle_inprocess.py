"""The tenant lifecycle in one process: AdminOps, ServiceOps and WorkerSet on a fake clock.

A real :class:`~supervisor.supervisor.Supervisor` (real sockets, state, quota
blocks) whose workers are :mod:`tests.helpers.fake_workers`: they live on the
supervisor's own loop, so the test turns the loop by hand and moves the clock
itself. No process is started, nothing waits on a timer, and every case is
decided by events, not by how fast the machine is.
"""

from __future__ import annotations

import itertools
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from shared import _atomics, log
from shared import protocol as proto
from shared.config import SupervisorConfig
from shared.spec import TenantSpec
from supervisor.lifecycle import workerset
from supervisor.store.rundir import read_admin_capability
from supervisor.supervisor import Supervisor
from tests.helpers.fake_workers import FakeClock, FakeSpawner
from tests.helpers.timeouts import scaled

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20

#: real seconds a call may take before the test calls it stuck: messages cross real sockets
#: (libzmq's I/O thread), so the loop waits on its poller for them - never a fixed sleep
STUCK_S = scaled(30.0)
#: the longest one turn waits on the poller for a message (a reply to the raw client is not on it)
TURN_WAIT_S = 0.005


class Harness:
    """A supervisor with fake workers, a raw client socket, and a clock the test moves."""

    def __init__(self, tmp: Path, **cfg: Any) -> None:
        self.clock = FakeClock()
        holder: list[FakeSpawner] = []
        config = SupervisorConfig(run_dir=str(tmp / "run"), backend="stub", pool_size=cfg.pop("pool_size", 1),
                                  **cfg)
        self.sup = Supervisor(config, clock=self.clock, spawner=FakeSpawner.factory(lambda: self.sup.loop, holder))
        self.sup.start()
        self.spawner = holder[0]
        self.admin = read_admin_capability(config.run_dir)
        self.client: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        self.client.setsockopt(zmq.LINGER, 0)
        self.client.connect(self.sup.rundir.endpoint("frontend"))
        self._rid = itertools.count(1)

    def turn(self, n: int = 1) -> None:
        for _ in range(n):
            self.sup.turn(TURN_WAIT_S)

    def settle(self, quiet_turns: int = 10) -> None:
        """Turn until nothing has been ready for ``quiet_turns`` turns: every message in flight
        (spawned workers' hellos, binds, stops) is handled."""
        quiet = 0
        deadline = time.monotonic() + STUCK_S
        while quiet < quiet_turns and time.monotonic() < deadline:
            handled = self.sup.loop.poll(TURN_WAIT_S)
            for handler in handled:
                handler()
            self.sup.turn(0.0)
            quiet = 0 if handled else quiet + 1

    def until(self, done: Callable[[], bool]) -> None:
        """Turn the loop until ``done()`` (a writer thread's commit, a worker's exit) or STUCK_S."""
        deadline = time.monotonic() + STUCK_S
        while not done():
            assert time.monotonic() < deadline, f"not done within {STUCK_S} s"
            self.settle(quiet_turns=1)

    def tick(self, seconds: float, step: float = 0.25) -> None:
        """Move the clock by ``seconds`` in steps (each past a housekeeping tick), settling at each."""
        steps = max(1, round(seconds / step))
        for _ in range(steps):
            self.clock.advance(seconds / steps)
            self.sup.turn(0.0)  # due timers and housekeeping at the new time
            self.settle(quiet_turns=2)
            # the heartbeats sent at this time have come back before the clock moves on: their
            # round trip crosses real sockets (libzmq's I/O thread), and quiet turns alone let a
            # starved host's late replies count as missed beats - a worker killed for silence
            # under a test that never made it silent
            self.until(self._beats_answered)

    def _beats_answered(self) -> bool:
        """Every live fake worker that answers heartbeats has answered the supervisor's last one."""
        assert self.sup.parts is not None
        workers = self.sup.parts.workers
        sent_at = workers._last_beat
        live = workers.workers
        return all(w.handle.last_heartbeat >= sent_at for w in self.spawner.alive()
                   if not w.silent and w.handle.control_hello and live.get(w.handle.ident) is w.handle)

    def send(self, op: str, args: dict[str, Any], cap: bytes | None = None) -> int:
        rid = next(self._rid)
        self.client.send(proto.encode_request(rid, op, self.admin if cap is None else cap, args))
        return rid

    def answer(self, rid: int) -> tuple[bool, Any]:
        deadline = time.monotonic() + STUCK_S
        while time.monotonic() < deadline:
            self.turn()
            if self.client.poll(0):
                got, ok, payload = proto.decode_reply(self.client.recv_multipart()[0])
                assert got == rid
                return ok, payload
        raise AssertionError(f"no answer to request {rid} within {STUCK_S} s")

    def call(self, op: str, args: dict[str, Any], cap: bytes | None = None) -> Any:
        ok, payload = self.answer(self.send(op, args, cap))
        assert ok, payload
        return payload

    def error(self, op: str, args: dict[str, Any], cap: bytes | None = None) -> dict[str, Any]:
        ok, payload = self.answer(self.send(op, args, cap))
        assert not ok, payload
        assert isinstance(payload, dict)
        return payload

    def register(self, name: str, **spec: Any) -> bytes:
        result = self.call("register", {"spec": TenantSpec(name, **spec).to_dict()})
        cap = result["capability"]
        assert isinstance(cap, bytes)
        return cap

    def tenant(self, name: str) -> dict[str, Any]:
        status = self.call("status", {"tenant": name})
        tenants = status["tenants"] if "tenants" in status else [status]
        found = [t for t in tenants if t.get("tenant") == name or t.get("tenant_id") == name]
        assert found, status
        return dict(found[0])

    def close(self) -> None:
        self.client.close(0)
        self.sup.request_stop()
        deadline = time.monotonic() + STUCK_S
        while time.monotonic() < deadline and self.sup.turn(TURN_WAIT_S):
            self.clock.advance(0.05)
        self.sup.close()
        self.spawner.close()


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    harness = Harness(tmp_path)
    try:
        yield harness
    finally:
        harness.close()


def test_register_binds_a_pool_worker_and_requests_reach_it(h: Harness) -> None:
    h.settle()
    assert len(h.spawner.workers) == 1  # the warm pool
    cap = h.register("acme", instances=1)
    (worker,) = h.spawner.of("acme")
    assert worker.received[0] == "bind"
    pong = h.call("ping", {}, cap)
    assert pong["pid"] == worker.process.pid
    assert "ping" in worker.received


def test_scale_up_and_down(h: Harness) -> None:
    h.register("acme", instances=1)
    h.call("scale", {"tenant": "acme", "instances": 3})
    h.settle()  # new instances start after the answer: their workers bind on later turns
    assert [w.instance for w in h.spawner.of("acme")] == [0, 1, 2]
    h.call("scale", {"tenant": "acme", "instances": 1})
    h.settle()
    assert [w.instance for w in h.spawner.of("acme")] == [0]


def test_crash_is_answered_and_restarted_after_backoff(h: Harness) -> None:
    cap = h.register("acme", instances=1)
    (worker,) = h.spawner.of("acme")
    worker.hang_ops.add("ping")
    rid = h.send("ping", {}, cap)
    h.until(lambda: "ping" in worker.received)  # in flight on the worker when it crashes
    worker.crash(signal.SIGSEGV)
    ok, err = h.answer(rid)
    assert not ok and err["code"] == "worker_lost" and err["fields"]["signal"] == signal.SIGSEGV
    h.tick(5.0)  # past any backoff
    # its replacement bound (the spawn's hello and bind cross real sockets: a loaded host delivers
    # them after any fixed number of quiet turns)
    h.until(lambda: len(h.spawner.of("acme")) == 1)
    (again,) = h.spawner.of("acme")
    assert again is not worker
    assert h.call("ping", {}, cap)["pid"] == again.process.pid


def test_a_hung_request_meets_its_deadline_and_the_worker_is_replaced(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    h = Harness(tmp_path)
    try:
        cap = h.register("acme", instances=1, request_timeout_s=2.0)
        (worker,) = h.spawner.of("acme")
        worker.hang_ops.add("ping")
        rid = h.send("ping", {}, cap)
        h.turn(5)
        assert h.client.poll(0) == 0  # not answered: the op hangs
        with caplog.at_level("WARNING", logger="twt.supervisor"):
            h.tick(2.5)
        ok, err = h.answer(rid)
        assert not ok and err["code"] in ("kernel_timeout", "worker_lost"), err
        assert signal.SIGTERM in worker.signals and not worker.alive
        # the exit event says why: the supervisor's kill at the request's deadline (twt chaos reads it)
        exits = [r for r in caplog.records if r.getMessage().startswith("event.exit")]
        assert [log._fields_of(r).get("cause") for r in exits] == ["deadline"], [r.__dict__ for r in exits]
        h.tick(5.0)
        (again,) = h.spawner.of("acme")
        assert again is not worker
    finally:
        h.close()


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace(h: Harness) -> None:
    cap = h.register("acme", instances=1, request_timeout_s=1.0)
    (worker,) = h.spawner.of("acme")
    worker.hang_ops.add("ping")
    worker.ignore_sigterm = True
    h.send("ping", {}, cap)
    h.tick(1.5)
    assert worker.signals == [signal.SIGTERM] and worker.alive
    h.tick(h.sup.config.kill_grace_s + 0.5)
    assert worker.signals == [signal.SIGTERM, signal.SIGKILL] and not worker.alive


def test_the_harness_moves_the_clock_only_after_late_heartbeat_replies_came_back(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness itself: a worker whose heartbeat replies reach the supervisor many polls late (a
    loaded host's starved I/O thread) is not killed for silence while the test moves the clock - the
    way a test that never made a worker silent lost one (and the device slot it asserted on)."""
    h.register("acme")
    h.settle()
    (slow,) = h.spawner.of("acme")
    late: list[int] = []  # polls left before each held reply is sent
    poll = h.sup.loop.poll

    def late_poll(timeout: float) -> Any:
        late[:] = [n - 1 for n in late]
        while late and late[0] <= 0:
            late.pop(0)
            slow.control.send(proto.encode_control("hb", {"requests": 0}))
        return poll(timeout)

    def on_control() -> None:
        while True:
            try:
                kind, _ = proto.decode_control(slow.control.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            if kind == "hb":
                late.append(100)

    monkeypatch.setattr(h.sup.loop, "poll", late_poll)
    h.sup.loop.unregister(slow.control)
    h.sup.loop.register(slow.control, on_control)
    cfg = h.sup.config
    h.tick(cfg.heartbeat_interval_s * (cfg.heartbeat_liveness + 2))
    assert slow.alive and not slow.signals


def test_silent_worker_is_killed_for_missed_heartbeats(h: Harness) -> None:
    h.register("acme", instances=1)
    (worker,) = h.spawner.of("acme")
    worker.silent = True
    cfg = h.sup.config
    h.tick(cfg.heartbeat_interval_s * (cfg.heartbeat_liveness + 2))
    assert signal.SIGTERM in worker.signals and not worker.alive


def test_a_kill_for_silence_logs_what_the_workers_threads_were_doing(
        h: Harness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    h.register("acme", instances=1)
    (worker,) = h.spawner.of("acme")
    seen: list[int] = []
    monkeypatch.setattr(workerset, "thread_report",
                        lambda pid, base=None: seen.append(pid) or "7:twt-control:D:pipe_write")
    worker.silent = True
    cfg = h.sup.config
    with caplog.at_level("WARNING", logger="twt.supervisor"):
        h.tick(cfg.heartbeat_interval_s * (cfg.heartbeat_liveness + 2))
    assert not worker.alive and seen == [worker.process.pid]
    kills = [r.getMessage() + str(getattr(r, "__dict__", {})) for r in caplog.records if "worker.kill" in r.getMessage()]
    assert any("7:twt-control:D:pipe_write" in k for k in kills), kills


def _starving(waited_s: Callable[[], float]) -> Callable[[int], dict[int, int]]:
    """A run-queue reading whose one thread has waited ``waited_s()`` seconds for a CPU by now."""
    return lambda pid: {pid: int(waited_s() * 1e9)}


def test_a_worker_starved_of_cpu_is_not_killed_for_beats_it_could_not_send(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded host: the worker's threads wait on a run queue and its beats come late. What it
    waited for a CPU is not silence, up to one liveness window more; past that it is killed."""
    h.register("acme", instances=1)
    (worker,) = h.spawner.of("acme")
    cfg = h.sup.config
    window = cfg.heartbeat_interval_s * cfg.heartbeat_liveness
    start = h.clock()
    # starved all the time since it went silent (the worst a loaded host does)
    monkeypatch.setattr(workerset, "run_delay_ns", _starving(lambda: h.clock() - start))
    worker.silent = True
    h.tick(window + 1.5)
    assert worker.alive and worker.signals == []
    h.tick(window + 1.0)  # twice the window and more: starved or not, it is killed
    assert signal.SIGTERM in worker.signals and not worker.alive


def test_a_silent_worker_that_is_not_waiting_for_a_cpu_is_killed_on_time(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    h.register("acme", instances=1)
    (worker,) = h.spawner.of("acme")
    cfg = h.sup.config
    monkeypatch.setattr(workerset, "run_delay_ns", _starving(lambda: 0.25))  # stopped: no waiting grows
    worker.silent = True
    h.tick(cfg.heartbeat_interval_s * (cfg.heartbeat_liveness + 2))
    assert signal.SIGTERM in worker.signals and not worker.alive


def _at_a_beat(h: Harness) -> None:
    """Move the clock until the supervisor has just sent its beats (and had them answered)."""
    workers = h.sup.parts.workers
    while workers._last_beat != h.clock():
        h.tick(0.25)


def test_a_worker_is_given_the_whole_window_from_the_first_beat_it_leaves_unanswered(h: Harness) -> None:
    """Silence runs from the oldest beat not answered, not from the last answer: an answer comes
    only after a beat, so the time from the last answer to the next beat is no silence."""
    h.register("acme", instances=1)
    (worker,) = h.spawner.of("acme")
    cfg = h.sup.config
    _at_a_beat(h)
    worker.silent = True
    h.tick(cfg.heartbeat_interval_s)  # the first beat it leaves unanswered
    assert h.sup.parts.workers._last_beat == h.clock()
    h.tick(cfg.heartbeat_interval_s * cfg.heartbeat_liveness)  # a whole window since that beat
    assert worker.alive and worker.signals == []
    h.tick(cfg.heartbeat_interval_s * 2)
    assert signal.SIGTERM in worker.signals and not worker.alive


def test_a_worker_that_answers_every_beat_is_never_read_for_starvation(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run-queue baseline (a /proc read of every thread) is taken only for a worker that left a
    beat unanswered. The beats ride on housekeeping ticks, which come a little later than the
    interval (steps of 0.22 s here, each an ordinary turn: no lateness), so at each beat the last
    answer is a little more than an interval old - and that worker is on time."""
    h.register("acme", instances=1)
    (worker,) = h.spawner.of("acme")
    reads: list[int] = []
    monkeypatch.setattr(workerset, "run_delay_ns", lambda pid: reads.append(pid) or {pid: 0})
    h.tick(h.sup.config.heartbeat_interval_s * 10, step=0.22)
    assert worker.alive and reads == []
    worker.silent = True
    h.tick(h.sup.config.heartbeat_interval_s * 3, step=0.22)
    assert reads  # one that leaves a beat unanswered is


def test_too_many_restarts_mark_the_tenant_failed_and_reset_revives_it(h: Harness) -> None:
    cap = h.register("acme", instances=1, max_restarts=2, restart_window_s=600)
    live = h.sup.parts.workers.workers
    for restart in range(3):
        if restart:  # the restart is bound (its messages handled, however late a loaded host delivers them)
            h.until(lambda: len(h.spawner.of("acme")) == 1)
        (worker,) = h.spawner.of("acme")
        worker.crash()
        h.until(lambda: worker.handle.ident not in live)  # its death handled, before the clock moves
        h.tick(1.0)  # past the backoff of each restart (0, 50 ms, 100 ms)
    h.settle()
    assert h.spawner.of("acme") == []
    assert h.tenant("acme")["state"] == "failed"
    err = h.error("ping", {}, cap)
    assert err["code"] == "tenant_failed"
    h.call("reset", {"tenant": "acme"})
    h.settle()
    (worker,) = h.spawner.of("acme")
    assert h.call("ping", {}, cap)["pid"] == worker.process.pid


def test_rolling_restart_replaces_every_instance(h: Harness) -> None:
    h.register("acme", instances=2)
    before = {w.process.pid for w in h.spawner.of("acme")}
    h.call("restart", {"tenant": "acme"})
    h.settle()
    after = {w.process.pid for w in h.spawner.of("acme")}
    assert len(after) == 2 and not before & after


def test_evict_stops_workers_and_revokes_the_capability(h: Harness) -> None:
    cap = h.register("acme", instances=2)
    workers = h.spawner.of("acme")
    h.call("evict", {"tenant": "acme"})
    assert all(not w.alive for w in workers)
    err = h.error("ping", {}, cap)
    assert err["code"] in ("capability_revoked", "isolation_violation", "unknown_tenant"), err


def test_the_domain_answers_a_registration_and_an_eviction_through_completions(h: Harness) -> None:
    """AdminOps takes no client identity: register and evict return completions, done once the
    workers are bound (or gone); the parts came from the one factory, as the daemon's do."""
    parts = h.sup.parts
    assert parts is not None
    registered: list[object] = []
    done = parts.admin.register(TenantSpec("acme", instances=2))
    done.then(registered.append, registered.append)
    assert not done.done  # committed on the writer thread; its instances bind on later turns
    h.until(lambda: done.done)
    (result,) = registered
    assert isinstance(result, dict) and result["capability"] and result["tenant"]["tenant_id"] == "acme"
    assert result["tenant"]["state"] == "running" and len(result["tenant"]["pids"]) == 2
    pids = sorted(w.process.pid for w in h.spawner.of("acme"))
    gone = parts.admin.evict("acme")
    assert not gone.done  # its two workers are still stopping
    h.until(lambda: gone.done)
    evicted: list[object] = []
    gone.then(evicted.append, evicted.append)
    assert len(evicted) == 1 and isinstance(evicted[0], dict)
    assert evicted[0]["evicted"] == "acme" and sorted(evicted[0]["pids"]) == pids
    assert not h.spawner.of("acme")


def test_the_quota_segment_lives_while_a_worker_may_hold_it(h: Harness) -> None:
    """Made at the bind, kept through a crash whose restart is immediate or backed off (the restart
    is moments away), taken down once the tenant failed (no worker will come): the counters stay."""
    cap = h.register("acme", instances=1, max_restarts=2, restart_window_s=600)
    rt = h.sup.tenants["acme"]
    first = rt.block.name
    assert first and rt.block.segment is not None
    h.register("idle", instances=0)
    assert h.sup.tenants["idle"].block.segment is None  # never started: never a segment
    (worker,) = h.spawner.of("acme")
    worker.crash()
    h.turn(5)
    assert rt.block.name == first  # restarted at once: the same segment
    h.tick(1.0)
    (worker,) = h.spawner.of("acme")
    worker.crash()
    h.settle(quiet_turns=3)
    assert any(s.restart_at is not None for s in rt.slots) and not h.spawner.of("acme")  # backing off
    assert rt.block.name == first  # a back-off restart keeps it
    h.tick(1.0)
    (worker,) = h.spawner.of("acme")
    worker.crash()
    h.tick(1.0)
    assert h.tenant("acme")["state"] == "failed"
    assert rt.block.segment is None and rt.block.name == ""  # no worker will come: the segment went
    assert not os.path.exists(f"/dev/shm/{first}")
    assert rt.block.snapshot().memory_quota_bytes == rt.spec.memory_quota_bytes
    h.call("reset", {"tenant": "acme"})
    h.settle()
    (worker,) = h.spawner.of("acme")
    assert h.call("ping", {}, cap)["pid"] == worker.process.pid
    assert rt.block.name not in ("", first)  # made again for the new worker


def test_an_empty_pool_hands_over_a_pool_worker_already_starting_rather_than_spawning_another(h: Harness) -> None:
    """An instance that finds the pool empty while a pool worker is starting takes that worker
    (further along than a new process, which would compete with it for the CPU); the pool
    refills behind it."""
    from tests.helpers.fake_workers import FakeWorker

    h.settle()
    assert len(h.spawner.workers) == 1  # the warm pool
    held: list[FakeWorker] = []

    def hold_hello(worker: FakeWorker) -> None:  # the new workers stay starting until released
        held.append(worker)
        worker.say_hello = lambda: None  # type: ignore[method-assign]

    h.spawner.on_spawn.append(hold_hello)
    h.register("first", instances=1)  # the warm worker
    h.tick(0.25)  # housekeeping refills the pool: one worker starting
    assert len(held) == 1 and held[0].handle.tenant is None and h.sup.parts.workers.pool_starting == 1
    rid = h.send("register", {"spec": TenantSpec("second").to_dict()})
    # the registration placed (its durable write is a writer thread's: turns until then, not a count)
    h.until(lambda: held[0].handle.tenant is not None or len(h.spawner.workers) > 2)
    starting = held[0]
    assert starting.handle.tenant == "second", "the starting pool worker was handed over"
    assert len(h.spawner.workers) == 2 and h.sup.parts.workers.pool_starting == 0  # no process spawned for it
    FakeWorker.say_hello(starting)
    ok, payload = h.answer(rid)
    assert ok, payload
    assert [w.handle.worker_id for w in h.spawner.of("second")] == [starting.handle.worker_id]
    assert starting.received[0] == "bind"
    h.tick(0.25)  # and the pool refills behind it
    assert len(held) == 2 and held[1].handle.tenant is None


def _parked_tenant_harness(tmp: Path, name: str) -> Harness:
    """A supervisor restarted on a state dir where ``name`` (one instance, no buffers) is stored
    parked: it comes back parked, and its first request activates it."""
    from supervisor.store.state import StateStore

    state = str(tmp / "state")
    first = Harness(tmp / "first", state_dir=state)
    try:
        first.register(name, instances=1, idle_timeout_s=3600.0)
    finally:
        first.close()
    store = StateStore.open(state)
    try:
        store.set_parked_many([name], True)
    finally:
        store.close()
    harness = Harness(tmp / "second", state_dir=state)
    harness.settle()
    assert harness.tenant(name)["state"] == "parked"
    return harness


def test_an_activation_sends_the_import_right_behind_the_bind_without_waiting_for_its_answer(
        tmp_path: Path) -> None:
    """The warm worker's bind and the instance's import leave together: the activation waits for
    one answer from the worker, not for the bind's and then the import's."""
    h = _parked_tenant_harness(tmp_path, "sleepy")
    try:
        (pool_worker,) = list(h.spawner.alive())
        assert pool_worker.handle.tenant is None
        pool_worker.hang_ops.add("bind")  # its bind is never answered
        cap = h.call("capability", {"tenant": "sleepy"})["capability"]
        h.send("ping", {}, cap)
        h.until(lambda: len(pool_worker.received) >= 2)
        assert pool_worker.received[:2] == ["bind", "import_buffer"]
        assert h.tenant("sleepy")["state"] != "running"  # nothing confirmed: the bind is unanswered
    finally:
        h.close()


def test_an_activation_whose_import_went_behind_the_bind_serves_the_waiting_request(tmp_path: Path) -> None:
    h = _parked_tenant_harness(tmp_path, "sleepy")
    try:
        (pool_worker,) = list(h.spawner.alive())
        cap = h.call("capability", {"tenant": "sleepy"})["capability"]
        assert h.call("ping", {}, cap)["pid"] == pool_worker.process.pid
        assert pool_worker.received[:3] == ["bind", "import_buffer", "ping"]
        assert h.tenant("sleepy")["state"] == "running"
    finally:
        h.close()


def test_a_failed_bind_fails_the_import_behind_it_and_the_next_worker_imports_again(tmp_path: Path) -> None:
    """A bind refused by the worker is that worker's failure (it is killed), not the activation's:
    the import sent behind it is refused too, and the worker that replaces it binds and imports."""
    from tests.helpers.fake_workers import FakeWorker

    h = _parked_tenant_harness(tmp_path, "sleepy")
    try:
        (pool_worker,) = list(h.spawner.alive())

        def failing_bind(worker: FakeWorker = pool_worker) -> None:
            for rid, op, _args, _frames in worker.requests():
                error = {"code": "invalid_argument", "message": "bind refused" if op == "bind" else "not bound"}
                worker.data.send(proto.encode_worker_reply(rid, False, error))

        h.sup.loop.unregister(pool_worker.data)
        h.sup.loop.register(pool_worker.data, failing_bind)
        pool_worker.ignore_sigterm = True  # the import's refusal is read while it is being killed
        cap = h.call("capability", {"tenant": "sleepy"})["capability"]
        rid = h.send("ping", {}, cap)
        h.until(lambda: pool_worker.signals == [signal.SIGTERM])
        assert pool_worker.received[:2] == ["bind", "import_buffer"]
        h.settle()
        assert pool_worker.alive and h.tenant("sleepy")["state"] != "parked"  # still activating
        h.tick(h.sup.config.kill_grace_s + 2.0)  # SIGKILL; the restart's back-off; the next bind and import
        ok, payload = h.answer(rid)
        assert ok, payload
        (served_by,) = h.spawner.of("sleepy")
        assert served_by is not pool_worker and payload["pid"] == served_by.process.pid
        assert served_by.received[:3] == ["bind", "import_buffer", "ping"]
        assert h.tenant("sleepy")["state"] == "running"
    finally:
        h.close()


def _warms_up(worker: Any) -> None:
    """A fake worker that, like a real one, says in its hello that it warms up (and is then
    ready for the pool only once it says ``warmed``: :func:`_say_warmed`)."""
    from shared.worker_link import WorkerHello

    def hello() -> None:
        wire = WorkerHello(worker.handle.token, worker.process.pid, warming=True).to_wire()
        worker.data.send(proto.encode_worker_reply(0, True, wire))
        worker.control.send(proto.encode_control("hello", wire))

    worker.say_hello = hello


def _say_warmed(worker: Any) -> None:
    from shared.worker_link import WORKER_WARMED

    worker.data.send(proto.encode_worker_reply(0, True, WORKER_WARMED))


def test_a_pool_worker_that_warms_up_joins_the_pool_once_it_says_warmed(h: Harness) -> None:
    h.settle()
    h.spawner.on_spawn.append(_warms_up)
    h.register("first", instances=1)  # takes the pool's worker
    h.tick(0.25)  # housekeeping refills: a worker that warms up after its hello
    fresh = h.spawner.workers[-1]
    h.until(lambda: fresh.handle.connected)  # its hello handled (a loaded host is slow to send it)
    ws = h.sup.parts.workers
    assert fresh.handle.tenant is None and fresh.handle.connected
    assert ws.pool == [] and ws.warming == [fresh.handle] and ws.pool_starting == 1  # not ready yet
    status = h.call("status", {"limit": 1})["supervisor"]["pool"]
    assert (status["idle"], status["starting"]) == (0, 1)
    _say_warmed(fresh)
    h.settle()
    assert ws.pool == [fresh.handle] and ws.warming == [] and ws.pool_starting == 0
    _say_warmed(fresh)  # said again: ignored, never a second place in the pool
    h.settle()
    assert ws.pool == [fresh.handle] and fresh.alive
    h.register("second", instances=1)
    assert [w.handle.worker_id for w in h.spawner.of("second")] == [fresh.handle.worker_id]


def test_with_the_pool_empty_a_warming_worker_is_bound_rather_than_a_process_spawned(h: Harness) -> None:
    h.settle()
    h.spawner.on_spawn.append(_warms_up)
    h.register("first", instances=1)
    h.tick(0.25)
    warming = h.spawner.workers[-1]
    h.until(lambda: warming.handle.connected)  # warming up, not still starting (its hello handled)
    spawned = len(h.spawner.workers)
    h.register("second", instances=1)  # no warm worker: the warming one is bound, its warm-up cut short
    assert [w.handle.worker_id for w in h.spawner.of("second")] == [warming.handle.worker_id]
    assert len(h.spawner.workers) == spawned  # nothing spawned for it
    ws = h.sup.parts.workers
    assert ws.warming == [] and ws.pool_starting == 0
    _say_warmed(warming)  # its notice crossed the bind: ignored
    h.settle()
    assert ws.pool == [] and warming.alive and warming.handle.tenant == "second"


def test_a_warming_pool_worker_that_dies_leaves_the_pool_count(h: Harness) -> None:
    h.settle()
    h.spawner.on_spawn.append(_warms_up)
    h.register("first", instances=1)
    h.tick(0.25)
    warming = h.spawner.workers[-1]
    ws = h.sup.parts.workers
    assert ws.pool_starting == 1
    warming.crash()
    h.settle()
    assert ws.warming == [] and warming.handle not in ws.pool and ws.pool_starting <= 1
    h.tick(1.0)  # past the failed start's back-off: the refill starts a worker
    h.until(lambda: len(ws.warming) + len(ws.pool) == 1)  # its hello handled (a loaded host is slow to send it)
    assert ws.pool_starting == 1


def test_the_pool_refill_waits_for_a_bind_in_flight_for_a_bounded_time(tmp_path: Path) -> None:
    """A new pool process's start and warm-up would compete with a bind for the CPU: the refill
    waits while a bind is in flight (a warm worker is still there for the next activation) - the
    housekeeping tick's refill is put off once - for two housekeeping ticks at most (a stream of
    binds must not drain the pool)."""
    from supervisor.lifecycle.workerset import POOL_HOLD_MAX_S
    from supervisor.supervisor import TICK_S

    h = Harness(tmp_path, pool_size=2)
    try:
        h.settle()
        held: list[tuple[Any, list[bytes]]] = []
        for worker in list(h.spawner.alive()):
            def hold_bind(worker: Any = worker) -> None:
                for rid, op, _args, frames in worker.requests():
                    if op == "bind":
                        held.append((worker, frames))
                    else:
                        worker.data.send(proto.encode_worker_reply(rid, True, {}))

            h.sup.loop.unregister(worker.data)
            h.sup.loop.register(worker.data, hold_bind)
        spawned = len(h.spawner.workers)
        rid = h.send("register", {"spec": TenantSpec("slow", instances=1).to_dict()})
        h.until(lambda: bool(held))
        ws = h.sup.parts.workers
        assert len(ws.pool) == 1 and ws.binding()
        h.tick(POOL_HOLD_MAX_S * 0.8, step=POOL_HOLD_MAX_S * 0.8)  # below its size, and no process started
        assert len(h.spawner.workers) == spawned and ws.binding()
        h.tick(TICK_S * 2.2, step=TICK_S * 1.1)  # past two ticks: refilled, the bind still unanswered
        assert len(h.spawner.workers) == spawned + 1 and ws.binding()
        worker, frames = held[0]
        bind_rid = proto.decode_worker_request(frames[0])[0]
        worker.data.send(proto.encode_worker_reply(bind_rid, True, {"pid": worker.process.pid}))
        ok, payload = h.answer(rid)
        assert ok, payload
    finally:
        h.close()


def test_the_tenants_artifacts_go_after_the_import_and_before_the_waking_request(tmp_path: Path) -> None:
    """The compiled modules follow the instance's import once it is answered (sent behind it,
    their hold competed with the supervisor's turn on a loaded host, and the waking request
    waited behind them either way), ahead of the request that woke the tenant; their load
    comes after it."""
    h = _parked_tenant_harness(tmp_path, "sleepy")
    try:
        cap = h.call("capability", {"tenant": "sleepy"})["capability"]
        module = b"(module (func (export \"f\") (result i32) i32.const 7))"
        rid = next(h._rid)
        h.client.send_multipart([proto.encode_request(rid, "put_module", cap, {}), module])
        ok, stored = h.answer(rid)
        assert ok, stored
        rt = h.sup.tenants["sleepy"]
        parking = h.sup.parts.parking
        assert parking.artifacts is not None and h.tenant("sleepy")["state"] == "parked"
        parking.artifacts.store.save_artifact("sleepy", rt.generation, stored["digest"], "ab" * 16, b"compiled")
        (pool_worker,) = list(h.spawner.alive())
        assert h.call("ping", {}, cap)["pid"] == pool_worker.process.pid
        h.until(lambda: "load_modules" in pool_worker.received)
        assert pool_worker.received[:5] == ["bind", "import_buffer", "import_modules", "ping", "load_modules"]
    finally:
        h.close()

def test_a_pool_worker_killed_before_its_hello_leaves_the_pool_count_and_is_replaced(h: Harness) -> None:
    """A pool worker that never says hello is killed; it counted as starting, and no longer does
    (a count left behind would keep the pool below its size for good)."""
    h.settle()
    silent: list[Any] = []

    def no_hello(worker: Any) -> None:
        silent.append(worker)
        worker.say_hello = lambda: None

    h.spawner.on_spawn.append(no_hello)
    h.register("first", instances=1)  # takes the pool's worker
    h.tick(0.25)  # the refill: a worker that stays silent
    ws = h.sup.parts.workers
    assert len(silent) == 1 and ws.pool_starting == 1
    h.spawner.on_spawn.clear()
    h.tick(workerset.HELLO_TIMEOUT_S + 1.0)  # killed for its silence; a new one replaces it
    assert not silent[0].alive
    assert ws.pool_starting == 0 and len(ws.pool) == 1


def test_a_burst_of_instance_starts_raises_the_pool_target_at_once(tmp_path: Path) -> None:
    """Ten starts within a moment: the pool grows for them now (their rate over a few seconds),
    not by a thirtieth of a worker each (their rate over the 30 s window), and settles back to
    the long window's target once the burst is seconds old. Starts at one moment are not read
    over their span (none): a tenant's instances do not fill the pool to its most."""
    h = Harness(tmp_path, pool_size=1, pool_max=8)
    try:
        ws = h.sup.parts.workers
        ws._refill_s = 0.5  # a pool worker's spawn-to-ready time, as measured
        now = h.clock()
        assert ws.pool_target_now(now) == 1
        for _ in range(10):
            ws._note_demand()
        refill = 0.5 + workerset.POOL_REFILL_LAG_S

        def covers(rate: float) -> int:  # the pool for that rate: its refill time's starts at the 99th percentile
            return workerset.poisson_quantile(rate * refill, workerset.POOL_WARM_SHARE) + 1

        # 10 starts at once: 5/s over the burst window, 2.75 workers taken on average while one refill starts
        assert ws.pool_target_now(now) == min(8, covers(5.0)) == 8
        # decayed, not read over a span: they came at one moment
        assert ws.pool_target_now(now + 0.5) == covers(5.0 * math.exp(-0.5 / workerset.POOL_BURST_WINDOW_S)) == 7
        later = now + 10 * workerset.POOL_BURST_WINDOW_S
        assert ws.pool_target_now(later) == 1 + 1  # the long window's: recent demand, one more
    finally:
        h.close()


def test_the_opening_of_a_stream_of_activations_raises_the_pool_target_to_its_rate(tmp_path: Path) -> None:
    """Starts at 15/s: half a second in, the pool's target covers 15/s times a refill (a decayed
    count that starts from nothing held a fifth of that rate then: the pool ran dry through a
    stream's opening); seconds in, the burst's reading is its decayed rate as before. Two starts
    moments apart are not read over their span (the pool is not filled to its most)."""
    h = Harness(tmp_path, pool_size=1, pool_max=8)
    try:
        ws = h.sup.parts.workers
        ws._refill_s = 0.2
        ws._note_demand()
        h.clock.advance(0.01)
        ws._note_demand()
        assert ws.pool_target_now(h.clock()) == 1 + 2  # 1/s over the burst window, not read over their span
        h.clock.advance(10 * workerset.POOL_BURST_WINDOW_S)
        for _ in range(8):
            h.clock.advance(1 / 15)
            ws._note_demand()
        assert ws.pool_target_now(h.clock()) >= 1 + 3  # 15/s x 0.25 s, and its clumps
        for _ in range(150):
            h.clock.advance(1 / 15)
            ws._note_demand()
        now = h.clock()
        assert ws._burst_estimate(now) == pytest.approx(ws._decayed_burst(now), rel=0.02)
    finally:
        h.close()



def test_a_steady_stream_of_starts_sizes_the_pool_for_its_clumps_not_its_mean(tmp_path: Path) -> None:
    """Starts at 10/s with a refill (tick lag plus spawn-to-ready) of 0.25 s take 2.5 pool workers
    on average within one refill, but more in a clump: the pool holds the 99th percentile of a
    Poisson count with that mean (plus the one an activation takes), so that an activation finds
    a warm worker 99 % of the time - the mean (1 + 3 before) left it dry for a tenth of them."""
    h = Harness(tmp_path, pool_size=1, pool_max=16)
    try:
        ws = h.sup.parts.workers
        ws._refill_s = 0.2
        mean = 10.0 * (0.2 + workerset.POOL_REFILL_LAG_S)
        for _ in range(300):  # 30 s at 10/s: both windows read the rate itself
            h.clock.advance(0.1)
            ws._note_demand()
        target = ws.pool_target_now(h.clock())

        def dry(pool: int) -> float:  # P(the starts of one refill time reach the pool): an activation finds none
            return 1.0 - sum(math.exp(-mean) * mean ** k / math.factorial(k) for k in range(pool))

        assert dry(target) <= 1 - workerset.POOL_WARM_SHARE < dry(target - 1), target
        assert target == 8
    finally:
        h.close()


def test_the_poisson_quantile_is_the_least_count_its_share_of_draws_stay_within() -> None:
    assert workerset.poisson_quantile(0.0, 0.99) == 0
    for mean in (0.05, 0.5, 2.5, 7.0, 40.0):
        k = workerset.poisson_quantile(mean, 0.99)
        cdf = [sum(math.exp(-mean) * mean ** i / math.factorial(i) for i in range(n + 1)) for n in (k - 1, k)]
        assert cdf[0] < 0.99 <= cdf[1], (mean, k, cdf)
    big = workerset.poisson_quantile(1000.0, 0.99)  # exp(-1000) underflows: the normal approximation
    assert 1060 <= big <= 1080


def test_a_workers_death_reclaims_its_device_slot_by_its_pid_reading_no_other_workers_proc_entry(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A death the loop saw frees that worker's device-budget share by its pid alone: no ``/proc``
    read of any other worker (a scan of every owner held the loop ~0.3 ms a live worker on a loaded
    host). The full scan stays as the periodic net: a slot whose owner is gone unseen is freed
    within ``RECLAIM_SCAN_INTERVAL_S``."""
    from tests.helpers.proc_reads import count_proc_reads
    from shared.device_budget import _S_PID, _S_START, DeviceBudget, _slot_off

    h.register("acme", instances=3)
    h.settle()
    workers = h.spawner.of("acme")
    assert h.sup.parts is not None
    budget = h.sup.parts.placement.budget(0)
    # each fake worker's device slot, as a worker claims it at its bind (its pid, its start time)
    slots = [DeviceBudget.attach(budget.name) for _ in workers]
    stranger = DeviceBudget.attach(budget.name)  # an owner no death will tell of
    try:
        stranger.consume(MIB)
        assert stranger.slot is not None
        _atomics.store(budget._buf, _slot_off(stranger.slot) + _S_PID, workers[2].process.pid + 1000)
        h.tick(workerset.RECLAIM_SCAN_INTERVAL_S)  # a periodic scan: the stranger's owner is gone
        assert budget.used_bytes == 0
        # the next scan is RECLAIM_SCAN_INTERVAL_S away (the clock stands still from here)
        for handle, worker in zip(slots, workers, strict=True):
            handle.consume(MIB)
            assert handle.slot is not None
            # a fake pid (above pid_max: /proc never has it): any owner whose entry is read looks gone
            _atomics.store(budget._buf, _slot_off(handle.slot) + _S_PID, worker.process.pid)
            _atomics.store(budget._buf, _slot_off(handle.slot) + _S_START, 12345)
        assert budget.used_bytes == 3 * MIB
        reads = count_proc_reads(monkeypatch)
        workers[0].crash()
        live = h.sup.parts.workers.workers
        h.until(lambda: workers[0].handle.ident not in live)  # its death handled
        assert budget.used_bytes == 2 * MIB  # its share only
        assert set(reads) <= {workers[0].process.pid}  # the dead worker's entry only
        assert {holder[0] for holder in budget.snapshot().holders} == {slots[1].slot, slots[2].slot}
    finally:
        for handle in (*slots, stranger):
            handle.close()


def test_an_idle_supervisor_ticks_slowly_and_a_request_brings_the_short_tick_back(h: Harness) -> None:
    """Idle (nothing in flight, parked, starting, stopping or due), housekeeping runs at the idle
    tick: an idle supervisor's loop wakes a few times a second, not twenty. A request that comes
    meanwhile brings the short tick back in the turn that reads it, so its deadline is watched as
    closely as on a supervisor that was never idle: the hung request is killed one short tick past
    its deadline."""
    from supervisor.supervisor import IDLE_TICK_S, TICK_S

    cap = h.register("acme", instances=1, request_timeout_s=1.0)
    (worker,) = h.spawner.of("acme")
    h.tick(1.0)  # settled: the instance bound, the pool refilled
    sup = h.sup
    assert TICK_S < sup._next_tick - h.clock() <= IDLE_TICK_S, "an idle supervisor kept the short tick"
    worker.hang_ops.add("ping")
    h.send("ping", {}, cap)
    h.until(lambda: "ping" in worker.received)
    assert sup._next_tick - h.clock() <= TICK_S, "a request in flight left the idle tick in place"
    # to the deadline and one short tick (less than an idle one) past it, in steps the stall guard
    # takes for ordinary turns
    h.tick(1.0 + TICK_S * 1.1, step=0.15)
    assert signal.SIGTERM in worker.signals, "the hung request was not killed at its deadline"
