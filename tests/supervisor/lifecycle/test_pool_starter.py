"""Workers' processes start on the worker set's starter thread, not on the supervisor's loop.

A real supervisor and real worker processes (``spawn``), driven by the test's own turns. The
worker's handle exists before its process: the loop turns while a start waits for its process,
a hello said before the start is taken in finds the handle, an instance that finds no warm
worker takes a start still in flight instead of starting another, and a stop, a teardown or a
failed start each end such a start cleanly.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from shared import protocol as proto
from shared.config import SupervisorConfig
from shared.spec import TenantSpec
from supervisor.runtime.workers import PreparedStart, Spawner, WorkerHandle, WorkerState
from supervisor.store.rundir import read_admin_capability
from supervisor.supervisor import Supervisor

pytestmark = pytest.mark.timeout(180)

#: real seconds before the test calls a step stuck (workers start in well under that)
STUCK_S = 90.0


class HeldSpawner(Spawner):
    """Starts each process, then holds the start (on the starter thread) while ``hold`` is set,
    until the test releases it."""

    def __init__(self, config: SupervisorConfig, endpoints: dict[str, str]) -> None:
        super().__init__(config, endpoints)
        self.hold = threading.Event()
        self.release = threading.Event()
        self.prepared = 0
        self.handles: list[WorkerHandle] = []
        self.in_start = threading.Event()  # a start is being held now
        self.signals: list[tuple[int, int]] = []  # (pid, signal) as sent

    def signal(self, worker: WorkerHandle, sig: int) -> None:
        self.signals.append((worker.pid, sig))
        super().signal(worker, sig)

    def prepare(self, pool: bool = False) -> PreparedStart:
        self.prepared += 1
        return super().prepare(pool)

    def start(self, prepared: PreparedStart) -> WorkerHandle:
        handle = super().start(prepared)
        self.handles.append(handle)
        if self.hold.is_set():
            self.in_start.set()
            self.release.wait(STUCK_S)
            self.in_start.clear()
        return handle


class FailingSpawner(HeldSpawner):
    """Every start fails once ``fail`` is set (the fork server gone, fds exhausted)."""

    fail = False

    def start(self, prepared: PreparedStart) -> WorkerHandle:
        if self.fail:
            raise OSError(24, "Too many open files")
        return super().start(prepared)


class Rig:
    """A supervisor on real worker processes, turned by the test, and a raw client."""

    def __init__(self, tmp: Path, spawner_cls: type[HeldSpawner] = HeldSpawner, **cfg: Any) -> None:
        made: list[HeldSpawner] = []

        def factory(config: SupervisorConfig, endpoints: dict[str, str]) -> HeldSpawner:
            made.append(spawner_cls(config, endpoints))
            return made[0]

        self.config = SupervisorConfig(run_dir=str(tmp / "run"), backend="stub", pool_size=1, start_method="spawn",
                                       **cfg)
        self.sup = Supervisor(self.config, spawner=factory)
        self.sup.start()
        self.spawner = made[0]
        assert self.sup.parts is not None
        self.workers = self.sup.parts.workers
        self.admin = read_admin_capability(self.config.run_dir)
        self.client: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        self.client.setsockopt(zmq.LINGER, 0)
        self.client.connect(self.sup.rundir.endpoint("frontend"))
        self._rid = itertools.count(1)

    def until(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + STUCK_S
        while not done():
            assert time.monotonic() < deadline, f"not within {STUCK_S} s: {what}"
            self.sup.turn(0.01)

    def send_register(self, name: str) -> int:
        rid = next(self._rid)
        spec = TenantSpec(name, instances=1).to_dict()
        self.client.send(proto.encode_request(rid, "register", self.admin, {"spec": spec}))
        return rid

    def answer(self, rid: int) -> tuple[bool, Any]:
        got: list[tuple[int, bool, Any]] = []

        def answered() -> bool:
            if self.client.poll(0):
                got.append(proto.decode_reply(self.client.recv_multipart()[0]))
            return bool(got)

        self.until(answered, f"the answer to request {rid}")
        assert got[0][0] == rid
        return got[0][1], got[0][2]

    def close(self) -> None:
        self.spawner.release.set()
        self.client.close(0)
        self.sup.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    try:
        yield r
    finally:
        r.close()


def _held_pool_start(rig: Rig) -> WorkerHandle:
    """Hold the pool's next start: the warm worker goes to tenant ``first``, and the refill's
    start is held on the starter thread. The refill's handle (its process not taken in)."""
    rig.until(lambda: len(rig.workers.pool) == 1, "the warm pool")
    rig.spawner.hold.set()
    ok, payload = rig.answer(rig.send_register("first"))
    assert ok, payload
    rig.until(rig.spawner.in_start.is_set, "the refill's start, held")
    (starting,) = [w for w in rig.workers.workers.values() if w.tenant is None]
    return starting


def test_a_workers_start_runs_off_the_loop_and_its_handle_exists_before_its_process(rig: Rig) -> None:
    starting = _held_pool_start(rig)
    assert not starting.started and starting.state is WorkerState.STARTING and rig.workers.pool_starting == 1
    # the loop turns while the start is held; the worker says hello meanwhile (its handle finds it)
    rig.until(lambda: starting.connected, "the held worker's hellos")
    assert rig.spawner.in_start.is_set() and not rig.workers.pool  # not in the pool before its process is known
    rig.spawner.release.set()
    rig.until(lambda: rig.workers.pool == [starting], "the worker in the pool")
    assert starting.started and starting.pid == rig.spawner.handles[-1].pid and rig.workers.pool_starting == 0


def test_an_instance_with_no_warm_worker_takes_a_start_in_flight_rather_than_starting_another(rig: Rig) -> None:
    starting = _held_pool_start(rig)
    prepared = rig.spawner.prepared
    rid = rig.send_register("second")
    rt = rig.sup.tenants
    rig.until(lambda: "second" in rt and rt["second"].slots and rt["second"].slots[0].worker is not None,
              "the second tenant's instance given a worker")
    assert rt["second"].slots[0].worker is starting, "the start in flight was taken"
    assert starting.tenant == "second" and not starting.started
    # nothing started for the instance itself: one more start at most, the pool's own refill
    assert rig.spawner.prepared <= prepared + 1
    assert all(w.tenant is None for w in rig.workers.workers.values() if w is not starting and not w.started)
    rig.spawner.release.set()
    ok, payload = rig.answer(rid)
    assert ok, payload
    assert rt["second"].slots[0].worker is starting and starting.pid == rig.spawner.handles[1].pid


def test_a_start_in_flight_at_teardown_is_waited_for_and_its_worker_killed(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    try:
        _held_pool_start(rig)
        queued = [rig.workers._spawn() for _ in range(2)]  # two more starts queued behind the held one
        assert not any(w.started for w in queued)
        threading.Timer(0.2, rig.spawner.release.set).start()  # the start finishes during the teardown
    finally:
        rig.client.close(0)
        rig.sup.close()
        rig.spawner.release.set()
    held = rig.spawner.handles[-1]
    with pytest.raises(ValueError, match="closed"):  # killed, reaped and closed by the teardown
        _ = held.process.exitcode
    assert len(rig.spawner.handles) == 2  # the pool's first worker and the held one: the queued never started


def test_a_worker_whose_start_ends_after_the_stop_began_is_stopped(rig: Rig) -> None:
    starting = _held_pool_start(rig)
    rig.sup.request_stop()
    rig.until(lambda: rig.sup._stopping, "the stop's stop_all")
    assert starting.expected_exit and starting.state is WorkerState.STOPPING and not starting.started
    rig.spawner.release.set()
    # its process gets the stop as its start ends, and exits: not waited on until the stop's timeout
    rig.until(lambda: starting.state is WorkerState.DEAD, "the late worker's exit")
    assert starting.ident not in rig.workers.workers and starting.kill_reason == "shutdown"


def test_a_signal_asked_before_the_process_exists_waits_for_it_and_a_kill_is_not_lowered(rig: Rig) -> None:
    import signal

    starting = _held_pool_start(rig)
    rig.workers.kill(starting, "test", "protocol")
    assert starting.pending_signal == signal.SIGTERM and starting.state is WorkerState.STOPPING
    rig.workers._signal(starting, signal.SIGKILL)
    rig.workers._signal(starting, signal.SIGTERM)
    assert starting.pending_signal == signal.SIGKILL
    rig.spawner.release.set()
    rig.until(lambda: starting.state is WorkerState.DEAD, "the killed worker's exit")
    assert starting.pending_signal is None
    assert [sig for pid, sig in rig.spawner.signals if pid == starting.pid] == [signal.SIGKILL]
    assert all(pid != 0 for pid, _ in rig.spawner.signals)  # never a signal to a pid not known yet


def test_a_failed_start_is_a_pool_failure_and_an_instance_that_took_it_is_answered(tmp_path: Path) -> None:
    rig = Rig(tmp_path, FailingSpawner)
    try:
        rig.until(lambda: len(rig.workers.pool) == 1, "the warm pool")
        spawner = rig.spawner
        assert isinstance(spawner, FailingSpawner)
        spawner.fail = True
        ok, payload = rig.answer(rig.send_register("first"))  # the warm worker
        assert ok, payload
        # every refill start in flight failed (a refill may start more than one; the pool then waits
        # its back-off before it starts another)
        rig.until(lambda: rig.workers._pool_failures >= 1 and rig.workers.pool_starting == 0,
                  "the refill's failed starts")
        assert not rig.workers.pool
        assert all(w.started for w in rig.workers.workers.values())  # the failed start's handle is gone
        ok, payload = rig.answer(rig.send_register("second"))  # its own start fails too: a typed answer
        assert not ok and isinstance(payload, dict) and "could not start" in str(payload.get("message")), payload
        assert rig.sup.turn(0.01)  # the loop goes on
    finally:
        rig.close()


def test_an_instance_that_takes_the_last_warm_worker_starts_the_refill_at_once(rig: Rig) -> None:
    """With starts off the loop, a pool left with no warm worker and no start refills at the
    take, not at the next housekeeping tick (an instance in between started its own process)."""
    rig.until(lambda: len(rig.workers.pool) == 1 and rig.workers.pool_starting == 0, "the warm pool")
    rig.sup._housekeeping = lambda parts, now: None  # type: ignore[method-assign]  # no tick refills
    prepared = rig.spawner.prepared
    ok, payload = rig.answer(rig.send_register("first"))
    assert ok, payload
    assert rig.spawner.prepared == prepared + 1 and rig.workers.pool_starting == 1
    (refill,) = [w for w in rig.workers.workers.values() if w.tenant is None]
    rig.until(lambda: rig.workers.pool == [refill], "the refill in the pool")
