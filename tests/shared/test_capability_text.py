"""One text form for capabilities (hex on one line), read back with legacy raw bytes accepted too."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.capability import (
    RegistryAdminCapability,
    TenantCapability,
    capability_from_text,
    capability_to_text,
    read_capability_file,
    write_capability_file,
)
from shared.errors import TenantIsolationViolation
from shared.spec import TenantSpec
from supervisor.store.registry import TenantRegistry

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def caps() -> Iterator[tuple[RegistryAdminCapability, TenantCapability]]:
    registry, admin = TenantRegistry.new()
    try:
        yield admin, registry.register_with_capability(admin, TenantSpec("acme"))
    finally:
        registry.close()


def test_text_is_hex_and_both_forms_read_back(caps: tuple[RegistryAdminCapability, TenantCapability]) -> None:
    admin, acme = caps
    text = capability_to_text(acme)
    assert text == acme.to_bytes().hex() and text.isascii() and "\n" not in text
    assert capability_from_text(text) == acme
    assert capability_from_text(f"  {text.upper()}\n") == acme  # whitespace and case do not matter
    assert capability_from_text(acme.to_bytes()) == acme  # legacy raw bytes
    assert capability_from_text(capability_to_text(admin).encode()) == admin
    # a raw token starts with its version byte (1): never mistaken for hex text
    assert acme.to_bytes()[0] == 1


def test_files_round_trip_0600_and_legacy(caps: tuple[RegistryAdminCapability, TenantCapability],
                                          tmp_path: Path) -> None:
    _, acme = caps
    path = tmp_path / "acme.cap"
    write_capability_file(path, acme)
    assert path.read_text() == capability_to_text(acme) + "\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_capability_file(path) == acme
    write_capability_file(path, acme)  # replaced atomically, no temp file left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acme.cap"]
    legacy = tmp_path / "legacy.cap"
    legacy.write_bytes(acme.to_bytes())
    assert read_capability_file(legacy) == acme


@pytest.mark.parametrize("content", [b"", b"abc", b"0102zz", b"\x30" * 10, b"hello world\n"])
def test_junk_is_refused_naming_the_file(content: bytes, tmp_path: Path) -> None:
    path = tmp_path / "junk.cap"
    path.write_bytes(content)
    with pytest.raises(TenantIsolationViolation, match=f"{path} does not hold one"):
        read_capability_file(path)


def test_a_missing_file_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_capability_file(tmp_path / "nope.cap")
