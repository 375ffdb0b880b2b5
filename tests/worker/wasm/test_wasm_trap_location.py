"""A guest's trap says where it happened, and running out of fuel says how much there was and how to
get more: the comforts a C or Zig developer expects from ``twt run``.

In process (tests/helpers/wasm_env.py): a WAT guest whose functions are named (the name section
wat2wasm writes), trapping two calls deep; the file:line of a debug C build is tested with the SDK
(tests/sdk/test_trap_lines.py).
"""

from __future__ import annotations

import pytest

from shared.errors import WasmTrap, error_from_dict
from tests.helpers.wasm_env import make_env

pytestmark = pytest.mark.timeout(60)

NAMED = """
(module
  (func $inner (param i32) (result i32)
    (if (i32.gt_s (local.get 0) (i32.const 2)) (then unreachable))
    (local.get 0))
  (func $middle (param i32) (result i32) (call $inner (i32.add (local.get 0) (i32.const 1))))
  (func (export "run") (param i32) (result i32) (call $middle (local.get 0)))
  (func (export "spin") (loop $l (br $l))))
"""


def test_a_trap_names_its_functions_and_offsets() -> None:
    with make_env(True) as env:
        assert env.host.run(NAMED.encode(), "run", [1], fuel=10**6, timeout_s=5)["results"] == [2]
        with pytest.raises(WasmTrap) as exc:
            env.host.run(NAMED.encode(), "run", [5], fuel=10**6, timeout_s=5)
    trap = exc.value
    assert trap.trap_code == "unreachable"
    frames = trap.location.split(" <- ")
    assert [f.split("+")[0] for f in frames[:2]] == ["inner", "middle"]  # innermost first
    assert all("+0x" in f for f in frames)
    assert f"at {trap.location}" in str(trap)
    again = error_from_dict(trap.to_dict())  # crosses the wire with its location
    assert isinstance(again, WasmTrap) and again.location == trap.location and str(again) == str(trap)


def test_out_of_fuel_names_the_budget_and_the_option() -> None:
    with make_env(True) as env, pytest.raises(WasmTrap) as exc:
        env.host.run(NAMED.encode(), "spin", [], fuel=123_456, timeout_s=5)
    trap = exc.value
    assert trap.trap_code == "out_of_fuel" and trap.fuel_limit == 123_456
    assert "123,456" in str(trap) and "--fuel" in str(trap) and "wasm_fuel" in str(trap)


def test_the_reply_names_the_limits_the_run_had() -> None:
    with make_env(True) as env:
        reply = env.host.run(NAMED.encode(), "run", [0], fuel=5000, timeout_s=2.5)
    assert reply["fuel_limit"] == 5000 and reply["timeout_s"] == 2.5
