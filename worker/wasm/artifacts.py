"""Compiled modules that survive parking: the worker's side of wasmtime's serialized artifacts.

    supervisor (supervisor.lifecycle.parking)                 worker (this module)
    park:     export_modules {digests}                 ───►  {fingerprint, artifacts: [[digest, n]...]}
                                                              + body: the artifacts, end to end
              the supervisor writes them to the state dir, into this tenant's own directory only
              (supervisor.store.artifacts: named by digest + fingerprint, MAC'd)
    activate: import_modules {modules: [[digest, fingerprint, module_n, artifact_n]...]}
              + body: each module's bytes, then its artifact  ───►  {loaded, stale, refused}
              (loaded: held; each is deserialized at its module's first run_wasm ...)
              ... the requests the activation was made for ...
              load_modules {}                                  ───►  {loaded, held}
              (... or here, after them, while no other request waits)

Who writes what: a worker never writes an artifact anywhere and never reads the
state directory. It hands its serialized modules to the supervisor, which
stores them under the tenant (and registration) the worker is bound to, and
later hands them back to a worker bound to that same tenant only.
``wasmtime.Module.deserialize`` trusts its input (a crafted artifact is native
code), so this is the trust boundary: an artifact is only ever deserialized by
a worker of the tenant whose worker produced it, so a compromised worker can at
worst compromise its own tenant's later workers - what it already controls.

What an artifact holds: wasmtime's serialized module, the module's interface
(its imports, exported functions' types, frame names and memory limits, read
from the binary once, where it was compiled) and the module's binary
(:func:`~worker.wasm.host.pack_artifact`) - a load takes the interface as it
is, and reads the binary only for an interface that does not read back; a WAT
module's text is assembled once, where it was compiled, not again at each
load. Both are trusted exactly as far as the artifact beside them: all come
from a worker of the same tenant. An artifact stored without the interface
(format 1) or without the binary still loads (its interface read from the
binary, its module's text assembled then).

Lazy: an import only checks each entry (its fingerprint, and that the module
bytes are the ones its digest names) and holds the bytes; the artifact is
deserialized when the first ``run_wasm`` of its module arrives
(:meth:`WasmHost.compile <worker.wasm.host.WasmHost.compile>`), or at the
``load_modules`` the supervisor sends after the requests the activation was
made for - one module at a time, and only while no other request waits (one
arriving meanwhile waits for one module's load at most). So the requests that
woke the tenant never wait for modules they do not run. A deserialized
module's import names are checked again here and their types by the linker.

An artifact under another engine fingerprint (a wasmtime upgrade, other engine
settings) is ``stale`` and one whose module bytes do not match its digest is
``refused``: both are compiled again at their next run, and the supervisor
removes their files (the next park stores fresh ones). One that does not
deserialize at its first run (counted in the host's ``artifact_refusals``) is
compiled then, and the next park exports the fresh compile under the same name.
Only modules this worker compiled itself are exported: one loaded from an
artifact is stored already.

Threads: the executor thread, like every op.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import zmq

from shared.errors import InvalidArgument, WasmCompile
from shared.sizes import MAX_MODULE_BYTES
from worker.wasm.compiler import CACHE_ENTRIES
from worker.wasm.host import WasmHost, engine_fingerprint

if TYPE_CHECKING:
    from worker.server import Reply, WorkerServer

__all__ = ["MAX_EXPORT_BYTES", "op_export_modules", "op_import_modules", "op_load_modules"]

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
#: artifact bytes one ``export_modules`` reply carries at most (what does not fit is compiled again)
MAX_EXPORT_BYTES = 32 << 20
_HEX64 = re.compile(r"[0-9a-f]{64}")
_FINGERPRINT = re.compile(r"[0-9a-f]{16,64}")


def _digests(value: object) -> list[str]:
    if not isinstance(value, list) or len(value) > 4 * CACHE_ENTRIES:
        raise InvalidArgument(f"digests must be a list of at most {4 * CACHE_ENTRIES} sha256 hex strings")
    for d in value:
        if not isinstance(d, str) or not _HEX64.fullmatch(d):
            raise InvalidArgument(f"not a sha256 hex digest: {d!r}")
    return list(value)


def op_export_modules(server: WorkerServer, args: dict[str, object], body: zmq.Frame | None) -> Reply:
    """``export_modules {digests, max_bytes}`` -> ``{fingerprint, artifacts: [[digest, nbytes]...]}`` +
    body: the serialized modules among ``digests`` this worker compiled, end to end, at most
    ``max_bytes`` (default and ceiling :data:`MAX_EXPORT_BYTES`: the reply must fit a message)."""
    digests = _digests(args.get("digests"))
    max_bytes = args.get("max_bytes", MAX_EXPORT_BYTES)
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
        raise InvalidArgument(f"max_bytes must be a positive int, got {max_bytes!r}")
    ctx = server.require_context()
    host = ctx.extensions.get(WasmHost.EXTENSION)
    if not isinstance(host, WasmHost) or not digests:
        return {"fingerprint": engine_fingerprint(), "artifacts": []}, None
    found = host.artifacts(digests, min(max_bytes, MAX_EXPORT_BYTES))
    return ({"fingerprint": engine_fingerprint(), "artifacts": [[d, len(data)] for d, data in found]},
            b"".join(data for _, data in found) if found else None)


def op_import_modules(server: WorkerServer, args: dict[str, object], body: zmq.Frame | None) -> Reply:
    """``import_modules {modules: [[digest, fingerprint, module_nbytes, artifact_nbytes]...]}`` + body
    -> ``{loaded, stale, refused}`` (digests): the tenant's compiled modules held for their first
    run (``loaded``; deserialized then, not now: see the module docstring)."""
    entries = args.get("modules")
    if not isinstance(entries, list) or len(entries) > CACHE_ENTRIES:
        raise InvalidArgument(f"modules must be a list of at most {CACHE_ENTRIES} entries")
    data = body.buffer if body is not None else memoryview(b"")
    parsed: list[tuple[str, str, int, int]] = []
    total = 0
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
                and _HEX64.fullmatch(entry[0]) and isinstance(entry[1], str) and _FINGERPRINT.fullmatch(entry[1])
                and all(isinstance(n, int) and not isinstance(n, bool) for n in entry[2:])
                and 0 < entry[2] <= MAX_MODULE_BYTES and 0 < entry[3] <= MAX_EXPORT_BYTES):
            raise InvalidArgument("modules entries are [sha256 hex, fingerprint hex, module bytes, artifact bytes]")
        parsed.append((entry[0], entry[1], entry[2], entry[3]))
        total += entry[2] + entry[3]
    if total != len(data):
        raise InvalidArgument(f"the body holds {len(data):,} B, the entries name {total:,} B")
    host = WasmHost.for_context(server.require_context())
    mine = engine_fingerprint()
    loaded: list[str] = []
    stale: list[str] = []
    refused: list[str] = []
    pos = 0
    for digest, fingerprint, module_n, artifact_n in parsed:
        module = data[pos:pos + module_n]
        artifact = data[pos + module_n:pos + module_n + artifact_n]
        pos += module_n + artifact_n
        if fingerprint != mine:
            stale.append(digest)
            continue
        try:
            host.hold_artifact(module, digest, artifact)
        except WasmCompile:
            refused.append(digest)  # not the module its digest names (or past the limits): its run says why
            continue
        loaded.append(digest)
    if loaded:
        host.ticker.prestart()  # a run follows: its epoch thread is up by then
    return {"loaded": loaded, "stale": stale, "refused": refused}, None


def op_load_modules(server: WorkerServer, args: dict[str, object], body: zmq.Frame | None) -> Reply:
    """``load_modules {}`` -> ``{loaded, held}``: deserialize the artifacts ``import_modules`` held,
    while no other request waits for this worker (see the module docstring)."""
    host = server.require_context().extensions.get(WasmHost.EXTENSION)
    if not isinstance(host, WasmHost):
        return {"loaded": 0, "held": 0}, None
    sock = getattr(server, "sock", None)

    def idle() -> bool:  # ZMQ_EVENTS, one getsockopt (``Socket.poll`` builds a Poller each call)
        return sock is None or not int(sock.getsockopt(_EVENTS)) & _POLLIN

    return {"loaded": host.load_held(idle), "held": host.held_artifacts}, None
