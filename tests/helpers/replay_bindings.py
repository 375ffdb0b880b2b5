"""Replay calls recorded through the fake driver into the real ``cuda.bindings`` (no GPU needed).

    python -m tests.helpers.replay_bindings RECORD_DIR    -> one JSON line: calls, names, failures

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
import json
import os
import pickle
import sys
from typing import Any

REFUSED = (TypeError, ValueError, OverflowError, AttributeError, BufferError)


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
    return {"calls": len(records), "names": sorted(names), "failures": failures}


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


def main(argv: list[str]) -> int:
    result = replay(load_records(argv[0]))
    result["cublas"] = replay_cublas(load_records(argv[0], ".cublas"))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
