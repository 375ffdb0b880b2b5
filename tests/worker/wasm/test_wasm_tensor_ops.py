"""The tensor ops of the tensorwasm ABI (matmul, elementwise, softmax, reductions) on the stub backend.

In process, as in test_wasm_abi: a real TenantContext over a real shared-memory
QuotaBlock, driven through ``worker/guests/probe.wat``. Every op is compared
with numpy on random shapes (hypothesis); then the aliasing rules, the checks
at the edges (handles, negative and overflowing sizes, guest pointers), an MLP
guest end to end, a GPU-quota refusal in the middle of an MLP, and a guest
calling matmul in a loop stopped by its deadline.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.errors import BackendUnavailable, KernelTimeout
from worker.backends.stub import StubBackend
from worker.wasm import ErrorCode, WasmSession, guest_source
from worker.wasm.tensor_abi import TENSOR_OPS, UNARY_OPS
from tests.helpers.model_ops import ref_unary
from tests.helpers.wasm_env import MLP, PAGE, Env, call, make_env, mem, mlp_forward, mlp_inputs, probe, softmax

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
OK = ErrorCode.OK
INVALID = ErrorCode.INVALID
BAD_HANDLE = ErrorCode.BAD_HANDLE
BUFFER_BOUNDS = ErrorCode.BUFFER_BOUNDS
MEMORY_BOUNDS = ErrorCode.MEMORY_BOUNDS
#: the run time of a session that serves a whole hypothesis test (hundreds of examples)
SESSION_S = 3600.0


def put(s: WasmSession, values: Any, extra: int = 0) -> int:
    """A new run buffer holding ``values`` as float32 (plus ``extra`` spare floats)."""
    arr = np.ascontiguousarray(values, dtype=np.float32).ravel()
    h = call(s, "alloc", max(4, 4 * (arr.size + extra)))
    assert h > 0
    if arr.size:
        s.host.ctx.backend.write(s.run.buffers[h][0], 0, memoryview(arr.tobytes()))
    return h


def get(s: WasmSession, h: int, n: int | None = None) -> Any:
    buf = s.run.buffers[h][0]
    count = buf.nbytes // 4 if n is None else n
    return np.frombuffer(s.host.ctx.backend.read(buf, 0, 4 * count), dtype=np.float32).copy()


def sigmoid(x: Any) -> Any:
    with np.errstate(all="ignore"):
        return (np.float32(1) / (np.float32(1) + np.exp(-x))).astype(np.float32)


UNARY_REF: dict[str, Callable[[Any], Any]] = {
    "relu": lambda x: np.maximum(x, np.float32(0)),
    "exp": np.exp,
    "tanh": np.tanh,
    "sigmoid": sigmoid,
    "neg": np.negative,
    "sqrt": np.sqrt,
    "abs": np.abs,
    **{name: (lambda x, name=name: ref_unary(name, x)) for name in ("log", "gelu", "silu", "rsqrt", "recip")},
}


@pytest.fixture
def env() -> Iterator[Env]:
    with make_env(True) as e:
        yield e


def close(got: Any, ref: Any, rtol: float = 2e-6, atol: float = 1e-6) -> None:
    np.testing.assert_allclose(got, np.asarray(ref, dtype=np.float32), rtol=rtol, atol=atol, equal_nan=True)


# ------------------------------------------------------------------ every op against numpy

dims = st.integers(0, 9)
floats = st.floats(-4, 4, width=32, allow_nan=False)


@contextmanager
def session(fast: bool = True) -> Iterator[tuple[Env, WasmSession]]:
    """One session for every example of a test: its run's deadline must outlast them all on a loaded
    host (past it every device op is refused: the test's timeout bounds it instead)."""
    with make_env(fast, gpu_cap=None) as env, probe(env, timeout_s=SESSION_S) as s:
        yield env, s


def test_the_table_is_the_import_list() -> None:
    from worker.wasm.abi import HANDLERS, IMPORTS

    for op in TENSOR_OPS:
        assert op.name in IMPORTS and op.name in HANDLERS
        assert IMPORTS[op.name] == op.wasm_type
    assert set(HANDLERS) == set(IMPORTS)


@pytest.mark.parametrize("fast", [True, False], ids=["unchecked", "checked"])
def test_ops_match_numpy_on_random_shapes(fast: bool) -> None:
    with session(fast) as (_, s):

        @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
        @given(m=dims, k=dims, n=dims, seed=st.integers(0, 2**32 - 1))
        def matmul(m: int, k: int, n: int, seed: int) -> None:
            r = np.random.default_rng(seed)
            a = r.standard_normal((m, k), dtype=np.float32)
            b = r.standard_normal((k, n), dtype=np.float32)
            ha, hb, hc = put(s, a), put(s, b), put(s, np.full(m * n, 7.0), extra=3)
            assert call(s, "matmul_f32", ha, hb, hc, m, k, n) == OK
            got = get(s, hc)
            close(got[: m * n].reshape(m, n), a @ b, rtol=1e-5, atol=1e-5)
            assert (got[m * n :] == 0).all()  # nothing past C is touched
            for h in (ha, hb, hc):
                assert call(s, "free", h) == OK

        @given(n=st.integers(0, 300), which=st.sampled_from(["add_f32", "mul_f32"]),
               alias=st.sampled_from(["none", "x", "y"]), seed=st.integers(0, 2**32 - 1))
        @settings(max_examples=60, deadline=None, derandomize=True)
        def binary(n: int, which: str, alias: str, seed: int) -> None:
            r = np.random.default_rng(seed)
            x, y = r.standard_normal(n, dtype=np.float32), r.standard_normal(n, dtype=np.float32)
            hx, hy = put(s, x), put(s, y)
            ho = {"x": hx, "y": hy}.get(alias) or put(s, np.zeros(n))
            assert call(s, which, hx, hy, ho, n) == OK
            ref = x + y if which == "add_f32" else x * y
            close(get(s, ho, n), ref, rtol=0, atol=0)
            for h in {hx, hy, ho}:
                assert call(s, "free", h) == OK

        @given(rows=dims, cols=dims, seed=st.integers(0, 2**32 - 1))
        @settings(max_examples=40, deadline=None, derandomize=True)
        def rowwise(rows: int, cols: int, seed: int) -> None:
            r = np.random.default_rng(seed)
            x = (r.standard_normal((rows, cols), dtype=np.float32) * 20).astype(np.float32)
            v = r.standard_normal(cols, dtype=np.float32)
            hm, hv = put(s, x), put(s, v)
            assert call(s, "add_rows_f32", hm, hv, rows, cols) == OK
            close(get(s, hm, rows * cols).reshape(rows, cols), x + v, rtol=0, atol=0)
            hs = put(s, x)
            assert call(s, "softmax_rows_f32", hs, rows, cols) == OK
            sm = get(s, hs, rows * cols).reshape(rows, cols)
            if rows and cols:
                close(sm, softmax(x), rtol=1e-5, atol=1e-7)
                close(sm.sum(axis=1), np.ones(rows), rtol=1e-5)
            ht, hout = put(s, x), put(s, np.zeros(rows * cols))
            assert call(s, "transpose_f32", ht, hout, rows, cols) == OK
            close(get(s, hout, rows * cols).reshape(cols, rows), x.T, rtol=0, atol=0)
            if rows and cols:
                assert call(s, "argmax_rows_f32", ht, rows, cols, 64) == OK
                got = np.frombuffer(mem(s)[64 : 64 + 4 * rows], dtype="<i4")
                np.testing.assert_array_equal(got, x.argmax(axis=1))
                assert call(s, "max_f32", ht, rows * cols, 8) == OK
                assert s.call("load_f32", [8]) == [float(x.max())]
            for h in (hm, hv, hs, ht, hout):
                assert call(s, "free", h) == OK

        @given(n=st.integers(0, 200), op=st.sampled_from(UNARY_OPS), inplace=st.booleans(),
               a=floats, seed=st.integers(0, 2**32 - 1))
        @settings(max_examples=80, deadline=None, derandomize=True)
        def elementwise(n: int, op: str, inplace: bool, a: float, seed: int) -> None:
            r = np.random.default_rng(seed)
            x = (r.standard_normal(n, dtype=np.float32) * 30).astype(np.float32)
            hx = put(s, x)
            ho = hx if inplace else put(s, np.zeros(n))
            assert call(s, "unary_f32", UNARY_OPS.index(op), hx, ho, n) == OK
            with np.errstate(all="ignore"):
                ref = UNARY_REF[op](x)
            close(get(s, ho, n), ref, rtol=2e-6, atol=1e-30)
            hy = put(s, x)
            assert call(s, "scale_f32", hy, a, n) == OK
            close(get(s, hy, n), x * np.float32(a), rtol=0, atol=0)
            for h in {hx, ho, hy}:
                assert call(s, "free", h) == OK

        matmul()
        binary()
        rowwise()
        elementwise()


def test_special_values_follow_numpy(env: Env) -> None:
    """NaN and infinities: max and argmax let a NaN win, softmax of an all -inf row is NaN, relu keeps NaN."""
    with probe(env) as s:
        x = np.array([1.0, np.nan, 3.0, 3.0, -np.inf, np.inf], dtype=np.float32)
        hx = put(s, x)
        assert call(s, "max_f32", hx, 6, 0) == OK
        assert np.isnan(s.call("load_f32", [0])[0])
        assert call(s, "max_f32", hx, 1, 0) == OK and s.call("load_f32", [0]) == [1.0]
        rows = np.array([[1, 5, 5], [np.nan, 9, np.nan], [-np.inf, -np.inf, -np.inf], [2, np.inf, 1]], np.float32)
        hr = put(s, rows)
        assert call(s, "argmax_rows_f32", hr, 4, 3, 100) == OK
        assert list(np.frombuffer(mem(s)[100:116], dtype="<i4")) == list(rows.argmax(axis=1)) == [1, 0, 0, 1]
        assert call(s, "softmax_rows_f32", hr, 4, 3) == OK
        close(get(s, hr, 12).reshape(4, 3), softmax(rows))
        assert call(s, "unary_f32", 0, hx, hx, 6) == OK
        close(get(s, hx, 6), [1, np.nan, 3, 3, 0, np.inf])


# ------------------------------------------------------------------ aliasing


def test_aliasing_rules(env: Env) -> None:
    with probe(env) as s:
        a = np.arange(16, dtype=np.float32).reshape(4, 4)
        ha, hb = put(s, a), put(s, np.eye(4))
        before = get(s, ha)
        assert call(s, "matmul_f32", ha, hb, ha, 4, 4, 4) == INVALID  # c is a
        assert call(s, "matmul_f32", ha, hb, hb, 4, 4, 4) == INVALID  # c is b
        assert call(s, "transpose_f32", ha, ha, 4, 4) == INVALID
        assert call(s, "add_rows_f32", ha, ha, 4, 4) == INVALID
        assert (get(s, ha) == before).all()
        # a and b may be the same buffer (A @ A), and out may be an input elsewhere
        hc = put(s, np.zeros(16))
        assert call(s, "matmul_f32", ha, ha, hc, 4, 4, 4) == OK
        close(get(s, hc).reshape(4, 4), a @ a)
        assert call(s, "add_f32", ha, ha, ha, 16) == OK
        close(get(s, ha), 2 * a.ravel())
        assert call(s, "mul_f32", hc, ha, ha, 16) == OK
        close(get(s, ha), (a @ a).ravel() * 2 * a.ravel())
        assert call(s, "unary_f32", 4, hc, hc, 16) == OK
        close(get(s, hc), -(a @ a).ravel())


def test_aliasing_is_decided_on_buffers_not_handles() -> None:
    """One client buffer passed as two arguments has two handles and is still one buffer."""
    with make_env(True) as env:
        alloc = env.ctx.allocator
        h = alloc.alloc(64)
        alloc_b = alloc.alloc(64)
        try:
            reply = env.host.run(ALIAS_GUEST, "run", [{"handle": h}, {"handle": alloc_b}, {"handle": h}],
                                 fuel=10**6, timeout_s=5)
        finally:
            alloc.free(h)
            alloc.free(alloc_b)
        assert reply["results"] == [int(INVALID), int(INVALID)]


ALIAS_GUEST = b"""(module
  (import "tensorwasm" "matmul_f32" (func $mm (param i64 i64 i64 i64 i64 i64) (result i32)))
  (import "tensorwasm" "transpose_f32" (func $t (param i64 i64 i64 i64) (result i32)))
  (func (export "run") (param $a i64) (param $b i64) (param $c i64) (result i32 i32)
    (call $mm (local.get $a) (local.get $b) (local.get $c) (i64.const 4) (i64.const 4) (i64.const 4))
    (call $t (local.get $a) (local.get $c) (i64.const 4) (i64.const 4))))
"""


# ------------------------------------------------------------------ checks at the edges

BIG = 1 << 62


def test_bad_handles_come_first(env: Env) -> None:
    with probe(env) as s:
        h = put(s, np.zeros(4))
        for name, args in [
            ("matmul_f32", (99, h, h, -1, 1, 1)), ("matmul_f32", (h, 0, h, 1, 1, 1)), ("matmul_f32", (h, h, -7, 1, 1, 1)),
            ("add_f32", (h, h, 99, -1)), ("mul_f32", (99, h, h, 1)), ("add_rows_f32", (h, I64_MAX, 1, 1)),
            ("unary_f32", (99, 99, h, 1)), ("scale_f32", (I64_MIN, 1.0, 1)), ("softmax_rows_f32", (5, 1, 1)),
            ("max_f32", (0, 0, -1)), ("argmax_rows_f32", (2, 1, 0, -1)), ("transpose_f32", (h, 3, 1, 1)),
        ]:
            assert call(s, name, *args) == BAD_HANDLE, (name, args)


@pytest.mark.parametrize("name,args", [
    ("matmul_f32", ("a", "b", "c", -1, 1, 1)), ("matmul_f32", ("a", "b", "c", 1, I64_MIN, 1)),
    ("matmul_f32", ("a", "b", "c", -BIG, -BIG, 1)),  # two negatives whose product is positive
    ("add_f32", ("a", "b", "c", -1)), ("mul_f32", ("a", "b", "c", I64_MIN)),
    ("add_rows_f32", ("a", "b", -1, 2)), ("add_rows_f32", ("a", "b", -2, -2)),
    ("unary_f32", (12, "a", "b", 1)), ("unary_f32", (-1, "a", "b", 1)), ("unary_f32", (I32_MAX, "a", "a", 1)),
    ("unary_f32", (0, "a", "b", -1)),
    ("scale_f32", ("a", 2.0, -1)), ("softmax_rows_f32", ("a", 1, -1)),
    ("max_f32", ("a", 0, 0)), ("max_f32", ("a", -1, 0)),
    ("argmax_rows_f32", ("a", 1, 0, 0)), ("argmax_rows_f32", ("a", -1, 1, 0)),
    ("transpose_f32", ("a", "b", -3, -3)),
])
def test_domain_errors_are_invalid(env: Env, name: str, args: tuple[Any, ...]) -> None:
    with probe(env) as s:
        hs = {"a": put(s, np.ones(16)), "b": put(s, np.ones(16)), "c": put(s, np.ones(16))}
        before = mem(s), [get(s, h).tobytes() for h in hs.values()]
        real = [hs.get(a, a) if isinstance(a, str) else a for a in args]
        assert call(s, name, *real) == INVALID
        assert (mem(s), [get(s, h).tobytes() for h in hs.values()]) == before


@pytest.mark.parametrize("name,args", [
    ("matmul_f32", ("a", "b", "c", 4, 4, 5)), ("matmul_f32", ("a", "b", "c", 5, 4, 4)),
    ("matmul_f32", ("a", "b", "c", 4, 5, 4)), ("matmul_f32", ("a", "b", "c", BIG, BIG, BIG)),
    ("matmul_f32", ("a", "b", "c", I64_MAX, 0, 1)), ("matmul_f32", ("a", "b", "c", 1, I64_MAX, 0)),
    ("matmul_f32", ("a", "b", "small", 4, 4, 4)),
    ("add_f32", ("a", "b", "small", 16)), ("add_f32", ("a", "b", "c", 17)), ("mul_f32", ("a", "b", "c", I64_MAX)),
    ("add_rows_f32", ("a", "small", 1, 9)), ("add_rows_f32", ("a", "b", 2, 9)),
    ("add_rows_f32", ("a", "b", BIG, BIG)), ("add_rows_f32", ("a", "b", I64_MAX, 0 + 1)),
    ("unary_f32", (1, "a", "small", 16)), ("unary_f32", (1, "a", "a", 17)),
    ("scale_f32", ("a", 2.0, 17)), ("softmax_rows_f32", ("a", 4, 5)), ("softmax_rows_f32", ("a", BIG, 4)),
    ("max_f32", ("a", 17, 0)), ("argmax_rows_f32", ("a", 17, 1, 0)), ("argmax_rows_f32", ("a", BIG, BIG, 0)),
    ("transpose_f32", ("a", "small", 4, 4)), ("transpose_f32", ("a", "b", 3, 6)),
    ("transpose_f32", ("a", "b", I64_MAX, I64_MAX)),
])
def test_buffer_ranges_are_checked_with_unbounded_arithmetic(env: Env, name: str, args: tuple[Any, ...]) -> None:
    with probe(env) as s:
        hs = {"a": put(s, np.ones(16)), "b": put(s, np.ones(16)), "c": put(s, np.ones(16)), "small": put(s, np.ones(8))}
        before = mem(s), [get(s, h).tobytes() for h in hs.values()]
        real = [hs.get(a, a) if isinstance(a, str) else a for a in args]
        assert call(s, name, *real) == BUFFER_BOUNDS
        assert (mem(s), [get(s, h).tobytes() for h in hs.values()]) == before


def test_exact_fits_succeed(env: Env) -> None:
    """At the edge: a buffer of exactly the needed bytes, the last bytes of guest memory."""
    with probe(env) as s:
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        ha, hb, hc = put(s, a), put(s, np.ones((4, 2))), put(s, np.zeros(6))
        assert call(s, "matmul_f32", ha, hb, hc, 3, 4, 2) == OK
        close(get(s, hc).reshape(3, 2), a @ np.ones((4, 2), np.float32))
        assert call(s, "max_f32", ha, 12, PAGE - 4) == OK
        assert s.call("load_f32", [PAGE - 4]) == [11.0]
        assert call(s, "argmax_rows_f32", ha, 3, 4, PAGE - 12) == OK
        assert list(np.frombuffer(mem(s)[PAGE - 12 :], dtype="<i4")) == [3, 3, 3]
        # zero-sized work is fine and touches nothing
        for name, args in [("matmul_f32", (ha, hb, hc, 0, 4, 2)), ("matmul_f32", (ha, hb, hc, 3, 0, 0)),
                           ("argmax_rows_f32", (ha, 0, 0, PAGE)), ("softmax_rows_f32", (ha, 0, 9)),
                           ("softmax_rows_f32", (ha, 9, 0)), ("transpose_f32", (ha, hc, 0, 0))]:
            assert call(s, name, *args) == OK
        # k = 0: C = zeros
        assert call(s, "matmul_f32", ha, hb, hc, 3, 0, 2) == OK
        assert (get(s, hc) == 0).all()


def test_guest_pointers_are_checked(env: Env) -> None:
    with probe(env) as s:
        h = put(s, np.arange(16))
        s.guest_memory()[:] = b"\x5a" * PAGE
        before = mem(s)
        for name, args in [
            ("max_f32", (h, 16, -1)), ("max_f32", (h, 16, PAGE - 3)), ("max_f32", (h, 16, I32_MIN)),
            ("argmax_rows_f32", (h, 4, 4, PAGE - 15)), ("argmax_rows_f32", (h, 16, 1, -4)),
            ("argmax_rows_f32", (h, 16, 1, PAGE - 63)),
        ]:
            assert call(s, name, *args) == MEMORY_BOUNDS, (name, args)
        assert mem(s) == before
        # the memory grows: a pointer that was out of bounds is now in
        assert s.call("grow", [1]) == [1]
        assert call(s, "max_f32", h, 16, PAGE) == OK
        assert s.call("load_f32", [PAGE]) == [15.0]


def test_pointer_ops_without_memory_are_no_memory(env: Env) -> None:
    guest = b"""(module
      (import "tensorwasm" "alloc" (func $alloc (param i64) (result i64)))
      (import "tensorwasm" "max_f32" (func $max (param i64 i64 i32) (result i32)))
      (import "tensorwasm" "argmax_rows_f32" (func $am (param i64 i64 i64 i32) (result i32)))
      (func (export "run") (result i32 i32) (local $h i64)
        (local.set $h (call $alloc (i64.const 64)))
        (call $max (local.get $h) (i64.const 4) (i32.const 0))
        (call $am (local.get $h) (i64.const 2) (i64.const 2) (i32.const 0))))"""
    reply = env.host.run(guest, "run", [], fuel=10**6, timeout_s=5)
    assert reply["results"] == [int(ErrorCode.NO_MEMORY)] * 2


def test_a_deadline_that_passed_in_a_device_op_makes_the_call_a_timeout(env: Env) -> None:
    """On a loaded host the epoch ticker runs late: the run's deadline can pass while the guest still
    runs, and its next device op is refused (the guest sees BACKEND, as for any failed op). The call
    is then the deadline's ``KernelTimeout``, never a result built on that code, and so is every
    later call of the run; an op refused for no deadline stays a plain BACKEND code (next test)."""
    with probe(env, timeout_s=SESSION_S) as s:
        h = call(s, "alloc", 64)
        assert call(s, "fill_f32", h, 1.0, 16) == OK
        timeouts = env.host.stats["timeouts"]
        s.run.deadline_ns = time.monotonic_ns() - 1  # the deadline passed; the ticker has not caught up
        with pytest.raises(KernelTimeout):
            call(s, "fill_f32", h, 2.0, 16)
        with pytest.raises(KernelTimeout):
            call(s, "add_rows_f32", h, h, 0, 0)
        assert env.host.stats["timeouts"] == timeouts + 2


def test_a_backend_failure_is_a_backend_code(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable(*args: object, **kwargs: object) -> None:
        raise BackendUnavailable("cuda", "cuBLAS missing: install tensor-wasm-tenant[cuda]")

    with probe(env) as s:
        h = put(s, np.ones(4))
        hc = put(s, np.ones(4))
        monkeypatch.setattr(env.ctx.backend, "matmul_f32", unavailable)
        monkeypatch.setattr(env.ctx.backend, "sum_f32", unavailable)
        # a synchronous op (its result goes to guest memory) returns the code at once
        assert call(s, "sum_f32", h, 4, 0) == ErrorCode.BACKEND
        # a queued one returns OK; its error is the code of the next synchronising call (one guest
        # call here: tests/worker/test_async_ops.py), or logged at the call's end
        assert call(s, "matmul_f32", h, h, hc, 2, 2, 2) == ErrorCode.OK
        assert call(s, "add", 1, 2) == 3  # the run goes on


# ------------------------------------------------------------------ an MLP guest


def mlp_reference(p: dict[str, Any]) -> Any:
    h = np.maximum(p["x"] @ p["w1"] + p["b1"], 0)
    return softmax(h @ p["w2"] + p["b2"])


def test_the_mlp_guest_matches_numpy() -> None:
    batch, d_in, hidden, d_out = 64, 32, 48, 10
    p = mlp_inputs(batch, d_in, hidden, d_out)
    with make_env(True, gpu_cap=None) as env, mlp_forward(env.host, p, batch, d_in, hidden, d_out) as mlp:
        assert mlp.reply["results"] == [0]
        assert mlp.reply["gpu_peak_bytes"] == 4 * batch * hidden
        ref = mlp_reference(p)
        close(mlp.out, ref, rtol=1e-5, atol=1e-6)
        classes = env.host.run(MLP, "classes", [mlp.args[-1], batch, d_out], fuel=10**7, timeout_s=10)
        assert classes["results"] == [int(ref.argmax(axis=1).sum())]


def test_a_gpu_quota_refusal_in_the_middle_of_an_mlp() -> None:
    """Layer 1 done, the logits buffer refused by the cap: GPU_QUOTA, nothing else touched, the run goes on."""
    batch, d_in, hidden, d_out = 16, 8, 64, 4
    p = mlp_inputs(batch, d_in, hidden, d_out)
    weights = sum(a.nbytes for a in p.values())
    h_bytes, z_bytes = 4 * batch * hidden, 4 * batch * d_out
    cap = weights + h_bytes + z_bytes - 4  # everything but the last 4 bytes of the logits fits
    with make_env(True, gpu_cap=cap) as env, probe(env) as s:
        hs = {name: put(s, arr) for name, arr in p.items()}
        hh = call(s, "alloc", h_bytes)
        assert hh > 0
        assert call(s, "matmul_f32", hs["x"], hs["w1"], hh, batch, d_in, hidden) == OK
        assert call(s, "add_rows_f32", hh, hs["b1"], batch, hidden) == OK
        assert call(s, "unary_f32", 0, hh, hh, batch * hidden) == OK
        h = get(s, hh)
        in_use = env.block.gpu_bytes_in_use
        assert call(s, "alloc", z_bytes) == ErrorCode.GPU_QUOTA  # in the middle of the MLP
        assert env.block.gpu_bytes_in_use == in_use  # nothing was allocated
        assert (get(s, hh) == h).all()
        close(h.reshape(batch, hidden), np.maximum(p["x"] @ p["w1"] + p["b1"], 0), rtol=1e-5, atol=1e-6)
        # the guest can recover: drop the input, then the logits fit and the forward pass completes
        assert call(s, "free", hs["x"]) == OK
        hz = call(s, "alloc", z_bytes)
        assert hz > 0
        assert call(s, "matmul_f32", hh, hs["w2"], hz, batch, hidden, d_out) == OK
        assert call(s, "add_rows_f32", hz, hs["b2"], batch, d_out) == OK
        assert call(s, "softmax_rows_f32", hz, batch, d_out) == OK
        close(get(s, hz).reshape(batch, d_out), mlp_reference(p), rtol=1e-5, atol=1e-6)
    # make_env checks that every byte went back to the quota


def test_the_mlp_guest_reports_the_refused_hidden_buffer() -> None:
    batch, d_in, hidden, d_out = 8, 4, 4096, 2
    p = mlp_inputs(batch, d_in, hidden, d_out)
    with make_env(True, gpu_cap=1 * MiB) as env:
        alloc = env.ctx.allocator
        handles = [alloc.alloc(max(4, a.nbytes)) for a in p.values()] + [alloc.alloc(4 * batch * d_out)]
        try:
            # 8 x 4096 floats = 128 KiB fits; a batch of 64 (1 MiB) does not
            ok = env.host.run(guest_source("mlp"), "forward", [*({"handle": h} for h in handles), batch, d_in,
                                                               hidden, d_out], fuel=10**7, timeout_s=10)
            refused = env.host.run(guest_source("mlp"), "forward", [*({"handle": h} for h in handles), 64, 0,
                                                                    hidden, 0], fuel=10**7, timeout_s=10)
        finally:
            for h in handles:
                alloc.free(h)
    assert ok["results"] == [0]
    assert refused["results"] == [int(ErrorCode.GPU_QUOTA)]


# ------------------------------------------------------------------ deadlines

MATMUL_LOOP = b"""(module
  (import "tensorwasm" "alloc" (func $alloc (param i64) (result i64)))
  (import "tensorwasm" "matmul_f32" (func $mm (param i64 i64 i64 i64 i64 i64) (result i32)))
  (func (export "run") (param $n i64) (result i32) (local $a i64) (local $c i64)
    (local.set $a (call $alloc (i64.mul (i64.mul (local.get $n) (local.get $n)) (i64.const 4))))
    (local.set $c (call $alloc (i64.mul (i64.mul (local.get $n) (local.get $n)) (i64.const 4))))
    (loop $forever
      (drop (call $mm (local.get $a) (local.get $a) (local.get $c) (local.get $n) (local.get $n) (local.get $n)))
      (br $forever))
    (i32.const 0)))
"""


def test_a_guest_calling_matmul_in_a_loop_is_stopped_by_its_deadline() -> None:
    with make_env(True, gpu_cap=None) as env:
        # compiled first, with no deadline: the run's 0.3 s would cover a compile too (a CompileOverrun is a
        # KernelTimeout as well, and would prove nothing about the matmul loop)
        env.host.compile(MATMUL_LOOP)
        compiles = env.host.stats["compiles"]
        with pytest.raises(KernelTimeout):
            env.host.run(MATMUL_LOOP, "run", [64], fuel=10**15, timeout_s=0.3)
        assert env.host.stats["compiles"] == compiles
        assert env.block.gpu_bytes_in_use == 0  # both buffers went with the run
        # the worker's host serves the next run
        assert env.host.run(guest_source("mlp"), "classes", [0, 0, 1], fuel=10**6, timeout_s=60)["results"] == [
            int(BAD_HANDLE)]


# ------------------------------------------------------------------ the stub backend directly


def test_stub_matmul_writes_into_c_without_a_copy() -> None:
    backend = StubBackend()
    a, b, c = backend.alloc(4 * 6), backend.alloc(4 * 6), backend.alloc(4 * 4)
    backend.write(a, 0, memoryview(struct.pack("<6f", 1, 2, 3, 4, 5, 6)))
    backend.write(b, 0, memoryview(struct.pack("<6f", 1, 0, 0, 1, 1, 1)))
    backing = c.data  # type: ignore[attr-defined]
    backend.matmul_f32(a, b, c, 2, 3, 2)
    assert c.data is backing  # type: ignore[attr-defined]
    assert struct.unpack("<4f", backend.read(c, 0, 16)) == (4, 5, 10, 11)
    assert backend.gemm_workspace_bytes() == 0

