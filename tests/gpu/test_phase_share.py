"""The hardware check's "share" phase on the fake driver and fake cuBLAS: the wiring, not the figures."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.gpu.phase_share import table_rows
from tests.helpers import gpu_dry_run

pytestmark = pytest.mark.timeout(300)


def test_the_share_phase_runs_on_the_fake_and_every_gemm_is_right(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The phase's result as the check's dry run got it from its child (``run(fake=True)`` there; the
    run is shared with tests/gpu/test_check_script.py: tests/helpers/gpu_dry_run.py)."""
    run = gpu_dry_run.dry_run(tmp_path_factory)
    assert run.proc.returncode == 0, gpu_dry_run.why_failed(run.proc)
    result = json.loads(run.json_out.read_text())["phases"]["share"]
    assert result["n"] == 64  # the fake's size: the phase ran with fake=True
    rows = table_rows(result)
    checks = {name: ok for name, _, _, ok, kind in rows if kind == "check"}
    assert checks == {"share: every GEMM under the lease equals A @ B": True,
                      "share 7:3: both tenants did work": True}, rows
    timings = [name for name, _, _, _, kind in rows if kind == "timing"]
    assert len(timings) == 5  # 7:3 time and work, cap, on vs off, gate vs bare
    split = result["split"]
    assert split["grants"] >= 1 and all(t["chunks"] > 0 and t["device_ns"] > 0 for t in split["tenants"])
    assert result["bare"]["tenants"][0]["chunks"] == 1  # the bare loop never went through the gate


def test_a_failed_round_is_one_failed_check() -> None:
    result: dict[str, Any] = {"split": {"error": "RuntimeError: no device"}, "cap": {}, "solo_on": {},
                              "solo_off": {}, "bare": {}}
    (row,) = table_rows(result)
    assert row[3] is False and "no device" in row[1] and row[4] == "check"
    (row,) = table_rows({"error": "share did not finish within 200 s (killed)"})
    assert row[3] is False
