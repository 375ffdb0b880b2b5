"""The fake driver's versions of the tensor-op kernels (``worker.backends.cuda_ops.OPS_SOURCE``).

:meth:`tests.helpers.fake_cuda.FakeDriver._run` hands every kernel it does
not know itself to :func:`run_tensor_kernel`, which computes it with numpy on
the fake device memory, by name, with the CUDA code's semantics: NaN wins in
max/argmax, the first of equal maxima, relu keeps NaN, ``max`` writes one
partial per block over the same grid-stride partition. A pointer outside any
allocation makes the launch fail at the next synchronize
(``CUDA_ERROR_ILLEGAL_ADDRESS``), as on hardware.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.helpers.fake_cuda import FakeDriver

__all__ = ["run_tensor_kernel"]


def _unary(op: int, x: Any) -> Any:
    import numpy as np

    with np.errstate(all="ignore"):
        if op == 0:
            return np.where((x > 0) | np.isnan(x), x, np.float32(0))
        if op == 1:
            return np.exp(x)
        if op == 2:
            return np.tanh(x)
        if op == 3:
            return np.float32(1) / (np.float32(1) + np.exp(-x))
        if op == 4:
            return -x
        if op == 5:
            return np.sqrt(x)
        if op == 6:
            return np.abs(x)
        if op == 7:
            return np.log(x)
        if op == 8:  # the kernel's GELU, step by step in float32
            t = x * x
            t = t * x
            t = t * np.float32(0.044715)
            t = t + x
            t = t * np.float32(0.7978845608028654)
            t = np.tanh(t)
            t = t + np.float32(1)
            t = t * x
            return t * np.float32(0.5)
        if op == 9:
            return x / (np.float32(1) + np.exp(-x))
        if op == 10:
            return np.float32(1) / np.sqrt(x)
        return np.float32(1) / x


def _binop(op: int, x: Any, y: Any) -> Any:
    import numpy as np

    return (np.add, np.subtract, np.multiply, np.divide, np.maximum, np.minimum)[op](x, y)


def _dtype(code: int) -> Any:
    import numpy as np

    if code == 2:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float16 if code == 1 else np.float32)


def _typed(drv: FakeDriver, addr: int, n: int, code: int) -> Any:
    import numpy as np

    dt = _dtype(code)
    found = drv._resolve(int(addr), n * dt.itemsize)
    if found is None:
        return None
    a, off = found
    return np.frombuffer(a.buf(), dtype=dt, count=n, offset=off)


def run_tensor_kernel(drv: FakeDriver, name: bytes, grid: int, block: int, args: tuple[Any, ...]) -> bool:
    """Run one tensor-op kernel; False when a pointer is out of bounds (or the kernel is unknown)."""
    import numpy as np

    f32 = drv._f32
    with np.errstate(all="ignore"):
        if name == b"twt_binary_f32":
            op, x, y, out, n = args
            xv, yv, ov = f32(x, n), f32(y, n), f32(out, n)
            if xv is None or yv is None or ov is None:
                return False
            ov[:] = _binop(op, xv, yv)
        elif name == b"twt_add_rows_f32":
            m, v, rows, cols = args
            mv, vv = f32(m, rows * cols), f32(v, cols)
            if mv is None or vv is None:
                return False
            mv.reshape(rows, cols)[:] += vv
        elif name == b"twt_unary_f32":
            op, x, out, n = args
            xv, ov = f32(x, n), f32(out, n)
            if xv is None or ov is None:
                return False
            ov[:] = _unary(op, xv.copy())
        elif name == b"twt_scale_f32":
            x, a, n = args
            xv = f32(x, n)
            if xv is None:
                return False
            xv *= np.float32(a)
        elif name == b"twt_zero_f32":
            p, n = args
            pv = f32(p, n)
            if pv is None:
                return False
            pv[:] = 0
        elif name == b"twt_transpose_f32":
            x, out, rows, cols, r0, r1 = args
            xv, ov = f32(x, rows * cols), f32(out, rows * cols)
            if xv is None or ov is None:
                return False
            ov.reshape(cols, rows)[:, r0:r1] = xv.reshape(rows, cols)[r0:r1].T
        elif name == b"twt_softmax_rows_f32":
            x, rows, cols = args
            xv = f32(x, rows * cols)
            if xv is None:
                return False
            mat = xv.reshape(rows, cols)
            e = np.exp(mat - mat.max(axis=1, keepdims=True))
            mat[:] = e / e.sum(axis=1, keepdims=True)
        elif name == b"twt_max_f32":
            x, n, partial = args
            xv, pv = f32(x, n), f32(partial, grid)
            if xv is None or pv is None:
                return False
            which = (np.arange(n, dtype=np.int64) // block) % grid  # the grid-stride partition
            for g in range(grid):
                part = xv[which == g]
                pv[g] = part.max() if part.size else -np.inf
        elif name == b"twt_argmax_rows_f32":
            x, first, count, cols, out = args
            xv = f32(x + 4 * first * cols, count * cols)
            ov = drv._f32(out, count, "int32")
            if xv is None or ov is None:
                return False
            ov[:] = xv.reshape(count, cols).argmax(axis=1)
        elif name == b"twt_binary_rows_f32":
            op, m, v, out, rows, cols = args
            mv, vv, ov = f32(m, rows * cols), f32(v, cols), f32(out, rows * cols)
            if mv is None or vv is None or ov is None:
                return False
            ov.reshape(rows, cols)[:] = _binop(op, mv.reshape(rows, cols), vv)
        elif name == b"twt_scalar_f32":
            op, x, a, out, n = args
            xv, ov = f32(x, n), f32(out, n)
            if xv is None or ov is None:
                return False
            ov[:] = _binop(op, xv, np.float32(a))
        elif name == b"twt_reduce_rows_f32":
            op, x, rows, cols, out = args
            xv, ov = f32(x, rows * cols), f32(out, rows)
            if xv is None or ov is None:
                return False
            mat = xv.reshape(rows, cols)
            if op == 1:
                ov[:] = mat.max(axis=1)
            else:  # double sums rounded once, as the kernel
                total = mat.astype(np.float64).sum(axis=1).astype(np.float32)
                ov[:] = total / np.float32(cols) if op == 2 else total
        elif name == b"twt_layernorm_rows_f32":
            x, g, b, out, rows, cols, eps = args
            xv, gv, bv, ov = f32(x, rows * cols), f32(g, cols), f32(b, cols), f32(out, rows * cols)
            if xv is None or gv is None or bv is None or ov is None:
                return False
            mat = xv.reshape(rows, cols).copy()
            mean = mat.astype(np.float64).sum(axis=1, keepdims=True).astype(np.float32) / np.float32(cols)
            d = mat - mean
            var = (d * d).astype(np.float64).sum(axis=1, keepdims=True).astype(np.float32) / np.float32(cols)
            ov.reshape(rows, cols)[:] = d / np.sqrt(var + np.float32(eps)) * gv + bv
        elif name == b"twt_gather_rows_f32":
            table, idx, n, cols, out = args
            iv, ov = drv._f32(idx, n, "int32"), f32(out, n * cols)
            if iv is None or ov is None:
                return False
            rows = int(iv.max()) + 1 if n else 0
            tv = f32(table, rows * cols)
            if tv is None or (n and int(iv.min()) < 0):
                return False
            ov.reshape(n, cols)[:] = tv.reshape(rows, cols)[iv]
        elif name == b"twt_copy_bytes":
            src, dst, n = args
            sv, dv = drv._f32(src, n, "uint8"), drv._f32(dst, n, "uint8")
            if sv is None or dv is None:
                return False
            dv[:] = sv
        elif name == b"twt_causal_mask_f32":
            x, rows, cols, offset = args
            xv = f32(x, rows * cols)
            if xv is None:
                return False
            xv.reshape(rows, cols)[np.arange(cols)[None, :] > np.arange(rows)[:, None] + offset] = -np.inf
        elif name == b"twt_cast":
            src, sd, dst, dd, n = args
            sv, dv = _typed(drv, src, n, sd), _typed(drv, dst, n, dd)
            if sv is None or dv is None:
                return False
            dv[:] = sv.astype(np.float32).astype(dv.dtype)
        elif name == b"twt_scale_any":
            p, dt, beta, n = args
            pv = _typed(drv, p, n, dt)
            if pv is None:
                return False
            pv[:] = 0 if beta == 0 else (pv.astype(np.float32) * np.float32(beta)).astype(pv.dtype)
        else:
            return False
    return True
