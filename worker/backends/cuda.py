"""The cuda backend: one tenant process's own context, stream and hard-capped memory pool.

    CudaBackend(device, gpu_cap)         (once, when the worker is bound)
      [environment]                      MPS variables into os.environ - before cuInit
      cuInit(0)                          no libcuda: RuntimeError subclass -> BackendUnavailable
      cuDeviceGet -> cuDevicePrimaryCtxRetain -> cuCtxSetCurrent
      cuStreamCreate(CU_STREAM_NON_BLOCKING)
      cuMemGetAllocationGranularity      maxSize = gpu cap rounded up to it (0 = no cap)
      cuMemPoolCreate(pinned, device, maxSize)          <- the driver-level hard cap
      cuMemPoolSetAttribute(RELEASE_THRESHOLD, cuuint64_t(recorded quota))  <- a retention hint only

    alloc(n)   cuMemAllocFromPoolAsync(n, pool, stream)   OOM -> DeviceOutOfMemory
    free(b)    cuMemFreeAsync(ptr, stream)
    write/read cuMemcpyHtoDAsync / cuMemcpyDtoHAsync + cuStreamSynchronize
    pin_host   cuMemHostRegister of a mapped shared-memory region (worker.regions):
               write_host/read_host then copy from/to its address as DMA; unpin_host
               (cuMemHostUnregister) before the region is unmapped, and at close
    fill/axpy/sum   NVRTC kernels on the stream (worker.backends.kernels)
    matmul, softmax ... the WASM ABI's tensor ops: cuBLAS + NVRTC kernels (worker.backends.cuda_ops)
    close()    free every buffer, synchronize, unload kernels, destroy pool, destroy stream,
               restore the previous context (failure: warning ``context.pop_failed``),
               release the primary context - logged, never raised

Metering is not done here: :class:`~worker.allocator.MeteredAllocator` has
consumed the tenant's (and the device budget's) bytes before :meth:`alloc`
is called, so a refused allocation never reaches the driver, and it releases
them again when :meth:`alloc` raises :class:`DeviceOutOfMemory`.

Why ``maxSize`` and not ``RELEASE_THRESHOLD``: the release threshold only
says how much freed memory the pool may keep cached instead of returning it
at a synchronize; it never refuses an allocation (the Rust crate's plan to
cap with it failed on hardware). ``maxSize`` bounds what the pool can ever
reserve, so the driver itself refuses past it. It is fixed when the pool is
created: a cap raised live (``twt set-quota``) is metered at once but reaches
the driver cap only when the instance restarts.

All calls come from the worker's executor thread. The context is made
current again if a call ever arrives on another thread (CUDA contexts are
per thread).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

from shared.errors import BackendUnavailable, CudaError
from shared.log import get_logger, log_event
from worker.backends._driver import Driver, Nvrtc
from worker.backends.base import Backend, DeviceBuffer, DeviceOutOfMemory
from worker.backends.cuda_ops import TensorOpsMixin

__all__ = ["CudaBackend", "CudaBuffer", "round_up"]

_log = get_logger("worker.cuda")
#: inside the first page: never mapped in any CUDA context, so a write there always faults
_UNMAPPED_ADDRESS = 0x100
_get_ident = threading.get_ident


def _host_address(view: memoryview) -> int:
    """The address of a writable host buffer's first byte (the export ends at once;
    the caller keeps the memory mapped while the address is in use)."""
    anchor = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


def round_up(n: int, granularity: int) -> int:
    """``n`` rounded up to a multiple of ``granularity`` (>= 1)."""
    g = max(1, granularity)
    return (n + g - 1) // g * g


class CudaBuffer(DeviceBuffer):
    """A pool allocation: ``ptr`` is the driver's ``CUdeviceptr``; ``addr`` its address as an int."""

    __slots__ = ("ptr",)

    def __init__(self, nbytes: int, ptr: Any) -> None:
        self.nbytes = nbytes  # (no super().__init__: this is the allocation hot path)
        self.ptr = ptr

    @property
    def addr(self) -> int:
        return int(self.ptr)


class CudaBackend(TensorOpsMixin, Backend):
    """A CUDA context, non-blocking stream and capped pool on one device, for one tenant process."""

    name = "cuda"

    def __init__(
        self,
        device_index: int = 0,
        *,
        gpu_cap_bytes: int | None = None,
        release_threshold: int | None = None,
        driver: Driver | str | Any | None = None,
        nvrtc: Nvrtc | str | Any | None = None,
        environment: dict[str, str] | None = None,
        cublas: str | Any | None = None,
    ) -> None:
        """Set up context, stream and pool; raises BackendUnavailable / CudaError (nothing held then).

        ``driver`` / ``nvrtc``: a module name, a module(-shaped) object or a
        ready :class:`Driver`; the real cuda-python modules by default.
        ``environment`` goes into ``os.environ`` before ``cuInit`` (MPS).
        """
        if environment:
            os.environ.update({str(k): str(v) for k, v in environment.items()})
        self.device_index = device_index
        self.gpu_cap_bytes = gpu_cap_bytes
        self.release_threshold = release_threshold
        self.environment = dict(environment or {})
        self._drv = driver if isinstance(driver, Driver) else Driver(driver)
        self._nvrtc_spec = nvrtc
        self._kernels: Any = None
        self._cublas_spec = cublas  # cuBLAS bindings module (name or object); imported on the first GEMM
        self._tensor_ops = None  # the WASM ABI's tensor ops (worker.backends.cuda_ops), on first use
        self._live: set[CudaBuffer] = set()
        self._pinned: dict[int, int] = {}  # cuMemHostRegister'ed host ranges: address -> bytes
        self.in_use = 0
        self.alloc_calls = 0  # cuMemAllocFromPoolAsync calls made (the GPU check reads it)
        self._closed = False
        self._ctx: Any = None
        self._prev_ctx: Any = None
        self._stream: Any = None
        self._pool: Any = None
        self._dev: Any = None
        self._thread = threading.get_ident()
        try:
            self._setup()
        except BaseException:
            self._teardown(log_only=True)
            raise
        d = self._drv.mod
        # hot paths: bound functions and constants, no attribute lookups per call
        self._alloc_async = d.cuMemAllocFromPoolAsync
        self._free_async = d.cuMemFreeAsync
        self._oom = self._drv.OUT_OF_MEMORY

    def op_timer(self) -> Any:
        """CUDA events on the tenant stream (shared.gpu_time charges by them)."""
        from worker.backends.cuda_timing import CudaEventTimer

        self._open()
        return CudaEventTimer(self._drv, self._stream, self._current)

    def view(self, buf: DeviceBuffer, offset: int, nbytes: int) -> CudaBuffer:
        """A window on ``buf`` for chunked ops (never in ``_live``: never freed)."""
        return CudaBuffer(nbytes, int(buf.ptr) + offset)  # type: ignore[attr-defined]

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> CudaBackend:
        """Build from the bind message's backend options (see ``supervisor.workerset``)."""
        cap = options.get("gpu_memory_bytes_cap")
        threshold = options.get("recorded_cuda_mem_pool_quota")
        env = options.get("environment") or {}
        if not isinstance(env, dict):
            raise BackendUnavailable("cuda", f"backend option 'environment' must be a table, got {type(env).__name__}")
        return cls(
            int(options.get("device_index", 0)),
            gpu_cap_bytes=None if cap is None else int(cap),
            release_threshold=None if threshold is None else int(threshold),
            driver=options.get("driver_module"),
            nvrtc=options.get("nvrtc_module"),
            environment=env,
            cublas=options.get("cublas_module"),
        )

    # ------------------------------------------------------------- set-up

    def _setup(self) -> None:
        drv = self._drv
        d = drv.mod
        try:
            drv.call("cuInit", 0)
        except CudaError as exc:
            if exc.result_name in ("CUDA_ERROR_NO_DEVICE", "CUDA_ERROR_NOT_FOUND"):
                raise BackendUnavailable("cuda", f"cuInit: {exc.result_name} (no usable CUDA device)") from None
            raise
        count = int(drv.call("cuDeviceGetCount"))
        if not 0 <= self.device_index < count:
            raise BackendUnavailable(
                "cuda", f"device {self.device_index} does not exist ({count} CUDA device(s) visible)"
            )
        self._dev = drv.call("cuDeviceGet", self.device_index)
        supported = drv.call(
            "cuDeviceGetAttribute", d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, self._dev
        )
        if not supported:
            raise BackendUnavailable("cuda", f"device {self.device_index} does not support memory pools")
        raw_name = drv.call("cuDeviceGetName", 256, self._dev)
        self.device_name = (raw_name.split(b"\0", 1)[0].decode(errors="replace")
                            if isinstance(raw_name, bytes) else str(raw_name))
        self._prev_ctx = drv.call("cuCtxGetCurrent")
        self._ctx = drv.call("cuDevicePrimaryCtxRetain", self._dev)
        drv.call("cuCtxSetCurrent", self._ctx)
        self._stream = drv.call("cuStreamCreate", int(d.CUstream_flags.CU_STREAM_NON_BLOCKING))
        self.granularity = int(drv.call(
            "cuMemGetAllocationGranularity",
            self._alloc_prop(),
            d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        ))
        self.pool_max_size = 0 if self.gpu_cap_bytes is None else round_up(max(1, self.gpu_cap_bytes), self.granularity)
        props = d.CUmemPoolProps()
        props.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.handleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        props.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = self.device_index
        props.maxSize = self.pool_max_size
        self._pool = drv.call("cuMemPoolCreate", props)
        if self.release_threshold is not None:
            drv.call(
                "cuMemPoolSetAttribute",
                self._pool,
                d.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                d.cuuint64_t(self.release_threshold),
            )
        self.total_bytes = 0
        free, total = drv.call("cuMemGetInfo")
        self.total_bytes = int(total)
        self.free_bytes_at_start = int(free)

    def _alloc_prop(self) -> Any:
        d = self._drv.mod
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device_index
        return prop

    def _current(self) -> None:
        """Make our context current if this call comes from a thread we have not seen."""
        if threading.get_ident() != self._thread:
            self._drv.call("cuCtxSetCurrent", self._ctx)
            self._thread = threading.get_ident()

    def _open(self) -> None:
        if self._closed:
            raise CudaError("cuda backend", "CUDA_ERROR_CONTEXT_IS_DESTROYED", 709,
                            message="the cuda backend of this worker is closed")

    # ------------------------------------------------------------ buffers

    def alloc(self, nbytes: int) -> CudaBuffer:
        if self._closed:
            self._open()
        if _get_ident() != self._thread:
            self._current()
        self.alloc_calls += 1
        err, ptr = self._alloc_async(nbytes, self._pool, self._stream)
        if err:
            if err == self._oom:
                limit = self.pool_max_size or self.total_bytes
                raise DeviceOutOfMemory(
                    nbytes, limit, self.in_use,
                    f"CUDA_ERROR_OUT_OF_MEMORY from cuMemAllocFromPoolAsync on device {self.device_index}: "
                    f"requested {nbytes:,} B with {self.in_use:,} B allocated in this process"
                    + (f" (pool maxSize {self.pool_max_size:,} B)" if self.pool_max_size else ""),
                )
            raise self._drv.error("cuMemAllocFromPoolAsync", err)
        buf = CudaBuffer(nbytes, ptr)
        self._live.add(buf)
        self.in_use += nbytes
        return buf

    def free(self, buf: DeviceBuffer) -> None:
        if buf not in self._live:
            return  # freed already (or by close), or not ours
        assert isinstance(buf, CudaBuffer)
        if _get_ident() != self._thread:
            self._current()
        self._live.discard(buf)
        self.in_use -= buf.nbytes
        (err,) = self._free_async(buf.ptr, self._stream)
        if err:
            error = self._drv.error("cuMemFreeAsync", err)
            if self._drv.context_lost is not None:
                return  # the context is gone, and its memory goes with the process: nothing to undo
            raise error

    def _copy(self, call: str, dst: Any, src: Any, nbytes: int) -> None:
        """One copy on our stream, waited for: the host side (a message frame, or a region the
        client reuses after the reply) must outlive it."""
        if not nbytes:
            return
        self._open()
        self._current()
        self._drv.call(call, dst, src, nbytes, self._stream)
        self._drv.call("cuStreamSynchronize", self._stream)

    def write(self, buf: DeviceBuffer, offset: int, data: memoryview) -> None:
        assert isinstance(buf, CudaBuffer)
        self._copy("cuMemcpyHtoDAsync", buf.addr + offset, data, len(data))

    def read(self, buf: DeviceBuffer, offset: int, nbytes: int) -> bytes:
        out = bytearray(nbytes)
        self.read_into(buf, offset, memoryview(out))
        return bytes(out)

    def read_into(self, buf: DeviceBuffer, offset: int, dest: memoryview) -> None:
        assert isinstance(buf, CudaBuffer)
        self._copy("cuMemcpyDtoHAsync", dest, buf.addr + offset, len(dest))

    # ------------------------------------------------------- pinned staging

    def pin_host(self, view: memoryview) -> int | None:
        """``cuMemHostRegister`` a mapped region so copies from/to it are DMA at link speed.

        A refusal (no such support, a locked-memory limit) is logged and the
        region is copied as pageable memory instead: slower, never wrong.
        """
        if not len(view):
            return None
        self._open()
        self._current()
        addr = _host_address(view)
        try:
            self._drv.call("cuMemHostRegister", addr, len(view), 0)
        except CudaError as exc:
            log_event(_log, logging.WARNING, "cuda.host_register_failed", nbytes=len(view), error=str(exc))
            return None
        self._pinned[addr] = len(view)
        return addr

    def unpin_host(self, addr: int) -> None:
        if self._pinned.pop(addr, None) is None or self._closed:
            return
        try:
            self._current()
            self._drv.call("cuMemHostUnregister", addr)
        except Exception as exc:  # noqa: BLE001 - cleanup: logged, never raised
            log_event(_log, logging.WARNING, "cuda.host_unregister_failed", error=str(exc))

    def write_host(self, buf: DeviceBuffer, offset: int, data: memoryview, addr: int | None) -> None:
        if addr is None:
            self.write(buf, offset, data)
            return
        assert isinstance(buf, CudaBuffer)
        self._copy("cuMemcpyHtoDAsync", buf.addr + offset, addr, len(data))

    def read_host(self, buf: DeviceBuffer, offset: int, dest: memoryview, addr: int | None) -> None:
        if addr is None:
            self.read_into(buf, offset, dest)
            return
        assert isinstance(buf, CudaBuffer)
        self._copy("cuMemcpyDtoHAsync", addr, buf.addr + offset, len(dest))

    # ------------------------------------------------------------ tensor ops

    def kernels(self) -> Any:
        """The compiled kernels (NVRTC on first use)."""
        self._open()
        self._current()
        if self._kernels is None:
            from worker.backends.kernels import Kernels

            nvrtc = self._nvrtc_spec if isinstance(self._nvrtc_spec, Nvrtc) else Nvrtc(self._nvrtc_spec)
            self._kernels = Kernels.load(self._drv, nvrtc, self._dev, self._stream)
        return self._kernels

    def fill_f32(self, buf: DeviceBuffer, value: float, count: int) -> None:
        assert isinstance(buf, CudaBuffer)
        self.kernels().fill_f32(buf.addr, value, count)

    def axpy_f32(self, n: int, a: float, x: DeviceBuffer, y: DeviceBuffer) -> None:
        assert isinstance(x, CudaBuffer) and isinstance(y, CudaBuffer)
        self.kernels().axpy_f32(n, a, x.addr, y.addr)

    def sum_f32(self, buf: DeviceBuffer, count: int) -> float:
        assert isinstance(buf, CudaBuffer)
        result: float = self.kernels().sum_f32(buf.addr, count)
        return result

    def inject_kernel_fault(self) -> None:
        """Launch a kernel that writes through an unmapped address (fault injection ``cuda-fault``).

        On hardware this is a real ``CUDA_ERROR_ILLEGAL_ADDRESS``: sticky, the
        context is lost and the worker must end. Raises that :class:`CudaError`.
        """
        self.kernels().fill_f32(_UNMAPPED_ADDRESS, 0.0, 1)
        raise CudaError("cuda-fault", "CUDA_SUCCESS", 0,
                        message="the injected kernel fault did not fault (the address was mapped?)")

    # ------------------------------------------------------------- status

    @property
    def context_lost(self) -> str | None:
        """The sticky driver error that made this process's context unusable, or None."""
        return self._drv.context_lost

    def pool_attribute(self, name: str) -> int:
        """A ``CU_MEMPOOL_ATTR_<name>`` of the tenant pool (e.g. ``USED_MEM_CURRENT``)."""
        d = self._drv.mod
        self._current()
        value = self._drv.call("cuMemPoolGetAttribute", self._pool, getattr(d.CUmemPool_attribute, f"CU_MEMPOOL_ATTR_{name}"))
        return int(value)

    def mem_info(self) -> tuple[int, int]:
        """(free, total) device bytes from ``cuMemGetInfo``."""
        self._current()
        free, total = self._drv.call("cuMemGetInfo")
        return int(free), int(total)

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "backend": self.name,
            "device": self.device_index,
            "device_name": getattr(self, "device_name", ""),
            "capacity_bytes": getattr(self, "total_bytes", 0),
            "in_use_bytes": self.in_use,
            "pool_max_size": getattr(self, "pool_max_size", 0),
            "allocation_granularity": getattr(self, "granularity", 0),
            # reported, and set as the release threshold: a retention hint, not a cap
            "recorded_cuda_mem_pool_quota": self.release_threshold,
            "driver_module": self._drv.module_name,
        }
        if self.environment:
            out["environment"] = dict(self.environment)
        return out

    # ------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Free everything, destroy pool and stream, release the primary context. Never raises."""
        if self._closed:
            return
        self._closed = True
        if self._drv.context_lost is not None:
            # every call would return the sticky error again: the process exit frees it all
            log_event(_log, logging.WARNING, "cuda.context_lost", device=self.device_index,
                      error=self._drv.context_lost)
            self._live.clear()
            self.in_use = 0
            return
        self._teardown(log_only=True)

    def _teardown(self, *, log_only: bool) -> None:
        drv = self._drv

        def attempt(call: str, *args: Any, event: str = "cuda.cleanup_failed") -> bool:
            try:
                drv.call(call, *args)
                return True
            except Exception as exc:  # noqa: BLE001 - cleanup must go on; logged, never raised
                log_event(_log, logging.WARNING, event, call=call, device=self.device_index, error=str(exc))
                return False

        if self._ctx is not None and threading.get_ident() != self._thread:
            attempt("cuCtxSetCurrent", self._ctx)
        for addr in list(self._pinned):  # normally unpinned by the regions first
            attempt("cuMemHostUnregister", addr)
        self._pinned.clear()
        if self._stream is not None:
            for buf in list(self._live):
                attempt("cuMemFreeAsync", buf.ptr, self._stream)
            self._live.clear()
            self.in_use = 0
            attempt("cuStreamSynchronize", self._stream)
        if self._kernels is not None:
            self._kernels.close()
            self._kernels = None
        self._close_tensor_ops()
        if self._pool is not None:
            attempt("cuMemPoolDestroy", self._pool)
            self._pool = None
        if self._stream is not None:
            attempt("cuStreamDestroy", self._stream)
            self._stream = None
        if self._ctx is not None:
            # the crate's pop-failure warning: restoring the previous context failed
            attempt("cuCtxSetCurrent", self._prev_ctx, event="context.pop_failed")
            attempt("cuDevicePrimaryCtxRelease", self._dev, event="context.release_failed")
            self._ctx = None
