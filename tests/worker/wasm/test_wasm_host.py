"""The WASM host in process: armed stores, typed errors, run-scoped cleanup, the module cache, the ticker.

A real TenantContext over a real shared-memory QuotaBlock and the stub
backend; every test checks that the counters are back where they started.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import zmq

from shared.errors import (
    InvalidArgument,
    KernelTimeout,
    MemoryExhausted,
    UnknownModule,
    WasmCompile,
    WasmTrap,
)
from worker.backends.stub import StubBackend
from worker.context import TenantContext
from worker.wasm import ErrorCode, WasmHost, guest_source, host as host_mod
from worker.wasm.host import memory_limits
from worker.wasm.ops import op_run_wasm
from tests.helpers.cluster import wait_for
from tests.helpers.wasm_env import PAGE, PROBE, Env, tenant_env

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
TRAPS = guest_source("traps")


@contextmanager
def make_env(*, fast: bool | None = None, memory_quota: int = 64 * MiB, max_memory: int = 1 * MiB,
             timeout_s: float = 5.0, fuel: int = 10**9) -> Iterator[Env]:
    with tenant_env("host", StubBackend(), fast=fast, memory_quota=memory_quota, gpu_cap=8 * MiB,
                    max_memory=max_memory, wasm_timeout_s=timeout_s, wasm_fuel=fuel) as env:
        yield env


@pytest.fixture
def env() -> Iterator[Env]:
    with make_env() as e:
        yield e


def run(env: Env, body: bytes, export: str, args: list[Any] | None = None, *, fuel: int = 10**9,
        timeout_s: float = 60.0) -> dict[str, Any]:
    """One run; ``timeout_s`` is a hang guard unless a test is about deadlines (the compile counts
    against it, and a loaded host once took more than 5 s to compile the probe guest)."""
    return env.host.run(body, export, args or [], fuel=fuel, timeout_s=timeout_s)


def still_serves(env: Env) -> None:
    assert run(env, TRAPS, "ok")["results"] == [42]
    assert env.counters() == (0, 0)


# ------------------------------------------------------------------ typed errors


def test_a_simple_run_and_its_reply(env: Env) -> None:
    reply = run(env, PROBE, "add", [2, 40])
    assert reply["results"] == [42]
    assert 0 < reply["fuel_used"] < 100
    assert 0 < reply["elapsed_s"] < 30  # measured and reported, not a speed target
    assert reply["cached"] is False and run(env, PROBE, "add", [1, 1])["cached"] is True
    assert reply["gpu_peak_bytes"] == 0 and reply["memory_bytes"] == PAGE and reply["logs"] == []


def test_fuel_exhaustion_is_a_trap(env: Env) -> None:
    with pytest.raises(WasmTrap) as exc:
        run(env, TRAPS, "spin", fuel=100_000)
    assert exc.value.trap_code == "out_of_fuel"
    assert "fuel" in exc.value.detail
    still_serves(env)


def test_the_deadline_is_a_kernel_timeout(env: Env) -> None:
    env.host.compile(TRAPS)  # no deadline: the run's 0.2 s (which would cover a compile too) are the guest's
    t0 = time.monotonic()
    with pytest.raises(KernelTimeout) as exc:
        run(env, TRAPS, "spin", fuel=10**15, timeout_s=0.2)
    elapsed = time.monotonic() - t0
    assert exc.value.timeout_s == 0.2 and exc.value.op == "run_wasm"
    assert 0.2 <= elapsed < 60.0  # stopped at its deadline (never early); the margin is for a loaded machine
    assert env.host.stats["timeouts"] == 1
    still_serves(env)


@pytest.mark.parametrize(
    ("export", "args", "code"),
    [
        ("unreachable", [], "unreachable"),
        ("recurse", [0], "stack_overflow"),
        ("oob", [], "memory_out_of_bounds"),
        ("div", [0], "integer_division_by_zero"),
    ],
)
@pytest.mark.parametrize("fast", [True, False], ids=["unchecked", "checked"])
def test_traps_are_typed_and_the_host_serves_the_next_run(export: str, args: list[int], code: str,
                                                          fast: bool) -> None:
    with make_env(fast=fast) as env:
        with pytest.raises(WasmTrap) as exc:
            run(env, TRAPS, export, args)
        assert exc.value.trap_code == code
        assert exc.value.detail and "\n" not in exc.value.detail
        still_serves(env)


def test_memory_grow_past_the_limit_returns_minus_one(env: Env) -> None:
    # traps.wat declares (memory 1) with no maximum: the limit is wasm_max_memory_bytes = 1 MiB = 16 pages
    with env.host.session(TRAPS, fuel=10**6, timeout_s=5) as s:
        assert env.block.bytes_in_use == 1 * MiB  # the cap is charged to the CPU quota for the run
        assert s.call("grow", [15]) == [1]
        assert s.call("pages", []) == [16]
        assert s.call("grow", [1]) == [-1]
        assert s.call("grow", [65536]) == [-1]
        assert s.call("grow", [-1]) == [-1]  # 0xFFFFFFFF pages
        assert s.call("pages", []) == [16]
    assert env.counters() == (0, 0)


def test_a_declared_maximum_is_charged_instead_of_the_cap(env: Env) -> None:
    with env.host.session(PROBE, fuel=10**6, timeout_s=5) as s:  # (memory 1 4)
        assert env.block.bytes_in_use == 4 * PAGE
        assert s.reservation == 4 * PAGE
    assert env.block.bytes_in_use == 0


def test_linear_memory_is_limited_by_the_free_cpu_quota() -> None:
    with make_env(memory_quota=3 * PAGE) as env:
        env.block.consume_bytes(PAGE)  # something else of the tenant holds one page
        with env.host.session(TRAPS, fuel=10**6, timeout_s=5) as s:
            assert s.reservation == 2 * PAGE
            assert env.block.bytes_in_use == 3 * PAGE
            assert s.call("grow", [1]) == [1]
            assert s.call("grow", [1]) == [-1]
        env.block.consume_bytes(2 * PAGE)  # now nothing is free: not even the initial page fits
        with pytest.raises(MemoryExhausted) as exc:
            run(env, TRAPS, "ok")
        assert exc.value.requested == PAGE
        assert env.block.bytes_in_use == 3 * PAGE
        env.block.release_bytes(3 * PAGE)
        still_serves(env)


def test_initial_memory_above_the_spec_limit_is_refused(env: Env) -> None:
    with pytest.raises(WasmCompile, match="wasm_max_memory_bytes"):
        run(env, b"(module (memory 17) (func (export \"f\")))", "f")
    still_serves(env)


def test_a_module_without_memory_reserves_nothing(env: Env) -> None:
    with env.host.session(b'(module (func (export "f") (result i32) (i32.const 7)))', fuel=100, timeout_s=1) as s:
        assert s.reservation == 0 and env.block.bytes_in_use == 0
        assert s.call("f") == [7]


# ------------------------------------------------------------------ compile errors


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"\x00\x01\x02\xff garbage", "neither a WebAssembly binary"),
        (bytes(range(256)) * 4, "neither a WebAssembly binary"),
        (b"\x00asm\x01\x00\x00\x00\x01\x05garbage", "offset"),
        (b"\x00asm\x02\x00\x00\x00", "version"),
        (b"", "empty"),
        (b"(module (func", "WAT does not parse"),
        (b'(module (func (export "f") (result i32) (i64.const 1)))', "type mismatch"),
        (b'(module (import "wasi_snapshot_preview1" "sock_accept" (func (param i32 i32 i32) (result i32))))',
         "no network"),
        (b'(module (import "wasi_snapshot_preview1" "fd_write" (func (param i32) (result i32))))', "fd_write"),
        (b'(module (import "wasi_snapshot_preview1" "fd_whatever" (func)))', "not a WASI preview 1 function"),
        (b'(module (import "wasi_unstable" "fd_write" (func (param i32 i32 i32 i32) (result i32))))',
         "not provided"),
        (b'(module (import "tensorwasm" "system" (func)))', "not provided"),
        (b'(module (import "tensorwasm" "alloc" (func (param i32) (result i32))))', "ABI type"),
        (b'(module (import "tensorwasm" "memory" (memory 1)))', "not provided"),
        (b'(module (memory 1 1 shared))', "threads"),
        (b'(module (memory i64 1))', "memory64"),
        (b'(module (memory 1) (memory 1))', "multiple memories"),
    ],
)
def test_compile_errors_are_typed(env: Env, body: bytes, match: str) -> None:
    with pytest.raises(WasmCompile) as exc:
        run(env, body, "f")
    assert match in exc.value.detail
    still_serves(env)


def test_random_bytes_never_crash_the_host(env: Env) -> None:
    rng = np.random.default_rng(5)
    for _ in range(200):
        body = b"\x00asm\x01\x00\x00\x00" + rng.integers(0, 256, size=int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
        try:
            # fuel bounds every run; the deadline is not what this tests (a loaded host's compile
            # thread can wait past a short one: CompileOverrun)
            run(env, body, "f", fuel=1000, timeout_s=60)
        except (WasmCompile, InvalidArgument, WasmTrap):
            pass
    still_serves(env)


def test_oversized_modules_are_refused(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_mod, "MAX_MODULE_BYTES", 100)
    with pytest.raises(WasmCompile, match="larger than"):
        run(env, b" " * 101 + b"(module)", "f")


# ------------------------------------------------------------------ run-scoped buffers

ALLOC_THEN = """(module
  (import "tensorwasm" "alloc" (func $alloc (param i64) (result i64)))
  (memory (export "memory") 1 1)
  (func (export "run") (result i64)
    (drop (call $alloc (i64.const 4096)))
    (drop (call $alloc (i64.const 1000)))
    {tail}))"""


@pytest.mark.parametrize(
    ("tail", "error"),
    [
        ("(i64.const 0)", None),
        ("unreachable", WasmTrap),
        ("(loop $l (br $l)) (i64.const 0)", KernelTimeout),
    ],
    ids=["return", "trap", "timeout"],
)
def test_guest_buffers_are_released_however_the_run_ends(env: Env, tail: str, error: type[Exception] | None) -> None:
    body = ALLOC_THEN.format(tail=tail).encode()
    before = env.counters()
    seen: list[tuple[int, int]] = []
    done = threading.Event()

    def watch() -> None:  # what a concurrent observer sees in the shared block during the run
        while not done.is_set():
            counters = env.counters()
            if counters != (0, 0):
                seen.append(counters)
                if error is KernelTimeout and counters == (PAGE, 5096):
                    # both buffers seen while the guest spins: now end the run by its deadline, the
                    # epoch pushed past it at once (what the ticker would do over the 30 s)
                    ticker = env.host.ticker
                    for _ in range(ticker.deadline_ticks(30.0) + 1):
                        ticker.engine.increment_epoch()
                    return
            done.wait(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    if error is None:
        assert run(env, body, "run")["gpu_peak_bytes"] == 5096
    else:
        # the spinning guest's deadline is long: the watcher ends it once it has seen the buffers. Its
        # fuel is far above what any host burns in that deadline (a fast one burns a few billion units a
        # second, which would run 10^9 out before a watcher scheduled late saw the buffers)
        with pytest.raises(error):
            run(env, body, "run", timeout_s=30.0 if error is KernelTimeout else 0.3,
                fuel=10**15 if error is KernelTimeout else 10**9)
    done.set()
    watcher.join()
    assert env.counters() == before == (0, 0)
    assert env.ctx.backend.info()["in_use_bytes"] == 0
    if error is KernelTimeout:
        assert seen[-1] == (PAGE, 5096)


def test_client_buffers_survive_a_trap(env: Env) -> None:
    h = env.ctx.allocator.alloc(1024)
    with pytest.raises(WasmTrap):
        run(env, TRAPS, "unreachable")
    assert env.ctx.allocator.handles() == {h: 1024}
    reply = run(env, PROBE, "fill_f32", [{"handle": h}, 3.0, 256])
    assert reply["results"] == [0]
    assert env.ctx.allocator.read(h, 0, 8) == np.full(2, 3.0, dtype=np.float32).tobytes()
    assert env.block.gpu_bytes_in_use == 1024
    env.ctx.allocator.free(h)


# ------------------------------------------------------------------ numerics


def test_axpy_sum_guest_matches_numpy(env: Env) -> None:
    rng = np.random.default_rng(99)
    n = 100_003  # not a multiple of the guest's 64 KiB copy chunk
    x = rng.standard_normal(n, dtype=np.float32)
    y = rng.standard_normal(n, dtype=np.float32)
    hx, hy = env.ctx.allocator.alloc(4 * n), env.ctx.allocator.alloc(4 * n)
    env.ctx.allocator.write(hx, 0, memoryview(x.tobytes()))
    env.ctx.allocator.write(hy, 0, memoryview(y.tobytes()))
    reply = run(env, guest_source("axpy_sum"), "run", [{"handle": hx}, {"handle": hy}, n, 0.3])
    total, status = reply["results"]
    assert status == 0
    ref = np.float32(0.3) * x + y
    got = np.frombuffer(env.ctx.allocator.read(hy, 0, 4 * n), dtype=np.float32)
    np.testing.assert_array_equal(got, ref)
    assert np.float32(total) == np.add.reduce(ref, dtype=np.float32)
    assert reply["gpu_peak_bytes"] == 4 * n  # the scratch copy of x
    assert reply["logs"] == ["axpy+sum done"]
    env.ctx.allocator.free(hx)
    env.ctx.allocator.free(hy)


def test_long_job_guest(env: Env) -> None:
    reply = run(env, guest_source("long_job"), "run", [1000, 6])
    assert reply["results"] == [3000.0]


def test_overcap_guest_reports_the_quota_code(env: Env) -> None:
    reply = run(env, guest_source("overcap"), "run", [4096, 9 * MiB])
    assert reply["results"] == [ErrorCode.GPU_QUOTA]
    assert reply["logs"] == ["second alloc refused: GPU quota exhausted (-5)"]


# ------------------------------------------------------------------ arguments


@pytest.mark.parametrize(
    ("export", "args", "match"),
    [
        ("nope", [], "no exported function"),
        ("memory", [], "no exported function"),
        ("add", [1], "takes 2 argument"),
        ("add", [1, 2, 3], "takes 2 argument"),
        ("add", [1, 2.5], "not a 32-bit integer"),
        ("add", [1, 1 << 32], "not a 32-bit integer"),
        ("add", [1, -(1 << 31) - 1], "not a 32-bit integer"),
        ("add", [True, 1], "expected a number"),
        ("add", ["1", 1], "expected a number"),
        ("add", [{"handle": 1}, 1], "i64 parameter"),
        ("free", [{"handle": 12345}], "unknown buffer handle"),
        ("free", [{"handle": 1, "x": 2}], "i64 parameter"),
    ],
)
def test_bad_arguments_are_invalid(env: Env, export: str, args: list[Any], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        run(env, PROBE, export, args)
    still_serves(env)


def test_integer_arguments_may_be_unsigned_and_floats_convert(env: Env) -> None:
    assert run(env, PROBE, "add", [(1 << 32) - 1, 2])["results"] == [1]  # 0xFFFFFFFF is -1
    reply = run(env, PROBE, "fill_f32", [(1 << 64) - 1, 1, 0])  # handle -1: unknown
    assert reply["results"] == [ErrorCode.BAD_HANDLE]
    assert run(env, b'(module (func (export "f") (param f64) (result f64) (f64.mul (local.get 0) (f64.const 2))))',
               "f", [3])["results"] == [6.0]


def test_several_results(env: Env) -> None:
    body = b'(module (func (export "f") (result i32 i64 f32) (i32.const 1) (i64.const -2) (f32.const 0.5)))'
    assert run(env, body, "f")["results"] == [1, -2, 0.5]


def test_one_run_at_a_time(env: Env) -> None:
    with env.host.session(PROBE, fuel=100, timeout_s=1):
        with pytest.raises(InvalidArgument, match="already in progress"):
            run(env, PROBE, "add", [1, 2])
    still_serves(env)


# ------------------------------------------------------------------ cache, engine, ticker


def test_modules_are_compiled_once_and_evicted_lru(env: Env) -> None:
    env.host.cache_entries = 2
    a, b, c = (f'(module (func (export "f") (result i32) (i32.const {i})))'.encode() for i in range(3))
    assert run(env, a, "f")["cached"] is False
    assert run(env, a, "f")["cached"] is True
    run(env, b, "f")
    run(env, a, "f")  # a is now the most recent
    run(env, c, "f")  # evicts b
    assert run(env, a, "f")["cached"] is True
    assert run(env, b, "f")["cached"] is False
    assert env.host.stats["compiles"] == 4
    # the key is the sha256 of what the worker received, WAT text included
    assert hashlib.sha256(a).hexdigest() in env.host._cache


def _parked_without_timeout(thread: threading.Thread) -> bool:
    """Whether ``thread`` waits in ``threading.Condition.wait`` with no timeout (the idle wait)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code is threading.Condition.wait.__code__:
            return frame.f_locals.get("timeout", 0) is None
        frame = frame.f_back
    return False


def test_one_idle_ticker_thread_per_host(env: Env) -> None:
    def tickers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "twt-wasm-epoch"]

    assert not env.host.ticker.running
    for _ in range(5):
        run(env, TRAPS, "ok")
    assert len(tickers()) == 1
    ticks = env.host.ticker.ticks
    # No run, no ticking: the thread parks on its condition without a timeout, where only a new
    # run (or close) wakes it. A tick already past its idle check when the last run ended may
    # still land (at most one): wait for the park itself, never for a duration.
    (thread,) = tickers()
    wait_for(lambda: _parked_without_timeout(thread), what="the idle ticker to park")
    assert ticks <= env.host.ticker.ticks <= ticks + 1
    env.ctx.close()  # closes its extensions: the host, and with it the ticker
    assert not env.host.ticker.running and not tickers()


def test_for_context_makes_one_host() -> None:
    with make_env() as env:
        assert WasmHost.for_context(env.ctx) is env.host
        assert env.host.fast_imports  # wasmtime 50's bindings have the unchecked API


def test_memory_limits_parser() -> None:
    import wasmtime

    for text, want in [
        ("(module)", None),
        ("(module (memory 0))", (0, None)),
        ("(module (memory 3 70000))", (3, 70000)),
        ('(module (func (export "f")) (memory (export "m") 2 2))', (2, 2)),
    ]:
        assert memory_limits(bytes(wasmtime.wat2wasm(text))) == want


# ------------------------------------------------------------------ the op


class _Server:
    def __init__(self, ctx: TenantContext) -> None:
        self.ctx = ctx

    def require_context(self) -> TenantContext:
        return self.ctx


def test_op_run_wasm_checks_and_caps_its_arguments() -> None:
    with make_env(timeout_s=0.2, fuel=50_000) as env:
        server: Any = _Server(env.ctx)
        env.host.compile(TRAPS)  # no deadline: the spec's 0.2 s would cover the compile too (a loaded host's outlasts it)
        body = zmq.Frame(TRAPS)
        digest = hashlib.sha256(TRAPS).hexdigest()
        result, out = op_run_wasm(server, {"export": "ok", "args": [], "digest": digest}, body)
        assert result["results"] == [42] and out is None
        with pytest.raises(WasmTrap, match="fuel"):  # asked for more fuel than the spec allows
            op_run_wasm(server, {"export": "spin", "fuel": 10**12, "timeout_s": 100}, body)
        with pytest.raises(InvalidArgument, match="digest"):
            op_run_wasm(server, {"export": "ok", "digest": "0" * 64}, body)
        with pytest.raises(UnknownModule):
            op_run_wasm(server, {"export": "ok", "digest": digest}, None)
        for bad in ({"export": ""}, {"export": 5}, {"export": "ok", "args": "x"}, {"export": "ok", "fuel": 1.5},
                    {"export": "ok", "fuel": -1}, {"export": "ok", "timeout_s": 0}, {"export": "ok", "fuel": True},
                    {"export": "ok", "timeout_s": float("nan")}, {"export": "ok", "args": [0] * 65}):
            with pytest.raises(InvalidArgument):
                op_run_wasm(server, bad, body)
        assert env.counters() == (0, 0)
