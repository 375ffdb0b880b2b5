"""The hardware check's tenancy phases on the fake driver: each ran in the check's dry run, its rows are
well-formed, and its checks pass where the fake can model them (the figures are the hardware's).

wasm_share, foreign, sync_cpu, settle, budget_burst, residual_full, overrun: the dry run is the run's one
``check_gpu.py --dry-run-fake --quick`` (tests/helpers/gpu_dry_run.py), shared with
test_check_script.py, test_phase_share.py and test_phase_mix.py; the tests here only read its JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.gpu import (phase_budget_burst, phase_foreign, phase_overrun, phase_residual_full, phase_settle,
                       phase_sync_cpu, phase_wasm_share)
from tests.helpers import gpu_dry_run

pytestmark = pytest.mark.timeout(300)

TableRows = Callable[[dict[str, Any]], list[tuple[str, str, str, bool | None, str]]]
MODULES: dict[str, TableRows] = {
    "wasm_share": phase_wasm_share.table_rows,
    "foreign": phase_foreign.table_rows,
    "sync_cpu": phase_sync_cpu.table_rows,
    "settle": phase_settle.table_rows,
    "budget_burst": phase_budget_burst.table_rows,
    "residual_full": phase_residual_full.table_rows,
    "overrun": phase_overrun.table_rows,
}


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run = gpu_dry_run.dry_run(tmp_path_factory)
    assert run.proc.returncode == 0, gpu_dry_run.why_failed(run.proc)
    result: dict[str, Any] = json.loads(run.json_out.read_text())
    return result


def _rows(doc: dict[str, Any], phase: str) -> list[dict[str, Any]]:
    return [r for r in doc["rows"] if r["phase"] == phase]


@pytest.mark.parametrize("phase", sorted(MODULES))
def test_the_phase_ran_on_the_fake_and_its_rows_are_well_formed(doc: dict[str, Any], phase: str) -> None:
    """Each phase's rows reached the table: checks all pass, every timing names its bound."""
    result = doc["phases"][phase]
    assert "error" not in result, result
    rows = _rows(doc, phase)
    checks = [r for r in rows if r["kind"] == "check"]
    timings = [r for r in rows if r["kind"] == "timing"]
    assert checks and all(r["ok"] is True for r in checks), checks
    assert timings, rows
    for r in timings:
        assert r["want"] and r["got"] and r["mark"] in ("PASS", "MISS", "----"), r
    # the table the orchestrator printed is what table_rows gives for the phase's JSON
    again = MODULES[phase](result)
    assert [(n, ok, kind) for n, _, _, ok, kind in again] == [(r["name"], r["ok"], r["kind"]) for r in rows]


def test_wasm_share_went_through_the_supervisor_with_both_rounds(doc: dict[str, Any]) -> None:
    r = doc["phases"]["wasm_share"]
    assert r["load"] == "chatty"  # the fake's load: no cuBLAS in a supervised worker there
    split = r["split"]["tenants"]
    assert split["w7"]["device_ns"] > 0 and split["w3"]["device_ns"] > 0  # charged by the workers' gates
    assert r["chatty"]["tenants"]["chatty"]["waits_s"]  # one reply's gpu_wait_s per chatty run


def test_foreign_ran_a_process_off_the_board(doc: dict[str, Any]) -> None:
    tenants = doc["phases"]["foreign"]["foreign"]["tenants"]
    assert [t["tenant"] for t in tenants] == ["a", "b", ""]
    assert tenants[2]["role"] == "foreign" and tenants[2]["device_ns"] == 0  # no gate: nothing charged


def test_sync_cpu_measured_both_waits(doc: dict[str, Any]) -> None:
    r = doc["phases"]["sync_cpu"]
    assert r["bare_wall_s"] > 0 and r["gate_wall_s"] > 0 and r["gate_chunks"] >= r["reps"]


def test_settle_ran_both_ways_with_fewer_settles_than_chunks(doc: dict[str, Any]) -> None:
    r = doc["phases"]["settle"]
    for work in ("small", "gemm"):
        sync, queued = r[work]["sync"], r[work]["queued"]
        assert sync["timer"] == "CudaEventTimer" and sync["settles"] == 0 and sync["chunks"] >= r["reps"]
        assert queued["timer"] == "CudaStretchTimer" and 0 < queued["settles"] < queued["chunks"]
        assert queued["charged_s"] > 0


def test_budget_burst_started_eight_and_counted_their_bytes(doc: dict[str, Any]) -> None:
    r = doc["phases"]["budget_burst"]
    assert r["tenants"] == 8 and all(x.get("served") for x in r["results"])
    assert r["tenant_bytes"] == 8 * phase_budget_burst.ALLOC_BYTES
    (hw,) = [row for row in _rows(doc, "budget_burst") if "cuMemGetInfo" in row["name"]]
    assert hw["ok"] is None and "hardware only" in hw["got"]  # the fake has a device per process


def test_residual_full_reader_took_most_of_its_device(doc: dict[str, Any]) -> None:
    r = doc["phases"]["residual_full"]
    for how in ("free_trim", "kill"):
        reader = r[how]["reader"]
        assert reader["mark_floats_found"] == 0
        assert reader["mib"] * (1 << 20) >= 0.75 * reader["total"], reader
    assert r["free_trim"]["writer_freed"]["reserved_after_trim"] == 0


def test_overrun_stopped_the_run_and_timed_it(doc: dict[str, Any]) -> None:
    r = doc["phases"]["overrun"]
    assert r["overrun_error"] == "KernelTimeout"
    assert r["overrun_reply_s"] >= r["deadline_s"]


@pytest.mark.parametrize("phase", sorted(MODULES))
def test_a_phase_that_failed_is_one_failed_check(phase: str) -> None:
    (row,) = MODULES[phase]({"error": "RuntimeError: no device"})
    assert row[3] is False and row[4] == "check" and "no device" in row[1]


def test_hardware_figures_decide_the_timing_rows() -> None:
    """On hardware figures the bounds apply: a spinning sync, an under-counting budget, an overshoot MISS."""
    spin = phase_sync_cpu.table_rows({"n": 8192, "reps": 10, "correct": True, "enqueue_s": 0.001,
                                      "bare_wall_s": 0.2, "bare_cpu_s": 0.19, "gate_wall_s": 0.2,
                                      "gate_cpu_s": 0.01, "gate_chunks": 90})
    assert [r[3] for r in spin] == [True, False, True]
    burst = {"tenants": 8, "alloc_bytes": 64 << 20, "fake": False, "budget_used_before": 0,
             "results": [{"served": True}] * 8, "budget_used_after": 600 << 20, "budget_refusals": 0,
             "tenant_bytes": 512 << 20, "before": {"free": 100 << 30}, "after": {"free": (100 << 30) - (700 << 20)}}
    assert [r[3] for r in phase_budget_burst.table_rows(burst)] == [True, True, False]  # 600 counted, 700 taken
    burst["after"] = {"free": (100 << 30) - (610 << 20)}
    assert phase_budget_burst.table_rows(burst)[2][3] is True
    over = {"n": 1, "deadline_s": 0.5, "quantum_s": 0.01, "overrun_error": None, "overrun_reply_s": 3.0,
            "light": {"waits_s": [0.001], "runs": 3, "right": True}, "flood_serves_again": True,
            "per_op_s": {"long": 1e-4, "short": 1e-4}, "ops": {"long": 4096, "short": 64}}
    rows = phase_overrun.table_rows(over)
    assert rows[0][3] is False and rows[3][3] is False  # never stopped: a failed check, and no overshoot PASS
