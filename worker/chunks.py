"""Long tensor ops in chunks, so that no single launch holds the device for more than ~2 ms.

A GPU without MPS cannot preempt a kernel of another context; our lease
(:mod:`shared.gpu_time`) passes only between launches. So every op that can
be cut is cut into pieces of the *same algorithm* on contiguous parts of its
buffers (views, never copies), each one launch:

    matmul_f32        C[r0:r1] = A[r0:r1] @ B            by row blocks (a GEMM per block)
    add/mul_f32,      out[i0:i1] = f(x[i0:i1], ...)      by element ranges
    unary, scale,
    fill, axpy
    add_rows_f32      m[r0:r1] += v                      by rows
    softmax_rows_f32  each row is independent            by rows
    argmax_rows_f32   each row is independent            by rows (out sliced alike)
    transpose, max,   not split: transpose's output blocks are not contiguous, and splitting a
    sum               reduction would change its summation order (results must not change)
    gemm_f32, gemm_ex C[r0:r1] by row blocks as matmul_f32 (with trans_a = 1, A's rows are not
                      contiguous: whole)
    gemm_strided_     by batches [b0:b1)
      batched_f32
    binary, scalar,   by element ranges (cast: byte views sized by each side's dtype)
    copy, cast
    binary_rows,      by rows (reduce_rows' out, gather's indices and out sliced alike; the causal
    reduce_rows,      mask's offset moves with the first row)
    layernorm_rows,
    gather_rows,
    causal_mask

Every element of a chunked result is computed by exactly the operations the
whole op would use on it (a row of a GEMM is the same dot products; the BLAS
may pick another kernel for a smaller block, so GEMM results agree up to
float32 rounding of the same sums - tests compare with a tolerance; the
elementwise ops and softmax are bit-identical).

A plan is ``(units, cost per unit, chunk(lo, hi) -> args)``; the gate
(:mod:`worker.device_time`) learns ns per cost unit from the chunks it ran
and sizes the next chunk to the 2 ms target.
"""

from __future__ import annotations

from collections.abc import Callable

from worker.backends.base import Backend, DeviceBuffer

__all__ = ["Plan", "plan"]

#: (units, cost of one unit, args of the chunk [lo, hi))
Plan = tuple[int, int, Callable[[int, int], tuple[object, ...]]]

_F = 4  # bytes per float32


def _v(backend: Backend, buf: DeviceBuffer, lo: int, hi: int) -> DeviceBuffer:
    view = backend.view(buf, lo * _F, (hi - lo) * _F)
    assert view is not None  # checked by plan(): the backend makes views
    return view


def _gemm(be: Backend, a: DeviceBuffer, b: DeviceBuffer, c: DeviceBuffer, m: int, k: int, n: int) -> Plan | None:
    if k == 0 or n == 0:
        return None
    return m, k * n, lambda lo, hi: (_v(be, a, lo * k, hi * k), b, _v(be, c, lo * n, hi * n), hi - lo, k, n)


def _binary(be: Backend, x: DeviceBuffer, y: DeviceBuffer, out: DeviceBuffer, n: int) -> Plan:
    return n, 1, lambda lo, hi: (_v(be, x, lo, hi), _v(be, y, lo, hi), _v(be, out, lo, hi), hi - lo)


def _unary(be: Backend, op: int, x: DeviceBuffer, out: DeviceBuffer, n: int) -> Plan:
    return n, 1, lambda lo, hi: (op, _v(be, x, lo, hi), _v(be, out, lo, hi), hi - lo)


def _scale(be: Backend, x: DeviceBuffer, a: float, n: int) -> Plan:
    return n, 1, lambda lo, hi: (_v(be, x, lo, hi), a, hi - lo)


def _fill(be: Backend, buf: DeviceBuffer, value: float, count: int) -> Plan:
    return count, 1, lambda lo, hi: (_v(be, buf, lo, hi), value, hi - lo)


def _axpy(be: Backend, n: int, a: float, x: DeviceBuffer, y: DeviceBuffer) -> Plan:
    return n, 2, lambda lo, hi: (hi - lo, a, _v(be, x, lo, hi), _v(be, y, lo, hi))


def _add_rows(be: Backend, m: DeviceBuffer, v: DeviceBuffer, rows: int, cols: int) -> Plan | None:
    if cols == 0:
        return None
    return rows, cols, lambda lo, hi: (_v(be, m, lo * cols, hi * cols), v, hi - lo, cols)


def _softmax(be: Backend, x: DeviceBuffer, rows: int, cols: int) -> Plan | None:
    if cols == 0:
        return None
    return rows, 3 * cols, lambda lo, hi: (_v(be, x, lo * cols, hi * cols), hi - lo, cols)


def _argmax(be: Backend, x: DeviceBuffer, rows: int, cols: int, out: memoryview) -> Plan | None:
    if cols == 0:
        return None
    return rows, cols, lambda lo, hi: (_v(be, x, lo * cols, hi * cols), hi - lo, cols, out[lo * 4 : hi * 4])


def _bv(backend: Backend, buf: DeviceBuffer, lo: int, hi: int) -> DeviceBuffer:
    """A view of bytes [lo, hi) (the ops that count bytes or mix dtypes)."""
    view = backend.view(buf, lo, hi - lo)
    assert view is not None  # checked by plan(): the backend makes views
    return view


_DT = (4, 2, 2)  # bytes per element of the ABI dtypes (f32, f16, bf16)


def _gemm2(be: Backend, ta: int, tb: int, m: int, n: int, k: int, alpha: float, a: DeviceBuffer, b: DeviceBuffer,
           beta: float, c: DeviceBuffer) -> Plan | None:
    if ta or n == 0:  # rows of a transposed A are not contiguous: it runs whole
        return None
    return m, max(k, 1) * n, lambda lo, hi: (ta, tb, hi - lo, n, k, alpha, _v(be, a, lo * k, hi * k), b, beta,
                                              _v(be, c, lo * n, hi * n))


def _gemm_ex(be: Backend, ta: int, tb: int, m: int, n: int, k: int, alpha: float, a: DeviceBuffer, ab: int,
             b: DeviceBuffer, beta: float, c: DeviceBuffer, cd: int) -> Plan | None:
    if ta or n == 0:
        return None
    sa, sc = _DT[ab], _DT[cd]
    return m, max(k, 1) * n, lambda lo, hi: (ta, tb, hi - lo, n, k, alpha, _bv(be, a, lo * k * sa, hi * k * sa), ab,
                                              b, beta, _bv(be, c, lo * n * sc, hi * n * sc), cd)


def _batched(be: Backend, ta: int, tb: int, m: int, n: int, k: int, alpha: float, a: DeviceBuffer, sa: int,
             b: DeviceBuffer, sb: int, beta: float, c: DeviceBuffer, sc: int, batch: int) -> Plan | None:
    if m == 0 or n == 0:
        return None

    def span(buf: DeviceBuffer, stride: int, size: int, lo: int, hi: int) -> DeviceBuffer:
        return _v(be, buf, lo * stride, lo * stride + (hi - lo - 1) * stride + size) if size else buf

    return batch, m * n * max(k, 1), lambda lo, hi: (
        ta, tb, m, n, k, alpha, span(a, sa, m * k, lo, hi), sa, span(b, sb, k * n, lo, hi), sb, beta,
        span(c, sc, m * n, lo, hi), sc, hi - lo)


def _binary_op(be: Backend, op: int, x: DeviceBuffer, y: DeviceBuffer, out: DeviceBuffer, n: int) -> Plan:
    return n, 1, lambda lo, hi: (op, _v(be, x, lo, hi), _v(be, y, lo, hi), _v(be, out, lo, hi), hi - lo)


def _binary_rows(be: Backend, op: int, m: DeviceBuffer, v: DeviceBuffer, out: DeviceBuffer, rows: int,
                 cols: int) -> Plan | None:
    if cols == 0:
        return None
    return rows, cols, lambda lo, hi: (op, _v(be, m, lo * cols, hi * cols), v, _v(be, out, lo * cols, hi * cols),
                                       hi - lo, cols)


def _scalar(be: Backend, op: int, x: DeviceBuffer, a: float, out: DeviceBuffer, n: int) -> Plan:
    return n, 1, lambda lo, hi: (op, _v(be, x, lo, hi), a, _v(be, out, lo, hi), hi - lo)


def _reduce_rows(be: Backend, op: int, x: DeviceBuffer, rows: int, cols: int, out: DeviceBuffer) -> Plan | None:
    if cols == 0:
        return None
    return rows, cols, lambda lo, hi: (op, _v(be, x, lo * cols, hi * cols), hi - lo, cols, _v(be, out, lo, hi))


def _layernorm(be: Backend, x: DeviceBuffer, g: DeviceBuffer, b: DeviceBuffer, out: DeviceBuffer, rows: int,
               cols: int, eps: float) -> Plan | None:
    if cols == 0:
        return None
    return rows, 4 * cols, lambda lo, hi: (_v(be, x, lo * cols, hi * cols), g, b, _v(be, out, lo * cols, hi * cols),
                                           hi - lo, cols, eps)


def _gather(be: Backend, table: DeviceBuffer, idx: memoryview, n: int, cols: int, out: DeviceBuffer) -> Plan | None:
    if cols == 0:
        return None
    return n, cols, lambda lo, hi: (table, idx[lo * 4 : hi * 4], hi - lo, cols, _v(be, out, lo * cols, hi * cols))


def _copy(be: Backend, src: DeviceBuffer, so: int, dst: DeviceBuffer, do: int, nbytes: int) -> Plan:
    return nbytes, 1, lambda lo, hi: (_bv(be, src, so + lo, so + hi), 0, _bv(be, dst, do + lo, do + hi), 0, hi - lo)


def _mask(be: Backend, x: DeviceBuffer, rows: int, cols: int, offset: int) -> Plan | None:
    if cols == 0:
        return None
    return rows, cols, lambda lo, hi: (_v(be, x, lo * cols, hi * cols), hi - lo, cols, offset + lo)


def _cast(be: Backend, src: DeviceBuffer, sd: int, dst: DeviceBuffer, dd: int, n: int) -> Plan:
    ss, ds = _DT[sd], _DT[dd]
    return n, 1, lambda lo, hi: (_bv(be, src, lo * ss, hi * ss), sd, _bv(be, dst, lo * ds, hi * ds), dd, hi - lo)


_PLANNERS: dict[str, Callable[..., Plan | None]] = {
    "gemm_f32": _gemm2,
    "gemm_ex": _gemm_ex,
    "gemm_strided_batched_f32": _batched,
    "binary_f32": _binary_op,
    "binary_rows_f32": _binary_rows,
    "scalar_f32": _scalar,
    "reduce_rows_f32": _reduce_rows,
    "layernorm_rows_f32": _layernorm,
    "gather_rows_f32": _gather,
    "copy": _copy,
    "causal_mask_f32": _mask,
    "cast": _cast,
    "matmul_f32": _gemm,
    "add_f32": _binary,
    "mul_f32": _binary,
    "unary_f32": _unary,
    "scale_f32": _scale,
    "fill_f32": _fill,
    "axpy_f32": _axpy,
    "add_rows_f32": _add_rows,
    "softmax_rows_f32": _softmax,
    "argmax_rows_f32": _argmax,
}


def plan(name: str, backend: Backend, args: tuple[object, ...]) -> Plan | None:
    """How op ``name`` with ``args`` (checked, in range) splits; None: it runs whole."""
    planner = _PLANNERS.get(name)
    if planner is None or not args:
        return None
    probe = next((a for a in args if isinstance(a, DeviceBuffer)), None)
    if probe is None or backend.view(probe, 0, 0) is None:
        return None
    return planner(backend, *args)
