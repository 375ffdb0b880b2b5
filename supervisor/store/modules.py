"""Stored modules on disk: a tenant's ``put_module`` modules survive a supervisor restart.

Layout, inside the state directory (0700, ours)::

    modules/<tenant id>/g<generation>/<sha256 hex>.wasm      0600, content-addressed

Per tenant and per generation, never shared: a module is served only to the
tenant that stored it, under the registration that stored it (an evicted and
re-registered tenant starts with none). The name is the content's sha256 and is
checked again on load, so a file changed behind our back (a compromised worker
of the same user, a bad disk) is dropped with a warning, never served under a
digest it does not have.

Bounds: exactly what the in-memory store holds (``put_module``'s LRU per
tenant and the held-bytes budgets): a module leaving the LRU is removed here
too, an eviction removes the tenant's directory, and a start loads a tenant's
files oldest first up to the same bounds and removes the rest (and every
directory of a tenant or generation the state no longer holds).

Durability: writes run on this store's one thread (the loop never waits for a
disk), each file written to a temporary name, fsynced, renamed; ``close``
(the supervisor's stop) waits for every queued write. A module stored just
before a SIGKILL may be missing after it - the run then answers
``UnknownModule`` and the client sends the module again; it is never wrong.
The bytes waiting for the disk are bounded (:data:`MAX_QUEUED_BYTES`; past it a
save is skipped and logged), and an eviction forgets its tenant's waiting saves.

Compiled-module artifacts (supervisor.store.artifacts: wasmtime-serialized
modules a worker of the tenant handed over when it parked) live in the same
directory as ``<digest>.<fingerprint>.cwasm``, so they share its bounds: they go
with their module (LRU), their tenant's generation (eviction) and a prune.
They are written on the same thread; :meth:`ModuleStore.load_artifacts` also
finds those still waiting for the disk (a park followed at once by a wake).

Owns: ``<state dir>/modules``, ``<state dir>/artifact.key``. Threads: the loop
calls; one writer thread does the file work, in submission order (a save, then
its removal, then an eviction).
"""

from __future__ import annotations

import hashlib
import logging
import os
import collections
import re
import shutil
import stat
import threading
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from shared.log import get_logger, log_event
from shared.sizes import MAX_MODULE_BYTES
from supervisor.store.artifacts import (
    ARTIFACT_KEY_FILE,
    MAX_ARTIFACT_BYTES,
    StoredArtifact,
    artifact_name,
    load_or_create_key,
    parse_artifact_name,
    seal,
    unseal,
)

__all__ = ["MAX_LOADED_ARTIFACT_BYTES", "MAX_QUEUED_BYTES", "MODULES_DIR", "ModuleStore", "StoredArtifact",
           "StoredModule"]

MODULES_DIR = "modules"
#: module bytes waiting for the disk at most; a save past it is skipped (served from memory only)
MAX_QUEUED_BYTES = 256 << 20
#: artifact bytes one activation hands a worker at most (the rest compile at their run)
MAX_LOADED_ARTIFACT_BYTES = 64 << 20
_log = get_logger("supervisor")
_DIGEST_FILE = re.compile(r"([0-9a-f]{64})\.wasm")
_GEN_DIR = re.compile(r"g([1-9][0-9]{0,18})")


@dataclass(frozen=True)
class _Job:
    kind: Literal["save", "remove", "drop", "artifact", "remove_artifact"]
    tenant_id: str
    generation: int
    digest: str | None = None
    data: bytes | None = None
    fingerprint: str | None = None


@dataclass(frozen=True)
class StoredModule:
    """One module found on disk, its content checked against its name."""

    digest: str
    data: bytes


class ModuleStore:
    """The tenants' stored modules under ``root`` (see the module docstring)."""

    def __init__(self, root: str, *, max_queued_bytes: int = MAX_QUEUED_BYTES, artifact_key_path: str | None = None) -> None:
        """``artifact_key_path``: the artifacts' MAC key (default: ``artifact.key`` beside ``root``),
        read or created at the first artifact."""
        self.root = os.path.abspath(root)
        self.max_queued_bytes = max_queued_bytes
        self._key_path = artifact_key_path or os.path.join(os.path.dirname(self.root), ARTIFACT_KEY_FILE)
        self._key_value: bytes | None = None
        self._key_lock = threading.Lock()
        #: artifacts stored, loaded, and dropped (not verified, or named stale or refused by a worker)
        self.artifacts_saved = 0
        self.artifacts_loaded = 0
        self.artifacts_dropped = 0
        self._jobs: collections.deque[_Job] = collections.deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._busy = False
        self._current: _Job | None = None  # the job the writer is carrying out (off the queue, not yet on disk)
        self.failed_writes = 0
        self.skipped_saves = 0

    # ---------------------------------------------------------------- writes (queued)

    def save(self, tenant_id: str, generation: int, digest: str, data: bytes) -> None:
        """Queue ``data`` to be written as ``digest`` of the tenant's generation. Past
        ``max_queued_bytes`` waiting to be written, it is not (served from memory only; logged)."""
        with self._cond:
            if self._queued_bytes + len(data) > self.max_queued_bytes:
                self.skipped_saves += 1
                log_event(_log, logging.WARNING, "modules.not_persisted", tenant=tenant_id, digest=digest,
                          queued_bytes=self._queued_bytes, reason="the disk is behind; served from memory only")
                return
            self._queued_bytes += len(data)
        self._submit(_Job("save", tenant_id, generation, digest, data))

    def remove(self, tenant_id: str, generation: int, digest: str) -> None:
        """Queue the removal of one module (it left the tenant's LRU), its artifacts with it."""
        self._submit(_Job("remove", tenant_id, generation, digest))

    def save_artifact(self, tenant_id: str, generation: int, digest: str, fingerprint: str, data: bytes) -> bool:
        """Queue a compiled module's artifact, which a worker bound to this tenant produced, for
        this tenant's generation only (replacing one under the same name). False when it was not
        kept: too big, a name that is not hex, or the disk behind (see :meth:`save`)."""
        try:
            artifact_name(digest, fingerprint)
        except ValueError:
            return False
        if not 0 < len(data) <= MAX_ARTIFACT_BYTES:
            return False
        with self._cond:
            if self._queued_bytes + len(data) > self.max_queued_bytes:
                self.skipped_saves += 1
                return False
            self._queued_bytes += len(data)
        self._submit(_Job("artifact", tenant_id, generation, digest, data, fingerprint))
        return True

    def remove_artifact(self, tenant_id: str, generation: int, digest: str, fingerprint: str) -> None:
        """Queue the removal of one artifact (a worker found it stale or refused it)."""
        self.artifacts_dropped += 1
        self._submit(_Job("remove_artifact", tenant_id, generation, digest, fingerprint=fingerprint))

    def drop(self, tenant_id: str, generation: int) -> None:
        """Remove every module of the tenant's generation (an eviction): its saves still
        waiting are forgotten at once (their bytes with them), then its directory goes."""
        with self._cond:
            kept = collections.deque(j for j in self._jobs if (j.tenant_id, j.generation) != (tenant_id, generation))
            for job in self._jobs:
                if job.data is not None and (job.tenant_id, job.generation) == (tenant_id, generation):
                    self._queued_bytes -= len(job.data)
            self._jobs = kept
        self._submit(_Job("drop", tenant_id, generation))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued job is done; False when ``timeout_s`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout_s)

    def close(self) -> None:
        """Finish every queued job (the supervisor's stop), then end the thread. Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None

    def _submit(self, job: _Job) -> None:
        with self._cond:
            self._jobs.append(job)
            if self._thread is None:
                self._closing = False
                self._thread = threading.Thread(target=self._run, name="twt-modules", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closing)
                if not self._jobs:
                    return  # closing, and nothing left
                job = self._jobs.popleft()
                self._busy = True
                self._current = job
            try:
                if job.kind == "save":
                    assert job.data is not None and job.digest is not None
                    self._save(job.tenant_id, job.generation, job.digest, job.data)
                elif job.kind == "remove":
                    assert job.digest is not None
                    self._remove(job.tenant_id, job.generation, job.digest)
                elif job.kind == "artifact":
                    assert job.data is not None and job.digest is not None and job.fingerprint is not None
                    self._save_artifact(job.tenant_id, job.generation, job.digest, job.fingerprint, job.data)
                elif job.kind == "remove_artifact":
                    assert job.digest is not None and job.fingerprint is not None
                    _unlink_quietly(os.path.join(self._dir(job.tenant_id, job.generation),
                                                 artifact_name(job.digest, job.fingerprint)))
                else:
                    self._drop(job.tenant_id, job.generation)
            except OSError as exc:  # a full disk: the module is still served from memory until a restart
                self.failed_writes += 1
                log_event(_log, logging.WARNING, "modules.write_failed", op=job.kind, tenant=job.tenant_id,
                          error=exc.strerror or str(exc))
            finally:
                with self._cond:
                    if job.data is not None:
                        self._queued_bytes -= len(job.data)
                    self._busy = False
                    self._current = None
                    self._cond.notify_all()

    @property
    def _key(self) -> bytes:
        """The artifacts' MAC key, read or created on first use (any thread; OSError if the state
        directory cannot hold it: the artifact is then not stored, or not loaded)."""
        with self._key_lock:
            if self._key_value is None:
                self._key_value = load_or_create_key(self._key_path)
            return self._key_value

    def _dir(self, tenant_id: str, generation: int) -> str:
        return os.path.join(self.root, tenant_id, f"g{int(generation)}")

    def _save(self, tenant_id: str, generation: int, digest: str, data: bytes) -> None:
        path = self._dir(tenant_id, generation)
        os.makedirs(path, mode=0o700, exist_ok=True)
        final = os.path.join(path, f"{digest}.wasm")
        if os.path.exists(final):
            return
        self._write(path, final, data)

    def _save_artifact(self, tenant_id: str, generation: int, digest: str, fingerprint: str, data: bytes) -> None:
        path = self._dir(tenant_id, generation)
        if not os.path.isfile(os.path.join(path, f"{digest}.wasm")):
            return  # its module is gone (left the LRU, or its tenant was evicted): nothing would load it
        # not fsynced: a crash that leaves it torn leaves a file that fails its MAC (compiled again)
        self._write(path, os.path.join(path, artifact_name(digest, fingerprint)),
                    seal(self._key, tenant_id, generation, digest, fingerprint, data), durable=False)
        self.artifacts_saved += 1

    @staticmethod
    def _write(path: str, final: str, data: bytes, *, durable: bool = True) -> None:
        """``data`` as ``final``: a temporary file written, fsynced and renamed, the directory fsynced
        (``durable``; else only written and renamed)."""
        tmp = final + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
        if not durable:
            return
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _remove(self, tenant_id: str, generation: int, digest: str) -> None:
        path = self._dir(tenant_id, generation)
        _unlink_quietly(os.path.join(path, f"{digest}.wasm"))
        try:
            names = os.listdir(path)
        except FileNotFoundError:
            return
        for name in names:
            parsed = parse_artifact_name(name)
            if parsed is not None and parsed[0] == digest:
                _unlink_quietly(os.path.join(path, name))

    def _drop(self, tenant_id: str, generation: int) -> None:
        shutil.rmtree(self._dir(tenant_id, generation), ignore_errors=True)
        try:
            os.rmdir(os.path.join(self.root, tenant_id))
        except OSError:
            pass  # another generation's directory is there (being written), or it is gone already

    # ---------------------------------------------------------------- start

    def load(self, tenant_id: str, generation: int) -> list[StoredModule]:
        """The tenant's modules of that generation, oldest first, each checked against its digest.

        A file that is not a module we wrote (wrong name, too big, content not matching
        its digest, a symlink) is removed with a warning. Runs before the loop serves.
        """
        path = self._dir(tenant_id, generation)
        try:
            names = os.listdir(path)
        except FileNotFoundError:
            return []
        found: list[tuple[float, StoredModule]] = []
        for name in names:
            full = os.path.join(path, name)
            if parse_artifact_name(name) is not None:
                continue  # an artifact: checked when it is loaded (load_artifacts)
            match = _DIGEST_FILE.fullmatch(name)
            module = self._read(full) if match else None
            if module is None or match is None or hashlib.sha256(module[1]).hexdigest() != match.group(1):
                log_event(_log, logging.WARNING, "modules.dropped", tenant=tenant_id, file=name,
                          reason="not a stored module, or its content does not match its digest")
                _unlink_quietly(full)
                continue
            found.append((module[0], StoredModule(match.group(1), module[1])))
        found.sort(key=lambda item: (item[0], item[1].digest))
        return [m for _, m in found]

    def load_artifacts(self, tenant_id: str, generation: int, digests: Collection[str]) -> list[StoredArtifact]:
        """The tenant's artifacts of the modules in ``digests`` (its stored modules), each checked
        against its MAC, most recent first, at most :data:`MAX_LOADED_ARTIFACT_BYTES`; those still
        waiting for the disk included. A file that does not verify, or whose module is not in
        ``digests``, is removed (with a warning for the first). Runs on the loop (an activation):
        only the files that fit the budget are read (their size known first)."""
        found: dict[str, tuple[float, StoredArtifact]] = {}
        try:
            key = self._key
        except OSError as exc:
            log_event(_log, logging.WARNING, "modules.artifact_key_unusable", error=exc.strerror or str(exc))
            return []
        with self._cond:
            # the queued jobs and the one being written: between leaving the queue and reaching
            # the disk an artifact is in neither, and an activation then would miss it
            waiting = [*([self._current] if self._current is not None else []), *self._jobs]  # oldest first
            for order, job in enumerate(waiting):
                if (job.kind == "artifact" and job.tenant_id == tenant_id and job.generation == generation
                        and job.digest is not None and job.digest in digests and job.data is not None
                        and job.fingerprint is not None):
                    found[artifact_name(job.digest, job.fingerprint)] = (
                        1e18 + order, StoredArtifact(job.digest, job.fingerprint, job.data))
        out: list[StoredArtifact] = []
        total = 0
        for _, artifact in sorted(found.values(), key=lambda item: -item[0]):  # waiting ones: the newest
            if total + len(artifact.data) <= MAX_LOADED_ARTIFACT_BYTES:
                total += len(artifact.data)
                out.append(artifact)
        path = self._dir(tenant_id, generation)
        try:
            names = os.listdir(path)
        except FileNotFoundError:
            names = []
        on_disk: list[tuple[float, int, str, tuple[str, str]]] = []
        for name in names:
            parsed = parse_artifact_name(name)
            if parsed is None or name in found:
                continue
            full = os.path.join(path, name)
            try:
                st = os.lstat(full)
            except OSError:
                continue
            if parsed[0] not in digests:
                _unlink_quietly(full)  # its module left the tenant's LRU
                continue
            on_disk.append((st.st_mtime, st.st_size, name, parsed))
        for _, size, name, parsed in sorted(on_disk, reverse=True):  # the newest first, read only what fits
            if total + size - 64 > MAX_LOADED_ARTIFACT_BYTES:
                continue
            full = os.path.join(path, name)
            raw = self._read(full, MAX_ARTIFACT_BYTES + 64)
            data = unseal(key, tenant_id, generation, parsed[0], parsed[1], raw[1]) if raw else None
            if raw is None or data is None:
                log_event(_log, logging.WARNING, "modules.artifact_dropped", tenant=tenant_id, file=name,
                          reason="not an artifact this supervisor stored for this tenant (truncated or changed)")
                self.artifacts_dropped += 1
                _unlink_quietly(full)
                continue
            if total + len(data) <= MAX_LOADED_ARTIFACT_BYTES:
                total += len(data)
                out.append(StoredArtifact(parsed[0], parsed[1], data))
        self.artifacts_loaded += len(out)
        return out

    @staticmethod
    def _read(path: str, limit: int = MAX_MODULE_BYTES) -> tuple[float, bytes] | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not 0 < st.st_size <= limit:
                return None
            chunks = []
            left = st.st_size
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    return None
                chunks.append(chunk)
                left -= len(chunk)
            return st.st_mtime, b"".join(chunks)
        finally:
            os.close(fd)

    def prune(self, keep: dict[str, int]) -> int:
        """Remove every directory but the current generation of the tenants in ``keep``
        (tenant id -> generation): what an eviction or a crash left. Returns how many went."""
        try:
            tenants = os.listdir(self.root)
        except FileNotFoundError:
            return 0
        removed = 0
        for tid in tenants:
            tdir = os.path.join(self.root, tid)
            if tid not in keep or not os.path.isdir(tdir) or os.path.islink(tdir):
                _remove_tree(tdir)
                removed += 1
                continue
            for gen in os.listdir(tdir):
                match = _GEN_DIR.fullmatch(gen)
                if match is None or int(match.group(1)) != keep[tid]:
                    _remove_tree(os.path.join(tdir, gen))
                    removed += 1
        return removed


def _remove_tree(path: str) -> None:
    if os.path.islink(path) or not os.path.isdir(path):
        _unlink_quietly(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
