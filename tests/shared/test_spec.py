from __future__ import annotations

import tomllib

import pytest

from shared.quota import DEFAULT_QUOTA_BYTES
from shared.spec import IsolationKind, RestartPolicy, TenantSpec


def test_defaults() -> None:
    spec = TenantSpec("acme")
    assert spec.memory_quota_bytes == DEFAULT_QUOTA_BYTES == 8 << 30
    assert spec.gpu_memory_bytes_cap is None
    assert spec.instances == 1
    assert spec.isolation is IsolationKind.PROCESS
    assert spec.restart is RestartPolicy.ALWAYS


def test_builder_returns_new_specs() -> None:
    base = TenantSpec("acme")
    spec = (
        base.with_memory_quota_bytes("2GiB")
        .with_gpu_memory_bytes_cap(512 << 20)
        .with_recorded_cuda_mem_pool_quota("256MiB")
        .with_cuda_device_index(1)
        .with_isolation(IsolationKind.MPS)
        .with_sm_percentage(50)
        .with_instances(3)
        .with_restart("on-failure", max_restarts=2, restart_window_s=5)
        .with_max_in_flight(8)
        .with_wasm_limits(fuel=1000, timeout_s=1.5, max_memory_bytes="1MiB")
    )
    assert base == TenantSpec("acme")
    assert spec.memory_quota_bytes == 2 << 30
    assert spec.gpu_memory_bytes_cap == 512 << 20
    assert spec.recorded_cuda_mem_pool_quota == 256 << 20
    assert spec.cuda_device_index == 1
    assert spec.isolation is IsolationKind.MPS
    assert spec.sm_percentage == 50
    assert spec.instances == 3
    assert spec.restart is RestartPolicy.ON_FAILURE
    assert (spec.max_restarts, spec.restart_window_s) == (2, 5.0)
    assert spec.max_in_flight == 8
    assert (spec.wasm_fuel, spec.wasm_timeout_s, spec.wasm_max_memory_bytes) == (1000, 1.5, 1 << 20)
    with pytest.raises(AttributeError):
        spec.instances = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "exc"),
    [
        ("memory_quota_bytes", -1, ValueError),
        ("memory_quota_bytes", "lots", ValueError),
        ("memory_quota_bytes", True, TypeError),
        ("gpu_memory_bytes_cap", 1.5, TypeError),
        ("cuda_device_index", -1, ValueError),
        ("isolation", "vm", ValueError),
        ("sm_percentage", 0, ValueError),
        ("sm_percentage", 101, ValueError),
        ("instances", 65, ValueError),
        ("restart", "sometimes", ValueError),
        ("max_in_flight", 0, ValueError),
        ("restart_window_s", float("nan"), ValueError),
        ("wasm_max_memory_bytes", 100, ValueError),
    ],
)
def test_validation_names_the_field(field: str, value: object, exc: type[Exception]) -> None:
    with pytest.raises(exc, match=field if exc is not TypeError or field != "isolation" else ""):
        TenantSpec.from_dict({"tenant_id": "acme", field: value})


def test_invalid_tenant_id() -> None:
    with pytest.raises(ValueError, match="invalid tenant id"):
        TenantSpec("Acme")


def test_from_toml_table_and_round_trip() -> None:
    doc = tomllib.loads(
        """
        [[tenant]]
        name = "acme"
        memory_quota_bytes = "1GiB"
        gpu_memory_bytes_cap = "512MiB"
        isolation = "auto"
        restart = "never"
        instances = 2
        """
    )
    spec = TenantSpec.from_dict(doc["tenant"][0])
    assert spec.tenant_id == "acme"
    assert spec.memory_quota_bytes == 1 << 30
    assert spec.isolation is IsolationKind.AUTO
    assert spec.restart is RestartPolicy.NEVER
    assert TenantSpec.from_dict(spec.to_dict()) == spec


def test_unknown_keys_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'gpu_cap'"):
        TenantSpec.from_dict({"tenant_id": "acme", "gpu_cap": 1})
    with pytest.raises(ValueError, match="both"):
        TenantSpec.from_dict({"tenant_id": "acme", "name": "acme"})
    with pytest.raises(ValueError, match="needs a 'tenant_id'"):
        TenantSpec.from_dict({"instances": 1})
    with pytest.raises(TypeError):
        TenantSpec.from_dict(["acme"])  # type: ignore[arg-type]
