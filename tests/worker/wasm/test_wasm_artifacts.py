"""Compiled modules as wasmtime artifacts (worker.wasm.artifacts): a worker's serialized modules
load into a fresh worker's cache without a compile, each at its module's first run (an import
deserializes nothing); a stale, corrupt or mismatched one is not loaded and the module is
compiled at its run, as before."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from shared.errors import InvalidArgument, WasmCompile
from tests.helpers.wasm_env import PROBE, Env, tenant_env
from worker.backends.stub import StubBackend
from worker.wasm import guest_source
from worker.wasm.artifacts import op_export_modules, op_import_modules, op_load_modules
from worker.wasm.host import engine_fingerprint

pytestmark = pytest.mark.timeout(60)

TRAPS = guest_source("traps")


@contextmanager
def env(name: str = "art") -> Iterator[Env]:
    with tenant_env(name, StubBackend()) as e:
        yield e


class _Frame:
    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)


class _Server:
    def __init__(self, e: Env) -> None:
        self.context = e.ctx

    def require_context(self) -> Any:
        return self.context


def _run(e: Env, body: bytes, export: str, args: list[Any]) -> dict[str, Any]:
    return e.host.run(body, export, args, fuel=10**9, timeout_s=60.0)


def _export(e: Env, *modules: bytes) -> tuple[dict[str, Any], bytes]:
    reply, body = op_export_modules(_Server(e), {"digests": [hashlib.sha256(m).hexdigest() for m in modules]},
                                    None)  # type: ignore[arg-type]
    return reply, bytes(body or b"")


def _import(e: Env, entries: list[tuple[bytes, str, bytes]]) -> dict[str, Any]:
    """``entries``: (module, fingerprint, artifact)."""
    wire = [[hashlib.sha256(m).hexdigest(), fp, len(m), len(a)] for m, fp, a in entries]
    body = b"".join(m + a for m, _, a in entries)
    reply, _ = op_import_modules(_Server(e), {"modules": wire}, _Frame(body))  # type: ignore[arg-type]
    return reply


def _artifacts_of(e: Env, *modules: bytes) -> list[tuple[bytes, str, bytes]]:
    reply, body = _export(e, *modules)
    out = []
    pos = 0
    by_digest = {hashlib.sha256(m).hexdigest(): m for m in modules}
    for digest, n in reply["artifacts"]:
        out.append((by_digest[digest], reply["fingerprint"], body[pos:pos + n]))
        pos += n
    assert pos == len(body)
    return out


def test_an_exported_artifact_loads_into_a_fresh_worker_without_a_compile() -> None:
    with env() as first:
        assert _run(first, PROBE, "add", [2, 40])["results"] == [42]
        assert _run(first, TRAPS, "ok", [])["results"] == [42]
        artifacts = _artifacts_of(first, PROBE, TRAPS)
        assert {a[0] for a in artifacts} == {PROBE, TRAPS} and all(a[1] == engine_fingerprint() for a in artifacts)
    with env() as second:
        reply = _import(second, artifacts)
        assert sorted(reply["loaded"]) == sorted(hashlib.sha256(m).hexdigest() for m in (PROBE, TRAPS))
        assert reply["stale"] == [] and reply["refused"] == []
        # a run follows an activation: the epoch thread is started already (not by the first run)
        assert second.host.ticker.running and second.host.stats["runs"] == 0
        # held, not deserialized: the import paid for neither module
        assert second.host.stats["artifact_loads"] == 0 and second.host.held_artifacts == 2
        run = _run(second, PROBE, "add", [1, 2])
        assert run["results"] == [3] and run["cached"] is True
        # each module is deserialized at its own first run, the other still held
        assert second.host.stats["artifact_loads"] == 1 and second.host.held_artifacts == 1
        assert _run(second, TRAPS, "ok", [])["cached"] is True
        assert second.host.stats["compiles"] == 0 and second.host.stats["artifact_loads"] == 2
        assert second.host.held_artifacts == 0
        assert _run(second, PROBE, "add", [1, 2])["cached"] is True and second.host.stats["artifact_loads"] == 2
        # a module loaded from an artifact is stored already: it is not exported again
        assert _export(second, PROBE, TRAPS)[0]["artifacts"] == []


def test_only_asked_and_compiled_modules_are_exported() -> None:
    with env() as e:
        assert _export(e, PROBE)[0]["artifacts"] == []  # nothing compiled yet
        _run(e, PROBE, "add", [1, 1])
        assert _export(e, TRAPS)[0]["artifacts"] == []  # not compiled: nothing to give
        assert [d for d, _ in _export(e, PROBE)[0]["artifacts"]] == [hashlib.sha256(PROBE).hexdigest()]


def test_a_stale_fingerprint_is_not_deserialized_and_the_run_compiles() -> None:
    with env() as first:
        _run(first, PROBE, "add", [1, 1])
        (module, _, artifact), = _artifacts_of(first, PROBE)
    with env() as second:
        other = "0" * 32  # another wasmtime release or engine settings
        reply = _import(second, [(module, other, artifact)])
        assert reply == {"loaded": [], "stale": [hashlib.sha256(PROBE).hexdigest()], "refused": []}
        run = _run(second, PROBE, "add", [1, 1])
        assert run["cached"] is False and second.host.stats["compiles"] == 1


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty-ish"])
def test_a_corrupt_artifact_is_refused_and_the_run_compiles(damage: str) -> None:
    with env() as first:
        _run(first, PROBE, "add", [1, 1])
        (module, fp, artifact), = _artifacts_of(first, PROBE)
    bad = {"truncated": artifact[: len(artifact) // 2],
           "flipped": artifact[:16] + bytes(b ^ 0xFF for b in artifact[16:64]) + artifact[64:],
           "empty-ish": b"\0"}[damage]
    with env() as second:
        reply = _import(second, [(module, fp, bad)])  # taken: nothing is deserialized before the run
        assert reply["loaded"] == [hashlib.sha256(PROBE).hexdigest()] and reply["refused"] == []
        run = _run(second, PROBE, "add", [20, 22])  # refused then, and compiled
        assert run["results"] == [42] and run["cached"] is False and second.host.stats["compiles"] == 1
        assert second.host.stats["artifact_refusals"] == 1 and second.host.held_artifacts == 0
        # compiled here, so the next park exports (and the supervisor replaces) it
        assert len(_export(second, PROBE)[0]["artifacts"]) == 1


def test_an_artifact_under_another_modules_digest_is_refused() -> None:
    """The module bytes must be the ones the digest names; the artifact of another module
    deserializes, but is refused where the bytes do not match."""
    with env() as first:
        _run(first, PROBE, "add", [1, 1])
        (_, fp, artifact), = _artifacts_of(first, PROBE)
    with env() as second:
        wire = [[hashlib.sha256(PROBE).hexdigest(), fp, len(TRAPS), len(artifact)]]
        reply, _ = op_import_modules(_Server(second), {"modules": wire}, _Frame(TRAPS + artifact))  # type: ignore[arg-type]
        assert reply["refused"] == [hashlib.sha256(PROBE).hexdigest()] and reply["loaded"] == []
        assert _run(second, TRAPS, "ok", [])["cached"] is False


@pytest.mark.parametrize("args", [
    {"modules": "x"},
    {"modules": [["ab", "0" * 32, 1, 1]]},
    {"modules": [["a" * 64, "zz", 1, 1]]},
    {"modules": [["a" * 64, "0" * 32, 0, 1]]},
    {"modules": [["a" * 64, "0" * 32, True, 1]]},
    {"modules": [["a" * 64, "0" * 32, 5, 5]]},  # the body is not 10 bytes
])
def test_malformed_imports_are_invalid_arguments(args: dict[str, Any]) -> None:
    with env() as e, pytest.raises(InvalidArgument):
        op_import_modules(_Server(e), args, _Frame(b"abc"))  # type: ignore[arg-type]


def test_malformed_exports_are_invalid_arguments() -> None:
    with env() as e:
        for bad in ("x", ["nothex"], [1]):
            with pytest.raises(InvalidArgument):
                op_export_modules(_Server(e), {"digests": bad}, None)  # type: ignore[arg-type]


def test_an_export_stays_within_max_bytes() -> None:
    with env() as e:
        _run(e, PROBE, "add", [1, 1])
        digests = [hashlib.sha256(PROBE).hexdigest()]
        reply, body = op_export_modules(_Server(e), {"digests": digests, "max_bytes": 100}, None)  # type: ignore[arg-type]
        assert reply["artifacts"] == [] and body is None  # the artifact is larger than 100 B
        reply, body = op_export_modules(_Server(e), {"digests": digests, "max_bytes": 1 << 30}, None)  # type: ignore[arg-type]
        assert len(reply["artifacts"]) == 1 and len(body or b"") == reply["artifacts"][0][1]
        for bad in (0, -1, True, "1"):
            with pytest.raises(InvalidArgument):
                op_export_modules(_Server(e), {"digests": digests, "max_bytes": bad}, None)  # type: ignore[arg-type]


class _Waiting:
    """A worker's data socket on which a request arrives after ``after`` idle looks."""

    def __init__(self, after: int) -> None:
        self.after = after

    def getsockopt(self, option: int) -> int:
        import zmq

        assert option == zmq.EVENTS  # what a worker's loop reads too: one getsockopt, no Poller
        self.after -= 1
        return int(zmq.POLLIN) if self.after < 0 else 0


def test_load_modules_deserializes_held_artifacts_until_a_request_waits() -> None:
    """After the requests an activation was made for, ``load_modules`` loads what is held, one
    module at a time, and stops as soon as another request waits (the rest load at their run)."""
    with env() as first:
        _run(first, PROBE, "add", [1, 1])
        _run(first, TRAPS, "ok", [])
        artifacts = _artifacts_of(first, PROBE, TRAPS)
    with env() as second:
        _import(second, artifacts)
        server = _Server(second)
        server.sock = _Waiting(after=1)  # type: ignore[attr-defined]
        reply, _ = op_load_modules(server, {}, None)  # type: ignore[arg-type]
        assert reply == {"loaded": 1, "held": 1} and second.host.stats["artifact_loads"] == 1
        reply, _ = op_load_modules(_Server(second), {}, None)  # type: ignore[arg-type]
        assert reply == {"loaded": 1, "held": 0} and second.host.stats["artifact_loads"] == 2
        assert _run(second, PROBE, "add", [1, 2])["cached"] is True
        assert _run(second, TRAPS, "ok", [])["cached"] is True and second.host.stats["compiles"] == 0
        assert op_load_modules(_Server(second), {}, None)[0] == {"loaded": 0, "held": 0}  # type: ignore[arg-type]
    with env() as bare:  # no module ever handed over: nothing to load
        assert op_load_modules(_Server(bare), {}, None)[0] == {"loaded": 0, "held": 0}  # type: ignore[arg-type]


def test_a_deserialized_module_importing_what_a_guest_may_not_have_is_refused() -> None:
    """The artifact path checks import names again (its types are the linker's): a module that
    imports a function the host does not offer is refused at its run, never linked."""
    bad = b'(module (import "env" "system" (func)) (func (export "ok") (result i32) i32.const 1))'
    with env() as e:
        engine = e.host.engine
        import wasmtime

        artifact = bytes(wasmtime.Module(engine, wasmtime.wat2wasm(bad.decode())).serialize())
        digest = hashlib.sha256(bad).hexdigest()
        assert _import(e, [(bad, engine_fingerprint(), artifact)])["loaded"] == [digest]
        with pytest.raises(WasmCompile, match="env::system is not provided"):
            _run(e, bad, "ok", [])
        assert e.host.stats["artifact_refusals"] == 1


def test_an_artifact_carries_its_modules_binary_so_a_load_assembles_no_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """A WAT module's text is assembled once, where it is compiled: its artifact carries the
    binary, and the load after an activation reads the imports, memory and exports from it."""
    import wasmtime

    from worker.wasm.host import unpack_artifact

    with env() as first:
        _run(first, PROBE, "add", [1, 1])
        (module, fp, artifact), = _artifacts_of(first, PROBE)
    serialized, wasm = unpack_artifact(artifact)
    assert wasm == wasmtime.wat2wasm(PROBE.decode()) and serialized
    with env() as second:
        def no_assembly(text: str) -> bytes:
            raise AssertionError("a load assembled the module's text again")

        monkeypatch.setattr(wasmtime, "wat2wasm", no_assembly)
        assert _import(second, [(module, fp, artifact)])["loaded"] == [hashlib.sha256(PROBE).hexdigest()]
        assert op_load_modules(_Server(second), {}, None)[0] == {"loaded": 1, "held": 0}  # type: ignore[arg-type]
        run = _run(second, PROBE, "add", [20, 22])
        assert run["results"] == [42] and run["cached"] is True and second.host.stats["compiles"] == 0


def test_an_artifact_stored_without_the_binary_still_loads() -> None:
    """An artifact that is wasmtime's serialized module alone (stored before artifacts carried
    the binary) loads as before: its module's text is assembled at the load."""
    from worker.wasm.host import unpack_artifact

    with env() as first:
        _run(first, PROBE, "add", [1, 1])
        (module, fp, artifact), = _artifacts_of(first, PROBE)
    with env() as second:
        _import(second, [(module, fp, unpack_artifact(artifact)[0])])
        run = _run(second, PROBE, "add", [1, 2])
        assert run["results"] == [3] and run["cached"] is True and second.host.stats["compiles"] == 0


def test_an_artifact_whose_parts_do_not_add_up_is_refused_and_the_run_compiles() -> None:
    from worker.wasm.host import ARTIFACT_MAGIC

    with env() as first:
        _run(first, PROBE, "add", [1, 1])
        (module, fp, artifact), = _artifacts_of(first, PROBE)
    bad = ARTIFACT_MAGIC + (len(artifact) * 2).to_bytes(4, "little") + artifact[len(ARTIFACT_MAGIC) + 4:]
    with env() as second:
        _import(second, [(module, fp, bad)])
        run = _run(second, PROBE, "add", [1, 2])
        assert run["results"] == [3] and run["cached"] is False and second.host.stats["artifact_refusals"] == 1


def test_an_artifact_carries_its_modules_interface_so_a_load_reads_no_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's interface (imports, exported functions' types, frame names, memory) is read
    once, where the module is compiled, and travels in its artifact: the load after an activation
    takes it as it is, and the run gives what it gives on a compiled module - a trap's frames named too."""
    from worker.wasm import GUEST_DIR
    from worker.wasm import host as host_mod

    for path in sorted(GUEST_DIR.glob("*.wat")):  # what travels is what the reader finds in the binary
        wasm = host_mod._binary(path.read_bytes())
        names: dict[int, str] = {}
        imports, exports = host_mod.module_interface(wasm, names)
        meta = host_mod.artifact_parts(host_mod.pack_artifact(b"x", wasm))[2]
        assert meta is not None
        assert host_mod.read_interface(meta) == (imports, exports, names, host_mod.memory_limits(wasm))
    with env() as first:
        _run(first, PROBE, "add", [1, 1])
        (module, fp, artifact), = _artifacts_of(first, PROBE)
    with env() as second:
        def no_read(*args: object) -> None:
            raise AssertionError("a load read the module's bytes again")

        for name in ("module_interface", "function_exports", "memory_limits"):
            monkeypatch.setattr(host_mod, name, no_read)
        assert _import(second, [(module, fp, artifact)])["loaded"] == [hashlib.sha256(PROBE).hexdigest()]
        assert op_load_modules(_Server(second), {}, None)[0] == {"loaded": 1, "held": 0}  # type: ignore[arg-type]
        run = _run(second, PROBE, "add", [20, 22])
        assert run["results"] == [42] and run["cached"] is True and second.host.stats["compiles"] == 0
        assert run["memory_bytes"] > 0  # its memory's limits came with it: the run reserved and had one


def test_an_artifact_whose_interface_does_not_read_back_loads_from_the_modules_bytes() -> None:
    """An interface that is not what pack_artifact writes (damaged, or of another shape) is not
    used: the load reads the module's binary as for an artifact without one, and the run is the same."""
    from worker.wasm import host as host_mod

    with env() as first:
        _run(first, PROBE, "add", [1, 1])
        (module, fp, artifact), = _artifacts_of(first, PROBE)
    serialized, wasm, meta = host_mod.artifact_parts(artifact)
    assert meta is not None and wasm is not None
    for junk in (b"\xc1" * len(meta), host_mod.msgpack.packb([[[1, 2]], [], [], None]),
                 host_mod.msgpack.packb([[], [["add", ["i32"], [7]]], [], None])):
        bad = (host_mod.ARTIFACT_MAGIC + len(serialized).to_bytes(4, "little") + serialized
               + len(junk).to_bytes(4, "little") + junk + wasm)
        with pytest.raises((ValueError, TypeError)):
            host_mod.read_interface(junk)
        with env() as second:
            _import(second, [(module, fp, bad)])
            run = _run(second, PROBE, "add", [1, 2])
            assert run["results"] == [3] and run["cached"] is True and second.host.stats["compiles"] == 0


def test_an_artifact_of_the_first_format_still_loads() -> None:
    """An artifact stored before artifacts carried the interface (the serialized module and the
    binary) loads as it did: the interface read from the binary."""
    from worker.wasm import host as host_mod

    with env() as first:
        _run(first, PROBE, "add", [1, 1])
        (module, fp, artifact), = _artifacts_of(first, PROBE)
    serialized, wasm = host_mod.unpack_artifact(artifact)
    assert wasm is not None
    old = host_mod.ARTIFACT_MAGIC_V1 + len(serialized).to_bytes(4, "little") + serialized + wasm
    assert host_mod.artifact_parts(old) == (serialized, wasm, None)
    with env() as second:
        _import(second, [(module, fp, old)])
        run = _run(second, PROBE, "add", [1, 2])
        assert run["results"] == [3] and run["cached"] is True and second.host.stats["compiles"] == 0
