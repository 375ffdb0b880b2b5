"""The stub backend: a simulated device in host memory, with a configurable capacity.

What CI runs and the default without a usable GPU. Buffers are ``bytearray``s;
tensor ops use numpy views on them (numpy is imported on first use, so an
idle worker does not pay for it). The capacity is per worker process, like a
device's memory seen by one context; the cross-tenant device budget lives in
shared memory (see :mod:`shared.device_budget` when present).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, cast

from worker.backends.base import Backend, DeviceBuffer, DeviceOutOfMemory
from worker.backends.timing import OpTimer, ThreadTimer

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["StubBackend", "StubBuffer", "load_numpy", "one_blas_thread"]


def _np_dtype(dtype: int) -> Any:
    """numpy's type for ABI dtype 0 (float32), 1 (float16), 2 (bfloat16, from ``ml_dtypes``)."""
    import numpy as np

    if dtype == 2:
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.float16 if dtype == 1 else np.float32


class _Binary:
    """The ``binary_f32`` selectors as numpy ufuncs (0 add ... 5 min), looked up on first use."""

    def __getitem__(self, op: int) -> Any:
        import numpy as np

        return (np.add, np.subtract, np.multiply, np.divide, np.maximum, np.minimum)[op]


_BINARY = _Binary()

_MATMUL: Any = None


def _matmul() -> Any:
    """``numpy.matmul``, looked up once (numpy loads on first use: :func:`load_numpy`)."""
    global _MATMUL
    if _MATMUL is None:
        import numpy as np

        _MATMUL = np.matmul
    return _MATMUL


#: the most float32 views a buffer keeps (:meth:`StubBackend._f32`): a guest using one buffer with
#: ever new shapes makes its cache start again, not grow
_VIEWS_KEPT = 8


class StubBuffer(DeviceBuffer):
    """Host bytes (``data``: a ``bytearray``, or a ``memoryview`` window on another buffer's) and the
    float32 numpy views of them made so far (``views``, by (rows, cols); cols -1: flat): a launch
    reuses its buffers' views instead of making three arrays per GEMM (the stub's launch overhead,
    ~6-10 us of the device thread's time a GEMM here, most of it those arrays)."""

    __slots__ = ("data", "views")

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.data = bytearray(nbytes)
        self.views: dict[tuple[int, int], Any] | None = None


def load_numpy() -> None:
    """Import numpy with one BLAS thread (unless the operator set the thread counts).

    The simulated device is one serial executor (shared.gpu_time): one BLAS thread per op, like one
    kernel at a time; a multi-threaded OpenBLAS spinning on a loaded host was measured 14x slower on a
    2-core machine. The thread counts are read when numpy loads, so they are set only before it does.
    The import takes tens of ms: a worker does it before its first device op, outside the device lease
    (:meth:`StubBackend.prepare`) - a fresh worker's first op importing numpy under the lease held every
    other tenant's device work up (a healthy tenant's run waited ~1 s for the device after a
    neighbour's restart, on a loaded host) - and not in a bind (a worker that runs no device op, a
    pool worker's activation, never pays it)."""
    one_blas_thread()
    import numpy  # noqa: F401


def one_blas_thread() -> None:
    """Set numpy's BLAS to one thread where numpy has not loaded yet and the operator set nothing
    (see :func:`load_numpy`)."""
    if "numpy" not in sys.modules:
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")


class StubBackend(Backend):
    """Host-memory simulation of one device context with ``capacity_bytes`` of memory."""

    name = "stub"
    #: the simulated device is the worker's device thread: ops the guest does not read at once
    #: are queued there (worker.device_time), and the guest's host code overlaps them
    queues_ops = True
    #: the device is this host's CPU: with the GPU-time scheduler off the gate still runs one op
    #: at a time per device (an flock, worker.device_time), as a GPU time-slices its contexts
    serial_device = True

    def __init__(self, capacity_bytes: int = 16 << 30, device_index: int = 0) -> None:
        one_blas_thread()  # whatever imports numpy first in this worker
        self.capacity_bytes = capacity_bytes
        self.device_index = device_index
        self.in_use = 0
        self._live: set[int] = set()

    def prepare(self, op: str) -> None:
        """numpy, before the device gate takes the lease for the first op (:func:`load_numpy`)."""
        load_numpy()

    def alloc(self, nbytes: int) -> StubBuffer:
        if self.in_use + nbytes > self.capacity_bytes:
            raise DeviceOutOfMemory(nbytes, self.capacity_bytes, self.in_use, "stub device out of memory")
        try:
            buf = StubBuffer(nbytes)
        except MemoryError:
            raise DeviceOutOfMemory(nbytes, self.capacity_bytes, self.in_use, "host memory exhausted") from None
        self.in_use += nbytes
        self._live.add(id(buf))
        return buf

    def free(self, buf: DeviceBuffer) -> None:
        assert isinstance(buf, StubBuffer)
        if id(buf) in self._live:
            self._live.discard(id(buf))
            self.in_use -= buf.nbytes
            buf.data = bytearray()
            buf.views = None  # (they name the freed bytes)

    def write(self, buf: DeviceBuffer, offset: int, data: memoryview) -> None:
        assert isinstance(buf, StubBuffer)
        # through a memoryview: ``bytearray[a:b] = view`` copies the view into a temporary
        # bytearray first (CPython), one whole extra copy per write
        memoryview(buf.data)[offset : offset + len(data)] = data

    @property
    def device_executor(self) -> bool:
        """Whether queued GEMM chunks go to the executor (``worker.backends.stub_executor``: a thread
        outside Python, the device's) rather than run on the Python device thread."""
        from worker.backends import stub_executor

        return stub_executor.available()

    def queue_timer(self) -> OpTimer:
        """The executor's timer (launched GEMM chunks pending until settled, other ops timed on the
        calling thread), or - the executor unavailable - the device thread's own CPU time per queued
        op (:class:`ThreadTimer`)."""
        from worker.backends import stub_executor

        load_numpy()  # (the BLAS the executor calls is numpy's, with its thread count set first)
        timer = stub_executor.make()
        return timer if timer is not None else ThreadTimer()

    def view(self, buf: DeviceBuffer, offset: int, nbytes: int) -> StubBuffer:
        assert isinstance(buf, StubBuffer)
        part = StubBuffer.__new__(StubBuffer)  # no bytearray of its own: a window on buf's
        part.nbytes = nbytes
        part.data = memoryview(buf.data)[offset : offset + nbytes]  # type: ignore[assignment]
        part.views = None
        return part

    def read(self, buf: DeviceBuffer, offset: int, nbytes: int) -> bytes:
        assert isinstance(buf, StubBuffer)
        return bytes(buf.data[offset : offset + nbytes])

    def read_into(self, buf: DeviceBuffer, offset: int, dest: memoryview) -> None:
        assert isinstance(buf, StubBuffer)
        dest[:] = memoryview(buf.data)[offset : offset + len(dest)]

    @staticmethod
    def _f32(buf: DeviceBuffer, count: int) -> npt.NDArray[np.float32]:
        """The first ``count`` float32 of ``buf`` (a view, made once per buffer and count)."""
        assert isinstance(buf, StubBuffer)
        views = buf.views
        if views is not None:
            got = views.get((count, -1))
            if got is not None:
                return cast("npt.NDArray[np.float32]", got)
        return cast("npt.NDArray[np.float32]", StubBackend._keep(buf, (count, -1), count))

    @staticmethod
    def _keep(buf: StubBuffer, key: tuple[int, int], count: int) -> Any:
        """A new float32 view of ``buf`` for ``key`` ((rows, cols), cols -1: flat), kept on the buffer."""
        import numpy as np

        view = np.frombuffer(buf.data, dtype=np.float32, count=count)
        if key[1] >= 0:
            view = view.reshape(key)
        views = buf.views
        if views is None or len(views) >= _VIEWS_KEPT:
            views = buf.views = {}
        views[key] = view
        return view

    def fill_f32(self, buf: DeviceBuffer, value: float, count: int) -> None:
        self._f32(buf, count).fill(value)

    def axpy_f32(self, n: int, a: float, x: DeviceBuffer, y: DeviceBuffer) -> None:
        import numpy as np

        xv = self._f32(x, n)
        yv = self._f32(y, n)
        if x is y:
            np.multiply(yv, np.float32(a + 1.0), out=yv)
            return
        # y += a*x without a temporary of n floats: in chunks that stay in cache
        step = 1 << 16
        scratch = np.empty(min(n, step), dtype=np.float32)
        a32 = np.float32(a)
        for start in range(0, n, step):
            stop = min(n, start + step)
            t = scratch[: stop - start]
            np.multiply(xv[start:stop], a32, out=t)
            np.add(yv[start:stop], t, out=yv[start:stop])

    def sum_f32(self, buf: DeviceBuffer, count: int) -> float:
        import numpy as np

        return float(np.add.reduce(self._f32(buf, count), dtype=np.float32))

    # -- the tensor ops of the WASM ABI: numpy on views of the buffers, results written in place
    #    (``out=``), temporaries only where an op needs them (a row's max and sum in softmax)

    @staticmethod
    def _mat(buf: DeviceBuffer, rows: int, cols: int) -> npt.NDArray[np.float32]:
        """``buf``'s first ``rows * cols`` float32 as a (rows, cols) matrix (kept as :meth:`_f32`'s)."""
        assert isinstance(buf, StubBuffer)
        views = buf.views
        if views is not None:
            got = views.get((rows, cols))
            if got is not None:
                return cast("npt.NDArray[np.float32]", got)
        return cast("npt.NDArray[np.float32]", StubBackend._keep(buf, (rows, cols), rows * cols))

    def matmul_f32(self, a: DeviceBuffer, b: DeviceBuffer, c: DeviceBuffer, m: int, k: int, n: int, *,
                   workspace: DeviceBuffer | None = None) -> None:
        # numpy's BLAS sgemm writes straight into C (contiguous, float32, no overlap with A or B)
        mat = self._mat
        _matmul()(mat(a, m, k), mat(b, k, n), out=mat(c, m, n))

    def add_f32(self, x: DeviceBuffer, y: DeviceBuffer, out: DeviceBuffer, n: int) -> None:
        import numpy as np

        with np.errstate(all="ignore"):
            np.add(self._f32(x, n), self._f32(y, n), out=self._f32(out, n))

    def mul_f32(self, x: DeviceBuffer, y: DeviceBuffer, out: DeviceBuffer, n: int) -> None:
        import numpy as np

        with np.errstate(all="ignore"):
            np.multiply(self._f32(x, n), self._f32(y, n), out=self._f32(out, n))

    def add_rows_f32(self, m: DeviceBuffer, v: DeviceBuffer, rows: int, cols: int) -> None:
        import numpy as np

        mat = self._mat(m, rows, cols)
        with np.errstate(all="ignore"):
            np.add(mat, self._f32(v, cols), out=mat)

    def unary_f32(self, op: int, x: DeviceBuffer, out: DeviceBuffer, n: int) -> None:
        import numpy as np

        src, dst = self._f32(x, n), self._f32(out, n)
        with np.errstate(all="ignore"):
            if op == 0:
                np.maximum(src, np.float32(0), out=dst)
            elif op == 1:
                np.exp(src, out=dst)
            elif op == 2:
                np.tanh(src, out=dst)
            elif op == 3:  # 1 / (1 + exp(-x)), in place in dst
                np.negative(src, out=dst)
                np.exp(dst, out=dst)
                np.add(dst, np.float32(1), out=dst)
                np.reciprocal(dst, out=dst)
            elif op == 4:
                np.negative(src, out=dst)
            elif op == 5:
                np.sqrt(src, out=dst)
            elif op == 6:
                np.abs(src, out=dst)
            elif op == 7:
                np.log(src, out=dst)
            elif op == 8:  # GELU, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
                t = src * src
                np.multiply(t, src, out=t)
                np.multiply(t, np.float32(0.044715), out=t)
                np.add(t, src, out=t)
                np.multiply(t, np.float32(0.7978845608028654), out=t)
                np.tanh(t, out=t)
                np.add(t, np.float32(1), out=t)
                np.multiply(t, src, out=t)
                np.multiply(t, np.float32(0.5), out=dst)
            elif op == 9:  # SiLU: x / (1 + exp(-x))
                t = np.negative(src)
                np.exp(t, out=t)
                np.add(t, np.float32(1), out=t)
                np.divide(src, t, out=dst)
            elif op == 10:
                np.sqrt(src, out=dst)
                np.reciprocal(dst, out=dst)
            elif op == 11:
                np.reciprocal(src, out=dst)
            else:  # the ABI checked op already
                raise ValueError(f"unknown unary op {op}")

    def scale_f32(self, x: DeviceBuffer, a: float, n: int) -> None:
        import numpy as np

        v = self._f32(x, n)
        with np.errstate(all="ignore"):
            np.multiply(v, np.float32(a), out=v)

    def softmax_rows_f32(self, x: DeviceBuffer, rows: int, cols: int) -> None:
        import numpy as np

        if rows == 0 or cols == 0:
            return
        mat = self._mat(x, rows, cols)
        # a block of rows at a time: the per-row max and sum are the only temporaries
        step = max(1, (1 << 16) // cols)
        with np.errstate(all="ignore"):
            for r in range(0, rows, step):
                block = mat[r : r + step]
                np.subtract(block, block.max(axis=1, keepdims=True), out=block)
                np.exp(block, out=block)
                np.divide(block, block.sum(axis=1, keepdims=True, dtype=np.float32), out=block)

    def max_f32(self, x: DeviceBuffer, count: int, out: memoryview) -> None:
        import numpy as np

        np.frombuffer(out, dtype="<f4", count=1)[0] = self._f32(x, count).max()

    def argmax_rows_f32(self, x: DeviceBuffer, rows: int, cols: int, out: memoryview) -> None:
        import numpy as np

        if rows == 0:
            return
        if cols > (1 << 31) - 1:
            from shared.errors import InvalidArgument

            raise InvalidArgument(f"argmax_rows_f32 answers int32 column indices: {cols:,} columns is more than "
                                  f"{(1 << 31) - 1:,}; split the rows")
        # numpy's argmax: the first maximum, and the first NaN when there is one
        np.frombuffer(out, dtype="<i4", count=rows)[:] = self._mat(x, rows, cols).argmax(axis=1)

    def transpose_f32(self, x: DeviceBuffer, out: DeviceBuffer, rows: int, cols: int) -> None:
        import numpy as np

        np.copyto(self._mat(out, cols, rows), self._mat(x, rows, cols).T)

    # -- the second round of ops: BLAS-style GEMMs, elementwise with a selector, row reductions and
    #    norms, gather, copy, mask, dtypes. Each is numpy's own algorithm on views (the tests' reference)

    @staticmethod
    def _typed(buf: DeviceBuffer, dtype: int, count: int, offset: int = 0) -> npt.NDArray[Any]:
        """``count`` elements of ABI dtype ``dtype`` (0 f32, 1 f16, 2 bf16) from element ``offset``."""
        import numpy as np

        assert isinstance(buf, StubBuffer)
        dt = _np_dtype(dtype)
        return np.frombuffer(buf.data, dtype=dt, count=count, offset=offset * np.dtype(dt).itemsize)

    @staticmethod
    def _gemm_into(trans_a: int, trans_b: int, m: int, n: int, k: int, alpha: float, a: npt.NDArray[np.float32],
                   b: npt.NDArray[np.float32], beta: float, c: npt.NDArray[np.float32]) -> None:
        """``c = alpha op(a) @ op(b) + beta c`` over flat float32 arrays; ``beta == 0`` does not read c."""
        import numpy as np

        if m == 0 or n == 0:
            return
        am = a.reshape(k, m).T if trans_a else a.reshape(m, k)
        bm = b.reshape(n, k).T if trans_b else b.reshape(k, n)
        cm = c.reshape(m, n)
        with np.errstate(all="ignore"):
            if alpha == 1.0 and beta == 0.0:
                np.matmul(am, bm, out=cm)
                return
            t = np.matmul(am, bm)
            np.multiply(t, np.float32(alpha), out=t)
            if beta == 0.0:
                np.copyto(cm, t)
            else:
                np.multiply(cm, np.float32(beta), out=cm)
                np.add(cm, t, out=cm)

    def gemm_f32(self, trans_a: int, trans_b: int, m: int, n: int, k: int, alpha: float, a: DeviceBuffer,
                 b: DeviceBuffer, beta: float, c: DeviceBuffer, *, workspace: DeviceBuffer | None = None) -> None:
        self._gemm_into(trans_a, trans_b, m, n, k, alpha, self._f32(a, m * k), self._f32(b, k * n), beta,
                        self._f32(c, m * n))

    def gemm_strided_batched_f32(self, trans_a: int, trans_b: int, m: int, n: int, k: int, alpha: float,
                                 a: DeviceBuffer, stride_a: int, b: DeviceBuffer, stride_b: int, beta: float,
                                 c: DeviceBuffer, stride_c: int, batch: int, *,
                                 workspace: DeviceBuffer | None = None) -> None:
        if m == 0 or n == 0:  # nothing to write (and batch is then bounded by no buffer: never loop on it)
            return
        for i in range(batch):
            self._gemm_into(trans_a, trans_b, m, n, k, alpha, self._typed(a, 0, m * k, i * stride_a),
                            self._typed(b, 0, k * n, i * stride_b), beta, self._typed(c, 0, m * n, i * stride_c))

    def gemm_ex(self, trans_a: int, trans_b: int, m: int, n: int, k: int, alpha: float, a: DeviceBuffer,
                ab_dtype: int, b: DeviceBuffer, beta: float, c: DeviceBuffer, c_dtype: int, *,
                workspace: DeviceBuffer | None = None) -> None:
        import numpy as np

        af = self._typed(a, ab_dtype, m * k).astype(np.float32)  # exact: f16 and bf16 are subsets of f32
        bf = self._typed(b, ab_dtype, k * n).astype(np.float32)
        cv = self._typed(c, c_dtype, m * n)
        if c_dtype == 0:
            self._gemm_into(trans_a, trans_b, m, n, k, alpha, af, bf, beta, cv)
            return
        cf = cv.astype(np.float32) if beta != 0.0 else np.empty(m * n, np.float32)
        self._gemm_into(trans_a, trans_b, m, n, k, alpha, af, bf, beta, cf)
        cv[:] = cf.astype(cv.dtype)  # one rounding, to nearest even

    def binary_f32(self, op: int, x: DeviceBuffer, y: DeviceBuffer, out: DeviceBuffer, n: int) -> None:
        import numpy as np

        with np.errstate(all="ignore"):
            _BINARY[op](self._f32(x, n), self._f32(y, n), out=self._f32(out, n))

    def binary_rows_f32(self, op: int, m: DeviceBuffer, v: DeviceBuffer, out: DeviceBuffer, rows: int,
                        cols: int) -> None:
        import numpy as np

        with np.errstate(all="ignore"):
            _BINARY[op](self._mat(m, rows, cols), self._f32(v, cols), out=self._mat(out, rows, cols))

    def scalar_f32(self, op: int, x: DeviceBuffer, a: float, out: DeviceBuffer, n: int) -> None:
        import numpy as np

        with np.errstate(all="ignore"):
            _BINARY[op](self._f32(x, n), np.float32(a), out=self._f32(out, n))

    def reduce_rows_f32(self, op: int, x: DeviceBuffer, rows: int, cols: int, out: DeviceBuffer) -> None:
        import numpy as np

        if rows == 0:
            return
        mat, dst = self._mat(x, rows, cols), self._f32(out, rows)
        with np.errstate(all="ignore"):
            if op == 1:
                np.maximum.reduce(mat, axis=1, out=dst)
            else:
                np.add.reduce(mat, axis=1, dtype=np.float32, out=dst)
                if op == 2:
                    np.divide(dst, np.float32(cols), out=dst)

    def layernorm_rows_f32(self, x: DeviceBuffer, gamma: DeviceBuffer, beta: DeviceBuffer, out: DeviceBuffer,
                           rows: int, cols: int, eps: float) -> None:
        import numpy as np

        if rows == 0:
            return
        src, dst = self._mat(x, rows, cols), self._mat(out, rows, cols)
        g, bt = self._f32(gamma, cols), self._f32(beta, cols)
        step = max(1, (1 << 16) // cols)
        n = np.float32(cols)
        with np.errstate(all="ignore"):
            for r in range(0, rows, step):
                blk = src[r : r + step]
                mean = np.add.reduce(blk, axis=1, dtype=np.float32, keepdims=True) / n
                d = blk - mean
                var = np.add.reduce(d * d, axis=1, dtype=np.float32, keepdims=True) / n
                np.divide(d, np.sqrt(var + np.float32(eps)), out=d)
                np.multiply(d, g, out=d)
                np.add(d, bt, out=dst[r : r + step])

    def gather_rows_f32(self, table: DeviceBuffer, idx: memoryview, n: int, cols: int, out: DeviceBuffer) -> None:
        import numpy as np

        if n == 0 or cols == 0:
            return
        rows = table.nbytes // (4 * cols)
        np.take(self._mat(table, rows, cols), np.frombuffer(idx, dtype="<i4", count=n), axis=0,
                out=self._mat(out, n, cols))

    def copy(self, src: DeviceBuffer, src_off: int, dst: DeviceBuffer, dst_off: int, nbytes: int) -> None:
        assert isinstance(src, StubBuffer) and isinstance(dst, StubBuffer)
        memoryview(dst.data)[dst_off : dst_off + nbytes] = memoryview(src.data)[src_off : src_off + nbytes]

    def causal_mask_f32(self, x: DeviceBuffer, rows: int, cols: int, offset: int) -> None:
        import numpy as np

        mat = self._mat(x, rows, cols)
        for r in range(min(rows, max(0, cols - offset - 1))):  # rows past that have nothing to mask
            mat[r, r + offset + 1 :] = -np.inf

    def cast(self, src: DeviceBuffer, src_dtype: int, dst: DeviceBuffer, dst_dtype: int, n: int) -> None:
        import numpy as np

        s, d = self._typed(src, src_dtype, n), self._typed(dst, dst_dtype, n)
        with np.errstate(all="ignore"):
            if src_dtype and dst_dtype:  # f16 <-> bf16: through f32 (exact), then one rounding
                d[:] = s.astype(np.float32).astype(d.dtype)
            else:
                d[:] = s.astype(d.dtype)
    transposes_in_blocks = True

    def transpose_block_f32(self, x: DeviceBuffer, out: DeviceBuffer, rows: int, cols: int, r0: int, r1: int) -> None:
        import numpy as np

        np.copyto(self._mat(out, cols, rows)[:, r0:r1], self._mat(x, rows, cols)[r0:r1].T)

    def info(self) -> dict[str, object]:
        return {
            "backend": self.name,
            "device": self.device_index,
            "device_name": "stub (host memory)",
            "capacity_bytes": self.capacity_bytes,
            "in_use_bytes": self.in_use,
        }

    def close(self) -> None:
        self._live.clear()
        self.in_use = 0
