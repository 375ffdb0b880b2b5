"""The model operations called from C exactly as GUESTS.md lists them: a softmax cross-entropy loss
(the logistic-regression tenant's, which once had to be computed in the guest) and the remaining
selectors, each checked against numpy by the guest's caller."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.helpers.model_ops import ref_binary, ref_unary
from tests.helpers.sdk_build import SdkBuilder
from tests.helpers.wasm_env import tenant_env
from worker.backends.stub import StubBackend

pytestmark = pytest.mark.timeout(300)  # the first build of a session compiles wasi-libc

MiB = 1 << 20

SOURCE = r"""
#include <stdlib.h>
#include "tensorwasm.h"

#define TRY(call) do { int32_t rc_ = (call); if (rc_ != TWT_OK) return rc_; } while (0)

/* mean over rows of logsumexp(x[i]) - x[i, y[i]]: the loss of logits x[n, k] with labels y */
TWT_EXPORT(xent) int32_t xent(twt_handle x, twt_handle labels, twt_handle loss, int64_t n, int64_t k) {
    twt_handle m = twt_alloc(n * 4), xt = twt_alloc(n * k * 4), s = twt_alloc(n * 4), gold = twt_alloc(n * 4);
    if (m < 0 || xt < 0 || s < 0 || gold < 0) return TWT_GPU_QUOTA;
    TRY(twt_reduce_rows_f32(TWT_RED_MAX, x, n, k, m));             /* m[i] = max_j x[i, j] */
    TRY(twt_transpose_f32(x, xt, n, k));                          /* rows of xt: one class, all samples */
    TRY(twt_binary_rows_f32(TWT_BIN_SUB, xt, m, xt, k, n));        /* x - m, per sample */
    TRY(twt_unary_f32(TWT_OP_EXP, xt, xt, n * k));
    twt_handle e = twt_alloc(n * k * 4);
    if (e < 0) return (int32_t)e;
    TRY(twt_transpose_f32(xt, e, k, n));
    TRY(twt_reduce_rows_f32(TWT_RED_SUM, e, n, k, s));
    TRY(twt_unary_f32(TWT_OP_LOG, s, s, n));
    TRY(twt_binary_f32(TWT_BIN_ADD, s, m, s, n));                  /* logsumexp */
    int32_t *idx = malloc((size_t)n * sizeof *idx);
    if (idx == NULL) return TWT_INVALID;
    TRY(twt_read(labels, 0, idx, (uint32_t)(n * 4)));
    for (int64_t i = 0; i < n; i++) idx[i] += (int32_t)(i * k);   /* x as a table of n*k one-float rows */
    int32_t rc = twt_gather_rows_f32(x, idx, n, 1, gold);
    free(idx);
    TRY(rc);
    TRY(twt_binary_f32(TWT_BIN_SUB, s, gold, s, n));
    TRY(twt_reduce_rows_f32(TWT_RED_MEAN, s, 1, n, loss));
    return TWT_OK;
}

/* every other selector on x, into out[op, :]: binary against y, scalar with a, the new unary ops */
TWT_EXPORT(selectors) int32_t selectors(twt_handle x, twt_handle y, twt_handle out, int64_t n, float a) {
    const int32_t bins[] = {TWT_BIN_ADD, TWT_BIN_SUB, TWT_BIN_MUL, TWT_BIN_DIV, TWT_BIN_MAX, TWT_BIN_MIN};
    const int32_t unary[] = {TWT_OP_LOG, TWT_OP_GELU, TWT_OP_SILU, TWT_OP_RSQRT, TWT_OP_RECIP};
    twt_handle t = twt_alloc(n * 4);
    if (t < 0) return (int32_t)t;
    int64_t row = 0;
    for (int i = 0; i < 6; i++, row++) {
        TRY(twt_binary_f32(bins[i], x, y, t, n));
        TRY(twt_copy(t, 0, out, row * n * 4, n * 4));
    }
    for (int i = 0; i < 6; i++, row++) {
        TRY(twt_scalar_f32(bins[i], x, a, t, n));
        TRY(twt_copy(t, 0, out, row * n * 4, n * 4));
    }
    for (int i = 0; i < 5; i++, row++) {
        TRY(twt_unary_f32(unary[i], x, t, n));
        TRY(twt_copy(t, 0, out, row * n * 4, n * 4));
    }
    return TWT_OK;
}
"""


def _buffers(env: Any, arrays: dict[str, Any]) -> dict[str, int]:
    alloc = env.ctx.allocator
    out = {}
    for name, arr in arrays.items():
        out[name] = alloc.alloc(max(4, arr.nbytes))
        alloc.write(out[name], 0, memoryview(np.ascontiguousarray(arr).tobytes()))
    return out


def test_a_cross_entropy_loss_from_c_equals_numpy(sdk: SdkBuilder) -> None:
    module = sdk.source("xent.c", SOURCE)
    r = np.random.default_rng(5)
    n, k = 40, 7
    x = (r.standard_normal((n, k), dtype=np.float32) * 3).astype(np.float32)
    y = r.integers(0, k, n, dtype=np.int32)
    with tenant_env("sdk", StubBackend(), gpu_cap=64 * MiB, max_memory=4 * MiB) as env:
        h = _buffers(env, {"x": x, "y": y, "loss": np.zeros(1, np.float32)})
        reply = env.host.run(module, "xent", [{"handle": h["x"]}, {"handle": h["y"]}, {"handle": h["loss"]}, n, k],
                             fuel=10**8, timeout_s=30)
        assert reply["results"] == [0]
        (loss,) = np.frombuffer(env.ctx.allocator.read(h["loss"], 0, 4), np.float32)
        for handle in h.values():
            env.ctx.allocator.free(handle)
    lse = np.log(np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1)) + x.max(axis=1)
    assert loss == pytest.approx(float((lse - x[np.arange(n), y]).mean()), rel=1e-5)


def test_every_selector_from_c_equals_numpy(sdk: SdkBuilder) -> None:
    module = sdk.source("xent.c", SOURCE)
    r = np.random.default_rng(8)
    n, a = 33, np.float32(0.75)
    x = np.abs(r.standard_normal(n, dtype=np.float32)) + np.float32(0.1)  # log / rsqrt on their domain
    y = r.standard_normal(n, dtype=np.float32)
    with tenant_env("sdk", StubBackend(), gpu_cap=64 * MiB, max_memory=4 * MiB) as env:
        h = _buffers(env, {"x": x, "y": y, "out": np.zeros(17 * n, np.float32)})
        reply = env.host.run(module, "selectors", [{"handle": h["x"]}, {"handle": h["y"]}, {"handle": h["out"]},
                                                   n, float(a)], fuel=10**8, timeout_s=30)
        assert reply["results"] == [0]
        got = np.frombuffer(env.ctx.allocator.read(h["out"], 0, 17 * n * 4), np.float32).reshape(17, n)
        for handle in h.values():
            env.ctx.allocator.free(handle)
    names = ("add", "sub", "mul", "div", "max", "min")
    want = [ref_binary(b, x, y) for b in names] + [ref_binary(b, x, a) for b in names]
    want += [ref_unary(u, x) for u in ("log", "gelu", "silu", "rsqrt", "recip")]
    np.testing.assert_allclose(got, np.stack(want), rtol=1e-6, atol=1e-7)
