"""cuBLAS for the cuda backend's GEMM: one handle on the tenant's stream, a workspace lent per call.

    CudaBackend.matmul_f32(a, b, c, m, k, n, workspace)
      Cublas.load()             import nvmath.bindings.cublas (the ``cuda`` extra); absent:
                                BackendUnavailable "cuBLAS missing, install tensor-wasm-tenant[cuda]"
                                cublasCreate (in the tenant's current context), cublasSetStream(tenant
                                stream), cublasSetPointerMode(HOST)
      sgemm_row_major()         cublasSetWorkspace(the metered buffer, or none), then
                                cublasSgemm(N, N, n, m, k, 1, B, n, A, k, 0, C, n)

Row-major through column-major BLAS: a row-major ``X[r, c]`` is the
column-major ``X^T``, so ``C = A @ B`` is computed as ``C^T = B^T @ A^T``
with no transposes at all - swap the operands and the ``m``/``n`` sizes,
leading dimensions ``n``, ``k``, ``n``. Dimensions beyond ``int32`` use
``cublasSgemm_64`` (cuBLAS 12's ILP64 entry point).

Why the workspace is set before the first GEMM and whenever it changes
(each run lends its own): cuBLAS would otherwise take its default workspace
with ``cudaMalloc``, outside the tenant's capped pool and its metered
quota. The caller (:meth:`worker.wasm.abi.GuestRun.gemm`) allocates it
through the metered allocator. ``cublasSetStream`` resets the workspace to
the default one, so the stream is set once, at creation, before it. Without a metered workspace
(the quota had no room) it gets the backend's fixed 64 KiB fallback (never ``(NULL, 0)``: cuBLAS
documents that too small a workspace may make routines fail with ``CUBLAS_STATUS_ALLOC_FAILED``,
and that >= 16 KiB prevents it). ``cublasCreate`` itself keeps state and a default workspace pool
on the device (32 MiB on sm_90 per the cuBLAS docs): measured by the backend (``cuMemGetInfo``
around it) and charged to the device budget as the worker's fixed overhead.

A failed call raises :class:`CudaError` named ``cublas...``; the caller then asks the stream
(``cuStreamQuery``) through the driver funnel, so a sticky fault behind the cuBLAS error ends
the worker as a failed driver call does (worker.backends.cuda_ops).

The math mode stays ``CUBLAS_DEFAULT_MATH``: true float32 (no TF32), so the
results agree with numpy within float32 tolerance.

The module is named like the driver's: ``nvmath.bindings.cublas`` by
default, or a module(-shaped) object (the test suite's fake cuBLAS).

Typing: cuda-python's bindings (and the tests' fake driver and cuBLAS) are untyped modules
(mypy: ignore_missing_imports). The handles they give are held as ``object`` and passed back; a
bindings module and what its calls return stay dynamically typed, converted (int(), bytes) where read.
"""

from __future__ import annotations

import ctypes
from typing import Any

from shared.cuda_compat import CUBLAS_WORKSPACE_BYTES
from shared.errors import BackendUnavailable, CudaError
from worker.backends._driver import import_bindings

__all__ = ["CUDA_DATA_TYPES", "DEFAULT_CUBLAS_MODULE", "GEMM_WORKSPACE_BYTES", "INSTALL_HINT", "Cublas"]

DEFAULT_CUBLAS_MODULE = "nvmath.bindings.cublas"
#: the workspace lent to cuBLAS per run where the device class is not known: cuBLAS's recommendation
#: for every architecture but Hopper (the backend lends shared.cuda_compat.cublas_workspace_bytes(cc))
GEMM_WORKSPACE_BYTES = CUBLAS_WORKSPACE_BYTES
INSTALL_HINT = "install tensor-wasm-tenant[cuda] (nvmath-python with nvidia-cublas)"
_I32_MAX = (1 << 31) - 1
#: cudaDataType_t of the ABI dtypes (f32, f16, bf16): CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF
CUDA_DATA_TYPES: tuple[int, ...] = (0, 2, 14)
_COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F
_GEMM_DEFAULT = -1  # CUBLAS_GEMM_DEFAULT


def load_cublas_module(module: object) -> Any:
    """The cuBLAS bindings module (imported lazily: a worker that never multiplies never loads it)."""
    try:
        return import_bindings(module, DEFAULT_CUBLAS_MODULE)
    except ImportError as exc:
        raise BackendUnavailable(
            "cuda", f"cuBLAS missing: {module or DEFAULT_CUBLAS_MODULE!r} is not importable ({exc}); {INSTALL_HINT}"
        ) from None
    except RuntimeError as exc:  # libcublas not found by the loader
        raise _missing_library(exc) from None
    except Exception as exc:  # noqa: BLE001 - importing nvmath runs its whole package (cuda.core & co.):
        # a version mismatch there can raise anything (AttributeError, TypeError ...); GEMM is then
        # unavailable, said by name, and the worker goes on
        raise BackendUnavailable(
            "cuda", f"cuBLAS missing: importing {module or DEFAULT_CUBLAS_MODULE!r} failed "
            f"({type(exc).__name__}: {exc}); {INSTALL_HINT} with a cuda-core it supports"
        ) from None


def _missing_library(exc: RuntimeError) -> BackendUnavailable:
    """The loader found no libcublas (the nvidia-cublas wheel): at import, or at the first call."""
    return BackendUnavailable("cuda", f"cuBLAS missing: {type(exc).__name__}: {exc}; {INSTALL_HINT}")


class Cublas:
    """One cuBLAS handle bound to the current context and the tenant's stream; use :meth:`load`."""

    def __init__(self, mod: Any, handle: int) -> None:
        self.mod = mod
        self.handle = handle
        self._n = int(mod.Operation.N)
        self._alpha = ctypes.c_float(1.0)
        self._beta = ctypes.c_float(0.0)
        self._alpha_p = ctypes.addressof(self._alpha)
        self._beta_p = ctypes.addressof(self._beta)
        self._sgemm = mod.sgemm
        self._sgemm_64 = getattr(mod, "sgemm_64", None)
        self._set_workspace = mod.set_workspace
        self._workspace: tuple[int, int] | None = None  # what cuBLAS holds now (None: its default)
        self.calls = 0

    @classmethod
    def load(cls, module: object, stream: Any) -> Cublas:
        """Create the handle on ``stream`` (the backend's context must be current)."""
        mod = load_cublas_module(module)
        try:
            handle = _checked(mod, "cublasCreate", mod.create)
        except RuntimeError as exc:  # nvmath's loader: libcublas (the nvidia-cublas wheel) not found
            raise _missing_library(exc) from None
        try:
            _checked(mod, "cublasSetStream", mod.set_stream, handle, int(stream))
            _checked(mod, "cublasSetPointerMode", mod.set_pointer_mode, handle, int(mod.PointerMode.HOST))
        except BaseException:
            _checked(mod, "cublasDestroy", mod.destroy, handle)
            raise
        return cls(mod, int(handle))

    def sgemm_row_major(self, a: int, b: int, c: int, m: int, k: int, n: int, workspace: tuple[int, int]) -> None:
        """``C[m,n] = A[m,k] @ B[k,n]`` for row-major float32 at device addresses (m, n, k >= 1)."""
        mod = self.mod
        if workspace != self._workspace:  # the handle keeps it; set_stream is never called again
            _checked(mod, "cublasSetWorkspace", self._set_workspace, self.handle, workspace[0], workspace[1])
            self._workspace = workspace
        big = max(m, n, k) > _I32_MAX
        if big and self._sgemm_64 is None:
            raise CudaError("cublasSgemm", "CUBLAS_STATUS_NOT_SUPPORTED", 15,
                            message=f"a GEMM of {m}x{k} @ {k}x{n} needs cublasSgemm_64 (cuBLAS >= 12)")
        fn = self._sgemm_64 if big else self._sgemm
        self.calls += 1
        _checked(mod, "cublasSgemm", fn, self.handle, self._n, self._n, n, m, k,
                 self._alpha_p, b, n, a, k, self._beta_p, c, n)

    # -- the BLAS-style GEMMs of the ABI's second round. Row-major ``C = alpha op(A) op(B) + beta C`` is
    #    column-major ``C^T = alpha op(B)^T op(A)^T + beta C^T``: B first, each operand transposed as the
    #    guest asked, leading dimensions the row lengths of the stored matrices.

    def _scalars(self, alpha: float, beta: float) -> tuple[int, int]:
        """Host pointers to ``alpha`` and ``beta`` as float32 (read by cuBLAS at the call)."""
        self._alpha.value = alpha
        self._beta.value = beta
        return self._alpha_p, self._beta_p

    def _prepare(self, workspace: tuple[int, int], what: str, *dims: int) -> None:
        if workspace != self._workspace:
            _checked(self.mod, "cublasSetWorkspace", self._set_workspace, self.handle, workspace[0], workspace[1])
            self._workspace = workspace
        if max(dims) > _I32_MAX:
            raise CudaError(what, "CUBLAS_STATUS_NOT_SUPPORTED", 15,
                            message=f"{what}: a dimension or stride beyond int32 ({max(dims):,}); split the GEMM")

    def gemm_row_major(self, ta: int, tb: int, m: int, n: int, k: int, alpha: float, a: int, b: int, beta: float,
                       c: int, workspace: tuple[int, int]) -> None:
        """``C[m,n] = alpha op(A) @ op(B) + beta C``, row-major float32 (m, n, k >= 1)."""
        mod = self.mod
        if workspace != self._workspace:
            _checked(mod, "cublasSetWorkspace", self._set_workspace, self.handle, workspace[0], workspace[1])
            self._workspace = workspace
        big = max(m, n, k) > _I32_MAX
        if big and self._sgemm_64 is None:
            raise CudaError("cublasSgemm", "CUBLAS_STATUS_NOT_SUPPORTED", 15,
                            message=f"a GEMM of {m}x{k} @ {k}x{n} needs cublasSgemm_64 (cuBLAS >= 12)")
        al, be = self._scalars(alpha, beta)
        ops = (int(mod.Operation.N), int(mod.Operation.T))
        self.calls += 1
        try:
            _checked(mod, "cublasSgemm", self._sgemm_64 if big else self._sgemm, self.handle, ops[tb], ops[ta],
                     n, m, k, al, b, k if tb else n, a, m if ta else k, be, c, n)
        finally:
            self._scalars(1.0, 0.0)

    def gemm_strided_batched_row_major(self, ta: int, tb: int, m: int, n: int, k: int, alpha: float, a: int,
                                       sa: int, b: int, sb: int, beta: float, c: int, sc: int, batch: int,
                                       workspace: tuple[int, int]) -> None:
        """``batch`` row-major GEMMs, matrix ``i`` at float ``i * s*`` of each operand (strides in floats)."""
        mod = self.mod
        self._prepare(workspace, "cublasSgemmStridedBatched", m, n, k, batch)
        al, be = self._scalars(alpha, beta)
        ops = (int(mod.Operation.N), int(mod.Operation.T))
        self.calls += 1
        try:
            _checked(mod, "cublasSgemmStridedBatched", mod.sgemm_strided_batched, self.handle, ops[tb], ops[ta],
                     n, m, k, al, b, k if tb else n, sb, a, m if ta else k, sa, be, c, n, sc, batch)
        finally:
            self._scalars(1.0, 0.0)

    def gemm_ex_row_major(self, ta: int, tb: int, m: int, n: int, k: int, alpha: float, a: int, ab: int, b: int,
                          beta: float, c: int, cd: int, workspace: tuple[int, int]) -> None:
        """:meth:`gemm_row_major` with A, B of ABI dtype ``ab`` and C of ``cd``, accumulated in float32
        (``CUBLAS_COMPUTE_32F``: no TF32, no reduced-precision sums)."""
        mod = self.mod
        self._prepare(workspace, "cublasGemmEx", m, n, k)
        al, be = self._scalars(alpha, beta)
        ops = (int(mod.Operation.N), int(mod.Operation.T))
        compute = int(getattr(getattr(mod, "ComputeType", None), "COMPUTE_32F", _COMPUTE_32F))
        algo = int(getattr(getattr(mod, "GemmAlgo", None), "DEFAULT", _GEMM_DEFAULT))
        self.calls += 1
        try:
            _checked(mod, "cublasGemmEx", mod.gemm_ex, self.handle, ops[tb], ops[ta], n, m, k, al,
                     b, CUDA_DATA_TYPES[ab], k if tb else n, a, CUDA_DATA_TYPES[ab], m if ta else k, be,
                     c, CUDA_DATA_TYPES[cd], n, compute, algo)
        finally:
            self._scalars(1.0, 0.0)

    def close(self) -> None:
        """Destroy the handle (errors are the caller's to log)."""
        handle, self.handle = self.handle, 0
        if handle:
            _checked(self.mod, "cublasDestroy", self.mod.destroy, handle)


def _checked(mod: Any, call: str, fn: Any, *args: Any) -> Any:
    """Call a cuBLAS binding; its ``cuBLASError`` becomes :class:`CudaError` with the status name."""
    try:
        return fn(*args)
    except mod.cuBLASError as exc:
        status = int(getattr(exc, "status", -1))
        name = _status_name(mod, status)
        raise CudaError(call, name, status, message=f"{call} failed: {name} ({exc})") from None


def _status_name(mod: Any, status: int) -> str:
    try:
        return f"CUBLAS_STATUS_{mod.Status(status).name}"
    except (ValueError, AttributeError, TypeError):
        return f"cublasStatus {status}"
