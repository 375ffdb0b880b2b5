"""Process and shared-memory hygiene checks used after every test.

A leak is a ``twt-*`` segment in /dev/shm, or a tensor-wasm-tenant process
(worker processes name themselves ``twt-worker``, supervisors
``twt-supervisor``; see ``shared.prctl``) that appeared during the test
and is still there after a grace period.

Several test runs may share one machine (and /dev/shm). Only what belongs to
*this* run counts, so one run never reports, kills or unlinks another run's
workers and segments: a process is ours when it is a descendant of this
one or carries this run's :data:`SESSION_ENV` marker in its environment
(inherited by spawned children). A segment is ours when

* its recorded owner is alive and one of our processes, or
* its owner is dead and its name carries the namespace of one of *this
  session's run dirs* (a supervisor names its segments after its run dir:
  ``shared.quota.segment_namespace``). This session's run dirs are the
  directories this process created (``launch()``'s temporary ones,
  ``tmp_path``...) and those it named to a supervisor it started
  (``--run-dir`` / ``TWT_RUN_DIR`` of a subprocess): an audit hook
  (:func:`sys.addaudithook`, ``os.mkdir`` and ``subprocess.Popen``) records
  them as they appear, so a run dir removed since still counts;
* its owner is dead and its name carries no namespace (a test's own segment,
  a killed child's), or it is not our layout: as before namespaces, ours -
  except a name as a supervisor of an older build makes it
  (``twt-<8 hex>-<slot>``, ``shared.quota.is_legacy_name``): our
  supervisors never make one, a parallel run of an older build does. Under
  pytest-xdist such a segment is ours only when this process wrote it (the
  audit hook sees the open): another worker makes them as often as we do.

So another run's supervisor segments - a parallel suite that has just
SIGKILLed its supervisor and is about to restart it - are never reported or
unlinked here, while a leak of our own still fails the test that made it.
Each pytest-xdist worker is a run of its own here (its own marker), so one
worker never blames or kills another's processes.

The same audit hook records two more things per test (:func:`take_events`):

* every path this process creates outside the run's temp root (``$TMPDIR``,
  a fresh directory per ``make test``): a file opened for writing, a
  directory, a unix socket, a rename or link target. Allowed besides the root:
  ``/dev/shm`` (segments: judged above), ``/dev/null``, ``/proc`` and
  ``__pycache__`` (or ``$PYTHONPYCACHEPREFIX``, where Python is told to keep it). So the suite leaves nothing in ``/tmp``, the checkout or
  ``$HOME``, and a leftover there can never hide a missing set-up step.
* whether the test started a process (``subprocess.Popen``, ``os.fork``,
  ``os.posix_spawn``, ...): tests that do carry the ``process`` marker
  (tests/conftest.py), and ``make test-fast`` runs the others.
"""

from __future__ import annotations

import os
import secrets
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final, Literal

import psutil

from shared.errors import SegmentError
from shared.quota import MAGIC, _owner_alive, is_legacy_name, namespace_of, read_header, segment_namespace

PROCESS_NAMES = ("twt-worker", "twt-supervisor")
SHM_DIR = "/dev/shm"
#: Not TWT_-prefixed: that prefix belongs to the product's configuration.
SESSION_ENV = "PYTEST_TWT_SESSION"


#: namespaces of this session's run dirs (see the module docstring); filled by _audit
_namespaces: set[str] = set()
_hooked = False
#: paths created outside the temp root, and process starts, since the last take_events()
_outside: list[str] = []
_starts: list[str] = []
_main_thread = threading.main_thread().ident
_PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
                             "os.system", "pty.spawn"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
#: besides the temp root, what a test may write to: segments (judged by leaks()), the null
#: device, /proc, and the bytecode cache next to the sources
_ALLOWED_PREFIXES = ("/dev/shm/", "/dev/null", "/proc/")
ROOT_ENV = "PYTEST_TWT_ROOT"


def temp_root() -> str:
    """This run's temp root: ``$PYTEST_TWT_ROOT`` (``make test`` makes a fresh one per run and
    points ``$TMPDIR`` into it), else the temp directory in force (``/tmp`` for a bare pytest)."""
    return os.path.realpath(os.environ.get(ROOT_ENV) or tempfile.gettempdir())


_root = ""


def mark_session() -> str:
    """Tag this test run (inherited by every child process) and start recording its run
    dirs, writes and process starts; idempotent. A pytest-xdist worker takes a marker of its
    own: the workers are parallel runs that must not judge each other's processes."""
    global _hooked, _root
    if not _hooked:
        _root = temp_root()
        sys.addaudithook(_audit)
        _hooked = True
        if os.environ.get("PYTEST_XDIST_WORKER"):
            os.environ[SESSION_ENV] = secrets.token_hex(8)
    return os.environ.setdefault(SESSION_ENV, secrets.token_hex(8))


def take_events() -> tuple[list[str], list[str]]:
    """(paths created outside the temp root, process starts) since the last call; clears both."""
    outside, starts = list(_outside), list(_starts)
    del _outside[:len(outside)], _starts[:len(starts)]
    return outside, starts


def is_allowed_write(path: str) -> bool:
    """Whether creating ``path`` stays inside what the suite may touch (see the module docstring)."""
    if path.startswith("\0") or not path:  # an abstract unix socket: no file
        return True
    full = os.path.abspath(path)
    if "/__pycache__/" in full or full.endswith("/__pycache__") or full.startswith(_ALLOWED_PREFIXES):
        return True
    if sys.pycache_prefix and full.startswith(os.path.abspath(sys.pycache_prefix) + os.sep):
        return True  # the bytecode cache kept elsewhere (tests/run-suite.sh puts it in its root)
    root = _root or temp_root()
    if full == root or full.startswith(root + os.sep):
        return True
    real = os.path.realpath(full)
    return real == root or real.startswith(root + os.sep)


#: twt-* segment files this process created with an open() (fabricated ones: tests/helpers/segments.py)
_created_segments: set[str] = set()


def _note_write(path: Any) -> None:
    if isinstance(path, (str, bytes, os.PathLike)):
        text = os.fsdecode(path)
        if text.startswith(SHM_DIR + "/twt-"):
            _created_segments.add(text[len(SHM_DIR) + 1:])
        if not is_allowed_write(text):
            _outside.append(text)


def add_run_dir(path: str | os.PathLike[str]) -> str:
    """Count ``path`` as one of this session's run dirs; returns its segment namespace."""
    namespace = segment_namespace(os.fspath(path))
    _namespaces.add(namespace)
    return namespace


def session_namespaces() -> frozenset[str]:
    return frozenset(_namespaces)


def _run_dirs_of(argv: Iterable[Any], cwd: Any, env: Any) -> list[str]:
    """The run dirs a supervisor command line names (``--run-dir X``, ``--run-dir=X``, ``TWT_RUN_DIR``)."""
    args = [os.fsdecode(a) for a in argv if isinstance(a, (str, bytes, os.PathLike))]
    found = [v for a, v in zip(args, args[1:]) if a == "--run-dir"]
    found += [a.split("=", 1)[1] for a in args if a.startswith("--run-dir=")]
    if isinstance(env, dict) and isinstance(env.get("TWT_RUN_DIR"), str):
        found.append(env["TWT_RUN_DIR"])
    base = os.fsdecode(cwd) if isinstance(cwd, (str, bytes, os.PathLike)) else os.getcwd()
    return [os.path.join(base, p) for p in found if p]


def _audit(event: str, args: tuple[Any, ...]) -> None:
    """Record this session's run dirs as they appear, and paths created outside the temp root
    and process starts (must never raise: it runs inside os calls)."""
    if event == "open":
        if isinstance(args[2], int) and args[2] & _WRITE_FLAGS:
            try:
                _note_write(args[0])
            except (TypeError, ValueError, OSError):
                pass
        return
    if event in _PROCESS_EVENTS and threading.get_ident() == _main_thread:
        _starts.append(event)  # the test's own thread: a leftover thread of another test is not it
    if event not in ("os.mkdir", "subprocess.Popen", "socket.bind", "os.rename", "os.symlink", "os.link"):
        return
    try:
        if event == "os.mkdir":
            path, _mode, dir_fd = args
            if dir_fd in (None, -1):
                _note_write(path)
                add_run_dir(os.fsdecode(path))
        elif event == "subprocess.Popen":
            _executable, argv, cwd, env = args
            for path in _run_dirs_of([argv] if isinstance(argv, (str, bytes)) else argv, cwd, env):
                _note_write(path)
                add_run_dir(path)
        elif event == "socket.bind":
            if isinstance(args[1], (str, bytes)):  # a unix socket's path
                _note_write(args[1])
        else:  # rename, symlink, link: (src, dst, [src_dir_fd,] dst_dir_fd)
            if args[-1] in (None, -1):
                _note_write(args[1])
    except (TypeError, ValueError, OSError, IndexError):  # an odd argument names no path; never break the call
        return


def _process_is_ours(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if pid in descendants():
        return True
    try:
        env = psutil.Process(pid).environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    marker = os.environ.get(SESSION_ENV)
    return marker is not None and env.get(SESSION_ENV) == marker


#: what :func:`_raw_owner` reports for a segment whose header is not written yet
_UNWRITTEN: Final = "unwritten"


def _raw_owner(name: str) -> tuple[int, int] | Literal["unwritten"] | None:
    """(owner pid, owner start) from any layout version's header (the first line is the same in
    all); :data:`_UNWRITTEN` for a segment whose header is not written yet (empty, or no magic:
    its creator writes the magic last - another process may be creating it this moment); None
    when the file is gone or not a tensor-wasm-tenant segment.

    One read answers both questions. Two (the owner, then "is it written yet?") may straddle the
    creator's header write: the first finds no owner, the second a header, and a live owner's
    segment passes for an ownerless leftover - which a serial run's leak fixture unlinks, under
    another worker's test between its create and its first attach."""
    try:
        with open(os.path.join(SHM_DIR, name), "rb") as f:
            head = f.read(40)
    except OSError:
        return None
    if len(head) < 8 or head[:8] == bytes(8):
        return _UNWRITTEN
    if len(head) < 40:
        return None
    magic, _version, _kind, pid, start = struct.unpack("<5Q", head)
    return (pid, start) if magic == MAGIC else None


def _dead_owners_segment_is_ours(name: str) -> bool:
    namespace = namespace_of(name)
    if namespace is None:
        if name in _created_segments:
            return True
        if os.environ.get("PYTEST_XDIST_WORKER"):
            # Another worker's test makes such segments as often as ours does (fabricated stale
            # ones, a killed child's): leave them to the worker that made them. Serial runs judge
            # them all.
            return False
        return not is_legacy_name(name)
    return namespace in _namespaces


def _segment_is_ours(name: str) -> bool:
    try:
        header = read_header(name)
    except SegmentError:
        # Another layout version (a run of another build on this machine) or not
        # ours at all: judge by the recorded owner when there is one.
        owner = _raw_owner(name)
        if owner == _UNWRITTEN:
            # no owner recorded yet: its creator may be between its shm_open and its header, in
            # another run (a serial run beside a parallel one - the self-tests' child run - took
            # such a segment from another worker's test between its create and its attach)
            return name in _created_segments
        if owner is None or not _owner_alive(*owner):
            return _dead_owners_segment_is_ours(name)
        return _process_is_ours(owner[0])
    if not header.owner_alive():
        return _dead_owners_segment_is_ours(name)
    return _process_is_ours(header.owner_pid)


def twt_segments() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith("twt-")}
    except FileNotFoundError:
        return set()


#: Linux's /proc with per-thread children lists (CONFIG_PROC_CHILDREN): the scans below read it
#: directly (a process's children without reading every process on the machine); elsewhere psutil
_PROC_SCANS = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def _proc_stat(pid: int) -> tuple[str, str, int] | None:
    """(name, state, start time in clock ticks since boot) of ``pid`` from /proc/PID/stat; None
    once it is gone. The name is the kernel's (what ``shared.prctl.set_process_name`` sets).

    Read with ``os.open``/``os.read`` (the kernel writes the whole line in one read; it is well under
    a page): half the CPU of ``open()``'s file object, which :func:`twt_processes` paid for every
    process on the machine twice a test."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    if not data:
        return None
    close = data.rfind(b")")
    fields = data[close + 2:].split()
    return data[data.find(b"(") + 1:close].decode(errors="replace"), fields[0].decode(), int(fields[19])


def twt_processes() -> set[tuple[int, float]]:
    """(pid, start time) of every live ``twt-*`` process on the machine.

    These scans run twice per test (before and after): on Linux one read of /proc/PID/stat per
    process - psutil's ``process_iter`` did the same reads with an object per process, three
    times the CPU (the fixture cost the suite ~15 s of CPU a run). The start time is only
    compared with the same function's, so ticks since boot serve as well as psutil's seconds."""
    if not _PROC_SCANS:  # not Linux's /proc: psutil's way
        found = set()
        for proc in psutil.process_iter(["name", "create_time", "status"]):
            info = proc.info
            if info["name"] in PROCESS_NAMES and info["status"] != psutil.STATUS_ZOMBIE:
                found.add((proc.pid, info["create_time"]))
        return found
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None and stat[0] in PROCESS_NAMES and stat[1] != "Z":
                out.add((int(entry), float(stat[2])))
    return out


def descendants(pid: int | None = None) -> set[int]:
    """Every process below ``pid`` (default: this one): its children, their children, ...

    From each thread's /proc children list where the kernel has them (a process's children are
    listed under the thread that started them), so the cost is that of our own process tree;
    psutil's ``children(recursive=True)`` reads every process on the machine to build it."""
    if not _PROC_SCANS:
        try:
            return {c.pid for c in psutil.Process(pid).children(recursive=True)}
        except psutil.Error:
            return set()
    found: set[int] = set()
    todo = [os.getpid() if pid is None else pid]
    while todo:
        parent = todo.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue  # gone meanwhile: its children were reparented, not ours any more
        for tid in threads:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = f.read().split()
            except OSError:
                continue
            for kid in map(int, kids):
                if kid not in found:
                    found.add(kid)
                    todo.append(kid)
    return found


def cmdline(pid: int) -> list[str]:
    """The command line of ``pid`` ([] once it is gone or for a kernel thread)."""
    if not _PROC_SCANS:
        try:
            return list(psutil.Process(pid).cmdline())
        except psutil.Error:
            return []
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


@dataclass
class Baseline:
    segments: set[str]
    processes: set[tuple[int, float]]
    #: whether processes are compared at all (a test that starts none - the start guard of
    #: tests/conftest.py fails one that does - need not pay for two scans of every process)
    check_processes: bool = True


def baseline(processes: bool = True) -> Baseline:
    return Baseline(twt_segments(), twt_processes() if processes else set(), processes)


def leaks(before: Baseline, grace_s: float = 5.0) -> tuple[set[str], set[tuple[int, float]]]:
    """Segments and processes new since ``before`` that outlive ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while True:
        segs = {n for n in twt_segments() - before.segments if _segment_is_ours(n)}
        procs = ({p for p in twt_processes() - before.processes if _process_is_ours(p[0])}
                 if before.check_processes else set())
        if (not segs and not procs) or time.monotonic() >= deadline:
            return segs, procs
        time.sleep(0.05)


def kill_processes(procs: set[tuple[int, float]]) -> None:
    for pid, _ in procs:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


def unlink_segments(names: set[str]) -> None:
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass
