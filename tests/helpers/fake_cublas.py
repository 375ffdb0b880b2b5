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
  with ``INVALID_VALUE``, reads the column-major operands from fake device
  memory and computes ``C = alpha*A@B + beta*C`` with numpy (float32);
  an operand outside any allocation is ``EXECUTION_FAILED``.

Use: ``FakeCublas(driver)`` as the ``cublas=`` of
:class:`worker.backends.cuda.CudaBackend` (a host without nvmath-python is
a module name that does not import).
"""

from __future__ import annotations

import ctypes
import enum
from typing import Any

from tests.helpers.fake_cuda import FakeDriver

__all__ = ["FakeCublas"]


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


class cuBLASError(Exception):  # noqa: N801 - the bindings' name
    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"{Status(status).name} ({status})")


_DEFAULT = object()


class FakeCublas:
    """Module-shaped: the backend calls ``create``, ``set_stream``, ``set_workspace``, ``sgemm`` ... on it."""

    Status = Status
    Operation = Operation
    PointerMode = PointerMode
    cuBLASError = cuBLASError

    def __init__(self, driver: FakeDriver) -> None:
        self.driver = driver
        self.__name__ = "tests.helpers.fake_cublas"
        self.handles: dict[int, dict[str, Any]] = {}
        self.calls: list[str] = []
        self.gemms: list[tuple[int, int, int]] = []  # (m, n, k) as cuBLAS saw them (column-major)
        self.default_workspace_gemms = 0
        self.fail: dict[str, list[int]] = {}
        self._next = 0x5000

    def fail_next(self, name: str, status: Status, times: int = 1) -> None:
        self.fail.setdefault(name, []).extend([int(status)] * times)

    def _enter(self, name: str) -> None:
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
        self._enter("create")
        ctx = self.driver._ctx()
        if self.driver._ctx_device(ctx) is None:
            raise cuBLASError(Status.NOT_INITIALIZED)
        self._next += 0x10
        self.handles[self._next] = {"ctx": ctx, "stream": 0, "workspace": _DEFAULT, "mode": PointerMode.HOST}
        return self._next

    def destroy(self, handle: int) -> None:
        self._enter("destroy")
        if self.handles.pop(handle, None) is None:
            raise cuBLASError(Status.NOT_INITIALIZED)

    def set_stream(self, handle: int, stream: int) -> None:
        self._enter("set_stream")
        h = self._handle(handle)
        if stream and stream not in self.driver.streams:
            raise cuBLASError(Status.INVALID_VALUE)
        h["stream"] = stream
        h["workspace"] = _DEFAULT  # cublasSetStream resets the user workspace

    def set_pointer_mode(self, handle: int, mode: int) -> None:
        self._enter("set_pointer_mode")
        self._handle(handle)["mode"] = PointerMode(mode)

    def set_workspace(self, handle: int, workspace: int, nbytes: int) -> None:
        self._enter("set_workspace")
        h = self._handle(handle)
        if (workspace == 0) != (nbytes == 0):
            raise cuBLASError(Status.INVALID_VALUE)
        if workspace and self.driver._resolve(workspace, nbytes) is None:
            raise cuBLASError(Status.INVALID_VALUE)
        h["workspace"] = (workspace, nbytes)

    def sgemm(self, handle: int, transa: int, transb: int, m: int, n: int, k: int, alpha: int, a: int,
              lda: int, b: int, ldb: int, beta: int, c: int, ldc: int) -> None:
        self._enter("sgemm")
        self._gemm(handle, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, bits=32)

    def sgemm_64(self, handle: int, transa: int, transb: int, m: int, n: int, k: int, alpha: int, a: int,
                 lda: int, b: int, ldb: int, beta: int, c: int, ldc: int) -> None:
        self._enter("sgemm_64")
        self._gemm(handle, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, bits=64)

    def _gemm(self, handle: int, transa: int, transb: int, m: int, n: int, k: int, alpha: int, a: int,
              lda: int, b: int, ldb: int, beta: int, c: int, ldc: int, *, bits: int) -> None:
        import numpy as np

        h = self._handle(handle)
        limit = (1 << (bits - 1)) - 1
        if min(m, n, k) < 0 or max(m, n, k, lda, ldb, ldc) > limit:
            raise cuBLASError(Status.INVALID_VALUE)
        if (transa, transb) != (Operation.N, Operation.N):
            raise cuBLASError(Status.NOT_SUPPORTED)  # the fake does only what the backend needs
        if lda < max(1, m) or ldb < max(1, k) or ldc < max(1, m):
            raise cuBLASError(Status.INVALID_VALUE)
        if h["mode"] != PointerMode.HOST:
            raise cuBLASError(Status.NOT_SUPPORTED)
        if h["workspace"] is _DEFAULT:
            self.default_workspace_gemms += 1
        al = ctypes.c_float.from_address(alpha).value
        be = ctypes.c_float.from_address(beta).value
        self.gemms.append((m, n, k))
        if m == 0 or n == 0:
            return

        def colmajor(ptr: int, rows: int, cols: int, ld: int) -> Any:
            flat = self.driver._f32(ptr, ld * (cols - 1) + rows) if cols else None
            if flat is None:
                raise cuBLASError(Status.EXECUTION_FAILED)
            full = np.lib.stride_tricks.as_strided(flat, shape=(rows, cols), strides=(4, 4 * ld))
            return full

        cm = colmajor(c, m, n, ldc)
        if k == 0:
            prod = np.zeros((m, n), np.float32)
        else:
            prod = colmajor(a, m, k, lda) @ colmajor(b, k, n, ldb)
        result = np.float32(al) * prod + (np.float32(be) * cm if be != 0 else np.float32(0))
        cm[...] = result.astype(np.float32)
