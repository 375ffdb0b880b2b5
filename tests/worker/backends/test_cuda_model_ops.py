"""The ABI's second-round ops (GEMM flags and batches, selectors, row reductions, layer norm, gather,
copy, causal mask, f16/bf16) on the cuda backend, against the fake driver and the fake cuBLAS.

The same calls and numpy references as test_wasm_model_ops (tests/helpers/model_ops.py): the
kernels' launch arguments, the cuBLAS row-major mapping (operand order, transposes, leading
dimensions, strides, data types) and the scratch round trip of gather's indices are what these
prove; the kernels' arithmetic itself is the fake's numpy twin (the GPU check runs the real one).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.model_ops import call, check_every_op, get, put
from tests.worker.backends.test_cuda_tensor_ops import cuda_env, probe
from worker.backends import cuda_ops
from worker.wasm import ErrorCode

pytestmark = pytest.mark.timeout(120)


def test_every_new_op_matches_numpy_on_the_cuda_backend() -> None:
    with cuda_env() as env, probe(env) as s:
        check_every_op(s, seed=1)
        assert env.cublas.default_workspace_gemms == 0  # every GEMM on the run's metered workspace
        assert {"sgemm", "sgemm_strided_batched", "gemm_ex"} <= set(env.cublas.calls)


def test_gemm_flags_reach_cublas_as_the_row_major_mapping() -> None:
    with cuda_env() as env, probe(env) as s:
        m, n, k = 3, 4, 5
        ha, hb, hc = put(s, np.ones((k, m))), put(s, np.ones((n, k))), put(s, np.zeros((m, n)))
        assert call(s, "gemm_f32", 1, 1, m, n, k, 1.0, ha, hb, 0.0, hc) == ErrorCode.OK
        # C^T = op(B)^T op(A)^T: cuBLAS sees (n, m, k), B first
        assert env.cublas.gemms[-1] == (n, m, k)
        np.testing.assert_array_equal(get(s, hc, m * n), np.full(m * n, k, np.float32))


def test_gather_of_more_rows_than_the_scratch_holds_goes_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_ops, "_GATHER_ROWS", 3)
    with cuda_env() as env, probe(env) as s:
        table = np.arange(40, dtype=np.float32).reshape(10, 4)
        idx = np.int32([9, 1, 1, 0, 5, 7, 2])
        s.guest_memory()[512 : 512 + idx.nbytes] = idx.tobytes()
        ht, ho = put(s, table), put(s, np.zeros((7, 4)))
        assert call(s, "gather_rows_f32", ht, 512, 7, 4, ho) == ErrorCode.OK
        np.testing.assert_array_equal(get(s, ho, 28).reshape(7, 4), table[idx])


def test_k_zero_scales_c_by_beta_without_cublas() -> None:
    with cuda_env() as env, probe(env) as s:
        c0 = np.arange(6, dtype=np.float32)
        ha, hb, hc = put(s, [0.0]), put(s, [0.0]), put(s, c0)
        assert call(s, "gemm_f32", 0, 0, 2, 3, 0, 1.0, ha, hb, 2.0, hc) == ErrorCode.OK
        np.testing.assert_array_equal(get(s, hc, 6), 2 * c0)
        assert call(s, "gemm_ex", 0, 0, 2, 3, 0, 1.0, ha, 1, hb, 0.0, hc, 0) == ErrorCode.OK
        np.testing.assert_array_equal(get(s, hc, 6), np.zeros(6, np.float32))
        assert not any(c.startswith(("sgemm", "gemm")) for c in env.cublas.calls)


def test_chunked_launches_give_the_same_results() -> None:
    """One row / element / batch a launch (a 1 ns chunk target): every view's device address is right."""
    with cuda_env() as env, probe(env) as s:
        gate = env.ctx.gate
        gate.chunk_ns = 1
        before = gate.chunks
        check_every_op(s, seed=2)
        assert gate.chunks - before > 1000
