"""A client of the wire protocol written from docs/PROTOCOL.md alone: pyzmq, msgpack and jsonschema.

It imports nothing of tensor-wasm-tenant (``test_conformance.py`` checks
that), so it is what a client in another language does, step by step:

* find the supervisor: ``supervisor.json`` in the run dir (keys by name),
  the admin capability in ``admin/admin.cap`` (hex text -> bytes);
* connect a DEALER (no empty delimiter frame) to ``frontend.ipc``, or to a
  ``listen`` endpoint over CURVE with the server's public key and a
  throwaway key pair of its own;
* send ``[header]`` or ``[header, body]``, header = msgpack
  ``[1, rid, op, capability (bin) | nil, args (map)]``;
* read ``[header, body?]``, header = ``[1, rid, ok, payload]``, and check
  the payload against the JSON Schema shipped with the package
  (``shared/protocol.schema.json``, read as a file), with a strict integer
  type (a msgpack float is never an int).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq

#: the schema file as the package ships it (read as data: no import of the package)
SCHEMA_PATH = Path(__file__).resolve().parents[2] / "shared" / "protocol.schema.json"
SCHEMA: dict[str, Any] = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
VERSION: int = SCHEMA["x-twt"]["protocol"]


def _strict_int(_: Any, value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@functools.cache
def _validator_class() -> Any:
    """Draft 2020-12 with msgpack's integers; jsonschema imported on first use (with referencing,
    attrs and rpds ~0.2 s of imports, which every xdist worker would pay at collection otherwise)."""
    import jsonschema

    return jsonschema.validators.extend(
        jsonschema.Draft202012Validator,
        type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _strict_int),
    )


def validator(pointer: str) -> Any:
    """A validator for one part of the schema (``#/$defs/...``), refs resolved within the document."""
    return _validator_class()({**SCHEMA, "$ref": pointer})


def read_ready(run_dir: str) -> dict[str, Any]:
    """``supervisor.json``: present once the supervisor is ready."""
    with open(os.path.join(run_dir, "supervisor.json"), encoding="utf-8") as f:
        info: dict[str, Any] = json.load(f)
    return info


def read_admin_cap(run_dir: str) -> bytes:
    """``admin/admin.cap``: the admin capability as lowercase hex and a newline."""
    with open(os.path.join(run_dir, "admin", "admin.cap"), encoding="ascii") as f:
        return bytes.fromhex(f.read().strip())


@dataclass
class Reply:
    """One reply: ``ok``, the result or error map, the body frame (or None)."""

    rid: int
    ok: bool
    payload: Any
    body: bytes | None

    @property
    def code(self) -> str | None:
        return self.payload["code"] if not self.ok else None


@dataclass
class RawClient:
    """A DEALER on the supervisor's frontend (see the module docstring)."""

    endpoint: str
    server_key: bytes | None = None  # Z85: CURVE over TCP
    timeout_ms: int = 60_000
    seen_codes: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if self.server_key is not None:
            public, secret = zmq.curve_keypair()  # throwaway: needed even without an allow-list
            self.sock.curve_serverkey = self.server_key
            self.sock.curve_publickey = public
            self.sock.curve_secretkey = secret
        self.sock.connect(self.endpoint)
        self._rids = itertools.count(1)

    def close(self) -> None:
        self.sock.close(0)

    def send(self, op: str, cap: bytes | None, args: dict[str, Any] | None = None, body: bytes | None = None,
             *, rid: int | None = None) -> int:
        """Send one request; returns its rid (use :meth:`recv` for the reply)."""
        rid = next(self._rids) if rid is None else rid
        header = msgpack.packb([VERSION, rid, op, cap, args if args is not None else {}], use_bin_type=True)
        self.sock.send_multipart([header] if body is None else [header, body])
        return rid

    def send_frames(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout_ms: int | None = None) -> Reply:
        """The next reply, its header checked against the schema; TimeoutError when none comes."""
        if not self.sock.poll(self.timeout_ms if timeout_ms is None else timeout_ms):
            raise TimeoutError(f"no reply from {self.endpoint}")
        frames = self.sock.recv_multipart()
        assert len(frames) in (1, 2), f"a reply is [header] or [header, body], got {len(frames)} frames"
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
        validator("#/$defs/reply_header").validate(header)
        _, rid, ok, payload = header
        reply = Reply(rid, ok, payload, frames[1] if len(frames) == 2 else None)
        if not ok:
            validator("#/$defs/error").validate(payload)
            code = payload["code"]
            assert code in SCHEMA["$defs"]["errors"], f"an error code the schema does not know: {code}"
            validator(f"#/$defs/errors/{code}").validate(payload)
            self.seen_codes.add(code)
        return reply

    def call(self, op: str, cap: bytes | None, args: dict[str, Any] | None = None, body: bytes | None = None,
             *, timeout_ms: int | None = None) -> Reply:
        """One request and its reply (checked: a success against the op's reply schema and body flag)."""
        rid = self.send(op, cap, args, body)
        reply = self.recv(timeout_ms)
        assert reply.rid == rid, (reply.rid, rid)
        if reply.ok:
            entry = SCHEMA["x-twt"]["ops"][op]
            anonymous = cap is None and entry["without_capability"]
            pointer = f"#/x-twt/ops/{op}/reply_without_capability" if anonymous else f"#/$defs/replies/{op}"
            validator(pointer).validate(reply.payload)
            assert (reply.body is not None) == entry["body_out"], (op, reply.body is not None)
        return reply

    def ok(self, op: str, cap: bytes | None, args: dict[str, Any] | None = None, body: bytes | None = None,
           **kw: Any) -> Any:
        reply = self.call(op, cap, args, body, **kw)
        assert reply.ok, (op, reply.payload)
        return reply.payload if reply.body is None else (reply.payload, reply.body)

    def error(self, code: str, op: str, cap: bytes | None, args: dict[str, Any] | None = None,
              body: bytes | None = None, **kw: Any) -> dict[str, Any]:
        """The request must be refused with ``code``; returns the error's ``fields``."""
        reply = self.call(op, cap, args, body, **kw)
        assert not reply.ok and reply.code == code, (op, args, reply.payload)
        fields: dict[str, Any] = reply.payload["fields"]
        return fields
