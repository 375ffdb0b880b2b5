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


def test_a_forked_worker_unpickles_its_target_without_an_import() -> None:
    """Every forked worker unpickles its target (the entry point naming worker.main:run) and its boot
    message first: the fork server's preload has imported their modules, so a worker's start
    imports nothing for them (the entry point's package was ~0.5 ms of each start). A fresh
    interpreter preloads as the fork server does."""
    import json
    import pickle
    import subprocess
    import sys

    from supervisor.runtime.workers import _WORKER_ENTRY, FORKSERVER_PRELOAD

    code = ("import importlib, json, pickle, sys\n"
            "for name in json.loads(sys.argv[1]):\n"
            "    importlib.import_module(name)\n"
            "before = set(sys.modules)\n"
            "pickle.loads(bytes.fromhex(sys.argv[2]))\n"
            "print(json.dumps(sorted(set(sys.modules) - before)))\n")
    target = pickle.dumps(_WORKER_ENTRY).hex()
    out = subprocess.run([sys.executable, "-c", code, json.dumps(FORKSERVER_PRELOAD), target], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert json.loads(out) == []
