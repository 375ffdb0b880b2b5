"""The parts' wiring: one factory, constructed in dependency order, news up through the signals.

What is checked here, without processes: a completion delivers one outcome; the tenant
signals call their subscribers by stage, whatever order the parts were built in; the
factory and the supervisor assign no attribute of another part (no callback set after
construction) and no part has an ``attach``; the domain methods take no wire identity;
and the packages below the frontend import nothing above them.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from shared.errors import TensorWasmError, UnknownTenant
from shared.spec import TenantSpec
from supervisor.control.admin import AdminOps
from supervisor.control.service import ServiceOps
from supervisor.lifecycle.signals import Stage, TenantSignals
from supervisor.runtime.completion import Completion
from supervisor.runtime.tenants import TenantRuntime
from supervisor.wiring import Parts

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]


def test_a_completion_delivers_its_first_outcome_once_now_or_later() -> None:
    seen: list[object] = []
    later: Completion[int] = Completion()
    later.then(seen.append, seen.append)
    assert not later.done and seen == []
    later.resolve(7)
    later.resolve(8)  # a request is answered once: the first outcome wins
    later.fail(UnknownTenant("x"))
    assert later.done and seen == [7]
    later.then(seen.append, seen.append)  # done already: called at once
    assert seen == [7, 7]

    failed: Completion[int] = Completion()
    exc = UnknownTenant("gone")
    failed.fail(exc)
    errors: list[TensorWasmError] = []
    failed.then(seen.append, errors.append)
    assert errors == [exc] and seen == [7, 7]

    none: Completion[None] = Completion.resolved(None)  # None is a value, not "no outcome"
    got: list[object] = []
    none.then(got.append, got.append)
    assert got == [None]


def _runtime() -> TenantRuntime:
    return TenantRuntime(TenantSpec("acme"), None, 1)  # type: ignore[arg-type]  # no block: never read


def test_the_signals_call_subscribers_by_stage_not_by_the_order_the_parts_were_built() -> None:
    signals = TenantSignals(stopping=lambda: False)
    calls: list[str] = []
    # subscribed as the factory builds them: parking first, then admin, then service
    signals.on_instance_ready(Stage.BUFFERS, lambda rt: calls.append("parking"))
    signals.on_instance_not_restarted(Stage.AFTER, lambda rt, *_: calls.append("parking.stopped"))
    signals.on_tenant_failed(Stage.AFTER, lambda rt, why: calls.append("parking.failed"))
    signals.on_instance_ready(Stage.SERVICE, lambda rt: calls.append("service"))
    signals.on_instance_ready(Stage.TENANT, lambda rt: calls.append("admin"))
    signals.on_instance_not_restarted(Stage.TENANT, lambda rt, *_: calls.append("admin.not_restarted"))
    signals.on_tenant_failed(Stage.TENANT, lambda rt, why: calls.append("admin.failed"))
    rt = _runtime()
    signals.instance_ready(rt)
    assert calls == ["parking", "admin", "service"]
    calls.clear()
    signals.serving(rt)  # an activation done: what a ready instance means, past parking's own stage
    assert calls == ["admin", "service"]
    calls.clear()
    signals.instance_not_restarted(rt, 0, 1, None, "exit")
    signals.tenant_failed(rt, "too many restarts")
    assert calls == ["admin.not_restarted", "parking.stopped", "admin.failed", "parking.failed"]


def test_the_signals_relay_downs_evictions_and_key_rotations_and_ask_the_supervisor_if_it_stops() -> None:
    stopping = [False]
    rotated: list[object] = []
    signals = TenantSignals(stopping=lambda: stopping[0], key_rotated=(rotated.append,))
    later: list[object] = []
    signals.on_key_rotated(later.append)
    down: list[tuple[TenantRuntime, TensorWasmError]] = []
    evicted: list[TenantRuntime] = []
    signals.on_tenant_down(lambda rt, exc: down.append((rt, exc)))
    signals.on_evicted(evicted.append)
    rt, exc = _runtime(), UnknownTenant("acme")
    signals.tenant_down(rt, exc)
    signals.evicted(rt)
    signals.key_rotated("new-admin")  # type: ignore[arg-type]  # passed through untouched
    assert down == [(rt, exc)] and evicted == [rt]
    assert rotated == ["new-admin"] and later == ["new-admin"]  # the supervisor's first
    assert not signals.is_stopping()
    stopping[0] = True
    assert signals.is_stopping()


def _part_attribute_assignments(path: Path) -> list[str]:
    """``part.attr = ...`` (or ``+=``, or ``parts.part.attr = ...``): an attribute of one of the
    parts (a field of :class:`Parts`, by the name the factory gives it) set from outside it."""
    names = {f.name for f in dataclasses.fields(Parts)} | {"parts", "hooks", "tcp", "sock"}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute):
                    root: ast.expr = sub
                    while isinstance(root, ast.Attribute):
                        root = root.value
                    if isinstance(root, ast.Name) and root.id in names:
                        found.append(f"{path.name}:{node.lineno}: {ast.unparse(target)}")
    return found


def test_the_factory_and_the_supervisor_set_no_attribute_of_another_part() -> None:
    """Construct, don't attach: a callback handed over after construction (``pending.x = ...``,
    ``frontend.y = ...``) is a cycle in disguise; state changes are the part's own methods."""
    found = []
    for path in (ROOT / "supervisor" / "wiring.py", ROOT / "supervisor" / "supervisor.py"):
        found += _part_attribute_assignments(path)
    assert found == []


def test_no_part_of_the_supervisor_has_an_attach_method() -> None:
    found = []
    for path in sorted((ROOT / "supervisor").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found += [f"{path.relative_to(ROOT)}: {node.name}.{item.name}" for item in node.body
                          if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "attach"]
    assert found == []


def test_the_domain_methods_take_no_wire_identity() -> None:
    """Only the op adapters (supervisor.control.ops) see a request's client and id."""
    found = []
    for cls in (AdminOps, ServiceOps):
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            params = set(inspect.signature(fn).parameters)
            if params & {"client", "rid"}:
                found.append(f"{cls.__name__}.{name}")
    assert found == []


#: a package -> the supervisor packages it must never import (they stand above it)
_BELOW = {
    "routing": ("admission", "observe", "lifecycle", "control", "cli", "wiring", "supervisor"),
    "admission": ("observe", "lifecycle", "control", "cli", "wiring", "supervisor"),
    "lifecycle": ("admission", "control", "cli", "wiring", "supervisor"),
    "control": ("cli", "wiring", "supervisor"),
}


@pytest.mark.parametrize("package", sorted(_BELOW))
def test_a_package_imports_nothing_above_it(package: str) -> None:
    found = []
    for path in sorted((ROOT / "supervisor" / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                parts = name.split(".")
                if parts[0] == "supervisor" and len(parts) > 1 and parts[1] in _BELOW[package]:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert found == []
