"""Every public name of each package is exported from its ``__init__`` (trio's test_exports)."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

PACKAGES = ["shared", "supervisor", "worker"]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_importable_and_sorted(name: str) -> None:
    pkg = importlib.import_module(name)
    assert len(set(pkg.__all__)) == len(pkg.__all__), f"{name}.__all__ has duplicates"
    for attr in pkg.__all__:
        assert hasattr(pkg, attr), f"{name}.__all__ names {attr!r}, which does not exist"
    assert list(pkg.__all__) == sorted(pkg.__all__), f"{name}.__all__ is not sorted"


@pytest.mark.parametrize("name", PACKAGES)
def test_modules_declare_all(name: str) -> None:
    """Each non-private module says what it exports, so the package face can be checked."""
    pkg = importlib.import_module(name)
    missing = []
    for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{name}."):
        leaf = info.name.rsplit(".", 1)[-1]
        if leaf.startswith("_") or leaf in ("preload",) or ".cli." in info.name or ".bench." in info.name:
            continue
        module = importlib.import_module(info.name)
        if not hasattr(module, "__all__"):
            missing.append(info.name)
    assert not missing, f"modules without __all__: {missing}"


def test_core_names_exported() -> None:
    import shared
    import supervisor
    import worker

    for name in ("TenantRegistry", "SupervisorClient", "launch"):
        assert name in supervisor.__all__
    for name in ("QuotaBlock", "TensorWasmError", "GpuMemoryExhausted", "TenantId"):
        assert name in shared.__all__
    assert "TenantContext" in worker.__all__


def test_supervisor_never_imports_worker() -> None:
    import subprocess
    import sys

    code = (
        "import sys, pkgutil, importlib, supervisor\n"
        "for info in pkgutil.walk_packages(supervisor.__path__, prefix='supervisor.'):\n"
        "    if not info.name.endswith('__main__'):\n"
        "        importlib.import_module(info.name)\n"
        "bad = sorted(m for m in sys.modules if m == 'worker' or m.startswith('worker.'))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


#: package -> the packages it must never import (docs/ARCHITECTURE.md "Layers")
FORBIDDEN = {"supervisor": {"worker"}, "worker": {"supervisor"}, "shared": {"supervisor", "worker"}}


def _imports(path: Path) -> list[tuple[int, str]]:
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layering_every_forbidden_direction(package: str) -> None:
    """Every import statement in every module (function-level ones too): supervisor and worker
    meet only in shared, and shared imports neither."""
    root = Path(__file__).resolve().parent.parent / package
    bad = [
        f"{path.relative_to(root.parent)}:{line} imports {name}"
        for path in sorted(root.rglob("*.py"))
        for line, name in _imports(path)
        if name.split(".")[0] in FORBIDDEN[package]
    ]
    assert not bad, bad
