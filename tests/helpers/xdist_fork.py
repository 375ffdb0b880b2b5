"""The pytest-xdist workers of a run, forked from one preloaded interpreter.

Every xdist worker is a fresh ``python -u -c "import sys;exec(eval(sys.stdin.readline()))"`` (execnet's
``popen`` gateway) that imports pytest, numpy, zmq, wasmtime, the supervisor's, the worker's and the
shared modules, and every test module, before its first test: the same ~800 third-party and product
modules in each of the 6 workers. Here the xdist controller starts one interpreter that imports them
once - the modules the suite's files import at their top (a scan of their ``import`` lines) and
pytest's own plugins - and then forks each worker from it: the child takes the controller's pipes,
environment and working directory and runs execnet's bootstrap line, as the fresh interpreter would.
It then imports the conftests and test modules itself (nothing of ``tests`` is preloaded: their
module-level code, such as the leak fixture's per-worker marker, runs in each worker as before).

What is never preloaded: the modules of pytest's plugin distributions (pytest-xdist, pytest-timeout,
hypothesis), which pytest imports through its assertion rewriter (a module imported before it would
be left unrewritten, and pytest warns about it); the preload refuses to fork at all when one of them
was imported. What differs from a fresh worker: its parent is the preloading interpreter, not the
controller; it shares that interpreter's string-hash seed; numpy's legacy global generator is seeded
again after the fork (Python's ``random`` is, by itself). Like tests/helpers/zygote.py's zygotes it
forks only while it has one thread, and any start it cannot make is a plain ``Popen``.
``PYTEST_TWT_ZYGOTE=0`` turns it off with the other zygotes.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from tests.helpers import zygote
from tests.helpers.timeouts import scaled

__all__ = ["install", "marked_for_rewrite", "preload_modules", "stop"]

#: execnet's bootstrap line: what a fresh popen worker runs (``python -u -c LINE``)
BOOTSTRAP = "import sys;exec(eval(sys.stdin.readline()))"
_ROOT = Path(__file__).resolve().parents[2]
#: a module-level import line: ``import a, b.c`` or ``from a.b import ...`` at the start of a line
_IMPORT = re.compile(r"^(?:from[ \t]+([A-Za-z_][\w.]*)[ \t]+import|import[ \t]+([A-Za-z_][\w.]*"
                     r"(?:[ \t]*,[ \t]*[A-Za-z_][\w.]*)*))", re.M)
#: how long the preload may take (a hang guard: a loaded machine is slow)
_READY_TIMEOUT_S = 120.0
#: never preloaded: ``worker.preload`` builds a wasmtime engine at import, which installs wasmtime's
#: handlers of the fault signals (a guest's trap is a SIGSEGV or SIGILL it turns into a ``Trap``). In a
#: fresh worker pytest's faulthandler is installed first and wasmtime's on top of it; a worker forked
#: after the engine was built gets faulthandler on top, and a trap ends the worker ("Fatal Python error")
_NOT_PRELOADED = frozenset({"worker.preload"})
#: the signals whose process-wide (native) handlers must still be the default ones when the preload ends
_FAULT_SIGNALS = ("SIGSEGV", "SIGILL", "SIGBUS", "SIGFPE")


def marked_for_rewrite() -> frozenset[str]:
    """The top-level names pytest marks for assertion rewriting before it loads its plugins (those of
    every distribution with a ``pytest11`` entry point), as ``Config._mark_plugins_for_rewrite``
    finds them: none of them may be imported before pytest starts."""
    import importlib.metadata

    try:
        from _pytest.config import _iter_rewritable_modules
    except ImportError:  # another pytest: every top-level name of those distributions, to be safe
        def _iter_rewritable_modules(files: Any) -> Iterator[str]:
            for f in files:
                yield str(f).split("/", 1)[0].removesuffix(".py")
    names: set[str] = set()
    for dist in importlib.metadata.distributions():
        if any(ep.group == "pytest11" for ep in dist.entry_points):
            names.update(_iter_rewritable_modules(str(f) for f in dist.files or []))
            names.update(ep.value.partition(":")[0].strip().split(".", 1)[0]
                         for ep in dist.entry_points if ep.group == "pytest11")
    return frozenset(names)


def preload_modules(root: Path = _ROOT, marked: frozenset[str] = frozenset()) -> list[str]:
    """What a worker's collection imports that is not the suite's own: pytest's default plugins,
    and every module the suite's files import at their top (``tests``, ``conftest`` and the
    names in ``marked`` left out)."""
    from _pytest.config import default_plugins, essential_plugins

    found = dict.fromkeys(["pytest", "execnet", *(f"_pytest.{p}" for p in (*essential_plugins, *default_plugins))])
    from tests.helpers import warm_bytecode

    for path in warm_bytecode.python_sources(root / "tests"):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for m in _IMPORT.finditer(text):
            for name in ([m.group(1)] if m.group(1) else [n.strip() for n in m.group(2).split(",")]):
                if name.split(".", 1)[0] not in ("tests", "conftest", "__future__", *marked) \
                        and name not in _NOT_PRELOADED:
                    found[name] = None
    return list(found)


# --------------------------------------------------------------------------- the server


def _serve_main() -> None:
    """The preloading interpreter (``python -u -c``, as a worker is started): import, then fork."""
    # it shares the terminal's process group: a ^C is the controller's and its workers' to handle
    # (each worker gets Python's own handler back), not a second traceback from here
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctl = socket.socket(fileno=int(sys.argv[1]))
    marked = marked_for_rewrite()
    for name in preload_modules(marked=marked):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module the worker fails to import fails there, as before
            continue
    leaked = sorted(n for n in sys.modules if n.split(".", 1)[0] in marked)
    problem = zygote._unfit() or ("" if zygote._one_thread() else "a native thread")
    problem = problem or (f"{leaked[:3]} imported (pytest rewrites them)" if leaked else "")
    problem = problem or (f"handlers of {caught} installed" if (caught := _fault_handlers()) else "")
    if problem:
        sys.exit(f"xdist_fork: preloading left {problem}")
    import gc

    gc.collect()
    gc.freeze()
    ctl.send(json.dumps({"ready": os.getpid(), "cwd": os.getcwd()}).encode())
    forked = zygote._serve(ctl)
    if forked is None:  # the controller is gone: reap the workers first, so that their CPU is counted
        _reap_all()
        return
    _become_worker(*forked)


def _fault_handlers() -> list[str]:
    """The fault signals (:data:`_FAULT_SIGNALS`) with a native handler that is not the default
    (``sigaction``: what a C library installed, which Python's ``signal`` module does not show)."""
    import ctypes
    import signal

    class SigAction(ctypes.Structure):  # glibc's struct sigaction: handler, mask, flags, restorer
        _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16), ("flags", ctypes.c_int),
                    ("restorer", ctypes.c_void_p)]

    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return []
    found = []
    for name in _FAULT_SIGNALS:
        action = SigAction()
        if libc.sigaction(int(getattr(signal, name)), None, ctypes.byref(action)) == 0 and action.handler:
            found.append(name)
    return found


def _reap_all() -> None:
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def _become_worker(request: dict[str, Any], fds: list[int]) -> None:
    """In a forked child: the controller's pipes, environment and directory, then execnet's bootstrap
    line in a ``__main__`` as ``python -c`` has it."""
    zygote.take_stdio(fds)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has it
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["-c"]
    import multiprocessing.process

    multiprocessing.process.ORIGINAL_DIR = os.getcwd()  # type: ignore[attr-defined]
    multiprocessing.current_process().authkey = os.urandom(32)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # its legacy global generator, as a fresh import seeds it
    main = sys.modules["__main__"]
    for name in list(vars(main)):
        if name not in ("__name__", "__doc__", "__package__", "__loader__", "__spec__", "__annotations__",
                        "__builtins__"):
            delattr(main, name)
    exec(compile(BOOTSTRAP, "<string>", "exec"), vars(main))
    raise SystemExit(0)


# --------------------------------------------------------------------------- the controller's side


class _Server:
    """The preloading interpreter, seen from the controller."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.ctl, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        code = "from tests.helpers.xdist_fork import _serve_main; _serve_main()"
        with open(os.devnull, "rb") as null_in, open(os.devnull, "wb") as null_out:
            self.proc = zygote._RealPopen([sys.executable, "-u", "-c", code, str(theirs.fileno())], env=dict(env),
                                          pass_fds=(theirs.fileno(),), stdin=null_in, stdout=null_out,
                                          stderr=None, close_fds=True)
        theirs.close()
        self.lock = threading.Lock()
        self._ready: bool | None = None

    def ready(self) -> bool:
        """Whether it preloaded and can fork (waits for its preload the first time)."""
        with self.lock:
            if self._ready is None:
                self.ctl.settimeout(scaled(_READY_TIMEOUT_S))
                try:
                    hello = self.ctl.recv(4096)
                except (TimeoutError, OSError):
                    hello = b""
                self.ctl.settimeout(None)
                self._ready = bool(hello)
                if not self._ready:
                    self.close()
            return self._ready

    def start(self, env: Mapping[str, str], cwd: str) -> zygote.ZygoteProcess | None:
        """A worker forked with a pipe for its stdin and one for its stdout (its stderr this
        process's); None when the server may not fork now."""
        if not self.ready():
            return None
        to_child, from_parent = os.pipe()[::-1]  # (write end, read end)
        from_child, to_parent = os.pipe()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        request = {"args": ["-u", "-c", BOOTSTRAP], "env": dict(env), "cwd": cwd}
        try:
            with self.lock:
                socket.send_fds(self.ctl, [json.dumps(request).encode()], [from_parent, to_parent, 2, theirs.fileno()])
                reply = self.ctl.recv(4096)
        except OSError:
            reply = b""
        finally:
            theirs.close()
            os.close(from_parent)
            os.close(to_parent)
        answer = json.loads(reply) if reply else {}
        if "pid" not in answer:
            ours.close()
            os.close(to_child)
            os.close(from_child)
            return None
        return zygote.ZygoteProcess(int(answer["pid"]), [sys.executable, "-u", "-c", BOOTSTRAP], ours,
                                    (to_child, from_child, None))

    def close(self) -> None:
        self.ctl.close()  # it sees EOF, reaps its workers and exits
        try:
            self.proc.wait(scaled(60))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_server: _Server | None = None


def install() -> None:
    """In the xdist controller, before its workers start: start the preloading interpreter, and make
    execnet's popen gateways fork their workers from it (a plain start where it cannot)."""
    global _server
    if not zygote.enabled() or _server is not None:
        return
    from execnet import gateway_base, gateway_io

    _server = _Server(os.environ)
    server = _server
    plain = gateway_io.Popen2IOMaster

    class ForkedIOMaster(plain):  # type: ignore[misc, valid-type]
        def __init__(self, args: list[str], execmodel: Any) -> None:
            child = None
            if list(args) == [sys.executable, "-u", "-c", gateway_io.popen_bootstrapline]:
                child = server.start(os.environ, os.getcwd())
            if child is None:
                plain.__init__(self, args, execmodel)
                return
            self.popen = child
            gateway_base.Popen2IO.__init__(self, child.stdin, child.stdout, execmodel=execmodel)

    gateway_io.Popen2IOMaster = ForkedIOMaster


def stop() -> None:
    """The end of the session: the preloading interpreter exits once its workers have."""
    global _server
    if _server is not None:
        server, _server = _server, None
        server.close()


if __name__ == "__main__":  # pragma: no cover - started with -c by _Server
    _serve_main()
