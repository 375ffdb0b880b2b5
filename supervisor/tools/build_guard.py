"""What keeps ``twt build`` of a hostile source inside the source's own directory.

    SRC ... ──► stage_sources: a copy of each source's directory in a fresh temp dir
                (regular files only: no symlink, no dot entry, bounded in files and bytes)
            ──► refuse_cimport: no ``@cImport`` in Zig (it would run clang on any path)
            ──► cache_lock: one build at a time per Zig cache ("waiting for ... (pid N)")
            ──► run_compiler (per C file: preprocess, list what it read) ──► check_dependencies
            ──► run_compiler (the build): its own process group, killed whole at the timeout;
                with ``sandbox``, as the user ``nobody`` with no supplementary group

A source may name any file in ``#include`` / ``#embed`` (absolute, ``..``,
through a macro); the compiler's dependency list names every file it read,
``#embed`` included, so the build is refused unless each lies in the staged
copy or the toolchain's own headers - nothing the source names outside its
directory reaches the module. Zig refuses ``@embedFile`` / ``@import``
outside the root's directory itself (the staged copy, where symlinks were
not copied). Source names are passed as paths under the copy (``src0/-oX.c``),
never as something the compiler could parse as an option.

Owns: the staged copy, the dependency check, the compiler's process group,
the cache lock. May touch: nothing outside the temp dir (the lock is an
``flock`` on the cache directory; with ``sandbox``, the caller gives the
sandbox cache it creates to ``nobody``). Threads: none; the lock is
between processes.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pwd
import re
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

__all__ = [
    "MAX_OUTPUT",
    "MAX_STAGED_BYTES",
    "MAX_STAGED_FILES",
    "BuildError",
    "NoDependencyList",
    "SandboxUser",
    "cache_lock",
    "check_dependencies",
    "chown_tree",
    "kill_group",
    "parse_depfile",
    "refuse_cimport",
    "run_compiler",
    "sandbox_user",
    "source_dir",
    "stage_sources",
]

#: files and bytes one build may copy from its sources' directories (a tenant's sources, not a home dir)
MAX_STAGED_FILES = 1000
MAX_STAGED_BYTES = 64 << 20
_MAX_DEPTH = 8
#: how long the compiler's process group may take to go once killed
_REAP_S = 5.0
#: the most of the compiler's messages a build keeps (its head and tail past that)
MAX_OUTPUT = 256 << 10


class BuildError(Exception):
    """A build failed: ``message`` is one line; ``output`` holds the compiler's own messages, if any."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


class NoDependencyList(BuildError):
    """The preprocessor listed no files (it does so when an ``#embed`` names nothing it finds): the build
    is refused; the compiler's own run says why."""


# ------------------------------------------------------------------ the staged copy


@dataclass
class _Budget:
    files: int = 0
    nbytes: int = 0


def stage_sources(sources: Sequence[Path], root: Path) -> list[Path]:
    """Copy each source's directory under ``root/src<i>``; the staged sources, relative to ``root``.

    Only regular files and directories are copied (no symlink, FIFO or
    device; no name starting with a dot), each opened with ``O_NOFOLLOW``
    so a file swapped for a link meanwhile is skipped; files this process
    cannot read are skipped too. BuildError past ``MAX_STAGED_FILES`` files
    or ``MAX_STAGED_BYTES`` bytes.
    """
    copies: dict[Path, Path] = {}
    budget = _Budget()
    staged: list[Path] = []
    for src in sources:
        if src.is_symlink():  # it could name /etc/shadow, and its folder would be /etc
            raise BuildError(f"{src}: a symlink: name the file itself (sources are copied; links are not followed)")
        if not src.is_file():
            raise BuildError(f"{src}: no such file")
        real = source_dir(src)
        dest = copies.get(real)
        if dest is None:
            dest = copies[real] = root / f"src{len(copies)}"
            dest.mkdir(mode=0o755)
            _copy_tree(real, dest, budget, 0)
        target = dest / src.name
        if not target.is_file():  # a dot-named source, or one skipped as unreadable: copy it or fail plainly
            try:
                _copy_file(src, target, budget)
            except OSError as exc:
                raise BuildError(f"{src}: cannot read it ({exc.strerror})") from None
            if not target.is_file():
                raise BuildError(f"{src}: not a regular file")
        staged.append(target.relative_to(root))
    return staged


def source_dir(src: Path) -> Path:
    """The directory a source is staged from: its own folder (the file itself is never a link here)."""
    return Path(os.path.realpath(src.absolute().parent))


def _copy_tree(src: Path, dest: Path, budget: _Budget, depth: int) -> None:
    try:
        entries = sorted(os.scandir(src), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith(".") or entry.is_symlink():
            continue
        if entry.is_dir(follow_symlinks=False):
            if depth < _MAX_DEPTH:
                sub = dest / entry.name
                sub.mkdir(mode=0o755)
                _copy_tree(Path(entry.path), sub, budget, depth + 1)
        elif entry.is_file(follow_symlinks=False):
            try:
                _copy_file(Path(entry.path), dest / entry.name, budget)
            except PermissionError:
                continue


def _copy_file(src: Path, dest: Path, budget: _Budget) -> None:
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a symlink or a FIFO now: not a source file
            return
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return
        budget.files += 1
        budget.nbytes += info.st_size
        if budget.files > MAX_STAGED_FILES or budget.nbytes > MAX_STAGED_BYTES:
            raise BuildError(f"{src.parent}: more than {MAX_STAGED_FILES} files or {MAX_STAGED_BYTES >> 20} MiB "
                             "to copy for the build: put the tenant's sources in a directory of their own")
        with os.fdopen(fd, "rb", closefd=False) as reader, open(dest, "wb") as writer:
            while chunk := reader.read(1 << 20):
                writer.write(chunk)
        os.chmod(dest, 0o644)
    finally:
        os.close(fd)


_CIMPORT = re.compile(rb"@cImport\b")


def refuse_cimport(root: Path) -> None:
    """BuildError when a staged Zig file uses ``@cImport`` (its clang reads any path; C files are checked)."""
    for path in sorted(root.rglob("*.zig")):
        if _CIMPORT.search(path.read_bytes()):
            raise BuildError(f"{path.relative_to(root).as_posix().split('/', 1)[-1]}: @cImport is not supported by "
                             "twt build (its C is not checked): build the C as a .c file beside the Zig root and "
                             "declare what it exports with `extern fn`")


# ------------------------------------------------------------------ what the compiler read


_DEP_TOKEN = re.compile(r"(?:\\.|[^\s\\])+")


def parse_depfile(text: str) -> list[str]:
    """The prerequisites of a Make rule as clang's ``-MD`` writes it (escaped spaces, ``\\`` continuations)."""
    body = text.replace("\\\n", " ")
    _, _, deps = body.partition(": ")
    out = []
    for token in _DEP_TOKEN.findall(deps):
        out.append(re.sub(r"\\(.)", r"\1", token).replace("$$", "$"))
    return out


def check_dependencies(depfile: Path, cwd: Path, allowed: Sequence[Path], source: str) -> None:
    """BuildError naming the first file ``depfile`` lists outside every ``allowed`` directory."""
    roots = [os.path.realpath(a) for a in allowed]
    try:
        deps = parse_depfile(depfile.read_text(errors="replace"))
    except OSError as exc:
        raise NoDependencyList(f"{source}: the compiler wrote no list of the files it read "
                               f"({exc.strerror}): is an #include or #embed missing?") from None
    for dep in deps:
        real = os.path.realpath(os.path.join(cwd, dep))
        if not any(real == r or real.startswith(r + os.sep) for r in roots):
            raise BuildError(f"{source}: reads {dep!r}, outside the source's directory (#include / #embed "
                             "may name only files beside the source, the SDK header and the C library)")


# ------------------------------------------------------------------ the compiler's processes


@dataclass(frozen=True)
class SandboxUser:
    """The unprivileged user a sandboxed build runs as."""

    name: str
    uid: int
    gid: int


def sandbox_user(name: str = "nobody") -> SandboxUser:
    """``nobody``'s ids; BuildError unless this process may switch to it (root)."""
    if os.geteuid() != 0:
        raise BuildError(f"--sandbox builds as the user {name!r}, which needs root (running as uid {os.geteuid()}); "
                         "without root, run twt build as a user that can read nothing a tenant may not see")
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise BuildError(f"--sandbox builds as the user {name!r}, and there is none on this host") from None
    return SandboxUser(name, entry.pw_uid, entry.pw_gid)


def chown_tree(root: Path, user: SandboxUser) -> None:
    """Give everything under ``root`` (made by this build: no link) to ``user``."""
    os.chown(root, user.uid, user.gid, follow_symlinks=False)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            os.chown(os.path.join(dirpath, name), user.uid, user.gid, follow_symlinks=False)


def run_compiler(cmd: Sequence[str], *, cwd: Path, env: dict[str, str], timeout_s: float,
                 user: SandboxUser | None = None) -> tuple[int, str]:
    """Run ``cmd`` in a session of its own; ``(exit code, what it printed)`` (stdout and stderr
    interleaved in one file; at most ``MAX_OUTPUT`` bytes kept, its head and tail).

    At the timeout (or any exception here) the whole process group is
    killed while its leader is still unreaped (so the group's id is still
    ours) - ``zig`` runs ``zig clang`` children that outlive a killed
    parent - and waited for before this returns, as far as the system lets.
    """
    extra: dict[str, object] = {}
    if user is not None:
        extra = {"user": user.uid, "group": user.gid, "extra_groups": []}
    with tempfile.TemporaryFile() as sink:  # a file, not a pipe: a flood of diagnostics is not held in memory
        try:
            proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=sink,
                                    stderr=sink, start_new_session=True, **extra)  # type: ignore[call-overload]
        except OSError as exc:
            who = f" as the user {user.name!r}" if user is not None else ""
            raise BuildError(f"cannot start the compiler {cmd[0]}{who}: {exc.strerror} (with --sandbox, the "
                             "ziglang package must lie where that user can read it, outside any 0700 home "
                             "directory)") from None
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            raise BuildError(f"the compiler did not finish within {timeout_s:g} s (its processes were killed)",
                             _bounded(sink)) from None
        except BaseException:
            kill_group(proc)
            raise
        # No kill after a normal exit: the leader is reaped now, so its pid (the group's id) may be reused.
        return proc.returncode, _bounded(sink)


def _bounded(sink: IO[bytes]) -> str:
    """What the compiler printed: all of it up to ``MAX_OUTPUT`` bytes, else its head and tail."""
    size = sink.seek(0, os.SEEK_END)
    sink.seek(0)
    if size <= MAX_OUTPUT:
        data = sink.read()
    else:
        head = sink.read(MAX_OUTPUT // 2)
        sink.seek(size - MAX_OUTPUT // 4)
        cut = size - MAX_OUTPUT // 2 - MAX_OUTPUT // 4
        data = head + f"\n[... {cut:,} bytes of compiler output cut ...]\n".encode() + sink.read()
    return data.decode(errors="replace").strip()


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``'s process group, reap ``proc``, and wait (bounded) until the group is gone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    except PermissionError:  # the group's members run as another user and this process is not root
        proc.kill()
    try:
        proc.wait(timeout=_REAP_S)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + _REAP_S
    while time.monotonic() < deadline and _group_alive(proc.pid):
        time.sleep(0.01)


def _group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` still runs (zombies waiting for init do not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_path.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


# ------------------------------------------------------------------ one build at a time per cache


@contextmanager
def cache_lock(cache: Path, *, timeout_s: float, notify: Callable[[str], object] | None = None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the ``cache`` directory itself for the ``with`` block.

    Why: Zig's cache takes concurrent builds, but two first builds each
    compile wasi-libc side by side, and builds beside them wait minutes in
    silence. Here a build that finds the lock taken says so once through
    ``notify`` ("waiting for another build of the Zig cache ... (pid N)",
    the holder found in ``/proc/locks``) and waits up to ``timeout_s``;
    BuildError past it. The lock is on the directory (opened read-only), so
    a build writes no file of its own into the cache; Zig's own locks are on
    files inside it.
    """
    if not cache.is_dir():
        cache.mkdir(parents=True, exist_ok=True)
    fd = os.open(cache, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not _try_lock(fd):
            holder = _lock_holder(fd)
            if notify is not None:
                notify(f"twt build: waiting for another build of the Zig cache {cache} (pid {holder})...")
            deadline = time.monotonic() + timeout_s
            while not _try_lock(fd):
                if time.monotonic() >= deadline:
                    raise BuildError(f"another build held the Zig cache {cache} for over {timeout_s:g} s "
                                     f"(pid {holder}: an flock on the directory)")
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the flock


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _lock_holder(fd: int) -> str:
    """The pid holding an ``flock`` on ``fd``'s file, from ``/proc/locks`` ("unknown" if not found)."""
    info = os.fstat(fd)
    want = (os.major(info.st_dev), os.minor(info.st_dev), info.st_ino)
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return "unknown"
    for line in lines:
        fields = line.split()
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":
            continue
        try:
            major, minor, inode = fields[5].split(":")
            if (int(major, 16), int(minor, 16), int(inode)) == want:
                return fields[4]
        except ValueError:
            continue
    return "unknown"
