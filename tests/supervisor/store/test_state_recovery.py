"""Losing and restoring the state: a lost database or lost commits (a truncated WAL) are refused with one line,
and `twt state backup` of a running supervisor and `twt state restore` bring back tenants and capabilities.

Real supervisors on the stub backend; correctness only.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.spec import TenantSpec
from supervisor.client.launch import launch
from supervisor.store.state import COMMITS_FILE, MARKER_FILE, STATE_FILE
from tests.helpers import zygote
from tests.helpers.cluster import FAST
from tests.helpers.tmp import short_temp_dir

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def run_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="twt-r", dir=short_temp_dir())
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _start(run_dir: str) -> Any:
    return launch({"supervisor": {**FAST, "log_level": "warning"}, "tenant": []}, run_dir=run_dir)


def _supervise(run_dir: str) -> subprocess.CompletedProcess[str]:
    return zygote.run([sys.executable, "-m", "supervisor", "supervise", "--run-dir", run_dir, "--backend", "stub",
                       "--log-level", "error"], timeout=60, cwd=str(REPO))


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
        out = zygote.run([sys.executable, "-m", "supervisor", "state", "backup", str(dest), "--run-dir", run_dir],
                         timeout=60, cwd=str(REPO))
        assert out.returncode == 0, out.stderr
        assert "1 tenants" in out.stdout and "registry key" in out.stdout
        c.register(None, TenantSpec("later"))  # after the backup: not in it
    assert (os.stat(dest).st_mode & 0o777) == 0o600
    state = Path(run_dir) / "state"
    out = zygote.run([sys.executable, "-m", "supervisor", "state", "restore", str(dest), "--run-dir", run_dir],
                     timeout=60, cwd=str(REPO))
    assert out.returncode == 0, out.stderr
    assert "1 tenants" in out.stdout and list(state.glob(STATE_FILE + ".replaced-*"))
    with _start(run_dir) as sup:
        tenants = {t.tenant_id: t for t in sup.client.status().tenants}
        assert sorted(tenants) == ["acme"]
        assert tenants["acme"].memory_quota_bytes == 64 << 20
        sup.client.ping(cap)  # the same registry key: the capability from before the backup works


def _twt(*argv: str) -> subprocess.CompletedProcess[str]:
    return zygote.run([sys.executable, "-m", "supervisor", *argv], timeout=60, cwd=str(REPO))


@pytest.mark.parametrize("loss", ["truncated", "deleted"])
def test_answered_registrations_lost_with_the_wal_stop_the_next_start_every_time(
    run_dir: str, tmp_path: Path, loss: str
) -> None:
    """Registrations and an eviction answered, the supervisor SIGKILLed, its WAL truncated or deleted (a
    backup that copied state.db alone): the next start stops with one StateError naming the recovery."""
    state = Path(run_dir) / "state"
    backup_file = tmp_path / "b.db"
    with _start(run_dir) as sup:
        c = sup.client
        c.register(None, TenantSpec("early"))
        assert _twt("state", "backup", str(backup_file), "--run-dir", run_dir).returncode == 0
        # a reader's snapshot (what a slow backup holds) keeps the checkpoint from folding in what follows
        reader = sqlite3.connect(f"file:{state / STATE_FILE}?mode=ro", uri=True)
        try:
            reader.execute("BEGIN")
            reader.execute("SELECT COUNT(*) FROM tenants").fetchone()
            c.register(None, TenantSpec("acme"))
            c.register(None, TenantSpec("gone"))
            c.evict(None, "gone")
            sup.process.kill()  # a crash: the answered changes are in the WAL only
            sup.process.wait(10)
        finally:
            reader.close()
    wal = state / (STATE_FILE + "-wal")
    assert wal.stat().st_size > 0
    if loss == "truncated":
        os.truncate(wal, 0)
    else:
        wal.unlink()
    (state / (STATE_FILE + "-shm")).unlink(missing_ok=True)
    for _ in range(2):
        out = _supervise(run_dir)
        assert out.returncode == 1, out.stderr
        lines = [line for line in out.stderr.splitlines() if line.startswith("twt:")]
        assert len(lines) == 1 and "StateError" in lines[0] and "committed changes are lost" in lines[0], out.stderr
        assert "twt state restore" in lines[0] and "Traceback" not in out.stderr
        assert not (Path(run_dir) / "supervisor.json").exists()
    check = _twt("state", "check", "--run-dir", run_dir)
    assert check.returncode == 4 and "committed changes are lost" in check.stdout, check.stdout + check.stderr
    restored = _twt("state", "restore", str(backup_file), "--run-dir", run_dir)  # the operator's way back
    assert restored.returncode == 0, restored.stderr
    with _start(run_dir) as sup:
        assert [t.tenant_id for t in sup.client.status().tenants] == ["early"]
    assert int((state / COMMITS_FILE).read_text()) >= 1


def test_backup_restore_and_check_honour_a_configs_state_dir(tmp_path: Path) -> None:
    run_dir = tempfile.mkdtemp(prefix="twt-r", dir=short_temp_dir())
    try:
        state = tmp_path / "elsewhere"
        config = tmp_path / "twt.toml"
        config.write_text(f'[supervisor]\nrun_dir = "{run_dir}"\nstate_dir = "{state}"\nbackend = "stub"\n'
                          'pool_size = 0\n[[tenant]]\nname = "filet"\n')
        with launch(str(config), run_dir=run_dir) as sup:
            assert [t.tenant_id for t in sup.client.status().tenants] == ["filet"]
            out = _twt("state", "backup", str(tmp_path / "b.db"), "--config", str(config))
            assert out.returncode == 0, out.stderr
            assert str(state / STATE_FILE) in out.stdout and "1 tenants" in out.stdout
            check = _twt("state", "check", "--config", str(config))
            assert check.returncode == 0 and "a supervisor holds the state" in check.stdout, check.stdout
            busy = _twt("state", "restore", str(tmp_path / "b.db"), "--config", str(config))
            assert busy.returncode == 1 and "in use by another supervisor" in busy.stderr
        assert not (Path(run_dir) / "state" / STATE_FILE).exists()  # never the run dir's default
        out = _twt("state", "restore", str(tmp_path / "b.db"), "--config", str(config))
        assert out.returncode == 0 and str(state / STATE_FILE) in out.stdout, out.stderr
        pre = _twt("check-config", str(config), "--state")
        assert pre.returncode == 0 and "1 tenants" in pre.stdout, pre.stdout + pre.stderr
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_check_config_lists_every_mistake_with_the_duplicate_names_in_the_first_pass(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[supervisor]\nmax_tenant = 3\n[[tenant]]\nname = "acme"\n[[tenant]]\nname = "beta"\n'
                   'memory_quota_bytes = "lots"\n[[tenant]]\nname = "acme"\n')
    out = _twt("check-config", str(bad))
    assert out.returncode == 4, out.stderr
    assert "3 mistakes" in out.stderr and "max_tenants" in out.stderr and "'lots'" in out.stderr
    assert "tenant 'acme' listed twice in the config ([[tenant]] #1, #3)" in out.stderr
    assert "Traceback" not in out.stderr
