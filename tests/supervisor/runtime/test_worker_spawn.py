"""A started worker is not in ``multiprocessing``'s set of live children (each later start would
poll it), and is still reaped with its exit status by the supervisor's own handle."""

from __future__ import annotations

import multiprocessing.process
import signal

import pytest

from shared.config import SupervisorConfig
from supervisor.runtime.workers import Spawner, exit_status, kill_tree

pytestmark = pytest.mark.timeout(120)


def test_a_started_worker_is_left_out_of_multiprocessings_children_and_still_reaped() -> None:
    # endpoints nobody serves: the worker never gets a bind; it is killed below
    spawner = Spawner(SupervisorConfig(start_method="spawn"),
                      {"backend": "tcp://127.0.0.1:9", "control": "tcp://127.0.0.1:9"})
    handle = spawner.spawn()
    try:
        assert handle.process not in multiprocessing.process._children  # type: ignore[attr-defined]
        assert handle.process not in multiprocessing.active_children()
        assert handle.process.exitcode is None  # alive: a process the supervisor still holds
    finally:
        kill_tree(handle.pid, signal.SIGKILL)
        assert exit_status(handle.process) == (None, signal.SIGKILL)  # reaped by its own handle
        handle.process.close()
