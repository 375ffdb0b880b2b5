"""A started worker is not in ``multiprocessing``'s set of live children (each later start would
poll it), and is still reaped with its exit status by the supervisor's own handle."""

from __future__ import annotations

import multiprocessing.process
import signal
from pathlib import Path

import pytest

from shared.config import SupervisorConfig
from tests.helpers import timeouts
from supervisor.runtime.workers import Spawner, exit_status, kill_tree

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[3]


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
    """Every forked worker unpickles its start first (a ForkedStart naming worker.main:run, with its
    boot message): the fork server's preload has imported their modules, so a worker's start
    imports nothing for them (the entry point's package was ~0.5 ms of each start). A fresh
    interpreter preloads as the fork server does."""
    import json
    import pickle
    import subprocess
    import sys

    from supervisor.runtime.entry import ForkedStart
    from supervisor.runtime.workers import _WORKER_ENTRY, FORKSERVER_PRELOAD

    code = ("import importlib, json, pickle, sys\n"
            "for name in json.loads(sys.argv[1]):\n"
            "    importlib.import_module(name)\n"
            "before = set(sys.modules)\n"
            "import io\n"
            "f = io.BytesIO(bytes.fromhex(sys.argv[2]))\n"
            "assert pickle.load(f) == {} and pickle.load(f).spec == 'worker.main:run'\n"
            "print(json.dumps(sorted(set(sys.modules) - before)))\n")
    spawner = Spawner(SupervisorConfig(start_method="spawn"),
                      {"backend": "tcp://127.0.0.1:9", "control": "tcp://127.0.0.1:9"})
    start = ForkedStart(_WORKER_ENTRY.spec, (spawner.prepare(pool=True).boot,), list(sys.path), str(REPO))
    target = (pickle.dumps({}) + pickle.dumps(start)).hex()
    out = subprocess.run([sys.executable, "-c", code, json.dumps(FORKSERVER_PRELOAD), target], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert json.loads(out) == []


_FROZEN_PROBE = """
import gc, importlib, json, os, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
frozen = gc.get_freeze_count()
r, w = os.pipe()
pid = os.fork()
if pid == 0:                              # a forked worker: what its collections walk
    import worker.main                    # its start's imports: preloaded, nothing new to track
    os.write(w, json.dumps({"tracked": len(gc.get_objects()), "frozen": gc.get_freeze_count()}).encode())
    os._exit(0)
os.close(w)
child = json.loads(os.read(r, 4096))
os.waitpid(pid, 0)
print(json.dumps({"frozen": frozen, "child": child}))
"""


def test_the_fork_servers_preload_leaves_its_objects_out_of_a_forked_workers_collections() -> None:
    """Once the fork server's preload is done, every object it made is in the collector's permanent
    generation: a forked worker's collections walk only what the worker made (a walk over the
    preload's objects writes each one's header: a copy-on-write fault per shared page, ~2 ms of
    every pool worker's start). A fresh interpreter preloads as the fork server does."""
    import json
    import subprocess
    import sys

    from supervisor.runtime.workers import FORKSERVER_PRELOAD

    out = subprocess.run([sys.executable, "-c", _FROZEN_PROBE, json.dumps(FORKSERVER_PRELOAD)], capture_output=True,
                         text=True, timeout=timeouts.scaled(120), check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["frozen"] > 20_000  # the preload's modules, the wasmtime host, the compiled decoders
    assert got["child"]["frozen"] > got["frozen"] * 0.9  # inherited as frozen ...
    assert got["child"]["tracked"] < got["frozen"] // 20  # ... and not walked by the worker's collections


class _Exited:
    """A process whose status is there (``ready_at_once``) or appears only once it is waited for."""

    def __init__(self, code: int, ready_at_once: bool) -> None:
        self.code, self.ready, self.joins = code, ready_at_once, 0

    @property
    def exitcode(self) -> int | None:
        return self.code if self.ready else None

    def join(self, timeout: float | None = None) -> None:
        self.joins += 1
        self.ready = True

    def close(self) -> None:
        pass


def test_a_dead_workers_status_is_read_without_a_wait_when_it_is_there() -> None:
    """At a worker's death (its sentinel fired) the status is read with one look; only when it is
    not there yet (a spawned child whose fds closed a moment before it became reapable) does the
    supervisor wait for it - a forkserver child's join made two selectors a death."""
    there = _Exited(-signal.SIGKILL, ready_at_once=True)
    assert exit_status(there) == (None, signal.SIGKILL) and there.joins == 0
    later = _Exited(3, ready_at_once=False)
    assert exit_status(later) == (3, None) and later.joins == 1


_FORKSERVER_REAP = r"""
import multiprocessing, multiprocessing.connection, os, select, signal, sys
from supervisor.runtime.workers import exit_status, kill_tree

def exit_with(code):
    os._exit(code)

if __name__ == "__main__":
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard >= 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    # a busy supervisor's fds: the sentinels land past FD_SETSIZE (1024), where select() fails
    spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(min(1100, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 64))]
    ctx = multiprocessing.get_context("forkserver")
    procs = [ctx.Process(target=exit_with, args=(3,)), ctx.Process(target=signal.pause)]
    for p in procs:
        p.start()
    high = all(p.sentinel >= 1024 for p in procs)
    kill_tree(procs[1].pid, signal.SIGKILL)
    for p in procs:  # its death, as the loop sees it
        look = select.poll()
        look.register(p.sentinel, select.POLLIN)
        assert look.poll(float(sys.argv[1]) * 1000)

    def no_selector(*args, **kwargs):
        raise AssertionError("a selector was made to read a status that was there")

    multiprocessing.connection.wait = no_selector
    got = [exit_status(p) for p in procs]
    assert got == [(3, None), (None, signal.SIGKILL)], got
    assert procs[0].exitcode == 3 and procs[1].exitcode == -signal.SIGKILL
    for p in procs:
        p.close()
    print("ok" if high else "ok, low fds")
"""


def test_a_forkserver_childs_status_is_read_from_its_sentinel_without_a_selector(tmp_path: Path) -> None:
    """A forkserver child's status is in its sentinel pipe once the fork server reaped it: read
    there directly (multiprocessing's own look waits on a fresh selector first, ~90 us of CPU a
    death); exited or killed, the status is right, and the process closes as before - also past
    FD_SETSIZE. In a child interpreter: a fork server of this test process would be every later
    test's."""
    import subprocess
    import sys

    script = tmp_path / "reap.py"
    script.write_text(_FORKSERVER_REAP)
    out = subprocess.run([sys.executable, str(script), str(timeouts.scaled(60))], cwd=REPO, capture_output=True,
                         text=True, timeout=timeouts.scaled(120))
    assert out.returncode == 0 and out.stdout.strip().startswith("ok"), out.stderr


_FORKED_START = r"""
import multiprocessing, multiprocessing.connection, os, select, signal, sys
from multiprocessing import forkserver
from supervisor.runtime.entry import EntryPoint
from supervisor.runtime.workers import ForkedProcess, exit_status, fork_start, kill_tree

if __name__ == "__main__":
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["supervisor.runtime.entry"])
    forkserver.ensure_running()
    # after the fork server started: a module only this process's sys.path finds, and its cwd
    sys.path.insert(0, sys.argv[2])
    os.chdir(sys.argv[2])
    procs = [
        fork_start(EntryPoint("os:_exit"), (3,)),
        fork_start(EntryPoint("signal:pause"), ()),
        fork_start(EntryPoint("sys:exit"), (5,)),
        fork_start(EntryPoint("os:getpid"), ()),                 # returns: status 0
        fork_start(EntryPoint("importlib:import_module"), ("forked_probe",)),
    ]
    assert all(isinstance(p, ForkedProcess) and p.pid > 0 for p in procs)
    assert procs[1].exitcode is None  # alive
    kill_tree(procs[1].pid, signal.SIGKILL)
    for p in procs:  # its death, as the loop sees it
        look = select.poll()
        look.register(p.sentinel, select.POLLIN)
        assert look.poll(float(sys.argv[1]) * 1000)

    def no_selector(*args, **kwargs):
        raise AssertionError("a selector was made to read a status that was there")

    multiprocessing.connection.wait = no_selector
    got = [exit_status(p) for p in procs]
    assert got == [(3, None), (None, signal.SIGKILL), (5, None), (0, None), (9, None)], got
    assert [p.exitcode for p in procs] == [3, -signal.SIGKILL, 5, 0, 9]
    for p in procs:
        p.close()
        p.close()  # once only
    assert all(p.sentinel == -1 for p in procs)
    print("ok")
"""

_FORKED_PROBE_MODULE = """
import os, sys
os._exit(9 if os.getcwd() == os.path.dirname(os.path.abspath(__file__)) else 8)
"""


def test_a_forked_start_runs_its_target_and_reports_its_status(tmp_path: Path) -> None:
    """A worker forked from a ForkedStart (the fork server's child without multiprocessing's
    process object, preparation and bootstrap) runs its target with the starter's sys.path and
    working directory, and its status - exited, returned, SystemExit, killed - is read from its
    sentinel with one look. In a child interpreter: a fork server of this test process would be
    every later test's."""
    import subprocess
    import sys

    script = tmp_path / "forked.py"
    script.write_text(_FORKED_START)
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "forked_probe.py").write_text(_FORKED_PROBE_MODULE)
    out = subprocess.run([sys.executable, str(script), str(timeouts.scaled(60)), str(tmp_path / "mods")], cwd=REPO,
                         capture_output=True, text=True, timeout=timeouts.scaled(120))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
