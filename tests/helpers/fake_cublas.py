"""A fake ``nvmath.bindings.cublas`` over the fake CUDA driver's memory, for tests without a GPU.

It has the bindings' shapes - ``create() -> int``, ``sgemm(handle, transa,
transb, m, n, k, alpha_ptr, a, lda, b, ldb, beta_ptr, c, ldc)`` with device
addresses as ints and ``alpha``/``beta`` as host pointers, failures raised as
``cuBLASError`` carrying a ``status`` - and behaves like cuBLAS where the
backend depends on it:

* a handle belongs to the context current at ``create`` and must be used
  from it; ``set_stream`` needs a live stream of the fake driver and resets
  the workspace to the default one (as cuBLAS 12 does);
* ``set_workspace`` needs ``(0, 0)`` or a live allocation at least that
  large; a GEMM run while the handle is on its *default* workspace is
  recorded in ``default_workspace_gemms`` (the backend must never let that
  happen: the default would be allocated outside the tenant's pool);
* ``sgemm`` checks the BLAS argument rules (``lda >= max(1, rows)`` ...)
  with ``INVALID_VALUE`` at the call, then *queues* the product on the
  handle's stream (as the real one launches kernels and returns): it reads
  the column-major operands from fake device memory when the stream gets
  there and computes ``C = alpha*A@B + beta*C`` with numpy (float32); an
  operand outside any allocation is then a sticky ``CUDA_ERROR_ILLEGAL_ADDRESS``
  that surfaces at the next synchronize or query, as a kernel fault does;
* ``create`` takes ``default_pool_bytes`` of device memory (the default
  workspace pool cuBLAS allocates with the handle) until ``destroy``.

Arguments are converted as the real (Cython) bindings convert them, before
anything else: a handle, pointer or stream must be a Python integer (an
``int``, an ``IntEnum``; not a ``ctypes`` object, not a ``CUstream``) that
fits ``intptr_t``, sizes fit ``int`` (``int64_t`` for the ``_64`` calls), a
workspace size is a non-negative ``size_t``: ``TypeError`` / ``OverflowError``
otherwise, as nvmath raises them. :class:`CublasRecorder` records every call's
arguments for the replay into the real ``nvmath.bindings.cublas``
(tests/helpers/replay_bindings.py).

Use: ``FakeCublas(driver)`` as the ``cublas=`` of
:class:`worker.backends.cuda.CudaBackend` (a host without nvmath-python is
a module name that does not import).
"""

from __future__ import annotations

import ctypes
import enum
import os
import pickle
import threading
from typing import Any

from tests.helpers.fake_cuda import CUresult, FakeDriver

__all__ = ["SIGNATURES", "CublasRecorder", "FakeCublas", "convert_args"]


class Status(enum.IntEnum):
    SUCCESS = 0
    NOT_INITIALIZED = 1
    ALLOC_FAILED = 3
    INVALID_VALUE = 7
    ARCH_MISMATCH = 8
    MAPPING_ERROR = 11
    EXECUTION_FAILED = 13
    INTERNAL_ERROR = 14
    NOT_SUPPORTED = 15


class Operation(enum.IntEnum):
    N = 0
    T = 1
    C = 2


class PointerMode(enum.IntEnum):
    HOST = 0
    DEVICE = 1


class cuBLASError(Exception):
    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"{Status(status).name} ({status})")


_DEFAULT = object()

#: the C types of each binding's parameters, as nvmath.bindings.cublas declares them (``cublas.pyi``)
_P, _I, _L, _S = "intptr_t", "int", "int64_t", "size_t"
SIGNATURES: dict[str, tuple[str, ...]] = {
    "create": (),
    "destroy": (_P,),
    "get_version": (_P,),
    "set_stream": (_P, _P),
    "set_pointer_mode": (_P, _I),
    "set_workspace": (_P, _P, _S),
    "sgemm": (_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _I, _P, _P, _I),
    "sgemm_64": (_P, _I, _I, _L, _L, _L, _P, _P, _L, _P, _L, _P, _P, _L),
    "sgemm_strided_batched": (_P, _I, _I, _I, _I, _I, _P, _P, _I, _L, _P, _I, _L, _P, _P, _I, _L, _I),
    "gemm_ex": (_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _I, _I),
}
#: cudaDataType_t -> numpy dtype name (bf16 through ml_dtypes)
_CUDA_TYPES = {0: "float32", 2: "float16", 14: "bfloat16"}
_COMPUTE_32F = 68
_RANGES = {_P: (-(1 << 63), 1 << 63), _L: (-(1 << 63), 1 << 63), _I: (-(1 << 31), 1 << 31), _S: (0, 1 << 64)}


def convert_args(name: str, args: tuple[Any, ...]) -> tuple[int, ...]:
    """``args`` converted to the C parameters of binding ``name`` as Cython does, or its error."""
    kinds = SIGNATURES[name]
    if len(args) != len(kinds):
        raise TypeError(f"{name}() takes exactly {len(kinds)} positional arguments ({len(args)} given)")
    out = []
    for value, kind in zip(args, kinds):
        # Cython's conversions: an ``intptr_t`` takes a Python int only (a bool, an IntEnum; not a
        # numpy integer, not a CUstream); the other integer types also take what defines ``__int__``
        # (a numpy integer, a float - truncated), never a ctypes object or an ``__index__``-only one
        if isinstance(value, int):
            v = int(value)
        elif kind != _P and hasattr(type(value), "__int__"):
            v = int(value)
        else:
            raise TypeError("an integer is required")
        lo, hi = _RANGES[kind]
        if not lo <= v < hi:
            raise OverflowError(f"can't convert {'negative ' if v < 0 else ''}value to {kind}")
        out.append(v)
    return tuple(out)


class FakeCublas:
    """Module-shaped: the backend calls ``create``, ``set_stream``, ``set_workspace``, ``sgemm`` ... on it."""

    Status = Status
    Operation = Operation
    PointerMode = PointerMode
    cuBLASError = cuBLASError

    def __init__(self, driver: FakeDriver, *, default_pool_bytes: int = 0) -> None:
        self.driver = driver
        self.default_pool_bytes = default_pool_bytes
        self.__name__ = "tests.helpers.fake_cublas"
        self.handles: dict[int, dict[str, Any]] = {}
        self.calls: list[str] = []
        self.gemms: list[tuple[int, int, int]] = []  # (m, n, k) as cuBLAS saw them (column-major)
        self.default_workspace_gemms = 0
        self.fail: dict[str, list[int]] = {}
        self._next = 0x5000

    def fail_next(self, name: str, status: Status, times: int = 1) -> None:
        self.fail.setdefault(name, []).extend([int(status)] * times)

    def _enter(self, name: str, args: tuple[Any, ...] = ()) -> None:
        convert_args(name, args)  # a wrongly typed argument fails first, as in the bindings
        self.calls.append(name)
        queued = self.fail.get(name)
        if queued:
            raise cuBLASError(queued.pop(0))

    def _handle(self, handle: int) -> dict[str, Any]:
        h = self.handles.get(handle)
        if h is None:
            raise cuBLASError(Status.NOT_INITIALIZED)
        if self.driver._ctx() != h["ctx"]:
            raise cuBLASError(Status.MAPPING_ERROR)  # used from another context
        return h

    # ------------------------------------------------------------- the bindings' calls

    def create(self) -> int:
        self._enter("create", ())
        ctx = self.driver._ctx()
        if self.driver._ctx_device(ctx) is None:
            raise cuBLASError(Status.NOT_INITIALIZED)
        dev = self.driver._ctx_device(ctx)
        if self.default_pool_bytes:
            if self.driver.device_reserved(dev) + self.default_pool_bytes > self.driver.memory_bytes:
                raise cuBLASError(Status.ALLOC_FAILED)
            self.driver.raw_reserved[dev] += self.default_pool_bytes
        self._next += 0x10
        self.handles[self._next] = {"ctx": ctx, "stream": 0, "workspace": _DEFAULT, "mode": PointerMode.HOST,
                                    "device": dev}
        return self._next

    def destroy(self, handle: int) -> None:
        self._enter("destroy", (handle,))
        h = self.handles.pop(handle, None)
        if h is None:
            raise cuBLASError(Status.NOT_INITIALIZED)
        if self.default_pool_bytes:
            self.driver.raw_reserved[h["device"]] -= self.default_pool_bytes

    def get_version(self, handle: int) -> int:
        self._enter("get_version", (handle,))
        self._handle(handle)
        return 130100  # cublasGetVersion's form: major * 10000 + minor * 100 + patch

    def set_stream(self, handle: int, stream: int) -> None:
        self._enter("set_stream", (handle, stream))
        h = self._handle(handle)
        if stream and stream not in self.driver.streams:
            raise cuBLASError(Status.INVALID_VALUE)
        h["stream"] = stream
        h["workspace"] = _DEFAULT  # cublasSetStream resets the user workspace

    def set_pointer_mode(self, handle: int, mode: int) -> None:
        self._enter("set_pointer_mode", (handle, mode))
        self._handle(handle)["mode"] = PointerMode(mode)

    def set_workspace(self, handle: int, workspace: int, nbytes: int) -> None:
        self._enter("set_workspace", (handle, workspace, nbytes))
        h = self._handle(handle)
        if (workspace == 0) != (nbytes == 0):
            raise cuBLASError(Status.INVALID_VALUE)
        if workspace and self.driver._resolve(workspace, nbytes) is None:
            raise cuBLASError(Status.INVALID_VALUE)
        h["workspace"] = (workspace, nbytes)

    def sgemm(self, handle: int, transa: int, transb: int, m: int, n: int, k: int, alpha: int, a: int,
              lda: int, b: int, ldb: int, beta: int, c: int, ldc: int) -> None:
        self._enter("sgemm", (handle, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc))
        self._gemm(handle, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, bits=32)

    def sgemm_64(self, handle: int, transa: int, transb: int, m: int, n: int, k: int, alpha: int, a: int,
                 lda: int, b: int, ldb: int, beta: int, c: int, ldc: int) -> None:
        self._enter("sgemm_64", (handle, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc))
        self._gemm(handle, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, bits=64)

    def sgemm_strided_batched(self, handle: int, transa: int, transb: int, m: int, n: int, k: int, alpha: int,
                              a: int, lda: int, stride_a: int, b: int, ldb: int, stride_b: int, beta: int, c: int,
                              ldc: int, stride_c: int, batch: int) -> None:
        args = (handle, transa, transb, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c, ldc, stride_c,
                batch)
        self._enter("sgemm_strided_batched", args)
        if batch < 0:
            raise cuBLASError(Status.INVALID_VALUE)
        for i in range(batch):
            self._gemm(handle, transa, transb, m, n, k, alpha, a + 4 * i * stride_a, lda, b + 4 * i * stride_b, ldb,
                       beta, c + 4 * i * stride_c, ldc, bits=32)

    def gemm_ex(self, handle: int, transa: int, transb: int, m: int, n: int, k: int, alpha: int, a: int,
                atype: int, lda: int, b: int, btype: int, ldb: int, beta: int, c: int, ctype: int, ldc: int,
                compute_type: int, algo: int) -> None:
        self._enter("gemm_ex", (handle, transa, transb, m, n, k, alpha, a, atype, lda, b, btype, ldb, beta, c,
                                ctype, ldc, compute_type, algo))
        if atype != btype or atype not in _CUDA_TYPES or ctype not in _CUDA_TYPES or compute_type != _COMPUTE_32F:
            raise cuBLASError(Status.NOT_SUPPORTED)
        if ctype not in (atype, 0):  # cuBLAS's COMPUTE_32F table: C is float32 or the inputs' type
            raise cuBLASError(Status.NOT_SUPPORTED)
        self._gemm(handle, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, bits=32,
                   types=(_CUDA_TYPES[atype], _CUDA_TYPES[ctype]))

    def _gemm(self, handle: int, transa: int, transb: int, m: int, n: int, k: int, alpha: int, a: int,
              lda: int, b: int, ldb: int, beta: int, c: int, ldc: int, *, bits: int,
              types: tuple[str, str] = ("float32", "float32")) -> None:
        import numpy as np

        h = self._handle(handle)
        limit = (1 << (bits - 1)) - 1
        if min(m, n, k) < 0 or max(m, n, k, lda, ldb, ldc) > limit:
            raise cuBLASError(Status.INVALID_VALUE)
        if transa not in (Operation.N, Operation.T) or transb not in (Operation.N, Operation.T):
            raise cuBLASError(Status.NOT_SUPPORTED)  # the fake does only what the backend needs
        a_rows, b_rows = (m if transa == Operation.N else k), (k if transb == Operation.N else n)
        if lda < max(1, a_rows) or ldb < max(1, b_rows) or ldc < max(1, m):
            raise cuBLASError(Status.INVALID_VALUE)
        if h["mode"] != PointerMode.HOST:
            raise cuBLASError(Status.NOT_SUPPORTED)
        if h["workspace"] is _DEFAULT:
            self.default_workspace_gemms += 1
        al = ctypes.c_float.from_address(alpha).value  # host pointer mode: read at the call
        be = ctypes.c_float.from_address(beta).value
        self.gemms.append((m, n, k))
        if m == 0 or n == 0:
            return
        drv = self.driver
        dev = h["device"]

        class _Fault(Exception):
            pass

        def dtype(name: str) -> Any:
            if name == "bfloat16":
                import ml_dtypes

                return np.dtype(ml_dtypes.bfloat16)
            return np.dtype(name)

        ab_t, c_t = dtype(types[0]), dtype(types[1])

        def colmajor(ptr: int, rows: int, cols: int, ld: int, dt: Any) -> Any:
            count = ld * (cols - 1) + rows if cols else 0
            found = drv._resolve(int(ptr), count * dt.itemsize) if cols else None
            if found is None:
                raise _Fault
            buf, off = found
            flat = np.frombuffer(buf.buf(), dtype=dt, count=count, offset=off)
            return np.lib.stride_tricks.as_strided(flat, shape=(rows, cols), strides=(dt.itemsize, dt.itemsize * ld))

        def op(x: Any, t: int) -> Any:
            return x.T if t == Operation.T else x

        def run() -> None:  # when the stream gets there
            try:
                cm = colmajor(c, m, n, ldc, c_t)
                if k == 0:
                    prod = np.zeros((m, n), np.float32)
                else:
                    am = op(colmajor(a, a_rows, k if transa == Operation.N else m, lda, ab_t), transa)
                    bm = op(colmajor(b, b_rows, n if transb == Operation.N else k, ldb, ab_t), transb)
                    prod = am.astype(np.float32) @ bm.astype(np.float32)
            except _Fault:
                drv.sticky.setdefault(dev, CUresult.CUDA_ERROR_ILLEGAL_ADDRESS)
                return
            result = np.float32(al) * prod + (np.float32(be) * cm.astype(np.float32) if be != 0 else np.float32(0))
            cm[...] = result.astype(np.float32).astype(c_t)

        drv._enqueue(h["stream"], run, getattr(drv, "launch_ns", 0))


class CublasRecorder:
    """Wraps a :class:`FakeCublas`: every binding call's arguments go to ``<dir>/<pid>.cublas``.

    The replay (tests/helpers/replay_bindings.py) calls the real
    ``nvmath.bindings.cublas`` with them; its argument conversion runs before
    it loads libcuda/libcublas. Each distinct (call, argument types) shape is
    kept a few times only; records are flushed at once.
    """

    def __init__(self, fake: FakeCublas, record_dir: str) -> None:
        self._fake = fake
        self._seen: dict[tuple[str, tuple[str, ...]], int] = {}
        os.makedirs(record_dir, exist_ok=True)
        self._file = open(os.path.join(record_dir, f"{os.getpid()}.cublas"), "ab")
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._fake, name)
        if name not in SIGNATURES:
            return value

        def recorded(*args: Any) -> Any:
            key = (name, tuple(type(a).__name__ for a in args))
            with self._lock:
                n = self._seen.get(key, 0)
                if n < 3:
                    self._seen[key] = n + 1
                    plain = tuple(int(a) if isinstance(a, enum.IntEnum) else a for a in args)
                    pickle.dump((name, plain), self._file)
                    self._file.flush()
            return value(*args)

        return recorded
