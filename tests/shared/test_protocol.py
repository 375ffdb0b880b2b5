"""The op table is the one declaration of the wire ops: dispatch, client, CLI and docs follow it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgpack
import pytest

from shared import protocol as proto
from shared.errors import InvalidArgument, ProtocolError
from shared.quota import QuotaSnapshot
from shared.records import ExitRecord, InstanceRecord, RunResult, StatusRecord, TenantRecord
from shared.spec import TenantSpec
from shared.wire import Record

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_op_is_documented_in_protocol_md() -> None:
    text = (DOCS / "PROTOCOL.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", text, flags=re.M))
    assert set(proto.OPS) <= documented, sorted(set(proto.OPS) - documented)


def test_every_op_has_a_client_method_and_its_cli_command_exists() -> None:
    import argparse

    from supervisor.cli import build_parser
    from supervisor.client.api import SupervisorClient

    commands = next(a.choices for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for op in proto.OPS.values():
        assert callable(getattr(SupervisorClient, op.client, None)), op  # "call": SupervisorClient.call(op, ...)
        assert op.cli is None or op.cli in commands, op


def test_tenant_and_admin_ops_partition_the_table() -> None:
    assert proto.TENANT_OPS | proto.ADMIN_OPS == set(proto.OPS)
    assert not proto.TENANT_OPS & proto.ADMIN_OPS
    assert proto.HANDLE_OPS <= proto.TENANT_OPS


def test_the_decoder_knows_exactly_the_table() -> None:
    for op in proto.OPS:
        assert proto.decode_client_header(proto.encode_request(1, op, None, {}))[1] == op
    with pytest.raises(Exception, match="unknown op"):
        proto.decode_client_header(proto.encode_request(1, "bye", None, {}))


@pytest.mark.parametrize(("op", "args", "message"), [
    ("alloc", {}, "needs the argument 'nbytes'"),
    ("alloc", {"nbytes": True}, "nbytes must be int, not bool"),
    ("alloc", {"nbytes": "1"}, "nbytes must be int"),
    ("scale", {"tenant": "a", "instances": 1.5}, "instances must be int"),
    ("set_quota", {"tenant": "a", "memory_quota_bytes": None}, "must be int or str"),
    ("inject_fault", {"tenant": "a", "kind": "crash", "params": []}, "params must be dict"),
])
def test_schema_refusals_are_typed(op: str, args: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        proto.check_args(op, args)


def test_schema_accepts_what_the_ops_take() -> None:
    proto.check_args("set_quota", {"tenant": "a", "gpu_memory_bytes_cap": None, "memory_quota_bytes": "1GiB"})
    proto.check_args("run_wasm", {"export": "run", "args": [1, 2.0], "timeout_s": 1, "extra": "ignored"})
    proto.check_args("inject_fault", {"tenant": "a", "kind": "slow", "instance": None, "params": {"ms": 1}})


def test_control_kinds_are_the_ones_in_use() -> None:
    assert proto.CONTROL_KINDS == {"hello", "hb", "stop", "fault", "fault_ack"}


def test_records_round_trip_and_tolerate_new_keys() -> None:
    inst = InstanceRecord(0, 123, "ready", 1, 2, 0, 1.5, False, None)
    tenant = TenantRecord("acme", "running", 1, pids=(123,), instances=(inst,), spec=TenantSpec("acme"))
    wire = {"supervisor": {"pid": 1, "registry_id": "r", "backend": "stub", "backend_reason": "", "start_method":
                           "spawn", "protocol": 1, "uptime_s": 1.0, "run_dir": "/x", "workers": 1,
                           "internal_errors": 0, "pool": {"idle": 1, "starting": 0, "size": 2, "pids": [7]},
                           "from_the_future": True},
            "tenants": [tenant.to_wire()], "devices": []}
    status = StatusRecord.from_wire(wire)
    assert status.tenant("acme") == tenant and status.supervisor.pool.pids == (7,)
    assert StatusRecord.from_wire(status.to_wire()) == status
    assert tenant.to_wire()["instances"][0]["pid"] == 123 and tenant.to_wire()["pids"] == [123]
    with pytest.raises(ProtocolError, match="lacks 'state'"):
        TenantRecord.from_wire({"tenant_id": "a"})


def test_records_are_typed_all_the_way_down() -> None:
    """Nested records decode as records; a value of the wrong type anywhere is a ProtocolError naming where."""
    exit_ = ExitRecord(exit_code=None, signal=9, reason="killed", at=1.5)
    inst = InstanceRecord(0, 123, "down", 0, 2, 1, None, False, exit_)
    snap = QuotaSnapshot("acme", "twt-x", 1, 5, 10, 5, 0, 0, 0, None, 0, 0, 0, None, ((0, 5, 0),))
    rec = TenantRecord("acme", "running", 1, instances=(inst,), spec=TenantSpec("acme", instances=2), quota=snap)
    wire = msgpack.unpackb(msgpack.packb(rec.to_wire()))
    back = TenantRecord.from_wire(wire)
    assert back == rec and back.instances[0].last_exit == exit_ and back.quota == snap
    assert back.spec is not None and back.spec.instances == 2 and back.to_wire() == wire
    newer = {**wire, "spec": {**wire["spec"], "from_a_newer_supervisor": 1}}  # a spec field we do not know
    assert TenantRecord.from_wire(newer) == rec
    assert RunResult.from_wire({"results": [1, 2.5], "fuel_used": 3, "elapsed_s": 1}).elapsed_s == 1.0
    bad: list[tuple[dict[str, Any], str]] = [
        ({**wire, "generation": True}, r"TenantRecord.generation: expected int, got bool"),
        ({**wire, "generation": "1"}, r"TenantRecord.generation: expected int, got str"),
        ({**wire, "pids": [1, "2"]}, r"TenantRecord.pids\[1\]: expected int, got str"),
        ({**wire, "instances": [{**wire["instances"][0], "last_exit": {"reason": "x"}}]},
         r"TenantRecord.instances\[0\].last_exit lacks 'exit_code'"),
        ({**wire, "quota": {**wire["quota"], "instance_shares": [[0, 1]]}},
         r"TenantRecord.quota.instance_shares\[0\]: expected array of 3, got list"),
        ({**wire, "spec": {"tenant_id": "acme", "instances": -1}}, r"TenantRecord.spec: expected TenantSpec"),
        ({**wire, "failed_reason": 5}, r"TenantRecord.failed_reason: expected str, got int"),
        ({**wire, "regions": {}}, r"TenantRecord.regions: expected array, got dict"),
    ]
    for data, message in bad:
        with pytest.raises(ProtocolError, match=message):
            TenantRecord.from_wire(data)
    with pytest.raises(ProtocolError, match="RunResult.results\\[0\\]: expected int \\| float, got str"):
        RunResult.from_wire({"results": ["1"], "fuel_used": None, "elapsed_s": 0.1})


def test_control_messages_are_records() -> None:
    from shared.worker_link import FaultAck, FaultOrder, WorkerHello

    order = FaultOrder("slow", {"ms": 5})
    assert proto.decode_control(proto.encode_control("fault", order.to_wire())) == ("fault", order.to_wire())
    assert FaultOrder.from_wire(order.to_wire()) == order
    assert FaultAck.from_wire({"ok": True, "armed": {"kind": "slow"}}).armed == {"kind": "slow"}
    with pytest.raises(ProtocolError, match="lacks 'token'"):
        WorkerHello.from_wire({"pid": 1})
    with pytest.raises(ProtocolError, match="must be a map"):
        WorkerHello.from_wire([1, 2])  # type: ignore[arg-type]


def test_op_categories_are_fields_of_the_op_table() -> None:
    """Who serves an op, and whether it pins, is local-only or big, is read from its row only."""
    assert set(proto.SERVED_BY) == {op.served_by for op in proto.OPS.values()}
    assert {n for n, op in proto.OPS.items() if op.admin} == {
        n for n, op in proto.OPS.items() if op.served_by in ("admin", "service")}
    assert proto.HANDLE_OPS == {n for n, op in proto.OPS.items() if op.handle}
    assert all(proto.OPS[n].pins for n in proto.HANDLE_OPS)
    assert {n for n, op in proto.OPS.items() if op.local_only} == {
        "region_create", "region_release", "write_region", "read_region"}
    with pytest.raises(ValueError, match="served_by"):
        proto.OpSpec("x", False, (), "", (), "x", served_by="elsewhere")
    with pytest.raises(ValueError, match="admin ops"):
        proto.OpSpec("x", True, (), "", (), "x", served_by="worker")


@pytest.mark.parametrize("spec", [{"tenant_id": "a", "instances": "3"}, {"tenant_id": "a", "colour": 1},
                                  {"name": "Bad Name"}, {"tenant_id": "a", "memory_quota_bytes": [1]}, {}])
def test_register_spec_is_checked_with_the_arguments(spec: dict[str, object]) -> None:
    """check_args is the only argument validator: a bad spec never reaches a handler (where a
    TypeError is a bug, answered as an internal error)."""
    with pytest.raises(InvalidArgument, match="register: spec"):
        proto.check_args("register", {"spec": spec})
    proto.check_args("register", {"spec": {"tenant_id": "a", "instances": 3}})


def test_reply_records_name_ops_and_the_schema_uses_them() -> None:
    """Each typed reply is declared once, as its op's ``Reply`` type (``shared.protocol.REPLY_RECORDS`` is
    read from them); the JSON Schema's reply of the op is that record, so the conformance suite checks
    real replies against the records - ``events``' page included."""
    from supervisor.docgen.protocol_schema import build_schema
    from shared.protocol import REPLY_RECORDS

    replies = build_schema()["$defs"]["replies"]
    assert set(REPLY_RECORDS) <= set(proto.OPS)
    for op, record in REPLY_RECORDS.items():
        assert replies[op] == {"$ref": f"#/$defs/records/{record.__name__}"}
    records = {name for name, op in proto.OPS.items()
               if isinstance(op.reply_type, type) and issubclass(op.reply_type, Record)}
    assert set(REPLY_RECORDS) == records
    assert replies["events"] == {"$ref": "#/$defs/records/EventsPage"}
    page = build_schema()["$defs"]["records"]["EventsPage"]
    assert set(page["required"]) == {"events", "next", "missed", "more", "log"}


def test_a_definition_whose_request_path_properties_name_no_argument_is_refused() -> None:
    """What the frontend does for an op is read from its definition: a property naming an argument
    the op does not declare, or naming buffers without pinning, is refused when it is defined."""
    with pytest.raises(ValueError, match="its region_arg 'region' is none of its arguments"):
        proto.OpSpec("x", False, (), "{}", (), "call", region_arg="region")
    with pytest.raises(ValueError, match="its reply_body_arg 'nbytes' is none of its arguments"):
        proto.OpSpec("x", False, (proto.Arg("n", (int,)),), "{}", (), "call", reply_body_arg="nbytes")
    with pytest.raises(ValueError, match="an op naming buffers or an instance pins"):
        proto.OpSpec("x", False, (proto.Arg("handle", (int,), True),), "{}", (), "call", handle=True)
    run = proto.OPS["run_wasm"]
    assert run.handles({"args": [1, {"handle": 7}, {"handle": True}, {"h": 2}]}) == [7]
    assert proto.OPS["read"].reply_body_bytes({"nbytes": 10}, 4) == 4 and proto.OPS["ping"].reply_body_bytes({}, 4) == 0


def test_a_typed_reply_is_checked_field_by_field() -> None:
    with pytest.raises(ProtocolError, match="the reply has no 'text'"):
        proto.Echo.Reply.from_wire({})
    with pytest.raises(ProtocolError, match="the reply is no map"):
        proto.Echo.Reply.from_wire([1])
    assert proto.Echo.Reply.from_wire({"text": "a", "extra": 1}) == proto.Echo.Reply("a")  # a later field is ignored
    assert proto.Echo.Args.reply_type is proto.Echo.Reply and proto.Echo.Args.op == "echo"
