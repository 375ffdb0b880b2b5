"""Every op is typed: its arguments and its reply are dataclasses, and its wire row is derived from them.

The row (what ``check_args`` enforces, what the docs and the schema say) comes from the ``Args``
dataclass; the generic typed call (``client.invoke(cap, Op.Args(...))``) decodes the answer into
the ``Reply`` type, so a reply that drifts from its type fails there.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from shared import protocol as proto
from shared.errors import InvalidArgument, ProtocolError
from shared.wire import Record


def test_every_op_has_typed_arguments_and_reply() -> None:
    for name, op in proto.OPS.items():
        assert op.args_type is not None and op.reply_type is not None, f"{name} is not typed"
        assert issubclass(op.args_type, proto.WireArgs) and op.args_type.op == name
        assert op.args_type.reply_type is op.reply_type
        assert dataclasses.is_dataclass(op.reply_type)
        assert issubclass(op.reply_type, (proto.WireReply, Record)), f"{name}: its reply cannot decode itself"
        holder = op.args_type.__qualname__.split(".")[0]  # Alloc.Args -> Alloc: the op's class, exported
        assert holder in proto.__all__ and getattr(proto, holder).spec is op, name


def test_the_schema_records_are_the_reply_types() -> None:
    """An op whose reply the schema describes as a record (``REPLY_RECORDS``) answers that record."""
    from shared.protocol import REPLY_RECORDS

    for name, record in REPLY_RECORDS.items():
        assert proto.OPS[name].reply_type is record, name


def test_the_rows_are_the_arguments() -> None:
    """One declaration: each op's argument row is its ``Args`` dataclass's fields, checks included."""
    for name, op in proto.OPS.items():
        assert op.args_type is not None
        assert op.args == proto.wire_fields(op.args_type), name
    assert proto.OPS["register"].args[0].check is not None  # the spec is checked whole
    assert proto.QUOTA_KEYS == ("memory_quota_bytes", "gpu_memory_bytes_cap", "recorded_cuda_mem_pool_quota",
                                "gpu_time_weight", "gpu_time_cap", "idle_timeout_s")


def test_absent_and_nil_are_two_things() -> None:
    """An optional argument left ABSENT is not sent; None is nil, only where the row takes nil."""
    args = proto.SetQuota.Args(tenant="acme", gpu_time_cap=None, memory_quota_bytes="1 GiB")
    assert args.to_wire() == {"tenant": "acme", "memory_quota_bytes": "1 GiB", "gpu_time_cap": None}
    rows = {a.name: a for a in proto.OPS["set_quota"].args}
    assert rows["memory_quota_bytes"].types == (int, str)  # may be left out, is never nil
    assert rows["gpu_time_cap"].types == (int, float, type(None))
    assert not rows["gpu_time_cap"].required and rows["tenant"].required
    write = {a.name: a for a in proto.OPS["write_region"].args}
    assert [a.name for a in proto.OPS["write_region"].args] == ["handle", "offset", "region", "region_offset", "nbytes"]
    assert write["offset"].types == (int,) and not write["offset"].required and write["nbytes"].required
    assert proto.Read.Args(handle=7, nbytes=3).to_wire() == {"handle": 7, "nbytes": 3}


def _sample(tp: object) -> object:
    """A value of a field's first wire type."""
    first = typing.get_args(tp)[0] if typing.get_args(tp) and typing.get_origin(tp) is not list else tp
    origin = typing.get_origin(first) or first
    return {int: 1, float: 0.5, str: "a", bytes: b"a", bool: True, list: [], dict: {}}[origin]


def test_what_the_arguments_send_passes_their_row() -> None:
    """``Args(...)`` of every op, its required fields filled, is a request ``check_args`` accepts;
    a value of another type is refused by the row derived from the same field."""
    for name, op in proto.OPS.items():
        assert op.args_type is not None
        hints = typing.get_type_hints(op.args_type)
        values = {f.name: _sample(hints[f.name]) for f in dataclasses.fields(op.args_type)
                  if f.default is dataclasses.MISSING}
        if name == "register":
            values["spec"] = {"name": "acme"}
        proto.check_args(name, op.args_type(**values).to_wire())
    with pytest.raises(InvalidArgument, match="alloc: nbytes must be int, not str"):
        proto.check_args("alloc", proto.Alloc.Args(nbytes=typing.cast(int, "1")).to_wire())
    with pytest.raises(InvalidArgument, match="register: spec"):
        proto.check_args("register", proto.Register.Args(spec={"name": "acme", "no_such_key": 1}).to_wire())


def test_a_flat_reply_is_checked_field_by_field() -> None:
    assert proto.Alloc.Args(nbytes=8).reply({"handle": 1 << 32, "nbytes": 8}) == proto.Alloc.Reply(1 << 32, 8)
    assert proto.Buffers.Reply.from_wire({"buffers": [[1, 8]], "bytes": 8}).bytes == 8
    with pytest.raises(ProtocolError, match="freed is a bool"):
        proto.Free.Reply.from_wire({"freed": True})
    with pytest.raises(ProtocolError, match="has no 'registry_id'"):
        proto.RotateKey.Reply.from_wire({"admin_capability": b"x"})
    assert proto.Status.Args.reply_type is proto.Status.Reply and proto.Quota.Reply.__name__ == "QuotaSnapshot"


@pytest.mark.process
def test_the_typed_call_decodes_each_reply_into_its_type() -> None:
    """Against a running supervisor: what each op answers is what its ``Reply`` type says."""
    from shared.records import StatusRecord, TenantRecord
    from tests.helpers.cluster import supervisor

    with supervisor([{"name": "acme"}]) as sup:
        client = sup.client
        admin = client.admin
        cap = client.tenant_capability(None, "acme")
        assert isinstance(client.invoke(admin, proto.Version.Args()), proto.Version.Reply)
        assert client.invoke(admin, proto.Hello.Args()).protocol == 1
        assert isinstance(client.invoke(admin, proto.Status.Args(limit=10)), StatusRecord)
        assert isinstance(client.invoke(admin, proto.TenantStatus.Args(tenant="acme")), TenantRecord)
        assert client.invoke(admin, proto.SetQuota.Args(tenant="acme", gpu_time_cap=None)).tenant_id == "acme"
        granted = client.invoke(admin, proto.Capability.Args(tenant="acme"))
        assert isinstance(granted.capability, bytes)
        assert client.invoke(cap, proto.Ping.Args()).tenant == "acme"
        buf = client.invoke(cap, proto.Alloc.Args(nbytes=64))
        assert buf.nbytes == 64 and buf.handle >= 1 << 32
        assert client.invoke(cap, proto.Buffers.Args()) == proto.Buffers.Reply([[buf.handle, 64]], 64)
        assert client.invoke(cap, proto.Free.Args(handle=buf.handle)) == proto.Free.Reply(64)
        assert client.invoke(cap, proto.Quota.Args()).tenant_id == "acme"
        assert client.invoke(cap, proto.Events.Args(max=5)).next >= 0
        assert client.invoke(admin, proto.Evict.Args(tenant="acme")).evicted == "acme"
