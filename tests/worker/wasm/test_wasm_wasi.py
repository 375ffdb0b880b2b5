"""WASI preview 1 for guests (worker/wasm/wasi.py), call by call, from hand-written WAT (no compiler needed).

The C-level view (printf, fopen, exit, malloc from wasi-libc) is
tests/sdk/test_hostile.py; here each import is driven with exact and hostile
arguments: what it writes, which errno it returns, that nothing of the host
is reachable, and that a module without WASI imports gets no WASI at all.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest

from shared.errors import WasmCompile, WasmTrap
from tests.helpers.wasm_env import Env, tenant_env
from worker.backends.stub import StubBackend
from worker.wasm import abi, guest_source
from worker.wasm.wasi import (
    ERRNO_BADF,
    ERRNO_FAULT,
    ERRNO_INVAL,
    ERRNO_NOTSUP,
    PROGRAM,
    OutputLines,
)

pytestmark = pytest.mark.timeout(60)

WASI = "wasi_snapshot_preview1"

# Every preview-1 call under test re-exported one to one, plus a reactor's _initialize that counts.
GUEST = f"""
(module
  (import "{WASI}" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "{WASI}" "fd_fdstat_get" (func $fdstat (param i32 i32) (result i32)))
  (import "{WASI}" "poll_oneoff" (func $poll (param i32 i32 i32 i32) (result i32)))
  (import "{WASI}" "args_sizes_get" (func $args_sizes (param i32 i32) (result i32)))
  (import "{WASI}" "args_get" (func $args_get (param i32 i32) (result i32)))
  (import "{WASI}" "environ_sizes_get" (func $env_sizes (param i32 i32) (result i32)))
  (import "{WASI}" "fd_prestat_get" (func $prestat (param i32 i32) (result i32)))
  (import "{WASI}" "random_get" (func $random (param i32 i32) (result i32)))
  (import "{WASI}" "clock_time_get" (func $clock (param i32 i64 i32) (result i32)))
  (import "{WASI}" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1 1)
  (global $inits (mut i32) (i32.const 0))
  (global $exit_in_init (mut i32) (i32.const 0))
  (func (export "_initialize")
    (global.set $inits (i32.add (global.get $inits) (i32.const 1))))
  (func (export "inits") (result i32) (global.get $inits))
  (func (export "fd_write") (param i32 i32 i32 i32) (result i32)
    (call $fd_write (local.get 0) (local.get 1) (local.get 2) (local.get 3)))
  (func (export "fdstat") (param i32 i32) (result i32) (call $fdstat (local.get 0) (local.get 1)))
  (func (export "poll") (result i32) (call $poll (i32.const 0) (i32.const 64) (i32.const 1) (i32.const 128)))
  (func (export "args_sizes") (result i32) (call $args_sizes (i32.const 0) (i32.const 4)))
  (func (export "args_get") (result i32) (call $args_get (i32.const 0) (i32.const 16)))
  (func (export "env_sizes") (result i32) (call $env_sizes (i32.const 0) (i32.const 4)))
  (func (export "prestat") (param i32) (result i32) (call $prestat (local.get 0) (i32.const 0)))
  (func (export "random") (param i32 i32) (result i32) (call $random (local.get 0) (local.get 1)))
  (func (export "clock") (result i32) (call $clock (i32.const 0) (i64.const 1) (i32.const 0)))
  (func (export "exit") (param i32) (call $exit (local.get 0)))
  (func (export "load64") (param i32) (result i64) (i64.load (local.get 0)))
)
""".encode()

EXIT_IN_INIT = f"""
(module
  (import "{WASI}" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1 1)
  (func (export "_initialize") (call $exit (i32.const 9)))
  (func (export "never") (result i32) (unreachable))
)
""".encode()


EXIT_IN_START = f"""
(module
  (import "{WASI}" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1 1)
  (func $start (call $exit (i32.const 5)))
  (start $start)
  (func (export "never") (result i32) (unreachable))
)
""".encode()


@pytest.fixture
def env() -> Iterator[Env]:
    with tenant_env("wasi", StubBackend(), max_memory=1 << 20) as e:
        yield e


def data(segments: dict[int, bytes]) -> str:
    """WAT data segments setting each ``segments`` entry at its offset."""
    return "".join(f'(data (i32.const {off}) "{"".join(chr(92) + format(b, "02x") for b in raw)}")'
                   for off, raw in segments.items())


def writer(segments: dict[int, bytes], *calls: tuple[int, int, int, int]) -> bytes:
    """A guest whose ``go`` makes each fd_write call in order; the errnos packed a byte each, first lowest."""
    body = "".join(
        f"(local.set $acc (i32.or (local.get $acc) (i32.shl (call $w (i32.const {fd}) (i32.const {iovs}) "
        f"(i32.const {n}) (i32.const {out})) (i32.const {8 * i}))))"
        for i, (fd, iovs, n, out) in enumerate(calls)
    )
    return (f'(module (import "{WASI}" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))'
            f'(memory (export "memory") 1 1) {data(segments)}'
            f'(func (export "go") (result i32) (local $acc i32) {body} (local.get $acc)))').encode()


def iovec(*pairs: tuple[int, int]) -> bytes:
    return b"".join(struct.pack("<II", p, n) for p, n in pairs)


# ------------------------------------------------------------------ stdout / stderr


def test_fd_write_lines_go_to_the_logs(env: Env) -> None:
    segments = {0: iovec((100, 6), (200, 9)), 100: b"hello ", 200: b"world\nand", 300: b" more\n\n", 400: iovec((300, 7))}
    guest = writer(segments, (1, 0, 2, 64), (2, 400, 1, 68), (1, 100, 0, 72))
    with env.host.session(guest, fuel=10**6, timeout_s=10.0) as s:
        assert s.call("go") == [0]
        mem = bytes(s.guest_memory())
        assert struct.unpack_from("<III", mem, 64) == (15, 7, 0)  # nwritten of each call
    # stdout: "hello world" then the unfinished "and" at the end of the run; stderr: " more" and ""
    reply = env.host.run(guest, "go", [], fuel=10**6, timeout_s=10.0)
    assert sorted(reply["logs"]) == sorted(["hello world", " more", "", "and"])
    assert reply["logs_dropped"] == 0


@pytest.mark.parametrize(
    ("segments", "call", "errno"),
    [
        ({0: iovec((100, 4))}, (3, 0, 1, 64), ERRNO_BADF),  # no fd 3 (nothing can be opened)
        ({0: iovec((100, 4))}, (0, 0, 1, 64), ERRNO_BADF),  # stdin is not writable
        ({0: iovec((65530, 10))}, (1, 0, 1, 64), ERRNO_FAULT),  # the data runs past memory
        ({0: iovec((100, 4))}, (1, 65530, 1, 64), ERRNO_FAULT),  # the iovec array runs past memory
        ({0: iovec((100, 4))}, (1, 0, 1, 65534), ERRNO_FAULT),  # nwritten past memory
        ({0: iovec((100, 4))}, (1, 0, -1, 64), ERRNO_INVAL),  # 4 G iovecs
        ({0: iovec((0xFFFFFFFF, 2))}, (1, 0, 1, 64), ERRNO_FAULT),  # a pointer wrapping around
    ],
)
def test_fd_write_rejects_hostile_arguments(env: Env, segments: dict[int, bytes], call: tuple[int, int, int, int],
                                            errno: int) -> None:
    reply = env.host.run(writer(segments, call), "go", [], fuel=10**6, timeout_s=10.0)
    assert reply["results"] == [errno]
    assert reply["logs"] == []


def test_output_is_rate_limited_like_log(env: Env) -> None:
    lines = b"x\n" * 5000
    guest = writer({0: iovec((100, len(lines))), 100: lines}, (1, 0, 1, 64))
    reply = env.host.run(guest, "go", [], fuel=10**6, timeout_s=10.0)
    assert reply["results"] == [0]
    assert len(reply["logs"]) == abi.MAX_LOG_LINES_IN_REPLY
    assert 5000 - reply["logs_dropped"] <= abi.MAX_LOG_LINES_PER_RUN


def test_output_lines_split_and_truncate() -> None:
    got: list[tuple[bytes, bool]] = []
    lines = OutputLines(lambda raw, cut: got.append((raw, cut)), max_bytes=4)
    for chunk in (b"ab", b"c\nlong line here", b"\n", b"\nx"):
        lines.write(chunk)
    assert got == [(b"abc", False), (b"long", True), (b"", False)]
    lines.close()
    lines.close()  # idempotent
    assert got[-1] == (b"x", False) and len(got) == 4


# ------------------------------------------------------------------ the rest of preview 1


def test_the_guest_sees_a_terminal_and_nothing_else(env: Env) -> None:
    with env.host.session(GUEST, fuel=10**6, timeout_s=10.0) as s:
        for fd in (0, 1, 2):
            assert s.call("fdstat", [fd, 256]) == [0]
            filetype, rights = s.guest_memory()[256], struct.unpack_from("<Q", s.guest_memory(), 264)[0]
            assert filetype == 2 and not rights & 0b100100  # a character device, no seek or tell
        assert s.call("fdstat", [3, 256]) == [ERRNO_BADF]
        assert s.call("fdstat", [1, 65530]) == [ERRNO_FAULT]
        for fd in (3, 4, 5):
            assert s.call("prestat", [fd]) == [ERRNO_BADF]  # no preopened directory at all
        assert s.call("poll") == [ERRNO_NOTSUP]  # no sleeping inside a host call
        assert s.call("env_sizes") == [0]
        assert struct.unpack_from("<II", s.guest_memory(), 0) == (0, 0)  # no environment
        assert s.call("args_sizes") == [0]
        assert struct.unpack_from("<II", s.guest_memory(), 0) == (1, len(PROGRAM) + 1)
        assert s.call("args_sizes") == [0] and s.call("args_get") == [0]
        argv0 = struct.unpack_from("<I", s.guest_memory(), 0)[0]
        assert bytes(s.guest_memory()[argv0 : argv0 + len(PROGRAM) + 1]) == PROGRAM.encode() + b"\0"
        assert s.call("random", [1024, 64]) == [0]
        assert bytes(s.guest_memory()[1024:1088]) != bytes(64)
        assert s.call("clock") == [0] and s.call("load64", [0]) != [0]
    # wasmtime's own functions trap on a guest range past memory (ours return EFAULT): typed, and the end of the run
    with pytest.raises(WasmTrap, match="out of bounds"):
        env.host.run(GUEST, "random", [65500, 64], fuel=10**6, timeout_s=10.0)
    assert env.counters() == (0, 0)


def test_initialize_runs_once_per_instance(env: Env) -> None:
    for _ in range(2):
        assert env.host.run(GUEST, "inits", [], fuel=10**6, timeout_s=10.0)["results"] == [1]


def test_proc_exit_is_an_exit_code_not_a_trap(env: Env) -> None:
    reply = env.host.run(GUEST, "exit", [3], fuel=10**6, timeout_s=10.0)
    assert (reply["results"], reply["exit_code"]) == ([], 3)
    reply = env.host.run(EXIT_IN_INIT, "never", [], fuel=10**6, timeout_s=10.0)
    assert (reply["results"], reply["exit_code"]) == ([], 9)  # the export was never called
    reply = env.host.run(EXIT_IN_START, "never", [], fuel=10**6, timeout_s=10.0)
    assert (reply["results"], reply["exit_code"]) == ([], 5)  # the instance never finished instantiating
    assert env.host.run(GUEST, "inits", [], fuel=10**6, timeout_s=10.0)["exit_code"] is None
    assert env.counters() == (0, 0)


def test_modules_without_wasi_get_none(env: Env) -> None:
    assert env.host.compile(guest_source("probe")).wasi is False
    assert env.host.compile(GUEST).wasi is True
    # without a WASI import there is no WASI context: such a module can only see tensorwasm
    reply = env.host.run(guest_source("probe"), "add", [1, 2], fuel=10**6, timeout_s=10.0)
    assert reply["results"] == [3] and reply["exit_code"] is None


def test_sockets_are_refused_at_compile_time(env: Env) -> None:
    body = f'(module (import "{WASI}" "sock_send" (func (param i32 i32 i32 i32 i32) (result i32))))'.encode()
    with pytest.raises(WasmCompile, match="no network"):
        env.host.compile(body)
