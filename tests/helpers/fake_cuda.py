"""A fake ``cuda.bindings.driver`` (plus the NVRTC calls the kernels need) for tests without a GPU.

It has the real module's call shapes - every call returns a tuple with the
result code first, attribute values are ``cuuint64_t``, pools are made from a
``CUmemPoolProps`` - and behaves like the driver where the cuda backend
depends on it:

* ``cuInit`` failure modes: libcuda missing (every call raises
  :class:`DynamicLibNotFoundError`, a ``RuntimeError`` subclass, as
  cuda.pathfinder does), no device, a driver mismatch;
* calls before ``cuInit`` fail ``CUDA_ERROR_NOT_INITIALIZED``; calls that
  need a context fail ``CUDA_ERROR_INVALID_CONTEXT`` on a thread without one;
* device capacity shared by contexts, pools and ``cuMemAlloc``;
  ``cuMemGetInfo`` reports what is left;
* pools: ``maxSize`` enforced (``CUDA_ERROR_OUT_OF_MEMORY`` past it, and
  ``CUDA_ERROR_INVALID_VALUE`` for a maxSize that is not a multiple of the
  allocation granularity; ``MAX_POOL_SIZE`` reads it back, rounded up to
  ``pool_size_granularity``), allocations aligned to 512 B, memory reserved
  in granularity chunks, freed memory kept up to
  ``CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`` until a synchronize and given back by
  ``cuMemPoolTrimTo`` - the threshold never refuses anything;
* asynchronous execution: launches, copies, frees (and the fake cuBLAS's
  GEMMs) are *queued* on their stream and run at a synchronize, an event or
  stream query (``cuEventRecord`` marks a point in the queue); a kernel's
  fault surfaces there, sticky; a queued free keeps its bytes outstanding
  (not reusable, not trimmable) until it has run; a stream in ``stalled``
  never finishes (queries say ``CUDA_ERROR_NOT_READY``; a synchronize is
  counted in ``blocking_waits``, then runs it anyway); destroying a context
  cancels its queue (``cancelled_ops``);
* primary-context flags (``cuDevicePrimaryCtxSetFlags``, ``primary_flags``,
  ``flags_set_while_active``), ``cuCtxCreate`` / ``cuCtxDestroy`` of extra
  contexts; contexts (``context_bytes``), modules (``module_bytes``) and
  ``cuMemAlloc`` take device memory;
* invalid handles (unknown or destroyed stream, pool, pointer, context,
  module) give the driver's error codes; ``cuGetErrorName`` names them;
* kernels: ``nvrtcCompileProgram`` reads the ``extern "C" __global__``
  signatures from the source and ``cuLaunchKernel`` checks the launch's
  ctypes against them, then runs the kernel *by name* with numpy
  (``twt_fill_f32``, ``twt_axpy_f32``, ``twt_sum_f32`` - the same
  grid-stride partition as the CUDA code).

Use it two ways:

* a :class:`FakeDriver` instance is module-shaped: pass it as ``driver=``
  (and ``nvrtc=``) to :class:`worker.backends.cuda.CudaBackend` and inspect
  ``calls`` / ``fail_next`` in the test;
* by name: ``cuda_driver_module = "tests.helpers.fake_cuda"`` (and
  ``cuda_nvrtc_module``) in the supervisor config, or the ``TWT_CUDA_*``
  variables. Module attributes then go to one instance per process built
  from the ``FAKE_CUDA_*`` environment: ``FAKE_CUDA_MODE`` (ok | no-libcuda
  | no-device | driver-mismatch), ``FAKE_CUDA_DEVICES``,
  ``FAKE_CUDA_MEMORY`` (bytes per device), ``FAKE_CUDA_CONTEXT_BYTES``,
  ``FAKE_CUDA_GRANULARITY``, ``FAKE_CUDA_DRIVER_VERSION`` (``cuDriverGetVersion``, 13000),
  ``FAKE_CUDA_BINDINGS`` (12 | 13: which cuda-bindings major's call shapes it has, below),
  ``FAKE_CUDA_NVRTC_CACHE`` (a folder where a run's processes share the real NVRTC's results),
  ``FAKE_CUDA_RECORD_DIR`` (each process writes
  ``<pid>.json`` there: the ``CUDA_MPS_*`` variables it saw at ``cuInit`` and
  the devices it retained a primary context on).

Both cuda-bindings majors the project supports (``bindings_major``; by
default ``FAKE_CUDA_BINDINGS``, else the installed cuda-bindings' major):
12.x's ``cuCtxCreate(flags, dev)``, ``CUmemPoolProps`` without
``gpuDirectRDMACapable`` and ``CUmemPool_attribute`` without ``MAX_POOL_SIZE``;
13.x's ``cuCtxCreate(ctxCreateParams, flags, dev)`` and the extra field and
member. A call in the other major's shape fails as that binding fails it
(``TypeError`` / ``AttributeError`` before anything happens), and the module
attributes ``CUmemPoolProps``, ``CUmemPool_attribute`` and ``BINDINGS_VERSION``
follow the process's fake (``shared.cuda_compat`` reads the last).

An asynchronous device model, off by default (``device_clock``): every
launch (and fake cuBLAS GEMM) costs ``launch_ns`` of device time on its
stream's clock, starting where the stream's work ends or where the device
has got to, whichever is later; ``cuEventRecord`` stamps the stream's clock;
``cuEventQuery`` (and ``cuStreamQuery``) answer ``CUDA_ERROR_NOT_READY`` until
the fake device has caught up with the stamp - a test moves it with
:meth:`FakeDriver.step` / :meth:`FakeDriver.catch_up`; a blocking wait
(``cuEventSynchronize``, ``cuStreamSynchronize``) catches the device up at
once; ``cuEventElapsedTime`` is the difference of the two stamps, exactly.
``not_ready_answers`` counts the queries it answered NOT_READY.

Not modelled: memory shared between *processes* (each process sees a whole
device), MPS itself, time (queued work runs when something waits for it,
all at once, unless its stream is stalled).
"""

from __future__ import annotations

import bisect
import ctypes
import enum
import functools
import json
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from shared.exitcodes import STICKY_CUDA_ERRORS

__all__ = ["DynamicLibNotFoundError", "FakeDriver", "instance", "reset"]


# ----------------------------------------------------------------- enums (real values)

#: the driver's sticky errors (the same list the worker uses; shared/exitcodes.py)
STICKY = frozenset(STICKY_CUDA_ERRORS)


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_DEINITIALIZED = 4
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_ECC_UNCORRECTABLE = 214
    CUDA_ERROR_INVALID_IMAGE = 200
    CUDA_ERROR_CONTAINED = 226
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_CONTEXT_ALREADY_IN_USE = 216
    CUDA_ERROR_INVALID_PTX = 218
    CUDA_ERROR_INVALID_SOURCE = 300
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701
    CUDA_ERROR_LAUNCH_TIMEOUT = 702
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709
    CUDA_ERROR_ASSERT = 710
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
    CUDA_ERROR_HARDWARE_STACK_ERROR = 714
    CUDA_ERROR_ILLEGAL_INSTRUCTION = 715
    CUDA_ERROR_MISALIGNED_ADDRESS = 716
    CUDA_ERROR_INVALID_ADDRESS_SPACE = 717
    CUDA_ERROR_INVALID_PC = 718
    CUDA_ERROR_LAUNCH_FAILED = 719
    CUDA_ERROR_TENSOR_MEMORY_LEAK = 721
    CUDA_ERROR_NOT_PERMITTED = 800
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_SYSTEM_DRIVER_MISMATCH = 803
    CUDA_ERROR_MPS_CLIENT_TERMINATED = 810
    CUDA_ERROR_EXTERNAL_DEVICE = 911
    CUDA_ERROR_UNKNOWN = 999


class _CUmemPool_attribute13(enum.IntEnum):
    """cuda-bindings 13.x's ``CUmemPool_attribute`` (the members the project uses)."""

    CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES = 1
    CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC = 2
    CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES = 3
    CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4
    CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT = 5
    CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH = 6
    CU_MEMPOOL_ATTR_USED_MEM_CURRENT = 7
    CU_MEMPOOL_ATTR_USED_MEM_HIGH = 8
    CU_MEMPOOL_ATTR_MAX_POOL_SIZE = 13


class _CUmemPool_attribute12(enum.IntEnum):
    """cuda-bindings 12.9's: no ``CU_MEMPOOL_ATTR_MAX_POOL_SIZE`` (a 12.x pool's cap is not readable)."""

    CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES = 1
    CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC = 2
    CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES = 3
    CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4
    CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT = 5
    CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH = 6
    CU_MEMPOOL_ATTR_USED_MEM_CURRENT = 7
    CU_MEMPOOL_ATTR_USED_MEM_HIGH = 8


# named as the bindings name them (the replay finds the real class by this name; pickling goes by
# the qualified name, which stays the module-level one)
_CUmemPool_attribute13.__name__ = _CUmemPool_attribute12.__name__ = "CUmemPool_attribute"
_PoolAttr = _CUmemPool_attribute13  # the fake's own logic: the superset


class CUctx_flags(enum.IntEnum):
    CU_CTX_SCHED_AUTO = 0
    CU_CTX_SCHED_SPIN = 1
    CU_CTX_SCHED_YIELD = 2
    CU_CTX_SCHED_BLOCKING_SYNC = 4
    CU_CTX_SCHED_MASK = 7
    CU_CTX_MAP_HOST = 8
    CU_CTX_LMEM_RESIZE_TO_MAX = 16


class CUevent_flags(enum.IntEnum):
    CU_EVENT_DEFAULT = 0
    CU_EVENT_BLOCKING_SYNC = 1
    CU_EVENT_DISABLE_TIMING = 2


class CUstream_flags(enum.IntEnum):
    CU_STREAM_DEFAULT = 0
    CU_STREAM_NON_BLOCKING = 1


class CUmemAllocationType(enum.IntEnum):
    CU_MEM_ALLOCATION_TYPE_INVALID = 0
    CU_MEM_ALLOCATION_TYPE_PINNED = 1
    CU_MEM_ALLOCATION_TYPE_MANAGED = 2


class CUmemAllocationHandleType(enum.IntEnum):
    CU_MEM_HANDLE_TYPE_NONE = 0
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_INVALID = 0
    CU_MEM_LOCATION_TYPE_DEVICE = 1
    CU_MEM_LOCATION_TYPE_HOST = 2


class CUmemAllocationGranularity_flags(enum.IntEnum):
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class CUdevice_attribute(enum.IntEnum):
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
    CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED = 115


class nvrtcResult(enum.IntEnum):
    NVRTC_SUCCESS = 0
    NVRTC_ERROR_OUT_OF_MEMORY = 1
    NVRTC_ERROR_PROGRAM_CREATION_FAILURE = 2
    NVRTC_ERROR_INVALID_INPUT = 3
    NVRTC_ERROR_INVALID_PROGRAM = 4
    NVRTC_ERROR_INVALID_OPTION = 5
    NVRTC_ERROR_COMPILATION = 6


class DynamicLibNotFoundError(RuntimeError):
    """What cuda.pathfinder raises on the first call when libcuda / libnvrtc cannot be found."""


# ----------------------------------------------------------------- handles and structs


class _Handle:
    """An opaque driver object handle (context, stream, pool, module, function, program).

    As in cuda.bindings: equal (and hashing equal) to a handle of the same
    type and value, never to a plain int; ``int()`` and ``__index__`` give the
    address; the constructor takes an int only.
    """

    __slots__ = ("_value",)

    def __init__(self, value: int = 0) -> None:
        if isinstance(value, _Handle | _Value):
            value = int(value)
        if not isinstance(value, int):
            raise TypeError("an integer is required")
        self._value = value

    def __int__(self) -> int:
        return self._value

    def __index__(self) -> int:
        return self._value

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and int(other) == self._value  # type: ignore[call-overload]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._value))

    def getPtr(self) -> int:
        return self._value

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._value:#x}>"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._value,))


class _Value:
    """A value wrapper (CUdevice, CUdeviceptr, cuuint64_t): as in cuda.bindings, it compares
    by *identity* (two ``CUdeviceptr(5)`` are not equal and hash apart) and has no ``__index__``;
    ``int()`` gives the value."""

    __slots__ = ("_value",)
    _bits = 64

    def __init__(self, value: int = 0) -> None:
        if isinstance(value, _Handle | _Value):
            value = int(value)
        if not isinstance(value, int):
            raise TypeError("an integer is required")
        if not 0 <= value < 1 << self._bits:
            raise OverflowError(f"can't convert {value} to an unsigned {self._bits}-bit value")
        self._value = value

    def __int__(self) -> int:
        return self._value

    def getPtr(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._value}>"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._value,))


class CUdevice(_Value):
    __slots__ = ()
    _bits = 31


class CUdeviceptr(_Value):
    __slots__ = ()


class cuuint64_t(_Value):
    __slots__ = ()


class CUcontext(_Handle):
    __slots__ = ()


class CUstream(_Handle):
    __slots__ = ()


class CUevent(_Handle):
    __slots__ = ()


class CUmemoryPool(_Handle):
    __slots__ = ()


class CUmodule(_Handle):
    __slots__ = ()


class CUfunction(_Handle):
    __slots__ = ()


class nvrtcProgram(_Handle):
    __slots__ = ()


class _Struct:
    """A driver struct as cuda.bindings has them: a fixed set of fields, each typed.

    Unknown fields raise ``AttributeError``; an int field refuses a non-number
    (``TypeError``) and a negative value (``OverflowError``); an enum field
    takes a member or an int of a member (``ValueError`` otherwise); a struct
    field takes only that struct type. ``_fields`` maps name -> int | enum | struct type.
    """

    __slots__: tuple[str, ...] = ()
    _fields: dict[str, Any] = {}

    def __init__(self) -> None:
        for name, kind in self._fields.items():
            if kind is int:
                value: Any = 0
            elif isinstance(kind, type) and issubclass(kind, enum.IntEnum):
                value = kind(min(int(m) for m in kind))
            else:
                value = kind()
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        kind = type(self)._fields.get(name)
        if kind is None:
            raise AttributeError(f"'cuda.bindings.driver.{type(self).__name__}' object has no attribute '{name}'")
        if kind is int:
            if isinstance(value, (str, bytes, bytearray)) or not hasattr(value, "__int__"):
                raise TypeError("an integer is required")
            value = int(value)
            if value < 0:
                raise OverflowError("can't convert negative value to size_t")
        elif isinstance(kind, type) and issubclass(kind, enum.IntEnum):
            value = kind(int(value))  # ValueError for a str or an unknown member, like the bindings
        elif not isinstance(value, kind):
            raise TypeError(f"Argument '{name}' is not instance of type {kind.__name__}")
        object.__setattr__(self, name, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_struct, (type(self), {n: getattr(self, n) for n in self._fields}))


def _rebuild_struct(cls: type[_Struct], fields: dict[str, Any]) -> _Struct:
    obj = cls()
    for name, value in fields.items():
        setattr(obj, name, value)
    return obj


class CUmemLocation(_Struct):
    __slots__ = ("type", "id")
    _fields = {"type": CUmemLocationType, "id": int}


class _CUmemPoolProps13(_Struct):
    """cuda-bindings 13.x's ``CUmemPoolProps``."""

    __slots__ = ("allocType", "handleTypes", "location", "win32SecurityAttributes", "maxSize", "usage",
                 "gpuDirectRDMACapable")
    _fields = {"allocType": CUmemAllocationType, "handleTypes": CUmemAllocationHandleType,
               "location": CUmemLocation, "win32SecurityAttributes": int, "maxSize": int, "usage": int,
               "gpuDirectRDMACapable": int}


class _CUmemPoolProps12(_Struct):
    """cuda-bindings 12.9's: no ``gpuDirectRDMACapable`` (setting it is an AttributeError there)."""

    __slots__ = ("allocType", "handleTypes", "location", "win32SecurityAttributes", "maxSize", "usage")
    _fields = {"allocType": CUmemAllocationType, "handleTypes": CUmemAllocationHandleType,
               "location": CUmemLocation, "win32SecurityAttributes": int, "maxSize": int, "usage": int}


_CUmemPoolProps13.__name__ = _CUmemPoolProps12.__name__ = "CUmemPoolProps"

#: per cuda-bindings major: the version the fake reports, and the names whose shape differs
BINDINGS: dict[int, dict[str, Any]] = {
    12: {"BINDINGS_VERSION": "12.9.10", "CUmemPool_attribute": _CUmemPool_attribute12,
         "CUmemPoolProps": _CUmemPoolProps12},
    13: {"BINDINGS_VERSION": "13.0.0", "CUmemPool_attribute": _CUmemPool_attribute13,
         "CUmemPoolProps": _CUmemPoolProps13},
}
#: module attributes that follow this process's fake's binding version (module ``__getattr__``)
_VERSIONED = frozenset(BINDINGS[13])


@functools.cache
def installed_bindings_major() -> int | None:
    """The major version of the cuda-bindings this interpreter would import (None: not installed)."""
    from importlib import metadata

    try:
        head = metadata.version("cuda-bindings").split(".", 1)[0]
    except metadata.PackageNotFoundError:
        return None
    return int(head) if head.isdigit() else None


def default_bindings_major(environ: Mapping[str, str] | None = None) -> int:
    """The major a fake speaks unless told: ``FAKE_CUDA_BINDINGS``, else the installed cuda-bindings'
    (so the fake stands in for the binding a test process would load), else 13."""
    env = os.environ if environ is None else environ
    raw = env.get("FAKE_CUDA_BINDINGS")
    if raw:
        return int(raw)
    installed = installed_bindings_major()
    return installed if installed in BINDINGS else 13


class CUmemAllocationProp(_Struct):
    __slots__ = ("type", "requestedHandleTypes", "location", "win32HandleMetaData")
    _fields = {"type": CUmemAllocationType, "requestedHandleTypes": CUmemAllocationHandleType,
               "location": CUmemLocation, "win32HandleMetaData": int}


# ----------------------------------------------------------------- the fake's state


def _round_up(n: int, g: int) -> int:
    return (n + g - 1) // g * g


_ALIGN = 512  # pool allocations are aligned (and padded) like this


class _Pool:
    def __init__(self, handle: int, device: int, ctx: int, max_size: int) -> None:
        self.handle = handle
        self.device = device
        self.ctx = ctx
        self.max_size = max_size
        self.release_threshold = 0
        self.used = 0
        self.used_high = 0
        self.reserved = 0
        self.reserved_high = 0
        self.live = 0  # outstanding allocations
        self.destroyed = False


class _Alloc:
    __slots__ = ("base", "size", "charged", "pool", "device", "data", "freeing")

    def __init__(self, base: int, size: int, charged: int, pool: _Pool | None, device: int) -> None:
        self.base = base
        self.size = size
        self.charged = charged
        self.pool = pool
        self.device = device
        self.data: bytearray | None = None  # made on first touch: large fake allocations cost nothing
        self.freeing = False  # a cuMemFreeAsync of it is queued, not yet run

    def buf(self) -> bytearray:
        if self.data is None:
            self.data = bytearray(self.size)
        return self.data


_SIG_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)', re.S)
_CTYPE_OF = {
    "pointer": (ctypes.c_void_p,),
    "float": (ctypes.c_float,),
    "double": (ctypes.c_double,),
    "int": (ctypes.c_int,),
    "unsigned long long": (ctypes.c_uint64, ctypes.c_ulonglong),
}


def _param_kind(decl: str) -> str:
    decl = re.sub(r"\b(const|__restrict__)\b", " ", decl)
    if "*" in decl:
        return "pointer"
    words = decl.split()[:-1]  # drop the parameter name
    return " ".join(words)




class FakeDriver:
    """One fake driver + NVRTC; attribute-compatible with the real modules for what the backend uses."""

    # the module-level names the backend reads from "the module"
    CUresult = CUresult
    CUmemPool_attribute: type[enum.IntEnum] = _CUmemPool_attribute13  # per bindings_major (__init__)
    CUstream_flags = CUstream_flags
    CUctx_flags = CUctx_flags
    CUevent_flags = CUevent_flags
    CUevent = CUevent
    CUmemAllocationType = CUmemAllocationType
    CUmemAllocationHandleType = CUmemAllocationHandleType
    CUmemLocationType = CUmemLocationType
    CUmemAllocationGranularity_flags = CUmemAllocationGranularity_flags
    CUdevice_attribute = CUdevice_attribute
    CUmemPoolProps: type[_Struct] = _CUmemPoolProps13
    BINDINGS_VERSION = "13.0.0"
    CUmemAllocationProp = CUmemAllocationProp
    CUmemLocation = CUmemLocation
    cuuint64_t = cuuint64_t
    CUdevice = CUdevice
    CUcontext = CUcontext
    CUstream = CUstream
    CUmemoryPool = CUmemoryPool
    CUevent = CUevent
    CUdeviceptr = CUdeviceptr
    nvrtcResult = nvrtcResult
    DynamicLibNotFoundError = DynamicLibNotFoundError

    def __init__(
        self,
        *,
        devices: int = 1,
        memory_bytes: int = 16 << 30,
        granularity: int = 2 << 20,
        context_bytes: int = 0,
        mode: str = "ok",
        name: str = "Fake CUDA Device",
        compute_capability: tuple[int, int] = (9, 0),
        nvrtc_archs: tuple[str, ...] | None = None,
        pools_supported: bool = True,
        record_dir: str | None = None,
        driver_version: int = 13000,
        real_nvrtc: bool = True,
        module_bytes: int = 0,
        pool_size_granularity: int = 1,
        bindings_major: int | None = None,
    ) -> None:
        if bindings_major is None:
            bindings_major = default_bindings_major()
        if bindings_major not in BINDINGS:
            raise ValueError(f"the fake speaks cuda-bindings majors {sorted(BINDINGS)}, not {bindings_major!r}")
        if mode not in ("ok", "no-libcuda", "no-device", "driver-mismatch"):
            raise ValueError(f"unknown fake CUDA mode {mode!r}")
        self.__name__ = "tests.helpers.fake_cuda"
        self.devices = devices
        self.memory_bytes = memory_bytes
        self.granularity = granularity
        self.context_bytes = context_bytes
        self.mode = mode
        self.device_name = name
        self.compute_capability = compute_capability
        self.nvrtc_archs = nvrtc_archs
        self.pools_supported = pools_supported
        self.record_dir = record_dir
        self.driver_version = driver_version
        #: which cuda-bindings major's call shapes this fake has (cuCtxCreate, CUmemPoolProps ...)
        self.bindings_major = bindings_major
        for name, value in BINDINGS[bindings_major].items():
            setattr(self, name, value)
        #: every call made, by name, in order (the tests' view of "was the driver called?")
        self.calls: list[str] = []
        #: name -> list of results the next calls return instead of running
        self._fail: dict[str, list[CUresult | nvrtcResult]] = {}
        self._lock = threading.RLock()
        self._tls = threading.local()
        self.initialized = False
        self._next = 0x1000
        # each process its own address range (as its own address space would give it), so an
        # address handed over from another process is unmapped here, not one of our buffers
        self._next_addr = 0x7000_0000_0000 + ((os.getpid() & 0xFF) << 36)
        self.ctx_refs: dict[int, int] = {}  # device -> primary context retain count
        self.ctx_handle = {d: 0xC000 + d for d in range(devices)}
        self.streams: dict[int, tuple[int, int]] = {}  # handle -> (ctx, flags)
        #: event handle -> perf_counter_ns at which the stream got past its record (cuEventElapsedTime)
        self.event_done_ns: dict[int, int] = {}
        self.pools: dict[int, _Pool] = {}
        self.allocs: dict[int, _Alloc] = {}
        self._bases: list[int] = []
        self.raw_reserved = [0] * devices  # cuMemAlloc bytes per device
        self.modules: dict[int, dict[bytes, list[str]]] = {}
        self.functions: dict[int, tuple[int, bytes, list[str]]] = {}
        self.programs: dict[int, dict[str, Any]] = {}
        #: device -> the sticky error its context hit: every later call in it returns that error,
        #: until the process ends (cuda.h: "the process must be terminated and relaunched")
        self.sticky: dict[int, CUresult] = {}
        self.launches: list[tuple[bytes, int, int]] = []  # (kernel, grid, block)
        self.compile_options: list[list[bytes]] = []
        self.init_environment: dict[str, str] = {}
        #: compile kernel sources for real with NVRTC when it is loadable (a syntax error then fails)
        self.real_nvrtc = real_nvrtc
        self.real_compiles = 0
        #: device bytes a loaded module takes (its code, constants ...) until cuModuleUnload
        self.module_bytes = module_bytes
        #: a pool's maxSize is enforced (and read back as MAX_POOL_SIZE) rounded up to this
        self.pool_size_granularity = pool_size_granularity
        self.module_reserved: dict[int, tuple[int, int]] = {}  # module -> (device, bytes)
        # ---- asynchronous execution: stream handle -> queued operations, run in order later
        self.queues: dict[int, list[tuple[int, Callable[[], None]]]] = {}
        self.enqueued: dict[int, int] = {}  # stream -> sequence number of the last queued op
        self.completed: dict[int, int] = {}  # stream -> sequence number of the last op run
        #: streams whose work makes no progress (a long kernel): queries say NOT_READY, a
        #: synchronize would block (counted in ``blocking_waits``, then the work runs anyway)
        self.stalled: set[int] = set()
        self.blocking_waits = 0
        #: queued operations dropped unrun because their context was destroyed
        self.cancelled_ops = 0
        self.events: dict[int, tuple[int, int] | None] = {}  # event -> (stream, sequence) recorded
        #: device -> flags set with cuDevicePrimaryCtxSetFlags (CU_CTX_SCHED_AUTO by default)
        self.primary_flags: dict[int, int] = {d: 0 for d in range(devices)}
        #: cuDevicePrimaryCtxSetFlags calls made while that primary context was active
        self.flags_set_while_active = 0
        self.extra_ctx: dict[int, int] = {}  # cuCtxCreate'd context -> device
        # ---- the asynchronous device model (module doc): off unless a test turns it on
        self.device_clock = False
        #: device ns one launch takes in that model
        self.launch_ns = 10_000
        self.stream_clock: dict[int, int] = {}  # stream -> device ns at which its queued work ends
        self.device_now: dict[int, int] = {}  # stream -> device ns the fake device has run it to
        self.event_stamp: dict[int, int] = {}  # event -> the stream's clock when it was recorded
        self.not_ready_answers = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FakeDriver:
        env = os.environ if environ is None else environ

        def num(key: str, default: int) -> int:
            raw = env.get(key)
            return default if not raw else int(raw)

        return cls(
            devices=num("FAKE_CUDA_DEVICES", 1),
            memory_bytes=num("FAKE_CUDA_MEMORY", 16 << 30),
            granularity=num("FAKE_CUDA_GRANULARITY", 2 << 20),
            context_bytes=num("FAKE_CUDA_CONTEXT_BYTES", 0),
            mode=env.get("FAKE_CUDA_MODE") or "ok",
            record_dir=env.get("FAKE_CUDA_RECORD_DIR") or None,
            real_nvrtc=env.get("FAKE_CUDA_REAL_NVRTC", "1") != "0",
            driver_version=num("FAKE_CUDA_DRIVER_VERSION", 13000),
            bindings_major=default_bindings_major(env),
        )

    # ------------------------------------------------------------- test controls

    def fail_next(self, name: str, result: CUresult | nvrtcResult, times: int = 1) -> None:
        """Make the next ``times`` calls of ``name`` return ``result`` without doing anything."""
        self._fail.setdefault(name, []).extend([result] * times)

    def count(self, name: str) -> int:
        return self.calls.count(name)

    def step(self, ns: int, stream: Any = None) -> None:
        """The asynchronous model's device runs ``ns`` on ``stream`` (every stream when None)."""
        with self._lock:
            for h in ([int(stream)] if stream is not None else list(self.streams)):
                self.device_now[h] = self.device_now.get(h, 0) + ns

    def catch_up(self, stream: Any = None) -> None:
        """The asynchronous model's device finishes what is queued on ``stream`` (every stream)."""
        with self._lock:
            for h in ([int(stream)] if stream is not None else list(self.streams)):
                self.device_now[h] = max(self.device_now.get(h, 0), self.stream_clock.get(h, 0))

    def backlog_ns(self, stream: Any) -> int:
        """Device ns queued on ``stream`` that the model's device has not run yet."""
        with self._lock:
            h = int(stream)
            return max(0, self.stream_clock.get(h, 0) - self.device_now.get(h, 0))

    def _reached(self, h: int, stamp: int) -> bool:
        return not self.device_clock or stamp <= self.device_now.get(h, 0)

    def device_reserved(self, device: int) -> int:
        pools = sum(p.reserved for p in self.pools.values() if p.device == device)
        ctx = self.context_bytes if self.ctx_refs.get(device, 0) > 0 else 0
        ctx += self.context_bytes * sum(1 for d in self.extra_ctx.values() if d == device)
        mods = sum(n for d, n in self.module_reserved.values() if d == device)
        return pools + ctx + mods + self.raw_reserved[device]

    # ------------------------------------------------------------- plumbing

    def _new(self) -> int:
        self._next += 0x10
        return self._next

    def _ctx(self) -> int:
        return int(getattr(self._tls, "ctx", 0))

    def _ctx_device(self, ctx: int) -> int | None:
        if ctx in self.extra_ctx:
            return self.extra_ctx[ctx]
        for dev, handle in self.ctx_handle.items():
            if handle == ctx and self.ctx_refs.get(dev, 0) > 0:
                return dev
        return None

    def _enter(self, name: str, *, needs_init: bool = True, needs_ctx: bool = False) -> CUresult | None:
        """Common entry of every driver call: record, libcuda missing, injected failures, state."""
        self.calls.append(name)
        if self.mode == "no-libcuda":
            raise DynamicLibNotFoundError(
                'Failure finding "libcuda.so": "cuda" is an NVIDIA driver library and can only be found '
                "via system search. Ensure the NVIDIA display driver is installed. (fake)"
            )
        queued = self._fail.get(name)
        if queued:
            err = CUresult(queued.pop(0))
            if err.name in STICKY and needs_ctx:
                dev = self._ctx_device(self._ctx())
                if dev is not None:
                    self.sticky.setdefault(dev, err)
            return err
        if needs_init and not self.initialized:
            return CUresult.CUDA_ERROR_NOT_INITIALIZED
        if needs_ctx:
            dev = self._ctx_device(self._ctx())
            if dev is None:
                return CUresult.CUDA_ERROR_INVALID_CONTEXT
            if dev in self.sticky:
                return self.sticky[dev]
        return None

    def _stream_ok(self, stream: Any) -> bool:
        h = int(stream) if stream is not None else 0
        return h == 0 or h in self.streams

    def _resolve(self, addr: int, n: int) -> tuple[_Alloc, int] | None:
        i = bisect.bisect_right(self._bases, addr) - 1
        if i < 0:
            return None
        a = self.allocs[self._bases[i]]
        off = addr - a.base
        if off < 0 or n < 0 or off + n > a.size:
            return None
        return a, off

    def _add_alloc(self, size: int, charged: int, pool: _Pool | None, device: int) -> int:
        base = self._next_addr
        self._next_addr += _round_up(max(size, 1), 256) + 256  # a gap: off-by-one accesses fault
        self.allocs[base] = _Alloc(base, size, charged, pool, device)
        bisect.insort(self._bases, base)
        return base

    def _drop_alloc(self, base: int) -> _Alloc:
        a = self.allocs.pop(base)
        self._bases.remove(base)
        return a

    def _trim(self, pool: _Pool, keep_bytes: int | None = None) -> None:
        """Release a pool's unused reserve down to ``keep_bytes`` (the release threshold by default).

        Allocations still live or with a free queued but not yet run are
        outstanding: their chunks stay reserved (the driver cannot release them).
        """
        keep = pool.release_threshold if keep_bytes is None else keep_bytes
        floor = _round_up(pool.used, self.granularity)
        pool.reserved = min(pool.reserved, max(floor, _round_up(keep, self.granularity)))

    # ------------------------------------------------------------- asynchronous execution

    def _enqueue(self, stream: Any, op: Callable[[], None], cost_ns: int = 0) -> None:
        """Queue ``op`` on ``stream`` (the null stream runs it at once); ``cost_ns``: its device time
        in the asynchronous model."""
        h = 0 if stream is None else int(stream)
        if h == 0:
            op()
            return
        if self.device_clock:
            self.stream_clock[h] = max(self.stream_clock.get(h, 0), self.device_now.get(h, 0)) + cost_ns
        seq = self.enqueued.get(h, 0) + 1
        self.enqueued[h] = seq
        self.queues.setdefault(h, []).append((seq, op))

    def _run_stream(self, h: int, upto: int | None = None) -> None:
        """Run ``h``'s queued operations (up to sequence ``upto``) in order; a fault drops the rest."""
        queue = self.queues.get(h)
        if not queue:
            return
        ctx = self.streams.get(h, (0, 0))[0]
        dev = self._ctx_device(ctx)
        while queue and (upto is None or queue[0][0] <= upto):
            seq, op = queue.pop(0)
            self.completed[h] = seq
            if dev is not None and dev in self.sticky:
                self.cancelled_ops += 1  # the context is lost: nothing more runs in it
                continue
            op()

    def pending(self, stream: Any) -> int:
        """Operations queued on ``stream`` and not yet run."""
        return len(self.queues.get(int(stream), []))

    def _drop_queues(self, ctx: int) -> None:
        """Destroying a context cancels the work still queued in it."""
        for h, (c, _) in list(self.streams.items()):
            if c == ctx:
                self.cancelled_ops += len(self.queues.pop(h, []))

    # ------------------------------------------------------------- init and devices

    def cuInit(self, flags: int) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuInit", needs_init=False)
            if err is not None:
                return (err,)
            if self.mode == "no-device":
                return (CUresult.CUDA_ERROR_NO_DEVICE,)
            if self.mode == "driver-mismatch":
                return (CUresult.CUDA_ERROR_SYSTEM_DRIVER_MISMATCH,)
            if flags != 0:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            self.initialized = True
            self.init_environment = {k: v for k, v in os.environ.items() if k.startswith("CUDA_MPS_")}
            self._record()
            return (CUresult.CUDA_SUCCESS,)

    def _record(self) -> None:
        """``<record dir>/<pid>.json``: the MPS variables seen at cuInit and the devices with a context."""
        if not self.record_dir:
            return
        path = os.path.join(self.record_dir, f"{os.getpid()}.json")
        doc = {"pid": os.getpid(), "environment": self.init_environment,
               "devices": sorted(d for d, n in self.ctx_refs.items() if n > 0)}
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(path + ".tmp", path)

    def cuDriverGetVersion(self) -> tuple[Any, ...]:
        err = self._enter("cuDriverGetVersion", needs_init=False)
        return (err, None) if err is not None else (CUresult.CUDA_SUCCESS, self.driver_version)

    def cuDeviceGetCount(self) -> tuple[Any, ...]:
        err = self._enter("cuDeviceGetCount")
        return (err, 0) if err is not None else (CUresult.CUDA_SUCCESS, self.devices)

    def cuDeviceGet(self, ordinal: int) -> tuple[Any, ...]:
        err = self._enter("cuDeviceGet")
        if err is not None:
            return (err, None)
        if not 0 <= int(ordinal) < self.devices:
            return (CUresult.CUDA_ERROR_INVALID_DEVICE, None)
        return (CUresult.CUDA_SUCCESS, CUdevice(int(ordinal)))

    def _dev(self, dev: Any) -> int | None:
        d = int(dev)
        return d if 0 <= d < self.devices else None

    def cuDeviceGetName(self, length: int, dev: Any) -> tuple[Any, ...]:
        err = self._enter("cuDeviceGetName")
        if err is not None:
            return (err, None)
        if self._dev(dev) is None:
            return (CUresult.CUDA_ERROR_INVALID_DEVICE, None)
        raw = self.device_name.encode()[: length - 1]
        return (CUresult.CUDA_SUCCESS, raw + b"\0" * (length - len(raw)))

    def cuDeviceTotalMem(self, dev: Any) -> tuple[Any, ...]:
        err = self._enter("cuDeviceTotalMem")
        if err is not None:
            return (err, None)
        if self._dev(dev) is None:
            return (CUresult.CUDA_ERROR_INVALID_DEVICE, None)
        return (CUresult.CUDA_SUCCESS, self.memory_bytes)

    def cuDeviceGetAttribute(self, attrib: Any, dev: Any) -> tuple[Any, ...]:
        err = self._enter("cuDeviceGetAttribute")
        if err is not None:
            return (err, None)
        if self._dev(dev) is None:
            return (CUresult.CUDA_ERROR_INVALID_DEVICE, None)
        values = {
            CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: 132,
            CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: self.compute_capability[0],
            CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: self.compute_capability[1],
            CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: int(self.pools_supported),
        }
        if int(attrib) not in values:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
        return (CUresult.CUDA_SUCCESS, values[CUdevice_attribute(int(attrib))])

    def cuGetErrorName(self, error: Any) -> tuple[Any, ...]:
        self.calls.append("cuGetErrorName")
        if self.mode == "no-libcuda":
            raise DynamicLibNotFoundError("libcuda not found (fake)")
        try:
            return (CUresult.CUDA_SUCCESS, CUresult(int(error)).name.encode())
        except ValueError:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, None)

    # ------------------------------------------------------------- contexts

    def cuDevicePrimaryCtxRetain(self, dev: Any) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuDevicePrimaryCtxRetain")
            if err is not None:
                return (err, None)
            d = self._dev(dev)
            if d is None:
                return (CUresult.CUDA_ERROR_INVALID_DEVICE, None)
            if self.ctx_refs.get(d, 0) == 0:
                if self.device_reserved(d) + self.context_bytes > self.memory_bytes:
                    return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
            self.ctx_refs[d] = self.ctx_refs.get(d, 0) + 1
            self._record()
            return (CUresult.CUDA_SUCCESS, CUcontext(self.ctx_handle[d]))

    def cuDevicePrimaryCtxRelease(self, dev: Any) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuDevicePrimaryCtxRelease")
            if err is not None:
                return (err,)
            d = self._dev(dev)
            if d is None:
                return (CUresult.CUDA_ERROR_INVALID_DEVICE,)
            if self.ctx_refs.get(d, 0) <= 0:
                return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
            self.ctx_refs[d] -= 1
            if self.ctx_refs[d] == 0:  # the primary context is destroyed with everything in it
                ctx = self.ctx_handle[d]
                self._drop_queues(ctx)
                for h in [h for h, (c, _) in self.streams.items() if c == ctx]:
                    del self.streams[h]
                for h in [h for h, p in self.pools.items() if p.ctx == ctx]:
                    del self.pools[h]
                for base in [b for b, a in self.allocs.items() if a.device == d]:
                    self._drop_alloc(base)
                self.raw_reserved[d] = 0
            return (CUresult.CUDA_SUCCESS,)

    def cuDevicePrimaryCtxSetFlags(self, dev: Any, flags: int) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuDevicePrimaryCtxSetFlags")
            if err is not None:
                return (err,)
            d = self._dev(dev)
            if d is None:
                return (CUresult.CUDA_ERROR_INVALID_DEVICE,)
            if not isinstance(flags, int) or flags < 0 or flags & ~0x1F or (flags & 7) not in (0, 1, 2, 4):
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            if self.ctx_refs.get(d, 0) > 0:
                self.flags_set_while_active += 1
            self.primary_flags[d] = int(flags)
            return (CUresult.CUDA_SUCCESS,)

    def cuDevicePrimaryCtxGetState(self, dev: Any) -> tuple[Any, ...]:
        err = self._enter("cuDevicePrimaryCtxGetState")
        if err is not None:
            return (err, None, None)
        d = self._dev(dev)
        if d is None:
            return (CUresult.CUDA_ERROR_INVALID_DEVICE, None, None)
        return (CUresult.CUDA_SUCCESS, self.primary_flags[d], int(self.ctx_refs.get(d, 0) > 0))

    def cuCtxGetFlags(self) -> tuple[Any, ...]:
        err = self._enter("cuCtxGetFlags", needs_ctx=True)
        if err is not None:
            return (err, None)
        ctx = self._ctx()
        if ctx in self.extra_ctx:
            return (CUresult.CUDA_SUCCESS, 0)
        d = self._ctx_device(ctx)
        assert d is not None
        return (CUresult.CUDA_SUCCESS, self.primary_flags[d])

    def cuCtxCreate(self, *args: Any) -> tuple[Any, ...]:
        """A regular (non-primary) context made current; it costs ``context_bytes`` until destroyed.

        The binding's shape: ``(flags, dev)`` in 12.x, ``(ctxCreateParams, flags, dev)`` in 13.x;
        any other count is the binding's ``TypeError`` (before anything happens).
        """
        want = 2 if self.bindings_major == 12 else 3
        if len(args) != want:
            raise TypeError(f"cuCtxCreate() takes exactly {want} positional arguments ({len(args)} given)")
        params = None if want == 2 else args[0]
        flags, dev = args[-2:]
        if params is not None:
            raise TypeError(f"Argument 'ctxCreateParams' is not instance of type CUctxCreateParams, got {type(params)!r}")
        if not isinstance(flags, int) or isinstance(flags, bool):
            raise TypeError(f"an integer is required for flags, got {type(flags)!r}")
        if flags < 0:
            raise OverflowError("can't convert negative value to unsigned int")
        with self._lock:
            err = self._enter("cuCtxCreate")
            if err is not None:
                return (err, None)
            d = self._dev(dev)
            if d is None:
                return (CUresult.CUDA_ERROR_INVALID_DEVICE, None)
            if self.device_reserved(d) + self.context_bytes > self.memory_bytes:
                return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
            h = self._new() | 0xC000_0000
            self.extra_ctx[h] = d
            self._tls.ctx = h
            return (CUresult.CUDA_SUCCESS, CUcontext(h))

    def cuCtxDestroy(self, ctx: Any) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuCtxDestroy")
            if err is not None:
                return (err,)
            h = int(ctx)
            if self.extra_ctx.pop(h, None) is None:
                return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
            self._drop_queues(h)
            if self._ctx() == h:
                self._tls.ctx = 0
            return (CUresult.CUDA_SUCCESS,)

    def cuCtxSetCurrent(self, ctx: Any) -> tuple[Any, ...]:
        err = self._enter("cuCtxSetCurrent")
        if err is not None:
            return (err,)
        h = 0 if ctx is None else int(ctx)
        if h != 0 and self._ctx_device(h) is None:
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        self._tls.ctx = h
        return (CUresult.CUDA_SUCCESS,)

    def cuCtxGetCurrent(self) -> tuple[Any, ...]:
        err = self._enter("cuCtxGetCurrent")
        if err is not None:
            return (err, None)
        return (CUresult.CUDA_SUCCESS, CUcontext(self._ctx()))

    def cuCtxPopCurrent(self) -> tuple[Any, ...]:
        err = self._enter("cuCtxPopCurrent")
        if err is not None:
            return (err, None)
        h = self._ctx()
        if h == 0:
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT, None)
        self._tls.ctx = 0
        return (CUresult.CUDA_SUCCESS, CUcontext(h))

    def cuMemGetInfo(self) -> tuple[Any, ...]:
        err = self._enter("cuMemGetInfo", needs_ctx=True)
        if err is not None:
            return (err, None, None)
        d = self._ctx_device(self._ctx())
        assert d is not None
        return (CUresult.CUDA_SUCCESS, max(0, self.memory_bytes - self.device_reserved(d)), self.memory_bytes)

    # ------------------------------------------------------------- streams

    def cuStreamCreate(self, flags: int) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuStreamCreate", needs_ctx=True)
            if err is not None:
                return (err, None)
            if int(flags) not in (0, 1):
                return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
            h = self._new()
            self.streams[h] = (self._ctx(), int(flags))
            return (CUresult.CUDA_SUCCESS, CUstream(h))

    def cuStreamDestroy(self, stream: Any) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuStreamDestroy")
            if err is not None:
                return (err,)
            if int(stream) not in self.streams:
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            self._run_stream(int(stream))  # its queued work still completes (cuda.h)
            del self.streams[int(stream)]
            return (CUresult.CUDA_SUCCESS,)

    def cuStreamSynchronize(self, stream: Any) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuStreamSynchronize", needs_ctx=True)
            if err is not None:
                return (err,)
            if not self._stream_ok(stream):
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            h = int(stream) if stream is not None else 0
            if h in self.stalled and self.queues.get(h):
                self.blocking_waits += 1  # on hardware this call would block until the work ends
            if self.device_clock:
                self.device_now[h] = max(self.device_now.get(h, 0), self.stream_clock.get(h, 0))
            self._run_stream(h)
            lost = self._lost()
            if lost is not None:
                return (lost,)  # a fault in the queued work surfaces here
            for pool in self.pools.values():
                self._trim(pool)  # the release threshold's retention ends at a synchronize
            return (CUresult.CUDA_SUCCESS,)

    def _lost(self) -> CUresult | None:
        """The sticky error of the current context's device, if any."""
        dev = self._ctx_device(self._ctx())
        return None if dev is None else self.sticky.get(dev)

    def cuStreamQuery(self, stream: Any) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuStreamQuery", needs_ctx=True)
            if err is not None:
                return (err,)
            if not self._stream_ok(stream):
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            h = int(stream) if stream is not None else 0
            if h in self.stalled and self.queues.get(h) or not self._reached(h, self.stream_clock.get(h, 0)):
                return (CUresult.CUDA_ERROR_NOT_READY,)
            self._run_stream(h)
            lost = self._lost()
            return (lost if lost is not None else CUresult.CUDA_SUCCESS,)

    # ------------------------------------------------------------- events

    def cuEventCreate(self, flags: int) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuEventCreate", needs_ctx=True)
            if err is not None:
                return (err, None)
            if not isinstance(flags, int) or flags & ~0xF:
                return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
            h = self._new()
            self.events[h] = None
            return (CUresult.CUDA_SUCCESS, CUevent(h))

    def cuEventRecord(self, event: Any, stream: Any) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuEventRecord", needs_ctx=True)
            if err is not None:
                return (err,)
            if int(event) not in self.events or not self._stream_ok(stream):
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            h = int(stream) if stream is not None else 0
            self.events[int(event)] = (h, self.enqueued.get(h, 0))
            self.event_done_ns.pop(int(event), None)
            if self.device_clock:
                self.event_stamp[int(event)] = max(self.stream_clock.get(h, 0), self.device_now.get(h, 0))
            if self._event_done(int(event)):
                self._done_at(int(event))  # nothing before it on the stream: complete now
            return (CUresult.CUDA_SUCCESS,)

    def _event_done(self, event: int) -> bool:
        mark = self.events[event]
        if mark is None:
            return True  # never recorded: complete, as cuda.h says
        h, seq = mark
        if not self._reached(h, self.event_stamp.get(event, 0)):
            return False
        return self.completed.get(h, 0) >= seq or not any(q <= seq for q, _ in self.queues.get(h, []))

    def cuEventQuery(self, event: Any) -> tuple[Any, ...]:
        return self._wait_event("cuEventQuery", event, block=False)

    def cuEventSynchronize(self, event: Any) -> tuple[Any, ...]:
        return self._wait_event("cuEventSynchronize", event, block=True)

    def _wait_event(self, call: str, event: Any, *, block: bool) -> tuple[Any, ...]:
        """Query (``block`` False) or synchronize: run the stream up to the event's record. A
        stalled stream answers a query NOT_READY; a synchronize on it counts a blocking wait."""
        with self._lock:
            err = self._enter(call, needs_ctx=True)
            if err is not None:
                return (err,)
            e = int(event)
            if e not in self.events:
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            mark = self.events[e]
            if mark is not None and not self._reached(mark[0], self.event_stamp.get(e, 0)):
                if not block:
                    self.not_ready_answers += 1
                    return (CUresult.CUDA_ERROR_NOT_READY,)
                self.device_now[mark[0]] = self.event_stamp.get(e, 0)  # a blocking wait: the device catches up
            if mark is not None and not self._event_done(e):
                if mark[0] in self.stalled:
                    if not block:
                        return (CUresult.CUDA_ERROR_NOT_READY,)
                    self.blocking_waits += 1
                self._run_stream(mark[0], mark[1])
            if mark is not None and self._event_done(e):
                self._done_at(e)
            lost = self._lost()
            return (lost if lost is not None else CUresult.CUDA_SUCCESS,)

    def cuEventDestroy(self, event: Any) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuEventDestroy")
            if err is not None:
                return (err,)
            if self.events.pop(int(event), 0) == 0:
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            self.event_done_ns.pop(int(event), None)
            self.event_stamp.pop(int(event), None)
            return (CUresult.CUDA_SUCCESS,)

    def cuEventElapsedTime(self, start: Any, end: Any) -> tuple[Any, ...]:
        """Milliseconds between the moments the stream got past the two records (the GPU-time
        gate's charge); ``CUDA_ERROR_NOT_READY`` while either is still queued, as the driver."""
        with self._lock:
            err = self._enter("cuEventElapsedTime", needs_ctx=True)
            if err is not None:
                return (err, None)
            e0, e1 = int(start), int(end)
            if e0 not in self.events or e1 not in self.events:
                return (CUresult.CUDA_ERROR_INVALID_HANDLE, None)
            if self.events[e0] is None or self.events[e1] is None:
                return (CUresult.CUDA_ERROR_INVALID_HANDLE, None)  # the driver: not recorded yet
            if not (self._event_done(e0) and self._event_done(e1)):
                return (CUresult.CUDA_ERROR_NOT_READY, None)
            if self.device_clock:
                return (CUresult.CUDA_SUCCESS, max(0, self.event_stamp.get(e1, 0) - self.event_stamp.get(e0, 0)) / 1e6)
            t0, t1 = self._done_at(e0), self._done_at(e1)
            return (CUresult.CUDA_SUCCESS, max(0, t1 - t0) / 1e6)

    def _done_at(self, event: int) -> int:
        """When the stream got past ``event``'s record (first seen done, if not noted before)."""
        return self.event_done_ns.setdefault(event, time.perf_counter_ns())

    # ------------------------------------------------------------- pools

    def cuMemGetAllocationGranularity(self, prop: Any, option: Any) -> tuple[Any, ...]:
        err = self._enter("cuMemGetAllocationGranularity")
        if err is not None:
            return (err, None)
        if not isinstance(prop, CUmemAllocationProp):
            raise TypeError(f"Argument 'prop' is not instance of type CUmemAllocationProp, got {type(prop)!r}")
        if (
            int(prop.type) != CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            or int(prop.location.type) != CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            or self._dev(prop.location.id) is None
        ):
            return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
        return (CUresult.CUDA_SUCCESS, self.granularity)

    def cuMemPoolCreate(self, props: Any) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuMemPoolCreate", needs_ctx=True)
            if err is not None:
                return (err, None)
            if not isinstance(props, self.CUmemPoolProps):  # the other major's struct: refused, as the binding does
                raise TypeError(f"Argument 'poolProps' is not instance of type CUmemPoolProps, got {type(props)!r}")
            d = self._dev(props.location.id)
            if (
                int(props.allocType) != CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
                or int(props.location.type) != CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                or d is None
                or not isinstance(props.maxSize, int)
                or props.maxSize < 0
                or props.maxSize % self.granularity
            ):
                return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
            if not self.pools_supported:
                return (CUresult.CUDA_ERROR_NOT_SUPPORTED, None)
            h = self._new()
            self.pools[h] = _Pool(h, d, self._ctx(), props.maxSize)
            return (CUresult.CUDA_SUCCESS, CUmemoryPool(h))

    def cuMemPoolDestroy(self, pool: Any) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuMemPoolDestroy")
            if err is not None:
                return (err,)
            p = self.pools.get(int(pool))
            if p is None or p.destroyed:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            p.destroyed = True
            if p.live == 0:  # else released once the last allocation is freed, like the driver
                del self.pools[p.handle]
            return (CUresult.CUDA_SUCCESS,)

    def cuMemPoolTrimTo(self, pool: Any, min_bytes_to_keep: int) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuMemPoolTrimTo")
            if err is not None:
                return (err,)
            p = self.pools.get(int(pool))
            if p is None or p.destroyed or not isinstance(min_bytes_to_keep, int) or min_bytes_to_keep < 0:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            self._trim(p, min_bytes_to_keep)
            return (CUresult.CUDA_SUCCESS,)

    def cuMemPoolSetAttribute(self, pool: Any, attr: Any, value: Any) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuMemPoolSetAttribute")
            if err is not None:
                return (err,)
            p = self.pools.get(int(pool))
            if p is None or p.destroyed:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            a = _PoolAttr(int(attr))
            if a in (
                _PoolAttr.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                _PoolAttr.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
                _PoolAttr.CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            ):
                if not isinstance(value, cuuint64_t):  # the bindings insist on the type
                    raise TypeError(f"Argument 'value' for {a.name} must be cuuint64_t, got {type(value)!r}")
                v = int(value)
                if a is _PoolAttr.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
                    p.release_threshold = v
                elif v != 0:
                    return (CUresult.CUDA_ERROR_INVALID_VALUE,)  # the high marks can only be reset
                elif a is _PoolAttr.CU_MEMPOOL_ATTR_USED_MEM_HIGH:
                    p.used_high = p.used
                else:
                    p.reserved_high = p.reserved
                return (CUresult.CUDA_SUCCESS,)
            if a in (
                _PoolAttr.CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES,
                _PoolAttr.CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC,
                _PoolAttr.CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
            ):
                return (CUresult.CUDA_SUCCESS,)
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)

    def cuMemPoolGetAttribute(self, pool: Any, attr: Any) -> tuple[Any, ...]:
        err = self._enter("cuMemPoolGetAttribute")
        if err is not None:
            return (err, None)
        p = self.pools.get(int(pool))
        if p is None or p.destroyed:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
        if int(attr) not in {int(m) for m in self.CUmemPool_attribute}:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, None)  # e.g. MAX_POOL_SIZE from a 12.x driver
        a = _PoolAttr(int(attr))
        values = {
            _PoolAttr.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: p.release_threshold,
            _PoolAttr.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: p.reserved,
            _PoolAttr.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: p.reserved_high,
            _PoolAttr.CU_MEMPOOL_ATTR_USED_MEM_CURRENT: p.used,
            _PoolAttr.CU_MEMPOOL_ATTR_USED_MEM_HIGH: p.used_high,
            # what the driver made of the maxSize asked for: it may round it up (pool_size_granularity)
            _PoolAttr.CU_MEMPOOL_ATTR_MAX_POOL_SIZE: _round_up(p.max_size, self.pool_size_granularity)
            if p.max_size else 0,
        }
        if a not in values:
            return (CUresult.CUDA_SUCCESS, 1)  # the reuse flags: int
        return (CUresult.CUDA_SUCCESS, cuuint64_t(values[a]))

    def cuMemAllocFromPoolAsync(self, bytesize: int, pool: Any, stream: Any) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuMemAllocFromPoolAsync", needs_ctx=True)
            if err is not None:
                return (err, None)
            p = self.pools.get(int(pool))
            if p is None or p.destroyed or bytesize <= 0:
                return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
            if not self._stream_ok(stream):
                return (CUresult.CUDA_ERROR_INVALID_HANDLE, None)
            charged = _round_up(bytesize, _ALIGN)
            used = p.used + charged
            if p.max_size and used > _round_up(p.max_size, self.pool_size_granularity):
                return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
            need = _round_up(used, self.granularity)
            grow = need - p.reserved
            if grow > 0:
                if self.device_reserved(p.device) + grow > self.memory_bytes:
                    return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
                p.reserved = need
                p.reserved_high = max(p.reserved_high, need)
            p.used = used
            p.used_high = max(p.used_high, used)
            p.live += 1
            return (CUresult.CUDA_SUCCESS, CUdeviceptr(self._add_alloc(bytesize, charged, p, p.device)))

    def cuMemFreeAsync(self, dptr: Any, stream: Any) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuMemFreeAsync", needs_ctx=True)
            if err is not None:
                return (err,)
            a = self.allocs.get(int(dptr))
            if a is None or a.pool is None or a.freeing:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            if not self._stream_ok(stream):
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            a.freeing = True

            def run_free() -> None:  # stream-ordered: the bytes stay outstanding until it has run
                if self.allocs.get(a.base) is not a:
                    return  # gone with its context
                self._drop_alloc(a.base)
                p = a.pool
                assert p is not None
                p.used -= a.charged
                p.live -= 1
                if p.destroyed and p.live == 0:
                    self.pools.pop(p.handle, None)

            self._enqueue(stream, run_free)
            return (CUresult.CUDA_SUCCESS,)

    def cuMemAlloc(self, bytesize: int) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuMemAlloc", needs_ctx=True)
            if err is not None:
                return (err, None)
            d = self._ctx_device(self._ctx())
            assert d is not None
            if bytesize <= 0:
                return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
            charged = _round_up(bytesize, self.granularity)
            if self.device_reserved(d) + charged > self.memory_bytes:
                return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
            self.raw_reserved[d] += charged
            return (CUresult.CUDA_SUCCESS, CUdeviceptr(self._add_alloc(bytesize, charged, None, d)))

    def cuMemFree(self, dptr: Any) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuMemFree", needs_ctx=True)
            if err is not None:
                return (err,)
            a = self.allocs.get(int(dptr))
            if a is None or a.pool is not None:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            self._drop_alloc(a.base)
            self.raw_reserved[a.device] -= a.charged
            return (CUresult.CUDA_SUCCESS,)

    # ------------------------------------------------------------- copies

    def cuMemcpyHtoDAsync(self, dst: Any, src: Any, count: int, stream: Any) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuMemcpyHtoDAsync", needs_ctx=True)
            if err is not None:
                return (err,)
            if not self._stream_ok(stream):
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            found = self._resolve(int(dst), count)
            if found is None:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            a, off = found
            if isinstance(src, int):  # pinned host memory: read by DMA when the stream gets there
                def run_copy() -> None:
                    a.buf()[off : off + count] = ctypes.string_at(src, count)
            else:
                data = memoryview(src).cast("B")[:count]
                if len(data) != count:
                    return (CUresult.CUDA_ERROR_INVALID_VALUE,)
                snapshot = bytes(data)  # pageable memory is staged at the call

                def run_copy() -> None:
                    a.buf()[off : off + count] = snapshot

            self._enqueue(stream, run_copy)
            return (CUresult.CUDA_SUCCESS,)

    def cuMemcpyDtoHAsync(self, dst: Any, src: Any, count: int, stream: Any) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuMemcpyDtoHAsync", needs_ctx=True)
            if err is not None:
                return (err,)
            if not self._stream_ok(stream):
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            found = self._resolve(int(src), count)
            if found is None:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            a, off = found
            if isinstance(dst, int):  # a host address (pinned staging, worker.regions)
                def run_to_address() -> None:
                    ctypes.memmove(dst, bytes(a.buf()[off : off + count]), count)

                self._enqueue(stream, run_to_address)
                if not self._is_pinned(dst, count):
                    self._finish_pageable(stream)
                return (CUresult.CUDA_SUCCESS,)
            out = memoryview(dst).cast("B")
            if out.readonly or len(out) < count:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)

            def run_to_buffer() -> None:  # the host buffer is written when the stream gets there
                out[:count] = a.buf()[off : off + count]

            self._enqueue(stream, run_to_buffer)
            self._finish_pageable(stream)  # a Python buffer is pageable memory
            return (CUresult.CUDA_SUCCESS,)

    def _is_pinned(self, addr: int, count: int) -> bool:
        """Whether ``[addr, addr + count)`` lies in page-locked memory (cuMemHostRegister / cuMemAllocHost)."""
        registered = getattr(self, "host_registered", {})
        return any(base <= addr and addr + count <= base + size for base, size in registered.items())

    def _finish_pageable(self, stream: Any) -> None:
        """The driver's rule for a device-to-host copy into *pageable* memory: "the function will
        return only once the copy has completed" (CUDA driver API, API synchronization behavior) -
        so the stream runs up to this copy before the call returns. Only a copy into page-locked
        memory stays queued (a stalled stream keeps it queued too: the real call would block)."""
        h = 0 if stream is None else int(stream)
        if h and h not in self.stalled:
            self._run_stream(h, self.enqueued.get(h))

    # ------------------------------------------------------------- page-locked host memory
    #
    # Kept apart from the rest (state made on first use): cuMemHostRegister /
    # cuMemHostUnregister of a caller's range, and cuMemAllocHost / cuMemFreeHost.
    # ``host_registered`` maps address -> bytes of what is registered now.

    @property
    def host_registered(self) -> dict[int, int]:
        ranges: dict[int, int] = self.__dict__.setdefault("_host_ranges", {})
        return ranges

    def cuMemHostRegister(self, p: Any, bytesize: int, flags: int) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuMemHostRegister", needs_ctx=True)
            if err is not None:
                return (err,)
            if not isinstance(p, int) or p <= 0 or bytesize <= 0 or flags & ~0xF:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            for base, size in self.host_registered.items():
                if base < p + bytesize and p < base + size:
                    return (CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,)
            self.host_registered[p] = bytesize
            return (CUresult.CUDA_SUCCESS,)

    def cuMemHostUnregister(self, p: Any) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuMemHostUnregister", needs_ctx=True)
            if err is not None:
                return (err,)
            if self.host_registered.pop(int(p), None) is None:
                return (CUresult.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,)
            if any(self.queues.values()):
                # a queued copy may still DMA from/to these pages: unregistering them under it is
                # undefined behaviour on hardware (the caller must synchronize first)
                self.unregistered_under_queued_work = getattr(self, "unregistered_under_queued_work", 0) + 1
            return (CUresult.CUDA_SUCCESS,)

    def cuMemAllocHost(self, bytesize: int) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuMemAllocHost", needs_ctx=True)
            if err is not None:
                return (err, None)
            if bytesize <= 0:
                return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
            block = (ctypes.c_char * bytesize)()
            addr = ctypes.addressof(block)
            self.__dict__.setdefault("_host_allocs", {})[addr] = block
            self.host_registered[addr] = bytesize
            return (CUresult.CUDA_SUCCESS, addr)

    def cuMemFreeHost(self, p: Any) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuMemFreeHost", needs_ctx=True)
            if err is not None:
                return (err,)
            if self.__dict__.get("_host_allocs", {}).pop(int(p), None) is None:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            self.host_registered.pop(int(p), None)
            return (CUresult.CUDA_SUCCESS,)

    # ------------------------------------------------------------- modules and kernels

    def cuModuleLoadData(self, image: Any) -> tuple[Any, ...]:
        with self._lock:
            err = self._enter("cuModuleLoadData", needs_ctx=True)
            if err is not None:
                return (err, None)
            raw = bytes(image)
            if not raw.startswith((b"FAKECUBIN\n", b"FAKEPTX\n")):
                return (CUresult.CUDA_ERROR_INVALID_IMAGE, None)
            sigs = json.loads(raw.split(b"\n", 1)[1].rstrip(b"\0 ").decode())
            d = self._ctx_device(self._ctx())
            assert d is not None
            if self.device_reserved(d) + self.module_bytes > self.memory_bytes:
                return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
            h = self._new()
            self.modules[h] = {k.encode(): v for k, v in sigs.items()}
            if self.module_bytes:
                self.module_reserved[h] = (d, self.module_bytes)
            return (CUresult.CUDA_SUCCESS, CUmodule(h))

    def cuModuleGetFunction(self, hmod: Any, name: bytes) -> tuple[Any, ...]:
        err = self._enter("cuModuleGetFunction", needs_ctx=True)
        if err is not None:
            return (err, None)
        mod = self.modules.get(int(hmod))
        if mod is None:
            return (CUresult.CUDA_ERROR_INVALID_HANDLE, None)
        if name not in mod:
            return (CUresult.CUDA_ERROR_NOT_FOUND, None)
        h = self._new()
        self.functions[h] = (int(hmod), name, mod[name])
        return (CUresult.CUDA_SUCCESS, CUfunction(h))

    def cuModuleUnload(self, hmod: Any) -> tuple[Any, ...]:
        err = self._enter("cuModuleUnload", needs_ctx=True)
        if err is not None:
            return (err,)
        if self.modules.pop(int(hmod), None) is None:
            return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
        self.module_reserved.pop(int(hmod), None)
        for h in [h for h, (m, _, _) in self.functions.items() if m == int(hmod)]:
            del self.functions[h]
        return (CUresult.CUDA_SUCCESS,)

    def cuLaunchKernel(
        self, f: Any, gx: int, gy: int, gz: int, bx: int, by: int, bz: int,
        shared: int, stream: Any, kernel_params: Any, extra: Any,
    ) -> tuple[Any, ...]:
        # the bindings convert every argument before they call the driver: a wrong type is a
        # TypeError whatever the state (``extra`` is a pointer: 0, never None)
        if not isinstance(extra, int):
            raise TypeError("an integer is required")
        if not (isinstance(kernel_params, tuple) and len(kernel_params) == 2 and extra == 0):
            raise TypeError("Argument 'kernelParams' is not a valid type: tuple[tuple[Any, ...], tuple[Any, ...]]")
        with self._lock:
            err = self._enter("cuLaunchKernel", needs_ctx=True)
            if err is not None:
                return (err,)
            fn = self.functions.get(int(f))
            if fn is None:
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            if not self._stream_ok(stream):
                return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
            _, name, kinds = fn
            if (gy, gz, by, bz) != (1, 1, 1, 1) or not 1 <= gx <= 2**31 - 1 or not 1 <= bx <= 1024:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            values, types = kernel_params
            if len(values) != len(types) or len(values) != len(kinds):
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            for kind, t in zip(kinds, types):
                if t not in _CTYPE_OF.get(kind, ()):
                    return (CUresult.CUDA_ERROR_INVALID_VALUE,)  # the launch does not match the source
            self.launches.append((name, gx, bx))
            dev = self._ctx_device(self._ctx())
            assert dev is not None

            def run_kernel() -> None:
                if not self._run(name, gx, bx, values):
                    # the launch itself succeeded; the fault shows at the next call that waits
                    # (a synchronize, a query) and at every call after it: the context is lost
                    self.sticky.setdefault(dev, CUresult.CUDA_ERROR_ILLEGAL_ADDRESS)

            self._enqueue(stream, run_kernel, self.launch_ns)
            return (CUresult.CUDA_SUCCESS,)

    def _f32(self, addr: int, n: int, dtype: str = "float32") -> Any:
        import numpy as np

        size = np.dtype(dtype).itemsize
        found = self._resolve(int(addr), n * size)
        if found is None:
            return None
        a, off = found
        return np.frombuffer(a.buf(), dtype=dtype, count=n, offset=off)

    def _run(self, name: bytes, grid: int, block: int, args: tuple[Any, ...]) -> bool:
        """Run a kernel by name (``KERNELS``) with numpy; False on an out-of-bounds pointer.

        Names not in ``KERNELS`` are the WASM ABI's tensor-op kernels
        (worker.backends.cuda_ops), which live in their own fake module.
        """
        run = KERNELS.get(name)
        if run is None:
            from tests.helpers.fake_tensor_kernels import run_tensor_kernel

            return run_tensor_kernel(self, name, grid, block, args)
        return run(self, grid, block, args)

    # ------------------------------------------------------------- NVRTC

    def _nvrtc_enter(self, name: str) -> nvrtcResult | None:
        self.calls.append(name)
        if self.mode == "no-libcuda":
            raise DynamicLibNotFoundError('Failure finding "libnvrtc.so" (fake)')
        queued = self._fail.get(name)
        if queued:
            return nvrtcResult(queued.pop(0))
        return None

    def nvrtcVersion(self) -> tuple[Any, ...]:
        err = self._nvrtc_enter("nvrtcVersion")
        return (err, 0, 0) if err is not None else (nvrtcResult.NVRTC_SUCCESS, 13, 0)

    def nvrtcGetErrorString(self, result: Any) -> tuple[Any, ...]:
        self.calls.append("nvrtcGetErrorString")
        try:
            return (nvrtcResult.NVRTC_SUCCESS, nvrtcResult(int(result)).name.encode())
        except ValueError:
            return (nvrtcResult.NVRTC_SUCCESS, b"NVRTC_ERROR unknown")

    def nvrtcCreateProgram(self, src: bytes, name: bytes, num_headers: int, headers: Any, include_names: Any) -> tuple[Any, ...]:
        err = self._nvrtc_enter("nvrtcCreateProgram")
        if err is not None:
            return (err, None)
        if not isinstance(src, bytes) or num_headers != len(headers or []):
            return (nvrtcResult.NVRTC_ERROR_INVALID_INPUT, None)
        h = self._new()
        self.programs[h] = {"src": src.decode(), "image": None, "log": b"", "options": []}
        return (nvrtcResult.NVRTC_SUCCESS, nvrtcProgram(h))

    def nvrtcCompileProgram(self, prog: Any, num_options: int, options: Any) -> tuple[Any, ...]:
        err = self._nvrtc_enter("nvrtcCompileProgram")
        if err is not None:
            return (err,)
        p = self.programs.get(int(prog))
        if p is None:
            return (nvrtcResult.NVRTC_ERROR_INVALID_PROGRAM,)
        opts = list(options or [])
        if num_options != len(opts) or not all(isinstance(o, bytes) for o in opts):
            return (nvrtcResult.NVRTC_ERROR_INVALID_INPUT,)
        p["options"] = opts
        self.compile_options.append(opts)
        arch = next((o.split(b"=", 1)[1].decode() for o in opts if o.startswith(b"--gpu-architecture=")), "compute_52")
        known = self.nvrtc_archs
        if known is not None and arch not in known:
            p["log"] = f"nvrtc: error: invalid value for --gpu-architecture (-arch): {arch}".encode()
            return (nvrtcResult.NVRTC_ERROR_INVALID_OPTION,)
        if self.real_nvrtc:
            compiled = compile_with_real_nvrtc(p["src"], opts)
            if compiled is not None:
                ok, out = compiled
                self.real_compiles += 1
                if not ok:
                    p["log"] = out
                    return (nvrtcResult.NVRTC_ERROR_COMPILATION,)
                p["ptx"] = out
        sigs = {m.group(1): [_param_kind(d) for d in m.group(2).split(",") if d.strip()]
                for m in _SIG_RE.finditer(p["src"])}
        if not sigs:
            p["log"] = b"error: no kernels found (fake)"
            return (nvrtcResult.NVRTC_ERROR_COMPILATION,)
        kind = b"FAKECUBIN\n" if arch.startswith("sm_") else b"FAKEPTX\n"
        p["image"] = kind + json.dumps(sigs).encode() + b"\0"
        p["arch"] = arch
        return (nvrtcResult.NVRTC_SUCCESS,)

    def _image_size(self, name: str, prog: Any, want: str) -> tuple[Any, ...]:
        err = self._nvrtc_enter(name)
        if err is not None:
            return (err, None)
        p = self.programs.get(int(prog))
        if p is None or p["image"] is None or not p["arch"].startswith(want):
            return (nvrtcResult.NVRTC_ERROR_INVALID_INPUT, None)
        return (nvrtcResult.NVRTC_SUCCESS, len(p["image"]))

    def _image_get(self, name: str, prog: Any, out: bytes | bytearray, want: str) -> tuple[Any, ...]:
        err = self._nvrtc_enter(name)
        if err is not None:
            return (err,)
        p = self.programs.get(int(prog))
        if p is None or p["image"] is None or not p["arch"].startswith(want):
            return (nvrtcResult.NVRTC_ERROR_INVALID_INPUT,)
        _fill_bytes(out, p["image"])
        return (nvrtcResult.NVRTC_SUCCESS,)

    def nvrtcGetCUBINSize(self, prog: Any) -> tuple[Any, ...]:
        return self._image_size("nvrtcGetCUBINSize", prog, "sm_")

    def nvrtcGetCUBIN(self, prog: Any, cubin: bytes | bytearray) -> tuple[Any, ...]:
        return self._image_get("nvrtcGetCUBIN", prog, cubin, "sm_")

    def nvrtcGetPTXSize(self, prog: Any) -> tuple[Any, ...]:
        return self._image_size("nvrtcGetPTXSize", prog, "compute_")

    def nvrtcGetPTX(self, prog: Any, ptx: bytes | bytearray) -> tuple[Any, ...]:
        return self._image_get("nvrtcGetPTX", prog, ptx, "compute_")

    def nvrtcGetProgramLogSize(self, prog: Any) -> tuple[Any, ...]:
        err = self._nvrtc_enter("nvrtcGetProgramLogSize")
        if err is not None:
            return (err, None)
        p = self.programs.get(int(prog))
        if p is None:
            return (nvrtcResult.NVRTC_ERROR_INVALID_PROGRAM, None)
        return (nvrtcResult.NVRTC_SUCCESS, len(p["log"]) + 1)

    def nvrtcGetProgramLog(self, prog: Any, log: bytes | bytearray) -> tuple[Any, ...]:
        err = self._nvrtc_enter("nvrtcGetProgramLog")
        if err is not None:
            return (err,)
        p = self.programs.get(int(prog))
        if p is None:
            return (nvrtcResult.NVRTC_ERROR_INVALID_PROGRAM,)
        _fill_bytes(log, p["log"] + b"\0")
        return (nvrtcResult.NVRTC_SUCCESS,)

    def nvrtcDestroyProgram(self, prog: Any) -> tuple[Any, ...]:
        err = self._nvrtc_enter("nvrtcDestroyProgram")
        if err is not None:
            return (err,)
        if self.programs.pop(int(prog), None) is None:
            return (nvrtcResult.NVRTC_ERROR_INVALID_PROGRAM,)
        return (nvrtcResult.NVRTC_SUCCESS,)


_real_nvrtc_state: list[Any] = []  # [module or None], probed once
_compiled: dict[tuple[str, tuple[bytes, ...]], tuple[bool, bytes]] = {}
#: a folder where every process of one test run keeps the real NVRTC's results (the suite sets it to a
#: folder of the run's temp root: tests/conftest.py; never a folder kept across runs, whose results
#: another NVRTC made); unset or empty, each process compiles for itself
NVRTC_CACHE_ENV = "FAKE_CUDA_NVRTC_CACHE"


def real_nvrtc_module() -> Any | None:
    """``cuda.bindings.nvrtc`` when libnvrtc loads here (the ``cuda`` extra's wheel), else None."""
    if not _real_nvrtc_state:
        try:
            from cuda.bindings import nvrtc

            err, *_ = nvrtc.nvrtcVersion()
            _real_nvrtc_state.append(nvrtc if not err else None)
        except (ImportError, RuntimeError):  # not installed, or libnvrtc not found
            _real_nvrtc_state.append(None)
    return _real_nvrtc_state[0]


def compile_with_real_nvrtc(src: str, options: list[bytes]) -> tuple[bool, bytes] | None:
    """Compile ``src`` to PTX with the real NVRTC: (True, ptx) or (False, log); None without NVRTC.

    ``--gpu-architecture=sm_XY`` becomes ``compute_XY`` (PTX is all that can be
    checked without a device); results are cached per (source, options): in this process, and
    across a test run's processes through the folder ``FAKE_CUDA_NVRTC_CACHE`` names
    (:func:`_nvrtc_cache_path`).
    """
    if _real_nvrtc_state and _real_nvrtc_state[0] is None:
        return None  # probed: no NVRTC in this process
    opts = tuple(o.replace(b"=sm_", b"=compute_") for o in options)
    key = (src, opts)
    if key in _compiled:
        return _compiled[key]
    shared_path = _nvrtc_cache_path(src, opts)
    kept = _read_nvrtc_result(shared_path)
    if kept is not None:  # another process of this run compiled it: NVRTC is not even loaded here
        _compiled[key] = kept
        return kept
    mod = real_nvrtc_module()
    if mod is None:
        return None
    result = _compile_with(mod, src, opts)
    if result is not None:
        _compiled[key] = result
        _write_nvrtc_result(shared_path, result)
    return result


def _compile_with(mod: Any, src: str, opts: tuple[bytes, ...]) -> tuple[bool, bytes] | None:
    """One real NVRTC compile: (True, ptx), (False, log), or None when NVRTC would not make a program."""
    err, prog = mod.nvrtcCreateProgram(src.encode(), b"twt_fake_check.cu", 0, [], [])
    if err:
        return None
    try:
        (err,) = mod.nvrtcCompileProgram(prog, len(opts), list(opts))
        if err:
            _, size = mod.nvrtcGetProgramLogSize(prog)
            log = bytearray(size)
            mod.nvrtcGetProgramLog(prog, log)
            result = (False, bytes(log).rstrip(b"\0 "))
        else:
            _, size = mod.nvrtcGetPTXSize(prog)
            ptx = bytearray(size)
            mod.nvrtcGetPTX(prog, ptx)
            result = (True, bytes(ptx).rstrip(b"\0"))
    finally:
        mod.nvrtcDestroyProgram(prog)
    return result


def _nvrtc_cache_path(src: str, opts: tuple[bytes, ...]) -> str | None:
    """Where one run's processes share the real NVRTC's result for ``src`` compiled with ``opts``.

    Why: every process that loads the kernels through the fake (a cuda-backend worker, a GPU check
    child) compiled the same two sources with the real NVRTC (~65 ms of CPU each, after ~70 ms of
    importing the bindings and loading the library; ~60 times in one hardware-check dry run). The first
    compile of each source in a run is real, and its result (PTX, or the error log) is the one every
    other process reads, without loading NVRTC at all: keyed on the source and the options, so a
    changed kernel compiles again. The folder is one run's (the suite's is in the run's temp root,
    removed with it): within a run the NVRTC library cannot change. None (no sharing) unless
    :data:`NVRTC_CACHE_ENV` names a folder.
    """
    folder = os.environ.get(NVRTC_CACHE_ENV)
    if not folder:
        return None
    import hashlib

    digest = hashlib.sha256(src.encode())
    for o in opts:
        digest.update(b"\0" + o)
    return os.path.join(folder, digest.hexdigest() + ".nvrtc")


def _read_nvrtc_result(path: str | None) -> tuple[bool, bytes] | None:
    """A result another process of the run wrote (a complete file: written whole, then renamed)."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if data[:1] not in (b"1", b"0"):
        return None
    return data[:1] == b"1", data[1:]


def _write_nvrtc_result(path: str | None, result: tuple[bool, bytes]) -> None:
    """Keep ``result`` for the run's other processes; a folder this process cannot write (another
    user's) only means they compile for themselves."""
    if path is None:
        return
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write((b"1" if result[0] else b"0") + result[1])
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


# ----------------------------------------------------------------- kernels, by name

#: what each kernel does, in numpy: ``fn(fake, grid, block, args) -> False`` on a bad pointer
#: (which the launch turns into a sticky CUDA_ERROR_ILLEGAL_ADDRESS). A new kernel in
#: worker/backends/kernels.py gets its twin here with ``@fake_kernel(b"name")``.
KERNELS: dict[bytes, Callable[[FakeDriver, int, int, tuple[Any, ...]], bool]] = {}


def fake_kernel(name: bytes) -> Callable[[Callable[[FakeDriver, int, int, tuple[Any, ...]], bool]],
                                         Callable[[FakeDriver, int, int, tuple[Any, ...]], bool]]:
    def register(fn: Callable[[FakeDriver, int, int, tuple[Any, ...]], bool]) -> Callable[
            [FakeDriver, int, int, tuple[Any, ...]], bool]:
        KERNELS[name] = fn
        return fn
    return register


@fake_kernel(b"twt_fill_f32")
def _fill_f32(fake: FakeDriver, grid: int, block: int, args: tuple[Any, ...]) -> bool:
    import numpy as np

    ptr, value, n = args
    out = fake._f32(ptr, n)
    if out is None:
        return False
    out.fill(np.float32(value))
    return True


@fake_kernel(b"twt_axpy_f32")
def _axpy_f32(fake: FakeDriver, grid: int, block: int, args: tuple[Any, ...]) -> bool:
    import numpy as np

    n, a, x, y = args
    xv, yv = fake._f32(x, n), fake._f32(y, n)
    if xv is None or yv is None:
        return False
    t = np.multiply(xv, np.float32(a), dtype=np.float32)  # a copy: x may be y
    np.add(yv, t, out=yv)
    return True


@fake_kernel(b"twt_sum_f32")
def _sum_f32(fake: FakeDriver, grid: int, block: int, args: tuple[Any, ...]) -> bool:
    import numpy as np

    ptr, n, partial = args
    xv, out = fake._f32(ptr, n), fake._f32(partial, grid, "float64")
    if xv is None or out is None:
        return False
    which = (np.arange(n, dtype=np.int64) // block) % grid  # the grid-stride partition
    out[:] = np.bincount(which, weights=xv.astype(np.float64), minlength=grid)
    return True


def _fill_bytes(out: bytes | bytearray, data: bytes) -> None:
    """Write into a caller's buffer in place, as the bindings' ``char *`` out-parameters do.

    A ``bytes`` object is written in place too (as the real bindings do) - which is why the
    backend must hand a ``bytearray``: ``b" " * 1`` is CPython's one shared ``b" "`` object.
    """
    if not isinstance(out, (bytes, bytearray)) or len(out) < len(data):
        raise TypeError("output buffer must be a bytes-like object of the reported size")
    if isinstance(out, bytearray):
        out[: len(data)] = data
        return
    addr = ctypes.cast(ctypes.c_char_p(out), ctypes.c_void_p).value
    assert addr is not None
    ctypes.memmove(addr, data, len(data))


# ----------------------------------------------------------------- module-level access

_instance: FakeDriver | None = None
_instance_lock = threading.Lock()


def instance() -> FakeDriver:
    """This process's fake (built from ``FAKE_CUDA_*`` on first use).

    With ``FAKE_CUDA_RECORD_CALLS=<dir>`` it records the arguments of every
    driver and NVRTC call into ``<dir>/<pid>.calls`` (see :class:`CallRecorder`).
    """
    global _instance
    with _instance_lock:
        if _instance is None:
            _instance = FakeDriver.from_env()
            record_dir = os.environ.get("FAKE_CUDA_RECORD_CALLS")
            if record_dir:
                _instance = CallRecorder(_instance, record_dir)  # type: ignore[assignment]
        return _instance


class Buf:
    """A recorded data buffer: its kind and a short sample (the replay needs types, not bytes)."""

    def __init__(self, kind: str, data: bytes) -> None:
        self.kind = kind
        self.data = data

    def rebuild(self) -> Any:
        if self.kind == "bytes":
            return bytes(self.data)
        if self.kind == "ndarray":
            import numpy as np

            return np.frombuffer(bytearray(self.data), dtype=np.uint8)
        if self.kind == "memoryview":
            return memoryview(bytearray(self.data))
        return bytearray(self.data)


def _snapshot(value: Any) -> Any:
    """A picklable copy of one call argument (buffers shortened to a sample of their kind)."""
    if isinstance(value, (bytes, bytearray, memoryview)) or type(value).__name__ == "ndarray":
        kind = type(value).__name__
        raw = memoryview(value).cast("B")[:64].tobytes() if not isinstance(value, bytes) else value[:64]
        return Buf(kind, raw)
    if isinstance(value, tuple):
        return tuple(_snapshot(v) for v in value)
    if isinstance(value, list):
        return [_snapshot(v) for v in value]
    return value


def _shape(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_shape(v) for v in value))
    return type(value).__name__


class CallRecorder:
    """Wraps a :class:`FakeDriver`: every ``cu*`` / ``nvrtc*`` call's arguments go to a file.

    The replay test (tests/worker/backends/test_replay_bindings.py) feeds them into the
    real ``cuda.bindings``, whose argument conversion runs before it loads
    libcuda/libnvrtc: a wrongly typed argument shows there as a ``TypeError``.
    Each distinct (call, argument types) shape is kept a few times only, and
    every record is flushed at once (workers end with ``os._exit``).
    """

    def __init__(self, fake: FakeDriver, record_dir: str) -> None:
        self._fake = fake
        self._seen: dict[tuple[Any, ...], int] = {}
        os.makedirs(record_dir, exist_ok=True)
        self._file = open(os.path.join(record_dir, f"{os.getpid()}.calls"), "ab")
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._fake, name)
        if not name.startswith(("cu", "nvrtc")) or not callable(value) or isinstance(value, type):
            return value

        def recorded(*args: Any) -> Any:
            self._record(name, args)
            return value(*args)

        return recorded

    def _record(self, name: str, args: tuple[Any, ...]) -> None:
        import pickle

        key = (name, _shape(args))
        with self._lock:
            n = self._seen.get(key, 0)
            if n >= 3:
                return
            self._seen[key] = n + 1
            pickle.dump((name, _snapshot(args)), self._file)
            self._file.flush()


def reset(driver: FakeDriver | None = None) -> None:
    """Replace (or drop) this process's fake - for tests that import the module by name."""
    global _instance
    with _instance_lock:
        _instance = driver


def __getattr__(name: str) -> Any:
    if (name.startswith(("cu", "nvrtc")) and hasattr(FakeDriver, name)) or name in _VERSIONED:
        return getattr(instance(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
