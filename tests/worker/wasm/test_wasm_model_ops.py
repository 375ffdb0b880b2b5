"""The ABI's second-round ops (GEMM flags and batches, selectors, row reductions, layer norm, gather,
copy, causal mask, f16/bf16) on the stub backend.

In process through ``worker/guests/probe.wat``, as test_wasm_tensor_ops: every op against numpy
(tests/helpers/model_ops.py, shared with the cuda fake's test), the same again cut into one-unit
chunks by the GPU-time gate (results must not depend on the chunking), each op's own error rules,
and random hostile arguments that must always come back as a code, never a trap.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.model_ops import alloc_bytes, call, check_every_op, get, put
from tests.helpers.wasm_env import Env, make_env, probe
from worker.wasm import ErrorCode, WasmSession
from worker.wasm.tensor_abi import TENSOR_OPS

pytestmark = pytest.mark.timeout(120)

OK = ErrorCode.OK
INVALID = ErrorCode.INVALID
BAD_HANDLE = ErrorCode.BAD_HANDLE
BUFFER_BOUNDS = ErrorCode.BUFFER_BOUNDS
MEMORY_BOUNDS = ErrorCode.MEMORY_BOUNDS
#: the run time of a session that serves a whole hypothesis test (hundreds of examples)
SESSION_S = 3600.0
NEW_OPS = ("gemm_f32", "gemm_strided_batched_f32", "binary_f32", "binary_rows_f32", "scalar_f32", "reduce_rows_f32",
           "layernorm_rows_f32", "gather_rows_f32", "copy", "causal_mask_f32", "cast", "gemm_ex")


@contextmanager
def session(fast: bool = True) -> Iterator[tuple[Env, WasmSession]]:
    """One session for every example of a test: its run's deadline must outlast them all on a loaded
    host (past it every device op is refused: the test's timeout bounds it instead)."""
    with make_env(fast, gpu_cap=None) as env, probe(env, timeout_s=SESSION_S) as s:
        yield env, s


@pytest.mark.parametrize("fast", [True, False], ids=["fast-imports", "checked-imports"])
def test_every_new_op_matches_numpy(fast: bool) -> None:
    with session(fast) as (_, s):
        check_every_op(s)


def test_results_do_not_depend_on_the_chunking() -> None:
    """With a 1 ns chunk target every op that splits runs one unit (row, element, batch) a launch."""
    with session() as (env, s):
        gate = env.ctx.gate
        before = gate.chunks
        gate.chunk_ns = 1
        check_every_op(s, seed=3)
        assert gate.chunks - before > 1000  # whole, its ~200 calls would be ~200 launches


def test_a_gemm_in_chunks_equals_numpy_on_a_larger_shape() -> None:
    with session() as (env, s):
        env.ctx.gate.chunk_ns = 20_000
        r = np.random.default_rng(9)
        m, n, k = 300, 70, 90
        a = r.standard_normal((m, k), dtype=np.float32)
        b = r.standard_normal((n, k), dtype=np.float32)
        c0 = r.standard_normal((m, n), dtype=np.float32)
        ha, hb, hc = put(s, a), put(s, b), put(s, c0)
        before = env.ctx.gate.chunks
        assert call(s, "gemm_f32", 0, 1, m, n, k, 2.0, ha, hb, 0.5, hc) == OK
        assert env.ctx.gate.chunks - before > 1
        np.testing.assert_allclose(get(s, hc, m * n).reshape(m, n), 2 * a @ b.T + 0.5 * c0, rtol=2e-5, atol=2e-5)


def test_selectors_flags_and_dtypes_outside_their_range_are_invalid() -> None:
    with session() as (_, s):
        h = [put(s, np.ones(64)) for _ in range(4)]
        cases: list[tuple[str, tuple[Any, ...]]] = [
            ("gemm_f32", (2, 0, 2, 2, 2, 1.0, h[0], h[1], 0.0, h[2])),
            ("gemm_f32", (0, -1, 2, 2, 2, 1.0, h[0], h[1], 0.0, h[2])),
            ("gemm_f32", (0, 0, 2, 2, 2, 1.0, h[0], h[1], 0.0, h[0])),  # c is a
            ("gemm_strided_batched_f32", (0, 0, 2, 2, 2, 1.0, h[0], 4, h[1], 4, 0.0, h[2], 3, 2)),  # outputs overlap
            ("gemm_strided_batched_f32", (0, 0, 2, 2, 2, 1.0, h[0], 4, h[1], 4, 0.0, h[2], 4, -1)),
            ("binary_f32", (6, h[0], h[1], h[2], 4)), ("binary_f32", (-1, h[0], h[1], h[2], 4)),
            ("binary_rows_f32", (0, h[0], h[1], h[1], 2, 2)),  # out is v
            ("scalar_f32", (6, h[0], 1.0, h[1], 4)),
            ("reduce_rows_f32", (3, h[0], 2, 2, h[1])), ("reduce_rows_f32", (0, h[0], 2, 0, h[1])),
            ("reduce_rows_f32", (0, h[0], 2, 2, h[0])),
            ("layernorm_rows_f32", (h[0], h[1], h[2], h[1], 2, 2, 1e-5)),  # out is gamma
            ("layernorm_rows_f32", (h[0], h[1], h[2], h[3], 2, 0, 1e-5)),
            ("gather_rows_f32", (h[0], 0, 1, 2, h[0])),  # out is table
            ("copy", (h[0], 0, h[0], 4, 8)),  # overlapping ranges of one buffer
            ("copy", (h[0], -4, h[1], 0, 4)),
            ("cast", (h[0], 0, h[1], 3, 4)), ("cast", (h[0], -1, h[1], 1, 4)), ("cast", (h[0], 0, h[0], 1, 4)),
            ("gemm_ex", (0, 0, 2, 2, 2, 1.0, h[0], 3, h[1], 0.0, h[2], 0)),
            ("gemm_ex", (0, 0, 2, 2, 2, 1.0, h[0], 1, h[1], 0.0, h[2], 7)),
            ("gemm_ex", (0, 0, 2, 2, 2, 1.0, h[0], 1, h[1], 0.0, h[2], 2)),  # f16 inputs, a bf16 C
            ("gemm_ex", (0, 0, 2, 2, 2, 1.0, h[0], 0, h[1], 0.0, h[2], 1)),  # f32 inputs, an f16 C
            ("causal_mask_f32", (h[0], 2, 2, -1)),
        ]
        before = [get(s, x, 64).tobytes() for x in h]
        for name, args in cases:
            assert call(s, name, *args) == INVALID, (name, args)
        assert [get(s, x, 64).tobytes() for x in h] == before  # a refused call touches nothing


def test_extents_follow_each_ops_shape_and_dtype() -> None:
    with session() as (_, s):
        small = alloc_bytes(s, 4 * 6)  # 6 floats, or 12 halves
        big = put(s, np.ones(64))
        # strided batch: (batch - 1) * stride + size floats
        assert call(s, "gemm_strided_batched_f32", 0, 0, 1, 2, 1, 1.0, big, 0, big, 0, 0.0, small, 2, 3) == OK
        assert call(s, "gemm_strided_batched_f32", 0, 0, 1, 2, 1, 1.0, big, 0, big, 0, 0.0, small, 3, 3) == BUFFER_BOUNDS
        # cast extents are n * dtype bytes per side
        assert call(s, "cast", big, 0, small, 1, 12) == OK
        assert call(s, "cast", big, 0, small, 1, 13) == BUFFER_BOUNDS
        assert call(s, "cast", small, 1, big, 0, 12) == OK
        assert call(s, "cast", small, 2, big, 0, 13) == BUFFER_BOUNDS
        # gemm_ex: a f16 A of m * k halves
        assert call(s, "gemm_ex", 0, 0, 3, 1, 4, 1.0, small, 1, small, 0.0, big, 0) == OK
        assert call(s, "gemm_ex", 0, 0, 3, 1, 5, 1.0, small, 1, small, 0.0, big, 0) == BUFFER_BOUNDS
        # copy counts bytes: to the last byte and one past it
        assert call(s, "copy", big, 0, small, 20, 4) == OK
        assert call(s, "copy", big, 0, small, 21, 4) == BUFFER_BOUNDS
        assert call(s, "copy", big, 0, small, 0, 1 << 62) == BUFFER_BOUNDS
        assert call(s, "reduce_rows_f32", 0, big, 7, 9, small) == BUFFER_BOUNDS  # out: rows floats
        assert call(s, "layernorm_rows_f32", big, small, small, big, 2, 7, 0.0) == BUFFER_BOUNDS  # gamma: cols


def test_gather_checks_every_index_and_its_guest_range() -> None:
    with session() as (_, s):
        table = np.arange(12, dtype=np.float32).reshape(4, 3)
        ht = put(s, table, extra=2)  # 4 whole rows (and 2 floats that make no row)
        ho = put(s, np.full((3, 3), 7.0))
        mem = s.guest_memory()
        for bad in ([0, 4, 1], [0, -1, 1], [2, 2, 1 << 31 - 1]):
            mem[0:12] = np.int32(bad).tobytes()
            assert call(s, "gather_rows_f32", ht, 0, 3, 3, ho) == BUFFER_BOUNDS, bad
            np.testing.assert_array_equal(get(s, ho, 9), np.full(9, 7.0, np.float32))  # nothing written
        mem[0:12] = np.int32([3, 0, 3]).tobytes()
        assert call(s, "gather_rows_f32", ht, 0, 3, 3, ho) == OK
        np.testing.assert_array_equal(get(s, ho, 9).reshape(3, 3), table[[3, 0, 3]])
        size = len(mem)
        assert call(s, "gather_rows_f32", ht, size - 8, 3, 3, ho) == MEMORY_BOUNDS
        assert call(s, "gather_rows_f32", ht, -4, 1, 3, ho) == MEMORY_BOUNDS
        assert call(s, "gather_rows_f32", 99, 0, 1, 3, ho) == BAD_HANDLE
        assert call(s, "gather_rows_f32", ht, 0, 4, 3, ho) == BUFFER_BOUNDS  # out holds 3 rows
        assert call(s, "gather_rows_f32", ht, size, 0, 3, ho) == OK  # nothing to read


def test_empty_matrices_with_a_huge_batch_return_at_once() -> None:
    """m = 0 bounds no buffer, so batch may be anything: nothing is written and nothing loops over it."""
    with session() as (_, s):
        h = put(s, np.ones(64))
        for m, n in ((0, 5), (5, 0)):
            assert call(s, "gemm_strided_batched_f32", 0, 0, m, n, 3, 1.0, h, 0, h, 0, 0.0, put(s, [0.0]), 0,
                        1 << 62) == OK


def test_bad_handles_come_first_for_every_new_op() -> None:
    with session() as (_, s):
        for op in TENSOR_OPS:
            if op.name not in NEW_OPS:
                continue
            args = [999 if role == "buf" else (-1 if role == "dim" else 0) for role, _ in op.roles]
            assert call(s, op.name, *args) == BAD_HANDLE, op.name


_VALUE = {
    "buf": st.sampled_from([1, 2, 3, 0, -1, 1 << 40]),
    "dim": st.one_of(st.integers(-3, 40), st.sampled_from([1 << 31, 1 << 62, -(1 << 63), (1 << 63) - 1])),
    "op": st.integers(-2, 13) | st.sampled_from([-(1 << 31), (1 << 31) - 1]),
    "f32": st.floats(-4, 4, width=32) | st.sampled_from([float("nan"), float("inf")]),
    "ptr": st.integers(-8, 70_000) | st.sampled_from([-(1 << 31), (1 << 31) - 1]),
}


@pytest.mark.slow  # 600 generated calls: make test runs it, make test-fast not
def test_hostile_arguments_are_always_a_code_never_a_trap() -> None:
    with session() as (_, s):
        for _ in range(3):
            put(s, np.ones(256))  # handles 1..3: some calls reach the backend

        ops = [op for op in TENSOR_OPS if op.name in NEW_OPS]

        @given(data=st.data())
        @settings(max_examples=600, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
        def hostile(data: st.DataObject) -> None:
            op = data.draw(st.sampled_from(ops))
            args = [data.draw(_VALUE[role]) for role, _ in op.roles]
            got = call(s, op.name, *args)
            assert got in (OK, INVALID, BAD_HANDLE, BUFFER_BOUNDS, MEMORY_BOUNDS), (op.name, args, got)

        hostile()
