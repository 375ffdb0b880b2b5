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
        return np.abs(x)


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
            ov[:] = xv + yv if op == 0 else xv * yv
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
            x, out, rows, cols = args
            xv, ov = f32(x, rows * cols), f32(out, rows * cols)
            if xv is None or ov is None:
                return False
            ov.reshape(cols, rows)[:] = xv.reshape(rows, cols).T
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
        else:
            return False
    return True
