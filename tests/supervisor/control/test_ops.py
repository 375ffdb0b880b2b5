"""One admin op, one class: the classes and the wire table agree, and the dispatch table and
PROTOCOL.md's op tables come from the classes (the twt commands: tests/supervisor/cli/test_commands.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shared import protocol as proto
from shared.errors import TenantIsolationViolation
from supervisor.control import ops
from supervisor.control.ops import (AdminOp, EitherCapabilityOp, FrontendOp, Reply, ServiceOp, WorkerOp, check_table,
                                    op_table)
from supervisor.control.ops.__main__ import main as doc_main

DOCS = Path(__file__).resolve().parents[3] / "docs"


def test_every_op_is_one_class_of_the_part_that_serves_it() -> None:
    table = op_table()
    assert [op.name for op in table] == list(proto.OPS)  # every op, in the wire table's order
    for op in table:
        if type(op).__module__ == "supervisor.control.ops._base":  # a worker op with no module: its stand-in
            assert op.spec.served_by == "worker" and op.spec.cli is None and op.name not in ops.served_here()
            assert isinstance(op, WorkerOp) and not op.error_notes and not op.args_doc
            continue
        assert op.spec is proto.OPS[op.name]
        assert op.part == op.spec.served_by
        kind = {"admin": AdminOp, "service": ServiceOp, "frontend": FrontendOp, "worker": WorkerOp}[op.part]
        if op.spec.any_capability:  # events: the frontend verifies either capability, the class reads the log
            kind = EitherCapabilityOp
        assert isinstance(op, kind)
        assert type(op).__module__ == f"supervisor.control.ops.{op.name}"  # one module per op, named as the op


def test_each_ops_documented_errors_are_its_definitions() -> None:
    """The errors column of PROTOCOL.md (each class's ``errors_doc``) is derived from the
    definition's ``errors`` (the schema's): every error named, in its order, none added; a class
    only adds notes, and a note on an error the definition does not list is refused."""
    for op in op_table():
        named = re.findall(r"`([A-Z][A-Za-z]+)`(?: \(|,|$)", op.errors_doc)
        assert [e for e in named if e in op.spec.errors] == list(op.spec.errors), op.name
        assert set(op.error_notes) <= set(op.spec.errors), op.name
    alloc = next(op for op in op_table() if op.name == "alloc")
    assert alloc.errors_doc.startswith("`GpuMemoryExhausted` (tenant cap")

    class StrayNote(WorkerOp):
        name = "ping"
        error_notes = {"UnknownTenant": "ping names no tenant"}  # not among ping's errors

    with pytest.raises(RuntimeError, match=r"definition does not list: \[\"ping: \['UnknownTenant'\]\"\]"):
        check_table([op for op in op_table() if op.name != "ping"] + [StrayNote()])

    class ByHand(WorkerOp):
        name = "ping"
        errors_doc = "`WorkerLost`, `Overloaded`"  # type: ignore[assignment]  # the column is derived, never written

    with pytest.raises(RuntimeError, match=r"ping: errors_doc written by hand"):
        check_table([op for op in op_table() if op.name != "ping"] + [ByHand()])


def test_a_class_set_that_disagrees_with_the_wire_table_is_refused() -> None:
    table = list(op_table())
    check_table(table)
    with pytest.raises(RuntimeError, match=r"without a class: \['scale'\]"):
        check_table([op for op in table if op.name != "scale"])
    with pytest.raises(RuntimeError, match=r"twice: \['evict'\]"):
        check_table([*table, next(op for op in table if op.name == "evict")])

    class Stray(AdminOp):
        name = "no_such_op"  # no wire row

    with pytest.raises(RuntimeError, match=r"of no op served here: \['no_such_op'\]"):
        check_table([*table, Stray()])

    class WrongPart(AdminOp):
        name = "reload"  # served by ServiceOps

    with pytest.raises(RuntimeError, match=r"wrong part: \['reload'\]"):
        check_table([op for op in table if op.name != "reload"] + [WrongPart()])


def test_the_dispatch_tables_bind_each_op_to_its_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each admin op's handler calls its class's ``serve`` with its part and a Reply that alone
    holds the request's client and id; the frontend's tables hand the ops to the frontend."""
    admin, service, pending = object(), object(), object()
    seen: list[tuple[object, ...]] = []
    for op in op_table():
        if isinstance(op, (AdminOp, ServiceOp)):
            monkeypatch.setattr(type(op), "serve", lambda self, part, reply, args: seen.append((self.name, part, reply,
                                                                                                args)))
    table = ops.handlers(admin, service, pending)  # type: ignore[arg-type]
    assert set(table) == {n for n, s in proto.OPS.items() if s.admin}
    for name, handler in table.items():
        handler(b"client", 7, {"tenant": "acme"})
        part = admin if proto.OPS[name].served_by == "admin" else service
        assert seen == [(name, part, Reply(pending, b"client", 7, name), {"tenant": "acme"})]  # type: ignore[arg-type]
        seen.clear()
    local = ops.local_handlers()
    assert set(local) == {"quota", "put_module", "region_create", "region_release"}
    assert all(h.__self__.name == n for n, h in local.items())  # type: ignore[attr-defined]
    either = ops.either_handlers()
    assert set(either) == {"events"}
    assert all(h.__self__.name == n for n, h in either.items())  # type: ignore[attr-defined]


def test_protocol_md_op_tables_are_generated_from_the_classes() -> None:
    assert doc_main(["--check"]) == 0, "run python -m supervisor.control.ops --write"
    text = (DOCS / "PROTOCOL.md").read_text()
    assert ops.doc_table() in text and ops.tenant_doc_table() in text and ops.either_doc_table() in text
    for op in op_table():
        assert op.doc_row() in text, op.name


def test_adding_a_worker_op_is_its_definition_and_its_handler() -> None:
    """What adding an op touches: ``echo`` is its definition (shared.protocol.Echo: typed arguments
    and reply, errors, who serves it), its worker handler and its test - no module here, no client
    method, no branch of the request path; its doc rows and schema entry are generated."""
    import worker.server
    from supervisor.client.api import SupervisorClient

    spec = proto.OPS["echo"]
    assert spec is proto.Echo.spec and spec.served_by == "worker" and spec.cli is None
    assert [(a.name, a.types, a.required) for a in spec.args] == [("text", (str,), True)]
    assert spec.reply == "{text}" and spec.errors == ()
    assert not (Path(ops.__file__).parent / "echo.py").exists()  # no class of its own
    echo = next(op for op in op_table() if op.name == "echo")
    assert echo.doc_row() == "| `echo` | `{text: str}` | | `{text}` | | |"
    assert not hasattr(SupervisorClient, "echo") and spec.client == "invoke"  # sent by the generic call
    assert worker.server._resolve("echo") is worker.server.op_echo
    assert proto.Echo.Args(text="hi").to_wire() == {"text": "hi"}
    assert proto.Echo.Args(text="hi").reply({"text": "hi"}) == proto.Echo.Reply("hi")


def test_echo_is_answered_by_the_tenants_worker_through_the_typed_call() -> None:
    from shared.errors import InvalidArgument, ProtocolError
    from tests.helpers.cluster import supervisor

    with supervisor([{"name": "acme"}]) as sup:
        cap = sup.client.tenant_capability(None, "acme")
        assert sup.client.invoke(cap, proto.Echo.Args(text="héllo")) == proto.Echo.Reply(text="héllo")
        with pytest.raises(InvalidArgument, match="echo: text must be str, not int"):  # the definition checks it
            sup.client.call("echo", cap, {"text": 3})
        with pytest.raises(InvalidArgument, match="echo needs the argument 'text'"):
            sup.client.call("echo", cap, {})
        with pytest.raises(TenantIsolationViolation):  # a tenant op: the admin capability is not a tenant's
            sup.client.invoke(sup.client.admin, proto.Echo.Args(text="x"))
    with pytest.raises(ProtocolError, match="Reply: text is a int"):  # a reply not of its type is refused
        proto.Echo.Args(text="x").reply({"text": 1})


def _op_name_branches(path: Path) -> list[str]:
    """Comparisons of an ``op`` (a name or an attribute so called) with an op's name in ``path``."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if not any(isinstance(n, ast.Name) and n.id == "op" or isinstance(n, ast.Attribute) and n.attr == "op"
                   for n in sides):
            continue
        names = [c.value for side in sides for c in ast.walk(side) if isinstance(c, ast.Constant)]
        if any(isinstance(v, str) and v in proto.OPS for v in names):
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_the_request_path_names_no_op(tmp_path: Path) -> None:
    """The frontend, the routing (the pending table), the admission and the spec read the ops'
    declared properties: none compares an op with an op's name."""
    root = Path(__file__).resolve().parents[3]
    files = [*sorted((root / "supervisor" / "admission").glob("*.py")),
             *sorted((root / "supervisor" / "routing").glob("*.py")), root / "shared" / "spec.py"]
    assert [b for f in files for b in _op_name_branches(f)] == []
    probe = root / "supervisor" / "admission" / "frontend.py"
    assert _op_name_branches(probe) == [] and "def _serve" in probe.read_text()  # the scan reads real code
    fake = tmp_path / "_probe_branch.py"  # and it finds a branch when there is one
    fake.write_text('def f(op: str) -> bool:\n    return op == "run_wasm" or op in ("a", "buffers")\n')
    assert _op_name_branches(fake) == ["_probe_branch.py:2", "_probe_branch.py:2"]


def test_version_names_the_running_supervisors_build(capsys: pytest.CaptureFixture[str]) -> None:
    """An admin op the supervisor serves: its definition and its one class (handler, command, doc notes)."""
    import json
    import platform

    from supervisor.cli import main
    from supervisor.observe.metrics import build_version
    from tests.helpers.cluster import supervisor

    with supervisor() as sup:
        assert sup.client.call("version", sup.client.admin) == {
            "version": build_version(), "python": platform.python_version(), "protocol": proto.PROTOCOL_VERSION}
        assert main(["version", "--run-dir", sup.run_dir]) == 0
        out = capsys.readouterr().out
        assert out == (f"twt {build_version()} (this command); supervisor {build_version()} "
                       f"(python {platform.python_version()}, protocol {proto.PROTOCOL_VERSION})\n")
        assert main(["version", "--json", "--run-dir", sup.run_dir]) == 0
        assert json.loads(capsys.readouterr().out)["supervisor"]["version"] == build_version()
        with pytest.raises(TenantIsolationViolation, match="admin op 'version'"):  # no capability: refused
            sup.client.call("version", None)
