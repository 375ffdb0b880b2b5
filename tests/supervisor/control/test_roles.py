"""Roles: the read-only monitor capability, and fault injection switched off.

The monitor capability reads (status, events, version, hello) from either frontend
without ``allow_remote_admin``, and changes nothing: every other admin op, and every
tenant op, refuses it. ``fault_injection = false`` refuses ``inject_fault`` with its
own typed error.
"""

from __future__ import annotations

from typing import Any

import pytest

from shared import protocol as proto
from shared.capability import (
    MonitorCapability,
    RegistryAdminCapability,
    TenantCapability,
    capability_from_bytes,
    capability_from_text,
)
from shared.errors import CapabilityRevoked, FaultInjectionDisabled, TenantIsolationViolation
from shared.spec import TenantSpec
from supervisor.client.api import SupervisorClient
from supervisor.store.registry import TenantRegistry
from tests.helpers.cli import twt
from tests.helpers.cluster import supervisor

LOOPBACK = "tcp://127.0.0.1:0"


def _remote(info: dict[str, Any], cap: Any) -> SupervisorClient:
    return SupervisorClient.remote(info["listen"][0], str(info["server_public_key"]), timeout_s=20, admin=cap)


def test_the_monitor_ops_are_exactly_the_read_only_ones() -> None:
    assert proto.MONITOR_OPS == {"hello", "status", "tenant_status", "version", "events"}
    for name in proto.MONITOR_OPS:
        assert proto.OPS[name].admin or proto.OPS[name].any_capability
    with pytest.raises(ValueError, match="admin-side"):
        proto.OpSpec("x", False, (), "", (), "call", monitor=True)


def test_a_monitor_token_is_its_own_kind_minted_from_the_key() -> None:
    registry, admin = TenantRegistry.new()
    try:
        monitor = registry.monitor_capability(admin)
        assert isinstance(monitor, MonitorCapability) and capability_from_bytes(monitor.to_bytes()) == monitor
        assert registry.monitor_capability(admin) == monitor  # the same bytes for as long as the key lives
        registry.verify_monitor(monitor)
        with pytest.raises(TenantIsolationViolation, match="not an admin capability"):
            registry.verify_admin(monitor)
        with pytest.raises(TenantIsolationViolation, match="not a monitor capability"):
            registry.verify_monitor(admin)
        with pytest.raises(TenantIsolationViolation):
            registry.monitor_capability(monitor)  # type: ignore[arg-type]  # only the admin mints it
        forged = bytearray(monitor.to_bytes())
        forged[-1] ^= 1
        with pytest.raises(TenantIsolationViolation, match="forged"):
            registry.verify_monitor(capability_from_bytes(bytes(forged)))
        with pytest.raises(TenantIsolationViolation, match="wrong_kind|expected a RegistryAdminCapability"):
            RegistryAdminCapability.from_bytes(monitor.to_bytes())
        registry.rotate_key(admin)
        with pytest.raises(CapabilityRevoked):
            registry.verify_monitor(monitor)
    finally:
        registry.close()


def test_the_monitor_reads_remotely_without_allow_remote_admin_and_changes_nothing() -> None:
    with supervisor([{"name": "acme"}], listen=[LOOPBACK]) as sup:
        c = sup.client
        monitor = c.role_capability(None, "monitor")
        acme = c.tenant_capability(None, "acme")
        with _remote(sup.info, monitor) as rc:
            status = rc.status()
            assert [t.tenant_id for t in status.tenants] == ["acme"]
            assert rc.tenant_status(None, "acme").tenant_id == "acme"
            assert rc.hello().registry_id == c.hello().registry_id
            assert rc.call("version", monitor)["protocol"] == proto.PROTOCOL_VERSION  # type: ignore[index]
            page = rc.events_page(None, 0)
            assert ("register", "acme") in [(e["event"], e.get("tenant")) for e in page["events"]]
            # nothing that changes state, and no tenant op
            with pytest.raises(TenantIsolationViolation, match="read-only ops only"):
                rc.call("evict", monitor, {"tenant": "acme"})
            with pytest.raises(TenantIsolationViolation, match="read-only ops only"):
                rc.call("inject_fault", monitor, {"tenant": "acme", "kind": "crash"})
            with pytest.raises(TenantIsolationViolation, match="read-only ops only"):
                rc.call("set_quota", monitor, {"tenant": "acme", "memory_quota_bytes": 1 << 20})
            with pytest.raises(TenantIsolationViolation, match="read-only ops only"):
                rc.call("rotate_key", monitor)
            with pytest.raises(TenantIsolationViolation, match="read-only ops only"):
                rc.call("capability", monitor, {"tenant": "acme"})
            with pytest.raises(TenantIsolationViolation, match="read-only ops only"):
                rc.call("register", monitor, {"spec": TenantSpec("beta").to_dict()})
            with pytest.raises(TenantIsolationViolation):
                rc.call("ping", monitor)
            with pytest.raises(Exception, match="monitor capability"):
                _ = rc.admin  # the client says why, before anything is sent
            # the admin capability is still refused over TCP (no allow_remote_admin)
            with pytest.raises(TenantIsolationViolation, match="allow_remote_admin"):
                rc.status(sup.admin_capability)
        after = c.status()
        assert [t.tenant_id for t in after.tenants] == ["acme"] and after.tenants[0].restarts == 0
        assert c.tenant_capability(None, "acme") == acme  # not evicted, no key rotated
        # a key rotation revokes it, like every other capability; the new one reads again
        c.rotate_key(None)
        with _remote(sup.info, monitor) as rc:
            with pytest.raises(CapabilityRevoked):
                rc.status()
        renewed = c.role_capability(None, "monitor")
        assert renewed != monitor
        with _remote(sup.info, renewed) as rc:
            assert [t.tenant_id for t in rc.status().tenants] == ["acme"]
        assert c.status().supervisor.internal_errors == 0


def test_twt_capability_role_monitor_prints_the_token() -> None:
    with supervisor([{"name": "acme"}]) as sup:
        out = twt("capability", "--role", "monitor", "--run-dir", sup.run_dir)
        assert out.returncode == 0, out.stderr
        cap = capability_from_text(out.stdout)
        assert isinstance(cap, MonitorCapability) and cap == sup.client.role_capability(None)
        both = twt("capability", "acme", "--role", "monitor", "--run-dir", sup.run_dir)
        assert both.returncode != 0 and "not both" in both.stderr
        tenant = capability_from_text(twt("capability", "acme", "--run-dir", sup.run_dir).stdout)
        assert isinstance(tenant, TenantCapability)
        with pytest.raises(Exception, match="unknown role"):
            sup.client.call("capability", sup.admin_capability, {"role": "root"})
        with pytest.raises(Exception, match="name a tenant or a role"):
            sup.client.call("capability", sup.admin_capability, {})


def test_fault_injection_off_refuses_inject_fault_with_its_typed_error() -> None:
    with supervisor([{"name": "acme"}], fault_injection=False) as sup:
        pid = sup.client.status().tenants[0].pids
        with pytest.raises(FaultInjectionDisabled, match="fault_injection = false") as info:
            sup.client.inject_fault(None, "acme", "crash")
        assert not info.value.is_retryable()
        assert sup.client.status().tenants[0].pids == pid  # nothing was broken
        with pytest.raises(FaultInjectionDisabled):  # refused before the tenant is even looked up
            sup.client.inject_fault(None, "nobody", "crash")
