"""What survives a supervisor restart on the same state directory: stored modules (per tenant, content-
addressed, removed on eviction), a failed tenant's state, and a tenant stored by a newer version.

Real supervisors on the stub backend; correctness only.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.errors import UnknownModule
from shared.spec import TenantSpec
from supervisor.client.launch import launch
from supervisor.store.modules import MODULES_DIR
from supervisor.store.state import STATE_FILE
from tests.helpers.cluster import FAST, tenant, wait_for
from tests.helpers.tmp import short_temp_dir

pytestmark = pytest.mark.timeout(240)

ONE = b'(module (func (export "one") (result i32) i32.const 1))'
TWO = b'(module (func (export "two") (result i32) i32.const 2))'


@pytest.fixture
def run_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="twt-m", dir=short_temp_dir())
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _start(run_dir: str, tenants: list[dict[str, Any]] | None = None) -> Any:
    return launch({"supervisor": {**FAST, "log_level": "warning"}, "tenant": tenants or []}, run_dir=run_dir)


def _module_files(run_dir: str) -> list[Path]:
    return sorted(p for p in (Path(run_dir) / "state" / MODULES_DIR).rglob("*") if p.is_file())


def test_stored_modules_survive_a_restart_per_tenant_and_go_with_an_eviction(run_dir: str) -> None:
    with _start(run_dir) as sup:
        c = sup.client
        acme = c.register(None, TenantSpec("acme"))
        beta = c.register(None, TenantSpec("beta"))
        gone = c.register(None, TenantSpec("gone"))
        one = c.put_module(acme, ONE)
        two = c.put_module(beta, TWO)
        c.put_module(gone, ONE)
        assert c.run_wasm(acme, one, "one").results == (1,)
    files = _module_files(run_dir)
    assert {f.name for f in files} == {f"{one}.wasm", f"{two}.wasm"} and len(files) == 3
    assert all(f.stat().st_mode & 0o077 == 0 for f in files)
    with _start(run_dir) as sup:  # the same state directory: run by digest without sending the module again
        c = sup.client
        assert c.run_wasm(acme, one, "one").results == (1,)
        assert c.run_wasm(beta, two, "two").results == (2,)
        with pytest.raises(UnknownModule):
            c.run_wasm(beta, one, "one")  # another tenant's module is never served
        assert c.status().supervisor.held_bytes["modules"] == len(ONE) * 2 + len(TWO)  # counted as before
        c.evict(None, "gone")
        wait_for(lambda: not (Path(run_dir) / "state" / MODULES_DIR / "gone").exists(), timeout_s=20,
                 what="the evicted tenant's modules removed")
        again = c.register(None, TenantSpec("gone"))
        with pytest.raises(UnknownModule):
            c.run_wasm(again, one, "one")  # a new registration starts with none


def test_a_module_file_changed_on_disk_is_dropped_not_served(run_dir: str) -> None:
    with _start(run_dir) as sup:
        cap = sup.client.register(None, TenantSpec("acme"))
        one = sup.client.put_module(cap, ONE)
    [path] = _module_files(run_dir)
    path.write_bytes(TWO)  # what a writer behind our back could do: the name is no longer its content
    assert hashlib.sha256(TWO).hexdigest() != one
    with _start(run_dir) as sup:
        with pytest.raises(UnknownModule):
            sup.client.run_wasm(cap, one, "one")
        assert sup.client.status().supervisor.held_bytes["modules"] == 0
    assert not path.exists()


def test_a_failed_tenant_is_still_failed_after_a_crash_and_after_its_config_entry_changed(run_dir: str) -> None:
    config = [{"name": "flaky", "restart": "always", "max_restarts": 0}]
    with _start(run_dir, config) as sup:
        c = sup.client
        c.inject_fault(None, "flaky", "crash")
        wait_for(lambda: tenant(c.status(), "flaky").state == "failed", timeout_s=20, what="flaky failed")
        sup.process.kill()
        sup.process.wait(10)
    with _start(run_dir, config) as sup:
        rec = tenant(sup.client.status(), "flaky")
        assert rec.state == "failed" and rec.pids == (), rec
    changed = [{**config[0], "memory_quota_bytes": "64MiB"}]  # the file's entry edited while it was down
    with _start(run_dir, changed) as sup:
        rec = tenant(sup.client.status(), "flaky")
        assert rec.state == "failed" and rec.pids == () and rec.memory_quota_bytes == 64 << 20, rec


def test_a_tenant_stored_by_a_newer_version_is_restored_without_its_unknown_field(run_dir: str) -> None:
    with _start(run_dir) as sup:
        cap = sup.client.register(None, TenantSpec("acme"))
    db = Path(run_dir) / "state" / STATE_FILE
    conn = sqlite3.connect(db)
    spec = json.loads(conn.execute("SELECT spec FROM tenants").fetchone()[0])
    conn.execute("UPDATE tenants SET spec = ?", (json.dumps({**spec, "future_field": 7}),))
    conn.commit()
    conn.close()
    with _start(run_dir) as sup:
        assert sup.client.ping(cap).tenant == "acme"
        wait_for(lambda: tenant(sup.client.status(), "acme").state == "running", timeout_s=30, what="acme running")
    conn = sqlite3.connect(db)
    assert json.loads(conn.execute("SELECT spec FROM tenants").fetchone()[0])["future_field"] == 7  # kept
    conn.close()
