"""The client's named methods are thin wrappers over its one typed call.

Each op the client has a method for (``OPS[op].client``) is sent by building the op's typed
arguments (``proto.<Op>.Args``) and handing them to :meth:`SupervisorClient.invoke` (or
:meth:`~SupervisorClient.invoke_body`, for an op answering with a body): no named method encodes a
request of its own. Read from the source with :mod:`ast`, so a method that goes around the typed
call is named here; the typed call itself is exercised against a running supervisor, with a body
and with an op (``echo``) that has no named method.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap

import pytest

from shared import protocol as proto
from shared.errors import InvalidArgument
from supervisor.client import api
from supervisor.client.api import SupervisorClient

#: the client's plumbing: the raw request primitives and the typed call over them (all else goes through these)
_PLUMBING = frozenset({"send", "recv", "request", "call", "invoke", "invoke_body", "_exchange", "_request_locked",
                       "_invoke_locked", "_recv_one", "_recv_remote", "_read_reply"})
#: what only the plumbing may call: sending a request by its op's name and an argument map
_RAW = frozenset({"send", "request", "call", "_request_locked"})
_TYPED = frozenset({"invoke", "invoke_body", "_exchange"})


def _methods() -> dict[str, ast.FunctionDef]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(SupervisorClient)))
    cls = tree.body[0]
    assert isinstance(cls, ast.ClassDef)
    return {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}


def _self_calls(fn: ast.FunctionDef) -> set[str]:
    """The methods of ``self`` a function calls (nested functions included)."""
    return {node.func.attr for node in ast.walk(fn) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self"}


def _args_built(fn: ast.FunctionDef) -> set[str]:
    """The ops whose typed arguments a function builds (``proto.Op.Args(...)``)."""
    ops: set[str] = set()
    for node in ast.walk(fn):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "Args"
                and isinstance(node.func.value, ast.Attribute) and isinstance(node.func.value.value, ast.Name)
                and node.func.value.value.id == "proto"):
            ops.add(getattr(proto, node.func.value.attr).spec.name)
    return ops


def test_every_named_method_builds_its_ops_arguments_and_invokes() -> None:
    methods = _methods()
    named = {spec.client: name for name, spec in proto.OPS.items() if spec.client not in ("call", "invoke")}
    assert named, "no op has a named method"
    for method, op in named.items():
        fn = methods.get(method)
        assert fn is not None, f"OPS[{op!r}].client names {method!r}, which SupervisorClient lacks"
        assert op in _args_built(fn), f"{method} does not build proto's {op} arguments"
        assert _self_calls(fn) & _TYPED, f"{method} does not go through the typed call"


def test_no_method_but_the_plumbing_sends_by_op_name() -> None:
    """Outside the plumbing nothing sends a request from an op name and a map: one encoder."""
    offenders = {name: sorted(_self_calls(fn) & _RAW) for name, fn in _methods().items()
                 if name not in _PLUMBING and _self_calls(fn) & _RAW}
    assert not offenders, f"methods sending around the typed call: {offenders}"
    source = inspect.getsource(api)
    assert source.count("encode_request(") == 1  # in send: the one place a request header is made


def test_a_body_for_an_op_without_one_is_refused_unsent() -> None:
    """The definition says whether an op takes a body (``body_in``): the typed call refuses one
    otherwise, before anything is sent (a client with no socket at all shows it)."""
    client = SupervisorClient.__new__(SupervisorClient)
    with pytest.raises(InvalidArgument, match="echo takes no body frame"):
        client.invoke(b"cap", proto.Echo.Args(text="x"), body=b"payload")
    with pytest.raises(InvalidArgument, match="ping takes no body frame"):
        client.invoke_body(b"cap", proto.Ping.Args(), body=memoryview(b"x"))


@pytest.mark.process
def test_the_typed_call_carries_bodies_and_ops_without_a_named_method() -> None:
    from tests.helpers.cluster import supervisor

    with supervisor([{"name": "acme"}]) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "acme")
        assert not hasattr(c, "echo")  # echo has no named method: the typed call is all it needs
        assert c.invoke(cap, proto.Echo.Args(text="hi")) == proto.Echo.Reply(text="hi")
        handle = c.invoke(cap, proto.Alloc.Args(nbytes=16)).handle
        assert c.invoke(cap, proto.Write.Args(handle=handle), body=b"0123456789abcdef").written == 16
        reply, body = c.invoke_body(cap, proto.Read.Args(handle=handle, offset=4, nbytes=6))
        assert (reply, body) == (proto.Read.Reply(nbytes=6), b"456789")
        assert c.read(cap, handle, 4) == b"0123"  # the named method: the same call
        module = b'(module (func (export "seven") (result i32) i32.const 7))'
        digest = c.invoke(cap, proto.PutModule.Args(), body=module).digest
        assert digest == hashlib.sha256(module).hexdigest()
        assert c.run_wasm(cap, digest, "seven").results == (7,)  # the stored module, named by its digest
        c.invoke(cap, proto.Free.Args(handle=handle))


def test_the_bulk_path_names_no_op_by_its_string() -> None:
    """The region requests of the bulk path are typed arguments too (``RegionCreate.Args`` ...):
    no op name is written out in it, so none can drift from its definition."""
    from supervisor.client import bulk

    strings = {node.value for node in ast.walk(ast.parse(inspect.getsource(bulk)))
               if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert not strings & set(proto.OPS), sorted(strings & set(proto.OPS))
