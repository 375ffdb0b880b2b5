"""Compiling a tenant's module within its run's deadline, and the per-worker cache of results.

Compile time is outside fuel and epochs, and it is superlinear in some
shapes: one function with 16,000 locals live across calls takes seconds, a
2 MiB module of them a minute (``tests/helpers/wasm_bombs.py``). So:

* :func:`compile_bounded` compiles on a thread of its own (wasmtime releases
  the GIL) while the caller waits until the run's deadline; past it,
  :class:`CompileOverrun` (a ``KernelTimeout``). The compiler cannot be
  stopped from outside: the worker answers the run and exits
  (``shared.exitcodes.WORKER_COMPILE_OVERRUN``), and the supervisor restarts
  the instance. The engine compiles on one core (no parallel compilation).
* :class:`ModuleCache` is the worker's (one tenant instance's) compile cache,
  keyed by the sha256 the worker computed itself, bounded in entries and in
  module bytes: least recently used first out.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

import wasmtime

from shared.errors import KernelTimeout

__all__ = ["CACHE_BYTES", "CACHE_ENTRIES", "CompileOverrun", "ModuleCache", "compile_bounded"]

#: compiled modules kept per worker (LRU)
CACHE_ENTRIES = 64
#: the compile-cache budget of a worker (one tenant instance): module bytes cached, LRU beyond
CACHE_BYTES = 64 << 20


class CompileOverrun(KernelTimeout):
    """Compiling took longer than the run's deadline. The compiler cannot be
    stopped from outside, so the worker answers this and exits (the
    supervisor restarts the instance): ``shared.exitcodes.WORKER_COMPILE_OVERRUN``."""


def compile_bounded(engine: wasmtime.Engine, wasm: bytes, deadline: float | None) -> wasmtime.Module:
    """``wasmtime.Module(engine, wasm)``, waited for until ``deadline`` (``time.monotonic()``)
    at most; :class:`CompileOverrun` past it (the compile thread keeps running)."""
    if deadline is None:
        return wasmtime.Module(engine, wasm)
    out: list[wasmtime.Module | BaseException] = []
    done = threading.Event()

    def work() -> None:
        try:
            out.append(wasmtime.Module(engine, wasm))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            out.append(exc)
        finally:
            done.set()

    threading.Thread(target=work, name="twt-wasm-compile", daemon=True).start()
    left = deadline - time.monotonic()
    if not done.wait(max(left, 0.0)):
        raise CompileOverrun(
            round(max(left, 0.0), 3),
            message=f"compiling the module ({len(wasm):,} B) did not finish within the run's deadline; "
            "the worker is restarted to stop the compiler",
        )
    if isinstance(out[0], BaseException):
        raise out[0]
    module: wasmtime.Module = out[0]
    return module


class _Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


M = TypeVar("M", bound=_Sized)


class ModuleCache(Generic[M]):
    """Compiled modules by digest, at most ``entries`` of them and ``max_bytes`` of module bytes."""

    def __init__(self, entries: int = CACHE_ENTRIES, max_bytes: int = CACHE_BYTES) -> None:
        self.entries = entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._modules: OrderedDict[str, M] = OrderedDict()

    def get(self, digest: str) -> M | None:
        found = self._modules.get(digest)
        if found is not None:
            self._modules.move_to_end(digest)
        return found

    def peek(self, digest: str) -> M | None:
        """The cached module, without counting it as used (an export reads them all)."""
        return self._modules.get(digest)

    def put(self, digest: str, module: M) -> None:
        """Keep ``module`` (unless it alone is over the byte budget), evicting the least recent."""
        if module.nbytes > self.max_bytes or digest in self._modules:
            return
        self._modules[digest] = module
        self.bytes += module.nbytes
        while len(self._modules) > self.entries or self.bytes > self.max_bytes:
            _, old = self._modules.popitem(last=False)
            self.bytes -= old.nbytes

    def clear(self) -> None:
        self._modules.clear()
        self.bytes = 0

    def __contains__(self, digest: object) -> bool:
        return digest in self._modules

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)
