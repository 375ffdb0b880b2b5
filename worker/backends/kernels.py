"""The cuda backend's tensor ops: fill, axpy and sum as NVRTC-compiled kernels on the tenant stream.

Compiled once per worker, on the first tensor op (a worker that only moves
bytes never loads NVRTC), for the device's own architecture (``sm_XY`` to a
cubin; ``compute_XY`` PTX when this NVRTC does not know the device). Every
launch goes on the tenant's non-blocking stream and is followed by a
synchronize, so an op is complete - and its launch error reported - when it
returns, as with the stub backend.

Numbers match numpy:

* ``axpy`` computes ``t = a*x[i]`` then ``y[i] + t``, two float32
  roundings like numpy's ``y + np.float32(a) * x``; compiled with
  ``--fmad=false`` so the compiler does not fuse them into one FMA.
* ``sum`` accumulates in double per block (a fixed grid-stride partition,
  so the result is deterministic), the host adds the per-block partials with
  ``math.fsum`` and rounds once to float32: at least as accurate as numpy's
  float32 pairwise sum, and equal to it within float32 rounding.

The per-block partials live in the backend's fixed scratch (the first
``MAX_SUM_BLOCKS`` doubles of one ``cuMemAlloc`` outside the tenant's pool,
charged to the device budget as fixed overhead), so a tenant at exactly its
cap can still sum.

Typing: cuda-python's bindings (and the tests' fake driver and cuBLAS) are untyped modules
(mypy: ignore_missing_imports). The handles they give are held as ``object`` and passed back; a
bindings module and what its calls return stay dynamically typed, converted (int(), bytes) where read.
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Callable
from typing import Any

from shared.errors import CudaError
from shared.log import get_logger, log_event
from worker.backends._driver import Driver, Nvrtc
from worker.backends.cuda_timing import NO_HOOKS, LaunchHooks

__all__ = ["BLOCK", "KERNEL_NAMES", "KERNEL_SOURCE", "MAX_GRID", "MAX_SUM_BLOCKS", "Kernels", "compile_source"]

_log = get_logger("worker.kernels")

BLOCK = 256
MAX_GRID = 65535
MAX_SUM_BLOCKS = 1024

KERNEL_SOURCE = r"""
extern "C" __global__ void twt_fill_f32(float* __restrict__ p, float v, unsigned long long n)
{
    unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step)
        p[i] = v;
}

/* x and y may be the same buffer: no __restrict__ here */
extern "C" __global__ void twt_axpy_f32(unsigned long long n, float a, const float* x, float* y)
{
    unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        float t = a * x[i];
        y[i] = y[i] + t;
    }
}

extern "C" __global__ void twt_sum_f32(const float* __restrict__ x, unsigned long long n,
                                       double* __restrict__ partial)
{
    __shared__ double s[256];
    double acc = 0.0;
    unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step)
        acc += (double)x[i];
    s[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned int half = blockDim.x / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half)
            s[threadIdx.x] += s[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        partial[blockIdx.x] = s[0];
}
"""

#: every ``extern "C" __global__`` function in KERNEL_SOURCE, looked up after loading; a new kernel:
#: add its source above, its name here, a method that launches it below (``self.functions[name]``),
#: and its numpy twin in tests/helpers/fake_cuda.py (``@fake_kernel(name)``)
KERNEL_NAMES: tuple[bytes, ...] = (b"twt_fill_f32", b"twt_axpy_f32", b"twt_sum_f32")


def _grid(n: int, cap: int) -> int:
    return max(1, min(cap, (n + BLOCK - 1) // BLOCK))


class Kernels:
    #: told around each launch (the backend: its current op timer records its events there)
    hooks: LaunchHooks = NO_HOOKS
    """The three kernels loaded into the current context; use :meth:`load`."""

    def __init__(self, drv: Driver, module: object, functions: dict[bytes, Any], scratch: int, stream: object,
                 wait_idle: Callable[[], None] | None = None) -> None:
        self._drv = drv
        self._wait_idle = wait_idle if wait_idle is not None else (lambda: None)
        self._module = module
        self.functions = functions
        self._fill, self._axpy, self._sum = (functions[n] for n in (b"twt_fill_f32", b"twt_axpy_f32", b"twt_sum_f32"))
        self._scratch = scratch
        self._stream = stream
        import numpy as np

        self._partials = np.zeros(MAX_SUM_BLOCKS, dtype=np.float64)
        self.arch = ""

    @classmethod
    def load(cls, drv: Driver, nvrtc: Nvrtc, device: object, stream: object, scratch: int, *,
             wait_idle: Callable[[], None] | None = None) -> Kernels:
        """Compile (NVRTC) and load the kernels for ``device`` into the current context.

        ``scratch``: device address of ``MAX_SUM_BLOCKS * 8`` bytes the sum's partials may use;
        ``wait_idle()``: called before each synchronize (the backend's bounded wait for queued work).
        """
        attr = drv.mod.CUdevice_attribute
        major = drv.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)
        minor = drv.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device)
        image, arch = compile_source(nvrtc, KERNEL_SOURCE, "twt_kernels.cu", int(major), int(minor),
                                     what="the tensor kernels")
        module = drv.call("cuModuleLoadData", image)
        try:
            functions = {n: drv.call("cuModuleGetFunction", module, n) for n in KERNEL_NAMES}
        except BaseException:
            drv.mod.cuModuleUnload(module)
            raise
        kernels = cls(drv, module, functions, int(scratch), stream, wait_idle)
        kernels.arch = arch
        return kernels

    def _launch(self, fn: object, name: str, grid: int, args: tuple[object, ...], types: tuple[object, ...]) -> None:
        drv = self._drv
        self.hooks.launching()
        drv.call("cuLaunchKernel", fn, grid, 1, 1, BLOCK, 1, 1, 0, self._stream, (args, types), 0)
        self.hooks.launched()  # the synchronize below is not device work: after the end event
        if self.hooks.defers_sync():
            return  # a queued op: its fault surfaces at the gate's settle of its events
        try:
            self._wait_idle()
            drv.call("cuStreamSynchronize", self._stream)
        except CudaError as exc:
            raise CudaError(exc.call, exc.result_name, exc.result_code,
                            message=f"kernel {name} failed: {exc.result_name} ({exc.result_code})") from None

    def fill_f32(self, ptr: int, value: float, count: int) -> None:
        if count <= 0:
            return
        self._launch(self._fill, "twt_fill_f32", _grid(count, MAX_GRID), (ptr, float(value), count),
                     (ctypes.c_void_p, ctypes.c_float, ctypes.c_uint64))

    def axpy_f32(self, n: int, a: float, x: int, y: int) -> None:
        if n <= 0:
            return
        self._launch(self._axpy, "twt_axpy_f32", _grid(n, MAX_GRID), (n, float(a), x, y),
                     (ctypes.c_uint64, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p))

    def sum_f32(self, ptr: int, count: int) -> float:
        if count <= 0:
            return 0.0
        import numpy as np

        grid = _grid(count, MAX_SUM_BLOCKS)
        self._launch(self._sum, "twt_sum_f32", grid, (ptr, count, self._scratch),
                     (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p))
        out = self._partials
        self._drv.call("cuMemcpyDtoHAsync", out, self._scratch, grid * 8, self._stream)
        self._drv.call("cuStreamSynchronize", self._stream)
        return float(np.float32(math.fsum(out[:grid].tolist())))

    def close(self) -> None:
        """Unload the module (logged, never raised; the scratch is the backend's)."""
        try:
            self._drv.call("cuModuleUnload", self._module)
        except Exception as exc:  # noqa: BLE001 - cleanup goes on; logged
            log_event(_log, logging.WARNING, "kernels.close_failed", call="cuModuleUnload", error=str(exc))


def compile_source(nvrtc: Nvrtc, source: str, filename: str, major: int, minor: int,
                   *, what: str | None = None) -> tuple[bytes, str]:
    """(image for cuModuleLoadData, architecture): a cubin for ``sm_XY``, else PTX for ``compute_XY``.

    The one NVRTC compile step of the cuda backend (these kernels and
    :mod:`worker.backends.cuda_ops`'). ``what`` names the source in a compile
    error (default: ``filename``).
    """
    what = filename if what is None else what
    for arch, get_size, get in (
        (f"sm_{major}{minor}", "nvrtcGetCUBINSize", "nvrtcGetCUBIN"),
        (f"compute_{major}{minor}", "nvrtcGetPTXSize", "nvrtcGetPTX"),
    ):
        opts = [f"--gpu-architecture={arch}".encode(), b"--fmad=false"]
        prog = nvrtc.call("nvrtcCreateProgram", source.encode(), filename.encode(), 0, [], [])
        try:
            try:
                nvrtc.call("nvrtcCompileProgram", prog, len(opts), opts)
            except CudaError as exc:
                if exc.result_name.endswith("INVALID_OPTION") and arch.startswith("sm_"):
                    continue  # this NVRTC does not know the device: JIT from PTX instead
                raise CudaError(exc.call, exc.result_name, exc.result_code,
                                message=f"compiling {what} for {arch} failed: {exc.result_name}\n"
                                f"{_program_log(nvrtc, prog)}") from None
            size = int(nvrtc.call(get_size, prog))
            # filled in place by NVRTC: a bytearray of its own, never ``b" " * size`` (for size 1
            # that is CPython's one shared b" " object, and NVRTC would write into every b" ")
            out = bytearray(size)
            nvrtc.call(get, prog, out)
            return bytes(out), arch
        finally:
            try:
                nvrtc.call("nvrtcDestroyProgram", prog)
            except CudaError:
                pass
    raise CudaError("nvrtcCompileProgram", "NVRTC_ERROR_INVALID_OPTION", 5,
                    message=f"NVRTC knows neither sm_{major}{minor} nor compute_{major}{minor}")


def _program_log(nvrtc: Nvrtc, prog: object) -> str:
    try:
        size = int(nvrtc.call("nvrtcGetProgramLogSize", prog))
        buf = bytearray(size)  # written in place (see compile_source)
        nvrtc.call("nvrtcGetProgramLog", prog, buf)
        return bytes(buf).rstrip(b"\0 ").decode(errors="replace")
    except CudaError:
        return "(no compile log)"
