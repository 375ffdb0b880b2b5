"""Every op of the ABI's second round (GEMM flags, selectors, row reductions, norms, gather, copy,
mask, dtypes) against numpy, through a probe session on any backend.

Used by tests/worker/wasm/test_wasm_model_ops.py (stub) and test_cuda_model_ops.py (the cuda backend on
the fake driver), so both backends answer the same calls with the same references. ``F32_TOL`` is
float32 rounding of the same algorithm (a GEMM's BLAS may sum in another order); the f16/bf16
tolerances are the ones docs/WASM-ABI.md documents.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from worker.wasm import ErrorCode, WasmSession
from worker.wasm.tensor_abi import BINARY_OPS, DTYPES, REDUCE_OPS, UNARY_OPS

__all__ = ["BF16_RTOL", "F16_RTOL", "F32_TOL", "NP_DTYPES", "alloc_bytes", "check_every_op", "gelu", "get",
           "get_typed", "layernorm", "put", "put_typed", "ref_binary", "ref_unary"]

#: (rtol, atol) of float32 results against numpy (same algorithm, float rounding)
F32_TOL = (2e-5, 2e-6)
#: relative tolerance of a result rounded to f16 / bf16 (one rounding: 2^-11 / 2^-8, plus f32 order)
F16_RTOL = 1e-3
BF16_RTOL = 8e-3


def _bf16() -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16


NP_DTYPES: dict[str, Any] = {"f32": np.float32, "f16": np.float16}


def np_dtype(name: str) -> Any:
    return _bf16() if name == "bf16" else NP_DTYPES[name]


def call(s: WasmSession, name: str, *args: object) -> int:
    (result,) = s.call(name, list(args))
    assert isinstance(result, int)
    return result


def alloc_bytes(s: WasmSession, nbytes: int) -> int:
    h = call(s, "alloc", max(4, nbytes))
    assert h > 0, h
    return h


def put_typed(s: WasmSession, values: Any, dtype: str = "f32", extra: int = 0) -> int:
    arr = np.ascontiguousarray(values).astype(np_dtype(dtype)).ravel()
    h = alloc_bytes(s, arr.nbytes + extra * arr.itemsize)
    if arr.size:
        s.host.ctx.backend.write(s.run.buffers[h][0], 0, memoryview(arr.tobytes()))
    return h


def put(s: WasmSession, values: Any, extra: int = 0) -> int:
    return put_typed(s, values, "f32", extra)


def get_typed(s: WasmSession, h: int, n: int, dtype: str = "f32") -> Any:
    dt = np.dtype(np_dtype(dtype))
    buf = s.run.buffers[h][0]
    return np.frombuffer(s.host.ctx.backend.read(buf, 0, n * dt.itemsize), dtype=dt).copy()


def get(s: WasmSession, h: int, n: int) -> Any:
    return get_typed(s, h, n, "f32")


def gelu(x: Any) -> Any:
    """The ABI's GELU (tanh form) in float32."""
    x = np.asarray(x, np.float32)
    with np.errstate(all="ignore"):
        t = np.tanh(np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x * x * x))
        return (np.float32(0.5) * x * (np.float32(1) + t)).astype(np.float32)


def ref_unary(name: str, x: Any) -> Any:
    with np.errstate(all="ignore"):
        return {
            "relu": lambda v: np.maximum(v, np.float32(0)),
            "exp": np.exp, "tanh": np.tanh,
            "sigmoid": lambda v: np.float32(1) / (np.float32(1) + np.exp(-v)),
            "neg": np.negative, "sqrt": np.sqrt, "abs": np.abs, "log": np.log, "gelu": gelu,
            "silu": lambda v: v / (np.float32(1) + np.exp(-v)),
            "rsqrt": lambda v: np.float32(1) / np.sqrt(v), "recip": lambda v: np.float32(1) / v,
        }[name](x).astype(np.float32)


def ref_binary(name: str, x: Any, y: Any) -> Any:
    with np.errstate(all="ignore"):
        fn = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
              "max": np.maximum, "min": np.minimum}[name]
        return fn(x, y).astype(np.float32)


def layernorm(x: Any, g: Any, b: Any, eps: float) -> Any:
    mean = x.mean(axis=1, keepdims=True, dtype=np.float32)
    d = x - mean
    var = (d * d).mean(axis=1, keepdims=True, dtype=np.float32)
    return (d / np.sqrt(var + np.float32(eps)) * g + b).astype(np.float32)


def close(got: Any, ref: Any, tol: tuple[float, float] = F32_TOL) -> None:
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=tol[0], atol=tol[1],
                               equal_nan=True)


def _op(x: Any, t: int) -> Any:
    return x.T if t else x


def check_every_op(s: WasmSession, seed: int = 0) -> None:
    """Each op (each selector, transpose flag and dtype) once on random data, against numpy."""
    r = np.random.default_rng(seed)
    ok = int(ErrorCode.OK)

    # gemm_f32: every transpose combination, alpha/beta, beta = 0 not reading C (NaN there)
    m, n, k = 5, 7, 3
    for ta in (0, 1):
        for tb in (0, 1):
            a = r.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
            b = r.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
            c0 = r.standard_normal((m, n), dtype=np.float32)
            ha, hb, hc = put(s, a), put(s, b), put(s, c0)
            assert call(s, "gemm_f32", ta, tb, m, n, k, 0.5, ha, hb, -2.0, hc) == ok
            close(get(s, hc, m * n).reshape(m, n), np.float32(0.5) * (_op(a, ta) @ _op(b, tb)) - 2 * c0)
            hn = put(s, np.full((m, n), np.nan, np.float32))
            assert call(s, "gemm_f32", ta, tb, m, n, k, 1.0, ha, hb, 0.0, hn) == ok
            close(get(s, hn, m * n).reshape(m, n), _op(a, ta) @ _op(b, tb))

    # gemm_strided_batched_f32: per-head Q @ K^T, and a broadcast A (stride 0)
    batch, m, n, k = 3, 4, 5, 6
    a = r.standard_normal((batch, m, k), dtype=np.float32)
    b = r.standard_normal((batch, n, k), dtype=np.float32)
    ha, hb, hc = put(s, a), put(s, b), put(s, np.zeros((batch, m, n), np.float32))
    assert call(s, "gemm_strided_batched_f32", 0, 1, m, n, k, 0.25, ha, m * k, hb, n * k, 0.0, hc, m * n,
                batch) == ok
    close(get(s, hc, batch * m * n).reshape(batch, m, n), np.float32(0.25) * (a @ b.transpose(0, 2, 1)))
    x = r.standard_normal((m, k), dtype=np.float32)
    w = r.standard_normal((batch, k, n), dtype=np.float32)
    hx, hw, ho = put(s, x), put(s, w), put(s, np.ones((batch, m, n), np.float32))
    assert call(s, "gemm_strided_batched_f32", 0, 0, m, n, k, 1.0, hx, 0, hw, k * n, 1.0, ho, m * n, batch) == ok
    close(get(s, ho, batch * m * n).reshape(batch, m, n), x @ w + 1)

    # binary, binary_rows, scalar: every selector, NaN through max/min
    nn = 37
    x = r.standard_normal(nn, dtype=np.float32)
    y = r.standard_normal(nn, dtype=np.float32)
    x[3], y[5] = np.nan, np.nan
    for i, name in enumerate(BINARY_OPS):
        hx, hy, ho = put(s, x), put(s, y), put(s, np.zeros(nn, np.float32))
        assert call(s, "binary_f32", i, hx, hy, ho, nn) == ok
        close(get(s, ho, nn), ref_binary(name, x, y))
        assert call(s, "binary_f32", i, hx, hy, hx, nn) == ok  # out = x
        close(get(s, hx, nn), ref_binary(name, x, y))
        hs = put(s, x)
        assert call(s, "scalar_f32", i, hs, 1.5, hs, nn) == ok
        close(get(s, hs, nn), ref_binary(name, x, np.float32(1.5)))
        mat = r.standard_normal((4, 6), dtype=np.float32)
        v = r.standard_normal(6, dtype=np.float32)
        hm, hv, hout = put(s, mat), put(s, v), put(s, np.zeros((4, 6), np.float32))
        assert call(s, "binary_rows_f32", i, hm, hv, hout, 4, 6) == ok
        close(get(s, hout, 24).reshape(4, 6), ref_binary(name, mat, v))

    # unary: every op (the new ones on their domains, incl. log of <= 0 and rsqrt/recip of 0)
    u = np.concatenate([r.standard_normal(40, dtype=np.float32) * 3, np.float32([0, -0.0, 1e-3, 20, -20])])
    for i, name in enumerate(UNARY_OPS):
        hx, ho = put(s, u), put(s, np.zeros(u.size, np.float32))
        assert call(s, "unary_f32", i, hx, ho, u.size) == ok
        close(get(s, ho, u.size), ref_unary(name, u), (1e-5, 1e-6))

    # reduce_rows: sum, max, mean
    mat = r.standard_normal((6, 33), dtype=np.float32)
    mat[2, 4] = np.nan
    for i, name in enumerate(REDUCE_OPS):
        hx, ho = put(s, mat), put(s, np.zeros(6, np.float32))
        assert call(s, "reduce_rows_f32", i, hx, 6, 33, ho) == ok
        with np.errstate(all="ignore"):
            ref = {"sum": mat.sum(axis=1, dtype=np.float32), "max": mat.max(axis=1),
                   "mean": mat.mean(axis=1, dtype=np.float32)}[name]
        close(get(s, ho, 6), ref)

    # layernorm_rows (in place and out of place)
    x = r.standard_normal((5, 24), dtype=np.float32) * 3 + 1
    g = r.standard_normal(24, dtype=np.float32)
    bt = r.standard_normal(24, dtype=np.float32)
    hx, hg, hb, ho = put(s, x), put(s, g), put(s, bt), put(s, np.zeros_like(x))
    assert call(s, "layernorm_rows_f32", hx, hg, hb, ho, 5, 24, 1e-5) == ok
    close(get(s, ho, x.size).reshape(x.shape), layernorm(x, g, bt, 1e-5))
    assert call(s, "layernorm_rows_f32", hx, hg, hb, hx, 5, 24, 1e-5) == ok
    close(get(s, hx, x.size).reshape(x.shape), layernorm(x, g, bt, 1e-5))

    # gather_rows: indices in guest memory (at byte 1024 of the probe's memory)
    table = r.standard_normal((10, 8), dtype=np.float32)
    idx = np.int32([3, 0, 9, 3, 7])
    s.guest_memory()[1024 : 1024 + idx.nbytes] = idx.tobytes()
    ht, ho = put(s, table), put(s, np.zeros((5, 8), np.float32))
    assert call(s, "gather_rows_f32", ht, 1024, 5, 8, ho) == ok
    close(get(s, ho, 40).reshape(5, 8), table[idx])

    # copy: between buffers and inside one (non-overlapping)
    src = r.standard_normal(16, dtype=np.float32)
    hs, hd = put(s, src), put(s, np.zeros(16, np.float32))
    assert call(s, "copy", hs, 8, hd, 20, 24) == ok
    want = np.zeros(16, np.float32)
    want.view(np.uint8)[20:44] = src.view(np.uint8)[8:32]
    close(get(s, hd, 16), want)
    assert call(s, "copy", hs, 0, hs, 32, 32) == ok
    src2 = src.copy()
    src2[8:16] = src[0:8]
    close(get(s, hs, 16), src2)

    # causal_mask: offsets 0 and 2, a non-square block
    for off in (0, 2):
        sc = r.standard_normal((4, 7), dtype=np.float32)
        hx = put(s, sc)
        assert call(s, "causal_mask_f32", hx, 4, 7, off) == ok
        want = sc.copy()
        want[np.arange(7)[None, :] > np.arange(4)[:, None] + off] = -np.inf
        np.testing.assert_array_equal(get(s, hx, 28).reshape(4, 7), want)

    # cast: every pair of dtypes, rounding to nearest even as numpy / ml_dtypes do
    vals = np.concatenate([r.standard_normal(30, dtype=np.float32) * 100,
                           np.float32([0, -0.0, np.inf, -np.inf, np.nan, 65504, 70000, 1e-8, 3.0e38])])
    for si, sname in enumerate(DTYPES):
        for di, dname in enumerate(DTYPES):
            if si == di:
                continue
            with np.errstate(all="ignore"):
                src_vals = vals.astype(np_dtype(sname))
            hs = put_typed(s, src_vals, sname)
            hd = alloc_bytes(s, vals.size * np.dtype(np_dtype(dname)).itemsize)
            assert call(s, "cast", hs, si, hd, di, vals.size) == ok
            got = get_typed(s, hd, vals.size, dname)
            with np.errstate(all="ignore"):
                want = src_vals.astype(np.float32).astype(np_dtype(dname))
            np.testing.assert_array_equal(got.view(np.uint16 if dname != "f32" else np.uint32)[~np.isnan(
                want.astype(np.float32))], want.view(got.dtype).view(
                np.uint16 if dname != "f32" else np.uint32)[~np.isnan(want.astype(np.float32))])
            assert np.isnan(got.astype(np.float32)).sum() == np.isnan(want.astype(np.float32)).sum()

    # gemm_ex: f16 / bf16 inputs, f32 accumulation, each C dtype
    m, n, k = 6, 5, 16
    for ab in (1, 2):
        for cd in (0, ab):  # C in float32 or in the inputs' dtype (the pairs cuBLAS has)
            a = r.standard_normal((m, k), dtype=np.float32).astype(np_dtype(DTYPES[ab]))
            b = r.standard_normal((n, k), dtype=np.float32).astype(np_dtype(DTYPES[ab]))
            c0 = r.standard_normal((m, n), dtype=np.float32).astype(np_dtype(DTYPES[cd]))
            ha, hb, hc = put_typed(s, a, DTYPES[ab]), put_typed(s, b, DTYPES[ab]), put_typed(s, c0, DTYPES[cd])
            assert call(s, "gemm_ex", 0, 1, m, n, k, 1.0, ha, ab, hb, 0.5, hc, cd) == ok
            ref = a.astype(np.float32) @ b.astype(np.float32).T + np.float32(0.5) * c0.astype(np.float32)
            got = get_typed(s, hc, m * n, DTYPES[cd]).astype(np.float32).reshape(m, n)
            rtol = {0: F32_TOL[0], 1: F16_RTOL, 2: BF16_RTOL}[cd]
            np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol)
