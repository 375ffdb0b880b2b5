"""The backend interface: what a compute backend must do for one tenant process.

The worker's :class:`~worker.context.TenantContext` meters every allocation
in shared memory *before* calling a backend, validates every handle, offset
and length, and turns :class:`DeviceOutOfMemory` into a quota refusal after
rolling the metered bytes back. A backend therefore only moves bytes and runs
ops on buffers it created, with arguments already known to be in range.

All calls come from the worker's executor thread (CUDA contexts are
per-thread), never concurrently.
"""

from __future__ import annotations

import abc
from typing import Protocol

from worker.backends.timing import HostTimer, OpTimer

__all__ = ["Backend", "ByteMeter", "DeviceBuffer", "DeviceOutOfMemory"]


class ByteMeter(Protocol):
    """A second counter consumed after the tenant's (the per-device budget): the allocator charges
    tenant buffers to it, a backend the device memory it holds outside any buffer."""

    def consume(self, n: int) -> None: ...
    def release(self, n: int) -> None: ...


class DeviceOutOfMemory(Exception):
    """The device (or the driver-level pool cap) refused an allocation.

    Internal to the worker: the allocator releases the metered bytes and
    raises :class:`shared.errors.GpuMemoryExhausted` with these numbers.
    """

    def __init__(self, requested: int, limit: int, in_use: int, detail: str = "") -> None:
        self.requested = requested
        self.limit = limit
        self.in_use = in_use
        self.detail = detail
        super().__init__(detail or f"device out of memory: requested {requested} with {in_use} of {limit} in use")


class DeviceBuffer:
    """A backend's buffer; ``nbytes`` is its usable size. Subclassed per backend."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class Backend(abc.ABC):
    """One tenant process's device state: context, stream, pool (or their simulation)."""

    #: "stub" or "cuda"
    name: str = "abstract"

    @property
    def device_executor(self) -> bool:
        """Whether the queue timer launches chunks on a device executor of the process's own (the
        stub's, ``worker.backends.stub_executor``): the device's CPU is then that thread's."""
        return False

    @property
    def context_lost(self) -> str | None:
        """A sticky driver error's name once the device context is unusable (the worker then exits)."""
        return None

    # -- device work and memory beyond single calls (the cuda backend's; no-ops for a host backend)

    def holds(self, buf: DeviceBuffer) -> bool:
        """Whether ``buf`` is still this backend's after a :meth:`free` that raised (the pool may
        still hold its memory, so its bytes must stay metered)."""
        return False

    def reclaim(self) -> None:
        """Give memory freed since the last call back to the device (after explicit frees)."""

    def retained_bytes(self) -> int:
        """Device bytes this backend still holds beyond its live buffers (a pool's freed, not yet
        returned memory): the device budget is credited for a free only past them. 0: none (host memory)."""
        return 0

    def prepare(self, op: str) -> None:
        """Load now what op ``op`` loads on its first use (compiled kernels, a BLAS handle). The device
        gate calls this before it takes the device lease for a worker's first op of each kind: an op
        runs under the lease, and a load inside it (a compile of hundreds of ms) held every other
        tenant's device work up. Nothing here: a backend that loads nothing on an op's first use. A
        load that fails here fails again in the op itself, where its error is reported."""

    def begin_run(self, limit: float | None) -> None:
        """A WASM run starts; no wait for its device work may last past ``limit`` (``time.monotonic()``)."""

    def end_run(self, deadline: float | None) -> None:
        """A WASM run ended: its device work must be done (waited for until ``deadline`` plus a
        grace period at most) and its freed memory returned. Raises ``KernelTimeout`` (the cuda
        backend's ``QueueOverrun``) when the work outlives that: the worker must then exit."""

    def attach_overhead_meter(self, meter: ByteMeter) -> None:
        """Charge the device memory this backend holds outside any tenant buffer to ``meter``."""

    def inject_kernel_fault(self) -> None:
        """Make the device fault as a bad kernel would (fault injection ``cuda-fault``)."""
        from shared.errors import InvalidArgument

        raise InvalidArgument(f"fault 'cuda-fault' needs the cuda backend (this worker runs {self.name!r})")

    @abc.abstractmethod
    def alloc(self, nbytes: int) -> DeviceBuffer:
        """Allocate ``nbytes`` (>= 1). Raises :class:`DeviceOutOfMemory`."""

    @abc.abstractmethod
    def free(self, buf: DeviceBuffer) -> None:
        """Return a buffer made by :meth:`alloc` (exactly once)."""

    @abc.abstractmethod
    def write(self, buf: DeviceBuffer, offset: int, data: memoryview) -> None:
        """Copy ``data`` into ``buf`` at ``offset`` (range already checked); complete on return."""

    @abc.abstractmethod
    def read(self, buf: DeviceBuffer, offset: int, nbytes: int) -> bytes:
        """Copy ``nbytes`` from ``buf`` at ``offset`` (range already checked)."""

    @abc.abstractmethod
    def fill_f32(self, buf: DeviceBuffer, value: float, count: int) -> None:
        """Set the first ``count`` float32 elements of ``buf`` to ``value``."""

    @abc.abstractmethod
    def axpy_f32(self, n: int, a: float, x: DeviceBuffer, y: DeviceBuffer) -> None:
        """``y[:n] = a * x[:n] + y[:n]`` in float32."""

    @abc.abstractmethod
    def sum_f32(self, buf: DeviceBuffer, count: int) -> float:
        """Sum of the first ``count`` float32 elements."""

    # -- the tensor ops of the WASM ABI (worker.wasm.tensor_abi): float32, row-major, arguments in range,
    #    aliasing already refused where the ABI forbids it; each is complete on return

    def gemm_workspace_bytes(self) -> int:
        """Device workspace :meth:`matmul_f32` would like lent to it (metered by the caller); 0: none."""
        return 0

    @abc.abstractmethod
    def matmul_f32(self, a: DeviceBuffer, b: DeviceBuffer, c: DeviceBuffer, m: int, k: int, n: int, *,
                   workspace: DeviceBuffer | None = None) -> None:
        """``C[m,n] = A[m,k] @ B[k,n]`` (``c`` is neither ``a`` nor ``b``; ``k == 0`` gives zeros)."""

    @abc.abstractmethod
    def add_f32(self, x: DeviceBuffer, y: DeviceBuffer, out: DeviceBuffer, n: int) -> None:
        """``out[:n] = x[:n] + y[:n]`` (``out`` may be ``x`` or ``y``)."""

    @abc.abstractmethod
    def mul_f32(self, x: DeviceBuffer, y: DeviceBuffer, out: DeviceBuffer, n: int) -> None:
        """``out[:n] = x[:n] * y[:n]`` (``out`` may be ``x`` or ``y``)."""

    @abc.abstractmethod
    def add_rows_f32(self, m: DeviceBuffer, v: DeviceBuffer, rows: int, cols: int) -> None:
        """``m[r, :] += v[:cols]`` for each of ``rows`` rows (``v`` is not ``m``)."""

    @abc.abstractmethod
    def unary_f32(self, op: int, x: DeviceBuffer, out: DeviceBuffer, n: int) -> None:
        """``out[:n] = f(x[:n])`` with ``f`` = ``UNARY_OPS[op]`` (``out`` may be ``x``)."""

    @abc.abstractmethod
    def scale_f32(self, x: DeviceBuffer, a: float, n: int) -> None:
        """``x[:n] *= a``."""

    @abc.abstractmethod
    def softmax_rows_f32(self, x: DeviceBuffer, rows: int, cols: int) -> None:
        """Softmax of each row in place, computed as ``exp(x - max(row)) / sum``."""

    @abc.abstractmethod
    def max_f32(self, x: DeviceBuffer, count: int, out: memoryview) -> None:
        """The largest of the first ``count`` (>= 1) floats into ``out`` (4 bytes, little-endian f32; NaN wins)."""

    @abc.abstractmethod
    def argmax_rows_f32(self, x: DeviceBuffer, rows: int, cols: int, out: memoryview) -> None:
        """Per row the first column holding its largest value (a NaN counts as largest) as ``rows`` i32 into ``out``."""

    @abc.abstractmethod
    def transpose_f32(self, x: DeviceBuffer, out: DeviceBuffer, rows: int, cols: int) -> None:
        """``out[cols, rows] = x[rows, cols].T`` (``out`` is not ``x``)."""

    # -- the second round (selectors and dtypes as in worker.wasm.tensor_abi: BINARY_OPS, REDUCE_OPS,
    #    DTYPES); the GEMMs take the run's metered workspace like matmul_f32

    @abc.abstractmethod
    def gemm_f32(self, trans_a: int, trans_b: int, m: int, n: int, k: int, alpha: float, a: DeviceBuffer,
                 b: DeviceBuffer, beta: float, c: DeviceBuffer, *, workspace: DeviceBuffer | None = None) -> None:
        """``C[m,n] = alpha op(A) @ op(B) + beta C`` row-major (``beta == 0``: C is not read)."""

    @abc.abstractmethod
    def gemm_strided_batched_f32(self, trans_a: int, trans_b: int, m: int, n: int, k: int, alpha: float,
                                 a: DeviceBuffer, stride_a: int, b: DeviceBuffer, stride_b: int, beta: float,
                                 c: DeviceBuffer, stride_c: int, batch: int, *,
                                 workspace: DeviceBuffer | None = None) -> None:
        """``batch`` of :meth:`gemm_f32`, matrix ``i`` at float ``i * stride_*`` of each buffer."""

    @abc.abstractmethod
    def gemm_ex(self, trans_a: int, trans_b: int, m: int, n: int, k: int, alpha: float, a: DeviceBuffer,
                ab_dtype: int, b: DeviceBuffer, beta: float, c: DeviceBuffer, c_dtype: int, *,
                workspace: DeviceBuffer | None = None) -> None:
        """:meth:`gemm_f32` over A, B of ``ab_dtype`` and C of ``c_dtype``, accumulated in float32."""

    @abc.abstractmethod
    def binary_f32(self, op: int, x: DeviceBuffer, y: DeviceBuffer, out: DeviceBuffer, n: int) -> None:
        """``out[:n] = x[:n] <op> y[:n]`` (``out`` may be ``x`` or ``y``)."""

    @abc.abstractmethod
    def binary_rows_f32(self, op: int, m: DeviceBuffer, v: DeviceBuffer, out: DeviceBuffer, rows: int,
                        cols: int) -> None:
        """``out[r, :] = m[r, :] <op> v[:cols]`` (``out`` may be ``m``, never ``v``)."""

    @abc.abstractmethod
    def scalar_f32(self, op: int, x: DeviceBuffer, a: float, out: DeviceBuffer, n: int) -> None:
        """``out[:n] = x[:n] <op> a`` (``out`` may be ``x``)."""

    @abc.abstractmethod
    def reduce_rows_f32(self, op: int, x: DeviceBuffer, rows: int, cols: int, out: DeviceBuffer) -> None:
        """``out[r]`` = sum / max / mean of row ``r`` (``cols >= 1`` when ``rows >= 1``)."""

    @abc.abstractmethod
    def layernorm_rows_f32(self, x: DeviceBuffer, gamma: DeviceBuffer, beta: DeviceBuffer, out: DeviceBuffer,
                           rows: int, cols: int, eps: float) -> None:
        """Per row ``(x - mean) / sqrt(var + eps) * gamma + beta`` (``out`` may be ``x``)."""

    @abc.abstractmethod
    def gather_rows_f32(self, table: DeviceBuffer, idx: memoryview, n: int, cols: int, out: DeviceBuffer) -> None:
        """``out[i] = table[idx[i]]``, rows of ``cols`` floats; ``idx``: ``n`` i32, already checked."""

    @abc.abstractmethod
    def copy(self, src: DeviceBuffer, src_off: int, dst: DeviceBuffer, dst_off: int, nbytes: int) -> None:
        """Device-to-device copy of ``nbytes`` (ranges of one buffer never overlap)."""

    @abc.abstractmethod
    def causal_mask_f32(self, x: DeviceBuffer, rows: int, cols: int, offset: int) -> None:
        """``x[r, c] = -inf`` where ``c > r + offset``."""

    @abc.abstractmethod
    def cast(self, src: DeviceBuffer, src_dtype: int, dst: DeviceBuffer, dst_dtype: int, n: int) -> None:
        """``n`` elements converted between dtypes, rounding to nearest even."""

    # -- GPU-time sharing (shared.gpu_time, worker.device_time, worker.chunks)

    #: True when :meth:`transpose_block_f32` is implemented (a transpose then runs in chunks)
    transposes_in_blocks: bool = False

    def transpose_block_f32(self, x: DeviceBuffer, out: DeviceBuffer, rows: int, cols: int, r0: int, r1: int) -> None:
        """``out[:, r0:r1] = x[r0:r1, :].T`` of the whole ``rows x cols`` transpose (one chunk of it)."""
        raise NotImplementedError(f"{self.name} has no block transpose")

    def device_rates(self) -> tuple[float, float]:
        """(flop/s, byte/s) the chunk cost model starts from (worker.chunks): deliberately low, so
        a first chunk is short; measurement corrects them per op and shape."""
        return 2e10, 4e9

    def op_timer(self) -> OpTimer:
        """What measures an op's device time (charged to the tenant): wall time for host backends."""
        return HostTimer()

    #: True when ops whose results the guest does not read at once may be queued and run on a
    #: device thread of the worker (worker.device_time.DeviceQueue): the backend's calls must be
    #: safe from that thread, one at a time. The stub's device is that thread.
    queues_ops: bool = False

    def queue_timer(self) -> OpTimer:
        """What measures a queued op's device time on the device thread (see :attr:`queues_ops`)."""
        return self.op_timer()

    def view(self, buf: DeviceBuffer, offset: int, nbytes: int) -> DeviceBuffer | None:
        """A buffer aliasing ``buf[offset:offset+nbytes]`` (in range, never freed), so a long op can run
        in chunks of rows or elements; None when this backend cannot (the op then runs whole)."""
        return None

    def read_into(self, buf: DeviceBuffer, offset: int, dest: memoryview) -> None:
        """Copy ``len(dest)`` bytes from ``buf`` at ``offset`` into ``dest`` (a host buffer).

        Backends override this to copy straight into e.g. WASM linear memory.
        """
        dest[:] = self.read(buf, offset, len(dest))

    # ---- host staging (shared-memory regions, worker.regions) ----
    #
    # A region's pages can be made DMA-able once (``pin_host``); copies from or
    # to them then name their address. The defaults keep pageable copies, which
    # is all a host-memory backend needs.

    def pin_host(self, view: memoryview) -> int | None:
        """Register ``view`` (a whole mapped region) for fast device copies.

        Returns the address to hand to :meth:`write_host` / :meth:`read_host`
        (offsets added by the caller), or ``None`` when this backend copies
        pageable memory anyway. Must be undone with :meth:`unpin_host` before
        the memory is unmapped.
        """
        return None

    def unpin_host(self, addr: int) -> None:
        """Undo :meth:`pin_host` (never raises)."""

    def write_host(self, buf: DeviceBuffer, offset: int, data: memoryview, addr: int | None) -> None:
        """Copy ``data`` (at ``addr`` when pinned) into ``buf`` at ``offset``; complete on return."""
        self.write(buf, offset, data)

    def read_host(self, buf: DeviceBuffer, offset: int, dest: memoryview, addr: int | None) -> None:
        """Copy ``len(dest)`` bytes of ``buf`` at ``offset`` into ``dest`` (at ``addr`` when pinned)."""
        self.read_into(buf, offset, dest)

    def info(self) -> dict[str, object]:
        """What status shows about this backend (device, capacity, pool ...)."""
        return {"backend": self.name}

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything (buffers still allocated included). Never raises."""
