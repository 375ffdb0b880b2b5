"""Compiling guest sources for the SDK tests, once per run per distinct input, shared by xdist workers.

``SdkBuilder.build(...)`` runs ``twt build``'s library function and keeps
the module bytes keyed by the sha256 of everything that decides them: each
source's name and bytes, the SDK's bindings, the options. The modules live
in one folder per test run (beside the xdist workers' own temp folders, the
way tests/helpers/gpu_dry_run.py shares its run), each built under an
``flock`` of its own: the first worker to need a guest builds it, the others
wait for that build and read its module - never a second compiler for the
same guest. Builds of different guests still run side by side, and take
turns on Zig's cache through ``twt build``'s own lock. The first build of a
fresh machine compiles wasi-libc once (tens of seconds on one core).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import shutil
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.tools.build import build_module, sdk_dir

__all__ = ["EXAMPLES", "ROOT", "SdkBuilder", "opened_during", "opened_in", "seed_sandbox_cache", "shared_build_dir"]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "sdk" / "examples"


def shared_build_dir(factory: pytest.TempPathFactory) -> Path:
    """The run's one folder of built guests: shared by every xdist worker of the run, fresh per run."""
    base = factory.getbasetemp()
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id and base.name.startswith("popen-gw"):  # an xdist worker: its siblings share the parent
        path = base.parent / f"sdk-build-{run_id[:16]}"
    else:
        path = base / "sdk-build"
    path.mkdir(exist_ok=True)
    return path


#: the parts of a Zig cache that a build opens for writing (``h``: the manifests, opened read-write
#: under a lock and rewritten; ``z``: the ZIR caches; ``b``: the build runner's): a seeded sandbox
#: cache gets private copies of them, owned by its user
_WRITTEN = ("h", "z", "b")
#: the part a build only reads once it is there (``o``: objects and archives, each written whole into
#: a new hash directory and then only read - wasi-libc's and the runtimes' among them: most of the bytes)
_READ_ONLY = ("o",)


#: inotify(7): a file in the watched folder was opened; watch only a directory; the event queue overflowed
_IN_OPEN, _IN_ONLYDIR, _IN_Q_OVERFLOW = 0x20, 0x1000000, 0x4000
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then len bytes of name)


def opened_in(folder: Path, action: Callable[[], object]) -> set[str] | None:
    """The names of the files in ``folder`` that were opened while ``action`` ran (by anyone: a
    superset of what ``action`` opened), through inotify; None where that cannot be known (no
    inotify, the event queue overflowed)."""
    found = opened_during(action, folder)
    return None if found is None else found[0]


def opened_during(action: Callable[[], object], folder: Path,
                  below: Path | None = None) -> tuple[set[str], set[str]] | None:
    """What was opened while ``action`` ran (by anyone), through inotify: the names of the files in
    ``folder`` and, with ``below``, the names of ``below``'s subfolders in which a file was opened
    (one watch per subfolder, those that exist when it starts: a folder made meanwhile is not
    named). None where that cannot be known (no inotify, too many watches, the event queue
    overflowed)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, AttributeError):
        return None
    if fd < 0:
        return None
    try:
        top = libc.inotify_add_watch(fd, os.fsencode(folder), _IN_OPEN)
        if top < 0:
            return None
        subfolders: dict[int, str] = {}
        for name in os.listdir(below) if below is not None else ():
            assert below is not None
            wd = libc.inotify_add_watch(fd, os.fsencode(below / name), _IN_OPEN | _IN_ONLYDIR)
            if wd >= 0:
                subfolders[wd] = name
            elif ctypes.get_errno() not in (errno.ENOTDIR, errno.ENOENT):  # not a folder, gone: not one
                return None  # the user's watch limit: unknown
        action()
        names: set[str] = set()
        used: set[str] = set()
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                return names, used
            at = 0
            while at + _EVENT.size <= len(data):
                wd, mask, _, size = _EVENT.unpack_from(data, at)
                if mask & _IN_Q_OVERFLOW:
                    return None
                name = data[at + _EVENT.size:at + _EVENT.size + size].rstrip(b"\0")
                if wd == top and name:
                    names.add(os.fsdecode(name))
                elif wd in subfolders:
                    used.add(subfolders[wd])
                at += _EVENT.size + size
    finally:
        os.close(fd)


def seed_sandbox_cache(source: Path, cache: Path, uid: int, gid: int,
                       probe: Callable[[], object] | None = None) -> None:
    """Make ``cache`` a Zig cache for the user ``uid``:``gid`` that already holds what ``source`` (the
    invoking user's cache) compiled, so that a sandboxed build in it compiles no wasi-libc.

    Why not a copy: the user's cache is hundreds of MB (a copy and a chown of every file cost the suite
    ~19 s of CPU). ``o`` becomes a tree of hard links: the files stay the invoking user's inodes with
    their modes, which the sandbox's user can read but not write (a file others may write is copied
    instead), and its directories stay the invoking user's, so nothing can be added to or changed in
    them either; only ``cache`` and ``cache/o`` themselves are the sandbox user's (new hash directories
    go there). What a build writes into (``h``, ``z``, ``b``) is a private copy owned by that user.
    So the sandbox's user still cannot write a byte that the invoking user's builds read. Another
    filesystem (no hard links) gets a copy. Other builds may write ``source`` meanwhile: what vanishes
    halfway is left out (a build compiles it again if it needs it).

    ``probe``: a trusted build on ``source`` of the kind the sandbox will run. Then ``h`` gets only
    the manifests opened while it ran, and ``o`` only the object folders in which it opened a file
    (:func:`opened_during`), not every manifest and object the user's cache ever wrote (on a machine
    where many checkouts built, ~40,000 manifests, 200 MB copied, and ~45,000 object folders, ~90,000
    links made, then all removed: ~9 s of CPU); one it missed only means that the sandboxed build
    compiles that part again. Without inotify (or past the user's watch limit), every manifest and
    every object, as without a probe."""
    cache.mkdir(mode=0o700)
    os.chown(cache, uid, gid)
    if not source.is_dir():
        return
    opened = (opened_during(probe, source / "h", source / "o")
              if probe is not None and (source / "h").is_dir() and (source / "o").is_dir() else None)
    manifests, objects = opened if opened is not None else (None, None)
    linkable = os.stat(source).st_dev == os.stat(cache).st_dev
    for name in sorted(os.listdir(source)):
        if name not in _WRITTEN + _READ_ONLY:  # tmp: a build's scratch
            continue
        src, dst = source / name, cache / name
        if name in _READ_ONLY and linkable:
            # cp's exit status is ignored: a file removed under it is reported and skipped
            if objects is None:
                subprocess.run(["cp", "-al", "--", str(src), str(dst)], stderr=subprocess.DEVNULL, check=False)
            else:  # the folders the probe read from, each a tree of links in a folder of the user's
                dst.mkdir()
                if objects:
                    subprocess.run(["cp", "-al", "--", *(str(src / o) for o in sorted(objects)), str(dst)],
                                   stderr=subprocess.DEVNULL, check=False)
            writable = subprocess.run(["find", str(dst), "-type", "f", "-perm", "-o+w", "-print0"],
                                      capture_output=True, check=False).stdout
            for path in filter(None, writable.split(b"\0")):  # a file others may write: not shared
                private = Path(os.fsdecode(path))
                data = private.read_bytes()
                private.unlink()
                private.write_bytes(data)
                os.chown(private, uid, gid)
        elif name == "h" and manifests is not None:
            dst.mkdir()
            for manifest in sorted(manifests):
                with contextlib.suppress(OSError):  # gone meanwhile, or not a file: left out
                    shutil.copyfile(src / manifest, dst / manifest, follow_symlinks=False)
            subprocess.run(["chown", "-R", "--no-dereference", f"{uid}:{gid}", "--", str(dst)], check=False)
        else:
            subprocess.run(["cp", "-r", "--", str(src), str(dst)], stderr=subprocess.DEVNULL, check=False)
            subprocess.run(["chown", "-R", "--no-dereference", f"{uid}:{gid}", "--", str(dst)], check=False)
        if dst.is_dir():
            os.chown(dst, uid, gid)
        else:  # nothing of it arrived: an empty one of the sandbox's user
            shutil.rmtree(dst, ignore_errors=True)
            dst.mkdir()
            os.chown(dst, uid, gid)


class SdkBuilder:
    """Builds C / Zig sources into module bytes, each distinct input once per run (see the module doc)."""

    def __init__(self, workdir: Path, shared: Path | None = None) -> None:
        self.workdir = workdir
        self.shared = shared if shared is not None else workdir / "modules"
        self.shared.mkdir(parents=True, exist_ok=True)
        self._cache: dict[str, bytes] = {}
        #: guests this process compiled (the rest it read from another worker's build, or its memo)
        self.builds = 0

    def _key(self, sources: list[Path], options: dict[str, Any]) -> str:
        digest = hashlib.sha256()
        for path in [*sources, sdk_dir() / "c" / "tensorwasm.h", sdk_dir() / "zig" / "tensorwasm.zig"]:
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        digest.update(repr(sorted(options.items())).encode())
        return digest.hexdigest()

    def build(self, *sources: Path, **options: Any) -> bytes:
        """The module built from ``sources`` with ``build_module`` ``options`` (once per run)."""
        paths = list(sources)
        key = self._key(paths, options)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._built(key, paths, options)
        return found

    def _built(self, key: str, paths: list[Path], options: dict[str, Any]) -> bytes:
        """The run's module for ``key``: read if a worker built it, else built here under its lock."""
        out = self.shared / f"{key[:24]}.wasm"
        with open(self.shared / f"{key[:24]}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another worker building this guest: wait for its module
            if not out.exists():
                build_module(paths, out, **options)  # written whole (a rename) or not at all
                self.builds += 1
            return out.read_bytes()

    def example(self, lang: str, name: str) -> bytes:
        """``sdk/examples/<lang>/<name>.<c|zig>``, built."""
        return self.build(EXAMPLES / lang / f"{name}.{'c' if lang == 'c' else 'zig'}")

    def source(self, name: str, text: str, **options: Any) -> bytes:
        """A guest written by a test (``name`` ends in .c or .zig), built."""
        path = self.workdir / "src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        return self.build(path, **options)
