"""The reload planner: what a changed config file does to what runs (no processes)."""

from __future__ import annotations

from shared.spec import TenantSpec
from supervisor.lifecycle.reload import LIVE_FIELDS, RESTART_FIELDS, SpecChange, TenantNow, plan_reload


def _now(spec: TenantSpec, registered: TenantSpec | None = None, origin: str = "file") -> TenantNow:
    return TenantNow(spec, registered or spec, origin)  # type: ignore[arg-type]


def test_every_spec_field_is_classified() -> None:
    assert LIVE_FIELDS.isdisjoint(RESTART_FIELDS)
    classified = LIVE_FIELDS | RESTART_FIELDS | {"tenant_id", "instances"}
    assert classified == set(TenantSpec.field_names())


def test_the_plan_registers_changes_evicts_and_leaves_runtime_tenants_alone() -> None:
    a = TenantSpec("a").with_memory_quota_bytes("1MiB")
    b = TenantSpec("b")
    c = TenantSpec("c")
    r = TenantSpec("r")
    current = {
        "a": _now(a),
        "b": _now(b.with_instances(3), registered=b),  # scaled at runtime since
        "c": _now(c),
        "r": _now(r, origin="runtime"),
        "gone": _now(TenantSpec("gone")),
        "rt": _now(TenantSpec("rt"), origin="runtime"),
    }
    new = [
        a.with_memory_quota_bytes("2MiB").with_wasm_limits(fuel=10),
        b,  # the file did not change: the runtime scale is kept
        TenantSpec("new").with_instances(2),
        TenantSpec("r").with_instances(2),  # registered at runtime: not the file's
        c.with_instances(2),
    ]
    plan = plan_reload(new, current)
    assert [s.tenant_id for s in plan.register] == ["new"]
    assert plan.unchanged == ("b",) and plan.conflicts == ("r",) and plan.evict == ("gone",)
    by_id = {ch.tenant_id: ch for ch in plan.change}
    assert set(by_id) == {"a", "c"}
    assert by_id["a"].fields == ("memory_quota_bytes", "wasm_fuel")
    assert by_id["a"].quota == {"memory_quota_bytes": 2 << 20}
    assert by_id["a"].needs_restart and not by_id["a"].scale and not by_id["a"].needs_placement
    assert by_id["c"].scale and not by_id["c"].needs_restart and by_id["c"].quota == {}
    summary = plan.summary()
    assert summary["registered"] == ["new"] and summary["evicted"] == ["gone"]
    assert summary["changed"][0] == {"tenant": "a", "fields": ["memory_quota_bytes", "wasm_fuel"],
                                     "restart": True, "scale": False}
    assert not plan.empty


def test_a_file_that_now_says_what_runs_is_adopted_without_a_change() -> None:
    b = TenantSpec("b")
    plan = plan_reload([b.with_instances(3)], {"b": _now(b.with_instances(3), registered=b)})
    assert plan.adopt == (b.with_instances(3),) and plan.change == ()


def test_settings_changes_are_reported_not_applied() -> None:
    plan = plan_reload([], {}, old_settings={"pool_size": 2, "backend": "stub"},
                       new_settings={"pool_size": 4, "backend": "stub", "log_level": "debug"})
    assert plan.settings == ("log_level", "pool_size") and plan.empty


def test_placement_changes_are_marked() -> None:
    change = SpecChange(TenantSpec("a"), TenantSpec("a").with_cuda_device_index(1))
    assert change.needs_placement and change.needs_restart
