"""Conformance: a raw client (``raw_client.py``: pyzmq, msgpack, jsonschema) against a real supervisor.

One supervisor per transport (module-scoped, started as ``twt supervise``
with the stub backend), every op and every error code the supervisor sends,
over ipc and over TCP with CURVE; every reply is checked against
``shared/protocol.schema.json``, and the argument refusals are generated
from it. The last test of each transport checks that everything the schema
lists was exercised, except the codes named in :data:`UNREACHABLE` with the
reason. Read this file with docs/PROTOCOL.md as an example of a client in
any language: nothing here imports the project.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.raw_client import SCHEMA, VERSION, RawClient, read_admin_cap, read_ready
from tests.helpers import zygote
from tests.helpers.timeouts import scaled

pytestmark = pytest.mark.timeout(300)

#: error codes the supervisor may send that this suite cannot provoke on the stub backend
UNREACHABLE = {
    "cuda_error": "a CUDA driver call failing needs the cuda backend",
    "segment_error": "needs a damaged quota segment",
    "state_error": "needs a state database that refuses writes (rotate_key)",
    "internal": "a bug in the supervisor",
    "draining": "needs a supervisor that is stopping (tests/supervisor/lifecycle/test_drain.py)",
    "fault_injection_disabled": "needs a supervisor with fault_injection = false (tests/supervisor/control/test_roles.py)",
}

ADD = b'(module (func (export "add") (param i32 i32) (result i32) local.get 0 local.get 1 i32.add))'
TRAP = b'(module (func (export "boom") unreachable))'
SPIN = b'(module (func (export "spin") (loop (br 0))))'
BIG_MEMORY = b'(module (memory 2048) (func (export "f")))'  # 128 MiB of linear memory: above the quota
#: a run deadline that only turns a hang into a failure (scaled: a loaded host's compile fits it)
HANG_GUARD_S = scaled(60)

MAIN = "conf-main"  # from the config file: its capability comes from the `capability` op
CONFIG = f"""
[supervisor]
pool_size = 0
# far above what this suite runs (a few instances), so that scaling past it is refused typed
max_workers = 48

[[tenant]]
name = "{MAIN}"
memory_quota_bytes = "64MiB"
gpu_memory_bytes_cap = "1MiB"
"""


@dataclass
class Supervisor:
    transport: str
    run_dir: str
    config: Path
    proc: subprocess.Popen[bytes]
    client: RawClient
    #: ipc run: a CURVE client on the same supervisor, which refuses admin ops over TCP
    tcp_no_admin: RawClient | None
    ops_seen: set[str] = field(default_factory=set)

    @property
    def info(self) -> dict[str, Any]:
        return read_ready(self.run_dir)

    def admin(self) -> bytes:
        return read_admin_cap(self.run_dir)  # read each time: rotate_key replaces it

    def cap(self, tenant: str = MAIN) -> bytes:
        cap: bytes = self.ok("capability", self.admin(), {"tenant": tenant})["capability"]
        return cap

    def ok(self, op: str, cap: bytes | None, args: dict[str, Any] | None = None, body: bytes | None = None,
           **kw: Any) -> Any:
        self.ops_seen.add(op)
        return self.client.ok(op, cap, args, body, **kw)

    def error(self, code: str, op: str, cap: bytes | None, args: dict[str, Any] | None = None,
              body: bytes | None = None, **kw: Any) -> dict[str, Any]:
        self.ops_seen.add(op)
        return self.client.error(code, op, cap, args, body, **kw)


@pytest.fixture(scope="module", params=["ipc", "tcp"])
def sup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervisor]:
    transport: str = request.param
    base = tmp_path_factory.mktemp(f"conf-{transport}")
    run_dir = str(base / "rd")
    config = base / "tenants.toml"
    config.write_text(CONFIG)
    cmd = [sys.executable, "-m", "supervisor", "supervise", "--config", str(config), "--run-dir", run_dir, "--backend", "stub",
           "--listen", "tcp://127.0.0.1:0"]
    if transport == "tcp":
        cmd.append("--allow-remote-admin")
    log = base / "supervisor.log"
    with open(log, "wb") as out:
        # `twt supervise`, forked from the suite's zygote as every other supervisor of the suite
        # (its workers from a forked fork server): the wire is the same as a fresh process's
        proc = zygote.popen(cmd, stdout=subprocess.DEVNULL, stderr=out)
    clients: list[RawClient] = []
    try:
        deadline = time.monotonic() + scaled(120)
        while not os.path.exists(os.path.join(run_dir, "supervisor.json")):
            if proc.poll() is not None:
                raise RuntimeError(f"twt supervise exited {proc.returncode}: {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"twt supervise did not become ready in {scaled(120):.0f} s")
            time.sleep(0.05)
        info = read_ready(run_dir)
        tcp_endpoint, server_key = info["listen"][0], info["server_public_key"].encode("ascii")
        if transport == "ipc":
            client = RawClient(info["frontend"])
            tcp_no_admin: RawClient | None = RawClient(tcp_endpoint, server_key)
            clients += [client, tcp_no_admin]
        else:
            client = RawClient(tcp_endpoint, server_key)
            tcp_no_admin = None
            clients.append(client)
        yield Supervisor(transport, run_dir, config, proc, client, tcp_no_admin)
    finally:
        for c in clients:
            c.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def _register(sup: Supervisor, name: str, **spec: Any) -> bytes:
    result = sup.ok("register", sup.admin(), {"spec": {"tenant_id": name, **spec}}, timeout_ms=120_000)
    assert result["tenant"]["tenant_id"] == name and result["tenant"]["state"] == "running"
    cap: bytes = result["capability"]
    assert isinstance(cap, bytes)
    return cap


def _evict(sup: Supervisor, name: str) -> None:
    result = sup.ok("evict", sup.admin(), {"tenant": name}, timeout_ms=120_000)
    assert result["evicted"] == name, result


# ------------------------------------------------------------------ the client is raw


def test_the_client_imports_nothing_of_the_project() -> None:
    here = Path(__file__).parent
    for path in here.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name.split(".")[0] not in ("shared", "supervisor", "worker"), (path.name, name)


# ------------------------------------------------------------------ discovery and liveness


def test_supervisor_json_and_admin_cap_are_as_documented(sup: Supervisor) -> None:
    info = sup.info
    for key, kind in (("pid", int), ("version", int), ("registry_id", str), ("backend", str), ("frontend", str),
                      ("events", str), ("started", float), ("state_dir", str), ("listen", list),
                      ("server_public_key", str)):
        assert isinstance(info[key], kind), key
    assert "metrics_url" in info and info["version"] == VERSION and len(info["server_public_key"]) == 40
    raw = (Path(sup.run_dir) / "admin" / "admin.cap").read_text()
    assert raw.endswith("\n") and raw.strip() == raw.strip().lower() and bytes.fromhex(raw.strip()) == sup.admin()
    # a capability: version 1, kind (1 admin, 2 tenant), then the registry id (16 bytes) that supervisor.json names
    assert sup.admin()[:2] == b"\x01\x01" and sup.admin()[2:18].hex() == info["registry_id"]
    assert sup.cap()[:2] == b"\x01\x02" and sup.cap()[2:18].hex() == info["registry_id"]
    hello = sup.ok("hello", sup.admin())
    assert hello["protocol"] == VERSION and hello["registry_id"] == info["registry_id"] and hello["pid"] == info["pid"]


def test_hello_without_a_capability_says_only_version_and_readiness(sup: Supervisor) -> None:
    for client in filter(None, (sup.client, sup.tcp_no_admin)):
        reply = client.ok("hello", None)
        assert reply == {"protocol": VERSION, "ready": True}
    sup.ops_seen.add("hello")


def test_a_request_behind_an_empty_delimiter_is_dropped_unanswered(sup: Supervisor) -> None:
    """What a REQ socket sends: [b"", header]. The supervisor cannot read a rid in it and drops it;
    the next request on the same connection is answered, and nothing came for the first."""
    sup.client.send_frames([b"", _header(7001, "hello", None, {})])
    rid = sup.client.send("hello", None)
    reply = sup.client.recv()
    assert reply.rid == rid and reply.ok
    assert not sup.client.sock.poll(0)


def _header(rid: int, op: Any, cap: Any, args: Any, version: Any = VERSION) -> bytes:
    import msgpack

    data: bytes = msgpack.packb([version, rid, op, cap, args], use_bin_type=True)
    return data


# ------------------------------------------------------------------ happy paths


def test_tenant_ops_of_the_main_tenant(sup: Supervisor) -> None:
    cap = sup.cap()
    ping = sup.ok("ping", cap)
    assert ping["tenant"] == MAIN
    h = sup.ok("alloc", cap, {"nbytes": 64})["handle"]
    assert 2**32 <= h < 2**56 and isinstance(h, int)  # PROTOCOL.md "Handles": keep it a 64-bit int
    assert sup.ok("write", cap, {"handle": h, "offset": 0}, b"x" * 64)["written"] == 64
    result, body = sup.ok("read", cap, {"handle": h, "nbytes": 64})
    assert result["nbytes"] == 64 and body == b"x" * 64
    assert [h, 64] in sup.ok("buffers", cap)["buffers"]
    assert sup.ok("quota", cap)["tenant_id"] == MAIN
    digest = sup.ok("put_module", cap, None, ADD)["digest"]
    assert sup.ok("run_wasm", cap, {"export": "add", "args": [2, 3], "digest": digest})["results"] == [5]
    assert sup.ok("run_wasm", cap, {"export": "add", "args": [4, 5]}, ADD)["results"] == [9]
    assert sup.ok("free", cap, {"handle": h})["freed"] == 64
    page = sup.ok("events", cap, {"after": 0, "max": 50})
    assert all(e.get("tenant") == MAIN for e in page["events"])


def test_echo_answers_the_text_it_was_sent(sup: Supervisor) -> None:
    assert sup.ok("echo", sup.cap(), {"text": "héllo"}) == {"text": "héllo"}  # its reply checked by the schema
    sup.error("invalid_argument", "echo", sup.cap(), {"text": 3})
    sup.error("invalid_argument", "echo", sup.cap(), {})
    sup.error("protocol_error", "echo", sup.cap(), {"text": "x"}, b"a body")  # it takes no body


def test_admin_ops_on_the_main_tenant(sup: Supervisor) -> None:
    admin = sup.admin()
    status = sup.ok("status", admin)
    assert any(t["tenant_id"] == MAIN for t in status["tenants"])
    assert sup.ok("version", admin)["protocol"] == 1
    record = sup.ok("tenant_status", admin, {"tenant": MAIN})
    assert record["origin"] == "file" and record["spec"]["gpu_memory_bytes_cap"] == 1 << 20
    assert sup.ok("set_quota", admin, {"tenant": MAIN, "memory_quota_bytes": "64MiB",
                                       "gpu_memory_bytes_cap": 1 << 20})["memory_quota_bytes"] == 64 << 20
    page = sup.ok("events", admin, {"after": 0, "kinds": ["register", "set_quota"]})
    assert {e["event"] for e in page["events"]} <= {"register", "set_quota"} and page["events"]
    summary = sup.ok("reload", admin)
    assert MAIN in summary["unchanged"]
    # past the supervisor's max_workers: refused with the limit's numbers, nothing changed
    fields = sup.error("capacity_exhausted", "scale", admin, {"tenant": MAIN, "instances": 49})
    assert (fields["setting"], fields["limit"]) == ("max_workers", 48)
    assert len(sup.ok("tenant_status", admin, {"tenant": MAIN})["instances"]) == 1


def test_register_capability_evict_and_a_revoked_capability(sup: Supervisor) -> None:
    name = "conf-extra"
    cap = _register(sup, name, memory_quota_bytes="16MiB", gpu_memory_bytes_cap=None, restart="on-failure",
                    request_timeout_s=20, wasm_max_memory_bytes="1MiB")
    assert sup.cap(name) == cap
    assert sup.ok("ping", cap)["tenant"] == name
    sup.error("already_registered", "register", sup.admin(), {"spec": {"name": name}})
    _evict(sup, name)
    fields = sup.error("capability_revoked", "ping", cap)
    assert fields["tenant_id"] == name  # its parent's code (isolation_violation) never shows
    sup.error("unknown_tenant", "tenant_status", sup.admin(), {"tenant": name})
    sup.error("unknown_tenant", "capability", sup.admin(), {"tenant": name})


def test_regions_serve_local_clients_only(sup: Supervisor) -> None:
    cap = sup.cap()
    if sup.transport == "tcp":
        sup.error("invalid_argument", "region_create", cap, {"nbytes": 1 << 16, "pid": os.getpid()})
        sup.error("invalid_argument", "region_release", cap, {"region": 1})
        sup.error("invalid_argument", "write_region", cap, {"handle": 1, "region": 1, "nbytes": 1})
        sup.error("invalid_argument", "read_region", cap, {"handle": 1, "region": 1, "nbytes": 1})
        return
    region = sup.ok("region_create", cap, {"nbytes": 1 << 16, "pid": os.getpid()})
    assert region["nbytes"] >= 1 << 16 and region["name"]
    src = sup.ok("alloc", cap, {"nbytes": 256})["handle"]
    dst = sup.ok("alloc", cap, {"nbytes": 256})["handle"]
    data = bytes(range(256))
    sup.ok("write", cap, {"handle": src}, data)
    assert sup.ok("read_region", cap, {"handle": src, "region": region["region"], "nbytes": 256})["nbytes"] == 256
    assert sup.ok("write_region", cap, {"handle": dst, "region": region["region"], "nbytes": 256})["written"] == 256
    assert sup.ok("read", cap, {"handle": dst, "nbytes": 256})[1] == data
    assert sup.ok("region_release", cap, {"region": region["region"]})["released"] == region["nbytes"]
    sup.error("invalid_argument", "region_release", cap, {"region": region["region"]})
    for h in (src, dst):
        sup.ok("free", cap, {"handle": h})
    fields = sup.error("memory_exhausted", "region_create", cap, {"nbytes": 1 << 30, "pid": os.getpid()})
    assert fields["tenant_id"] == MAIN and fields["requested"] > fields["limit"] - fields["current"]


# ------------------------------------------------------------------ errors


def test_refused_capabilities(sup: Supervisor) -> None:
    cap, admin = sup.cap(), sup.admin()
    sup.error("isolation_violation", "ping", None)
    forged = cap[:-1] + bytes([cap[-1] ^ 1])  # one bit of the MAC
    sup.error("isolation_violation", "ping", forged)
    sup.error("isolation_violation", "status", cap)  # a tenant capability for an admin op
    sup.error("isolation_violation", "hello", cap)
    sup.error("isolation_violation", "alloc", admin, {"nbytes": 1})  # the admin one for a tenant op
    sup.error("isolation_violation", "ping", b"\x01\x02")  # truncated
    if sup.tcp_no_admin is not None:  # admin ops over TCP without allow_remote_admin
        sup.tcp_no_admin.error("isolation_violation", "status", admin)
        sup.client.seen_codes |= sup.tcp_no_admin.seen_codes
        page = sup.ok("events", admin, {"after": 0, "kinds": ["denied"], "max": 1000})
        denied = [e for e in page["events"] if e["op"] == "status" and e["reason"] == "other"]
        assert denied and denied[-1]["verified"] is False and denied[-1]["tenant"] is None
        assert "claimed" not in denied[-1]  # an admin capability names no tenant


def test_the_monitor_capability_reads_and_changes_nothing(sup: Supervisor) -> None:
    """``capability {role: "monitor"}``: a token of kind 3 that the read-only ops accept - over TCP
    without allow_remote_admin too - and every op that changes state refuses."""
    monitor = sup.ok("capability", sup.admin(), {"role": "monitor"})["capability"]
    assert monitor[:2] == b"\x01\x03" and monitor[2:18].hex() == sup.info["registry_id"]
    for client in filter(None, (sup.client, sup.tcp_no_admin)):
        assert MAIN in {t["tenant_id"] for t in client.ok("status", monitor)["tenants"]}
        assert client.ok("version", monitor)["protocol"] == VERSION
        assert client.ok("tenant_status", monitor, {"tenant": MAIN})["tenant_id"] == MAIN
        assert "events" in client.ok("events", monitor, {"after": 0, "max": 1})
        client.error("isolation_violation", "evict", monitor, {"tenant": MAIN})
        client.error("isolation_violation", "capability", monitor, {"tenant": MAIN})
        client.error("isolation_violation", "ping", monitor)
        sup.client.seen_codes |= client.seen_codes
    sup.error("invalid_argument", "capability", sup.admin(), {"role": "root"})
    sup.error("invalid_argument", "capability", sup.admin(), {})


def test_protocol_errors(sup: Supervisor) -> None:
    c = sup.client
    for frames in (
        [_header(11, "ping", None, {}, version=VERSION + 1)],  # a version this supervisor does not speak
        [_header(12, "ping", "not-bin", {})],  # the capability as str
        [_header(13, "no_such_op", None, {})],
        [_header(14, "ping", None, [])],  # args not a map
        [_header(15, "put_module", None, {}), b"body", b"one too many"],
        [_header(16, "ping", None, {}), b"a body ping does not take"],  # never silently accepted
    ):
        c.send_frames(frames)
        reply = c.recv()
        assert not reply.ok and reply.code == "protocol_error" and reply.rid == msgpack_rid(frames[0])


def msgpack_rid(header: bytes) -> int:
    import msgpack

    rid: int = msgpack.unpackb(header, raw=False)[1]
    return rid


def _wrong_value(schema: dict[str, Any]) -> Any:
    """A value of a type the argument's schema does not allow (a bool never is, unless declared)."""
    return True if "boolean" not in str(schema) else b"\x00"


def test_argument_refusals_generated_from_the_schema(sup: Supervisor) -> None:
    """For every op and every declared argument: missing (when required) and of a wrong type."""
    cap, admin = sup.cap(), sup.admin()
    for op, args_schema in SCHEMA["$defs"]["args"].items():
        props: dict[str, Any] = args_schema.get("properties", {})
        required: list[str] = args_schema.get("required", [])
        who = admin if SCHEMA["x-twt"]["ops"][op]["capability"] == "admin" else cap
        valid = {name: _plausible(op, name) for name in required}
        for name in required:
            sup.error("invalid_argument", op, who, {k: v for k, v in valid.items() if k != name})
        for name, schema in props.items():
            sup.error("invalid_argument", op, who, {**valid, name: _wrong_value(schema)})


def _plausible(op: str, name: str) -> Any:
    """A well-typed value for a required argument (the refusal under test is another argument's)."""
    schema = SCHEMA["$defs"]["args"][op]["properties"][name]
    kind = schema.get("type")
    if name == "tenant":
        return MAIN
    if "$ref" in schema or "anyOf" in schema:
        return {"tenant_id": "conf-never"} if name == "spec" else 1
    if kind in ("integer", "number") or (isinstance(kind, list) and "integer" in kind):
        return 1
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return "x"
    if kind == "object":
        return {}
    if kind == "array":
        return []
    return None


def test_wasm_errors(sup: Supervisor) -> None:
    cap = sup.cap()
    sup.error("wasm_compile", "run_wasm", cap, {"export": "f"}, b"this is not a module")
    assert sup.error("wasm_trap", "run_wasm", cap, {"export": "boom"}, TRAP)["trap_code"]
    sup.error("unknown_module", "run_wasm", cap, {"export": "f", "digest": "0" * 64})
    sup.error("memory_exhausted", "run_wasm", cap, {"export": "f"}, BIG_MEMORY)
    fields = sup.error("gpu_memory_exhausted", "alloc", cap, {"nbytes": 2 << 20})
    assert fields["limit"] == 1 << 20 and fields["requested"] == 2 << 20


def test_lifecycle_errors(sup: Supervisor) -> None:
    """One tenant through overload, a deadline, a restart, a stop, a crash, a failure and a reset."""
    name = "conf-life"
    # the tenant's ceiling is a hang guard: a run's deadline covers its module's compile, and a loaded
    # host's first compile in a fresh worker outlasted a short one (the worker then exits, and with
    # max_restarts = 0 the tenant failed); the deadline asserted below is the run's own
    cap = _register(sup, name, max_in_flight=1, max_restarts=0, wasm_timeout_s=HANG_GUARD_S, wasm_fuel=1 << 62)
    admin = sup.admin()
    c = sup.client
    try:
        # SPIN compiled first, with no deadline that matters: a small fuel ends it, and the worker's
        # cache has it, so the short deadline below covers the run alone
        sup.error("wasm_trap", "run_wasm", cap, {"export": "spin", "fuel": 1000}, SPIN)
        # overloaded while its one request slot runs a guest that never ends; that run's deadline
        spin = c.send("run_wasm", cap, {"export": "spin", "timeout_s": 0.5}, SPIN)
        ping = c.send("ping", cap)
        replies = {r.rid: r for r in (c.recv(), c.recv())}
        assert replies[ping].code == "overloaded" and replies[spin].code == "kernel_timeout", replies
        assert replies[ping].payload["fields"]["limit"] == 1
        assert replies[spin].payload["fields"]["timeout_s"] == 0.5  # the run's own deadline stopped it
        sup.ops_seen |= {"run_wasm", "ping"}
        # a handle from before a restart
        h = sup.ok("alloc", cap, {"nbytes": 16})["handle"]
        assert sup.ok("restart", admin, {"tenant": name}, timeout_ms=120_000)["tenant_id"] == name
        sup.error("buffer_lost", "read", cap, {"handle": h, "nbytes": 16})
        # scaled to 0: stopped; a fault has no live instance
        assert sup.ok("scale", admin, {"tenant": name, "instances": 0})["state"] == "stopped"
        sup.error("tenant_stopped", "ping", cap)
        sup.error("worker_lost", "inject_fault", admin, {"tenant": name, "kind": "crash"})
        sup.ok("scale", admin, {"tenant": name, "instances": 1})
        _wait_running(sup, name)
        # a crash with max_restarts = 0: failed, until reset
        armed = sup.ok("inject_fault", admin, {"tenant": name, "kind": "crash"}, timeout_ms=120_000)
        assert armed["kind"] == "crash"
        _wait_state(sup, name, "failed")
        sup.error("tenant_failed", "ping", cap)
        sup.error("tenant_failed", "restart", admin, {"tenant": name})
        assert sup.ok("reset", admin, {"tenant": name}, timeout_ms=120_000)["state"] == "running"
        assert sup.ok("ping", cap)["tenant"] == name
    finally:
        _evict(sup, name)


def _wait_state(sup: Supervisor, name: str, state: str) -> None:
    """Poll tenant_status until the tenant is in ``state`` (the event it waits for), at most a minute."""
    deadline = time.monotonic() + scaled(60)
    while sup.ok("tenant_status", sup.admin(), {"tenant": name})["state"] != state:
        assert time.monotonic() < deadline, f"{name} never became {state}"
        time.sleep(0.05)


def _wait_running(sup: Supervisor, name: str) -> None:
    _wait_state(sup, name, "running")


def test_config_errors_and_backend_refusals(sup: Supervisor) -> None:
    admin = sup.admin()
    good = sup.config.read_text()
    sup.config.write_text(good + "\n[[tenant]\n")  # not TOML
    try:
        assert sup.error("config_error", "reload", admin)["path"] == str(sup.config)
    finally:
        sup.config.write_text(good)
    reply = sup.client.call("register", admin, {"spec": {"tenant_id": "conf-mps", "isolation": "mps"}},
                            timeout_ms=120_000)
    sup.ops_seen.add("register")
    if reply.ok:  # an MPS daemon runs here after all: nothing to refuse
        _evict(sup, "conf-mps")
        pytest.skip("an MPS daemon runs on this host: isolation=mps is not refused")
    assert reply.code == "backend_unavailable", reply.payload


def test_rotate_key_revokes_every_capability(sup: Supervisor) -> None:
    old_admin, old_cap = sup.admin(), sup.cap()
    result = sup.ok("rotate_key", old_admin)
    assert result["admin_capability"] == sup.admin() != old_admin  # admin.cap holds the new one
    sup.error("capability_revoked", "status", old_admin)
    sup.error("capability_revoked", "ping", old_cap)
    assert sup.ok("ping", sup.cap())["tenant"] == MAIN



def _handshake_event(endpoint: str, server_key: bytes, *, client_keys: bool = True) -> int:
    """Connect a DEALER as a raw client would, send hello, and return the first handshake event its
    monitor reports; afterwards no reply has come (the request never left the client)."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_serverkey = server_key
    if client_keys:
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                      | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        sock.connect(endpoint)
        sock.send(_header(1, "hello", None, {}))
        assert monitor.poll(60_000), "no handshake event within a minute"
        event = int(recv_monitor_message(monitor)["event"])
        if event != zmq.EVENT_HANDSHAKE_SUCCEEDED:
            assert not sock.poll(0)  # a failed handshake is silence on the socket itself
        return event
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


def test_a_wrong_server_key_is_only_a_monitor_event(sup: Supervisor) -> None:
    import zmq

    info = sup.info  # both supervisors listen on TCP (the ipc one without allow_remote_admin)
    endpoint, key = info["listen"][0], info["server_public_key"].encode("ascii")
    assert _handshake_event(endpoint, key) == zmq.EVENT_HANDSHAKE_SUCCEEDED
    wrong = zmq.curve_keypair()[0]
    assert _handshake_event(endpoint, wrong) == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    # the server key alone is not enough, even without an allow-list: a client needs a pair of its own
    assert _handshake_event(endpoint, key, client_keys=False) == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


def test_everything_the_schema_lists_was_exercised(sup: Supervisor) -> None:
    """Run last for each transport: every op, and every code the supervisor sends, was seen."""
    assert set(SCHEMA["x-twt"]["ops"]) <= sup.ops_seen, sorted(set(SCHEMA["x-twt"]["ops"]) - sup.ops_seen)
    sent = {code for code, meta in SCHEMA["x-twt"]["errors"].items() if meta["sent_by_supervisor"]}
    missing = sent - sup.client.seen_codes - set(UNREACHABLE)
    assert not missing, sorted(missing)
