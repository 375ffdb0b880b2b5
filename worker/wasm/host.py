"""The WASM host of one worker: engine, epoch ticker, compiled-module cache, armed stores.

    run_wasm(body, export, args, fuel, timeout_s)
      │ compile(body)       sha256 -> CompiledModule (LRU); WAT or binary; imports checked:
      │                     only ``tensorwasm`` functions of the exact ABI types and WASI
      │                     preview 1 without sockets (worker.wasm.wasi), else WasmCompile
      │ reserve memory      linear-memory cap = min(spec.wasm_max_memory_bytes, the module's
      │                     declared max, the tenant's free CPU quota), consumed from the CPU
      │                     quota for the run (block.consume_bytes) and released after it
      │ Store               set_limits(memory_size=cap, memories=1, instances=1, tables, elements)
      │                     set_fuel(fuel); set_epoch_deadline(ticks of the one ticker thread)
      │                     a WASI module's store: a WasiConfig reaching nothing of the host
      │ instantiate + call  host imports (worker.wasm.abi) on the tenant's allocator/backend;
      │                     a reactor's ``_initialize`` once, then the export; stdout/stderr
      │                     line by line into the run's logs; ``proc_exit(n)`` -> exit_code n
      ▼ finally             free the run's buffers, release the reservation, drop the store
    {results, fuel_used, elapsed_s, ..., exit_code}  |  WasmCompile / WasmTrap(trap_code) / KernelTimeout

One engine per worker, created here - in the worker, after the spawn or
fork, never inherited. Compiled modules stay in memory as ``wasmtime.Module``
objects, keyed by the sha256 of the bytes the worker itself received and
hashed. The one thing deserialized is an artifact of this same tenant, which
a worker of this tenant serialized before it was parked
(:mod:`worker.wasm.artifacts`: the trust boundary is the tenant).

Why reserve the whole linear-memory cap up front: wasmtime-py exposes no
growth callback (``ResourceLimiter`` is Rust-only), and ``memory.grow`` runs
inside guest code with no host call to meter it. So the cap *is* the charge:
the store's limiter makes ``memory.grow`` past it return -1, and the same
number of bytes is held in the tenant's CPU quota until the run ends. A
module that declares a maximum (``(memory 1 4)``) is charged only that.

Host imports use wasmtime's *unchecked* function ABI when the binding
exposes it (one ctypes callback reading raw values: ~0.5 us a call against
~9 us through ``Linker.define_func``'s generic trampoline, measured on the
dev box); the public path is the fallback and is tested too.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import platform
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType
from typing import Any, Final, TypeVar, cast

import msgpack
import wasmtime

from shared.checks import is_int
from shared.errors import (
    InvalidArgument,
    KernelTimeout,
    MemoryExhausted,
    WasmCompile,
    WasmTrap,
)
from shared.frames import encode_worker_reply
from shared.log import get_logger, log_event
from shared.spec import TenantSpec
from shared.sizes import MAX_MODULE_BYTES  # the largest module body the worker compiles
from worker.context import TenantContext
from worker.priority import name_thread, start_thread
from worker.wasm.abi import (
    HANDLERS,
    IMPORT_MODULE,
    IMPORTS,
    MAX_LOG_BYTES,
    ErrorCode,
    GuestRun,
    LogLimiter,
    NoGuestMemory,
    guest_view,
)
from worker.wasm.compiler import CACHE_BYTES, CACHE_ENTRIES, CompileOverrun, ModuleCache, compile_bounded
from worker.wasm.wasi import (
    WASI_FUNCTIONS,
    WASI_MODULE,
    WASI_REFUSED,
    OutputLines,
    OutputStopped,
    define_wasi,
    wasi_config,
)

__all__ = ["WARM_UP_WAT", "CompiledModule", "EpochTicker", "GuestExit", "WasmHost", "WasmSession", "engine_fingerprint",
           "pool_warm_up"]

T = TypeVar("T")

_log = get_logger("worker.wasm")

PAGE = 65536
#: export arguments a run may pass
MAX_ARGS = 64
#: per-store limits besides memory: a few tables of bounded size, one instance
MAX_TABLES = 4
MAX_TABLE_ELEMENTS = 100_000
#: default epoch tick: the resolution of deadlines
TICK_S = 0.01
_INTERNAL = int(ErrorCode.INTERNAL)
_KINDS = {"i32", "i64", "f32", "f64"}


#: frames a trap's location names (innermost first); deeper ones are counted, not listed
MAX_TRAP_FRAMES = 4


#: every engine setting of ours that is not wasmtime's default: part of the artifact fingerprint
_CONFIG_FLAGS: dict[str, bool] = {
    "consume_fuel": True,
    "epoch_interruption": True,
    # Only what the ABI needs: 32-bit memories, no shared memory or threads,
    # no GC heaps (outside the memory limit), one memory per module.
    "wasm_threads": False,
    "shared_memory": False,
    "wasm_memory64": False,
    "wasm_multi_memory": False,
    "wasm_gc": False,
    "wasm_function_references": False,
    "wasm_exceptions": False,
    "wasm_stack_switching": False,
    "wasm_component_model": False,
    "wasm_custom_page_sizes": False,
    # A compile bomb (a small module that takes minutes to compile) may use one
    # core, not all of them; its time is bounded by the run's deadline (compile()).
    "parallel_compilation": False,
}


def _config() -> wasmtime.Config:
    # A trap's backtrace with file:line from the module's DWARF (a debug build's): wasmtime reads
    # this when the engine is made. Modules without DWARF pay nothing; an operator may set it to 0.
    os.environ.setdefault("WASMTIME_BACKTRACE_DETAILS", "1")
    cfg = wasmtime.Config()
    for name, value in _CONFIG_FLAGS.items():
        setattr(cfg, name, value)
    return cfg


@functools.lru_cache(maxsize=1)
def engine_fingerprint() -> str:
    """What a serialized module depends on: the wasmtime release, our engine settings and the
    machine. An artifact stored under another fingerprint is never deserialized (a wasmtime
    upgrade or a settings change makes every stored artifact stale; they are compiled again)."""
    try:
        version = importlib.metadata.version("wasmtime")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    described = json.dumps({"wasmtime": version, "machine": platform.machine(), "flags": _CONFIG_FLAGS,
                            "backtrace_details": os.environ.get("WASMTIME_BACKTRACE_DETAILS", "1")},
                           sort_keys=True)
    return hashlib.sha256(described.encode()).hexdigest()[:32]


# ------------------------------------------------------------------ ticker


class EpochTicker:
    """The worker's one epoch thread: bumps the engine's epoch every ``tick_s`` while a run is active.

    Idle workers pay nothing: the thread sleeps on a condition until a run
    starts. Deadlines are ``ceil(timeout / tick) + 1`` ticks, so a run is
    never stopped early; a loaded machine can only make ticks (and the stop)
    late.
    """

    def __init__(self, engine: wasmtime.Engine, tick_s: float = TICK_S) -> None:
        self.engine = engine
        self.tick_s = tick_s
        self._cond = threading.Condition()
        self._active = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.ticks = 0

    def deadline_ticks(self, timeout_s: float) -> int:
        return max(1, math.ceil(timeout_s / self.tick_s)) + 1

    def acquire(self) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError("epoch ticker is closed")
            self._active += 1
            self._start_locked()
            self._cond.notify()

    def prestart(self) -> None:
        """Start the (idle) thread now, ahead of the first run: starting a thread waits for it to
        be scheduled, which a loaded host makes the first run's slowest step (a run soon follows
        an activation that loaded compiled modules)."""
        with self._cond:
            if not self._stopping:
                self._start_locked()

    def _start_locked(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="twt-wasm-epoch", daemon=True)
            start_thread(self._thread)  # the worker's normal priority, above its guest's

    def release(self) -> None:
        with self._cond:
            self._active -= 1

    def _loop(self) -> None:
        name_thread()
        cond = self._cond
        while True:
            with cond:
                while self._active == 0 and not self._stopping:
                    cond.wait()
                if self._stopping:
                    return
                cond.wait(self.tick_s)  # woken early only by close() or another acquire
                if self._stopping:
                    return
                if self._active == 0:
                    continue  # the run ended during this tick: no trailing tick while idle
            self.engine.increment_epoch()
            self.ticks += 1

    def expire(self, ticks: int) -> None:
        """Move the epoch ``ticks`` on at once: the running store, whose deadline is at most that
        far, traps at its next check (a run refused device time stops instead of spinning)."""
        for _ in range(ticks + 1):
            self.engine.increment_epoch()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=2.0)


# ------------------------------------------------------------------ modules


@dataclass(frozen=True)
class CompiledModule:
    """A validated, linked-ahead module: what the cache holds."""

    digest: str
    module: wasmtime.Module
    pre: wasmtime.InstancePre
    #: (min pages, max pages or None) of the module's own memory; None: no memory
    memory: tuple[int, int | None] | None
    nbytes: int
    compile_s: float
    exports: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = field(default_factory=dict)
    #: imports WASI preview 1: its store gets a WASI context (worker.wasm.wasi)
    wasi: bool = False
    #: function index -> export name: what a trap's frame is called when the module has no name section
    export_names: dict[int, str] = field(default_factory=dict)
    #: deserialized from a stored artifact rather than compiled here (not exported again)
    from_artifact: bool = False
    #: the module's binary (its WAT text assembled), kept with a module compiled here: an export
    #: hands it over with the artifact (:func:`pack_artifact`), so a load assembles no text again
    wasm: bytes = b""


#: what begins an exported artifact that carries its module's binary (:func:`pack_artifact`); an
#: artifact without it is wasmtime's serialized module alone (its binary is assembled at its load)
ARTIFACT_MAGIC_V1: Final = b"\0twtart1"
#: ... and one that also carries the module's interface, read once where it was compiled
ARTIFACT_MAGIC: Final = b"\0twtart2"
_ARTIFACT_HEAD: Final = len(ARTIFACT_MAGIC) + 4
#: the most names an artifact's interface may list (imports, exports, frame names: each)
_MAX_INTERFACE_NAMES: Final = 100_000



def pack_artifact(serialized: bytes, wasm: bytes) -> bytes:
    """An exported artifact: the serialized module, the module's interface (its imports, its
    exported functions' types, their names by index, its memory: read from ``wasm`` once, here,
    at the park) and the module's binary. A load takes the interface as it is rather than
    reading it from the binary again (the probe guest: ~22 us against ~137 us, on a load that
    runs between the request that woke a tenant and its first ``run_wasm``); the binary stays
    for an interface that does not read back. Assembling a WAT module's text again at the load
    cost 0.6-1.2 ms of its ~1.5 ms before the binary was carried. Neither is more trusted than
    the artifact beside it: all come from a worker of the same tenant (see worker.wasm.artifacts).
    A module whose interface this reader does not follow is packed without one (format 1)."""
    try:
        names: dict[int, str] = {}
        imports, exports = module_interface(wasm, names)
        meta: bytes = msgpack.packb([[list(i) for i in imports],
                              [[name, list(kinds[0]), list(kinds[1])] for name, kinds in exports.items()],
                              [[index, name] for index, name in names.items()],
                              list(memory) if (memory := memory_limits(wasm)) is not None else None])
    except (ValueError, KeyError, IndexError, UnicodeDecodeError):
        return ARTIFACT_MAGIC_V1 + len(serialized).to_bytes(4, "little") + serialized + wasm
    return (ARTIFACT_MAGIC + len(serialized).to_bytes(4, "little") + serialized
            + len(meta).to_bytes(4, "little") + meta + wasm)


def artifact_parts(artifact: bytes) -> tuple[bytes, bytes | None, bytes | None]:
    """(serialized module, module binary, interface) of an artifact: the binary None for one
    without it (stored before artifacts carried it), the interface None for one without it
    (format 1, or none). ValueError when the lengths do not add up."""
    if artifact.startswith(ARTIFACT_MAGIC):
        versioned = True
    elif artifact.startswith(ARTIFACT_MAGIC_V1):
        versioned = False
    else:
        return artifact, None, None
    n = int.from_bytes(artifact[len(ARTIFACT_MAGIC):_ARTIFACT_HEAD], "little")
    end = _ARTIFACT_HEAD + n
    if len(artifact) < _ARTIFACT_HEAD or end >= len(artifact):
        raise ValueError("the artifact's parts do not add up to its length")
    meta = None
    if versioned:
        m = int.from_bytes(artifact[end:end + 4], "little")
        if len(artifact) < end + 4 or end + 4 + m >= len(artifact):
            raise ValueError("the artifact's parts do not add up to its length")
        meta, end = artifact[end + 4:end + 4 + m], end + 4 + m
    return artifact[_ARTIFACT_HEAD:_ARTIFACT_HEAD + n], artifact[end:], meta


def unpack_artifact(artifact: bytes) -> tuple[bytes, bytes | None]:
    """(serialized module, module binary) of an artifact; the binary None for an artifact
    without one (stored before artifacts carried it). ValueError when the lengths do not add up."""
    serialized, wasm, _ = artifact_parts(artifact)
    return serialized, wasm


def read_interface(meta: bytes) -> Interface:
    """An artifact's interface (:func:`pack_artifact`), checked for shape: ValueError (or
    TypeError) for anything else - the load then reads the module's binary instead."""
    data = msgpack.unpackb(meta, use_list=True, max_str_len=1 << 16, max_bin_len=0, max_ext_len=0,
                           max_array_len=_MAX_INTERFACE_NAMES, max_map_len=0)
    imports_raw, exports_raw, names_raw, memory_raw = data
    imports = [(module, name) for module, name in imports_raw]
    exports: ExportTypes = {name: (tuple(params), tuple(results)) for name, params, results in exports_raw}
    names = {index: name for index, name in names_raw}
    # one pass of set checks, not a check per element: this runs in front of a woken tenant's first run
    strings = {type(x) for pair in imports for x in pair} | {type(x) for x in exports} | {type(x) for x in names.values()}
    kinds = {k for params, results in exports.values() for k in params + results}
    if not strings <= {str} or not kinds <= _KIND_NAMES or not {type(i) for i in names} <= {int}:
        raise ValueError("an artifact's interface names strings, value types and function indexes only")
    memory: tuple[int, int | None] | None = None
    if memory_raw is not None:
        low, high = memory_raw
        if not (is_int(low) and (high is None or is_int(high))):
            raise ValueError("a memory's limits are pages")
        memory = (low, high)
    return imports, exports, names, memory


def _export_types(module: wasmtime.Module) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Each exported function's (param kinds, result kinds)."""
    return {
        e.name: (_valtypes(e.type.params), _valtypes(e.type.results))
        for e in module.exports
        if isinstance(e.type, wasmtime.FuncType)
    }


def _digest_within_limits(body: bytes | bytearray | memoryview) -> str:
    """The sha256 of a module body within the size limits, else WasmCompile."""
    if len(body) > MAX_MODULE_BYTES:
        raise WasmCompile(f"module of {len(body):,} B is larger than the {MAX_MODULE_BYTES:,} B limit")
    if not len(body):
        raise WasmCompile("empty module")
    return hashlib.sha256(body).hexdigest()


def _binary(body: bytes | bytearray | memoryview) -> bytes:
    """The module's binary: ``body`` itself, or its WAT text assembled (WasmCompile if neither)."""
    wasm = bytes(body)
    if wasm.startswith(b"\0asm"):
        return wasm
    try:
        text = wasm.decode("utf-8")
    except UnicodeDecodeError:
        raise WasmCompile("neither a WebAssembly binary (no \\0asm magic) nor UTF-8 WAT text") from None
    try:
        return bytes(wasmtime.wat2wasm(text))
    except wasmtime.WasmtimeError as exc:
        raise WasmCompile(f"WAT does not parse: {_wat_error(str(exc))}") from None


class GuestExit(Exception):
    """The guest called WASI ``proc_exit(code)``: the run ends there, with ``code`` in the reply."""

    def __init__(self, code: int) -> None:
        super().__init__(f"the guest exited with code {code}")
        self.code = code


def _leb_u32(data: bytes, pos: int) -> tuple[int, int]:
    if pos < len(data) and data[pos] < 0x80:  # most numbers in a module (counts, indexes, lengths): one byte
        return data[pos], pos + 1
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 35:
            raise ValueError("truncated or overlong LEB128")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def function_exports(wasm: bytes) -> dict[int, str]:
    """Function index -> export name, from the export section (id 7) of validated bytes; {} when
    the module has none (or, defensively, when the bytes do not parse)."""
    out: dict[int, str] = {}
    try:
        pos = 8
        while pos < len(wasm):
            section = wasm[pos]
            size, pos = _leb_u32(wasm, pos + 1)
            end = pos + size
            if section == 7:
                count, p = _leb_u32(wasm, pos)
                for _ in range(count):
                    length, p = _leb_u32(wasm, p)
                    name = bytes(wasm[p : p + length]).decode("utf-8", errors="replace")
                    kind = wasm[p + length]
                    index, p = _leb_u32(wasm, p + length + 1)
                    if kind == 0:
                        out.setdefault(index, name)
                return out
            pos = end
    except (ValueError, IndexError):
        return {}
    return out


#: value type encodings (what ``str(wasmtime.ValType)`` calls them): the engine's settings allow no others
_VALTYPE_CODES: Final = {0x7F: "i32", 0x7E: "i64", 0x7D: "f32", 0x7C: "f64", 0x7B: "v128",
                         0x70: str(wasmtime.ValType.funcref()), 0x6F: str(wasmtime.ValType.externref())}

ExportTypes = dict[str, tuple[tuple[str, ...], tuple[str, ...]]]
#: every value type's name an interface may hold (what the reader of a module's bytes gives)
_KIND_NAMES: Final = frozenset(_VALTYPE_CODES.values())
#: what a load needs of a module besides its compiled code: its imports (module, name), its
#: exported functions' (param kinds, result kinds), the name of each exported function's index
#: (a trap's frames) and its memory's (min, max) pages
Interface = tuple[list[tuple[str, str]], ExportTypes, dict[int, str], "tuple[int, int | None] | None"]


def _name(data: bytes, pos: int) -> tuple[str, int]:
    n, pos = _leb_u32(data, pos)
    if pos + n > len(data):
        raise ValueError("a name runs past the end of the module")
    return data[pos:pos + n].decode("utf-8"), pos + n


def _limits(data: bytes, pos: int) -> tuple[int, int | None, int]:
    """A table's or memory's limits at ``pos``: (min, max or None, the position after them)."""
    flags = data[pos]
    minimum, pos = _leb_u32(data, pos + 1)
    maximum = None
    if flags & 1:
        maximum, pos = _leb_u32(data, pos)
    return minimum, maximum, pos


def _skip_limits(data: bytes, pos: int) -> int:
    return _limits(data, pos)[2]


def _sections(wasm: bytes) -> Iterator[tuple[int, int]]:
    """Each section of a module's bytes: (its id, where its contents start). ``ValueError`` for a
    section that runs past the end."""
    pos = 8
    while pos < len(wasm):
        section = wasm[pos]
        size, pos = _leb_u32(wasm, pos + 1)
        end = pos + size
        if end > len(wasm):
            raise ValueError("section runs past the end of the module")
        yield section, pos
        pos = end


def module_interface(wasm: bytes, names: dict[int, str] | None = None) -> tuple[list[tuple[str, str]], ExportTypes]:
    """Every import's (module, name) and each exported function's (param kinds, result kinds),
    read from the type, import, function and export sections of bytes wasmtime has validated;
    ``names`` given, also what :func:`function_exports` reads, in the same pass.

    What an artifact's load needs of its module, without asking the wasmtime binding for each
    import and export (a Python object and a C call per name and per type: most of a load's
    time, and the load of a woken tenant's modules delays its first run). ValueError (or
    KeyError, IndexError) on anything unexpected: the caller then asks the binding."""
    types: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    imports: list[tuple[str, str]] = []
    func_types: list[int] = []  # type index of each function, imported ones first
    exports: ExportTypes = {}
    for section, p in _sections(wasm):
        if section == 1:
            count, p = _leb_u32(wasm, p)
            for _ in range(count):
                if wasm[p] != 0x60:
                    raise ValueError("not a function type")
                n, p = _leb_u32(wasm, p + 1)
                params = tuple(_VALTYPE_CODES[b] for b in wasm[p:p + n])
                n, p = _leb_u32(wasm, p + n)
                results = tuple(_VALTYPE_CODES[b] for b in wasm[p:p + n])
                p += n
                types.append((params, results))
        elif section == 2:
            count, p = _leb_u32(wasm, p)
            for _ in range(count):
                module, p = _name(wasm, p)
                name, p = _name(wasm, p)
                kind = wasm[p]
                p += 1
                imports.append((module, name))
                if kind == 0:
                    index, p = _leb_u32(wasm, p)
                    func_types.append(index)
                elif kind == 1:  # a table: its element type, then its limits
                    p = _skip_limits(wasm, p + 1)
                elif kind == 2:
                    p = _skip_limits(wasm, p)
                elif kind == 3:  # a global: its type and mutability
                    p += 2
                else:
                    raise ValueError(f"import kind {kind}")
        elif section == 3:
            count, p = _leb_u32(wasm, p)
            for _ in range(count):
                index, p = _leb_u32(wasm, p)
                func_types.append(index)
        elif section == 7:
            count, p = _leb_u32(wasm, p)
            for _ in range(count):
                name, p = _name(wasm, p)
                kind = wasm[p]
                index, p = _leb_u32(wasm, p + 1)
                if kind == 0:
                    exports[name] = types[func_types[index]]
                    if names is not None:
                        names.setdefault(index, name)
    return imports, exports


def memory_limits(wasm: bytes) -> tuple[int, int | None] | None:
    """(min, max) pages of the module's defined memory, from its memory section (id 5).

    Called only on bytes wasmtime has already validated (32-bit memories,
    at most one, not shared), so the layout is known good; a malformed
    section still fails cleanly with ``ValueError``.
    """
    for section, pos in _sections(wasm):
        if section == 5:
            count, p = _leb_u32(wasm, pos)
            if count == 0:
                return None
            minimum, maximum, _ = _limits(wasm, p)
            return minimum, maximum
    return None


def _valtypes(types: Sequence[object]) -> tuple[str, ...]:
    return tuple(str(t) for t in types)


_NOISE = re.compile(r"^(\d+:\s*)?(wasm trap:\s*)?")


def _short(message: str, limit: int = 400) -> str:
    """The informative line of a wasmtime message (its last non-empty line)."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    text = _NOISE.sub("", lines[-1] if lines else message)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_FRAME = re.compile(r"^\s*(\d+):\s+0x[0-9a-f]+ - ")
_AT = re.compile(r"^\s+at (.+):(\d+)(?::(\d+))?\s*$")


def trap_location(trap: wasmtime.Trap, export_names: dict[int, str] | None = None) -> str:
    """The guest's frames of a trap, innermost first: ``crash+0x32 (t.c:3:11) <- run+0x55 (t.c:8:12)``.

    Names and offsets come from wasmtime's frames (a module's name section, else the name a
    function is exported under, else ``func[N]``); ``file:line:col`` from the backtrace text, present when the module carries DWARF (``twt
    build -O debug``) and WASMTIME_BACKTRACE_DETAILS is on (see :func:`_config`). Never raises:
    a location is a courtesy, the trap itself is the error.
    """
    try:
        frames = trap.frames
        lines: dict[int, str] = {}
        current = -1
        for text in str(trap).splitlines():
            m = _FRAME.match(text)
            if m:
                current = int(m[1])
                continue
            at = _AT.match(text)
            if at and current >= 0 and current not in lines:
                where = os.path.basename(at[1]) + ":" + at[2] + (f":{at[3]}" if at[3] else "")
                lines[current] = where
        parts = []
        for i, frame in enumerate(frames[:MAX_TRAP_FRAMES]):
            name = frame.func_name or (export_names or {}).get(frame.func_index) or f"func[{frame.func_index}]"
            part = f"{name}+{frame.func_offset:#x}"
            if i in lines:
                part += f" ({lines[i]})"
            parts.append(part)
        if len(frames) > MAX_TRAP_FRAMES:
            parts.append(f"... {len(frames) - MAX_TRAP_FRAMES} more")
        return _short(" <- ".join(parts), 600) if parts else ""
    except Exception:  # noqa: BLE001 - a location is best effort; the trap is reported either way
        return ""


def _wat_error(message: str) -> str:
    """``expected `)` (line 1, column 14)`` from wat2wasm's multi-line report."""
    first = message.strip().splitlines()[0] if message.strip() else "syntax error"
    where = re.search(r"-->\s*\S*?:(\d+):(\d+)", message)
    return f"{first} (line {where[1]}, column {where[2]})" if where else first


# ------------------------------------------------------------------ imports


def _raw_ffi() -> ModuleType | None:
    """wasmtime's ctypes bindings, if they have what the unchecked import path needs."""
    try:
        from wasmtime import _ffi as ffi
    except ImportError:  # pragma: no cover - layout of another wasmtime-py version
        return None
    needed = (
        "wasmtime_linker_define_func_unchecked",
        "wasmtime_func_unchecked_callback_t",
        "wasmtime_caller_context",
        "wasmtime_memory_data",
        "wasmtime_memory_data_size",
        "wasmtime_val_raw",
    )
    return ffi if all(hasattr(ffi, n) for n in needed) else None


_VALTYPE = {"i32": wasmtime.ValType.i32, "i64": wasmtime.ValType.i64, "f32": wasmtime.ValType.f32}


def _functype(name: str) -> wasmtime.FuncType:
    params, result = IMPORTS[name]
    return wasmtime.FuncType([_VALTYPE[p]() for p in params], [_VALTYPE[result]()])


def _export_ffi() -> tuple[ModuleType, Callable[[Any], Any]] | None:
    """wasmtime's ctypes bindings and its extern wrapper, if they have the by-name export lookup."""
    try:
        from wasmtime import _ffi as ffi
        from wasmtime._extern import wrap_extern
    except ImportError:  # pragma: no cover - layout of another wasmtime-py version
        return None
    if not all(hasattr(ffi, n) for n in ("wasmtime_instance_export_get", "wasmtime_extern_t")):
        return None  # pragma: no cover
    return ffi, wrap_extern


_EXPORT_FFI: Final = _export_ffi()


def instance_export(instance: wasmtime.Instance, store: wasmtime.Store, name: str) -> Any:
    """``instance.exports(store).get(name)``, looked up by name alone: ``Instance.exports`` wraps
    every export of the instance on first use (a C call and a Python object each: 0.3-0.4 ms a run
    for a module of 35 exports, ~40 % of a warm ``run_wasm`` of it in the worker), where a run needs
    two (its memory and the function it calls). None when there is no such export."""
    found = _EXPORT_FFI
    if found is None:  # pragma: no cover - the binding's public path
        return instance.exports(store).get(name)
    ffi, wrap = found
    item = ffi.wasmtime_extern_t()  # a fresh one per export: the wrapper keeps a view into it
    encoded = name.encode()
    if not ffi.wasmtime_instance_export_get(store._context(), ctypes.byref(instance._instance), encoded,
                                           len(encoded), ctypes.byref(item)):
        return None
    return wrap(item)


# ------------------------------------------------------------------ sessions


def _count_dropped(run: GuestRun, n: int) -> None:
    """``n`` guest output lines dropped in bulk (past the log limits): counted like any dropped line."""
    run.logs_dropped += n


class WasmSession:
    """One armed store with one instance: what a run (or a test) calls exports on."""

    def __init__(self, host: WasmHost, compiled: CompiledModule, store: wasmtime.Store,
                 run: GuestRun, fuel: int, timeout_s: float, reservation: int) -> None:
        self.host = host
        self.compiled = compiled
        self.store = store
        self.run = run
        self.fuel = fuel
        self.timeout_s = timeout_s
        self.reservation = reservation
        self.instance: wasmtime.Instance | None = None
        self.memory: wasmtime.Memory | None = None
        #: the code of a ``proc_exit`` in a start function or ``_initialize`` (the run then calls no export)
        self.exit_code: int | None = None
        #: WASI stdout (1) and stderr (2), line by line into the run's log; lines dropped in bulk are
        #: counted in the run's ``logs_dropped``, and ``fd_write`` stops at the run's deadline
        self.streams = {fd: OutputLines(partial(run.log_line, stream=name), MAX_LOG_BYTES,
                                        drop=partial(_count_dropped, run), deadline_ns=run.deadline_ns)
                        for fd, name in ((1, "stdout"), (2, "stderr"))}

    # -- guest memory, for the imports (set as GuestRun.span)

    def _memory_for(self, caller: Any) -> wasmtime.Memory:  # a Caller, or wasmtime's raw caller pointer (fast imports)
        mem = self.memory
        if mem is None:
            # During instantiation (a start function) the exports are not known yet.
            extern = (caller if isinstance(caller, wasmtime.Caller) else wasmtime.Caller(caller)).get("memory")
            if not isinstance(extern, wasmtime.Memory):
                raise NoGuestMemory
            mem = self.memory = extern
        return mem

    def span_checked(self, caller: Any) -> tuple[int, int]:  # as _memory_for
        mem = self._memory_for(caller)
        ptr = mem.data_ptr(caller)
        return ctypes.cast(ptr, ctypes.c_void_p).value or 0, mem.data_len(caller)

    def span_raw(self, caller: object) -> tuple[int, int]:
        ffi = self.host._ffi
        assert ffi is not None
        raw = ctypes.byref(self._memory_for(caller)._memory)
        ctx = ffi.wasmtime_caller_context(caller)
        address = ctypes.cast(ffi.wasmtime_memory_data(ctx, raw), ctypes.c_void_p).value or 0
        return address, ffi.wasmtime_memory_data_size(ctx, raw)

    # -- calls

    def fuel_used(self) -> int:
        try:
            return self.fuel - self.store.get_fuel()
        except wasmtime.WasmtimeError:
            return self.fuel

    def guest_memory(self) -> memoryview:
        """The guest's whole linear memory (tests: canaries, bounds); valid until the next call."""
        if self.memory is None:
            raise InvalidArgument("the module exports no memory")
        size = self.memory.data_len(self.store)
        address = ctypes.cast(self.memory.data_ptr(self.store), ctypes.c_void_p).value or 0
        return guest_view(address, size, writable=True)

    def call(self, export: str, args: Sequence[object] = ()) -> list[object]:
        """Call ``export`` with ``args`` (ints, floats, ``{"handle": h}``); its results as a list."""
        if self.instance is None:
            raise InvalidArgument(f"the guest exited with code {self.exit_code} while it was instantiated")
        func = instance_export(self.instance, self.store, export)
        if not isinstance(func, wasmtime.Func):
            names = sorted(self.compiled.exports)
            raise InvalidArgument(f"module has no exported function {export!r}; exported functions: {names}")
        kinds = self.compiled.exports.get(export)  # read from the module once, at its compile or load
        if kinds is None:
            ftype = func.type(self.store)
            kinds = (_valtypes(ftype.params), _valtypes(ftype.results))
        values = self._convert_args(export, kinds[0], args)
        for kind in kinds[1]:
            if kind not in _KINDS:
                raise InvalidArgument(f"export {export!r} returns a {kind}; only i32/i64/f32/f64 results are supported")
        try:
            result = self.host._guarded_call(self, lambda: func(self.store, *values))
        finally:
            self.run.end_sync()  # the guest's queued device work is part of the call (bounded)
        passed = self.run.deadline_passed
        if passed is not None:
            # The run's deadline passed inside a device op (refused: the guest saw BACKEND) before
            # the epoch stopped the guest - on a loaded host the ticker runs late. Whatever the guest
            # made of that code (long_job returns NaN), its result is no answer: the call is a timeout.
            self.host.stats["timeouts"] += 1
            raise KernelTimeout(self.timeout_s, "run_wasm") from passed
        if result is None:
            return []
        return list(result) if isinstance(result, list) else [result]

    def _convert_args(self, export: str, kinds: tuple[str, ...], args: Sequence[object]) -> list[object]:
        if len(args) != len(kinds):
            raise InvalidArgument(
                f"export {export!r} takes {len(kinds)} argument(s) ({', '.join(kinds) or 'none'}), got {len(args)}"
            )
        out: list[object] = []
        for i, (kind, value) in enumerate(zip(kinds, args)):
            where = f"argument {i} of {export!r} ({kind})"
            if isinstance(value, dict):
                if set(value) != {"handle"} or kind != "i64":
                    raise InvalidArgument(f"{where}: a buffer is passed as {{'handle': h}} to an i64 parameter")
                buf = self.host.ctx.allocator.lookup(value["handle"])
                out.append(self.run.add_client_buffer(buf))
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidArgument(f"{where}: expected a number, got {type(value).__name__}")
            elif kind in ("i32", "i64"):
                bits = 32 if kind == "i32" else 64
                if not isinstance(value, int) or not -(1 << (bits - 1)) <= value < (1 << bits):
                    raise InvalidArgument(f"{where}: {value!r} is not a {bits}-bit integer")
                out.append(value - (1 << bits) if value >= 1 << (bits - 1) else value)
            elif kind in ("f32", "f64"):
                out.append(float(value))
            else:
                raise InvalidArgument(f"{where}: parameters of type {kind} are not supported")
        return out


# ------------------------------------------------------------------ the host


#: the refusal of a pool host (not adopted by a tenant yet): it has no context and runs no module
_NOT_BOUND = "the WASM host is not bound to a tenant yet"


class WasmHost:
    """Runs untrusted modules for one tenant instance (one per worker; see :meth:`for_context`)."""

    EXTENSION = "wasm"

    def __init__(self, ctx: TenantContext | None, *, fast_imports: bool | None = None, tick_s: float = TICK_S,
                 cache_entries: int = CACHE_ENTRIES, cache_bytes: int = CACHE_BYTES) -> None:
        """``ctx`` None: a pool worker's host, made before any tenant is bound (:func:`pool_warm_up`);
        the tenant's context is set when :meth:`for_context` adopts it at the first use after the bind."""
        self._ctx = ctx
        self.engine = wasmtime.Engine(_config())
        self.linker = wasmtime.Linker(self.engine)
        self.ticker = EpochTicker(self.engine, tick_s)
        self.limiter = LogLimiter()
        self._cache: ModuleCache[CompiledModule] = ModuleCache(cache_entries, cache_bytes)
        self._session: WasmSession | None = None
        self._keep: list[object] = []  # ctypes callbacks must outlive the linker
        self._ffi = _raw_ffi() if fast_imports is not False else None
        if fast_imports and self._ffi is None:
            raise RuntimeError("this wasmtime binding has no unchecked host-function API")
        self.fast_imports = self._ffi is not None
        for name in IMPORTS:
            if self._ffi is not None:
                self._define_raw(name)
            else:
                self._define_checked(name)
        self._keep += define_wasi(self.linker, self._stream_of)
        #: stored artifacts an activation handed over, deserialized at their module's first run
        #: (worker.wasm.artifacts): digest -> (module bytes, artifact bytes)
        self._held: dict[str, tuple[bytes, bytes]] = {}
        self.stats = {"runs": 0, "compiles": 0, "artifact_loads": 0, "artifact_refusals": 0, "cache_hits": 0,
                      "traps": 0, "timeouts": 0}
        self._closed = False
        #: :meth:`warm_up` ran (a pool host, before its bind)
        self.warmed = False

    @classmethod
    def for_context(cls, ctx: TenantContext) -> WasmHost:
        """The worker's host, created on first use and closed with the context. A pool worker's
        host, warmed before the bind (:func:`pool_warm_up`), is adopted instead of making one."""
        host = ctx.extensions.get(cls.EXTENSION)
        if not isinstance(host, WasmHost):
            host = _adopt_pool_host(ctx)
            if host is None:
                host = cls(ctx)
            ctx.extensions[cls.EXTENSION] = host
        return host

    @property
    def ctx(self) -> TenantContext:
        """The bound tenant's context; a pool host (not adopted yet) has none and runs no module."""
        ctx = self._ctx
        if ctx is None:
            raise InvalidArgument(_NOT_BOUND)
        return ctx

    @property
    def bound(self) -> bool:
        return self._ctx is not None

    # -------------------------------------------------------------- imports

    def _current(self) -> GuestRun | None:
        session = self._session
        return session.run if session is not None else None

    def _stream_of(self, fd: int) -> OutputLines | None:
        session = self._session
        return session.streams.get(fd) if session is not None else None

    def _define_checked(self, name: str) -> None:
        handler = HANDLERS[name]

        def call(caller: wasmtime.Caller, *args: object) -> int:
            run = self._current()
            if run is None:
                return _INTERNAL
            try:
                result: int = handler(run, caller, *args)
                return result
            except Exception:  # noqa: BLE001 - a host bug must not become the guest's trap
                _log.exception("wasm.host_import_failed import=%s", name)
                return _INTERNAL

        self.linker.define_func(IMPORT_MODULE, name, _functype(name), call, access_caller=True)

    def _define_raw(self, name: str) -> None:
        ffi = self._ffi
        assert ffi is not None
        params, result_kind = IMPORTS[name]
        kinds = tuple(enumerate(params))
        handler = HANDLERS[name]

        def callback(env: Any, caller: Any, vals: Any, nvals: int) -> int:  # ctypes: wasmtime's C callback arguments
            # Results overwrite the arguments in ``vals``; returning 0 means "no trap".
            try:
                run = self._current()
                if run is None:
                    result = _INTERNAL
                else:
                    result = handler(run, caller, *[getattr(vals[i], k) for i, k in kinds])
            except BaseException:  # noqa: BLE001 - nothing may unwind through wasmtime's frames
                _log.exception("wasm.host_import_failed import=%s", name)
                result = _INTERNAL
            setattr(vals[0], result_kind, result)
            return 0

        cb = ffi.wasmtime_func_unchecked_callback_t(callback)
        fin = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _env: None)
        self._keep += [cb, fin]
        module = IMPORT_MODULE.encode()
        encoded = name.encode()
        functype = _functype(name)
        error = ffi.wasmtime_linker_define_func_unchecked(
            self.linker.ptr(), ctypes.create_string_buffer(module), len(module),
            ctypes.create_string_buffer(encoded), len(encoded), functype.ptr(), cb, None, fin,
        )
        if error:
            raise wasmtime.WasmtimeError._from_ptr(error)

    # -------------------------------------------------------------- compile

    @property
    def cache_entries(self) -> int:
        return self._cache.entries

    @cache_entries.setter
    def cache_entries(self, n: int) -> None:
        self._cache.entries = n

    def compile(self, body: bytes | bytearray | memoryview, *, deadline: float | None = None) -> CompiledModule:
        """The compiled module for ``body`` (WAT text or a binary), from the cache when seen before.

        ``deadline`` (``time.monotonic()``): compiling past it raises
        :class:`CompileOverrun` (the compiler thread keeps running until the
        worker exits; the caller must make it exit).
        """
        digest = _digest_within_limits(body)
        cached = self._cache.get(digest)
        if cached is not None:
            self.stats["cache_hits"] += 1
            return cached
        held = self._held.pop(digest, None)
        if held is not None:
            loaded = self._deserialize(digest, *held)
            if loaded is not None:
                return loaded
        t0 = time.perf_counter()
        wasm = _binary(body)
        try:
            module = compile_bounded(self.engine, wasm, deadline)
        except CompileOverrun:
            self.stats["timeouts"] += 1
            raise
        except wasmtime.WasmtimeError as exc:
            raise WasmCompile(_short(str(exc))) from None
        compiled = self._admit(digest, module, wasm, t0, from_artifact=False)
        self.stats["compiles"] += 1
        log_event(_log, logging.INFO, "wasm.compiled", tenant=self.ctx.tenant_id, digest=digest[:16],
                  nbytes=len(wasm), duration_ms=round(compiled.compile_s * 1000, 3))
        return compiled

    def hold_artifact(self, body: bytes | bytearray | memoryview, digest: str,
                      artifact: bytes | bytearray | memoryview) -> None:
        """Keep ``body``'s compiled form ``artifact`` (its ``serialize()``d module, produced by a
        worker of this same tenant: see :mod:`worker.wasm.artifacts`) until the module's first
        run, which deserializes it instead of compiling (:meth:`compile`). Nothing is
        deserialized now: an activation does not pay for modules its requests do not run.
        WasmCompile when ``body`` is not the module ``digest`` names."""
        if _digest_within_limits(body) != digest:
            raise WasmCompile("the module bytes do not match the digest their artifact was stored under")
        if digest not in self._cache:
            self._held[digest] = (bytes(body), bytes(artifact))

    def load_held(self, idle: Callable[[], bool]) -> int:
        """Deserialize held artifacts, the oldest first, while ``idle()`` (no request waits);
        returns how many were loaded. What is still held then loads at its first run."""
        loaded = 0
        while self._held and idle():
            digest = next(iter(self._held))
            body, artifact = self._held.pop(digest)
            if digest not in self._cache and self._deserialize(digest, body, artifact) is not None:
                loaded += 1
        return loaded

    @property
    def held_artifacts(self) -> int:
        """Artifacts handed over and not deserialized yet (their modules have not run)."""
        return len(self._held)

    def _deserialize(self, digest: str, body: bytes, artifact: bytes) -> CompiledModule | None:
        """The compiled module from a held artifact, cached; None when the artifact does not
        deserialize on this engine or its module no longer passes the checks (the run then
        compiles, and the next park stores a fresh artifact in its place). The module's own
        facts (memory limits, export names) come from ``body``, never the artifact."""
        t0 = time.perf_counter()
        try:
            serialized, wasm, meta = artifact_parts(artifact)
            if wasm is None:
                wasm = _binary(body)  # an artifact without the binary: its text assembled again
            known = None
            if meta is not None:
                try:
                    known = read_interface(meta)
                except (ValueError, TypeError):
                    known = None  # read from the binary instead
            module = wasmtime.Module.deserialize(self.engine, serialized)
            compiled = self._admit(digest, module, wasm, t0, from_artifact=True, known=known)
        except (wasmtime.WasmtimeError, ValueError, WasmCompile) as exc:
            self.stats["artifact_refusals"] += 1
            log_event(_log, logging.WARNING, "wasm.artifact_refused", tenant=self.ctx.tenant_id, digest=digest[:16],
                      error=_short(str(exc)))
            return None
        self.stats["artifact_loads"] += 1
        log_event(_log, logging.INFO, "wasm.artifact_loaded", tenant=self.ctx.tenant_id, digest=digest[:16],
                  nbytes=len(artifact), duration_ms=round(compiled.compile_s * 1000, 3))
        return compiled

    def artifacts(self, digests: Iterable[str], max_bytes: int) -> list[tuple[str, bytes]]:
        """``serialize()`` of the cached modules among ``digests`` that this worker compiled itself
        (one loaded from an artifact is stored already), at most ``max_bytes`` of them, most
        recently used first."""
        wanted = set(digests)
        out: list[tuple[str, bytes]] = []
        total = 0
        for digest in reversed(list(self._cache)):
            compiled = self._cache.peek(digest)
            if compiled is None or compiled.from_artifact or digest not in wanted:
                continue
            data = pack_artifact(bytes(compiled.module.serialize()), compiled.wasm)
            if total + len(data) > max_bytes:
                continue
            total += len(data)
            out.append((digest, data))
        return out

    def _admit(self, digest: str, module: wasmtime.Module, wasm: bytes, t0: float, *,
               from_artifact: bool, cache: bool = True, known: Interface | None = None) -> CompiledModule:
        """Check a compiled (or deserialized) module's imports, link it ahead and cache it
        (``cache`` False: only the first two - the pool's rehearsal of a load, :meth:`warm_up_steps`).

        A module deserialized from its tenant's artifact was checked in full when it was
        compiled; here its import *names* are checked again (what the guest may reach) and their
        types are left to the linker (``instantiate_pre`` refuses an import whose type is not
        the host's): reading every import's type through the wasmtime binding is most of what
        loading an artifact costs."""
        interface: tuple[list[tuple[str, str]], ExportTypes] | None = None
        names: dict[int, str] = {}
        if known is not None:  # an artifact's, as read where it was compiled (:func:`pack_artifact`)
            interface, names = (known[0], known[1]), known[2]
        elif from_artifact:
            try:
                interface = module_interface(wasm, names)
            except (ValueError, KeyError, IndexError, UnicodeDecodeError):
                interface = None  # read through the binding instead
        if interface is not None:
            wasi = self._check_import_names(interface[0])
        else:
            wasi = self._check_imports(module, types=not from_artifact)
        try:
            pre = self.linker.instantiate_pre(module)
            memory = known[3] if known is not None else memory_limits(wasm)
        except (wasmtime.WasmtimeError, ValueError) as exc:
            # "incompatible import type for `wasi_snapshot_preview1::fd_write`" + the cause's last line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            last = _short(str(exc))
            raise WasmCompile(last if first in last else f"{first}: {last}") from None
        exports = interface[1] if interface is not None else _export_types(module)
        compiled = CompiledModule(digest, module, pre, memory, len(wasm), time.perf_counter() - t0, exports,
                                  wasi, names if interface is not None else function_exports(wasm), from_artifact,
                                  b"" if from_artifact else wasm)
        if cache:
            self._cache.put(digest, compiled)  # the budget: entries and module bytes, LRU beyond
        return compiled

    @staticmethod
    def _check_import_names(imports: Iterable[tuple[str, str]]) -> bool:
        """:meth:`_check_imports` on (module, name) pairs read from the bytes (an artifact's
        module): the names only; the linker checks the types (``instantiate_pre``)."""
        wasi = False
        for module, name in imports:
            where = f"import {module}::{name}"
            if module == WASI_MODULE:
                wasi = True
                if name in WASI_REFUSED:
                    raise WasmCompile(f"{where} is refused: a guest has no network (no WASI sockets)")
                if name not in WASI_FUNCTIONS:
                    raise WasmCompile(f"{where} is not provided: not a WASI preview 1 function")
            elif module != IMPORT_MODULE or name not in IMPORTS:
                raise WasmCompile(
                    f"{where} is not provided: a guest may import only {IMPORT_MODULE}::"
                    f"{{{', '.join(IMPORTS)}}} and WASI preview 1 ({WASI_MODULE}) functions"
                )
        return wasi

    @staticmethod
    def _check_imports(module: wasmtime.Module, *, types: bool = True) -> bool:
        """Refuse an import the guest may not have (WasmCompile); whether it imports WASI.
        ``types``: also check each host import's type here, for a precise message (without,
        the linker refuses a wrong type)."""
        wasi = False
        for imp in module.imports:
            where = f"import {imp.module}::{imp.name}"
            if imp.module == WASI_MODULE:
                wasi = True
                if imp.name in WASI_REFUSED:
                    raise WasmCompile(f"{where} is refused: a guest has no network (no WASI sockets)")
                if imp.name not in WASI_FUNCTIONS or (types and not isinstance(imp.type, wasmtime.FuncType)):
                    raise WasmCompile(f"{where} is not provided: not a WASI preview 1 function")
                continue  # its type is checked when the module is linked (instantiate_pre)
            if imp.module != IMPORT_MODULE or imp.name not in IMPORTS:
                raise WasmCompile(
                    f"{where} is not provided: a guest may import only {IMPORT_MODULE}::"
                    f"{{{', '.join(IMPORTS)}}} and WASI preview 1 ({WASI_MODULE}) functions"
                )
            if not types:
                continue
            ty = imp.type
            params, result = IMPORTS[imp.name]
            if not isinstance(ty, wasmtime.FuncType):
                raise WasmCompile(f"{where} must be a function")
            got = (_valtypes(ty.params), _valtypes(ty.results))
            if got != (params, (result,)):
                raise WasmCompile(
                    f"{where} has type ({', '.join(got[0])}) -> ({', '.join(got[1])}); "
                    f"the ABI type is ({', '.join(params)}) -> ({result})"
                )
        return wasi

    # -------------------------------------------------------------- memory

    def _reserve_memory(self, compiled: CompiledModule) -> int:
        """Consume the run's linear-memory cap from the tenant's CPU quota; returns it."""
        if compiled.memory is None:
            return 0
        spec = self.ctx.spec
        block = self.ctx.block
        cap = spec.wasm_max_memory_bytes // PAGE * PAGE
        min_pages, max_pages = compiled.memory
        need = min_pages * PAGE
        want = cap if max_pages is None else min(cap, max_pages * PAGE)
        if need > cap:
            raise WasmCompile(
                f"module needs {need:,} B of linear memory at start; tenant {self.ctx.tenant_id!r} allows "
                f"{cap:,} B (wasm_max_memory_bytes)"
            )
        for _ in range(8):  # another instance of the tenant may race us for the same quota
            limit = block.memory_quota_bytes
            used = block.bytes_in_use
            amount = min(want, max(0, limit - used) // PAGE * PAGE)
            if amount < need:
                break
            try:
                if amount:
                    block.consume_bytes(amount)
                return amount
            except MemoryExhausted:
                continue
        raise MemoryExhausted(
            self.ctx.tenant_id, need, block.memory_quota_bytes, block.bytes_in_use,
            message=(
                f"tenant {self.ctx.tenant_id!r}: no room for the module's {need:,} B of initial linear memory "
                f"in the host memory quota ({block.bytes_in_use:,} of {block.memory_quota_bytes:,} B in use)"
            ),
        )

    # -------------------------------------------------------------- runs

    @contextmanager
    def session(self, body: bytes | bytearray | memoryview | CompiledModule, *, fuel: int,
                timeout_s: float) -> Iterator[WasmSession]:
        """An instantiated, armed store; everything it held is released on exit."""
        if self._closed:
            raise InvalidArgument("the WASM host is closed")
        if self._session is not None:
            raise InvalidArgument("a WASM run is already in progress in this worker")
        compiled = body if isinstance(body, CompiledModule) else self.compile(body)
        reservation = self._reserve_memory(compiled)
        store: wasmtime.Store | None = None
        session: WasmSession | None = None
        ticking = False
        try:
            store = wasmtime.Store(self.engine)
            store.set_limits(
                memory_size=reservation,
                table_elements=MAX_TABLE_ELEMENTS,
                instances=1,
                tables=MAX_TABLES,
                memories=0 if compiled.memory is None else 1,
            )
            store.set_fuel(fuel)
            if compiled.wasi:
                store.set_wasi(wasi_config())
            run = GuestRun(self.ctx, self.limiter)
            run.deadline_ns = time.monotonic_ns() + int(timeout_s * 1e9)
            session = WasmSession(self, compiled, store, run, fuel, timeout_s, reservation)
            run.span = session.span_raw if self.fast_imports else session.span_checked
            run.interrupt = functools.partial(self.ticker.expire, self.ticker.deadline_ticks(timeout_s))
            self._session = session
            self.ticker.acquire()
            ticking = True
            store.set_epoch_deadline(self.ticker.deadline_ticks(timeout_s))
            try:
                session.instance = self._guarded_call(session, lambda: compiled.pre.instantiate(store),
                                                      instantiate=True)
            except GuestExit as exc:  # a start function called proc_exit: the run is over before it began
                session.exit_code = exc.code
                yield session
                return
            if session.memory is None:
                mem = instance_export(session.instance, store, "memory")
                if isinstance(mem, wasmtime.Memory):
                    session.memory = mem
            if compiled.exports.get("_initialize") == ((), ()):
                # a reactor (wasm32-wasi, -mexec-model=reactor): libc's constructors, once per instance
                init = instance_export(session.instance, store, "_initialize")
                assert isinstance(init, wasmtime.Func)
                try:
                    self._guarded_call(session, lambda: init(store))
                except GuestExit as exc:
                    session.exit_code = exc.code
            yield session
        finally:
            if session is not None:
                for stream in session.streams.values():
                    stream.close()  # a last line without a newline still reaches the log
            self._session = None
            if ticking:
                self.ticker.release()
            if session is not None:
                session.run.release()
            if store is not None:
                store.close()  # the linear memory goes now, not at some later GC
            if reservation:
                self.ctx.block.release_bytes(reservation)
            if session is not None:  # last: may raise QueueOverrun (queued GPU work past the deadline)
                session.run.finish(timeout_s)

    def _guarded_call(self, session: WasmSession, fn: Callable[[], T], *, instantiate: bool = False) -> T:
        """Run guest code; wasmtime's traps and errors become the typed errors."""
        try:
            return fn()
        except OutputStopped as stop:  # fd_write ran out of the run's time or fuel inside the call
            if stop.reason == "deadline":
                self.stats["timeouts"] += 1
                raise KernelTimeout(session.timeout_s, "run_wasm") from None
            self.stats["traps"] += 1
            raise WasmTrap("out_of_fuel", "all fuel consumed by the guest's output (fd_write)") from None
        except wasmtime.ExitTrap as exited:  # WASI proc_exit: an end, not a fault
            raise GuestExit(exited.code) from None
        except wasmtime.Trap as trap:
            code = trap.trap_code
            if code is wasmtime.TrapCode.INTERRUPT:
                self.stats["timeouts"] += 1
                raise KernelTimeout(session.timeout_s, "run_wasm") from None
            self.stats["traps"] += 1
            name = code.name.lower() if code is not None else "host"
            detail = _short(str(trap))
            if code is wasmtime.TrapCode.OUT_OF_FUEL:
                detail = (f"the run's fuel budget of {session.fuel:,} units is spent; give it more with "
                          f"`twt run --fuel N` (run_wasm's `fuel`), up to the tenant's `wasm_fuel` ceiling")
            fuel_limit = session.fuel if code is wasmtime.TrapCode.OUT_OF_FUEL else None
            raise WasmTrap(name, detail, trap_location(trap, session.compiled.export_names), fuel_limit) from None
        except wasmtime.WasmtimeError as exc:
            if instantiate:
                raise WasmCompile(f"instantiation failed: {_short(str(exc))}") from None
            self.stats["traps"] += 1
            raise WasmTrap("error", _short(str(exc))) from None

    def run(self, body: bytes | bytearray | memoryview | CompiledModule, export: str, args: Sequence[object] = (),
            *, fuel: int, timeout_s: float) -> dict[str, object]:
        """One complete run: the ``run_wasm`` reply, or a typed error."""
        if self._ctx is None:  # a pool host: refused before a tenant's module is compiled (or cached) here
            raise InvalidArgument(_NOT_BOUND)
        t0 = time.perf_counter()
        self.stats["runs"] += 1
        # "cached": not compiled by this run - found in the cache, or deserialized from the
        # tenant's own artifact an activation handed over (compiled before, by this tenant)
        hits = self.stats["cache_hits"] + self.stats["artifact_loads"]
        # Compiling counts against the run's time: the deadline covers both.
        deadline = time.monotonic() + timeout_s
        compiled = body if isinstance(body, CompiledModule) else self.compile(body, deadline=deadline)
        left = deadline - time.monotonic()
        if left <= 0:
            self.stats["timeouts"] += 1
            raise KernelTimeout(timeout_s, message=f"run_wasm: compiling used the whole run time of {timeout_s:g} s")
        with self.session(compiled, fuel=fuel, timeout_s=left) as session:
            session.timeout_s = timeout_s  # errors name the run's limit; the epoch deadline has what is left
            results: list[object] = []
            exit_code = session.exit_code
            if exit_code is None:
                try:
                    results = session.call(export, args)
                except GuestExit as exc:
                    exit_code = exc.code
            if session.run.deadline_passed is not None:
                # the deadline ran out inside a device op of a guest that then exited (proc_exit:
                # no call result); a call that returned raised this already (WasmSession.call)
                self.stats["timeouts"] += 1
                raise KernelTimeout(timeout_s, "run_wasm") from session.run.deadline_passed
            fuel_used = session.fuel_used()
            memory_bytes = session.memory.data_len(session.store) if session.memory is not None else 0
            run = session.run
        return {
            "results": results,
            "fuel_used": fuel_used,
            "elapsed_s": round(time.perf_counter() - t0, 6),
            "cached": self.stats["cache_hits"] + self.stats["artifact_loads"] > hits,
            "gpu_peak_bytes": run.gpu_peak_bytes,
            "memory_bytes": memory_bytes,
            "logs": run.logs,
            # every line the guest wrote and the reply does not carry: dropped by the limits, or logged
            # by the worker past the reply's MAX_LOG_LINES_IN_REPLY
            "logs_dropped": run.logs_dropped + run.log_lines - len(run.logs),
            "exit_code": exit_code,
            **run.gpu_totals(),
            # the limits this run had (the request's, capped by the tenant's spec): a client can tell
            # its user that an asked-for --fuel or --timeout was cut to the ceiling
            "fuel_limit": fuel,
            "timeout_s": timeout_s,
        }

    def warm_up(self) -> None:
        """Run the tenant-free parts of a first run once, on this (pool) host before it is bound.

        A worker's first ``run_wasm`` paid for set-up that is the same whatever the module:
        the engine's first store, the linker resolving host functions and WASI, the first
        instantiate (the runtime's lazy state), the first WAT parse, the epoch thread's start,
        and the first pass of this process through the run's own Python path (an artifact's
        load and the runs are rehearsed through the very methods a tenant's take:
        :meth:`_rehearse`). Done here, on :data:`WARM_UP_WAT` (our module, never a tenant's), the
        tenant's first run pays only for its own module (and an artifact's load, the engine's
        first deserialize done here too, only for its own). Holds nothing afterwards: the store, its linear memory
        and the module are dropped, nothing enters the tenant's module cache, and no quota is
        touched (there is no tenant yet). Refused once the host is bound."""
        for _ in self.warm_up_steps():
            pass

    def warm_up_steps(self) -> Iterator[None]:
        """:meth:`warm_up` one step at a time (each ~1 ms on a quiet host: assemble, compile,
        deserialize, the load's checks and link, one rehearsed run, the other; a worker forked from the fork server deserializes
        the module the preload compiled instead of assembling and compiling it): a pool worker's
        loop runs one step and looks at its queue again, so a bind that arrives mid-way waits for
        one step, not the whole warm-up, and the loop stops calling it once bound. Refused once
        the host is bound."""
        if self._ctx is not None:
            raise InvalidArgument("a bound WASM host is not warmed: its runs are the tenant's")
        artifact = _preloaded_warm_up  # compiled and packed by the fork server: deserialized, not compiled here
        if artifact is None:
            wasm = _binary(WARM_UP_WAT)
            artifact = pack_artifact(bytes(wasmtime.Module(self.engine, wasm).serialize()), wasm)
        yield
        # an artifact's load as ``load_modules`` makes it: its parts, the engine's first deserialize ...
        serialized, wasm_or_none, meta = artifact_parts(artifact)
        wasm = wasm_or_none or b""
        module = wasmtime.Module.deserialize(self.engine, serialized)
        yield
        known = read_interface(meta or b"")
        yield
        # ... its name checks and its link, not cached. Not the compile path's reads of every import's
        # and export's type through the binding (``_check_imports``, ``_export_types``: ~2 ms and ~180
        # copy-on-write faults of a forked worker's warm-up): an artifact's load reads them from its
        # interface, and a module compiled in the worker pays its compile anyway. Their one use for an
        # artifact's load was the malloc heap's pages their allocations made the worker's own: with the
        # fork server's holes filled (worker.fork_heap) a load then takes ~10 faults more, not ~50
        compiled = self._admit(_WARM_UP_DIGEST, module, wasm, time.perf_counter(), from_artifact=True, cache=False,
                               known=known)
        self.ticker.prestart()
        # the second run of a code path still costs more than a warm one: two runs, less the one
        # the fork server's preload ran before this worker was forked (:func:`preload_pool_host`)
        for _ in range(2 - _preloaded_runs):
            yield
            if self._ctx is not None:
                return  # adopted by the tenant meanwhile: its runs are the tenant's
            self._rehearse(compiled)
        self.warmed = True

    def _rehearse(self, compiled: CompiledModule) -> None:
        """One run of our warm-up module through the path a tenant's ``run_wasm`` takes - :meth:`run`,
        :meth:`session`, the run's host state, the call, its release and the reply's encoding - on
        nobody's account (:class:`_Nobody`: no quota, no buffer, no device), before the bind.

        A worker is forked from the fork server: the first time it runs a stretch of Python it
        writes to pages the fork server shares with it (reference counts, the interpreter's
        inline caches) and takes a page fault for each, and its CPU caches hold none of it. When
        that stretch was the tenant's first ``run_wasm`` after an activation, that run cost about
        twice a warm one in the worker (56 minor faults against 5) - not the idle gap before it:
        a run after a 5 ms gap and a round trip elsewhere costs what a warm one does. A raw store's
        run of the module (:meth:`_warm_run`) left all of that to the tenant. Holds nothing
        afterwards: the host's counters are as before, nothing is cached, no thread is left
        beyond the epoch ticker's."""
        if self._ctx is not None:
            raise InvalidArgument("a bound WASM host is not warmed: its runs are the tenant's")
        stats = dict(self.stats)
        self._ctx = _NOBODY  # the executor thread's own: a bind (which adopts the host) waits behind this step
        try:
            encode_worker_reply(0, True, self.run(compiled, "run", [64], fuel=WARM_UP_FUEL, timeout_s=1.0))
        finally:
            self._ctx = None
            self.stats.update(stats)

    def _warm_run(self, pre: wasmtime.InstancePre, *, ticker: bool) -> None:
        """One run of the warm-up module (``pre``) in a store of its own, dropped after. Without
        ``ticker`` (the fork server's, which must start no thread) the epoch thread is not asked
        for: the deadline is never reached, the fuel bounds the run."""
        store = wasmtime.Store(self.engine)
        if ticker:
            self.ticker.acquire()
        try:
            store.set_limits(memory_size=PAGE, table_elements=MAX_TABLE_ELEMENTS, instances=1,
                             tables=MAX_TABLES, memories=1)
            store.set_fuel(WARM_UP_FUEL)
            store.set_wasi(wasi_config())
            store.set_epoch_deadline(self.ticker.deadline_ticks(1.0))
            instance = pre.instantiate(store)
            run = instance_export(instance, store, "run")
            memory = instance_export(instance, store, "memory")
            assert isinstance(run, wasmtime.Func) and isinstance(memory, wasmtime.Memory)
            run.type(store)
            run(store, 64)
            store.get_fuel()
            memory.data_len(store)
            memory.data_ptr(store)
        finally:
            if ticker:
                self.ticker.release()
            store.close()

    def info(self) -> dict[str, object]:
        return {"fast_imports": self.fast_imports, "cached_modules": len(self._cache), **self.stats}

    def close(self) -> None:
        """Stop the ticker and drop the cache (the context closes its extensions on shutdown)."""
        if self._closed:
            return
        self._closed = True
        self.ticker.close()
        self._cache.clear()



# ------------------------------------------------------------------ the pool's warm-up

def _warm_up_wat() -> bytes:
    """:data:`WARM_UP_WAT`: our module (never a tenant's) with a one-page memory and a loop, that
    imports every host function the linker defines (:data:`IMPORTS`) and the WASI functions it
    defines itself. A pool worker's warm-up loads it as a tenant's artifact is loaded and runs it
    (:meth:`WasmHost.warm_up_steps`), so the engine has registered those functions' types and the
    link and the instantiate have resolved each of them once before the bind: a tenant module's
    first load after an activation then pays for its own code, not for every import it names the
    first time in this process. A forked worker's first load of the probe guest (which imports every
    host function): ~130 minor faults after a warm-up that imported two, ~54 after this one; the
    warm-up itself takes ~175 more (~850 -> ~1,030), off the activation's path."""
    imports = "".join(f'  (import "{IMPORT_MODULE}" "{name}" (func (param {" ".join(params)}) (result {result})))\n'
                      for name, (params, result) in IMPORTS.items())
    wasi = "".join(f'  (import "wasi_snapshot_preview1" "{name}" (func (param {params}) (result i32)))\n'
                   for name, params in (("fd_write", "i32 i32 i32 i32"), ("fd_fdstat_get", "i32 i32"),
                                        ("poll_oneoff", "i32 i32 i32 i32")))
    return ("(module\n" + imports + wasi + """  (memory (export "memory") 1 1)
  (func (export "run") (param $n i32) (result i32) (local $sum i32)
    (block $done (loop $next
      (br_if $done (i32.eqz (local.get $n)))
      (i32.store (i32.const 0) (i32.add (i32.load (i32.const 0)) (local.get $n)))
      (local.set $sum (i32.add (local.get $sum) (local.get $n)))
      (local.set $n (i32.sub (local.get $n) (i32.const 1)))
      (br $next)))
    (local.get $sum)))
""").encode()


#: what a pool worker runs before it is bound (WasmHost.warm_up): ours, not a tenant's (:func:`_warm_up_wat`)
WARM_UP_WAT: Final = _warm_up_wat()
#: the warm-up run's fuel: its loop of 64 needs about a thousand units
WARM_UP_FUEL: Final = 100_000
#: the name the warm-up module's rehearsal has instead of a tenant module's digest
_WARM_UP_DIGEST: Final = "warm-up"


class _Nobody:
    """What a rehearsal run (:meth:`WasmHost._rehearse`) has in place of a tenant's context: the
    fields and methods a run's path reads of it, each on nobody's account - its spec is the
    defaults, its quota block charges nothing, it has no buffer, its device does nothing. Our
    warm-up module calls no host function, so nothing else of a context is reached."""

    tenant_id = ""
    instance = 0
    memory_quota_bytes = 1 << 40
    bytes_in_use = 0

    def __init__(self) -> None:
        self.spec = TenantSpec("warm-up")
        # one object in each role the run's path reads: the quota block, the allocator, the backend, the gate
        self.block = self.allocator = self.backend = self.gate = self

    def consume_bytes(self, n: int) -> None:
        pass

    def release_bytes(self, n: int) -> None:
        pass

    def lookup(self, handle: int) -> None:
        raise InvalidArgument("a rehearsal run has no buffers")

    def free_buffer(self, buf: object) -> None:
        pass

    def settle(self) -> None:
        pass

    def begin_run(self, limit: float | None) -> None:
        pass

    def end_run(self, deadline: float | None) -> None:
        pass

    def take_run_totals(self) -> tuple[int, int]:
        return 0, 0

    def sync(self, deadline_ns: int | None = None, *, run_end: bool = False) -> None:
        pass

    def release(self, deadline_ns: int | None = None) -> bool:
        return True


_NOBODY: Final = cast(TenantContext, _Nobody())

#: a pool worker's host, warmed before its bind and adopted by the tenant's first use (one per process)
_pool_host: WasmHost | None = None
#: :data:`WARM_UP_WAT`'s artifact (:func:`pack_artifact`: serialized, its interface, its binary), made once
#: by the fork server's preload (:func:`preload_pool_host`); None elsewhere (the warm-up then assembles,
#: compiles and packs it)
_preloaded_warm_up: bytes | None = None
#: warm-up runs the fork server's preload made on the pool host (0 or 1): a forked worker runs that
#: many fewer (its copy-on-write pages and the epoch thread still need one of its own)
_preloaded_runs = 0


def _adopt_pool_host(ctx: TenantContext) -> WasmHost | None:
    """The pool's host, now ``ctx``'s (once: a worker serves one tenant), or None if there is none."""
    global _pool_host
    host, _pool_host = _pool_host, None
    if host is None or host._closed or host._ctx is not None:
        return None
    host._ctx = ctx
    return host


def preload_pool_host() -> WasmHost:
    """Make this process's pool host now, unwarmed, compile the warm-up module once and run it
    once (the fork server's preload, :mod:`worker.preload`): every forked pool worker inherits the
    engine, the linker with the host functions and the warm-up module's compiled artifact instead
    of making them (~6 ms of each worker's start, ~45 starts a second at a busy density stream's
    rate), and runs the module once where it ran it twice.
    Starts no thread: the compile here is serial, on an engine of its own with the same settings
    (wasmtime's parallel compilation would start its thread pool, and threads do not survive a
    fork); the epoch ticker's thread starts at the warm-up's runs, in the worker. Holds nothing of
    a tenant: the fork server never binds."""
    global _pool_host, _preloaded_warm_up, _preloaded_runs
    if _preloaded_warm_up is None:
        config = _config()
        config.parallel_compilation = False  # not part of an artifact's compatibility
        wasm = _binary(WARM_UP_WAT)
        _preloaded_warm_up = pack_artifact(bytes(wasmtime.Module(wasmtime.Engine(config), wasm).serialize()), wasm)
    if _pool_host is None:
        _pool_host = WasmHost(None)
    host = _pool_host
    if not _preloaded_runs and host._ctx is None and not host._closed:
        # One warm-up run here (the runtime's lazy state: its first store, instantiate and call,
        # made once for every forked worker), without the epoch thread; each worker then runs
        # once, not twice (~0.8 ms less of each pool worker's warm-up; the run after its warm-up,
        # ~0.2 ms, measured the same within noise).
        module = wasmtime.Module.deserialize(host.engine, artifact_parts(_preloaded_warm_up)[0])
        host._warm_run(host.linker.instantiate_pre(module), ticker=False)
        _preloaded_runs = 1
    return _pool_host


def pool_warm_up() -> Iterator[None]:
    """A pool worker's WASM warm-up in steps (``WorkerServer.idle_work``: one step at a time, while
    no request waits, never after the bind): the engine and the linker with the host functions
    (unless the fork server's preload made them: :func:`preload_pool_host`), then one warm-up run
    (:meth:`WasmHost.warm_up`). The host is offered for adoption from the first step on, so a
    bind that comes mid-way still finds the engine made."""
    global _pool_host
    host = _pool_host
    if host is None:
        host = WasmHost(None)
        _pool_host = host
        yield
    elif host.warmed or host.bound or host._closed:
        return  # warmed (or adopted) before: one warm-up a process
    engine_fingerprint()  # an activation's import_modules asks for it (the wasmtime version: ms to find)
    yield
    if host is _pool_host:  # not adopted meanwhile (a bound host runs only its tenant's modules)
        yield from host.warm_up_steps()  # the loop stops calling once bound
