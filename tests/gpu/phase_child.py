"""Running one phase of the hardware check in a fresh process (the orchestrator never initialises
CUDA): the phase script with this checkout on ``PYTHONPATH``, on the fake driver when the check
runs with ``--dry-run-fake``; its result is the last JSON line it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["last_json_line", "run_phase_script"]


def run_phase_script(script: str, *, quick: bool, fake_flag: str, timeout_s: float
                     ) -> subprocess.CompletedProcess[str] | None:
    """Run ``script``; None when it did not finish within ``timeout_s`` (it is killed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    fake = os.environ.get("GPU_CHECK_DRIVER_MODULE") == "tests.helpers.fake_cuda"
    argv = [sys.executable, script, *(["--quick"] if quick else []), *([fake_flag] if fake else [])]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None


def last_json_line(phase: str, proc: subprocess.CompletedProcess[str] | None, timeout_s: float) -> dict[str, Any]:
    """The phase's result, or ``{"phase", "error"}`` saying why there is none."""
    if proc is None:
        return {"phase": phase, "error": f"{phase} did not finish within {timeout_s:.0f} s (killed)"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"phase": phase, "error": f"{phase} exit {proc.returncode}: " + " | ".join(tail)}
    result: dict[str, Any] = json.loads(lines[-1])
    return result
