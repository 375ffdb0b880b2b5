"""What parking says to a worker about compiled modules, and what it keeps of the answers.

    park:     export_modules {digests: the tenant's stored modules, max_bytes}
              reply {fingerprint, artifacts: [[digest, n]...]} + body  ──►  keep(): stored under
              *this* tenant and generation only, and only for its stored modules
    activate: import_modules {modules: [[digest, fingerprint, module_n, artifact_n]...]} + body
              (message(): the tenant's own artifacts, within max_bytes)
              reply {loaded, stale, refused}  ──►  settle(): stale and refused files removed

The trust boundary (docs/SECURITY.md): the bytes a worker of tenant T exported
are written only into T's directory (supervisor.store.artifacts seals them for
T) and sent only to a worker of T. Nothing here can fail a park or an
activation: a module without a usable artifact compiles at its run.

Owns: nothing (the store owns the files). Loop thread only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Final

from shared.log import get_logger, log_event

if TYPE_CHECKING:
    from supervisor.runtime.tenants import TenantRuntime
    from supervisor.store.modules import ModuleStore

__all__ = ["ARTIFACT_MESSAGE_BYTES", "ModuleArtifacts"]

_log = get_logger("supervisor")

#: compiled-module bytes one export reply or import message carries at most (what does not fit is
#: compiled at its run); the supervisor lowers it to half the configured message size
ARTIFACT_MESSAGE_BYTES: Final = 32 << 20


class ModuleArtifacts:
    """The tenants' compiled-module artifacts as parking exchanges them with workers."""

    def __init__(self, store: ModuleStore, max_bytes: int = ARTIFACT_MESSAGE_BYTES) -> None:
        self.store = store
        self.max_bytes = max_bytes

    def export_args(self, rt: TenantRuntime) -> dict[str, object] | None:
        """``export_modules``' args for a worker of ``rt`` (None: it has no stored module to ask for)."""
        if not rt.modules:
            return None
        return {"digests": list(rt.modules), "max_bytes": self.max_bytes}

    def keep(self, rt: TenantRuntime, payload: object, body: bytes) -> int:
        """Store what a worker of ``rt`` exported, under ``rt`` only and for its stored modules
        only; returns how many were queued. An unusable reply is logged and dropped."""
        listed = payload.get("artifacts") if isinstance(payload, dict) else None
        fingerprint = payload.get("fingerprint") if isinstance(payload, dict) else None
        if (not isinstance(listed, list) or not isinstance(fingerprint, str)
                or not all(isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], int)
                           and not isinstance(e[1], bool) and e[1] > 0 for e in listed)
                or sum(e[1] for e in listed) != len(body)):
            log_event(_log, logging.WARNING, "tenant.artifacts_unusable", tenant=rt.tenant_id)
            return 0
        kept = 0
        pos = 0
        for digest, n in listed:
            if digest in rt.modules:
                kept += self.store.save_artifact(rt.tenant_id, rt.generation, digest, fingerprint, body[pos:pos + n])
            pos += n
        return kept

    def message(self, rt: TenantRuntime) -> tuple[dict[str, object], memoryview, dict[str, str]] | None:
        """``import_modules``' args and body for a worker of ``rt``, and the fingerprint of each
        artifact sent (for :meth:`settle`); None when it has none. Module and artifact bytes
        together stay within ``max_bytes`` (the most recent artifacts first)."""
        if not rt.modules:
            return None
        entries: list[list[object]] = []
        parts: list[bytes] = []
        sent: dict[str, str] = {}
        total = 0
        for artifact in self.store.load_artifacts(rt.tenant_id, rt.generation, rt.modules):
            module = rt.modules[artifact.digest]
            size = len(module) + len(artifact.data)
            if total + size > self.max_bytes:
                continue
            total += size
            entries.append([artifact.digest, artifact.fingerprint, len(module), len(artifact.data)])
            parts += (module, artifact.data)
            sent[artifact.digest] = artifact.fingerprint
        if not entries:
            return None
        return {"modules": entries}, memoryview(b"".join(parts)), sent

    def settle(self, rt: TenantRuntime, payload: object, sent: dict[str, str]) -> int:
        """A worker of ``rt`` answered an import: the artifacts it found stale (another engine
        fingerprint) or refused (they did not deserialize) are removed - the next park stores fresh
        ones. Returns how many it loaded."""
        if not isinstance(payload, dict):
            return 0
        for key in ("stale", "refused"):
            named = payload.get(key)
            for digest in named if isinstance(named, list) else ():
                if isinstance(digest, str) and digest in sent:
                    self.store.remove_artifact(rt.tenant_id, rt.generation, digest, sent[digest])
        loaded = payload.get("loaded")
        return len(loaded) if isinstance(loaded, list) else 0
