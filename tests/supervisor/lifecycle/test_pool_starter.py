"""Pool workers start on the starter thread, not on the supervisor's loop: the loop turns while
a start waits for its process, and the hellos a worker says before the loop has its handle are
held by its routing id and read once it has (a real supervisor, real worker processes)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from shared.config import SupervisorConfig
from supervisor.runtime.workers import PreparedStart, Spawner, WorkerHandle
from supervisor.supervisor import Supervisor

pytestmark = pytest.mark.timeout(120)

#: real seconds before the test calls a step stuck (workers start in well under that)
STUCK_S = 60.0


class HeldSpawner(Spawner):
    """Starts the process, then holds the start until the test lets it go (or STUCK_S)."""

    def __init__(self, config: SupervisorConfig, endpoints: dict[str, str]) -> None:
        super().__init__(config, endpoints)
        self.started = threading.Event()
        self.release = threading.Event()
        self.handles: list[WorkerHandle] = []
        self.in_start = False  # a start is being held now

    def start(self, prepared: PreparedStart) -> WorkerHandle:
        handle = super().start(prepared)
        self.handles.append(handle)
        self.in_start = True
        self.started.set()
        self.release.wait(STUCK_S)
        self.in_start = False
        return handle


def test_a_pool_worker_starts_off_the_loop_and_its_early_hellos_are_read_once_it_is_taken_in(
        tmp_path: Path) -> None:
    made: list[HeldSpawner] = []

    def factory(config: SupervisorConfig, endpoints: dict[str, str]) -> HeldSpawner:
        made.append(HeldSpawner(config, endpoints))
        return made[0]

    config = SupervisorConfig(run_dir=str(tmp_path / "run"), backend="stub", pool_size=1, start_method="spawn")
    sup = Supervisor(config, spawner=factory)
    try:
        sup.start()
        spawner = made[0]
        deadline = time.monotonic() + STUCK_S
        turns_while_held = 0
        assert sup.parts is not None
        workers = sup.parts.workers
        # the loop keeps turning while the start is held, and holds the worker's hellos meanwhile
        while time.monotonic() < deadline:
            sup.turn(0.01)
            turns_while_held += spawner.in_start  # the turn returned while the start was held
            held = [m for ms in getattr(workers, "_early", {}).values() for m in ms]
            if len(held) >= 2:  # both hellos (data and control) came before the handle
                break
        assert not spawner.release.is_set()
        assert turns_while_held > 0, "the loop waited for the start"
        assert not workers.pool and workers.pool_starting == 1
        spawner.release.set()
        while not workers.pool and time.monotonic() < deadline:
            sup.turn(0.01)
        (worker,) = workers.pool
        assert worker.pid == spawner.handles[0].pid and worker.connected  # its held hellos were read
        assert workers.pool_starting == 0 and not workers._early
    finally:
        made and made[0].release.set()
        sup.close()


def _supervisor(tmp_path: Path, spawner_cls: type[Spawner]) -> tuple[Supervisor, list[Spawner]]:
    made: list[Spawner] = []

    def factory(config: SupervisorConfig, endpoints: dict[str, str]) -> Spawner:
        made.append(spawner_cls(config, endpoints))
        return made[0]

    config = SupervisorConfig(run_dir=str(tmp_path / "run"), backend="stub", pool_size=1, start_method="spawn")
    return Supervisor(config, spawner=factory), made


class FailingSpawner(Spawner):
    """Every start fails (the fork server gone, fds exhausted)."""

    def start(self, prepared: PreparedStart) -> WorkerHandle:
        raise OSError(24, "Too many open files")


def test_a_start_that_fails_on_the_starter_thread_counts_as_a_pool_failure(tmp_path: Path) -> None:
    sup, _ = _supervisor(tmp_path, FailingSpawner)
    try:
        sup.start()
        assert sup.parts is not None
        workers = sup.parts.workers
        deadline = time.monotonic() + STUCK_S
        while workers._pool_failures == 0 and time.monotonic() < deadline:
            sup.turn(0.01)
        assert workers._pool_failures >= 1  # the pool backs off (pool_retry_delay_s)
        assert workers.pool_starting == 0 and not workers.pool and not workers._early
        assert sup.turn(0.01)  # the loop goes on
    finally:
        sup.close()


def test_a_start_in_flight_at_teardown_is_waited_for_and_its_worker_killed(tmp_path: Path) -> None:
    sup, made = _supervisor(tmp_path, HeldSpawner)
    spawner = None
    try:
        sup.start()
        spawner = made[0]
        assert isinstance(spawner, HeldSpawner)
        deadline = time.monotonic() + STUCK_S
        while not spawner.in_start and time.monotonic() < deadline:
            sup.turn(0.01)
        assert spawner.in_start
        threading.Timer(0.2, spawner.release.set).start()  # the start finishes during the teardown
    finally:
        sup.close()
    assert spawner is not None
    (handle,) = spawner.handles
    with pytest.raises(ValueError, match="closed"):  # killed, reaped and closed by the teardown
        _ = handle.process.exitcode
