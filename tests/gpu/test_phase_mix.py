"""The hardware check's "mix" phase on the fake driver and fake cuBLAS: the wiring, not the figures."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.gpu.phase_mix import table_rows
from tests.helpers import gpu_dry_run

pytestmark = pytest.mark.timeout(300)


def test_the_mix_phase_runs_on_the_fake_and_its_checks_pass(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Heavy beside chatty, k instances, the holder SIGKILLed mid-chunk (its lease reclaimed, the
    waiter served), the longest hold: every check passes on the fake; the spin kernel is hardware only."""
    run = gpu_dry_run.dry_run(tmp_path_factory)
    assert run.proc.returncode == 0, gpu_dry_run.why_failed(run.proc)
    result = json.loads(run.json_out.read_text())["phases"]["mix"]
    assert result["n"] == 64  # the fake's size: the phase ran with fake=True
    rows = table_rows(result)
    checks = {name: ok for name, _, _, ok, kind in rows if kind == "check"}
    assert checks and all(checks.values()), rows
    assert "mix: holder SIGKILLed mid-chunk, its lease reclaimed, the waiter runs" in checks
    assert result["kill"]["held"] is True
    timings = {name for name, _, _, _, kind in rows if kind == "timing"}
    assert any("chatty wait per op p99" in t for t in timings)
    assert any("3 instances vs 1" in t for t in timings)
    assert any("spin kernel" in t for t in timings)
    chatty = result["gaps"]["0.3"]["mix"]["tenants"][1]
    assert chatty["role"] == "chatty" and len(chatty["waits_ns"]) == chatty["ops"] > 0


def test_a_failed_round_is_a_failed_check() -> None:
    (row,) = table_rows({"error": "mix did not finish within 200 s (killed)"})
    assert row[3] is False and row[4] == "check"
    result: dict[str, Any] = {"gaps": {"0.1": {"control": {"error": "RuntimeError: no device"}, "mix": {}}},
                              "kill": {"error": "the holder never held the device busy"}}
    rows = table_rows(result)
    assert [r[3] for r in rows] == [False, False] and "no device" in rows[0][1]
