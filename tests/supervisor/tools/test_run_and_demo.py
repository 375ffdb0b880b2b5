"""WASM end to end: run_wasm through a real supervisor and worker, ``twt run``, and ``twt demo``."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import pytest
import wasmtime

from shared.errors import InvalidArgument, KernelTimeout, UnknownModule, WasmCompile, WasmTrap
from shared.spec import TenantSpec
from supervisor.cli.commands.run_wasm import parse_wasm_arg
from supervisor.tools.demo import guest_path
from tests.helpers.cli import twt
from tests.helpers.cluster import instance_pid, supervisor, tenant

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
#: a run's deadline covers its module's compile: where a test needs every run to finish, the tenant's
#: ceiling is a hang guard (a loaded host took more than 0.3 s to compile the probe guest), and the
#: ceiling that a test asserts is checked with SPIN, a module whose compile is negligible
HANG_GUARD_S = 60.0
SPIN = b'(module (func (export "spin") (loop $l (br $l))))'


def test_run_wasm_through_the_supervisor() -> None:
    spec = TenantSpec.from_dict({"tenant_id": "acme", "gpu_memory_bytes_cap": 16 * MiB,
                                 "wasm_timeout_s": HANG_GUARD_S, "wasm_fuel": 10**12})
    # the spins end at their deadline, never out of fuel: a tight loop burns a few billion units a second on
    # a fast host, more than the default ceiling holds in 0.5 s
    capped_spec = TenantSpec.from_dict({"tenant_id": "capped", "wasm_timeout_s": 0.5, "wasm_fuel": 10**13})
    traps = guest_path("traps").read_bytes()
    with supervisor() as sup:
        c = sup.client
        cap = c.register(None, spec)
        capped = c.register(None, capped_spec)
        pid = instance_pid(sup, "acme")
        assert c.run_wasm(cap, guest_path("probe").read_bytes(), "add", [2, 3]).results == (5,)

        # every way of failing arrives typed, and the same worker serves the next run
        with pytest.raises(WasmTrap) as trap:
            c.run_wasm(cap, traps, "unreachable")
        assert trap.value.trap_code == "unreachable"
        with pytest.raises(WasmTrap) as trap:
            c.run_wasm(cap, traps, "recurse", [0])
        assert trap.value.trap_code == "stack_overflow"
        with pytest.raises(WasmTrap) as trap:
            c.run_wasm(cap, traps, "spin", fuel=1000)
        assert trap.value.trap_code == "out_of_fuel"
        with pytest.raises(KernelTimeout) as timeout:
            c.run_wasm(cap, traps, "spin", timeout_s=0.5)  # the run's own deadline
        assert timeout.value.timeout_s == 0.5
        with pytest.raises(KernelTimeout) as timeout:
            c.run_wasm(capped, SPIN, "spin", timeout_s=60)  # capped to the spec's 0.5 s
        assert timeout.value.timeout_s == 0.5
        with pytest.raises(WasmCompile):
            c.run_wasm(cap, os.urandom(64), "f")
        with pytest.raises(InvalidArgument):
            c.run_wasm(cap, traps, "ok", [1])
        assert c.run_wasm(cap, traps, "grow", [1 << 16]).results == (-1,)
        assert c.run_wasm(cap, traps, "ok").results == (42,)
        assert instance_pid(sup, "acme") == pid
        assert tenant(c.status(), "acme").restarts == 0 and tenant(c.status(), "capped").restarts == 0

        # a module stored once, run by digest
        digest = c.put_module(cap, traps)
        reply = c.run_wasm(cap, digest, "ok")
        assert reply.results == (42,) and reply.cached is True
        with pytest.raises(UnknownModule):
            c.run_wasm(cap, "ab" * 32, "ok")

        # client buffers in, results checked against numpy
        n = 30_000
        rng = np.random.default_rng(3)
        x, y = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
        hx, hy = c.alloc(cap, 4 * n), c.alloc(cap, 4 * n)
        c.write(cap, hx, x.tobytes())
        c.write(cap, hy, y.tobytes())
        reply = c.run_wasm(cap, guest_path("axpy_sum").read_bytes(), "run", [{"handle": hx}, {"handle": hy}, n, 2.0])
        total, status = reply.results
        ref = np.float32(2.0) * x + y
        assert status == 0
        np.testing.assert_array_equal(np.frombuffer(c.read(cap, hy, 4 * n), dtype=np.float32), ref)
        assert np.float32(total) == np.add.reduce(ref, dtype=np.float32)
        assert c.buffers(cap) == {hx: 4 * n, hy: 4 * n}  # the client's buffers outlive the run
        c.free(cap, hx)
        c.free(cap, hy)

        # the guest over its cap gets the error code, and everything is released
        assert c.run_wasm(cap, guest_path("overcap").read_bytes(), "run", [MiB, 32 * MiB]).results == (-5,)
        q = c.quota(cap)
        assert (q.gpu_bytes_in_use, q.bytes_in_use) == (0, 0)
        assert q.cpu_high_water >= 65536  # linear memory was charged to the host quota while it ran


def test_parse_wasm_arg() -> None:
    assert parse_wasm_arg("42") == 42
    assert parse_wasm_arg("-0x10") == -16
    assert parse_wasm_arg("2.5") == 2.5
    assert parse_wasm_arg("handle=0x100") == {"handle": 256}
    for bad in ("abc", "1.2.3", "handle=x"):
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            parse_wasm_arg(bad)


def test_twt_run_end_to_end(tmp_path: Path) -> None:
    wat = tmp_path / "add.wat"
    wat.write_bytes(guest_path("probe").read_bytes())
    wasm = tmp_path / "traps.wasm"
    wasm.write_bytes(bytes(wasmtime.wat2wasm(guest_path("traps").read_text())))
    spin = tmp_path / "spin.wat"
    spin.write_bytes(SPIN)
    with supervisor([{"name": "acme", "wasm_timeout_s": HANG_GUARD_S}, {"name": "capped", "wasm_timeout_s": 0.3,
                                                                             "wasm_fuel": 10**13}]) as sup:
        rd = sup.run_dir
        ok = twt("run", "acme", str(wat), "--invoke", "add", "--arg", "2", "--arg", "3", "--run-dir", rd)
        assert ok.returncode == 0, ok.stderr
        assert "results: [5]" in ok.stdout and "fuel used" in ok.stdout

        js = twt("run", "acme", str(wasm), "--invoke", "ok", "--json", "--run-dir", rd)
        assert js.returncode == 0, js.stderr
        assert json.loads(js.stdout)["results"] == [42]

        trap = twt("run", "acme", str(wasm), "--invoke", "unreachable", "--run-dir", rd)
        assert trap.returncode == 1
        assert "WasmTrap" in trap.stderr and "unreachable" in trap.stderr

        slow = twt("run", "capped", str(spin), "--invoke", "spin", "--timeout", "5", "--run-dir", rd)
        assert slow.returncode == 1 and "KernelTimeout" in slow.stderr and "0.3 s" in slow.stderr

        unknown = twt("run", "nobody", str(wat), "--invoke", "add", "--run-dir", rd)
        assert unknown.returncode == 1 and "UnknownTenant" in unknown.stderr

        usage = twt("run", "acme", str(wat), "--run-dir", rd)
        assert usage.returncode == 2 and "--invoke" in usage.stderr
        assert tenant(sup.client.status(), "acme").restarts == 0
        assert tenant(sup.client.status(), "capped").restarts == 0
    gone = twt("run", "acme", str(wat), "--invoke", "add", "--run-dir", rd)
    assert gone.returncode == 3


@pytest.mark.timeout(420)  # the demo builds its C guest: on a busy machine, maybe the first C build of the cache
def test_twt_demo_exits_zero() -> None:
    result = twt("demo", "--backend", "stub", timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for name in ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot"):
        assert name in out
    assert "GPU_QUOTA" in out and "KernelTimeout" in out and "WorkerLost" in out
    assert "probabilities == numpy, classes ==" in out
    assert "UNEXPECTED" not in out
    assert "f32 == numpy" in out and "bf16 == numpy" in out  # the C-built transformer block
    assert "demo: all 6 outcomes as expected" in out


def test_launch_puts_this_checkout_first_on_the_childs_path() -> None:
    """The launched supervisor imports the package directory's *parent* (the regroup into
    subpackages once moved launch.py a level down and put supervisor/ itself there, so
    ``python -m supervisor`` found supervisor/supervisor.py from any other working directory)."""
    from supervisor.client.launch import CHECKOUT

    assert (CHECKOUT / "supervisor" / "__init__.py").is_file()
    assert (CHECKOUT / "worker" / "__init__.py").is_file()


def test_a_supervisor_launched_from_another_directory_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a caller outside the checkout (the bench did this)
    with supervisor([{"name": "away"}]) as sup:
        assert sup.client.ping(sup.client.tenant_capability(None, "away")).tenant == "away"
