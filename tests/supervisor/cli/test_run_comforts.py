"""``twt run`` tells a guest developer what happened: where a trap was, that an asked-for ``--timeout``
or ``--fuel`` was cut to the tenant's ceiling, and with ``--json`` a JSON document in every outcome."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli import twt
from tests.helpers.cluster import supervisor

pytestmark = pytest.mark.timeout(120)

NAMED = """
(module
  (func $boom (unreachable))
  (func (export "run") (call $boom))
  (func (export "ok") (result i32) (i32.const 7))
  (func (export "spin") (loop $l (br $l))))
"""


def test_twt_run_says_where_what_was_capped_and_answers_json(tmp_path: Path) -> None:
    named = tmp_path / "named.wat"
    named.write_text(NAMED)
    # one small module for every run, compiled once (below): the tenant's 0.3 s ceiling keeps the spins short.
    # The fuel ceiling is far above what any host spends in 0.3 s (a tight loop burns a few billion units a
    # second on a fast one), so a spin ends at its deadline, never out of fuel
    with supervisor([{"name": "acme", "wasm_timeout_s": 0.3, "wasm_fuel": 10**13}]) as sup:
        rd = ("--run-dir", sup.run_dir)
        # the module compiled in the tenant's worker first: a run's deadline covers its module's
        # compile, which a loaded host stretches past 0.3 s; the compiled module is kept, so the
        # run is tried again until its compile fitted (a compile cut off restarts the worker)
        while (first := twt("run", "acme", str(named), "--invoke", "ok", *rd)).returncode != 0:
            assert "KernelTimeout" in first.stderr and "compil" in first.stderr, first.stderr

        trap = twt("run", "acme", str(named), "--invoke", "run", *rd)
        assert trap.returncode == 1 and "WasmTrap" in trap.stderr
        assert "at boom+0x" in trap.stderr and "<- run+0x" in trap.stderr

        slow = twt("run", "acme", str(named), "--invoke", "spin", "--timeout", "5", *rd)
        assert slow.returncode == 1 and "KernelTimeout" in slow.stderr
        assert "--timeout 5 s is above tenant acme's ceiling" in slow.stderr and "capped to 0.3 s" in slow.stderr

        ok = twt("run", "acme", str(named), "--invoke", "ok", "--timeout", "9", "--fuel", str(10**14), *rd)
        assert ok.returncode == 0 and "results: [7]" in ok.stdout
        assert "note: --timeout 9 s" in ok.stdout and "capped to 0.3 s" in ok.stdout
        assert "note: --fuel 100,000,000,000,000" in ok.stdout and "capped to 10,000,000,000,000" in ok.stdout

        fuel = twt("run", "acme", str(named), "--invoke", "spin", "--fuel", "5000", *rd)
        assert fuel.returncode == 1 and "out_of_fuel" in fuel.stderr
        assert "5,000 units" in fuel.stderr and "--fuel" in fuel.stderr

        # --json: a document on stdout whatever happens, and the exit status as without it
        for argv, code, check in (
            (("--invoke", "ok"), 0, lambda d: d["ok"] is True and d["results"] == [7]),
            (("--invoke", "run"), 1, lambda d: d["error"]["type"] == "WasmTrap"
             and d["error"]["fields"]["location"].startswith("boom+0x")),
            (("--invoke", "spin", "--timeout", "5"), 1, lambda d: d["error"]["type"] == "KernelTimeout"
             and "capped to 0.3 s" in d["notes"][0]),
            (("--invoke", "nope"), 1, lambda d: d["ok"] is False and d["error"]["message"]),
        ):
            proc = twt("run", "acme", str(named), *argv, "--json", *rd)
            assert proc.returncode == code, proc.stderr
            doc = json.loads(proc.stdout)
            assert check(doc), doc
        missing = twt("run", "acme", str(tmp_path / "absent.wasm"), "--invoke", "ok", "--json", *rd)
        assert missing.returncode == 1 and json.loads(missing.stdout)["error"]["code"] == "os_error"
        compile_error = tmp_path / "bad.wat"
        compile_error.write_text("(module (func")
        bad = twt("run", "acme", str(compile_error), "--invoke", "ok", "--json", *rd)
        assert bad.returncode == 1 and json.loads(bad.stdout)["error"]["type"] == "WasmCompile"
    gone = twt("run", "acme", str(named), "--invoke", "ok", "--json", "--run-dir", sup.run_dir)
    assert gone.returncode == 3 and json.loads(gone.stdout)["error"]["type"] == "SupervisorUnavailable"
