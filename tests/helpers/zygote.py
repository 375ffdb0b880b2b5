"""A preloaded fork server for the suite's ``python -m supervisor`` processes.

The suite starts a supervisor about a thousand times; each fresh interpreter spends most of its
start-up CPU (~0.2 s) importing the same ~200 modules. A zygote is a plain ``python -m
tests.helpers.zygote`` process, one per test process (started on the first launch), that imports
the supervisor's modules once and then forks one child per start. The child becomes exactly what
``python -m supervisor ARGS`` would be:

* it runs the module as ``-m`` does (``runpy``'s ``_run_module_as_main``: ``__main__`` is
  ``supervisor.__main__``, ``sys.argv[0]`` its file), and exits as an interpreter does (atexit,
  thread shutdown, the exit code or ``-signal``);
* stdin, stdout and stderr are the caller's (its descriptors travel with the request), its
  environment and working directory are the caller's, its process group is the caller's (the
  zygote was started in it and never leaves it), and signal dispositions are a fresh
  interpreter's (the zygote's SIGCHLD handler and wake-up fd are undone);
* it inherits no thread, no socket and no secret: the zygote is a fresh interpreter that has only
  imported modules (checked before every fork: one thread, no multiprocessing resource tracker),
  never the test process; multiprocessing's authentication key and original directory are
  renewed in the child.

A ``supervise`` child also gets its multiprocessing resource tracker, and with ``--start-method
forkserver`` its fork server, as forks of itself rather than fresh interpreters (the zygote has the
fork server's preload, ``worker.preload``, imported too): see :func:`_start_forkserver` and
:func:`_fork_resource_tracker_on_first_use`. A child that runs ``twt chaos`` or ``twt demo``
(:data:`LAUNCHERS`), which ``launch()`` supervisors of their own, first forks a zygote for itself and
starts them through it (:func:`_fork_zygote`). The zygote is its descendants' subreaper, and its
preloaded objects are frozen out of the garbage collector's walks before it forks.

The caller gets a :class:`ZygoteProcess` shaped like :class:`subprocess.Popen` (``pid``,
``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``, ``returncode``): the zygote reaps
the child and sends its exit status over a socket of that child's own.

A zygote started by :func:`script_server` also forks ``python SCRIPT ARGS`` for the scripts under
one folder (the hardware check's orchestrator, its ``--child`` steps and phase scripts, in the
suite's dry run: tests/helpers/gpu_dry_run.py), with extra modules preloaded and pipes for stdio
where the caller asks for them (``stdout=PIPE``, ``capture_output``): the child runs the script as
``python SCRIPT`` does (``runpy.run_path`` as ``__main__``, the script's folder first on
``sys.path``). A forked script that starts processes of its own (anything but a ``--child`` step)
gets a zygote of its own, as a launcher does, and ``subprocess.Popen`` in it forks through that
zygote what fits - the scripts, ``python -m supervisor`` - and starts anything else as before.

Only a start the zygote can make identical is forked: the same interpreter and the same
interpreter-level environment (every ``PYTHON*`` and ``LD_*`` variable, read before any code
runs). Any other start - and any start when the zygote cannot run - is a plain
:class:`subprocess.Popen`. ``PYTEST_TWT_ZYGOTE=0`` turns the zygote off (not ``TWT_``-prefixed: that prefix is the
product's configuration, and a supervisor warns about a ``TWT_`` variable it does not know).
"""

from __future__ import annotations

import gc
import io
import json
import locale
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Mapping, Sequence
from typing import Any

from tests.helpers.timeouts import scaled

__all__ = ["ZygoteProcess", "adopt", "enabled", "install", "popen", "run", "script_server", "server_pids", "stop",
           "with_start_method"]

#: the real class, before :func:`_fork_through_zygote` puts :class:`_ForkingPopen` in its place
_RealPopen = subprocess.Popen

#: the modules a ``supervise`` start imports (what the zygote loads once); the supervise command's
#: own module and the ``twt`` commands' are imported on first use by the command line, so each forked
#: child imported them again
PRELOAD = ("supervisor.cli", "supervisor.cli.supervise", "supervisor.supervisor", "supervisor.wiring",
           "supervisor.client.api", "supervisor.cli.commands", "supervisor.cli.ops", "supervisor.cli.status",
           "supervisor.control.ops", "zmq.utils.garbage")
#: the module each forked child runs (as ``python -m``)
MODULE = "supervisor"
_ENABLE_ENV = "PYTEST_TWT_ZYGOTE"
_MAX_REQUEST = 1 << 20
#: how long the zygote's imports may take (a hang guard: a loaded machine is slow)
_READY_TIMEOUT_S = 120.0
#: a zygote's extra modules (comma-separated; :func:`script_server`) and the folder whose scripts it forks
_PRELOAD_ENV = "PYTEST_TWT_ZYGOTE_PRELOAD"
_SCRIPTS_ENV = "PYTEST_TWT_ZYGOTE_SCRIPTS"
#: read at numpy's import (its BLAS's thread count): a forked script's must be the zygote's
_BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: in a zygote started by :func:`script_server` and in its forks: the folder whose scripts are forked
_script_root: str | None = None


def _interpreter_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables an interpreter reads before running code: a start that differs in one of
    them cannot be a fork of a zygote that was started without it. A folder named twice in
    ``PYTHONPATH`` counts once: ``site`` drops the repeats from ``sys.path`` (``launch()`` puts the
    checkout first on a path that may hold it already: ``twt chaos`` forked from a zygote)."""
    found = {k: v for k, v in env.items() if k.startswith(("PYTHON", "LD_"))}
    if "PYTHONPATH" in found:
        found["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(found["PYTHONPATH"].split(os.pathsep)))
    return found


# --------------------------------------------------------------------------- the server


def _serve(ctl: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The zygote's loop: fork a child per request, report each child's exit. Returns in a
    forked child (its request and descriptors); returns None in the zygote when the caller is gone."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    children: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([ctl.fileno(), wake_r], [], [])
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
            _reap(children)
        if ctl.fileno() not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(ctl, _MAX_REQUEST, 4)
        except ConnectionError:
            data, fds = b"", []
        if not data:  # the test process is gone (or stopped us): its supervisors live on, as Popen's do
            for sock in children.values():
                sock.close()
            ctl.close()
            return None
        request = json.loads(data)
        problem = _unfit()
        if problem or len(fds) != 4:
            for fd in fds:
                os.close(fd)
            ctl.send(json.dumps({"error": problem or f"{len(fds)} descriptors"}).encode())
            continue
        if "script" in request:
            _script_code(request["script"])  # compiled here once: every fork of this zygote has it
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for sock in children.values():
                sock.close()
            ctl.close()
            os.close(wake_r)
            os.close(wake_w)
            return request, fds
        children[pid] = socket.socket(fileno=fds[3])
        for fd in fds[:3]:
            os.close(fd)
        ctl.send(json.dumps({"pid": pid}).encode())
        _reap(children)


#: a forked script's code, compiled in the zygote on its first start: (path, mtime, size) -> code
_compiled: dict[tuple[str, int, int], types.CodeType] = {}


def _script_code(path: str) -> types.CodeType | None:
    """``path``'s code as ``python PATH`` compiles it (source, not a cached ``.pyc``), compiled once
    per zygote (and its copies: the check's orchestrator's zygote holds check_gpu.py's for its
    some twenty ``--child`` steps, ~14 ms of CPU each); None when it cannot be read."""
    try:
        st = os.stat(path)
        key = (path, st.st_mtime_ns, st.st_size)
        if key not in _compiled:
            with open(path, "rb") as f:
                _compiled[key] = compile(f.read(), path, "exec")
        return _compiled[key]
    except (OSError, SyntaxError, ValueError):
        return None  # the child compiles it and reports as python SCRIPT would


def _unfit() -> str:
    """Why the zygote may not fork now ("" when it may): it must hold nothing but imports."""
    if threading.active_count() != 1:
        return f"{threading.active_count()} threads"
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    if tracker is not None and getattr(getattr(tracker, "_resource_tracker", None), "_fd", None) is not None:
        return "a resource tracker"
    return ""


def _reap(children: dict[int, socket.socket]) -> None:
    """Reap every child that has exited: a forked start (its status to its caller) or an orphan
    handed to us as the subreaper (a supervisor's fork server, tracker or worker that outlived it)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock = children.pop(pid, None)
        if sock is not None:
            try:
                sock.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
            except OSError:
                pass  # the caller dropped its handle
            sock.close()


#: the commands that launch() supervisors of their own: a child forked to run one gets a zygote of
#: its own (:func:`_fork_zygote`)
LAUNCHERS = frozenset({"chaos", "demo"})


def take_stdio(fds: list[int]) -> None:
    """In a forked child: the request's three stdio descriptors become 0, 1 and 2; the fourth (the
    socket through which the server reports the child's exit to the caller) is the server's, not the
    child's, and is closed."""
    os.close(fds[3])
    for target, fd in enumerate(fds[:3]):
        if fd != target:
            os.dup2(fd, target)
    for fd in fds[:3]:
        if fd > 2:
            os.close(fd)


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """In a forked child: take the caller's descriptors, environment and directory, then run
    the module as ``python -m`` does (an exception or SystemExit ends the interpreter as usual)."""
    script = request.get("script")
    if script is None:
        launches = bool(request["args"][:1]) and request["args"][0] in LAUNCHERS
    else:
        launches = request["args"][:1] != ["--child"]  # a check step starts no process; a phase script may
    zygote = _fork_zygote(fds) if launches else None
    take_stdio(fds)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    cwd = os.getcwd()
    if sys.path and sys.path[0] == request["zygote_cwd"]:
        # -m puts the working directory first, python SCRIPT the script's folder
        sys.path[0] = cwd if script is None else os.path.dirname(script)
    import multiprocessing.process

    multiprocessing.process.ORIGINAL_DIR = cwd  # type: ignore[attr-defined]  # spawn hands it to workers
    multiprocessing.current_process().authkey = os.urandom(32)
    if _wants_forkserver(request["args"]):
        _start_forkserver()
    if script is None and request["args"][:1] == ["supervise"]:
        _fork_resource_tracker_on_first_use()  # after the fork server: its workers keep multiprocessing's own
    elif script is not None and launches:  # a phase script: its tenants' segments and fork server
        _fork_resource_tracker_on_first_use()
        _fork_forkserver_on_first_use()
    if zygote is not None:
        _launch_through(*zygote, cwd=request["zygote_cwd"])
    import runpy

    if script is not None:
        sys.argv = [script, *request["args"]]
        code = _script_code(script)
        if code is None:
            runpy.run_path(script, run_name="__main__")  # what python SCRIPT runs (its errors too)
        else:  # run_path's own way with the code compiled in the zygote
            runpy._run_module_code(code, None, "__main__", pkg_name="", script_name=script)  # type: ignore[attr-defined]
        return
    sys.argv = ["-m", *request["args"]]
    runpy._run_module_as_main(MODULE, alter_argv=True)  # type: ignore[attr-defined]  # what -m runs


def _fork_zygote(fds: list[int]) -> tuple[socket.socket, int, dict[str, str], dict[str, str | None]]:
    """In a child forked to run a command that launches its own supervisors (``twt chaos``, ``twt
    demo``: :data:`LAUNCHERS`), before it takes anything of its request: fork a zygote for it - a
    copy of this process as the zygote made it (one thread, the preload, nothing of a caller's) that
    serves that command's starts as the suite's zygote serves a test's. So the campaign's and the
    demo's supervisors (and their fork servers, trackers and workers) are forks too, not fresh
    interpreters (~0.2 s of CPU each, and a fresh fork server's preload or a spawned interpreter per
    worker).

    Returns (the control socket, the new zygote's pid, this interpreter's own environment, which
    that zygote's starts must match, and its BLAS thread variables, which its forked scripts' must). The new zygote is a child of the command; it ends when the
    command closes the socket (when it exits), and the suite's zygote reaps it (the subreaper)."""
    interpreter = _interpreter_env(os.environ)  # this interpreter's: the request's comes later
    blas = {k: os.environ.get(k) for k in _BLAS_ENV}
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid:
        theirs.close()
        return ours, pid, interpreter, blas
    ours.close()
    for fd in fds:
        os.close(fd)
    forked = _serve(theirs)
    if forked is None:  # the command is gone
        os._exit(0)
    _become(*forked)  # a start of the command's: this process is now what it asked for
    raise SystemExit(0)  # the module ran to its end without exiting: as the interpreter would


def _launch_through(ctl: socket.socket, pid: int, interpreter: dict[str, str], blas: dict[str, str | None],
                    cwd: str) -> None:
    """In the command that :func:`_fork_zygote` forked a zygote for: ``launch()`` starts its
    supervisors through it (this module's client, imported here as the tests import it); in a zygote
    that forks scripts, every ``subprocess.Popen`` of the process tries it first."""
    import supervisor.client.launch

    from tests.helpers import zygote as client

    client._script_root = _script_root
    client.adopt(ctl, pid, interpreter, cwd, blas=blas)
    client.install(supervisor.client.launch)
    if client._script_root is not None:
        client._fork_through_zygote()


def _wants_forkserver(args: Sequence[str]) -> bool:
    """Whether ``args`` start a supervisor whose workers come from a fork server."""
    args = list(args)
    if not args or args[0] != "supervise":
        return False
    return "--start-method=forkserver" in args or any(
        a == "--start-method" and b == "forkserver" for a, b in zip(args, args[1:]))


def _open_fds() -> list[int]:
    try:
        return [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, os.sysconf("SC_OPEN_MAX")))


#: a fresh interpreter's warning filters and options (the zygote's, read before its preload): what
#: a resource tracker started as ``python -W ... -c ...`` would begin with
_FRESH_WARNINGS: tuple[list[Any], list[str]] = ([], [])


def _fork_resource_tracker_on_first_use() -> None:
    """In a forked child about to become ``supervise``: its multiprocessing resource tracker, when
    first wanted, is a fork of this process rather than a fresh interpreter (~0.03 s of CPU per
    supervisor; every supervisor starts one).

    ``ResourceTracker.ensure_running`` is wrapped: while the process has one thread (the
    supervisor asks for its tracker early in its start), it forks the tracker first -
    ``resource_tracker.main`` on a pipe, stdio and that pipe its only descriptors, SIGINT and
    SIGTERM blocked across the fork as multiprocessing does, and the warning filters a fresh
    interpreter would have (its start's, then every ``-W`` option added since, such as the
    supervisor's own filter for the tracker's "leaked" warning) - and then runs the original,
    which finds it alive. With more than one thread it spawns one as usual.
    """
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker  # type: ignore[attr-defined]
    original = type(tracker).ensure_running

    def ensure_running() -> None:
        with tracker._lock:
            if tracker._fd is None and _one_thread():
                tracker._fd, tracker._pid = _fork_resource_tracker(resource_tracker)
        original(tracker)

    tracker.ensure_running = ensure_running
    resource_tracker.ensure_running = ensure_running  # type: ignore[attr-defined]  # the module's alias


def _one_thread() -> bool:
    """Whether this process has one thread: Python's and the C libraries' (zmq's I/O threads) alike."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def _fork_resource_tracker(resource_tracker: types.ModuleType) -> tuple[int, int]:
    """(write end, pid) of a resource tracker forked from this single-threaded process."""
    import warnings

    r, w = os.pipe()
    ignored = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, ignored)
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                for fd in _open_fds():
                    if fd > 2 and fd != r:
                        try:
                            os.close(fd)
                        except OSError:
                            pass
                filters, options = _FRESH_WARNINGS
                warnings.filters[:] = filters
                warnings._filters_mutated()  # type: ignore[attr-defined]
                warnings._processoptions(sys.warnoptions[len(options):])  # type: ignore[attr-defined]
                resource_tracker.main(r)  # sets SIGINT and SIGTERM to ignored, then unblocks them
                code = 0
            except BaseException:  # noqa: BLE001 - reported as a fresh interpreter would, then gone
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
    except BaseException:
        os.close(w)
        raise
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, ignored)
        os.close(r)
    return w, pid


def _start_forkserver(preload: Sequence[str] | None = None) -> None:
    """In a forked child about to become ``supervise --start-method forkserver``: start its fork
    server as a fork of this process rather than as a fresh interpreter.

    This is ``multiprocessing.forkserver.ForkServer.ensure_running`` less its ``exec``: the same
    listener (a 0600 unix socket in multiprocessing's temp dir), the same "alive" pipe, the same
    ``forkserver.main`` loop with the supervisor's preload list, a child of the supervisor (which
    finds it running and uses it, as it would one it had started itself). The zygote has imported
    that preload already (:func:`_main`), and this process holds nothing but imports yet (one
    thread: checked before the fork that made it), so the fork is what a fresh fork server would be
    after its preload: ~0.2 s of CPU less per supervisor, and each worker it forks starts warm. What
    differs: the fork server's memory also holds the supervisor's modules (its workers' too; a
    worker's own imports are checked in a fresh interpreter by tests/worker/test_start_imports.py),
    and its ``/proc/PID/cmdline`` is the zygote's.
    """
    from multiprocessing import connection, forkserver

    from supervisor.runtime.workers import FORKSERVER_PRELOAD

    modules = list(FORKSERVER_PRELOAD if preload is None else preload)
    server = forkserver._forkserver  # type: ignore[attr-defined]
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the fork server: only stdio, its listener and the pipe, as spawnv_passfds leaves it
            code = 1
            try:
                keep = {0, 1, 2, listener.fileno(), alive_r}
                for fd in _open_fds():
                    if fd not in keep:
                        try:
                            os.close(fd)
                        except OSError:
                            pass
                forkserver.main(listener.fileno(), alive_r, modules)
                code = 0
            except SystemExit as exc:  # main's end: every holder of the alive pipe is gone
                code = exc.code if isinstance(exc.code, int) else 0
            except BaseException:  # noqa: BLE001 - reported as a fresh interpreter would, then gone
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    server._preload_modules = modules


def _fork_forkserver_on_first_use() -> None:
    """In a forked script that starts processes (a phase script of the hardware check): its
    multiprocessing fork server (its tenants'), when first wanted while the script has one thread,
    is a fork of the script (:func:`_start_forkserver` with the preload the script set) rather than
    a fresh interpreter that imports that preload (~0.3 s of CPU a phase). Its tenants then find
    the script's ``__main__`` loaded, where a fresh fork server's re-import it. With more than one
    thread it starts one as usual."""
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver  # type: ignore[attr-defined]
    original = type(server).ensure_running

    def ensure_running() -> None:
        if server._forkserver_pid is None and _one_thread():
            resource_tracker.ensure_running()  # first, as the original does (forked on first use too)
            _start_forkserver(server._preload_modules)
        original(server)

    server.ensure_running = ensure_running
    forkserver.ensure_running = ensure_running  # type: ignore[attr-defined]  # the module's alias


def _become_subreaper() -> None:
    """Make the zygote its descendants' reaper (Linux's ``PR_SET_CHILD_SUBREAPER``; not inherited
    by its children): what a forked supervisor leaves running when it exits - its fork server and
    resource tracker end after it, a worker may outlive a killed one - is handed to the zygote, which
    reaps it, rather than to init. So their CPU lands in the zygote's children's time, which the
    suite's CPU log reads (tests/helpers/cpu_profile.py): a fork server's workers are its children,
    not the supervisor's, and without this a run's log left them out."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass  # not Linux: orphans go to init, as a plain Popen's do


def _warm() -> None:
    """What every forked supervisor and ``twt`` command otherwise made for itself after the fork, made
    once here: the modules its command line imports on first use (the supervise command, each ``twt``
    command's module, the admin op classes behind the frontend's dispatch table) and the wire codec of
    every record (``shared.wire`` writes a decoder per record class on its first use and keeps it:
    ~10 of them in each supervisor's start). Pure caches, filled as the first use would fill them:
    a forked child only finds them made."""
    import importlib
    import pkgutil

    import shared.wire
    import supervisor.cli.commands
    import supervisor.control.ops

    for info in pkgutil.iter_modules(supervisor.cli.commands.__path__):
        importlib.import_module(f"{supervisor.cli.commands.__name__}.{info.name}")
    supervisor.control.ops.op_table()  # imports every op module; cached for the process
    todo = list(shared.wire.Record.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        try:
            shared.wire._plan(cls)  # the decoder and encoders a first decode or encode would write
        except Exception:  # noqa: BLE001 - a record the codec cannot plan fails where it is used, as before
            continue


def _main() -> None:
    import warnings

    _FRESH_WARNINGS[0][:] = warnings.filters
    _FRESH_WARNINGS[1][:] = sys.warnoptions
    ctl = socket.socket(fileno=int(sys.argv[1]))
    _become_subreaper()
    # what a supervisor's fork server preloads (worker.preload: zmq, wasmtime, the worker's
    # modules; no thread), first, then the supervisor's own modules
    from supervisor.runtime.workers import FORKSERVER_PRELOAD

    import multiprocessing.forkserver  # noqa: F401  (its main loop runs in a forked child)

    extra = [m for m in os.environ.get(_PRELOAD_ENV, "").split(",") if m]
    for name in (*FORKSERVER_PRELOAD, *PRELOAD, *extra):
        __import__(name)
    _warm()
    problem = _unfit() or ("" if not extra or _one_thread() else "a native thread (a BLAS pool?)")
    if problem:
        sys.exit(f"zygote: preloading left {problem}")
    global _script_root
    _script_root = os.environ.get(_SCRIPTS_ENV) or None
    # The preloaded objects into the collector's permanent generation (what CPython's gc docs
    # advise before fork without exec): a forked supervisor, fork server or worker's collections
    # never walk them, which would cost CPU and copy the pages they touch (the objects' headers).
    gc.collect()
    gc.freeze()
    ctl.send(json.dumps({"ready": os.getpid(), "cwd": os.getcwd()}).encode())
    forked = _serve(ctl)
    if forked is not None:
        _become(*forked)


# --------------------------------------------------------------------------- the client


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


class ZygoteProcess(subprocess.Popen):  # type: ignore[type-arg]
    """A forked ``python -m supervisor`` (or script), as :class:`subprocess.Popen` shows a child.

    Not a child of this process (the zygote's): its exit status comes from the zygote, over
    ``status`` (a socket of its own, readable once the child is reaped). ``pipes``: this end of
    each stdio pipe the caller asked for (``stdin``, ``stdout``, ``stderr``; None where it did not),
    made into file objects as Popen makes them (``text``, ``encoding``, ``errors``, ``bufsize``), so
    that Popen's own ``communicate`` reads and writes them."""

    def __init__(self, pid: int, args: Sequence[str], status: socket.socket,
                 pipes: tuple[int | None, int | None, int | None] = (None, None, None), *, text: bool = False,
                 encoding: str | None = None, errors: str | None = None, bufsize: int = -1) -> None:
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = self.stdout = self.stderr = None
        self._child_created = False  # Popen.__del__: nothing of ours to reap
        self._status = status
        self._orphan = False
        self._lock = threading.Lock()
        # what Popen.__init__ sets and its communicate() reads
        self._waitpid_lock = threading.Lock()
        self._input = None
        self._communication_started = False
        self._sigint_wait_secs = 0.25
        self._closed_child_pipe_fds = True
        self.pipesize = -1
        self.text_mode = bool(encoding or errors or text)
        self.encoding = (encoding or locale.getpreferredencoding(False)) if self.text_mode else encoding
        self.errors = errors
        line_buffering = self.text_mode and bufsize == 1
        if line_buffering:
            bufsize = -1
        stdin, stdout, stderr = pipes
        if stdin is not None:
            self.stdin = open(stdin, "wb", bufsize)
            if self.text_mode:
                self.stdin = io.TextIOWrapper(self.stdin, write_through=True, line_buffering=line_buffering,
                                              encoding=self.encoding, errors=errors)
        for name, fd in (("stdout", stdout), ("stderr", stderr)):
            if fd is not None:
                stream: Any = open(fd, "rb", bufsize)
                if self.text_mode:
                    stream = io.TextIOWrapper(stream, encoding=self.encoding, errors=errors)
                setattr(self, name, stream)

    def _read_status(self, timeout: float | None) -> int | None:
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            if self._orphan:
                return self._orphan_status(timeout)
            ready, _, _ = select.select([self._status], [], [], timeout)
            if not ready:
                return None
            data = self._status.recv(4096)
            self._status.close()
            if data:
                self.returncode = int(json.loads(data)["returncode"])
                return self.returncode
            # the zygote died before the child: its status is lost, only whether it runs is known
            self._orphan = True
            return self._orphan_status(timeout)

    def _orphan_status(self, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while _alive(self.pid):
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.02)
        self.returncode = -signal.SIGKILL  # gone, with a status nobody kept: reported as killed
        return self.returncode

    def poll(self) -> int | None:
        return self._read_status(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._read_status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a pid that may have been reused
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        if self.stdin is None and self.stdout is None and self.stderr is None:
            self.wait(timeout)
            return None, None
        return super().communicate(input, timeout)

    def __exit__(self, *exc: object) -> None:
        try:
            for stream in (self.stdout, self.stderr, self.stdin):
                if stream is not None:
                    stream.close()
        finally:
            self.wait()

    def __del__(self) -> None:
        status = getattr(self, "_status", None)
        if status is not None:
            status.close()


class _Zygote:
    def __init__(self, env: Mapping[str, str], *, new_session: bool = False) -> None:
        self.ctl, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = dict(env)
        self.blas = {k: self.env.get(k) for k in _BLAS_ENV}
        # the zygote's own stdio: nothing of the test's (each child gets the caller's per start)
        with open(os.devnull, "rb") as null_in, open(os.devnull, "wb") as null_out:
            self.proc = _RealPopen([sys.executable, "-m", "tests.helpers.zygote", str(theirs.fileno())],
                                   env=self.env, pass_fds=(theirs.fileno(),), stdin=null_in, stdout=null_out,
                                   stderr=None, close_fds=True, start_new_session=new_session)
        theirs.close()
        self.ctl.settimeout(_READY_TIMEOUT_S)
        try:
            hello = self.ctl.recv(4096)
        except TimeoutError:
            self.proc.kill()
            hello = b""
        self.ctl.settimeout(None)
        if not hello:
            self.proc.wait()
            raise OSError(f"the zygote exited with {self.proc.returncode} before it was ready")
        info = json.loads(hello)
        self.pid = int(info["ready"])
        self.cwd = str(info["cwd"])
        self.lock = threading.Lock()

    def start(self, args: Sequence[str], env: Mapping[str, str], stdio: tuple[int, int, int],
              cwd: str, *, script: str | None = None, pipes: tuple[int | None, int | None, int | None] = (None, None, None),
              text: dict[str, Any] | None = None) -> ZygoteProcess | None:
        """A forked ``python -m supervisor ARGS`` (``python SCRIPT ARGS`` with ``script``); None when the
        zygote may not fork now. ``pipes`` and ``text``: what :class:`ZygoteProcess` makes of the
        caller's ends of the pipes given as ``stdio``."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        request = {"args": list(args), "env": dict(env), "cwd": cwd, "zygote_cwd": self.cwd,
                   **({"script": script} if script is not None else {})}
        try:
            with self.lock:
                socket.send_fds(self.ctl, [json.dumps(request).encode()], [*stdio, theirs.fileno()])
                reply = self.ctl.recv(4096)
        finally:
            theirs.close()
        if not reply:
            ours.close()
            raise OSError("the zygote is gone")
        answer = json.loads(reply)
        if "pid" not in answer:
            ours.close()
            return None
        cmd = [sys.executable, "-m", MODULE, *args] if script is None else [sys.executable, script, *args]
        return ZygoteProcess(int(answer["pid"]), cmd, ours, pipes, **(text or {}))

    @classmethod
    def forked(cls, ctl: socket.socket, pid: int, env: Mapping[str, str], cwd: str,
               blas: Mapping[str, str | None] | None = None) -> _Zygote:
        """A zygote that is already running: a child of this process, forked by :func:`_fork_zygote`."""
        self = cls.__new__(cls)
        self.ctl, self.env, self.pid, self.cwd = ctl, dict(env), pid, cwd
        self.blas = dict(blas or {})
        self.proc = _Child(pid)  # type: ignore[assignment]
        self.lock = threading.Lock()
        return self

    def close(self) -> None:
        self.ctl.close()  # the zygote sees EOF and exits; its children live on
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Child:
    """What :attr:`_Zygote.proc` is for a forked zygote: a child of this process, but no Popen's."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere
                self.returncode = 0
                return 0
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


#: the zygotes, by the interpreter-level environment they were started with (a few at most: the
#: launcher's, a test's own PYTHONPATH...)
_zygotes: dict[frozenset[tuple[str, str]], _Zygote] = {}
_MAX_ZYGOTES = 4
_broken = False
#: set in a command forked with a zygote of its own (:func:`adopt`): that one serves its starts
#: that match it, and no other zygote is started (a start that does not match is a plain Popen)
_adopted = False
_start_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get(_ENABLE_ENV, "1") != "0" and not _broken


def server_pids() -> set[int]:
    """The running zygotes' pids: helper processes of the suite, not a test's."""
    return {z.pid for z in list(_zygotes.values()) if z.proc.poll() is None}


#: how a forked ``supervise`` starts its workers when neither its command, its environment nor its
#: config file names a method: see :func:`with_start_method`
FORKED_START_METHOD = "forkserver"


def with_start_method(args: Sequence[str], env: Mapping[str, str], cwd: str) -> list[str]:
    """``args`` of a forked start, with ``--start-method forkserver`` added to a ``supervise`` that
    names no start method: not in ``args``, not as ``TWT_START_METHOD`` in ``env``, not in the
    ``--config`` file (read as the supervisor reads it; a file it cannot read is left to the
    supervisor to refuse).

    Its fork server is then a fork of the zygote's child (:func:`_start_forkserver`), which has the
    workers' preload imported, so each worker it starts is a fork of a warm process (~0.04 s of CPU
    on the reference machine's successor, against ~0.2 s for a fresh ``spawn`` interpreter that
    imports the worker's modules). The suite's supervisors started through ``launch()`` or ``twt
    supervise`` without a method spawned some 190 workers a run (~38 s of CPU). ``spawn`` stays
    covered by every start that names it (the start-method tests, the logs' ``event.spawn``, the
    status table's), by the supervisors that are not forked (the hardware check's plain runs, the Ray
    nodes', the cold starts read through a pipe) and by the whole suite under ``PYTEST_TWT_ZYGOTE=0``.
    """
    args = list(args)
    if args[:1] != ["supervise"] or env.get("TWT_START_METHOD"):
        return args
    config = None
    for i, arg in enumerate(args):
        if arg == "--start-method" or arg.startswith("--start-method="):
            return args
        if arg == "--config" and i + 1 < len(args):
            config = args[i + 1]
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
    if config is not None:
        from shared.config import read_config_file

        try:
            if "start_method" in read_config_file(os.path.join(cwd, config)):
                return args
        except (OSError, ValueError):
            return args
    return [*args, "--start-method", FORKED_START_METHOD]


def adopt(ctl: socket.socket, pid: int, interpreter: Mapping[str, str], cwd: str, *,
          blas: Mapping[str, str | None] | None = None) -> None:
    """Serve this process's starts through the zygote :func:`_fork_zygote` forked for it (and only
    through it): see :func:`_launch_through`."""
    global _adopted
    _adopted = True
    _zygotes[frozenset(interpreter.items())] = _Zygote.forked(ctl, pid, interpreter, cwd, blas)


def _zygote_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment a shared zygote starts with: this process's own, with the interpreter-level
    variables and BLAS thread counts of the start that asked for it (what its key and preload
    need) - never the rest of that start's variables. Each fork gets its caller's environment in
    ``os.environ``, but its ``/proc/PID/environ`` is the zygote's start block: a variable one test
    passed (``NOTIFY_SOCKET``, say) would show there in every later test's forks."""
    own = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "LD_")) and k not in _BLAS_ENV}
    return {**own, **{k: v for k, v in env.items() if k.startswith(("PYTHON", "LD_")) or k in _BLAS_ENV}}


def _zygote_for(env: Mapping[str, str]) -> _Zygote | None:
    key = frozenset(_interpreter_env(env).items())
    with _start_lock:
        found = _zygotes.get(key)
        if found is not None and found.proc.poll() is None:
            _zygotes[key] = _zygotes.pop(key)  # the most recently used last
            return found
        if _adopted:
            return None
        if found is not None:
            del _zygotes[key]
            found.close()  # died (killed by a test?): a new one in its place
        while len(_zygotes) >= _MAX_ZYGOTES:
            # the least recently used gives way (its children live on): which tests share a worker
            # is xdist's choice, so a cap that refused would make a test's start plain or forked by chance
            _zygotes.pop(next(iter(_zygotes))).close()
        _zygotes[key] = _Zygote(_zygote_env(env))
        return _zygotes[key]


def _stdio_fd(stream: Any, default: int) -> tuple[int, bool]:
    """(descriptor, opened here) for a Popen-style stdio argument we can pass on; raises
    ValueError for PIPE and other forms a forked child cannot share."""
    if stream is None:
        return default, False
    if stream == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR), True
    if isinstance(stream, int) and stream >= 0:
        return stream, False
    if hasattr(stream, "fileno"):
        return stream.fileno(), False
    raise ValueError(f"cannot pass {stream!r} to a forked child")


#: what a forked script's start may pass (anything else is Popen's to do)
_SCRIPT_KWARGS = frozenset({"env", "cwd", "stdin", "stdout", "stderr", "text", "universal_newlines", "encoding",
                            "errors", "bufsize"})


def _script(cmd: Sequence[str], root: str | None) -> str | None:
    """The script of ``cmd`` when it is ``python SCRIPT ...`` for a script under ``root``, else None."""
    if root is None or isinstance(cmd, (str, bytes)) or len(cmd) < 2 or cmd[0] != sys.executable:
        return None
    path = os.path.abspath(os.fspath(cmd[1]))
    if not (path.startswith(root.rstrip(os.sep) + os.sep) and path.endswith(".py") and os.path.isfile(path)):
        return None
    return path


def _start(zygote: _Zygote, cmd: Sequence[str], env: dict[str, str], kwargs: Mapping[str, Any],
           script: str | None) -> ZygoteProcess | None:
    """``cmd`` forked from ``zygote`` (None when it may not fork now); raises ValueError for a stdio
    argument a forked child cannot share. A script's start may ask for pipes."""
    opened: list[int] = []
    pipes: list[int | None] = [None, None, None]
    try:
        stdio = []
        for i, (name, default) in enumerate((("stdin", 0), ("stdout", 1), ("stderr", 2))):
            stream = kwargs.get(name)
            if script is not None and stream == subprocess.PIPE:
                r, w = os.pipe()
                pipes[i], theirs = (w, r) if i == 0 else (r, w)
                stdio.append(theirs)
                opened.append(theirs)
                continue
            fd, mine = _stdio_fd(stream, default)
            stdio.append(fd)
            if mine:
                opened.append(fd)
        # the same audit event a Popen raises: the suite's hygiene hook records the run dir and the start
        sys.audit("subprocess.Popen", cmd[0], list(cmd), None, env)
        cwd = os.path.abspath(os.fspath(kwargs.get("cwd") or os.getcwd()))
        if script is None:
            child = zygote.start(with_start_method(cmd[3:], env, cwd), env, (stdio[0], stdio[1], stdio[2]), cwd)
        else:
            text = {"text": bool(kwargs.get("text") or kwargs.get("universal_newlines")),
                    "encoding": kwargs.get("encoding"), "errors": kwargs.get("errors"),
                    "bufsize": kwargs.get("bufsize", -1)}
            child = zygote.start([os.fspath(a) for a in cmd[2:]], env, (stdio[0], stdio[1], stdio[2]), cwd,
                                 script=script, pipes=(pipes[0], pipes[1], pipes[2]), text=text)
    except BaseException:
        child = None
        raise
    finally:
        for fd in opened:
            os.close(fd)
        if child is None:
            for end in pipes:
                if end is not None:
                    os.close(end)
    return child


def popen(cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:  # type: ignore[type-arg]
    """``subprocess.Popen(cmd, **kwargs)``, forked from a zygote when ``cmd`` is ``python -m
    supervisor ...`` with arguments a zygote reproduces exactly (env, cwd, stdin/stdout/stderr as a
    descriptor, DEVNULL or inherited; nothing else), or - in a script forked by a :func:`script_server`
    zygote - ``python SCRIPT ...`` for a script it forks (pipes and text mode too, with its BLAS
    thread variables); a plain Popen otherwise."""
    global _broken
    env = kwargs.get("env")
    env = dict(os.environ if env is None else env)
    script = _script(cmd, _script_root) if _adopted else None
    if script is not None:
        fits = enabled() and set(kwargs) <= _SCRIPT_KWARGS
    else:
        fits = (enabled() and not isinstance(cmd, (str, bytes)) and len(cmd) >= 3
                and list(cmd[:3]) == [sys.executable, "-m", MODULE]
                and set(kwargs) <= {"env", "cwd", "stdin", "stdout", "stderr"})
    if not fits:
        return _RealPopen(cmd, **kwargs)
    try:
        zygote = _zygote_for(env)
        if zygote is not None and script is not None and zygote.blas != {k: env.get(k) for k in _BLAS_ENV}:
            zygote = None
        child = _start(zygote, cmd, env, kwargs, script) if zygote is not None else None
    except ValueError:
        return _RealPopen(cmd, **kwargs)
    except OSError:
        _broken = True  # no zygote on this host: every start is a plain one from now on
        return _RealPopen(cmd, **kwargs)
    return child if child is not None else _RealPopen(cmd, **kwargs)


class _ForkingPopen(_RealPopen):  # type: ignore[type-arg]
    """``subprocess.Popen`` in a forked script that starts processes (:func:`_fork_through_zygote`):
    :func:`popen` - a fork where it fits, the real class's object otherwise (so ``__init__`` here
    never runs)."""

    def __new__(cls, args: Any, *rest: Any, **kwargs: Any) -> Any:
        if rest:
            return _RealPopen(args, *rest, **kwargs)
        return popen(args, **kwargs)


def _fork_through_zygote() -> None:
    """Every ``subprocess.Popen`` (and so ``subprocess.run``) of this process through :func:`popen`:
    in a script forked by a :func:`script_server` zygote, whose ``__main__`` code and modules call
    ``subprocess`` themselves."""
    subprocess.Popen = _ForkingPopen  # type: ignore[misc]


def script_server(env: Mapping[str, str], *, scripts: str, preload: Sequence[str] = ()) -> _Zygote:
    """A zygote of one caller's own (not one of the suite's), started with ``env`` in a session of its
    own (its process group is the whole tree it forks: one ``killpg`` stops it), that also imports
    ``preload`` (it must start no native thread: set the BLAS thread variables to 1 for numpy) and
    forks ``python SCRIPT`` for the scripts under ``scripts``: see :func:`start_script`. Close it
    (``.close()``) when done; :class:`OSError` when it cannot start."""
    return _Zygote({**env, _PRELOAD_ENV: ",".join(preload), _SCRIPTS_ENV: os.path.abspath(scripts)},
                   new_session=True)


def start_script(zygote: _Zygote, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:  # type: ignore[type-arg]
    """``subprocess.Popen(cmd, **kwargs)`` for ``cmd`` = ``python SCRIPT ...``, forked from a
    :func:`script_server` zygote (SCRIPT under its folder; the same interpreter variables); a plain
    Popen where it cannot be."""
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    script = _script(cmd, zygote.env.get(_SCRIPTS_ENV))
    if (script is None or not set(kwargs) <= _SCRIPT_KWARGS or _interpreter_env(env) != _interpreter_env(zygote.env)
            or zygote.blas != {k: env.get(k) for k in _BLAS_ENV}):
        return _RealPopen(cmd, **kwargs)
    try:
        child = _start(zygote, cmd, env, kwargs, script)
    except ValueError:
        return _RealPopen(cmd, **kwargs)
    return child if child is not None else _RealPopen(cmd, **kwargs)


def run(cmd: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
        cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd,
    check=False)``, the child forked by :func:`popen` where it can be: output read through pipes
    until both close (as ``communicate`` does), the child killed and reaped at the timeout.

    ``timeout`` is a hang guard, scaled like every timeout of the suite
    (:func:`~tests.helpers.timeouts.scaled`): a command that takes 30 s on a quiet machine takes 90 on
    one three times slower, and is not hung."""
    timeout = scaled(timeout)
    kwargs: dict[str, Any] = {"env": env, "cwd": cwd} if cwd is not None else {"env": env}
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        proc = popen(cmd, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, **kwargs)
    finally:
        os.close(out_w)
        os.close(err_w)
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    deadline = time.monotonic() + timeout
    try:
        open_fds = [out_r, err_r]
        while open_fds:
            left = deadline - time.monotonic()
            ready, _, _ = select.select(open_fds, [], [], max(left, 0))
            if not ready:
                proc.kill()
                proc.wait()
                raise subprocess.TimeoutExpired(list(cmd), timeout)
            for fd in ready:
                data = os.read(fd, 65536)
                if data:
                    chunks[fd].append(data)
                else:
                    open_fds.remove(fd)
        code = proc.wait(max(deadline - time.monotonic(), 0.001))
    except subprocess.TimeoutExpired:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
    finally:
        os.close(out_r)
        os.close(err_r)

    def text(fd: int) -> str:  # as text=True decodes: the locale's encoding, universal newlines
        raw = b"".join(chunks[fd]).decode(locale.getpreferredencoding(False))
        return raw.replace("\r\n", "\n").replace("\r", "\n")

    return subprocess.CompletedProcess(list(cmd), code, text(out_r), text(err_r))


class _SubprocessShim(types.ModuleType):
    """:mod:`subprocess` with :func:`popen` as ``Popen``: what :func:`install` gives a module."""

    Popen = staticmethod(popen)

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)


def install(module: types.ModuleType) -> None:
    """Route ``module``'s ``subprocess.Popen`` (the supervisor launcher's) through :func:`popen`."""
    if getattr(module, "subprocess", None) is subprocess:
        module.subprocess = _SubprocessShim("subprocess")  # type: ignore[attr-defined]


def stop() -> None:
    """Stop the zygotes (the end of the test session); the children they forked live on."""
    with _start_lock:
        zygotes = list(_zygotes.values())
        _zygotes.clear()
    for z in zygotes:
        z.close()


if __name__ == "__main__":
    _main()
