"""One ``check_gpu.py --dry-run-fake --quick`` per test run, for every test that reads it.

The hardware check's dry run on the fake driver takes about 10 s of CPU (30 s of wall time, most of
it the share phase's timed rounds). Three test modules read one: tests/gpu/test_check_script.py (the
phases, the JSON, the figures the docs name), tests/gpu/test_phase_share.py (the share phase's
result) and tests/worker/backends/test_replay_bindings.py (every driver, NVRTC and cuBLAS call the check
makes, recorded through ``FAKE_CUDA_RECORD_CALLS`` and replayed into the real bindings). Each used
to run its own. :func:`dry_run` runs it once, with the calls recorded, and hands every caller the
same result:

* in one process, from memory;
* across pytest-xdist workers (loadscope puts the three modules on different workers), through a
  directory shared by the run's workers (the parent of the worker's pytest base temp, named after
  xdist's run id): the first worker to take its lock runs the check and writes the result; the
  others wait on the lock (a blocked ``flock``: no CPU) and read it. A worker that died halfway
  leaves no result, so the next one runs the check itself.

Every caller gets the record directory read-only by convention: a test that adds calls of its own
copies the records first (see test_replay_bindings).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import timeouts

__all__ = ["DryRun", "dry_run", "why_failed"]

ROOT = Path(__file__).resolve().parents[2]
#: the check's own timeout inside a test: a hang guard, scaled as every test timeout is (the check
#: runs first, beside the run's heaviest modules: on a busy machine its ~35 s took over 220 s);
#: the reading tests' pytest timeouts are larger
TIMEOUT_S = timeouts.scaled(200)


@dataclass(frozen=True)
class DryRun:
    """What one dry run left: its exit, output, JSON file and the calls it made through the fakes."""

    proc: subprocess.CompletedProcess[str]
    json_out: Path
    record_dir: Path


_memo: list[DryRun] = []


def _shared_dir(factory: pytest.TempPathFactory) -> Path:
    base = factory.getbasetemp()
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id and base.name.startswith("popen-gw"):  # an xdist worker: its siblings share the parent
        path = base.parent / f"gpu-dry-run-{run_id[:16]}"
    else:
        path = base / "gpu-dry-run"
    path.mkdir(exist_ok=True)
    return path


def _run(where: Path) -> DryRun:
    out, records = where / "check.json", where / "calls"
    records.mkdir(exist_ok=True)
    env = {**os.environ, "FAKE_CUDA_RECORD_CALLS": str(records), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "check_gpu.py"), "--dry-run-fake", "--quick",
                           "--json-out", str(out)], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT,
                          env=env)
    return DryRun(proc, out, records)


def dry_run(factory: pytest.TempPathFactory) -> DryRun:
    """The run's one dry run of the hardware check (with its calls recorded); see the module docstring."""
    if _memo:
        return _memo[0]
    where = _shared_dir(factory)
    done = where / "done.json"
    with open(where / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held while the check runs; a waiting worker blocks here
        try:
            if done.exists():
                doc = json.loads(done.read_text())
                result = DryRun(subprocess.CompletedProcess(doc["args"], doc["returncode"], doc["stdout"], doc["stderr"]),
                                where / "check.json", where / "calls")
            else:
                result = _run(where)
                p = result.proc
                tmp = where / "done.json.tmp"
                tmp.write_text(json.dumps({"args": p.args, "returncode": p.returncode, "stdout": p.stdout,
                                           "stderr": p.stderr}))
                tmp.rename(done)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    _memo.append(result)
    return result


def why_failed(proc: subprocess.CompletedProcess[str]) -> str:
    """What a failed dry run says: its FAIL rows first (a check that failed may be far from the
    end of a long table), then the ends of its output."""
    fails = [line for line in proc.stdout.splitlines() if line.startswith("FAIL") or " FAIL " in line[:20]]
    return "\n".join(["failed checks:", *fails, "--- stdout (end):", proc.stdout[-2000:],
                      "--- stderr (end):", proc.stderr[-2000:]])
