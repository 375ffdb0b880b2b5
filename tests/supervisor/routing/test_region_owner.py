"""Who owns a shared-memory region: the process the kernel names for the ipc connection
(``SO_PEERCRED``, libzmq's ``Peer-Address``), never the pid the client sends."""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

import pytest

from shared.capability import TenantCapability
from shared.errors import MemoryExhausted
from shared.region import MIN_REGION_BYTES
from shared.spec import TenantSpec
from supervisor.client.api import SupervisorClient
from supervisor.routing.regions import ipc_peer_pid
from tests.helpers import private_mount
from tests.helpers.cluster import supervisor, tenant, wait_for

pytestmark = pytest.mark.timeout(120)

#: regions the liar makes: its tenant's whole host quota
LIES = 3


def _lie_then_exit(run_dir: str, cap: bytes, made: Any, go: Any) -> None:
    """Create regions claiming to be pid 1 (alive for ever), then exit without releasing them."""
    c = SupervisorClient(run_dir)
    for _ in range(LIES):
        c.call("region_create", TenantCapability.from_bytes(cap), {"nbytes": MIN_REGION_BYTES, "pid": 1})
    made.set()
    go.wait(60)
    os._exit(0)  # no release, no close: the process is simply gone


def test_a_client_claiming_pid_1_loses_its_regions_when_it_exits() -> None:
    """Before: ``region_create`` took the client's word for its pid; naming pid 1 pinned the
    regions after the client exited, and the next region_create was refused until eviction."""
    with supervisor() as sup:
        c = sup.client
        liar = c.register(None, TenantSpec("liar").with_memory_quota_bytes(LIES * MIN_REGION_BYTES))
        other = c.register(None, TenantSpec("other"))
        ctx = mp.get_context("spawn")
        made, go = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_lie_then_exit, args=(sup.run_dir, liar.to_bytes(), made, go))
        proc.start()
        try:
            assert made.wait(60), "the liar made no regions"
            regions = tenant(c.status(), "liar").regions
            assert len(regions) == LIES and {r.pid for r in regions} == {proc.pid}  # its own pid, not 1
            with pytest.raises(MemoryExhausted):  # the liar's quota is full while it lives
                c.region_create(liar, MIN_REGION_BYTES)
            go.set()
            proc.join(60)
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        wait_for(lambda: not tenant(c.status(), "liar").regions, what="the exited liar's regions released")
        assert c.quota(liar).bytes_in_use == 0
        for cap in (liar, other):  # the same tenant and another can make theirs again
            grant = c.region_create(cap, MIN_REGION_BYTES)
            assert c.region_release(cap, grant.region) == grant.nbytes


def test_the_owner_is_the_connection_s_process_whatever_pid_is_sent() -> None:
    with supervisor() as sup:
        c = sup.client
        cap = c.register(None, TenantSpec("acme"))
        for args in ({"nbytes": MIN_REGION_BYTES, "pid": 1}, {"nbytes": MIN_REGION_BYTES, "pid": 2**22 + 12345},
                     {"nbytes": MIN_REGION_BYTES}):
            grant = c.call("region_create", cap, args)
            assert isinstance(grant, dict)
            assert {r.pid for r in tenant(c.status(), "acme").regions} == {os.getpid()}
            c.call("region_release", cap, {"region": grant["region"]})


#: the liar of the /dev/shm scenario: regions claiming pid 1 until /dev/shm (past its reserve) is
#: full - 2 MiB ones, then 64 KiB ones - then it waits for its stdin to close and exits unreleased
_LIAR = """
import os, sys
from shared.capability import TenantCapability
from shared.errors import TensorWasmError
from supervisor.client.api import SupervisorClient
c = SupervisorClient(sys.argv[1])
cap = TenantCapability.from_bytes(bytes.fromhex(sys.argv[2]))
made = 0
for size in (2 << 20, 64 << 10):
    while made < 64:
        try:
            c.call("region_create", cap, {"nbytes": size, "pid": 1})
        except TensorWasmError:
            break
        made += 1
print(made, flush=True)
sys.stdin.read()
os._exit(0)
"""


@pytest.mark.timeout(300)
@pytest.mark.skipif(private_mount.available() is not None, reason=str(private_mount.available()))
def test_regions_of_a_liar_filling_dev_shm_are_released_when_it_exits() -> None:
    """The finding as it was seen: a client naming pid 1 filled /dev/shm with regions and exited,
    and another tenant's 64 KiB region_create was refused until the liar's tenant was evicted.
    Here on a real 32 MiB /dev/shm in a private mount namespace."""
    result = private_mount.run_scenario("""
import json, os, subprocess, sys, tempfile
from shared.errors import TensorWasmError
from shared.spec import TenantSpec
from supervisor.client.launch import launch
from tests.helpers.cluster import FAST, tenant, wait_for
from tests.supervisor.routing.test_region_owner import _LIAR

def outcome(fn):
    try:
        fn()
        return "ok"
    except TensorWasmError as exc:
        return exc.code

run_dir = tempfile.mkdtemp(prefix="twt-rl")
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m,mode=1777", "tmpfs", "/dev/shm"], check=True)
out = {}
with launch({"supervisor": {**FAST, "log_level": "error"}, "tenant": []}, run_dir=run_dir) as sup:
    c = sup.client
    liar = c.register(None, TenantSpec("liar"))
    victim = c.register(None, TenantSpec("victim"))
    child = subprocess.Popen([sys.executable, "-c", _LIAR, sup.run_dir, liar.to_bytes().hex()],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    out["made"] = int(child.stdout.readline())
    out["owners"] = sorted({r.pid for r in tenant(c.status(), "liar").regions})
    out["liar_pid"] = child.pid
    out["victim_while_the_liar_lives"] = outcome(lambda: c.region_create(victim, 64 << 10))
    child.stdin.close()
    out["liar_exit"] = child.wait(60)
    wait_for(lambda: not tenant(c.status(), "liar").regions, what="the exited liar's regions released")
    out["victim_after"] = outcome(lambda: c.region_create(victim, 64 << 10))
    out["liar_bytes_after"] = c.quota(liar).bytes_in_use
subprocess.run(["umount", "-l", "/dev/shm"], check=False)
subprocess.run(["rm", "-rf", run_dir], check=False)
print(json.dumps(out))
""")
    assert result["made"] > 8 and result["liar_exit"] == 0, result
    assert result["owners"] == [result["liar_pid"]], result  # not pid 1
    assert result["victim_while_the_liar_lives"] == "segment_error", result
    assert result["victim_after"] == "ok" and result["liar_bytes_after"] == 0, result


def test_ipc_peer_pid_reads_libzmq_s_credentials_only() -> None:
    assert ipc_peer_pid("localhost:1000:1000:4242") == 4242
    assert ipc_peer_pid("/run/twt/frontend.ipc:0:0:17") == 17
    for bad in (None, 5, "", "127.0.0.1", "localhost:0:0:0", "x:a:b:c", "1:2:3"):
        assert ipc_peer_pid(bad) is None
