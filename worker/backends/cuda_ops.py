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
      gemm_f32, gemm_strided_batched_f32, gemm_ex
                      cuBLAS sgemm / sgemmStridedBatched / GemmEx (CUBLAS_COMPUTE_32F) with the
                      transposes, alpha and beta mapped to column-major (worker.backends._cublas);
                      k == 0: C = beta C by a kernel
      binary, binary_rows, scalar, causal_mask, cast, copy
                      one grid-stride launch each (binary ops: one kernel, the selector an argument;
                      f16 through PTX cvt.rn, bf16 rounded to nearest even by bits)
      reduce_rows, layernorm_rows
                      one block per row, sums in double rounded once to float
      gather_rows     the checked row indices copied into the scratch (a chunk of them at a time,
                      stream-ordered), then one launch

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

The scratch (``OPS_SCRATCH_BYTES``) is a slice of the backend's fixed scratch
(:mod:`worker.backends.cuda_scratch`: one ``cuMemAlloc`` outside the tenant's pool,
charged to the device budget as fixed overhead), so a tenant exactly at its cap
can still reduce.
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
from worker.backends.cuda_scratch import CUBLAS_FALLBACK_WORKSPACE_BYTES, OPS_SCRATCH_BYTES, SUM_SCRATCH_BYTES
from worker.backends.cuda_timing import NO_HOOKS, LaunchHooks, TimerHooks
from worker.backends.kernels import compile_source

__all__ = ["OPS_SOURCE", "CudaTensorOps", "TensorOpsMixin"]


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
_MAX_BLOCKS = 1024
_ARGMAX_ROWS = OPS_SCRATCH_BYTES // 4
#: argmax answers int32 indices (the WASM ABI's): a row wider than this has columns it cannot name
MAX_ARGMAX_COLS = (1 << 31) - 1

OPS_SOURCE = r"""
#define GRID_STRIDE(i, n) \
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (unsigned long long)gridDim.x * blockDim.x)

#define NEG_INF __int_as_float(0xff800000)

/* NaN-propagating max, as numpy's */
__device__ __forceinline__ float nan_max(float a, float b) { return (b > a || b != b) ? b : a; }

/* NaN-propagating min, as numpy's */
__device__ __forceinline__ float nan_min(float a, float b) { return (b < a || b != b) ? b : a; }

/* the BINARY_OPS selectors: 0 add, 1 sub, 2 mul, 3 div, 4 max, 5 min (NaN wins, as np.maximum) */
__device__ __forceinline__ float binop(int op, float a, float b)
{
    switch (op) {
    case 0: return a + b;
    case 1: return a - b;
    case 2: return a * b;
    case 3: return a / b;
    case 4: return (a != a) ? a : nan_max(a, b);
    default: return (a != a) ? a : nan_min(a, b);
    }
}

/* x, y and out may be the same buffer: no __restrict__ */
extern "C" __global__ void twt_binary_f32(int op, const float* x, const float* y, float* out, unsigned long long n)
{
    GRID_STRIDE(i, n) out[i] = binop(op, x[i], y[i]);
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
        case 6: r = fabsf(v); break;
        case 7: r = logf(v); break;
        case 8: {                                              /* GELU, tanh form, numpy's order */
            float t = v * v;
            t = t * v;
            t = t * 0.044715f;
            t = t + v;
            t = t * 0.7978845608028654f;
            t = tanhf(t);
            t = t + 1.0f;
            t = t * v;
            r = t * 0.5f;
            break;
        }
        case 9: r = v / (1.0f + expf(-v)); break;              /* SiLU */
        case 10: r = 1.0f / sqrtf(v); break;                   /* rsqrt, IEEE sqrt and division */
        default: r = 1.0f / v; break;                          /* recip */
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

/* out[:, r0:r1] = x[r0:r1, :].T of the whole rows x cols transpose (r0 = 0, r1 = rows: all of it) */
extern "C" __global__ void twt_transpose_f32(const float* __restrict__ x, float* __restrict__ out,
                                             unsigned long long rows, unsigned long long cols,
                                             unsigned long long r0, unsigned long long r1)
{
    GRID_STRIDE(i, (r1 - r0) * cols) {
        unsigned long long r = r0 + i / cols, c = i % cols;
        out[c * rows + r] = x[r * cols + c];
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

/* out may be m (never v) */
extern "C" __global__ void twt_binary_rows_f32(int op, const float* m, const float* __restrict__ v, float* out,
                                               unsigned long long rows, unsigned long long cols)
{
    GRID_STRIDE(i, rows * cols) out[i] = binop(op, m[i], v[i % cols]);
}

extern "C" __global__ void twt_scalar_f32(int op, const float* x, float a, float* out, unsigned long long n)
{
    GRID_STRIDE(i, n) out[i] = binop(op, x[i], a);
}

/* a block's sum of per-thread doubles, in s[0] (all threads must call it) */
__device__ double block_sum(double* s, double v)
{
    __syncthreads();
    s[threadIdx.x] = v;
    __syncthreads();
    for (unsigned int h = blockDim.x / 2; h > 0; h >>= 1) {
        if (threadIdx.x < h) s[threadIdx.x] += s[threadIdx.x + h];
        __syncthreads();
    }
    return s[0];
}

/* one block per row: 0 sum, 1 max (NaN wins), 2 mean; sums in double, rounded once to float
   (mean: the float sum divided by cols, numpy's two roundings) */
extern "C" __global__ void twt_reduce_rows_f32(int op, const float* __restrict__ x, unsigned long long rows,
                                               unsigned long long cols, float* __restrict__ out)
{
    __shared__ double s[256];
    __shared__ float sm[256];
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* row = x + r * cols;
        if (op == 1) {
            float m = NEG_INF;
            for (unsigned long long j = threadIdx.x; j < cols; j += blockDim.x) m = nan_max(m, row[j]);
            __syncthreads();
            sm[threadIdx.x] = m;
            __syncthreads();
            for (unsigned int h = blockDim.x / 2; h > 0; h >>= 1) {
                if (threadIdx.x < h) sm[threadIdx.x] = nan_max(sm[threadIdx.x], sm[threadIdx.x + h]);
                __syncthreads();
            }
            if (threadIdx.x == 0) out[r] = sm[0];
        } else {
            double acc = 0.0;
            for (unsigned long long j = threadIdx.x; j < cols; j += blockDim.x) acc += (double)row[j];
            float total = (float)block_sum(s, acc);
            if (threadIdx.x == 0) out[r] = op == 2 ? total / (float)cols : total;
        }
    }
}

/* one block per row: mean and biased variance (sums in double, each rounded once to float), then
   out = (x - mean) / sqrt(var + eps) * gamma + beta in float, numpy's order; out may be x */
extern "C" __global__ void twt_layernorm_rows_f32(const float* x, const float* __restrict__ g,
                                                  const float* __restrict__ b, float* out,
                                                  unsigned long long rows, unsigned long long cols, float eps)
{
    __shared__ double s[256];
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* row = x + r * cols;
        float* dst = out + r * cols;
        double acc = 0.0;
        for (unsigned long long j = threadIdx.x; j < cols; j += blockDim.x) acc += (double)row[j];
        float mean = (float)block_sum(s, acc) / (float)cols;
        acc = 0.0;
        for (unsigned long long j = threadIdx.x; j < cols; j += blockDim.x) {
            float d = row[j] - mean;
            acc += (double)(d * d);
        }
        float var = (float)block_sum(s, acc) / (float)cols;
        float denom = sqrtf(var + eps);
        __syncthreads();  /* every thread read its row before any writes (out may be x) */
        for (unsigned long long j = threadIdx.x; j < cols; j += blockDim.x) {
            float d = row[j] - mean;
            d = d / denom;
            d = d * g[j];
            dst[j] = d + b[j];
        }
    }
}

/* out[i, :] = table[idx[i], :]; idx already checked against the table */
extern "C" __global__ void twt_gather_rows_f32(const float* __restrict__ table, const int* __restrict__ idx,
                                               unsigned long long n, unsigned long long cols,
                                               float* __restrict__ out)
{
    GRID_STRIDE(i, n * cols) out[i] = table[(unsigned long long)idx[i / cols] * cols + i % cols];
}

/* nbytes from src to dst (never overlapping): 16 bytes a thread when everything is aligned */
extern "C" __global__ void twt_copy_bytes(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                          unsigned long long n)
{
    if ((((unsigned long long)src | (unsigned long long)dst | n) & 15ull) == 0) {
        GRID_STRIDE(i, n / 16) ((uint4*)dst)[i] = ((const uint4*)src)[i];
    } else {
        GRID_STRIDE(i, n) dst[i] = src[i];
    }
}

extern "C" __global__ void twt_causal_mask_f32(float* x, unsigned long long rows, unsigned long long cols,
                                               unsigned long long offset)
{
    GRID_STRIDE(i, rows * cols) if (i % cols > i / cols + offset) x[i] = NEG_INF;
}

/* the dtypes: 0 f32, 1 f16 (PTX cvt, round to nearest even), 2 bf16 (by bits, round to nearest even,
   NaN kept quiet with its sign) */
__device__ __forceinline__ float h2f(unsigned short h)
{
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short f2h(float f)
{
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float b2f(unsigned short b) { return __uint_as_float(((unsigned int)b) << 16); }
__device__ __forceinline__ unsigned short f2b(float f)
{
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
__device__ __forceinline__ float load_as(const void* p, int dt, unsigned long long i)
{
    if (dt == 0) return ((const float*)p)[i];
    unsigned short v = ((const unsigned short*)p)[i];
    return dt == 1 ? h2f(v) : b2f(v);
}
__device__ __forceinline__ void store_as(void* p, int dt, unsigned long long i, float f)
{
    if (dt == 0) ((float*)p)[i] = f;
    else ((unsigned short*)p)[i] = dt == 1 ? f2h(f) : f2b(f);
}

extern "C" __global__ void twt_cast(const void* __restrict__ src, int sd, void* __restrict__ dst, int dd,
                                    unsigned long long n)
{
    GRID_STRIDE(i, n) store_as(dst, dd, i, load_as(src, sd, i));
}

/* p[:n] = beta * p[:n] in dtype dt, or zeros when beta == 0 (a GEMM with k == 0: BLAS's C = beta C) */
extern "C" __global__ void twt_scale_any(void* p, int dt, float beta, unsigned long long n)
{
    GRID_STRIDE(i, n) store_as(p, dt, i, beta == 0.0f ? 0.0f : load_as(p, dt, i) * beta);
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
          b"twt_transpose_f32", b"twt_softmax_rows_f32", b"twt_max_f32", b"twt_argmax_rows_f32",
          b"twt_binary_rows_f32", b"twt_scalar_f32", b"twt_reduce_rows_f32", b"twt_layernorm_rows_f32",
          b"twt_gather_rows_f32", b"twt_copy_bytes", b"twt_causal_mask_f32", b"twt_cast", b"twt_scale_any")
#: gather's row indices go through the scratch: this many a launch
_GATHER_ROWS = OPS_SCRATCH_BYTES // 4
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

        ``scratch``: ``OPS_SCRATCH_BYTES`` of device memory the reductions may use;
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

    def transpose_f32(self, x: int, out: int, rows: int, cols: int, r0: int = 0, r1: int | None = None) -> None:
        """``out[:, r0:r1] = x[r0:r1].T`` of the ``rows x cols`` transpose (default: all rows)."""
        r1 = rows if r1 is None else r1
        if not (0 <= r0 <= r1 <= rows):
            raise ValueError(f"transpose rows {r0}:{r1} outside 0:{rows}")
        if r1 > r0 and cols:
            self._launch(b"twt_transpose_f32", _grid((r1 - r0) * cols), (x, out, rows, cols, r0, r1),
                         (_P, _P, _U, _U, _U, _U))

    def softmax_rows_f32(self, x: int, rows: int, cols: int) -> None:
        if rows and cols:
            self._launch(b"twt_softmax_rows_f32", min(rows, MAX_GRID), (x, rows, cols), (_P, _U, _U))

    # ------------------------------------------------------------ the second round

    def _ws(self, workspace: tuple[int, int]) -> tuple[int, int]:
        return self._fallback_workspace if workspace == (0, 0) else workspace

    def _cublas_call(self, fn: Callable[[Cublas], None]) -> None:
        """One cuBLAS call queued on the stream; a cuBLAS error asks the stream for a sticky fault."""
        try:
            fn(self.cublas)
        except CudaError as exc:
            if exc.call.startswith("cublas"):
                self._after_cublas_error()
            raise
        self._on_enqueued()

    def gemm_f32(self, ta: int, tb: int, m: int, n: int, k: int, alpha: float, a: int, b: int, beta: float,
                 c: int, workspace: tuple[int, int]) -> None:
        if m == 0 or n == 0:
            return
        if k == 0:  # C = beta C (BLAS), without cuBLAS
            self._launch(b"twt_scale_any", _grid(m * n), (c, 0, float(beta), m * n), (_P, _I, _F, _U))
            return
        ws = self._ws(workspace)
        self._cublas_call(lambda cb: cb.gemm_row_major(ta, tb, m, n, k, alpha, a, b, beta, c, ws))

    def gemm_strided_batched_f32(self, ta: int, tb: int, m: int, n: int, k: int, alpha: float, a: int, sa: int,
                                 b: int, sb: int, beta: float, c: int, sc: int, batch: int,
                                 workspace: tuple[int, int]) -> None:
        if m == 0 or n == 0 or batch == 0:
            return
        if k == 0:  # C = beta C per matrix: one launch when they are packed, else one each
            if sc == m * n:
                self._launch(b"twt_scale_any", _grid(batch * m * n), (c, 0, float(beta), batch * m * n),
                             (_P, _I, _F, _U))
                return
            for i in range(batch):
                self._launch(b"twt_scale_any", _grid(m * n), (c + 4 * i * sc, 0, float(beta), m * n),
                             (_P, _I, _F, _U))
            return
        ws = self._ws(workspace)
        self._cublas_call(lambda cb: cb.gemm_strided_batched_row_major(
            ta, tb, m, n, k, alpha, a, sa, b, sb, beta, c, sc, batch, ws))

    def gemm_ex(self, ta: int, tb: int, m: int, n: int, k: int, alpha: float, a: int, ab: int, b: int,
                beta: float, c: int, cd: int, workspace: tuple[int, int]) -> None:
        if m == 0 or n == 0:
            return
        if k == 0:
            self._launch(b"twt_scale_any", _grid(m * n), (c, cd, float(beta), m * n), (_P, _I, _F, _U))
            return
        ws = self._ws(workspace)
        self._cublas_call(lambda cb: cb.gemm_ex_row_major(ta, tb, m, n, k, alpha, a, ab, b, beta, c, cd, ws))

    def binary_rows_f32(self, op: int, m: int, v: int, out: int, rows: int, cols: int) -> None:
        if rows and cols:
            self._launch(b"twt_binary_rows_f32", _grid(rows * cols), (op, m, v, out, rows, cols),
                         (_I, _P, _P, _P, _U, _U))

    def scalar_f32(self, op: int, x: int, a: float, out: int, n: int) -> None:
        if n:
            self._launch(b"twt_scalar_f32", _grid(n), (op, x, float(a), out, n), (_I, _P, _F, _P, _U))

    def reduce_rows_f32(self, op: int, x: int, rows: int, cols: int, out: int) -> None:
        if rows:
            self._launch(b"twt_reduce_rows_f32", min(rows, MAX_GRID), (op, x, rows, cols, out), (_I, _P, _U, _U, _P))

    def layernorm_rows_f32(self, x: int, g: int, b: int, out: int, rows: int, cols: int, eps: float) -> None:
        if rows:
            self._launch(b"twt_layernorm_rows_f32", min(rows, MAX_GRID), (x, g, b, out, rows, cols, float(eps)),
                         (_P, _P, _P, _P, _U, _U, _F))

    def gather_rows_f32(self, table: int, idx: memoryview, n: int, cols: int, out: int) -> None:
        """Indices through the scratch, ``_GATHER_ROWS`` a launch; stream order keeps each launch's
        indices in place until it ran (the next copy into the scratch queues behind it)."""
        if n == 0 or cols == 0:
            return
        for first in range(0, n, _GATHER_ROWS):
            count = min(_GATHER_ROWS, n - first)
            self._drv.call("cuMemcpyHtoDAsync", self._scratch, idx[4 * first : 4 * (first + count)], 4 * count,
                           self._stream)
            self._launch(b"twt_gather_rows_f32", _grid(count * cols), (table, self._scratch, count, cols,
                                                                       out + 4 * first * cols), (_P, _P, _U, _U, _P))

    def copy(self, src: int, dst: int, nbytes: int) -> None:
        if nbytes:
            self._launch(b"twt_copy_bytes", _grid(nbytes), (src, dst, nbytes), (_P, _P, _U))

    def causal_mask_f32(self, x: int, rows: int, cols: int, offset: int) -> None:
        if rows and cols:
            self._launch(b"twt_causal_mask_f32", _grid(rows * cols), (x, rows, cols, offset), (_P, _U, _U, _U))

    def cast(self, src: int, sd: int, dst: int, dd: int, n: int) -> None:
        if n:
            self._launch(b"twt_cast", _grid(n), (src, sd, dst, dd, n), (_P, _I, _P, _I, _U))

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
    cublas_workspace_bytes: int  # per device class (set by CudaBackend from the compute capability)

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
            assert self._scratch is not None
            base = self._scratch + SUM_SCRATCH_BYTES
            fallback = (base + OPS_SCRATCH_BYTES, CUBLAS_FALLBACK_WORKSPACE_BYTES)
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
        """cuBLAS's recommended workspace for this device (32 MiB on Hopper, else 4 MiB)."""
        return self.cublas_workspace_bytes or GEMM_WORKSPACE_BYTES

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
        self.tensor_ops().binary_f32(2, _addr(x), _addr(y), _addr(out), n)

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

    #: the kernel takes a row range: a transpose runs in chunks of input rows (worker.chunks)
    transposes_in_blocks = True

    def transpose_block_f32(self, x: DeviceBuffer, out: DeviceBuffer, rows: int, cols: int, r0: int, r1: int) -> None:
        """``out[:, r0:r1] = x[r0:r1].T``: one chunk of the whole transpose, one launch on the whole buffers."""
        self.tensor_ops().transpose_f32(_addr(x), _addr(out), rows, cols, r0, r1)

    @staticmethod
    def _ws(workspace: DeviceBuffer | None) -> tuple[int, int]:
        return (0, 0) if workspace is None else (_addr(workspace), workspace.nbytes)

    def gemm_f32(self, trans_a: int, trans_b: int, m: int, n: int, k: int, alpha: float, a: DeviceBuffer,
                 b: DeviceBuffer, beta: float, c: DeviceBuffer, *, workspace: DeviceBuffer | None = None) -> None:
        self.tensor_ops().gemm_f32(trans_a, trans_b, m, n, k, alpha, _addr(a), _addr(b), beta, _addr(c),
                                   self._ws(workspace))

    def gemm_strided_batched_f32(self, trans_a: int, trans_b: int, m: int, n: int, k: int, alpha: float,
                                 a: DeviceBuffer, stride_a: int, b: DeviceBuffer, stride_b: int, beta: float,
                                 c: DeviceBuffer, stride_c: int, batch: int, *,
                                 workspace: DeviceBuffer | None = None) -> None:
        self.tensor_ops().gemm_strided_batched_f32(trans_a, trans_b, m, n, k, alpha, _addr(a), stride_a, _addr(b),
                                                   stride_b, beta, _addr(c), stride_c, batch, self._ws(workspace))

    def gemm_ex(self, trans_a: int, trans_b: int, m: int, n: int, k: int, alpha: float, a: DeviceBuffer,
                ab_dtype: int, b: DeviceBuffer, beta: float, c: DeviceBuffer, c_dtype: int, *,
                workspace: DeviceBuffer | None = None) -> None:
        self.tensor_ops().gemm_ex(trans_a, trans_b, m, n, k, alpha, _addr(a), ab_dtype, _addr(b), beta, _addr(c),
                                  c_dtype, self._ws(workspace))

    def binary_f32(self, op: int, x: DeviceBuffer, y: DeviceBuffer, out: DeviceBuffer, n: int) -> None:
        self.tensor_ops().binary_f32(op, _addr(x), _addr(y), _addr(out), n)

    def binary_rows_f32(self, op: int, m: DeviceBuffer, v: DeviceBuffer, out: DeviceBuffer, rows: int,
                        cols: int) -> None:
        self.tensor_ops().binary_rows_f32(op, _addr(m), _addr(v), _addr(out), rows, cols)

    def scalar_f32(self, op: int, x: DeviceBuffer, a: float, out: DeviceBuffer, n: int) -> None:
        self.tensor_ops().scalar_f32(op, _addr(x), a, _addr(out), n)

    def reduce_rows_f32(self, op: int, x: DeviceBuffer, rows: int, cols: int, out: DeviceBuffer) -> None:
        self.tensor_ops().reduce_rows_f32(op, _addr(x), rows, cols, _addr(out))

    def layernorm_rows_f32(self, x: DeviceBuffer, gamma: DeviceBuffer, beta: DeviceBuffer, out: DeviceBuffer,
                           rows: int, cols: int, eps: float) -> None:
        self.tensor_ops().layernorm_rows_f32(_addr(x), _addr(gamma), _addr(beta), _addr(out), rows, cols, eps)

    def gather_rows_f32(self, table: DeviceBuffer, idx: memoryview, n: int, cols: int, out: DeviceBuffer) -> None:
        self.tensor_ops().gather_rows_f32(_addr(table), idx, n, cols, _addr(out))

    def copy(self, src: DeviceBuffer, src_off: int, dst: DeviceBuffer, dst_off: int, nbytes: int) -> None:
        self.tensor_ops().copy(_addr(src) + src_off, _addr(dst) + dst_off, nbytes)

    def causal_mask_f32(self, x: DeviceBuffer, rows: int, cols: int, offset: int) -> None:
        self.tensor_ops().causal_mask_f32(_addr(x), rows, cols, offset)

    def cast(self, src: DeviceBuffer, src_dtype: int, dst: DeviceBuffer, dst_dtype: int, n: int) -> None:
        self.tensor_ops().cast(_addr(src), src_dtype, _addr(dst), dst_dtype, n)


def _addr(buf: DeviceBuffer) -> int:
    return int(buf.ptr)  # type: ignore[attr-defined]  # a CudaBuffer
