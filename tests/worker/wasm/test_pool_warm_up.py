"""A pool worker warms its WASM path before it is bound (worker.wasm.host.pool_warm_up), and the
tenant's first use adopts that host: the engine and linker made, our own module run once, nothing
of it in the tenant's cache or quota; the executor loop runs the steps only while unbound and idle."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

import shared._shm
from shared import protocol as proto
from shared.worker_link import WORKER_WARMED
from shared.errors import InvalidArgument
from worker.backends.stub import StubBackend
from worker.faults import FaultState
from worker.server import WorkerServer, wasm_warm_up
from worker.wasm import GUEST_DIR, WasmHost, guest_source
from worker.wasm import host as host_mod
from tests.helpers import timeouts
from tests.helpers.wasm_env import PROBE, tenant_env

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def no_pool_host() -> Iterator[None]:
    """Each test starts and ends with no pool host in this process (it is per process)."""
    host_mod._pool_host = None
    yield
    left = host_mod._pool_host
    host_mod._pool_host = None
    if left is not None:
        left.close()


def _warm(monkeypatch: pytest.MonkeyPatch) -> WasmHost:
    def no_segment(*args: object, **kwargs: object) -> None:
        raise AssertionError("the warm-up touched a shared-memory segment")

    monkeypatch.setattr(shared._shm, "attach", no_segment)
    monkeypatch.setattr(shared._shm, "create", no_segment)
    for _ in host_mod.pool_warm_up():
        pass
    host = host_mod._pool_host
    assert host is not None and host.warmed and not host.bound
    monkeypatch.undo()
    return host


def test_the_warm_up_runs_our_module_and_holds_nothing_of_a_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    host = _warm(monkeypatch)
    assert host.ticker.running  # the epoch thread is up before the first run
    assert host.info()["cached_modules"] == 0 and host.stats["runs"] == 0 and host.held_artifacts == 0
    with pytest.raises(InvalidArgument, match="not bound"):
        host.run(PROBE, "add", [1, 2], fuel=10**6, timeout_s=5.0)  # a pool host runs no tenant module
    # refused before the tenant's module is compiled: nothing of it compiled, kept or counted
    assert host.info()["cached_modules"] == 0 and host.stats["compiles"] == 0 and host.stats["runs"] == 0


def test_the_first_use_after_the_bind_adopts_the_warm_host(monkeypatch: pytest.MonkeyPatch) -> None:
    warm = _warm(monkeypatch)
    with tenant_env("adopt", StubBackend()) as env:
        env.ctx.extensions.pop(WasmHost.EXTENSION).close()  # as a fresh worker's context: no host yet
        host = WasmHost.for_context(env.ctx)
        assert host is warm and host.ctx is env.ctx and host_mod._pool_host is None
        reply = host.run(PROBE, "add", [2, 40], fuel=10**6, timeout_s=30.0)
        assert reply["results"] == [42] and reply["cached"] is False  # the tenant's module, compiled for it
        assert host.info()["cached_modules"] == 1
        assert WasmHost.for_context(env.ctx) is host
        with pytest.raises(InvalidArgument, match="bound"):
            host.warm_up()  # its runs are the tenant's now
        assert env.counters() == (0, 0)  # the run's linear memory was the tenant's, and is back
    # a worker serves one tenant: the pool host is adopted once, a later context makes its own
    with tenant_env("other", StubBackend()) as env2:
        env2.ctx.extensions.pop(WasmHost.EXTENSION).close()
        assert WasmHost.for_context(env2.ctx) is not warm


def test_the_loop_runs_idle_work_only_while_unbound(monkeypatch: pytest.MonkeyPatch) -> None:
    zctx = zmq.Context()
    router: zmq.Socket[Any] = zctx.socket(zmq.ROUTER)
    dealer: zmq.Socket[Any] = zctx.socket(zmq.DEALER)
    router.bind("inproc://worker-idle")
    dealer.setsockopt(zmq.IDENTITY, b"w1")
    dealer.connect("inproc://worker-idle")
    server = WorkerServer(dealer, FaultState())
    steps: list[int] = []
    second = threading.Event()

    def work() -> Iterator[None]:
        steps.append(server.requests)
        yield
        steps.append(server.requests)
        second.set()
        yield
        raise RuntimeError("a failing step ends the work, not the worker")

    server.idle_work = work()
    dealer.send(b"hello")
    assert router.recv_multipart()[0] == b"w1"
    router.send_multipart([b"w1", proto.encode_worker_request(1, "ping", {})])
    thread = threading.Thread(target=server.serve)
    thread.start()
    try:
        assert proto.decode_worker_reply(router.recv_multipart()[1])[:2] == (1, True)
        assert second.wait(30)
        # the work ended (here by its error): the worker says it is warmed, ready for a bind
        assert proto.decode_worker_reply(router.recv_multipart()[1]) == (0, True, WORKER_WARMED)
        router.send_multipart([b"w1", proto.encode_worker_request(2, "ping", {})])
        assert proto.decode_worker_reply(router.recv_multipart()[1])[:2] == (2, True)  # it still serves
    finally:
        server.stop_event.set()
        thread.join(30)
        dealer.close(0)
        router.close(0)
        zctx.term()
    assert not thread.is_alive()
    assert steps[0] == 1  # the queued request was served before the first step
    assert server.idle_work is None


def test_a_bound_worker_drops_its_idle_work() -> None:
    server = WorkerServer(None, FaultState())  # type: ignore[arg-type]  # no socket: only _idle_step is used
    ran: list[int] = []

    def work() -> Iterator[None]:
        ran.append(1)
        yield

    server.idle_work = work()
    server.context = object()  # type: ignore[assignment]  # bound: the time is the tenant's
    server._idle_step()  # no socket: a ``warmed`` notice would fail here (a bound worker sends none)
    assert ran == [] and server.idle_work is None


def test_the_workers_warm_up_imports_the_host_then_warms_it() -> None:
    steps = wasm_warm_up()
    next(steps)  # nothing before the loop's first look at the queue
    assert host_mod._pool_host is None
    for _ in steps:
        pass
    host = host_mod._pool_host
    assert host is not None and host.warmed
    assert guest_source("probe")  # the bundled guests are untouched by it


def test_a_pool_workers_warm_up_and_bind_import_no_numpy() -> None:
    """numpy's import takes tens of ms: neither a pool worker's warm-up nor the bind's backend construction
    loads it (an activation's bind took ~60 ms when the backend did); a worker's first device op loads
    it, before the device lease (tests/worker/test_device_time.py). In a fresh process."""
    code = ("import sys\nfrom worker.server import wasm_warm_up\nfrom worker.backends import create_backend\n"
            "for _ in wasm_warm_up(): pass\ncreate_backend('stub', {})\nprint('numpy' in sys.modules)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                          timeout=timeouts.scaled(120), env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False"]


_ALL_KINDS = b"""(module
  (import "env" "t" (table 2 8 funcref))
  (import "env" "m" (memory 1 4))
  (import "env" "g" (global (mut i64)))
  (import "wasi_snapshot_preview1" "fd_write" (func (param i32 i32 i32 i32) (result i32)))
  (func (export "f") (param f32 f64 externref) (result i64 i32) (i64.const 1) (i32.const 2))
  (global (export "answer") i32 (i32.const 42)))
"""


def test_an_artifacts_imports_and_exports_are_read_from_its_bytes_as_wasmtime_reads_them() -> None:
    """The artifact load's reader of the module's interface (no binding call per name) agrees with
    wasmtime on every bundled guest and on imports of every kind."""
    import wasmtime

    engine = wasmtime.Engine(host_mod._config())
    bodies = [path.read_bytes() for path in sorted(GUEST_DIR.glob("*.wat"))] + [_ALL_KINDS]
    for body in bodies:
        wasm = host_mod._binary(body)
        module = wasmtime.Module(engine, wasm)
        names: dict[int, str] = {}
        imports, exports = host_mod.module_interface(wasm, names)
        assert imports == [(i.module, i.name) for i in module.imports]
        assert exports == host_mod._export_types(module)
        assert names == host_mod.function_exports(wasm)  # a trap's frame names, read in the same pass
    with pytest.raises(ValueError):
        host_mod.module_interface(host_mod._binary(PROBE)[:200])  # cut short: the binding reads it instead


def test_the_warm_up_comes_in_small_steps_and_stops_once_the_host_is_adopted() -> None:
    """A bind that arrives mid-way waits for one step of the warm-up (assemble, compile,
    deserialize, link, a run, the other run), not all of it; a host adopted by a tenant runs
    no more of it."""
    whole = list(host_mod.pool_warm_up())
    assert len(whole) >= 7 and host_mod._pool_host is not None and host_mod._pool_host.warmed
    host_mod._pool_host.close()
    host_mod._pool_host = None
    steps = host_mod.pool_warm_up()
    for _ in range(5):  # the host made, its module assembled and compiled: no run yet
        next(steps)
    host = host_mod._pool_host
    assert host is not None and not host.warmed
    with tenant_env("mid-way", StubBackend()) as env:
        env.ctx.extensions.pop(WasmHost.EXTENSION).close()
        assert WasmHost.for_context(env.ctx) is host  # adopted at the bind's first use
        runs_before = host.ticker.ticks
        for _ in steps:  # were the loop to call it again, nothing of ours runs in the tenant's host
            pass
        assert not host.warmed and host.ticker.ticks == runs_before and host.stats["runs"] == 0


def test_the_fork_servers_preload_finds_the_engine_fingerprint_for_every_forked_worker() -> None:
    """The fork server's preload finds the engine fingerprint (the wasmtime version's lookup in
    the installed packages' metadata, ~3 ms of CPU): every forked pool worker inherits it instead
    of finding it again in its warm-up. A fresh interpreter, as the fork server is."""
    import subprocess
    import sys

    code = ("import worker.preload\n"
            "from worker.wasm.host import engine_fingerprint\n"
            "print(engine_fingerprint.cache_info().currsize)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "1"


_PRELOADED_FORK = """
import json, os, sys, threading
import worker.preload                     # as the fork server does
from worker.wasm import host as host_mod
made = host_mod._pool_host
before = {"made": made is not None, "warmed": bool(made and made.warmed),
          "threads": threading.active_count(), "tasks": len(os.listdir("/proc/self/task")),
          "numpy": "numpy" in sys.modules, "artifact": host_mod._preloaded_warm_up is not None,
          "libc": __import__("shared.prctl").prctl._libc.cache_info().currsize == 1,
          "ops": all(m in sys.modules for m in ("worker.parking", "worker.regions", "worker.wasm.artifacts")),
          "runs": getattr(host_mod, "_preloaded_runs", 0)}
r, w = os.pipe()
pid = os.fork()
if pid == 0:                              # a forked pool worker: its warm-up warms the inherited host
    import wasmtime
    compiled = []
    real_init = wasmtime.Module.__init__
    def counted(self, *args, **kwargs):
        compiled.append(1)
        real_init(self, *args, **kwargs)
    wasmtime.Module.__init__ = counted
    stores = []
    real_store = wasmtime.Store
    def store(*args, **kwargs):
        stores.append(1)
        return real_store(*args, **kwargs)
    wasmtime.Store = store
    from worker.server import wasm_warm_up
    steps = sum(1 for _ in wasm_warm_up())
    host = host_mod._pool_host
    os.write(w, json.dumps({"same": host is made, "warmed": bool(host and host.warmed), "compiled": len(compiled),
                            "steps": steps, "ticker": bool(host and host.ticker.running),
                            "runs": len(stores)}).encode())
    os._exit(0)
os.close(w)
child = json.loads(os.read(r, 4096))
_, status = os.waitpid(pid, 0)
print(json.dumps({"before": before, "child": child, "status": status}))
"""


def test_the_fork_servers_preload_makes_the_pool_host_and_a_forked_worker_warms_it() -> None:
    """The fork server's preload makes the pool host (engine, linker, host functions), compiles the
    warm-up module (serially) and runs it once (without the epoch thread), loads the C library's
    symbols and imports the lazy ops' modules, starting no thread and loading no
    numpy; a worker forked from it warms that very host (the preload's artifact deserialized, not
    compiled; the runs; its epoch thread started in the worker) instead of making its own."""
    import json

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, "-c", _PRELOADED_FORK], capture_output=True, text=True, cwd=root,
                          timeout=timeouts.scaled(120), env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["before"] == {"made": True, "warmed": False, "threads": 1, "tasks": 1, "numpy": False, "ops": True,
                             "artifact": True, "libc": True, "runs": 1}  # one warm-up run, and still no thread
    assert got["child"]["runs"] == 1  # the worker's own run: one, not two (the preload ran the other)
    assert got["status"] == 0
    assert got["child"]["same"] and got["child"]["warmed"] and got["child"]["ticker"]
    assert got["child"]["steps"] >= 5  # the module's load, its link and the runs, in the worker ...
    assert got["child"]["compiled"] == 0  # ... which compiles nothing: the preload's artifact is deserialized


def test_a_preloaded_host_is_warmed_once_and_never_after_its_adoption() -> None:
    made = host_mod.preload_pool_host()
    assert host_mod.preload_pool_host() is made and not made.warmed  # once a process
    for _ in host_mod.pool_warm_up():
        pass
    assert host_mod._pool_host is made and made.warmed
    assert list(host_mod.pool_warm_up()) == []  # warmed: a second warm-up does nothing
    host_mod._pool_host = None
    host_mod._preloaded_runs = 0  # this process is no fork server: later tests' hosts warm with both runs
    made.close()
    unwarmed = host_mod.preload_pool_host()
    with tenant_env("adopts", StubBackend()) as env:
        env.ctx.extensions.pop(WasmHost.EXTENSION).close()
        assert WasmHost.for_context(env.ctx) is unwarmed  # adopted before any warm-up
        host_mod._pool_host = unwarmed  # (as if still offered) a bound host is never warmed
        assert list(host_mod.pool_warm_up()) == [] and not unwarmed.warmed
        host_mod._pool_host = None


def test_a_fork_server_whose_pool_host_fails_still_comes_up() -> None:
    """The preload's pool host is an optimisation: if it cannot be made, the fork server's preload
    still completes (a fork server that died there would start no worker at all), says so on
    stderr, and each worker makes its own host in its warm-up."""
    import json

    code = ("import json, sys\n"
            "import worker.wasm.host as host_mod\n"
            "def broken(*args, **kwargs):\n"
            "    raise RuntimeError('no engine here')\n"
            "host_mod.WasmHost = broken\n"
            "import worker.preload\n"
            "print(json.dumps({'pool_host': host_mod._pool_host is not None}))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                          timeout=timeouts.scaled(120), env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"pool_host": False}
    assert "the pool's WASM host was not preloaded" in proc.stderr and "no engine here" in proc.stderr


_TRAP_AFTER_PRELOAD = """
import json, os
import worker.preload                     # as the fork server does: its warm-up run included
from worker.wasm import host as host_mod
import wasmtime
WAT = b'(module (memory 1 1) (func (export "oob") (result i32) (i32.load (i32.const 70000)))' \\
      b' (func (export "spin") (loop (br 0))))'
r, w = os.pipe()
pid = os.fork()
if pid == 0:                              # a forked pool worker, warmed, then a guest that traps
    from worker.server import wasm_warm_up
    for _ in wasm_warm_up():
        pass
    h = host_mod._pool_host
    module = wasmtime.Module(h.engine, wasmtime.wat2wasm(WAT))
    out = {}
    for name in ("oob", "spin"):
        store = wasmtime.Store(h.engine)
        store.set_fuel(100_000)
        store.set_epoch_deadline(1000)
        try:
            wasmtime.Instance(store, module, []).exports(store)[name](store)
            out[name] = "returned"
        except wasmtime.Trap:
            out[name] = "trap"
    os.write(w, json.dumps(out).encode())
    os._exit(0)
os.close(w)
child = json.loads(os.read(r, 4096) or b"{}")
_, status = os.waitpid(pid, 0)
print(json.dumps({"runs": host_mod._preloaded_runs, "child": child, "status": status}))
"""


def test_a_worker_forked_after_the_preloads_warm_up_run_still_traps_a_guests_faults() -> None:
    """The fork server ran the warm-up module before forking (the runtime's lazy state, its signal
    handlers and alternate signal stack among it, are inherited): a guest's out-of-bounds load (a
    SIGSEGV the runtime turns into a trap) and its fuel running out still trap in the forked
    worker, which lives on."""
    import json

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, "-c", _TRAP_AFTER_PRELOAD], capture_output=True, text=True, cwd=root,
                          timeout=timeouts.scaled(120), env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"runs": 1, "child": {"oob": "trap", "spin": "trap"}, "status": 0}


def test_the_warm_up_rehearses_the_runs_path_on_nobodys_account(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's warm-up runs our module through the tenant's own run path (WasmHost.run, its
    session, the call, the release): each rehearsal is a real run, and afterwards the host is
    unbound, its counters untouched, its cache empty, no run left open; it touched no segment
    (``_warm``). A tenant's run after the adoption gives what it gives on a fresh host."""
    sessions: list[object] = []
    real_session = WasmHost.session

    def counted(self: WasmHost, *args: Any, **kwargs: Any) -> Any:
        sessions.append(self._ctx)
        return real_session(self, *args, **kwargs)

    monkeypatch.setattr(WasmHost, "session", counted)
    host = _warm(monkeypatch)
    # two rehearsed runs, less the one a fork server's preload ran (here: an earlier test's preload)
    assert len(sessions) == 2 - host_mod._preloaded_runs >= 1 and all(ctx is host_mod._NOBODY for ctx in sessions)
    assert not host.bound and host._session is None
    assert host.stats == {k: 0 for k in host.stats} and host.info()["cached_modules"] == 0
    with tenant_env("after-rehearsal", StubBackend()) as env:
        env.ctx.extensions.pop(WasmHost.EXTENSION).close()
        assert WasmHost.for_context(env.ctx) is host
        reply = host.run(PROBE, "add", [2, 40], fuel=10**6, timeout_s=30.0)
        assert reply["results"] == [42] and host.stats["runs"] == 1 and host.stats["compiles"] == 1
        assert env.counters() == (0, 0)


def test_a_rehearsal_that_fails_leaves_the_host_unbound_and_its_counters_as_they_were() -> None:
    host = WasmHost(None)
    try:
        wasm = host_mod._binary(b'(module (func (export "other")))')
        import wasmtime

        compiled = host._admit("no-run", wasmtime.Module(host.engine, wasm), wasm, 0.0, from_artifact=True,
                               cache=False)
        before = dict(host.stats)
        with pytest.raises(InvalidArgument, match="no exported function 'run'"):
            host._rehearse(compiled)
        assert not host.bound and host._session is None and host.stats == before
        assert host.info()["cached_modules"] == 0
    finally:
        host.close()


def test_a_bound_host_is_never_rehearsed() -> None:
    with tenant_env("bound", StubBackend()) as env:
        wasm = host_mod._binary(host_mod.WARM_UP_WAT)
        import wasmtime

        compiled = env.host._admit("w", wasmtime.Module(env.host.engine, wasm), wasm, 0.0, from_artifact=True,
                                   cache=False)
        with pytest.raises(InvalidArgument, match="not warmed"):
            env.host._rehearse(compiled)
        assert env.host.ctx is env.ctx and env.host.stats["runs"] == 0


def test_the_warm_up_module_imports_every_host_function_and_passes_a_tenants_checks() -> None:
    import wasmtime

    from worker.wasm.abi import IMPORT_MODULE, IMPORTS

    host = WasmHost(None)
    try:
        wasm = host_mod._binary(host_mod.WARM_UP_WAT)
        module = wasmtime.Module(host.engine, wasm)
        imported = {(imp.module, imp.name) for imp in module.imports}
        assert {(IMPORT_MODULE, name) for name in IMPORTS} <= imported
        assert {m for m, _ in imported} == {IMPORT_MODULE, "wasi_snapshot_preview1"}
        host._check_imports(module)  # every import's type is the host's (a tenant's load checks the same)
        compiled = host._admit("w", module, wasm, 0.0, from_artifact=True, cache=False)
        host._rehearse(compiled)  # links every import, instantiates and runs: nothing held after it
        assert host.info()["cached_modules"] == 0 and host.stats["runs"] == 0 and not host.bound
    finally:
        host.close()
