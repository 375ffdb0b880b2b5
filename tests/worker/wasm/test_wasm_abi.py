"""The tensorwasm imports, one by one, with valid and hostile arguments.

In process: a real TenantContext over a real shared-memory QuotaBlock and the
stub backend, driven through ``worker/guests/probe.wat`` (which re-exports
every import), on both import paths (wasmtime's unchecked ABI and the public
``Linker.define_func`` fallback). Every hostile call must return its error
code, touch no byte of guest memory or buffer outside what it may, and let
the run go on.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.errors import CudaError
from shared.log import TextFormatter
from tests.helpers.wasm_env import PROBE, Env, buffer_bytes, call, make_env, mem, poke, probe
from worker.wasm import ErrorCode, abi

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
PAGE = 65536
I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
MEM_PATTERN = bytes((i * 7) & 0xFF for i in range(PAGE))
BUF_PATTERN = bytes((i * 13 + 5) & 0xFF for i in range(256))


@pytest.fixture(params=[True, False], ids=["unchecked", "checked"])
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    with make_env(request.param) as e:
        yield e


# ------------------------------------------------------------------ alloc / free


def test_alloc_and_free_meter_the_gpu_quota(env: Env) -> None:
    with probe(env) as s:
        h1 = call(s, "alloc", 1000)
        h2 = call(s, "alloc", 24)
        assert (h1, h2) == (1, 2)
        assert env.block.gpu_bytes_in_use == 1024
        assert env.block.instance_share(0)[1] == 1024
        assert buffer_bytes(s, h1) == bytes(1000)  # stub buffers start zeroed
        assert call(s, "free", h1) == ErrorCode.OK
        assert env.block.gpu_bytes_in_use == 24
        assert call(s, "free", h1) == ErrorCode.BAD_HANDLE  # double free
        assert call(s, "alloc", 8) == 3  # handles are never reused within a run
        assert s.run.gpu_peak_bytes == 1024
    assert env.block.gpu_bytes_in_use == 0  # h2 and h3 went with the run


@pytest.mark.parametrize("nbytes", [0, -1, I64_MIN])
def test_alloc_of_a_bad_size_is_invalid(env: Env, nbytes: int) -> None:
    with probe(env) as s:
        assert call(s, "alloc", nbytes) == ErrorCode.INVALID
        assert env.block.gpu_bytes_in_use == 0


@pytest.mark.parametrize("nbytes", [MiB + 1, 1 << 40, I64_MAX])
def test_alloc_past_the_gpu_cap_is_refused_without_allocating(env: Env, nbytes: int) -> None:
    with probe(env) as s:
        assert call(s, "alloc", nbytes) == ErrorCode.GPU_QUOTA
        assert env.block.gpu_bytes_in_use == 0
        assert env.ctx.backend.info()["in_use_bytes"] == 0
        assert env.block.snapshot().gpu_refusals == 1
        h = call(s, "alloc", MiB)  # exactly the cap fits
        assert h > 0
        assert call(s, "alloc", 1) == ErrorCode.GPU_QUOTA
        assert call(s, "free", h) == 0
        assert call(s, "alloc", 1) > 0


def test_device_out_of_memory_is_its_own_code() -> None:
    with make_env(True, gpu_cap=None, capacity=4096) as env, probe(env) as s:
        assert call(s, "alloc", 4096) > 0
        assert call(s, "alloc", 1) == ErrorCode.DEVICE_OOM
        assert env.block.gpu_bytes_in_use == 4096  # the refused byte was rolled back
    with make_env(True) as env, probe(env) as s:
        env.ctx.faults.apply("oom", {"count": 1})  # an injected driver OOM under the cap
        assert call(s, "alloc", 100) == ErrorCode.DEVICE_OOM
        assert env.block.gpu_bytes_in_use == 0
        assert call(s, "alloc", 100) > 0


def test_too_many_live_buffers(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(abi, "MAX_LIVE_HANDLES", 3)
    with probe(env) as s:
        handles = [call(s, "alloc", 8) for _ in range(3)]
        assert call(s, "alloc", 8) == ErrorCode.TOO_MANY_HANDLES
        assert call(s, "free", handles[0]) == 0
        assert call(s, "alloc", 8) == 4


@pytest.mark.parametrize("handle", [0, -1, 5, 1 << 40, I64_MIN, I64_MAX])
def test_free_of_an_unknown_handle(env: Env, handle: int) -> None:
    with probe(env) as s:
        assert call(s, "alloc", 8) == 1
        assert call(s, "free", handle) == ErrorCode.BAD_HANDLE
        assert env.block.gpu_bytes_in_use == 8


def test_client_buffers_are_usable_but_not_freed(env: Env) -> None:
    client = env.ctx.allocator.alloc(64)
    env.ctx.allocator.write(client, 0, memoryview(struct.pack("<4f", 1, 2, 3, 4)))
    with env.host.session(PROBE, fuel=10**9, timeout_s=10) as s:
        (rc,) = s.call("free", [{"handle": client}])  # the guest sees it as handle 1
        assert rc == ErrorCode.NOT_OWNED
        assert s.run.buffers[1][1] is False
        assert call(s, "sum_f32", 1, 4, 0) == 0
        assert s.call("load_f32", [0]) == [10.0]
        assert call(s, "fill_f32", 1, 0.5, 16) == 0
    assert env.ctx.allocator.handles() == {client: 64}  # survives the run
    assert env.block.gpu_bytes_in_use == 64
    assert struct.unpack("<4f", env.ctx.allocator.read(client, 0, 16)) == (0.5,) * 4
    env.ctx.allocator.free(client)


# ------------------------------------------------------------------ write / read


def test_write_and_read_round_trip(env: Env) -> None:
    with probe(env) as s:
        h = call(s, "alloc", 256)
        payload = bytes(range(200))
        poke(s, 100, payload)
        assert call(s, "write", h, 10, 100, 200) == 0
        assert buffer_bytes(s, h) == bytes(10) + payload + bytes(46)
        assert call(s, "read", h, 10, 5000, 200) == 0
        assert mem(s)[5000:5200] == payload
        # empty copies are fine, even at the very end of memory
        assert call(s, "write", h, 256, PAGE, 0) == 0
        assert call(s, "read", h, 0, PAGE, 0) == 0
        # the last bytes of memory and of the buffer are usable
        poke(s, PAGE - 4, b"\xAA\xBB\xCC\xDD")
        assert call(s, "write", h, 252, PAGE - 4, 4) == 0
        assert buffer_bytes(s, h)[252:] == b"\xAA\xBB\xCC\xDD"


def test_memory_that_grew_is_usable(env: Env) -> None:
    with probe(env) as s:
        h = call(s, "alloc", 16)
        assert call(s, "read", h, 0, PAGE + 8, 16) == ErrorCode.MEMORY_BOUNDS
        assert s.call("grow", [1]) == [1]
        assert call(s, "fill_f32", h, 2.0, 4) == 0
        assert call(s, "read", h, 0, PAGE + 8, 16) == 0
        assert mem(s)[PAGE + 8 : PAGE + 24] == struct.pack("<4f", 2, 2, 2, 2)
        assert s.call("grow", [3]) == [-1]  # the probe declares at most 4 pages


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize(
    ("offset", "ptr", "length", "code"),
    [
        (0, -1, 4, ErrorCode.MEMORY_BOUNDS),  # 0xFFFFFFFF
        (0, I32_MIN, 4, ErrorCode.MEMORY_BOUNDS),  # 0x80000000
        (0, I32_MAX, 1, ErrorCode.MEMORY_BOUNDS),
        (0, PAGE - 3, 4, ErrorCode.MEMORY_BOUNDS),  # straddles the end of memory
        (0, PAGE, 1, ErrorCode.MEMORY_BOUNDS),
        (0, 0, -1, ErrorCode.BUFFER_BOUNDS),  # 4 GiB - 1 bytes: past the 256-byte buffer first
        (0, 0, 257, ErrorCode.BUFFER_BOUNDS),
        (-1, 0, 4, ErrorCode.BUFFER_BOUNDS),
        (253, 0, 4, ErrorCode.BUFFER_BOUNDS),
        (256, 0, 1, ErrorCode.BUFFER_BOUNDS),
        (I64_MAX, 0, 1, ErrorCode.BUFFER_BOUNDS),
        (I64_MIN, 0, 1, ErrorCode.BUFFER_BOUNDS),
    ],
)
def test_hostile_copies_touch_nothing(env: Env, op: str, offset: int, ptr: int, length: int, code: int) -> None:
    with probe(env) as s:
        h = call(s, "alloc", 256)
        poke(s, 0, bytes(range(256)) * 256)
        assert call(s, "fill_f32", h, 7.0, 64) == 0
        before_mem, before_buf = mem(s), buffer_bytes(s, h)
        assert call(s, op, h, offset, ptr, length) == code
        assert mem(s) == before_mem
        assert buffer_bytes(s, h) == before_buf
        assert call(s, "add", 2, 3) == 5  # the run goes on


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("handle", [0, 2, -1, I64_MAX])
def test_copies_with_a_bad_handle(env: Env, op: str, handle: int) -> None:
    with probe(env) as s:
        h = call(s, "alloc", 16)
        assert call(s, op, handle, 0, 0, 4) == ErrorCode.BAD_HANDLE
        assert call(s, "free", h) == 0
        assert call(s, op, h, 0, 0, 4) == ErrorCode.BAD_HANDLE  # freed


def test_read_writes_exactly_its_range(env: Env) -> None:
    with probe(env) as s:
        h = call(s, "alloc", 64)
        assert call(s, "fill_f32", h, -1.0, 16) == 0
        poke(s, 0, b"\x11" * 4096)
        assert call(s, "read", h, 4, 1001, 13) == 0
        after = mem(s)
        assert after[1001:1014] == struct.pack("<16f", *([-1.0] * 16))[4:17]
        assert after[:1001] == b"\x11" * 1001 and after[1014:4096] == b"\x11" * (4096 - 1014)


# ------------------------------------------------------------------ tensor ops


def test_fill_f32(env: Env) -> None:
    with probe(env) as s:
        h = call(s, "alloc", 40)
        assert call(s, "fill_f32", h, 1.5, 10) == 0
        assert buffer_bytes(s, h) == struct.pack("<10f", *([1.5] * 10))
        assert call(s, "fill_f32", h, 9.0, 0) == 0
        assert call(s, "fill_f32", h, 2.0, 3) == 0
        assert buffer_bytes(s, h)[:16] == struct.pack("<4f", 2, 2, 2, 1.5)
        for count, code in [(-1, ErrorCode.INVALID), (I64_MIN, ErrorCode.INVALID), (11, ErrorCode.BUFFER_BOUNDS),
                            (I64_MAX, ErrorCode.BUFFER_BOUNDS), (1 << 62, ErrorCode.BUFFER_BOUNDS)]:
            assert call(s, "fill_f32", h, 5.0, count) == code
        assert call(s, "fill_f32", 99, 5.0, 1) == ErrorCode.BAD_HANDLE
        assert buffer_bytes(s, h)[:16] == struct.pack("<4f", 2, 2, 2, 1.5)


def test_axpy_and_sum_match_numpy_on_random_data(env: Env) -> None:
    rng = np.random.default_rng(1234)
    n = 50_001
    x = rng.standard_normal(n, dtype=np.float32)
    y = rng.standard_normal(n, dtype=np.float32)
    a = np.float32(-1.25)
    with make_env(True, gpu_cap=None) as big, probe(big) as s:
        hx, hy = call(s, "alloc", 4 * n), call(s, "alloc", 4 * n)
        be = big.ctx.backend
        be.write(s.run.buffers[hx][0], 0, memoryview(x.tobytes()))
        be.write(s.run.buffers[hy][0], 0, memoryview(y.tobytes()))
        assert call(s, "axpy_f32", n, float(a), hx, hy) == 0
        got = np.frombuffer(buffer_bytes(s, hy), dtype=np.float32)
        ref = a * x + y
        np.testing.assert_array_equal(got, ref)  # the same float32 ops as numpy's
        assert call(s, "sum_f32", hy, n, 64) == 0
        (total,) = s.call("load_f32", [64])
        assert total == pytest.approx(float(ref.sum(dtype=np.float64)), rel=1e-4, abs=1e-2)
        assert np.float32(total) == np.add.reduce(ref, dtype=np.float32)
        # part of the vectors only, and x == y
        assert call(s, "axpy_f32", 10, 2.0, hy, hy) == 0
        np.testing.assert_array_equal(np.frombuffer(buffer_bytes(s, hy), dtype=np.float32)[:10], ref[:10] * 3)
        np.testing.assert_array_equal(np.frombuffer(buffer_bytes(s, hy), dtype=np.float32)[10:], ref[10:])


def test_axpy_hostile_arguments(env: Env) -> None:
    with probe(env) as s:
        hx, hy, small = call(s, "alloc", 400), call(s, "alloc", 400), call(s, "alloc", 40)
        assert call(s, "fill_f32", hx, 1.0, 100) == 0
        before = buffer_bytes(s, hy), buffer_bytes(s, small)
        for n, x, y, code in [
            (-1, hx, hy, ErrorCode.INVALID),
            (I64_MIN, hx, hy, ErrorCode.INVALID),
            (101, hx, hy, ErrorCode.BUFFER_BOUNDS),
            (11, hx, small, ErrorCode.BUFFER_BOUNDS),
            (11, small, hy, ErrorCode.BUFFER_BOUNDS),
            (I64_MAX, hx, hy, ErrorCode.BUFFER_BOUNDS),
            (1, 0, hy, ErrorCode.BAD_HANDLE),
            (1, hx, 77, ErrorCode.BAD_HANDLE),
            (1, -1, -1, ErrorCode.BAD_HANDLE),
        ]:
            assert call(s, "axpy_f32", n, 3.0, x, y) == code, (n, x, y)
        assert (buffer_bytes(s, hy), buffer_bytes(s, small)) == before
        assert call(s, "axpy_f32", 0, 3.0, hx, hy) == 0


def test_sum_f32_hostile_arguments(env: Env) -> None:
    with probe(env) as s:
        h = call(s, "alloc", 16)
        assert call(s, "fill_f32", h, 0.25, 4) == 0
        poke(s, 0, b"\x5A" * PAGE)
        before = mem(s)
        for count, ptr, code in [
            (4, -1, ErrorCode.MEMORY_BOUNDS),
            (4, PAGE - 3, ErrorCode.MEMORY_BOUNDS),
            (4, PAGE, ErrorCode.MEMORY_BOUNDS),
            (4, I32_MIN, ErrorCode.MEMORY_BOUNDS),
            (5, 0, ErrorCode.BUFFER_BOUNDS),
            (-1, 0, ErrorCode.INVALID),
        ]:
            assert call(s, "sum_f32", h, count, ptr) == code
        assert call(s, "sum_f32", 2, 4, 0) == ErrorCode.BAD_HANDLE
        assert mem(s) == before
        assert call(s, "sum_f32", h, 4, PAGE - 4) == 0  # the last 4 bytes of memory
        assert s.call("load_f32", [PAGE - 4]) == [1.0]
        assert mem(s)[: PAGE - 4] == before[: PAGE - 4]
        assert call(s, "sum_f32", h, 0, 8) == 0
        assert s.call("load_f32", [8]) == [0.0]


# ------------------------------------------------------------------ log


def test_log_lines_are_bounded_and_cleaned(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="twt.worker.wasm"), probe(env) as s:
        poke(s, 0, b"hello \x1b[31mred\x00\xff")
        assert call(s, "log", 0, 16) == 0
        poke(s, 100, b"x" * 5000)
        assert call(s, "log", 100, 5000) == 0
        assert call(s, "log", 0, 0) == 0
        assert call(s, "log", PAGE - 2, 4) == ErrorCode.MEMORY_BOUNDS
        assert call(s, "log", -1, 1) == ErrorCode.MEMORY_BOUNDS
        assert call(s, "log", 0, -1) == ErrorCode.MEMORY_BOUNDS
        logs = list(s.run.logs)
    assert logs[0] == "hello \ufffd[31mred\ufffd\ufffd"
    assert logs[1] == "x" * abi.MAX_LOG_BYTES + " [truncated]"
    assert logs[2] == ""
    lines = [r for r in caplog.records if r.getMessage() == "wasm.log"]
    assert len(lines) == 3
    assert "hello" in TextFormatter().format(lines[0]) and "tenant=abi" in TextFormatter().format(lines[0])


def test_log_is_rate_limited(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(abi, "MAX_LOG_LINES_PER_RUN", 5)
    with probe(env) as s:
        poke(s, 0, b"line")
        codes = [call(s, "log", 0, 4) for _ in range(7)]
        assert codes == [0] * 5 + [ErrorCode.RATE_LIMITED] * 2
        assert len(s.run.logs) == 5
    env.host.limiter.tokens = 0.0  # the per-worker bucket is empty: the next run is limited too
    env.host.limiter.rate = 0.0
    with probe(env) as s:
        poke(s, 0, b"line")
        assert call(s, "log", 0, 4) == ErrorCode.RATE_LIMITED
    assert env.host.limiter.dropped == 1


# ------------------------------------------------------------------ no memory, host failures


NO_MEMORY_GUEST = b"""(module
  (import "tensorwasm" "alloc" (func $alloc (param i64) (result i64)))
  (import "tensorwasm" "write" (func $write (param i64 i64 i32 i32) (result i32)))
  (import "tensorwasm" "log" (func $log (param i32 i32) (result i32)))
  (import "tensorwasm" "sum_f32" (func $sum (param i64 i64 i32) (result i32)))
  (func (export "run") (result i32 i32 i32)
    (local $h i64)
    (local.set $h (call $alloc (i64.const 16)))
    (call $write (local.get $h) (i64.const 0) (i32.const 0) (i32.const 4))
    (call $log (i32.const 0) (i32.const 0))
    (call $sum (local.get $h) (i64.const 4) (i32.const 0))))"""

HIDDEN_MEMORY_GUEST = b"""(module
  (import "tensorwasm" "log" (func $log (param i32 i32) (result i32)))
  (memory 1)
  (func (export "run") (result i32) (call $log (i32.const 0) (i32.const 1))))"""


@pytest.mark.parametrize("guest", [NO_MEMORY_GUEST, HIDDEN_MEMORY_GUEST], ids=["none", "not-exported"])
def test_pointer_imports_without_an_exported_memory(env: Env, guest: bytes) -> None:
    reply = env.host.run(guest, "run", [], fuel=10**6, timeout_s=5)
    assert set(reply["results"]) == {ErrorCode.NO_MEMORY}


START_GUEST = b"""(module
  (import "tensorwasm" "log" (func $log (param i32 i32) (result i32)))
  (memory (export "memory") 1 1)
  (data (i32.const 0) "from start")
  (global $rc (mut i32) (i32.const 99))
  (func $start (global.set $rc (call $log (i32.const 0) (i32.const 10))))
  (start $start)
  (func (export "rc") (result i32) (global.get $rc)))"""


def test_imports_work_from_the_start_function(env: Env) -> None:
    reply = env.host.run(START_GUEST, "rc", [], fuel=10**6, timeout_s=5)
    assert reply["results"] == [0]
    assert reply["logs"] == ["from start"]


def test_a_host_bug_is_an_internal_code_not_a_trap(env: Env, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("simulated host bug")

    with probe(env) as s:
        h = call(s, "alloc", 16)
        monkeypatch.setattr(env.ctx.backend, "sum_f32", broken)  # a synchronous op (its result is read)
        with caplog.at_level(logging.ERROR, logger="twt.worker.wasm"):
            assert call(s, "sum_f32", h, 4, 0) == ErrorCode.INTERNAL
        assert "simulated host bug" in caplog.text
        caplog.clear()
        monkeypatch.setattr(env.ctx.backend, "fill_f32", broken)  # a queued op: the call returns first,
        with caplog.at_level(logging.ERROR, logger="twt.worker.wasm"):  # the bug is logged at the sync
            assert call(s, "fill_f32", h, 1.0, 4) == 0
        assert "simulated host bug" in caplog.text
        assert call(s, "add", 1, 1) == 2


def test_a_backend_error_on_alloc_is_a_backend_code(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(nbytes: int) -> object:
        raise CudaError("cuMemAllocFromPoolAsync", "CUDA_ERROR_UNKNOWN", 999)

    monkeypatch.setattr(env.ctx.backend, "alloc", failing)
    with probe(env) as s:
        assert call(s, "alloc", 16) == ErrorCode.BACKEND
        assert env.block.gpu_bytes_in_use == 0  # the allocator rolled the bytes back


# ------------------------------------------------------------------ property test


@pytest.fixture(scope="module")
def both_envs() -> Iterator[dict[bool, Env]]:
    """One context per import path for every example of the property test: each example opens a
    session of its own (fresh guest memory, buffers freed at its end), so the context - a quota
    block and a WasmHost, ~15 ms of CPU to make, most of an example's cost - needs no remaking."""
    with make_env(True) as unchecked, make_env(False) as checked:
        yield {True: unchecked, False: checked}


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    op=st.sampled_from(["write", "read"]),
    offset=st.one_of(st.integers(-8, 300), st.integers(I64_MIN, I64_MAX)),
    ptr=st.one_of(st.integers(PAGE - 300, PAGE + 8), st.integers(-8, 300), st.integers(I32_MIN, I32_MAX)),
    length=st.one_of(st.integers(-4, 300), st.integers(I32_MIN, I32_MAX)),
    fast=st.booleans(),
)
def test_copies_agree_with_a_model(both_envs: dict[bool, Env], op: str, offset: int, ptr: int, length: int,
                                   fast: bool) -> None:
    size = 256
    env = both_envs[fast]
    with probe(env) as s:
        h = call(s, "alloc", size)
        poke(s, 0, MEM_PATTERN)
        env.ctx.backend.write(s.run.buffers[h][0], 0, memoryview(BUF_PATTERN))
        mem0, buf0 = mem(s), buffer_bytes(s, h)
        p, n = ptr & 0xFFFFFFFF, length & 0xFFFFFFFF
        if offset < 0 or offset + n > size:
            want = ErrorCode.BUFFER_BOUNDS
        elif p + n > PAGE:
            want = ErrorCode.MEMORY_BOUNDS
        else:
            want = ErrorCode.OK
        assert call(s, op, h, offset, ptr, length) == want
        mem1, buf1 = mem(s), buffer_bytes(s, h)
        if want != ErrorCode.OK:
            assert (mem1, buf1) == (mem0, buf0)
        elif op == "write":
            assert mem1 == mem0
            assert buf1 == buf0[:offset] + mem0[p : p + n] + buf0[offset + n :]
        else:
            assert buf1 == buf0
            assert mem1 == mem0[:p] + buf0[offset : offset + n] + mem0[p + n :]
    assert (env.block.bytes_in_use, env.block.gpu_bytes_in_use) == (0, 0)  # the session gave every byte back
