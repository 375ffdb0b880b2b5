"""Tenant and instance identifiers."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from shared.ids import InstanceId, TenantId, tenant_name

VALID = [
    "a",
    "0",
    "acme",
    "acme-prod.1",
    "a_b",
    "9lives",
    "a.b-c_d",
    "a" * 63,
    "x" + "-" * 62,
]

INVALID = [
    "",
    "a" * 64,
    "Acme",
    "ACME",
    "-acme",
    "_acme",
    ".acme",
    "acme prod",
    "acme/0",
    "acme\n",
    "\nacme",
    "acme\x00",
    "ácme",
    "acme!",
    "a:b",
    "a*",
    "ａcme",  # fullwidth letter
    "٣",  # Arabic-Indic digit
]


@pytest.mark.parametrize("value", VALID)
def test_valid_tenant_ids(value: str) -> None:
    tid = TenantId(value)
    assert tid == value
    assert isinstance(tid, str)
    assert repr(tid) == repr(value)
    assert TenantId(tid) is tid


@pytest.mark.parametrize("value", INVALID, ids=repr)
def test_invalid_tenant_ids_raise_value_error(value: str) -> None:
    with pytest.raises(ValueError, match="invalid tenant id") as info:
        TenantId(value)
    assert "1-63 characters" in str(info.value)


@pytest.mark.parametrize("value", [None, 1, b"acme", ["acme"], 1.5])
def test_non_str_tenant_id_raises_type_error(value: Any) -> None:
    with pytest.raises(TypeError, match="must be a str"):
        TenantId(value)


def test_tenant_name_checks_as_tenant_id_and_keeps_a_plain_str() -> None:
    """What a spec or a quota keeps per tenant: the very str given (no copy), or a plain one."""
    name = "".join(["ac", "me"])
    assert tenant_name(name) is name
    kept = tenant_name(TenantId("acme"))
    assert kept == "acme" and type(kept) is str
    with pytest.raises(ValueError, match="invalid tenant id"):
        tenant_name("Acme")
    with pytest.raises(TypeError, match="must be a str"):
        tenant_name(b"acme")


def test_tenant_id_pickles() -> None:
    tid = TenantId("acme")
    back = pickle.loads(pickle.dumps(tid))
    assert back == tid and type(back) is TenantId


@pytest.mark.parametrize(
    ("text", "tenant", "index"),
    [("acme/0", "acme", 0), ("a.b-c/17", "a.b-c", 17), ("x/65535", "x", 65535), ("9/1", "9", 1)],
)
def test_instance_id_parse_and_str(text: str, tenant: str, index: int) -> None:
    iid = InstanceId.parse(text)
    assert iid.tenant == tenant and type(iid.tenant) is TenantId
    assert iid.index == index
    assert str(iid) == text
    assert InstanceId.parse(str(iid)) == iid


@pytest.mark.parametrize(
    "text",
    ["acme", "acme/", "/0", "acme/-1", "acme/x", "acme/1.0", "acme/65536", "Acme/0", "acme/ 1", "acme/٣", "acme/²"],
)
def test_instance_id_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        InstanceId.parse(text)


def test_instance_id_parse_non_str() -> None:
    with pytest.raises(TypeError):
        InstanceId.parse(5)  # type: ignore[arg-type]


def test_instance_id_validates_on_construction() -> None:
    assert InstanceId("acme", 3).tenant == TenantId("acme")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        InstanceId(TenantId("acme"), -1)
    with pytest.raises(ValueError):
        InstanceId(TenantId("acme"), 1 << 16)
    with pytest.raises(TypeError):
        InstanceId(TenantId("acme"), True)
    with pytest.raises(TypeError):
        InstanceId(TenantId("acme"), "1")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        InstanceId("Bad", 0)  # type: ignore[arg-type]


def test_instance_id_is_frozen_hashable_ordered() -> None:
    a, b, c = InstanceId.parse("acme/0"), InstanceId.parse("acme/1"), InstanceId.parse("beta/0")
    assert sorted([c, b, a]) == [a, b, c]
    assert len({a, InstanceId.parse("acme/0")}) == 1
    with pytest.raises(AttributeError):
        a.index = 5  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(a)) == a
