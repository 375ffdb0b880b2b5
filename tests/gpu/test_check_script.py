"""The hardware check script itself, run on the fake driver (``--dry-run-fake --quick``).

This proves the script works - every phase runs, the table and the JSON come
out, timings never decide the exit code - so the few minutes of a real GPU
are not spent on a broken script. It proves nothing about hardware.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.check_gpu import PHASES, Row

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)


def test_dry_run_on_the_fake_passes_every_phase_and_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "check_gpu.py"), "--dry-run-fake", "--quick",
                           "--json-out", str(out)], capture_output=True, text=True, timeout=220, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("PASSED")  # the table comes last
    doc = json.loads(out.read_text())
    assert doc["ok"] is True and doc["fake"] is True
    assert {p.name for p in PHASES} <= set(doc["phases"])
    rows = doc["rows"]
    assert not [r for r in rows if r["kind"] == "check" and r["ok"] is False]
    by_phase = {r["phase"] for r in rows if r["kind"] == "check" and r["ok"] is True}
    assert {"pool", "metering", "isolation", "tenants", "fault", "kernels"} <= by_phase
    fault = doc["phases"]["fault"]
    assert fault["faulty_request"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert fault["last_exit"]["reason"] == "CUDA context lost: CUDA_ERROR_ILLEGAL_ADDRESS"
    iso = doc["phases"]["isolation"]["reader"]
    assert iso["copy_got_a_bytes"] is False and iso["kernel_got_a_bytes"] is False
    assert iso["kernel"] == "CUDA_ERROR_ILLEGAL_ADDRESS" and iso["context_lost"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert any(r["kind"] == "timing" for r in rows)


def test_a_missed_timing_target_never_fails_the_run() -> None:
    miss = Row("timing", "metered / raw", "1.5x", "<= 1.10x", False, "timing")
    fail = Row("pool", "cap", "CUDA_SUCCESS", "OOM", False, "check")
    assert miss.mark == "MISS" and fail.mark == "FAIL"


def test_an_unknown_phase_is_refused() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "check_gpu.py"), "--dry-run-fake",
                           "--only", "nosuch"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "unknown phase" in proc.stderr
