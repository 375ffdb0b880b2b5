"""Full file systems fail cleanly: a full state disk refuses admin ops with StateError and
applies nothing (an eviction never comes undone); a full /dev/shm refuses registrations and regions
with a typed error and the supervisor stays up.

Real: each scenario runs a real supervisor (stub backend) in a private mount namespace with a small
tmpfs mounted only there (tests/helpers/private_mount.py), filled for real - no failure seam.
Skipped only where the host cannot make a private mount namespace (not root).
"""

from __future__ import annotations

import pytest

from tests.helpers import private_mount

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(private_mount.available() is not None, reason=str(private_mount.available())),
]

_PRELUDE = """
import json, os, subprocess, tempfile, time
from shared.errors import StateError, TensorWasmError
from shared.spec import TenantSpec
from supervisor.client.launch import launch
from tests.helpers.cluster import FAST, wait_for

def mount_tmpfs(path, size):
    os.makedirs(path, mode=0o700, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", path], check=True)

def fill(path):
    # every byte left, then a page or two more for good measure (fails with ENOSPC)
    fd = os.open(os.path.join(path, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)

def cleanup(run_dir, *mounts):
    for m in mounts:
        subprocess.run(["umount", "-l", m], check=False)
    subprocess.run(["rm", "-rf", run_dir], check=False)

def outcome(fn):
    try:
        fn()
        return "ok"
    except TensorWasmError as exc:
        return exc.code

def start(run_dir):
    return launch({"supervisor": {**FAST, "log_level": "error"}, "tenant": []}, run_dir=run_dir)
"""


def test_a_full_state_disk_refuses_admin_ops_and_an_eviction_never_comes_undone() -> None:
    result = private_mount.run_scenario(_PRELUDE + """
run_dir = tempfile.mkdtemp(prefix="twt-sf")  # $TMPDIR: the run's short root
state = os.path.join(run_dir, "state")
mount_tmpfs(state, "4m")
out = {}
with start(run_dir) as sup:
    c = sup.client
    cap = c.register(None, TenantSpec("acme"))
    c.register(None, TenantSpec("beta"))
    wal = os.path.join(state, "state.db-wal")
    wait_for(lambda: not os.path.exists(wal) or os.path.getsize(wal) == 0, timeout_s=30, what="checkpoint")
    fill(state)
    out["evict"] = outcome(lambda: c.evict(None, "acme"))
    out["ping_after_refused_evict"] = outcome(lambda: c.ping(cap))
    out["set_quota"] = outcome(lambda: c.set_quota(None, "acme", memory_quota_bytes="1MiB"))
    out["quota_after"] = c.quota(cap).memory_quota_bytes
    out["scale"] = outcome(lambda: c.scale(None, "acme", 2))
    out["register"] = outcome(lambda: c.register(None, TenantSpec("gamma")))
    out["tenants_while_full"] = sorted(t.tenant_id for t in c.status().tenants)
    os.unlink(os.path.join(state, "filler"))
    out["evict_with_room"] = outcome(lambda: c.evict(None, "acme"))
    out["ping_after_evict"] = outcome(lambda: c.ping(cap))
with start(run_dir) as sup:
    out["tenants_after_restart"] = sorted(t.tenant_id for t in sup.client.status().tenants)
    out["ping_after_restart"] = outcome(lambda: sup.client.ping(cap))
cleanup(run_dir, state)
print(json.dumps(out))
""")
    assert result["evict"] == "state_error", result
    assert result["ping_after_refused_evict"] == "ok", result  # not applied: nothing revoked
    assert result["set_quota"] == "state_error" and result["quota_after"] != 1 << 20, result
    assert result["scale"] == "state_error", result
    assert result["register"] == "state_error", result
    assert result["tenants_while_full"] == ["acme", "beta"], result
    assert result["evict_with_room"] == "ok", result
    assert result["ping_after_evict"] in ("capability_revoked", "unknown_tenant"), result
    assert result["tenants_after_restart"] == ["beta"], result
    assert result["ping_after_restart"] in ("capability_revoked", "unknown_tenant"), result


def test_a_full_dev_shm_refuses_regions_and_registrations_and_the_supervisor_stays_up() -> None:
    result = private_mount.run_scenario(_PRELUDE + """
from supervisor.routing.regions import SHM_RESERVE_BYTES
run_dir = tempfile.mkdtemp(prefix="twt-sh")  # $TMPDIR: the run's short root
mount_tmpfs("/dev/shm", "32m")
subprocess.run(["chmod", "1777", "/dev/shm"], check=True)
out = {}
with start(run_dir) as sup:
    c = sup.client
    hog = c.register(None, TenantSpec("hog"))  # the default 8 GiB host quota: far more than /dev/shm
    made, refusal = 0, None
    for _ in range(64):
        try:
            c.region_create(hog, 2 << 20)
            made += 1
        except TensorWasmError as exc:
            refusal = exc.code
            break
    st = os.statvfs("/dev/shm")
    out["regions"], out["region_refusal"] = made, refusal
    out["free_after_regions"] = st.f_bavail * st.f_frsize
    out["register_after_regions"] = outcome(lambda: c.register(None, TenantSpec("next")))
    fill("/dev/shm")
    out["register_when_full"] = outcome(lambda: c.register(None, TenantSpec("late")))
    out["region_when_full"] = outcome(lambda: c.region_create(hog, 64 << 10))
    out["ping_when_full"] = outcome(lambda: c.ping(hog))
    os.unlink("/dev/shm/filler")
    out["register_with_room"] = outcome(lambda: c.register(None, TenantSpec("late")))
    out["tenants"] = sorted(t.tenant_id for t in c.status().tenants)
    out["supervisor_alive"] = sup.process.poll() is None
out["reserve"] = SHM_RESERVE_BYTES
cleanup(run_dir, "/dev/shm")
print(json.dumps(out))
""")
    assert 0 < result["regions"] < 16 and result["region_refusal"] == "segment_error", result
    assert result["free_after_regions"] >= result["reserve"] - (2 << 20), result
    assert result["register_after_regions"] == "ok", result  # the reserve kept room for its block
    assert result["register_when_full"] == "segment_error", result
    assert result["region_when_full"] == "segment_error", result
    assert result["ping_when_full"] == "ok" and result["supervisor_alive"], result
    assert result["register_with_room"] == "ok", result
    assert result["tenants"] == ["hog", "late", "next"], result
