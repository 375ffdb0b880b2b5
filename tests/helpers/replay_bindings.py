"""Replay calls recorded through the fake driver into the real ``cuda.bindings`` (no GPU needed).

    python -m tests.helpers.replay_bindings RECORD_DIR    -> one JSON line: calls, names, failures,
                                                             the bindings' version
    python -m tests.helpers.replay_bindings --serve       -> the same for each RECORD_DIR read from stdin,
                                                             one JSON line each, until stdin closes
    python -m tests.helpers.replay_bindings --prepare     -> install the other major (below), once

Both cuda-bindings majors the project supports (12.x and 13.x, shared.cuda_compat) are replayed
into: the environment's own (``pip install -e .`` resolves cuda-bindings 13, ``.[cuda12]`` 12.9)
and the other one, installed on first use with ``pip install --target`` into a directory beside
the virtual environment (``<venv>/twt-cuda12`` or ``twt-cuda13``) by make's install step
(``--prepare``), or by the first replay that needs it where make did not run (a file lock makes
concurrent test workers install it once). Both import without a GPU: the replay runs in a child process whose ``PYTHONPATH`` puts that directory first
(:func:`bindings_path`). :data:`OTHER_MAJOR_SPEC` names the release each major installs.

The real bindings convert every argument (handles, structs, enums, buffers,
kernel parameter tuples) *before* they load libcuda / libnvrtc, so a call
whose arguments the real binding would refuse raises ``TypeError`` /
``ValueError`` / ``OverflowError`` here, while a well-typed call gets as far
as the library loader. To make that loader fail the same way on every
machine (and never let a fake handle reach a real library), this process
replaces cuda.pathfinder's loader before the bindings are imported.

Fake objects are translated to their real counterparts by type name: a
handle to the real handle of the same value, a struct field by field, an
enum member by value, a recorded buffer to a buffer of the same kind.

cuBLAS calls recorded through :class:`tests.helpers.fake_cublas.CublasRecorder`
(``*.cublas`` files) are replayed into the real ``nvmath.bindings.cublas``
the same way (its Cython wrappers convert every argument before they load
libcuda), when nvmath-python is installed and no libcuda is loadable here
(nvmath loads libcuda itself, with no hook to block it: a fake handle must
never reach a real cuBLAS). Otherwise the result says why it was skipped.
"""

from __future__ import annotations

import enum
import fcntl
import json
import os
import pickle
import select
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import IO, Any

REFUSED = (TypeError, ValueError, OverflowError, AttributeError, BufferError)
#: what ``pip install --target`` installs for a major the environment does not have
OTHER_MAJOR_SPEC = {12: "cuda-bindings==12.9.*", 13: "cuda-bindings>=13,<14"}
_DONE = ".twt-complete"  # written last: a directory without it is an interrupted install
PIP_TIMEOUT_S = 600


def installed_major() -> int | None:
    """The cuda-bindings major this interpreter imports by default (None: none installed)."""
    from tests.helpers.fake_cuda import installed_bindings_major

    return installed_bindings_major()


def _target(major: int) -> Path:
    """Where the other major lives: beside the virtual environment (its lifetime), else the user's cache."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / f"twt-cuda{major}"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "twt" / f"cuda{major}"


def bindings_path(major: int) -> Path | None:
    """The ``PYTHONPATH`` entry that makes ``cuda.bindings`` that major: None for the environment's own,
    else the installed target directory (installed now, under a lock, when missing).

    Raises ``RuntimeError`` with pip's own words when it cannot be installed (no network to the
    package index, say): the replay into that major is part of ``make test``, never skipped quietly.
    """
    if major not in OTHER_MAJOR_SPEC:
        raise ValueError(f"cuda-bindings major {major} is not one the project supports ({sorted(OTHER_MAJOR_SPEC)})")
    if installed_major() == major:
        return None
    target = _target(major)
    if (target / _DONE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second test worker waits here, then finds it done
        if (target / _DONE).exists():
            return target
        staging = target.parent / f".{target.name}.tmp{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                               "--no-input", "--target", str(staging), OTHER_MAJOR_SPEC[major]],
                              capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
        if proc.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise RuntimeError(f"pip install --target {staging} {OTHER_MAJOR_SPEC[major]} failed "
                               f"(exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-2000:]}")
        shutil.rmtree(target, ignore_errors=True)
        os.rename(staging, target)
        (target / _DONE).write_text(OTHER_MAJOR_SPEC[major] + "\n")
    return target


def replay_env(major: int, root: Path) -> dict[str, str]:
    """The environment of a replay child process that imports cuda-bindings ``major``.

    The other major comes from make's install step (``--prepare``); where that step has not run
    (a suite started without make), the same ``--prepare`` runs here, in a child process, once.
    """
    extra: Path | None = None
    if installed_major() != major:
        extra = _target(major)
        if not (extra / _DONE).exists():
            proc = subprocess.run([sys.executable, "-m", "tests.helpers.replay_bindings", "--prepare"],
                                  capture_output=True, text=True, timeout=PIP_TIMEOUT_S + 60, cwd=root, check=False)
            if proc.returncode != 0 or not (extra / _DONE).exists():
                raise RuntimeError(f"cuda-bindings {major}.x for the replay could not be installed: "
                                   f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
    path = [str(p) for p in (extra, root) if p is not None]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def _block_library_loading() -> None:
    import cuda.pathfinder as pathfinder
    import cuda.pathfinder._dynamic_libs.load_nvidia_dynamic_lib as loader

    def blocked(libname: str, *args: Any, **kwargs: Any) -> Any:
        raise pathfinder.DynamicLibNotFoundError(f"{libname}: library loading blocked for the replay")

    pathfinder.load_nvidia_dynamic_lib = blocked
    loader.load_nvidia_dynamic_lib = blocked


def _translate(value: Any, drv: Any, nvrtc: Any) -> Any:
    from tests.helpers import fake_cuda as fake

    if isinstance(value, fake.Buf):
        return value.rebuild()
    if isinstance(value, enum.IntEnum) and type(value).__module__ == fake.__name__:
        real_enum = getattr(drv, type(value).__name__, None) or getattr(nvrtc, type(value).__name__)
        return real_enum(int(value))
    if isinstance(value, (fake._Handle, fake._Value)):
        cls = getattr(drv, type(value).__name__, None) or getattr(nvrtc, type(value).__name__)
        return cls(int(value))
    if isinstance(value, fake._Struct):
        real = getattr(drv, type(value).__name__)()
        for name in type(value)._fields:
            setattr(real, name, _translate(getattr(value, name), drv, nvrtc))
        return real
    if isinstance(value, tuple):
        return tuple(_translate(v, drv, nvrtc) for v in value)
    if isinstance(value, list):
        return [_translate(v, drv, nvrtc) for v in value]
    return value


def load_records(record_dir: str, suffix: str = ".calls") -> list[tuple[str, tuple[Any, ...]]]:
    records: list[tuple[str, tuple[Any, ...]]] = []
    for entry in sorted(os.listdir(record_dir)):
        if not entry.endswith(suffix):
            continue
        with open(os.path.join(record_dir, entry), "rb") as f:
            while True:
                try:
                    records.append(pickle.load(f))
                except EOFError:
                    break
    return records


def replay(records: list[tuple[str, tuple[Any, ...]]]) -> dict[str, Any]:
    """Call the real binding with each record's arguments; collect the ones it refuses."""
    _block_library_loading()
    import cuda.bindings
    from cuda.bindings import driver as drv
    from cuda.bindings import nvrtc

    failures: list[str] = []
    names: set[str] = set()
    for name, args in records:
        names.add(name)
        fn = getattr(nvrtc if name.startswith("nvrtc") else drv, name, None)
        if fn is None:
            failures.append(f"{name}: no such function in the real bindings")
            continue
        try:
            real_args = _translate(args, drv, nvrtc)
        except REFUSED as exc:
            failures.append(f"{name}: argument not representable in the real bindings: {type(exc).__name__}: {exc}")
            continue
        try:
            fn(*real_args)
        except REFUSED as exc:
            shapes = ", ".join(type(a).__name__ for a in args)
            failures.append(f"{name}({shapes}): {type(exc).__name__}: {exc}")
        except RuntimeError:
            pass  # the library loader: the arguments were accepted
    return {"calls": len(records), "names": sorted(names), "failures": failures,
            "bindings_version": cuda.bindings.__version__}


def _libcuda_loadable() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def replay_cublas(records: list[tuple[str, tuple[Any, ...]]]) -> dict[str, Any]:
    """Call the real ``nvmath.bindings.cublas`` with each record's arguments; the ones it refuses.

    ``{"skipped": why}`` when nvmath-python is not installed or libcuda is
    loadable (the call would reach a real cuBLAS with fake handles).
    """
    try:
        import nvmath.bindings.cublas as cublas
    except Exception as exc:  # noqa: BLE001 - not installed here (it is the cuda extra's)
        return {"skipped": f"nvmath.bindings.cublas not importable: {type(exc).__name__}: {exc}"}
    if _libcuda_loadable():
        return {"skipped": "libcuda is loadable here: a replayed call would reach the real cuBLAS"}
    from cuda.bindings import driver as drv
    from cuda.bindings import nvrtc

    failures: list[str] = []
    outcomes: list[str] = []  # per record: "accepted" or the exception's type name
    names: set[str] = set()
    for name, args in records:
        names.add(name)
        fn = getattr(cublas, name, None)
        if fn is None:
            failures.append(f"{name}: no such function in nvmath.bindings.cublas")
            outcomes.append("missing")
            continue
        try:
            fn(*_translate(args, drv, nvrtc))  # a fake CUstream becomes the real one
        except REFUSED as exc:
            shapes = ", ".join(type(a).__name__ for a in args)
            failures.append(f"{name}({shapes}): {type(exc).__name__}: {exc}")
            outcomes.append(type(exc).__name__)
        except RuntimeError:
            outcomes.append("accepted")  # nvmath's loader (no libcuda): the arguments were accepted
    return {"calls": len(records), "names": sorted(names), "failures": failures, "outcomes": outcomes}


def replay_dir(record_dir: str) -> dict[str, Any]:
    """Both replays of one record directory: the driver's and NVRTC's calls, and cuBLAS's."""
    result = replay(load_records(record_dir))
    result["cublas"] = replay_cublas(load_records(record_dir, ".cublas"))
    return result


def serve(requests: IO[str], answers: IO[str]) -> None:
    """One :func:`replay_dir` per line of ``requests`` (a record directory), one JSON line each on
    ``answers`` (``{"error": traceback}`` for a replay that raised), until ``requests`` ends.

    Why a server: each replay in a fresh interpreter paid the bindings' imports (~1.2 s of CPU), and
    a test module replays a dozen times into each major. A replay keeps no state between directories:
    every call converts its arguments before the (blocked) library loader, in the first replay of a
    process as in the tenth - the controls that replay wrongly typed calls (tests/worker/backends/
    test_replay_bindings.py) run in the same server after the others, so they would see it if not."""
    for line in requests:
        record_dir = line.rstrip("\n")
        try:
            answer = replay_dir(record_dir)
        except Exception:  # noqa: BLE001 - one answer per request either way
            answer = {"error": traceback.format_exc()}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


class Replayer:
    """A ``--serve`` child for cuda-bindings ``major`` (:func:`replay_env`), kept for many replays."""

    def __init__(self, major: int, root: Path) -> None:
        self.major = major
        self._err = tempfile.TemporaryFile()  # a file, not a pipe: nobody has to drain it
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.replay_bindings", "--serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, bufsize=0,
                                     cwd=root, env=replay_env(major, root))
        self._pending = b""

    def replay(self, record_dir: Path, timeout_s: float) -> dict[str, Any]:
        """What ``python -m tests.helpers.replay_bindings RECORD_DIR`` prints, from the server;
        RuntimeError (with the server's stderr) when it died or did not answer within ``timeout_s``."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(os.fsencode(record_dir) + b"\n")
        except BrokenPipeError:
            raise RuntimeError(f"the replay server ended: {self._stderr()}") from None
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise RuntimeError(f"the replay server did not answer within {timeout_s:g} s: {self._stderr()}")
            data = os.read(fd, 1 << 16)
            if not data:
                raise RuntimeError(f"the replay server ended: {self._stderr()}")
            self._pending += data
        line, self._pending = self._pending.split(b"\n", 1)
        result: dict[str, Any] = json.loads(line)
        if "error" in result:
            raise RuntimeError(f"the replay raised: {result['error']}")
        return result

    def _stderr(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-3000:]

    def close(self) -> None:
        """End the server (its stdin closed) and reap it; killed if it does not end in 30 s."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._err.close()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        serve(sys.stdin, sys.stdout)
        return 0
    if argv[:1] == ["--prepare"]:  # make's install step: the major this environment lacks, installed once
        for major in OTHER_MAJOR_SPEC:
            where = bindings_path(major)
            if where is not None:
                print(f"cuda-bindings {major}.x for the replay test: {where}")
        return 0
    print(json.dumps(replay_dir(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
