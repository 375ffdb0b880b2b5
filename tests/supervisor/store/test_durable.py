"""A durable service: state across restarts, rotate-key, reset, rolling restart, reload, stall, audit.

Real supervisors on the stub backend; correctness only (no timing is asserted).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from shared.capability import TenantCapability
from shared.errors import CapabilityRevoked, ConfigError, TenantIsolationViolation
from shared.spec import TenantSpec
from shared.records import ReloadChange
from supervisor.observe.events import TOPIC_PREFIX, decode_event
from supervisor.client.launch import SupervisorHandle, launch
from supervisor.store.rundir import read_admin_capability
from tests.helpers import zygote
from tests.helpers.cluster import FAST, tenant, wait_for
from tests.helpers.tmp import short_temp_dir

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def run_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="twt-d", dir=short_temp_dir())
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _start(run_dir: str, tenants: list[dict[str, Any]] | None = None, **settings: Any) -> Any:
    return launch({"supervisor": {**FAST, "log_level": "warning", **settings}, "tenant": tenants or []},
                  run_dir=run_dir)


def _pids(sup: SupervisorHandle, tid: str) -> list[int]:
    return [i.pid for i in tenant(sup.client.status(), tid).instances if i.state == "ready"]


def _running(sup: SupervisorHandle, tid: str, n: int) -> bool:
    rec = tenant(sup.client.status(), tid)
    return rec.state == "running" and len(_pids(sup, tid)) == n


def _gone(pids: list[int]) -> bool:
    def dead(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    return all(dead(p) for p in pids)


class _Events:
    """Collects published events on a thread, on one SUB socket for the whole test."""

    def __init__(self, run_dir: str, kinds: tuple[str, ...]) -> None:
        self.seen: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        for kind in kinds:
            self._sock.setsockopt(zmq.SUBSCRIBE, TOPIC_PREFIX + kind.encode())
        self._sock.connect("ipc://" + os.path.join(run_dir, "events.ipc"))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(100):
                self.seen.append(decode_event(self._sock.recv_multipart()))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.seen if e.get("event") == kind]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)


# ----------------------------------------------------------------------- restart


def test_a_restarted_supervisor_brings_back_tenants_changes_and_capabilities(run_dir: str) -> None:
    config = [{"name": "filet", "memory_quota_bytes": "64MiB"}]
    with _start(run_dir, config, pool_size=1) as sup:
        c = sup.client
        cap_rt = c.register(None, TenantSpec("rt").with_memory_quota_bytes("32MiB"))
        cap_file = c.tenant_capability(None, "filet")
        c.set_quota(None, "rt", gpu_memory_bytes_cap="64MiB")
        c.scale(None, "rt", 2)
        wait_for(lambda: _running(sup, "rt", 2), timeout_s=30, what="rt scaled to 2")
        cap_gone = c.register(None, TenantSpec("gone"))
        c.evict(None, "gone")
        c.alloc(cap_rt, 1 << 20)
        assert c.quota(cap_rt).gpu_bytes_in_use == 1 << 20
        admin_before = read_admin_capability(run_dir)
        old_pids = [p for rec in c.status().tenants for p in rec.pids]
        sup.process.kill()  # a crash: no graceful stop
        sup.process.wait(10)
        wait_for(lambda: _gone(old_pids), timeout_s=10, what="the old workers gone with their supervisor")
    with _start(run_dir, config, pool_size=1) as sup:
        c = sup.client
        assert read_admin_capability(run_dir) == admin_before  # the admin capability is the same
        status = c.status()
        assert sorted(t.tenant_id for t in status.tenants) == ["filet", "rt"]
        rt = tenant(status, "rt")
        assert rt.gpu_memory_bytes_cap == 64 << 20 and rt.memory_quota_bytes == 32 << 20
        wait_for(lambda: _running(sup, "rt", 2), timeout_s=30, what="rt restored with 2 instances")
        assert c.ping(cap_rt).tenant == "rt" and c.ping(cap_file).tenant == "filet"
        with pytest.raises(CapabilityRevoked):
            c.ping(cap_gone)  # evicted before the restart: still revoked
        # the buffers died with the old workers; their quota is not held any more
        assert c.quota(cap_rt).gpu_bytes_in_use == 0 and c.buffers(cap_rt) == {}
        assert c.register(None, TenantSpec("gone")).generation == cap_gone.generation + 1


def test_a_failed_tenant_stays_failed_across_a_restart_and_reset_starts_it_with_the_same_capability(
    run_dir: str,
) -> None:
    with _start(run_dir) as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("flaky").with_restart("always", max_restarts=0))
        c.inject_fault(None, "flaky", "crash")
        wait_for(lambda: tenant(c.status(), "flaky").state == "failed", timeout_s=20, what="flaky failed")
    with _start(run_dir) as sup:
        c = sup.client
        rec = tenant(c.status(), "flaky")
        assert rec.state == "failed" and "restarts within" in rec.failed_reason and rec.pids == ()
        out = zygote.run([sys.executable, "-m", "supervisor", "reset", "flaky", "--run-dir", run_dir],
                         timeout=120, cwd=str(REPO))
        assert out.returncode == 0, out.stderr
        assert "state running" in out.stdout
        assert c.ping(cap).tenant == "flaky"  # the same capability
        assert tenant(c.status(), "flaky").failed_reason is None
    with _start(run_dir) as sup:  # the reset is durable too
        wait_for(lambda: _running(sup, "flaky", 1), timeout_s=30, what="flaky running after a restart")


def test_a_corrupt_state_stops_the_start_with_one_line_and_is_left_alone(run_dir: str) -> None:
    state = Path(run_dir) / "state"
    state.mkdir(mode=0o700)
    db = state / "state.db"
    db.write_bytes(b"definitely not sqlite " * 100)
    before = db.read_bytes()
    out = zygote.run([sys.executable, "-m", "supervisor", "supervise", "--run-dir", run_dir, "--backend", "stub",
                      "--log-level", "error"], timeout=60, cwd=str(REPO))
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if line.startswith("twt:")]
    assert len(lines) == 1 and str(db) in lines[0] and "StateError" in lines[0], out.stderr
    assert "Traceback" not in out.stderr
    assert db.read_bytes() == before
    assert not (Path(run_dir) / "supervisor.json").exists()


# ----------------------------------------------------------------------- rotate-key and the audit


def test_rotate_key_revokes_every_capability_durably_and_denials_are_published(run_dir: str) -> None:
    with _start(run_dir) as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("acme"))
        events = _Events(run_dir, ("denied",))
        try:
            raw = cap.to_bytes()
            forged = TenantCapability.from_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
            # the subscription joins asynchronously: refuse until the first event shows up
            wait_for(lambda: (pytest.raises(TenantIsolationViolation, c.ping, forged), events.of("denied"))[1],
                     timeout_s=10, what="a denied event")
            first = events.of("denied")[0]
            assert first["reason"] == "forged" and first["tenant"] is None and first["verified"] is False
            assert first["claimed"] == "acme" and first["op"] == "ping"
            out = zygote.run([sys.executable, "-m", "supervisor", "rotate-key", "--run-dir", run_dir],
                             timeout=60, cwd=str(REPO))
            assert out.returncode == 2 and "--yes" in out.stderr  # it asks first
            new_admin = c.rotate_key(None)
            assert read_admin_capability(run_dir) == new_admin.to_bytes()
            n = len(events.of("denied"))
            with pytest.raises(CapabilityRevoked):
                c.ping(cap)
            fresh = c.tenant_capability(None, "acme")
            assert fresh != cap and c.ping(fresh).tenant == "acme"
            wait_for(lambda: len(events.of("denied")) > n, timeout_s=10, what="the revoked denial")
            assert events.of("denied")[n]["reason"] == "revoked"
        finally:
            events.close()
    with _start(run_dir) as sup:
        c = sup.client
        assert read_admin_capability(run_dir) == new_admin.to_bytes()
        with pytest.raises(CapabilityRevoked):
            c.ping(cap)  # revoked stays revoked
        assert c.ping(fresh).tenant == "acme"


# ----------------------------------------------------------------------- rolling restart


def test_restart_replaces_every_instance_one_at_a_time_without_spending_the_budget(run_dir: str) -> None:
    with _start(run_dir) as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("acme").with_instances(2).with_restart("always", max_restarts=0))
        before = _pids(sup, "acme")
        events = _Events(run_dir, ("exit", "ready", "restart", "failed", "kill", "scale"))
        try:
            # the subscription joins asynchronously: a harmless admin change shows when it has
            wait_for(lambda: (c.scale(None, "acme", 2), events.of("scale"))[1], timeout_s=10,
                     what="the event subscription")
            rec = c.restart_tenant(None, "acme")
            assert rec.state == "running" and rec.restarts == 0
            after = sorted(rec.pids)
            assert len(after) == 2 and not set(after) & set(before)
            assert c.ping(cap).tenant == "acme"
            wait_for(lambda: len(events.of("exit")) >= 2, timeout_s=10, what="both exits published")
            # one at a time: the second old worker exits only after the first new one is ready
            order = [(e["event"], e.get("pid")) for e in events.seen if e["event"] in ("exit", "ready")]
            first_ready = next(i for i, (kind, _) in enumerate(order) if kind == "ready")
            second_exit = [i for i, (kind, _) in enumerate(order) if kind == "exit"][1]
            assert first_ready < second_exit, order
            assert all(e["expected"] for e in events.of("exit"))
            assert not events.of("restart") and not events.of("failed")
        finally:
            events.close()
            # shown with a failure (pytest prints a failed test's output): seen failing only beside
            # heavy load, never reproduced - what the supervisor published says which step went wrong
            print("events seen:", [{k: e.get(k) for k in ("event", "pid", "instance", "expected", "reason",
                                                         "exit_code", "signal")} for e in events.seen])


# ----------------------------------------------------------------------- reload


def _write_config(path: Path, tenants: list[dict[str, Any]], extra: str = "") -> None:
    lines = ["[supervisor]"]
    for key, value in {**FAST, "log_level": "warning"}.items():
        lines.append(f"{key} = {value!r}".replace("'", '"'))
    lines.append(extra)
    for t in tenants:
        lines.append("[[tenant]]")
        for key, value in t.items():
            lines.append(f"{key} = {value!r}".replace("'", '"'))
    path.write_text("\n".join(lines) + "\n")


def test_reload_applies_the_difference_and_a_bad_file_changes_nothing(run_dir: str, tmp_path: Path) -> None:
    cfg = tmp_path / "twt.toml"
    _write_config(cfg, [{"name": "a", "memory_quota_bytes": "16MiB"}, {"name": "b"}, {"name": "k"}])
    with launch(str(cfg), run_dir=run_dir) as sup:
        c = sup.client
        cap_a, cap_b = c.tenant_capability(None, "a"), c.tenant_capability(None, "b")
        c.register(None, TenantSpec("r"))
        c.set_quota(None, "k", memory_quota_bytes="8MiB")  # a live change the file does not know about
        pid_a = _pids(sup, "a")
        # a: quota (live) and wasm fuel (new workers); b: removed; c: new; r: registered at runtime
        _write_config(cfg, [{"name": "a", "memory_quota_bytes": "32MiB", "wasm_fuel": 1000}, {"name": "k"},
                            {"name": "c", "instances": 2}, {"name": "r", "instances": 3}])
        summary = c.reload(None)
        assert summary.registered == ("c",) and summary.evicted == ("b",) and summary.unchanged == ("k",)
        assert summary.conflicts == ("r",) and summary.errors == ()
        assert [tenant(c.status(), t).origin for t in ("a", "k", "r")] == ["file", "file", "runtime"]
        assert summary.changed == (ReloadChange("a", ("memory_quota_bytes", "wasm_fuel"), restart=True, scale=False),)
        status = c.status()
        assert tenant(status, "a").memory_quota_bytes == 32 << 20  # at once
        assert tenant(status, "k").memory_quota_bytes == 8 << 20  # the runtime change is kept
        assert len(tenant(status, "r").instances) == 1  # untouched
        with pytest.raises(KeyError):
            tenant(status, "b")
        with pytest.raises(CapabilityRevoked):
            c.ping(cap_b)
        wait_for(lambda: _running(sup, "c", 2), timeout_s=30, what="c registered from the file")
        wait_for(lambda: _running(sup, "a", 1) and _pids(sup, "a") != pid_a, timeout_s=30, what="a restarted")
        assert tenant(c.status(), "a").spec.wasm_fuel == 1000 and c.ping(cap_a).tenant == "a"

        # a bad file: nothing changes, the CLI exits 2 and says why
        before = c.status().tenants
        cfg.write_text(cfg.read_text() + '\n[[tenant]]\nname = "d"\nbogus = 1\n')
        with pytest.raises(ConfigError, match="bogus"):
            c.reload(None)
        out = zygote.run([sys.executable, "-m", "supervisor", "reload", "--run-dir", run_dir],
                         timeout=60, cwd=str(REPO))
        assert out.returncode == 2 and "bogus" in out.stderr and "nothing changed" in out.stderr
        after = c.status().tenants
        assert [(t.tenant_id, t.spec, t.pids) for t in after] == \
            [(t.tenant_id, t.spec, t.pids) for t in before]
        # well-formed, but a device this supervisor does not manage: refused before anything changes
        _write_config(cfg, [{"name": "a", "memory_quota_bytes": "32MiB", "wasm_fuel": 1000}, {"name": "k"},
                            {"name": "c", "instances": 2}, {"name": "e", "cuda_device_index": 7}])
        with pytest.raises(ConfigError, match="cuda_device_index=7"):
            c.reload(None)
        assert [t.tenant_id for t in c.status().tenants] == [t.tenant_id for t in before]

        # SIGHUP reloads (and never stops the supervisor)
        _write_config(cfg, [{"name": "a", "memory_quota_bytes": "32MiB", "wasm_fuel": 1000, "instances": 2},
                            {"name": "k"}, {"name": "c", "instances": 2}])
        sup.process.send_signal(signal.SIGHUP)
        wait_for(lambda: _running(sup, "a", 2), timeout_s=30, what="a scaled by SIGHUP")
        assert sup.process.poll() is None
    # the file tenants' state came along: a restart with the same file changes nothing
    with launch(str(cfg), run_dir=run_dir) as sup:
        status = sup.client.status()
        assert tenant(status, "a").spec.instances == 2
        assert tenant(status, "k").memory_quota_bytes == 8 << 20
        assert sorted(t.tenant_id for t in status.tenants) == ["a", "c", "k", "r"]


# ----------------------------------------------------------------------- stall


def test_a_stopped_supervisor_finds_every_worker_alive_when_continued(run_dir: str) -> None:
    """SIGSTOP for 3x the heartbeat liveness window, then SIGCONT: same pids, nothing restarted."""
    with _start(run_dir, pool_size=1) as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("acme").with_instances(2))
        before = sorted(_pids(sup, "acme"))
        pool_before = wait_for(lambda: c.status().supervisor.pool.pids, timeout_s=30, what="a warm pool")
        os.kill(sup.pid, signal.SIGSTOP)
        try:
            time.sleep(3 * FAST["heartbeat_interval_s"] * FAST["heartbeat_liveness"])  # the stall itself
        finally:
            os.kill(sup.pid, signal.SIGCONT)
        assert c.ping(cap).tenant == "acme"
        # a wrong verdict would come within one window of the resume: give it one (a duration
        # that is the property itself, not a wait for an event that could come late)
        time.sleep(FAST["heartbeat_interval_s"] * FAST["heartbeat_liveness"])
        rec = tenant(c.status(), "acme")
        assert sorted(rec.pids) == before and rec.restarts == 0 and rec.state == "running"
        assert all(i.incarnation == 1 for i in rec.instances)
        assert c.status().supervisor.pool.pids == pool_before


# ----------------------------------------------------------------------- 64 tenants


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sixty_four_tenants_are_restored(run_dir: str) -> None:
    with launch({"supervisor": {**FAST, "log_level": "warning", "pool_size": 0}, "tenant": []},
                run_dir=run_dir, start_method="forkserver", ready_timeout_s=300) as sup:
        caps = [sup.client.register(None, TenantSpec(f"t{i:02d}"), timeout_s=120) for i in range(64)]
    with launch({"supervisor": {**FAST, "log_level": "warning", "pool_size": 0}, "tenant": []},
                run_dir=run_dir, start_method="forkserver", ready_timeout_s=300) as sup:
        status = sup.client.status()
        assert len(status.tenants) == 64 and all(t.state == "running" for t in status.tenants)
        assert all(sup.client.ping(cap).tenant == cap.tenant_id for cap in caps)


def test_file_tenants_follow_the_file_across_restarts_but_not_a_start_without_one(run_dir: str) -> None:
    with _start(run_dir, [{"name": "a"}, {"name": "b"}]):
        pass
    with launch(None, run_dir=run_dir, backend="stub", pool_size=0) as sup:  # no --config: nothing compared
        assert sorted(t.tenant_id for t in sup.client.status().tenants) == ["a", "b"]
    with _start(run_dir, [{"name": "b", "instances": 2}]) as sup:  # the file changed while it was down
        status = sup.client.status()
        assert [t.tenant_id for t in status.tenants] == ["b"]
        assert tenant(status, "b").spec.instances == 2
