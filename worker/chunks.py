"""Every tensor op in chunks, sized by a cost model, so that no single launch holds the device for
more than ~2 ms.

A GPU without MPS cannot preempt a kernel of another context; our lease
(:mod:`shared.gpu_time`) passes only between launches. So every op is cut
into pieces of the *same algorithm* on contiguous parts of its buffers
(views, never copies), each one launch:

    matmul_f32        C[r0:r1] = A[r0:r1] @ B            by row blocks (a GEMM per block)
    add/mul_f32,      out[i0:i1] = f(x[i0:i1], ...)      by element ranges
    unary, scale,
    fill, axpy
    add_rows_f32      m[r0:r1] += v                      by rows
    softmax_rows_f32  each row is independent            by rows
    argmax_rows_f32   each row is independent            by rows (out sliced alike)
    transpose_f32     out[:, r0:r1] = x[r0:r1].T         by input rows (stub and cuda: a block transpose)
    max_f32           max of the chunks' maxima          by element ranges (exact: NaN still wins)
    sum_f32           sum of the chunks' sums            by element ranges (rounding: see below)
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
elementwise ops, softmax, argmax, max and transpose are bit-identical). A
chunked ``sum_f32`` adds float32 partial sums exactly (``math.fsum``) and
rounds once: within float32 rounding of the whole-op sum, not bit-equal to it.

**Cost model.** A plan declares, per unit (a row, an element), the work it
does: floating-point operations and bytes moved, plus bytes every chunk moves
whatever its size (a GEMM reads all of B per row block). :class:`CostModel`
turns that into device ns with the backend's rates (roofline: the larger of
flops / flop rate and bytes / bandwidth), corrected by a factor measured per
op *and shape* (the dims the per-unit cost depends on: a skinny GEMM is
memory-bound where a square one is not). The first chunk of a shape not seen
yet uses the largest factor measured for that op, and at least 1: the
backend's rates are deliberately below the device's, so it is short rather
than long.

**Adding an op** (``register``): a planner ``(backend, *args) -> Plan | None``
that says how its args split; nothing else in the gate changes.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from worker.backends.base import Backend, DeviceBuffer

__all__ = ["CostModel", "Plan", "plan", "register"]

_F = 4  # bytes per float32
#: the largest number of (op, shape) corrections a worker keeps (shapes are guest-chosen: bounded)
MAX_SHAPES = 1024


@dataclass(frozen=True)
class Plan:
    """How one op call splits: ``units`` independent pieces, each costing ``flops`` and ``bytes``."""

    units: int
    flops: float
    bytes: float
    #: the arguments of the launch that does units [lo, hi)
    chunk: Callable[[int, int], tuple[object, ...]]
    #: the dims the per-unit cost depends on (the measured correction is kept per op and shape)
    shape: tuple[int, ...] = ()
    #: bytes every chunk moves whatever its size (GEMM: all of B)
    fixed_bytes: float = 0.0
    #: the op's result from its chunks' results, in order (reductions); None: no result
    combine: Callable[[Sequence[Any]], Any] | None = None
    #: what each chunk calls instead of the op's own function (a block variant of the op)
    call: Callable[..., Any] | None = None


class CostModel:
    """Chunk sizes from declared work and measured device time (see the module docstring)."""

    def __init__(self, flops_per_s: float, bytes_per_s: float) -> None:
        self.flops_per_ns = flops_per_s / 1e9
        self.bytes_per_ns = bytes_per_s / 1e9
        #: (op, shape) -> measured / modelled ns, most recently used last
        self._factor: OrderedDict[tuple[str, tuple[int, ...]], float] = OrderedDict()
        #: op -> the largest factor measured for any of its shapes (a new shape's first guess)
        self._worst: dict[str, float] = {}

    def _model(self, p: Plan, units: int) -> float:
        per = max(p.flops / self.flops_per_ns, p.bytes / self.bytes_per_ns)
        return max(1.0, units * per + p.fixed_bytes / self.bytes_per_ns)

    def factor(self, name: str, p: Plan) -> float:
        """The correction used for the next chunk of ``name`` at this shape."""
        got = self._factor.get((name, p.shape))
        # a new shape: never faster than the (low) rates, nor than the op's slowest shape so far
        return got if got is not None else max(1.0, self._worst.get(name, 1.0))

    def predict_ns(self, name: str, p: Plan, units: int) -> float:
        return self.factor(name, p) * self._model(p, units)

    def units_for(self, name: str, p: Plan, target_ns: int, left: int) -> int:
        """How many units the next chunk takes to last about ``target_ns`` (at least 1)."""
        f = self.factor(name, p)
        per = f * max(p.flops / self.flops_per_ns, p.bytes / self.bytes_per_ns)
        room = target_ns - f * p.fixed_bytes / self.bytes_per_ns
        if per <= 0:
            return left
        return max(1, min(left, int(room / per) if room > 0 else 1))

    def observe(self, name: str, p: Plan, units: int, ns: int) -> None:
        """A chunk of ``units`` took ``ns``: move the (op, shape) correction toward it."""
        if ns <= 0:
            return
        measured = ns / self._model(p, units)
        key = (name, p.shape)
        old = self._factor.pop(key, None)
        value = measured if old is None else 0.5 * old + 0.5 * measured
        self._factor[key] = value
        if len(self._factor) > MAX_SHAPES:
            self._factor.popitem(last=False)
        self._worst[name] = max(self._worst.get(name, 0.0), value)


def _v(backend: Backend, buf: DeviceBuffer, lo: int, hi: int) -> DeviceBuffer:
    view = backend.view(buf, lo * _F, (hi - lo) * _F)
    assert view is not None  # checked by plan(): the backend makes views
    return view


def _gemm(be: Backend, a: DeviceBuffer, b: DeviceBuffer, c: DeviceBuffer, m: int, k: int, n: int) -> Plan | None:
    if k == 0 or n == 0:
        return None
    return Plan(m, 2.0 * k * n, _F * (k + n), lambda lo, hi: (_v(be, a, lo * k, hi * k), b,
                                                               _v(be, c, lo * n, hi * n), hi - lo, k, n),
                shape=(k, n), fixed_bytes=_F * k * n)


def _binary(be: Backend, x: DeviceBuffer, y: DeviceBuffer, out: DeviceBuffer, n: int) -> Plan:
    return Plan(n, 1, 3 * _F, lambda lo, hi: (_v(be, x, lo, hi), _v(be, y, lo, hi), _v(be, out, lo, hi), hi - lo))


def _unary(be: Backend, op: int, x: DeviceBuffer, out: DeviceBuffer, n: int) -> Plan:
    return Plan(n, 8, 2 * _F, lambda lo, hi: (op, _v(be, x, lo, hi), _v(be, out, lo, hi), hi - lo), shape=(op,))


def _scale(be: Backend, x: DeviceBuffer, a: float, n: int) -> Plan:
    return Plan(n, 1, 2 * _F, lambda lo, hi: (_v(be, x, lo, hi), a, hi - lo))


def _fill(be: Backend, buf: DeviceBuffer, value: float, count: int) -> Plan:
    return Plan(count, 0, _F, lambda lo, hi: (_v(be, buf, lo, hi), value, hi - lo))


def _axpy(be: Backend, n: int, a: float, x: DeviceBuffer, y: DeviceBuffer) -> Plan:
    return Plan(n, 2, 3 * _F, lambda lo, hi: (hi - lo, a, _v(be, x, lo, hi), _v(be, y, lo, hi)))


def _add_rows(be: Backend, m: DeviceBuffer, v: DeviceBuffer, rows: int, cols: int) -> Plan | None:
    if cols == 0:
        return None
    return Plan(rows, cols, 2 * _F * cols, lambda lo, hi: (_v(be, m, lo * cols, hi * cols), v, hi - lo, cols),
                shape=(cols,))


def _softmax(be: Backend, x: DeviceBuffer, rows: int, cols: int) -> Plan | None:
    if cols == 0:
        return None
    return Plan(rows, 12.0 * cols, 4 * _F * cols, lambda lo, hi: (_v(be, x, lo * cols, hi * cols), hi - lo, cols),
                shape=(cols,))


def _argmax(be: Backend, x: DeviceBuffer, rows: int, cols: int, out: memoryview) -> Plan | None:
    if cols == 0:
        return None
    return Plan(rows, cols, _F * cols + _F,
                lambda lo, hi: (_v(be, x, lo * cols, hi * cols), hi - lo, cols, out[lo * 4 : hi * 4]),
                shape=(cols,))


def _transpose(be: Backend, x: DeviceBuffer, out: DeviceBuffer, rows: int, cols: int) -> Plan | None:
    if not be.transposes_in_blocks or cols == 0:
        return None
    return Plan(rows, 0, 2 * _F * cols, lambda lo, hi: (x, out, rows, cols, lo, hi), shape=(cols,),
                call=be.transpose_block_f32)


def _sum(be: Backend, buf: DeviceBuffer, count: int) -> Plan:
    def combine(parts: Sequence[Any]) -> float:
        import numpy as np

        return float(np.float32(math.fsum(float(p or 0.0) for p in parts)))

    return Plan(count, 1, _F, lambda lo, hi: (_v(be, buf, lo, hi), hi - lo), combine=combine)


def _max(be: Backend, x: DeviceBuffer, count: int, out: memoryview) -> Plan:
    parts: list[memoryview] = []

    def chunk(lo: int, hi: int) -> tuple[object, ...]:
        part = memoryview(bytearray(4))
        parts.append(part)
        return (_v(be, x, lo, hi), hi - lo, part)

    def combine(_: Sequence[Any]) -> None:
        import numpy as np

        values = np.frombuffer(b"".join(bytes(p) for p in parts), dtype="<f4")
        np.frombuffer(out, dtype="<f4", count=1)[0] = values.max()  # a NaN part wins, as whole

    return Plan(count, 1, _F, chunk, combine=combine)


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
    return Plan(m, 2.0 * k * n, _F * (k + n),
                lambda lo, hi: (ta, tb, hi - lo, n, k, alpha, _v(be, a, lo * k, hi * k), b, beta,
                                _v(be, c, lo * n, hi * n)),
                shape=(k, n), fixed_bytes=_F * k * n)


def _gemm_ex(be: Backend, ta: int, tb: int, m: int, n: int, k: int, alpha: float, a: DeviceBuffer, ab: int,
             b: DeviceBuffer, beta: float, c: DeviceBuffer, cd: int) -> Plan | None:
    if ta or n == 0:
        return None
    sa, sc = _DT[ab], _DT[cd]
    return Plan(m, 2.0 * k * n, sa * k + sc * n,
                lambda lo, hi: (ta, tb, hi - lo, n, k, alpha, _bv(be, a, lo * k * sa, hi * k * sa), ab,
                                b, beta, _bv(be, c, lo * n * sc, hi * n * sc), cd),
                shape=(k, n, ab, cd), fixed_bytes=sa * k * n)


def _batched(be: Backend, ta: int, tb: int, m: int, n: int, k: int, alpha: float, a: DeviceBuffer, sa: int,
             b: DeviceBuffer, sb: int, beta: float, c: DeviceBuffer, sc: int, batch: int) -> Plan | None:
    if m == 0 or n == 0:
        return None

    def span(buf: DeviceBuffer, stride: int, size: int, lo: int, hi: int) -> DeviceBuffer:
        return _v(be, buf, lo * stride, lo * stride + (hi - lo - 1) * stride + size) if size else buf

    return Plan(batch, 2.0 * m * n * k, _F * (m * k + k * n + m * n), lambda lo, hi: (
        ta, tb, m, n, k, alpha, span(a, sa, m * k, lo, hi), sa, span(b, sb, k * n, lo, hi), sb, beta,
        span(c, sc, m * n, lo, hi), sc, hi - lo), shape=(m, n, k))


def _binary_op(be: Backend, op: int, x: DeviceBuffer, y: DeviceBuffer, out: DeviceBuffer, n: int) -> Plan:
    return Plan(n, 1, 3 * _F, lambda lo, hi: (op, _v(be, x, lo, hi), _v(be, y, lo, hi), _v(be, out, lo, hi), hi - lo),
                shape=(op,))


def _binary_rows(be: Backend, op: int, m: DeviceBuffer, v: DeviceBuffer, out: DeviceBuffer, rows: int,
                 cols: int) -> Plan | None:
    if cols == 0:
        return None
    return Plan(rows, cols, 2 * _F * cols,
                lambda lo, hi: (op, _v(be, m, lo * cols, hi * cols), v, _v(be, out, lo * cols, hi * cols),
                                hi - lo, cols),
                shape=(op, cols), fixed_bytes=_F * cols)


def _scalar(be: Backend, op: int, x: DeviceBuffer, a: float, out: DeviceBuffer, n: int) -> Plan:
    return Plan(n, 1, 2 * _F, lambda lo, hi: (op, _v(be, x, lo, hi), a, _v(be, out, lo, hi), hi - lo), shape=(op,))


def _reduce_rows(be: Backend, op: int, x: DeviceBuffer, rows: int, cols: int, out: DeviceBuffer) -> Plan | None:
    if cols == 0:
        return None
    return Plan(rows, cols, _F * cols + _F,
                lambda lo, hi: (op, _v(be, x, lo * cols, hi * cols), hi - lo, cols, _v(be, out, lo, hi)),
                shape=(op, cols))


def _layernorm(be: Backend, x: DeviceBuffer, g: DeviceBuffer, b: DeviceBuffer, out: DeviceBuffer, rows: int,
               cols: int, eps: float) -> Plan | None:
    if cols == 0:
        return None
    return Plan(rows, 8.0 * cols, 2 * _F * cols,
                lambda lo, hi: (_v(be, x, lo * cols, hi * cols), g, b, _v(be, out, lo * cols, hi * cols),
                                hi - lo, cols, eps),
                shape=(cols,), fixed_bytes=2 * _F * cols)


def _gather(be: Backend, table: DeviceBuffer, idx: memoryview, n: int, cols: int, out: DeviceBuffer) -> Plan | None:
    if cols == 0:
        return None
    return Plan(n, 0, 2 * _F * cols,
                lambda lo, hi: (table, idx[lo * 4 : hi * 4], hi - lo, cols, _v(be, out, lo * cols, hi * cols)),
                shape=(cols,))


def _copy(be: Backend, src: DeviceBuffer, so: int, dst: DeviceBuffer, do: int, nbytes: int) -> Plan:
    return Plan(nbytes, 0, 2, lambda lo, hi: (_bv(be, src, so + lo, so + hi), 0, _bv(be, dst, do + lo, do + hi), 0,
                                              hi - lo))


def _mask(be: Backend, x: DeviceBuffer, rows: int, cols: int, offset: int) -> Plan | None:
    if cols == 0:
        return None
    return Plan(rows, 0, _F * cols, lambda lo, hi: (_v(be, x, lo * cols, hi * cols), hi - lo, cols, offset + lo),
                shape=(cols,))


def _cast(be: Backend, src: DeviceBuffer, sd: int, dst: DeviceBuffer, dd: int, n: int) -> Plan:
    ss, ds = _DT[sd], _DT[dd]
    return Plan(n, 1, ss + ds, lambda lo, hi: (_bv(be, src, lo * ss, hi * ss), sd, _bv(be, dst, lo * ds, hi * ds), dd,
                                               hi - lo), shape=(sd, dd))


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
    "transpose_f32": _transpose,
    "sum_f32": _sum,
    "max_f32": _max,
}


def register(name: str, planner: Callable[..., Plan | None]) -> None:
    """Make op ``name`` preemptible: ``planner(backend, *args)`` (args as the op takes them, checked)
    returns its :class:`Plan`, or None where it must run whole. Replaces an earlier planner."""
    _PLANNERS[name] = planner


def plan(name: str, backend: Backend, args: tuple[object, ...]) -> Plan | None:
    """How op ``name`` with ``args`` (checked, in range) splits; None: it runs whole."""
    planner = _PLANNERS.get(name)
    if planner is None or not args:
        return None
    probe = next((a for a in args if isinstance(a, DeviceBuffer)), None)
    if probe is None or backend.view(probe, 0, 0) is None:
        return None
    got = planner(backend, *args)
    return got if got is not None and got.units > 0 else None
