"""The cuda backend: one tenant process's own context, stream and hard-capped memory pool.

    CudaBackend(device, gpu_cap)         (once, when the worker is bound)
      [environment]                      MPS variables into os.environ - before cuInit
      cuInit(0)                          no libcuda: RuntimeError subclass -> BackendUnavailable
      cuDevicePrimaryCtxSetFlags(SCHED_BLOCKING_SYNC)   before first use: waits sleep, never spin
      cuDevicePrimaryCtxRetain -> cuCtxSetCurrent
      [context cost]                     cuMemGetInfo, cuCtxCreate a throw-away context,
                                         cuMemGetInfo, cuCtxDestroy: what one context takes
      cuStreamCreate(CU_STREAM_NON_BLOCKING)
      cuMemGetAllocationGranularity      maxSize = gpu cap rounded up to it (0 = no cap)
      cuMemPoolCreate(pinned, device, maxSize)          <- the driver-level hard cap
      cuMemAlloc(FIXED_SCRATCH_BYTES)    the one fixed scratch (sum/max partials, argmax rows,
                                         cuBLAS's fallback workspace: worker.backends.cuda_scratch)
      cuMemGetInfo                       fixed overhead = context + what set-up took

    alloc(n)   cuMemAllocFromPoolAsync(n, pool, stream)   OOM -> drain, cuMemPoolTrimTo(0), retry
               once -> DeviceOutOfMemory
    free(b)    cuMemFreeAsync(ptr, stream); a non-sticky error keeps b (and its metered bytes)
    reclaim()  after frees: cuStreamSynchronize + cuMemPoolTrimTo(pool, 0) (memory back to the device)
    retained_bytes()  cuMemPoolGetAttribute(RESERVED_MEM_CURRENT) - live bytes: what a free has not
               yet given back (the device budget is credited only past it; worker.allocator)
    write/read cuMemcpyHtoDAsync / cuMemcpyDtoHAsync + cuStreamSynchronize
    pin_host   cuMemHostRegister of a mapped shared-memory region (worker.regions):
               write_host/read_host then copy from/to its address as DMA; unpin_host
               (cuMemHostUnregister) before the region is unmapped, and at close
    fill/axpy/sum   NVRTC kernels on the stream (worker.backends.kernels)
    matmul, softmax ... the WASM ABI's tensor ops: cuBLAS + NVRTC kernels (worker.backends.cuda_ops),
               queued: an event every QUEUE_EVENT_EVERY ops, wait when QUEUE_MAX_EVENTS are out
    queued ops  under the gate (``queues_ops``): write-only ops run on the worker's device thread
               (worker.device_time), the context made current there once; a CudaStretchTimer's
               event pairs time them and the gate settles them at board boundaries
    end_run(deadline)  wait for the run's queued work until deadline + grace; past it the
               worker must exit (QueueOverrun): only destroying the context cancels queued work
    close()    free every buffer, synchronize, unpin, unload kernels, free the scratch, destroy
               pool and stream, restore the previous context (failure: warning
               ``context.pop_failed``), release the primary context - logged, never raised

Device memory nobody meters otherwise - the context, the fixed scratch, the
kernel modules, cuBLAS's handle and default workspace pool - is this
worker's *fixed overhead*: measured (``cuMemGetInfo`` around each piece) and
charged to the device budget (:meth:`attach_overhead_meter`) for as long as
the worker lives; the budget's slot for this process gives it back when the
process dies.

The release threshold (``recorded_cuda_mem_pool_quota``) is reported, never
set: a pool keeping freed memory past a synchronize is memory the device
budget has already credited back, which another tenant would then fail to
get. The pool keeps nothing (threshold 0) and :meth:`reclaim` trims it.

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

Calls come from the worker's executor thread and, for queued ops, its device
thread (one at a time for device work: the gate runs a synchronous op only
once the queue is empty; an allocation may overlap a queued launch, which
the driver orders on the stream). The context is made current once on each
thread that calls (CUDA contexts are current per thread).

Typing: cuda-python's bindings (and the tests' fake driver and cuBLAS) are untyped modules
(mypy: ignore_missing_imports). The handles they give are held as ``object`` and passed back; a
bindings module and what its calls return stay dynamically typed, converted (int(), bytes) where read.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, SupportsInt, TypeVar

from shared.cuda_compat import cublas_workspace_bytes, default_context_bytes
from shared.errors import BackendUnavailable, CudaError, KernelTimeout
from shared.log import get_logger, log_event
from worker.backends._driver import Driver, Nvrtc
from worker.backends.base import Backend, ByteMeter, DeviceBuffer, DeviceOutOfMemory
from worker.backends.cuda_ops import Closable, TensorOpsMixin
from worker.backends.cuda_scratch import FIXED_SCRATCH_BYTES

if TYPE_CHECKING:
    from worker.backends.cuda_timing import CudaStretchTimer
    from worker.backends.kernels import Kernels
    from worker.backends.timing import OpTimer

__all__ = ["QUEUE_EVENT_EVERY", "QUEUE_GRACE_S", "QUEUE_MAX_EVENTS", "CudaBackend",
           "CudaBuffer", "QueueOverrun", "round_up"]

T = TypeVar("T", bound=Closable)

_log = get_logger("worker.cuda")
#: queued GPU work per run: an event recorded every QUEUE_EVENT_EVERY async ops; when
#: QUEUE_MAX_EVENTS are outstanding the oldest is waited for (at most ~ EVERY x MAX ops in flight)
QUEUE_EVENT_EVERY = 16
QUEUE_MAX_EVENTS = 4
#: how long past a run's deadline its queued work may take before the worker must exit
QUEUE_GRACE_S = 1.0
_CU_EVENT_DISABLE_TIMING = 2
_CU_CTX_SCHED_BLOCKING_SYNC = 4


class QueueOverrun(KernelTimeout):
    """A run's queued GPU work did not finish by its deadline plus the grace period.

    Nothing but destroying the context cancels queued work, so the worker
    answers this and exits (``shared.exitcodes.WORKER_GPU_QUEUE_OVERRUN``); the
    supervisor restarts the instance as for any deadline.
    """
#: retained_bytes() when the pool's memory comes back only with the process: above any withheld sum
_ALL_RETAINED = 1 << 62
#: inside the first page: never mapped in any CUDA context, so a write there always faults
_UNMAPPED_ADDRESS = 0x100
#: ops whose first use compiles this backend's own kernels (:meth:`CudaBackend.kernels`)
_KERNEL_OPS = frozenset({"fill_f32", "axpy_f32", "sum_f32"})
#: tensor ops that call cuBLAS (its handle is loaded on the first)
_BLAS_OPS = frozenset({"matmul_f32", "gemm_f32", "gemm_strided_batched_f32", "gemm_ex"})
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

    def __init__(self, nbytes: int, ptr: SupportsInt) -> None:
        self.nbytes = nbytes  # (no super().__init__: this is the allocation hot path)
        self.ptr = ptr

    @property
    def addr(self) -> int:
        return int(self.ptr)


class CudaBackend(TensorOpsMixin, Backend):
    """A CUDA context, non-blocking stream and capped pool on one device, for one tenant process."""

    name = "cuda"
    #: write-only ops are queued and run on the worker's device thread (worker.device_time), timed
    #: by a :class:`~worker.backends.cuda_timing.CudaStretchTimer` settled at board boundaries
    queues_ops = True

    def __init__(
        self,
        device_index: int = 0,
        *,
        gpu_cap_bytes: int | None = None,
        release_threshold: int | None = None,
        driver: object = None,  # a Driver, a module name, or a module(-shaped) object
        nvrtc: object = None,  # likewise for NVRTC
        environment: dict[str, str] | None = None,
        cublas: object = None,  # likewise for cuBLAS
        context_bytes: int | None = None,
        queue_grace_s: float = QUEUE_GRACE_S,
    ) -> None:
        """Set up context, stream and pool; raises BackendUnavailable / CudaError (nothing held then).

        ``driver`` / ``nvrtc``: a module name, a module(-shaped) object or a
        ready :class:`Driver`; the real cuda-python modules by default.
        ``environment`` goes into ``os.environ`` before ``cuInit`` (MPS).
        ``context_bytes``: what one context costs on this device, when known
        (else measured with a throw-away context at set-up).
        """
        if environment:
            os.environ.update({str(k): str(v) for k, v in environment.items()})
        self.device_index = device_index
        self.gpu_cap_bytes = gpu_cap_bytes
        self.release_threshold = release_threshold
        self.environment = dict(environment or {})
        self._drv = driver if isinstance(driver, Driver) else Driver(driver)
        self._nvrtc_spec = nvrtc
        self._kernels: Kernels | None = None
        self._cublas_spec = cublas  # cuBLAS bindings module (name or object); imported on the first GEMM
        self._tensor_ops = None  # the WASM ABI's tensor ops (worker.backends.cuda_ops), on first use
        self._live: set[CudaBuffer] = set()
        self._pinned: dict[int, int] = {}  # cuMemHostRegister'ed host ranges: address -> bytes
        self.in_use = 0
        self.alloc_calls = 0  # cuMemAllocFromPoolAsync calls made (the GPU check reads it)
        self._closed = False
        self._ctx: object = None
        self._prev_ctx: object = None
        self._stream: object = None
        self._pool: object = None
        self._dev: object = None
        self._thread = threading.get_ident()
        #: per thread: whether our context was made current on it (a new thread object starts False,
        #: even one that reuses a dead thread's ident)
        self._ctx_tls = threading.local()
        #: the device thread of queued ops (its stretch timer bounds its work: no note_enqueued events)
        self._queue_thread: int | None = None
        self._scratch: int | None = None
        self.context_bytes = context_bytes
        #: where context_bytes came from: "given" (the supervisor's probe, or the caller),
        #: "measured" (here, at set-up) or "default" (not measurable: the device class's figure)
        self.context_bytes_source = "given" if context_bytes is not None else "measured"
        self.compute_capability = (0, 0)
        self.cublas_workspace_bytes = 0
        self.queue_grace_s = queue_grace_s
        #: device bytes this worker holds outside the tenant's pool (context, scratch, modules, cuBLAS)
        self.overhead_bytes = 0
        self._overhead_meter: ByteMeter | None = None
        self._overhead_charged = 0
        # queued work: events in flight (oldest first), idle events, async ops since the last event
        self._inflight: deque[object] = deque()
        self._idle_events: list[object] = []
        self._since_event = 0
        self._run_limit: float | None = None  # the current run's latest wait (monotonic), or None
        #: set once a run's queued work outlived its deadline: the worker must exit (QueueOverrun)
        self.queue_overrun = False
        self._freed = False  # frees since the last reclaim()
        self._pool_destroyed = False  # cuMemPoolDestroy succeeded: nothing retained any more
        self.trims = 0  # cuMemPoolTrimTo calls made
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

    def op_timer(self) -> OpTimer:
        """CUDA events on the tenant stream (shared.gpu_time charges by them)."""
        from worker.backends.cuda_timing import CudaEventTimer

        self._open()
        timer = CudaEventTimer(self._drv, self._stream, self._current)
        self.launch_hooks().timer = timer  # the kernels record its events right around their launches
        return timer

    def queue_timer(self) -> CudaStretchTimer:
        """The device thread's timer of queued ops (called there): the context made current on
        that thread, a ring of event pairs made once, the launch hooks of this thread forwarded
        to it. Its settle past the run's limit is this backend's :class:`QueueOverrun`."""
        from worker.backends.cuda_timing import CudaStretchTimer

        self._open()
        self._current()
        timer = CudaStretchTimer(self._drv, self._stream, self._current, self._overrun)
        self.launch_hooks().timer = timer
        self._queue_thread = threading.get_ident()
        return timer

    def view(self, buf: DeviceBuffer, offset: int, nbytes: int) -> CudaBuffer:
        """A window on ``buf`` for chunked ops (never in ``_live``: never freed)."""
        return CudaBuffer(nbytes, int(buf.ptr) + offset)  # type: ignore[attr-defined]

    @classmethod
    def from_options(cls, options: dict[str, object]) -> CudaBackend:
        """Build from the bind message's backend options (see ``supervisor.lifecycle.workerset``)."""
        cap = options.get("gpu_memory_bytes_cap")
        threshold = options.get("recorded_cuda_mem_pool_quota")
        env = options.get("environment") or {}
        if not isinstance(env, dict):
            raise BackendUnavailable("cuda", f"backend option 'environment' must be a table, got {type(env).__name__}")
        ctx_bytes = options.get("context_bytes")
        return cls(
            _int_option("device_index", options.get("device_index", 0)),
            context_bytes=None if ctx_bytes is None else _int_option("context_bytes", ctx_bytes),
            gpu_cap_bytes=None if cap is None else _int_option("gpu_memory_bytes_cap", cap),
            release_threshold=None if threshold is None else _int_option("recorded_cuda_mem_pool_quota", threshold),
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
        attr = d.CUdevice_attribute
        self.compute_capability = (
            int(drv.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self._dev)),
            int(drv.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self._dev)))
        #: the workspace each run lends cuBLAS (metered as the run's buffer): per device class
        self.cublas_workspace_bytes = cublas_workspace_bytes(self.compute_capability[0])
        self._prev_ctx = drv.call("cuCtxGetCurrent")
        # Before the context's first use: a wait (synchronize, event) sleeps on an interrupt instead
        # of spinning a core - with one context per worker, the default (SCHED_AUTO: spin while
        # contexts <= cores) would burn a core per waiting worker. Refused only by a driver that
        # cannot change an active primary context (another user in this process): logged, not fatal.
        try:
            drv.call("cuDevicePrimaryCtxSetFlags", self._dev, _CU_CTX_SCHED_BLOCKING_SYNC)
        except CudaError as exc:
            log_event(_log, logging.WARNING, "cuda.ctx_flags_refused", device=self.device_index, error=str(exc))
        self._ctx = drv.call("cuDevicePrimaryCtxRetain", self._dev)
        drv.call("cuCtxSetCurrent", self._ctx)
        self._ctx_tls.current = True
        free_at_start = int(drv.call("cuMemGetInfo")[0])
        if self.context_bytes is None:
            self.context_bytes = self._measure_context()
        assert self.context_bytes is not None
        self._stream = drv.call("cuStreamCreate", int(d.CUstream_flags.CU_STREAM_NON_BLOCKING))
        self.granularity = int(drv.call(
            "cuMemGetAllocationGranularity",
            self._alloc_prop(),
            d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        ))
        self.pool_max_size = 0 if self.gpu_cap_bytes is None else round_up(max(1, self.gpu_cap_bytes), self.granularity)
        self._pool = drv.call("cuMemPoolCreate", drv.api.pool_props(d, self.device_index, self.pool_max_size))
        # what the driver enforces may be more than asked (it rounds maxSize up): read it back, so the
        # OOM message and status name the real backstop (cuda-bindings 12.x cannot: the size asked for)
        self.pool_max_size_effective = self.pool_max_size
        max_attr = drv.api.max_pool_size_attribute(d)
        if self.pool_max_size and max_attr is not None:
            try:
                self.pool_max_size_effective = int(drv.call("cuMemPoolGetAttribute", self._pool, max_attr))
            except CudaError:  # a driver older than the binding: the size asked for
                if drv.context_lost is not None:
                    raise
        # (no CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: it stays 0, so freed memory leaves the pool)
        self._scratch = int(drv.call("cuMemAlloc", FIXED_SCRATCH_BYTES))
        self.total_bytes = 0
        free, total = drv.call("cuMemGetInfo")
        self.total_bytes = int(total)
        self.free_bytes_at_start = int(free)
        # what set-up took (stream, pool, scratch) is a cuMemGetInfo delta on a shared device: another
        # process freeing memory meanwhile shrinks it, so it is never counted below the scratch we hold
        self.overhead_bytes = self.context_bytes + max(FIXED_SCRATCH_BYTES, free_at_start - int(free))

    def _measure_context(self) -> int:
        """Device bytes one more context takes: ``cuMemGetInfo`` around a throw-away ``cuCtxCreate``.

        Only when the supervisor passed no figure (its probe measures once per device, before any
        worker starts, so concurrent starts cannot skew it; a backend made directly measures here).
        Our own primary context is already made when a context exists to ask ``cuMemGetInfo``, so
        a second one is measured instead (the same cost: same device, same process, same loading
        mode). Another process allocating at the same moment skews it either way; it is clamped
        at 0. A device that refuses a second context (compute mode EXCLUSIVE_PROCESS, no memory
        left for one) or any other non-sticky failure is never counted as free: the conservative
        default of the device class (:func:`shared.cuda_compat.default_context_bytes`), logged.
        """
        drv = self._drv
        try:
            free_before = int(drv.call("cuMemGetInfo")[0])
            tmp = drv.create_context(0, self._dev)
        except CudaError as exc:
            if drv.context_lost is not None:
                raise
            return self._context_default(exc)
        try:
            free_after = int(drv.call("cuMemGetInfo")[0])
        except CudaError as exc:
            if drv.context_lost is not None:
                raise
            return self._context_default(exc)
        finally:
            drv.call("cuCtxDestroy", tmp)
            drv.call("cuCtxSetCurrent", self._ctx)
        self.context_bytes_source = "measured"
        return max(0, free_before - free_after)

    def _context_default(self, exc: CudaError) -> int:
        self._drv.call("cuCtxSetCurrent", self._ctx)
        fallback = default_context_bytes(self.compute_capability[0])
        self.context_bytes_source = "default"
        log_event(_log, logging.WARNING, "cuda.context_not_measured", device=self.device_index, error=str(exc),
                  compute_capability="{}.{}".format(*self.compute_capability), assumed_bytes=fallback)
        return fallback

    # ------------------------------------------------------- fixed overhead

    def attach_overhead_meter(self, meter: ByteMeter) -> None:
        """Charge this worker's fixed overhead to ``meter`` (the device budget), now and as it grows.

        Raises the meter's refusal (``GpuMemoryExhausted``) when the device
        has no room for this worker at all.
        """
        self._overhead_meter = meter
        self._charge_overhead()

    def _charge_overhead(self) -> None:
        meter = self._overhead_meter
        due = self.overhead_bytes - self._overhead_charged
        if meter is None or due <= 0:
            return
        meter.consume(due)
        self._overhead_charged += due

    def _measured(self, load: Callable[[], T]) -> T:
        """Run ``load()`` (a module, a cuBLAS handle) and add what it took from the device to the
        fixed overhead, charged at once; a refused charge undoes the load (``close()`` on its result)."""
        free_before = int(self._drv.call("cuMemGetInfo")[0])
        out = load()
        try:
            self.overhead_bytes += max(0, free_before - int(self._drv.call("cuMemGetInfo")[0]))
            self._charge_overhead()
        except BaseException:
            try:
                out.close()
            finally:
                self.overhead_bytes = self._overhead_charged
            raise
        return out

    def _alloc_prop(self) -> object:
        d = self._drv.mod
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device_index
        return prop

    def _current(self) -> None:
        """Make our context current on the calling thread, once per thread (the executor's and the
        device thread's calls alternate; neither pays a cuCtxSetCurrent per switch)."""
        tid = threading.get_ident()
        if tid != self._thread:
            if not getattr(self._ctx_tls, "current", False):
                self._drv.call("cuCtxSetCurrent", self._ctx)
                self._ctx_tls.current = True
            self._thread = tid

    def _open(self) -> None:
        if self._closed:
            raise CudaError("cuda backend", "CUDA_ERROR_CONTEXT_IS_DESTROYED", 709,
                            message="the cuda backend of this worker is closed")
        if self.queue_overrun:
            self._overrun()  # no more work onto a queue the worker exits to cancel

    # ------------------------------------------------------------ buffers

    def alloc(self, nbytes: int) -> CudaBuffer:
        if self._closed:
            self._open()
        if _get_ident() != self._thread:
            self._current()
        self.alloc_calls += 1
        err, ptr = self._alloc_async(nbytes, self._pool, self._stream)
        if err == self._oom:
            # memory freed on the stream but not yet observed, or reserve the pool still holds in
            # pieces too small for this request: drain, give it back, and try once more
            self._drain_and_trim()
            self.alloc_calls += 1
            err, ptr = self._alloc_async(nbytes, self._pool, self._stream)
        if err:
            if err == self._oom:
                limit = self.pool_max_size or self.total_bytes
                raise DeviceOutOfMemory(
                    nbytes, limit, self.in_use,
                    f"CUDA_ERROR_OUT_OF_MEMORY from cuMemAllocFromPoolAsync on device {self.device_index}: "
                    f"requested {nbytes:,} B with {self.in_use:,} B allocated in this process"
                    + (f" (pool maxSize {self.pool_max_size_effective:,} B)" if self.pool_max_size else ""),
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
        (err,) = self._free_async(buf.ptr, self._stream)
        if err:
            error = self._drv.error("cuMemFreeAsync", err)
            if self._drv.context_lost is not None:
                self._live.discard(buf)
                self.in_use -= buf.nbytes
                return  # the context is gone, and its memory goes with the process: nothing to undo
            # the pool may still hold it: it stays ours (and metered); close() frees it again
            raise error
        self._live.discard(buf)
        self.in_use -= buf.nbytes
        self._freed = True

    def holds(self, buf: DeviceBuffer) -> bool:
        return buf in self._live

    def reclaim(self) -> None:
        """Give freed pool memory back to the device: synchronize (the frees are observed), then
        ``cuMemPoolTrimTo(pool, 0)``. Called after explicit frees and at run end (batched: one per
        request or run), and by the allocator when the device budget refuses while freed bytes are
        withheld (inside a run: the queued work is waited for within the run's limit first).
        Errors go through the driver funnel (a sticky one ends the worker)."""
        if not self._freed or self._closed or self.queue_overrun or self._drv.context_lost is not None:
            return  # (a lost context's memory comes back with the process only)
        self._current()
        self.wait_idle()
        self._drv.call("cuStreamSynchronize", self._stream)
        self._trim()

    def retained_bytes(self) -> int:
        """What the pool reserves beyond the live buffers (``CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT``
        minus their bytes): freed memory not yet back on the device, plus the pool's rounding of
        the live ones. The device budget is credited for frees only past it (worker.allocator).

        0 once the pool is destroyed; everything (a bound no withheld byte reaches) while the
        memory can only come back with the process: a lost context, an overrun queue, a closed
        backend whose pool was not destroyed, or a failed read (logged).
        """
        if self._pool_destroyed:
            return 0
        if self._closed or self._pool is None or self.queue_overrun or self._drv.context_lost is not None:
            return _ALL_RETAINED
        try:
            self._current()
            reserved = int(self._drv.call("cuMemPoolGetAttribute", self._pool,
                                          self._drv.mod.CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT))
        except CudaError as exc:
            log_event(_log, logging.WARNING, "cuda.pool_read_failed", device=self.device_index, error=str(exc))
            return _ALL_RETAINED
        return max(0, reserved - self.in_use)

    def _trim(self) -> None:
        self._drv.call("cuMemPoolTrimTo", self._pool, 0)
        self.trims += 1
        self._freed = False

    def _drain_and_trim(self) -> None:
        try:
            if self._drain(self._run_limit):
                self._drv.call("cuStreamSynchronize", self._stream)  # idle: returns at once
                self._trim()
        except CudaError:
            if self._drv.context_lost is not None:
                raise
            # a non-sticky failure here only loses the retry's chance; the retry answers

    # ------------------------------------------------------- queued work

    def begin_run(self, limit: float | None) -> None:
        """A WASM run starts; no wait for its queued work lasts past ``limit`` (monotonic)."""
        self._run_limit = None if limit is None else limit + self.queue_grace_s

    def note_enqueued(self) -> None:
        """One more asynchronous op is on the stream: bound the queue (an event every
        QUEUE_EVENT_EVERY ops; with QUEUE_MAX_EVENTS out, wait for the oldest). Not on the device
        thread of queued ops: its stretch timer's ring and the gate's settles bound that work, and
        these events are the executor thread's."""
        if self._queue_thread is not None and _get_ident() == self._queue_thread:
            return
        self._since_event += 1
        if self._since_event < QUEUE_EVENT_EVERY:
            return
        self._since_event = 0
        ev = self._idle_events.pop() if self._idle_events else self._drv.call(
            "cuEventCreate", _CU_EVENT_DISABLE_TIMING)
        try:
            self._drv.call("cuEventRecord", ev, self._stream)
        except BaseException:
            self._idle_events.append(ev)
            raise
        self._inflight.append(ev)
        while len(self._inflight) > QUEUE_MAX_EVENTS:
            oldest = self._inflight[0]
            if not self._wait_event(oldest, self._run_limit):
                self._overrun()
            self._idle_events.append(self._inflight.popleft())

    def _wait_event(self, ev: object, until: float | None) -> bool:
        """Poll ``cuEventQuery`` until the event completes (True) or ``until`` passes (False).

        Polling (sleeping between queries), not ``cuEventSynchronize``: a wait
        must end at the deadline, and a blocking driver wait cannot be cut short.
        """
        not_ready = self._drv.CUresult.CUDA_ERROR_NOT_READY
        query = self._drv.mod.cuEventQuery
        pause = 50e-6
        while True:
            (err,) = query(ev)
            if not err:
                return True
            if err != not_ready:
                raise self._drv.error("cuEventQuery", err)  # a sticky fault in the queued work
            if until is not None and time.monotonic() >= until:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)

    def wait_idle(self) -> None:
        """Before a blocking synchronize inside a run (a copy, a reduction to the host): wait for the
        queued work first, bounded by the run's limit (a blocking driver wait could not be cut
        short at the deadline); past it, :class:`QueueOverrun`. Outside runs nothing is queued."""
        if self._run_limit is not None and (self._inflight or self._since_event):
            if not self._drain(self._run_limit):
                self._overrun()

    def _drain(self, until: float | None) -> bool:
        """Wait for everything queued so far (until ``until`` at most); the events in flight retire."""
        ev = self._idle_events.pop() if self._idle_events else self._drv.call(
            "cuEventCreate", _CU_EVENT_DISABLE_TIMING)
        try:
            self._drv.call("cuEventRecord", ev, self._stream)
            if not self._wait_event(ev, until):
                return False
        finally:
            self._idle_events.append(ev)
        self._idle_events.extend(self._inflight)
        self._inflight.clear()
        self._since_event = 0
        return True

    def _overrun(self) -> None:
        self.queue_overrun = True
        log_event(_log, logging.ERROR, "cuda.queue_overrun", device=self.device_index,
                  grace_s=self.queue_grace_s)
        raise QueueOverrun(self.queue_grace_s, message=(
            "the run's queued GPU work did not finish by its deadline plus "
            f"{self.queue_grace_s:g} s; only destroying the CUDA context cancels it, so this worker exits "
            "and the supervisor restarts it"))

    def end_run(self, deadline: float | None) -> None:
        """At a run's end: wait for its queued work until ``deadline`` + grace, then give its freed
        memory back. :class:`QueueOverrun` past that (also when a wait during the run overran)."""
        self._run_limit = None
        if self._closed or self._drv.context_lost is not None:
            return
        if self.queue_overrun:
            self._overrun()
        self._current()
        until = None if deadline is None else max(deadline, time.monotonic()) + self.queue_grace_s
        if not self._drain(until):
            self._overrun()
        try:
            self.reclaim()
        except CudaError as exc:
            if self._drv.context_lost is not None:
                raise
            # a non-sticky failure to give memory back must not turn a finished run into an error
            log_event(_log, logging.WARNING, "cuda.reclaim_failed", device=self.device_index, error=str(exc))

    def _copy(self, call: str, dst: object, src: object, nbytes: int) -> None:
        """One copy on our stream, waited for: the host side (a message frame, or a region the
        client reuses after the reply) must outlive it."""
        if not nbytes:
            return
        self._open()
        self._current()
        self._drv.call(call, dst, src, nbytes, self._stream)
        self.wait_idle()
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

    def kernels(self) -> Kernels:
        """The compiled kernels (NVRTC on first use)."""
        self._open()
        self._current()
        if self._kernels is None:
            from worker.backends.kernels import Kernels

            nvrtc = self._nvrtc_spec if isinstance(self._nvrtc_spec, Nvrtc) else Nvrtc(self._nvrtc_spec)
            assert self._scratch is not None
            scratch = self._scratch
            self._kernels = self._measured(lambda: Kernels.load(self._drv, nvrtc, self._dev, self._stream, scratch,
                                                                wait_idle=self.wait_idle))
            self._kernels.hooks = self.launch_hooks()
        return self._kernels

    def prepare(self, op: str) -> None:
        """Compile the kernels ``op`` launches (NVRTC) and load cuBLAS for a GEMM, before the device
        gate takes the lease for it (see :meth:`Backend.prepare`)."""
        if op in _KERNEL_OPS:
            self.kernels()
        elif op in _BLAS_OPS:
            _ = self.tensor_ops().cublas
        elif callable(getattr(TensorOpsMixin, op, None)):
            self.tensor_ops()

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

    def info(self) -> dict[str, object]:
        out: dict[str, object] = {
            "backend": self.name,
            "device": self.device_index,
            "device_name": getattr(self, "device_name", ""),
            "capacity_bytes": getattr(self, "total_bytes", 0),
            "in_use_bytes": self.in_use,
            "pool_max_size": getattr(self, "pool_max_size", 0),
            "pool_max_size_effective": getattr(self, "pool_max_size_effective", 0),  # as the driver reads it back
            "allocation_granularity": getattr(self, "granularity", 0),
            # reported only: the pool's release threshold stays 0 (freed memory goes back to the device)
            "recorded_cuda_mem_pool_quota": self.release_threshold,
            "driver_module": self._drv.module_name,
        }
        out["fixed_overhead_bytes"] = self.overhead_bytes
        out["context_bytes"] = self.context_bytes
        out["context_bytes_source"] = self.context_bytes_source
        out["compute_capability"] = "{}.{}".format(*self.compute_capability)
        out["cublas_workspace_bytes"] = self.cublas_workspace_bytes
        out["cuda_bindings"] = self._drv.api.version
        if self.environment:
            out["environment"] = dict(self.environment)
        return out

    # ------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Free everything, destroy pool and stream, release the primary context. Never raises."""
        if self._closed:
            return
        self._closed = True
        if self._drv.context_lost is not None or self.queue_overrun:
            # a lost context fails every call; an overrun queue would block every synchronize:
            # either way the process exit (which destroys the context) frees it all
            log_event(_log, logging.WARNING, "cuda.context_lost" if self._drv.context_lost else "cuda.close_skipped",
                      device=self.device_index, error=self._drv.context_lost or "queued work past its deadline")
            self._live.clear()
            self.in_use = 0
            self._release_overhead()
            return
        self._teardown(log_only=True)
        self._release_overhead()

    def _release_overhead(self) -> None:
        meter, charged = self._overhead_meter, self._overhead_charged
        self._overhead_meter, self._overhead_charged = None, 0
        if meter is not None and charged:
            try:
                meter.release(charged)
            except Exception as exc:  # noqa: BLE001 - cleanup: logged, never raised
                log_event(_log, logging.WARNING, "cuda.overhead_release_failed", error=str(exc))

    def _teardown(self, *, log_only: bool) -> None:
        drv = self._drv

        def attempt(call: str, *args: object, event: str = "cuda.cleanup_failed") -> bool:
            try:
                drv.call(call, *args)
                return True
            except Exception as exc:  # noqa: BLE001 - cleanup must go on; logged, never raised
                log_event(_log, logging.WARNING, event, call=call, device=self.device_index, error=str(exc))
                return False

        if self._ctx is not None and threading.get_ident() != self._thread:
            attempt("cuCtxSetCurrent", self._ctx)
        if self._stream is not None:
            for buf in list(self._live):
                attempt("cuMemFreeAsync", buf.ptr, self._stream)
            self._live.clear()
            self.in_use = 0
            attempt("cuStreamSynchronize", self._stream)
        # after the synchronize: a queued copy may still be reading or writing pinned pages
        for addr in list(self._pinned):  # normally unpinned by the regions first
            attempt("cuMemHostUnregister", addr)
        self._pinned.clear()
        if self._kernels is not None:
            self._kernels.close()
            self._kernels = None
        self._close_tensor_ops()
        for ev in [*self._inflight, *self._idle_events]:
            attempt("cuEventDestroy", ev)
        self._inflight.clear()
        self._idle_events.clear()
        if self._scratch is not None:
            attempt("cuMemFree", self._scratch)
            self._scratch = None
        if self._pool is not None:
            # its memory is back on the device once destroyed (every buffer was freed and the stream
            # synchronized above); if not, it comes back with the process
            self._pool_destroyed = attempt("cuMemPoolDestroy", self._pool)
            self._pool = None
        if self._stream is not None:
            attempt("cuStreamDestroy", self._stream)
            self._stream = None
        if self._ctx is not None:
            # the crate's pop-failure warning: restoring the previous context failed
            attempt("cuCtxSetCurrent", self._prev_ctx, event="context.pop_failed")
            attempt("cuDevicePrimaryCtxRelease", self._dev, event="context.release_failed")
            self._ctx = None


def _int_option(name: str, value: object) -> int:
    """An int backend option (written by the supervisor; a wrong type is said plainly)."""
    if not isinstance(value, (int, float, str)):
        raise BackendUnavailable("cuda", f"backend option {name!r} must be an int, got {type(value).__name__}")
    return int(value)
