"""Losing and restoring the state: a lost database is refused with one line where one was
initialized before, and `twt state backup` of a running supervisor restores tenants and capabilities.

Real supervisors on the stub backend; correctness only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.spec import TenantSpec
from supervisor.client.launch import launch
from supervisor.store.state import MARKER_FILE, STATE_FILE
from tests.helpers.cluster import FAST
from tests.helpers.tmp import short_temp_dir

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def run_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="twt-r", dir=short_temp_dir())
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _start(run_dir: str) -> Any:
    return launch({"supervisor": {**FAST, "log_level": "warning"}, "tenant": []}, run_dir=run_dir)


def _supervise(run_dir: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor", "supervise", "--run-dir", run_dir, "--backend", "stub",
                           "--log-level", "error"], capture_output=True, text=True, timeout=60, cwd=REPO)


def test_a_lost_wal_or_database_is_refused_with_one_line_not_a_silent_first_start(run_dir: str) -> None:
    with _start(run_dir) as sup:
        sup.client.register(None, TenantSpec("acme"))
    state = Path(run_dir) / "state"
    assert (state / MARKER_FILE).exists()
    for suffix in ("", "-wal", "-shm"):
        (state / (STATE_FILE + suffix)).unlink(missing_ok=True)
    out = _supervise(run_dir)
    assert out.returncode == 1, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("twt:")]
    assert len(lines) == 1 and "StateError" in lines[0] and "initialized before" in lines[0], out.stderr
    assert "Traceback" not in out.stderr
    assert not (state / STATE_FILE).exists()
    assert not (Path(run_dir) / "supervisor.json").exists()


def test_a_backup_of_a_running_supervisor_restores_tenants_and_capabilities(run_dir: str, tmp_path: Path) -> None:
    dest = tmp_path / "backup.db"
    with _start(run_dir) as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("acme"))
        c.set_quota(None, "acme", memory_quota_bytes="64MiB")
        out = subprocess.run([sys.executable, "-m", "supervisor", "state", "backup", str(dest), "--run-dir", run_dir],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
        assert out.returncode == 0, out.stderr
        assert "1 tenants" in out.stdout and "registry key" in out.stdout
        c.register(None, TenantSpec("later"))  # after the backup: not in it
    assert (os.stat(dest).st_mode & 0o777) == 0o600
    state = Path(run_dir) / "state"
    for suffix in ("", "-wal", "-shm"):
        (state / (STATE_FILE + suffix)).unlink(missing_ok=True)
    shutil.copyfile(dest, state / STATE_FILE)
    with _start(run_dir) as sup:
        tenants = {t.tenant_id: t for t in sup.client.status().tenants}
        assert sorted(tenants) == ["acme"]
        assert tenants["acme"].memory_quota_bytes == 64 << 20
        sup.client.ping(cap)  # the same registry key: the capability from before the backup works
