"""WASI output bounded by cost: ``fd_write`` pays fuel per byte and line, counts dropped lines in bulk, and
stops at the run's deadline inside the call (worker/wasm/wasi.py), and ``logs_dropped`` counts every line
the reply does not carry.

The guests are hand-written WAT (tests/helpers/wasm_bombs.py ``output_flood``): 1,024 iovecs over 1 MiB
of newlines, once, or each naming the whole 1 MiB again and again (1 GiB a call). No wall-clock bound
is asserted: a run that ends is one the deadline or the fuel ended, and the outcome says which.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.errors import KernelTimeout, WasmTrap
from tests.helpers.wasm_bombs import OUTPUT_FLOOD_LINES, output_flood
from tests.helpers.wasm_env import Env, tenant_env
from worker.backends.stub import StubBackend
from worker.wasm import abi
from worker.wasm.wasi import FUEL_PER_BYTE, FUEL_PER_LINE, OutputLines

pytestmark = pytest.mark.timeout(120)

WASI = "wasi_snapshot_preview1"
FLOOD = output_flood()


@pytest.fixture
def env() -> Iterator[Env]:
    with tenant_env("wasi-cost", StubBackend(), max_memory=4 << 20) as e:
        yield e


def test_one_call_of_a_million_lines_is_paid_for_and_counted_in_bulk(env: Env) -> None:
    reply = env.host.run(FLOOD, "once", [], fuel=10**9, timeout_s=60.0)
    assert reply["results"] == [0]
    logs = reply["logs"]
    assert logs == [""] * abi.MAX_LOG_LINES_IN_REPLY and isinstance(logs, list)
    # every line is accounted for: carried in the reply, or counted as dropped
    dropped = reply["logs_dropped"]
    assert isinstance(dropped, int) and len(logs) + dropped == OUTPUT_FLOOD_LINES
    fuel_used = reply["fuel_used"]
    assert isinstance(fuel_used, int)
    assert fuel_used >= OUTPUT_FLOOD_LINES * (FUEL_PER_BYTE + FUEL_PER_LINE)


def test_an_endless_output_flood_ends_at_the_deadline_and_the_host_serves_on(env: Env) -> None:
    # compiled first, with no deadline: a run's deadline covers its compile too, and a loaded host's
    # compile alone can outlast 0.5 s (a CompileOverrun would prove nothing about the output flood)
    env.host.compile(FLOOD)
    compiles = env.host.stats["compiles"]
    with pytest.raises(KernelTimeout) as timeout:
        env.host.run(FLOOD, "flood", [], fuel=10**15, timeout_s=0.5)  # fuel enough for ~1,000 s of output
    assert env.host.stats["compiles"] == compiles  # the 0.5 s were the guest's: it ran from the cache
    assert timeout.value.timeout_s == 0.5
    assert env.host.stats["timeouts"] == 1
    assert env.host.run(FLOOD, "once", [], fuel=10**9, timeout_s=60.0)["results"] == [0]
    assert env.counters() == (0, 0)


def test_an_output_flood_runs_out_of_fuel_inside_the_call(env: Env) -> None:
    fuel = 10**8  # less than one call of the flood (1 GiB of newlines) costs
    with pytest.raises(WasmTrap) as trap:
        env.host.run(FLOOD, "flood", [], fuel=fuel, timeout_s=60.0)
    assert trap.value.trap_code == "out_of_fuel"
    with env.host.session(FLOOD, fuel=fuel, timeout_s=60.0) as s, pytest.raises(WasmTrap):
        s.call("flood")
        assert s.fuel_used() == fuel  # the store's fuel is gone, as after guest code ran out


def _lines_guest(count: int) -> bytes:
    """``go``: ``count`` lines through the ``log`` import, then ``count`` through one fd_write."""
    return f"""
(module
  (import "tensorwasm" "log" (func $log (param i32 i32) (result i32)))
  (import "{WASI}" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1 1)
  (data (i32.const 0) "\\40\\00\\00\\00\\{count:02x}\\00\\00\\00")
  (data (i32.const 16) "line")
  (func (export "go") (result i32)
    (local $i i32)
    (memory.fill (i32.const 64) (i32.const 10) (i32.const {count}))
    (loop $next
      (drop (call $log (i32.const 16) (i32.const 4)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $next (i32.lt_u (local.get $i) (i32.const {count}))))
    (call $w (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 32)))
)
""".encode()


def test_logs_dropped_counts_every_line_the_reply_does_not_carry(env: Env) -> None:
    count = 100  # under the run's 256 and the worker's burst of 100 for log; stdout then hits the burst
    reply = env.host.run(_lines_guest(count), "go", [], fuel=10**8, timeout_s=60.0)
    assert reply["results"] == [0]
    logs = reply["logs"]
    assert logs == ["line"] * abi.MAX_LOG_LINES_IN_REPLY and isinstance(logs, list)
    dropped = reply["logs_dropped"]
    assert isinstance(dropped, int) and len(logs) + dropped == 2 * count


def test_output_lines_count_the_rest_of_a_write_in_bulk_once_one_is_dropped() -> None:
    emitted: list[bytes] = []
    dropped: list[int] = []

    def emit(raw: bytes, truncated: bool) -> int:
        emitted.append(raw)
        return 0 if len(emitted) <= 2 else 1  # keeps two lines, then drops

    lines = OutputLines(emit, 64, drop=dropped.append)
    lines.write(b"a\nb\nc\n" + b"x\n" * 10_000 + b"tail")
    assert emitted == [b"a", b"b", b"c"]  # the third was dropped: the other 10,000 only counted
    assert dropped == [10_000] and lines.dropped == 10_000
    lines.write(b" more\n")
    assert emitted[-1] == b"tail more"
