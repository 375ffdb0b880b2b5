"""The cuda backend's tensor ops of the WASM ABI: GEMM through cuBLAS, the rest as NVRTC kernels.

    CudaTensorOps(drv, nvrtc, device, stream, cublas_module)     (one per backend, on first use)
      matmul_f32      cuBLAS sgemm (worker.backends._cublas) with the run's metered workspace, else
                      the fixed scratch's 64 KiB; k == 0: C zeroed by a kernel. A cuBLAS error is
                      followed by cuStreamQuery through the driver funnel: a sticky fault behind it
                      is recorded (context lost, the worker exits) as for any driver call
      add/mul, add_rows, unary, scale, softmax_rows, transpose
                      one launch each, grid-stride loops, ``unsigned long long`` indices
      max_f32         per-block maxima into a fixed scratch, the host takes the max of those
      argmax_rows     one block per row, rows in chunks of the scratch, each chunk copied
                      straight into guest memory

Every launch goes on the tenant's stream. Ops that leave their result on
the device are stream-ordered and return at once: everything else the
tenant does (copies, frees, the next op) goes on the same stream, so it
sees the result; an execution error surfaces at the next synchronize. Ops
that hand a result to the host (max, argmax) synchronize. Each queued op
is counted (``on_enqueued``, the backend's :meth:`note_enqueued`), which
bounds how much work one run can have in flight.

Numbers follow numpy (the GPU check compares every op with numpy within
float32 tolerance): ``--fmad=false`` (no fused multiply-add numpy would not
do), relu keeps NaN like ``np.maximum``, max and argmax let a NaN win like
``np.max``/``np.argmax``, argmax takes the first of equal maxima, softmax is
``exp(x - max) / sum`` per row. Transcendentals (``expf``, ``tanhf``) are
CUDA's, within a few ulp of numpy's.

The scratch (``SCRATCH_BYTES``) is a slice of the backend's fixed scratch
(one ``cuMemAlloc`` outside the tenant's pool, charged to the device budget
as fixed overhead), so a tenant exactly at its cap can still reduce.
Nothing here allocates per call.

The compile step is :func:`worker.backends.kernels.compile_source` (a cubin for the
device's ``sm_XY``, PTX when this NVRTC does not know it).

Typing: cuda-python's bindings (and the tests' fake driver and cuBLAS) are untyped modules
(mypy: ignore_missing_imports). The handles they give are held as ``object`` and passed back; a
bindings module and what its calls return stay dynamically typed, converted (int(), bytes) where read.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from shared.errors import CudaError, InvalidArgument
from shared.log import get_logger, log_event
from worker.backends._cublas import GEMM_WORKSPACE_BYTES, Cublas
from worker.backends._driver import Driver, Nvrtc
from worker.backends.base import DeviceBuffer
from worker.backends.cuda_timing import NO_HOOKS, LaunchHooks, TimerHooks
from worker.backends.kernels import compile_source

__all__ = ["OPS_SOURCE", "SCRATCH_BYTES", "CudaTensorOps", "TensorOpsMixin"]


class Closable(Protocol):
    """What a measured load gives (compiled kernels, a cuBLAS handle): closed again when refused."""

    def close(self) -> None: ...


_C = TypeVar("_C", bound=Closable)


class Measure(Protocol):
    """The backend's ``_measured``: run ``load()`` and charge what it took from the device."""

    def __call__(self, load: Callable[[], _C], /) -> _C: ...


def _unmeasured(load: Callable[[], _C]) -> _C:
    return load()

_log = get_logger("worker.cuda_ops")

BLOCK = 256
MAX_GRID = 65535
#: scratch for max partials (MAX_GRID floats would be more than needed: 1024 blocks) and argmax rows
SCRATCH_BYTES = 64 << 10
_MAX_BLOCKS = 1024
_ARGMAX_ROWS = SCRATCH_BYTES // 4
#: argmax answers int32 indices (the WASM ABI's): a row wider than this has columns it cannot name
MAX_ARGMAX_COLS = (1 << 31) - 1

OPS_SOURCE = r"""
#define GRID_STRIDE(i, n) \
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (unsigned long long)gridDim.x * blockDim.x)

#define NEG_INF __int_as_float(0xff800000)

/* NaN-propagating max, as numpy's */
__device__ __forceinline__ float nan_max(float a, float b) { return (b > a || b != b) ? b : a; }

/* x, y and out may be the same buffer: no __restrict__ */
extern "C" __global__ void twt_binary_f32(int op, const float* x, const float* y, float* out, unsigned long long n)
{
    GRID_STRIDE(i, n) out[i] = op == 0 ? x[i] + y[i] : x[i] * y[i];
}

extern "C" __global__ void twt_add_rows_f32(float* __restrict__ m, const float* __restrict__ v,
                                            unsigned long long rows, unsigned long long cols)
{
    GRID_STRIDE(i, rows * cols) m[i] = m[i] + v[i % cols];
}

extern "C" __global__ void twt_unary_f32(int op, const float* x, float* out, unsigned long long n)
{
    GRID_STRIDE(i, n) {
        float v = x[i];
        float r;
        switch (op) {
        case 0: r = (v > 0.0f || v != v) ? v : 0.0f; break;   /* relu, NaN kept */
        case 1: r = expf(v); break;
        case 2: r = tanhf(v); break;
        case 3: r = 1.0f / (1.0f + expf(-v)); break;           /* sigmoid */
        case 4: r = -v; break;
        case 5: r = sqrtf(v); break;
        default: r = fabsf(v); break;
        }
        out[i] = r;
    }
}

extern "C" __global__ void twt_scale_f32(float* x, float a, unsigned long long n)
{
    GRID_STRIDE(i, n) x[i] = x[i] * a;
}

extern "C" __global__ void twt_zero_f32(float* p, unsigned long long n)
{
    GRID_STRIDE(i, n) p[i] = 0.0f;
}

extern "C" __global__ void twt_transpose_f32(const float* __restrict__ x, float* __restrict__ out,
                                             unsigned long long rows, unsigned long long cols)
{
    GRID_STRIDE(i, rows * cols) {
        unsigned long long r = i / cols, c = i % cols;
        out[c * rows + r] = x[i];
    }
}

/* one block per row (grid-stride over rows): max, then exp(x - max) and its sum, then divide */
extern "C" __global__ void twt_softmax_rows_f32(float* x, unsigned long long rows, unsigned long long cols)
{
    __shared__ float s[256];
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        float* row = x + r * cols;
        float m = NEG_INF;
        for (unsigned long long j = threadIdx.x; j < cols; j += blockDim.x) m = nan_max(m, row[j]);
        s[threadIdx.x] = m;
        __syncthreads();
        for (unsigned int h = blockDim.x / 2; h > 0; h >>= 1) {
            if (threadIdx.x < h) s[threadIdx.x] = nan_max(s[threadIdx.x], s[threadIdx.x + h]);
            __syncthreads();
        }
        m = s[0];
        __syncthreads();
        float acc = 0.0f;
        for (unsigned long long j = threadIdx.x; j < cols; j += blockDim.x) {
            float e = expf(row[j] - m);
            row[j] = e;
            acc += e;
        }
        s[threadIdx.x] = acc;
        __syncthreads();
        for (unsigned int h = blockDim.x / 2; h > 0; h >>= 1) {
            if (threadIdx.x < h) s[threadIdx.x] += s[threadIdx.x + h];
            __syncthreads();
        }
        float total = s[0];
        __syncthreads();
        for (unsigned long long j = threadIdx.x; j < cols; j += blockDim.x) row[j] = row[j] / total;
    }
}

extern "C" __global__ void twt_max_f32(const float* __restrict__ x, unsigned long long n, float* __restrict__ partial)
{
    __shared__ float s[256];
    float m = NEG_INF;
    GRID_STRIDE(i, n) m = nan_max(m, x[i]);
    s[threadIdx.x] = m;
    __syncthreads();
    for (unsigned int h = blockDim.x / 2; h > 0; h >>= 1) {
        if (threadIdx.x < h) s[threadIdx.x] = nan_max(s[threadIdx.x], s[threadIdx.x + h]);
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = s[0];
}

/* (vb, ib) beats (va, ia): the first NaN, else the larger value, else the smaller index */
__device__ __forceinline__ bool beats(float vb, unsigned long long ib, float va, unsigned long long ia)
{
    bool nb = vb != vb, na = va != va;
    if (nb || na) return nb && (!na || ib < ia);
    return vb > va || (vb == va && ib < ia);
}

/* rows [first, first + count) of x, one block per row; out[r - first] = the row's argmax */
extern "C" __global__ void twt_argmax_rows_f32(const float* __restrict__ x, unsigned long long first,
                                               unsigned long long count, unsigned long long cols,
                                               int* __restrict__ out)
{
    __shared__ float sv[256];
    __shared__ unsigned long long si[256];
    for (unsigned long long r = blockIdx.x; r < count; r += gridDim.x) {
        const float* row = x + (first + r) * cols;
        float v = NEG_INF;
        unsigned long long at = ~0ull;
        for (unsigned long long j = threadIdx.x; j < cols; j += blockDim.x)
            if (beats(row[j], j, v, at)) { v = row[j]; at = j; }
        sv[threadIdx.x] = v;
        si[threadIdx.x] = at;
        __syncthreads();
        for (unsigned int h = blockDim.x / 2; h > 0; h >>= 1) {
            if (threadIdx.x < h && beats(sv[threadIdx.x + h], si[threadIdx.x + h], sv[threadIdx.x], si[threadIdx.x])) {
                sv[threadIdx.x] = sv[threadIdx.x + h];
                si[threadIdx.x] = si[threadIdx.x + h];
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) out[r] = (int)si[0];
        __syncthreads();
    }
}
"""

_NAMES = (b"twt_binary_f32", b"twt_add_rows_f32", b"twt_unary_f32", b"twt_scale_f32", b"twt_zero_f32",
          b"twt_transpose_f32", b"twt_softmax_rows_f32", b"twt_max_f32", b"twt_argmax_rows_f32")
_P, _F, _I, _U = ctypes.c_void_p, ctypes.c_float, ctypes.c_int, ctypes.c_uint64


def _grid(n: int, cap: int = MAX_GRID) -> int:
    return max(1, min(cap, (n + BLOCK - 1) // BLOCK))


class CudaTensorOps:
    #: told around each launch (the backend: its current op timer records its events there)
    hooks: LaunchHooks = NO_HOOKS
    """The compiled op kernels and the cuBLAS handle of one backend; use :meth:`load`."""

    def __init__(self, drv: Driver, module: object, functions: dict[bytes, Any], scratch: int, stream: object,
                 cublas_module: object, fallback_workspace: tuple[int, int] = (0, 0),
                 on_enqueued: Callable[[], None] | None = None, measured: Measure | None = None,
                 wait_idle: Callable[[], None] | None = None) -> None:
        self._drv = drv
        self._fallback_workspace = fallback_workspace
        self._on_enqueued = on_enqueued if on_enqueued is not None else (lambda: None)
        self._wait_idle = wait_idle if wait_idle is not None else (lambda: None)
        self._measured: Measure = measured if measured is not None else _unmeasured
        self._module = module
        self._fn = functions
        self._scratch = scratch
        self._stream = stream
        self._cublas_module = cublas_module
        self._cublas: Cublas | None = None
        self.arch = ""
        import numpy as np

        self._partials = np.empty(_MAX_BLOCKS, dtype=np.float32)

    @classmethod
    def load(cls, drv: Driver, nvrtc: Nvrtc, device: object, stream: object, cublas_module: object = None, *,
             scratch: int, fallback_workspace: tuple[int, int] = (0, 0), on_enqueued: Callable[[], None] | None = None,
             measured: Measure | None = None, wait_idle: Callable[[], None] | None = None) -> CudaTensorOps:
        """Compile (NVRTC) and load the op kernels into the current context; cuBLAS waits for a GEMM.

        ``scratch``: ``SCRATCH_BYTES`` of device memory the reductions may use;
        ``fallback_workspace``: (address, bytes) cuBLAS gets when a run has no
        metered workspace; ``on_enqueued()`` after each queued op;
        ``measured(load)`` runs a load and charges what it took (the cuBLAS handle);
        ``wait_idle()`` before each synchronize (the backend's bounded wait for queued work).
        """
        attr = drv.mod.CUdevice_attribute
        major = drv.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)
        minor = drv.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device)
        image, arch = compile_source(nvrtc, OPS_SOURCE, "twt_tensor_ops.cu", int(major), int(minor))
        module = drv.call("cuModuleLoadData", image)
        try:
            functions = {n: drv.call("cuModuleGetFunction", module, n) for n in _NAMES}
        except BaseException:
            drv.mod.cuModuleUnload(module)
            raise
        ops = cls(drv, module, functions, int(scratch), stream, cublas_module, fallback_workspace,
                  on_enqueued, measured, wait_idle)
        ops.arch = arch
        return ops

    def _launch(self, name: bytes, grid: int, args: tuple[object, ...], types: tuple[object, ...]) -> None:
        self.hooks.launching()
        self._drv.call("cuLaunchKernel", self._fn[name], grid, 1, 1, BLOCK, 1, 1, 0, self._stream, (args, types), 0)
        self.hooks.launched()
        self._on_enqueued()

    def _sync(self, what: str) -> None:
        try:
            self._wait_idle()
            self._drv.call("cuStreamSynchronize", self._stream)
        except CudaError as exc:
            raise CudaError(exc.call, exc.result_name, exc.result_code,
                            message=f"{what} failed: {exc.result_name} ({exc.result_code})") from None

    # ------------------------------------------------------------ GEMM

    @property
    def cublas(self) -> Cublas:
        if self._cublas is None:
            try:
                self._cublas = self._measured(lambda: Cublas.load(self._cublas_module, self._stream))
            except CudaError:
                self._after_cublas_error()
                raise
        return self._cublas

    def _after_cublas_error(self) -> None:
        """cuBLAS failed: ask the stream through the driver funnel. A sticky fault (an earlier
        kernel's, or cuBLAS's own) answers here, is recorded as the context lost and raised
        instead, so the worker exits as it does after a failed driver call."""
        try:
            self._drv.call("cuStreamQuery", self._stream)
        except CudaError:
            if self._drv.context_lost is not None:
                raise
            # CUDA_ERROR_NOT_READY (work still queued) or another non-sticky answer: the cuBLAS error stands

    @staticmethod
    def workspace_bytes() -> int:
        return GEMM_WORKSPACE_BYTES

    def matmul_f32(self, a: int, b: int, c: int, m: int, k: int, n: int, workspace: tuple[int, int]) -> None:
        if m == 0 or n == 0:
            return
        if k == 0:
            self._launch(b"twt_zero_f32", _grid(m * n), (c, m * n), (_P, _U))
            return
        if workspace == (0, 0):
            workspace = self._fallback_workspace  # never NULL: cuBLAS may refuse some GEMMs without one
        cublas = self.cublas  # the handle's first use (a load) is launch preparation, not device work
        try:
            self.hooks.launching()
            cublas.sgemm_row_major(a, b, c, m, k, n, workspace)
            self.hooks.launched()
        except CudaError as exc:
            if exc.call.startswith("cublas"):
                self._after_cublas_error()
            raise
        self._on_enqueued()

    # ------------------------------------------------------------ elementwise

    def binary_f32(self, op: int, x: int, y: int, out: int, n: int) -> None:
        if n:
            self._launch(b"twt_binary_f32", _grid(n), (op, x, y, out, n), (_I, _P, _P, _P, _U))

    def add_rows_f32(self, m: int, v: int, rows: int, cols: int) -> None:
        if rows and cols:
            self._launch(b"twt_add_rows_f32", _grid(rows * cols), (m, v, rows, cols), (_P, _P, _U, _U))

    def unary_f32(self, op: int, x: int, out: int, n: int) -> None:
        if n:
            self._launch(b"twt_unary_f32", _grid(n), (op, x, out, n), (_I, _P, _P, _U))

    def scale_f32(self, x: int, a: float, n: int) -> None:
        if n:
            self._launch(b"twt_scale_f32", _grid(n), (x, float(a), n), (_P, _F, _U))

    def transpose_f32(self, x: int, out: int, rows: int, cols: int) -> None:
        if rows and cols:
            self._launch(b"twt_transpose_f32", _grid(rows * cols), (x, out, rows, cols), (_P, _P, _U, _U))

    def softmax_rows_f32(self, x: int, rows: int, cols: int) -> None:
        if rows and cols:
            self._launch(b"twt_softmax_rows_f32", min(rows, MAX_GRID), (x, rows, cols), (_P, _U, _U))

    # ------------------------------------------------------------ reductions to the host

    def max_f32(self, x: int, count: int, out: memoryview) -> None:
        import numpy as np

        grid = _grid(count, _MAX_BLOCKS)
        self._launch(b"twt_max_f32", grid, (x, count, self._scratch), (_P, _U, _P))
        parts = self._partials
        self._drv.call("cuMemcpyDtoHAsync", parts, self._scratch, 4 * grid, self._stream)
        self._sync("kernel twt_max_f32")
        with np.errstate(all="ignore"):
            np.frombuffer(out, dtype="<f4", count=1)[0] = parts[:grid].max()

    def argmax_rows_f32(self, x: int, rows: int, cols: int, out: memoryview) -> None:
        if cols > MAX_ARGMAX_COLS:
            raise InvalidArgument(
                f"argmax_rows_f32 answers int32 column indices: {cols:,} columns is more than "
                f"{MAX_ARGMAX_COLS:,}; split the rows")
        for first in range(0, rows, _ARGMAX_ROWS):
            count = min(_ARGMAX_ROWS, rows - first)
            self._launch(b"twt_argmax_rows_f32", min(count, MAX_GRID), (x, first, count, cols, self._scratch),
                         (_P, _U, _U, _U, _P))
            self._drv.call("cuMemcpyDtoHAsync", out[4 * first : 4 * (first + count)], self._scratch, 4 * count,
                           self._stream)
            self._sync("kernel twt_argmax_rows_f32")

    # ------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Destroy the cuBLAS handle, unload the module (logged, never raised; the scratch is the backend's)."""
        if self._cublas is not None:
            try:
                self._cublas.close()
            except Exception as exc:  # noqa: BLE001 - cleanup goes on; logged
                log_event(_log, logging.WARNING, "cuda_ops.close_failed", call="cublasDestroy", error=str(exc))
            self._cublas = None
        try:
            self._drv.call("cuModuleUnload", self._module)
        except Exception as exc:  # noqa: BLE001 - cleanup goes on; logged
            log_event(_log, logging.WARNING, "cuda_ops.close_failed", call="cuModuleUnload", error=str(exc))


class TensorOpsMixin:
    """The tensor-op methods of :class:`worker.backends.cuda.CudaBackend` (its ``Backend`` interface part).

    Each checks that the backend is open, makes its context current and
    hands device addresses to :class:`CudaTensorOps`, built on the first op.
    """

    _drv: Driver
    _dev: object
    _stream: object
    _nvrtc_spec: object
    _cublas_spec: object
    _tensor_ops: CudaTensorOps | None
    _scratch: int | None

    def _open(self) -> None: ...  # provided by CudaBackend
    def _current(self) -> None: ...  # provided by CudaBackend
    def note_enqueued(self) -> None: ...  # provided by CudaBackend
    def wait_idle(self) -> None: ...  # provided by CudaBackend
    def _measured(self, load: Callable[[], _C]) -> _C:  # provided by CudaBackend
        raise NotImplementedError

    def tensor_ops(self) -> CudaTensorOps:
        """The op kernels (NVRTC on first use) and the cuBLAS handle (on the first GEMM)."""
        self._open()
        self._current()
        if self._tensor_ops is None:
            nvrtc = self._nvrtc_spec if isinstance(self._nvrtc_spec, Nvrtc) else Nvrtc(self._nvrtc_spec)
            from worker.backends.cuda import CUBLAS_FALLBACK_WORKSPACE_BYTES, SUM_SCRATCH_BYTES

            assert self._scratch is not None
            base = self._scratch + SUM_SCRATCH_BYTES
            fallback = (base + SCRATCH_BYTES, CUBLAS_FALLBACK_WORKSPACE_BYTES)
            self._tensor_ops = self._measured(lambda: CudaTensorOps.load(
                self._drv, nvrtc, self._dev, self._stream, self._cublas_spec, scratch=base,
                fallback_workspace=fallback, on_enqueued=self.note_enqueued, measured=self._measured,
                wait_idle=self.wait_idle))
            self._tensor_ops.hooks = self.launch_hooks()
        return self._tensor_ops

    def launch_hooks(self) -> TimerHooks:
        """What the kernels and tensor ops tell around each launch: the current op timer's events."""
        hooks = getattr(self, "_launch_hooks", None)
        if hooks is None:
            hooks = self._launch_hooks = TimerHooks()
        return hooks

    def _close_tensor_ops(self) -> None:
        if self._tensor_ops is not None:
            self._tensor_ops.close()
            self._tensor_ops = None

    def gemm_workspace_bytes(self) -> int:
        return GEMM_WORKSPACE_BYTES

    def device_rates(self) -> tuple[float, float]:
        """(flop/s, byte/s) the chunk cost model starts from: below any data-centre GPU's fp32 rate
        and bandwidth (an H200: ~60 TFLOP/s, 4.8 TB/s), so a first chunk is short; measured after."""
        return 5e12, 5e11

    def matmul_f32(self, a: DeviceBuffer, b: DeviceBuffer, c: DeviceBuffer, m: int, k: int, n: int, *,
                   workspace: DeviceBuffer | None = None) -> None:
        ws = (0, 0) if workspace is None else (_addr(workspace), workspace.nbytes)
        self.tensor_ops().matmul_f32(_addr(a), _addr(b), _addr(c), m, k, n, ws)

    def add_f32(self, x: DeviceBuffer, y: DeviceBuffer, out: DeviceBuffer, n: int) -> None:
        self.tensor_ops().binary_f32(0, _addr(x), _addr(y), _addr(out), n)

    def mul_f32(self, x: DeviceBuffer, y: DeviceBuffer, out: DeviceBuffer, n: int) -> None:
        self.tensor_ops().binary_f32(1, _addr(x), _addr(y), _addr(out), n)

    def add_rows_f32(self, m: DeviceBuffer, v: DeviceBuffer, rows: int, cols: int) -> None:
        self.tensor_ops().add_rows_f32(_addr(m), _addr(v), rows, cols)

    def unary_f32(self, op: int, x: DeviceBuffer, out: DeviceBuffer, n: int) -> None:
        self.tensor_ops().unary_f32(op, _addr(x), _addr(out), n)

    def scale_f32(self, x: DeviceBuffer, a: float, n: int) -> None:
        self.tensor_ops().scale_f32(_addr(x), a, n)

    def softmax_rows_f32(self, x: DeviceBuffer, rows: int, cols: int) -> None:
        self.tensor_ops().softmax_rows_f32(_addr(x), rows, cols)

    def max_f32(self, x: DeviceBuffer, count: int, out: memoryview) -> None:
        self.tensor_ops().max_f32(_addr(x), count, out)

    def argmax_rows_f32(self, x: DeviceBuffer, rows: int, cols: int, out: memoryview) -> None:
        self.tensor_ops().argmax_rows_f32(_addr(x), rows, cols, out)

    def transpose_f32(self, x: DeviceBuffer, out: DeviceBuffer, rows: int, cols: int) -> None:
        self.tensor_ops().transpose_f32(_addr(x), _addr(out), rows, cols)


def _addr(buf: DeviceBuffer) -> int:
    return int(buf.ptr)  # type: ignore[attr-defined]  # a CudaBuffer
