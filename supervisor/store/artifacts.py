"""Compiled-module artifacts on disk: a tenant's wasmtime-serialized modules, kept while it is parked.

Layout, beside the tenant's stored modules (supervisor.store.modules)::

    modules/<tenant id>/g<generation>/<module sha256>.<engine fingerprint>.cwasm     0600
    <state dir>/artifact.key                                                         0600, 32 random bytes

Who writes them: only the supervisor, and only the bytes a worker bound to
*that* tenant handed it (``export_modules`` while the tenant parks), into that
tenant's directory of its current registration. They go back only to a worker
bound to the same tenant (``import_modules`` on activation). The worker never
touches the state directory. ``wasmtime.Module.deserialize`` trusts its input
(an artifact is native code), so that is the trust boundary: an artifact is only
ever loaded by the tenant whose worker produced it (docs/SECURITY.md).

A file is ``magic | version | HMAC-SHA256 | artifact``; the MAC (key:
``artifact.key``) covers the tenant id, generation, module digest, engine
fingerprint and the artifact's bytes, so a truncated or corrupted file, or one
copied from another tenant's directory or under another name, does not verify
and is removed (the module is compiled again at its next run, and the next park
stores a fresh artifact). The fingerprint in the name (the wasmtime release, the
engine's settings and the machine, as the worker computes it) is what a worker
checks before deserializing: another one is stale.

Owns: the file format and the key. Threads: any (pure functions, and the key
file read or created once, before the loop serves).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import struct
from dataclasses import dataclass

__all__ = [
    "ARTIFACT_KEY_FILE",
    "MAX_ARTIFACT_BYTES",
    "StoredArtifact",
    "artifact_name",
    "load_or_create_key",
    "parse_artifact_name",
    "seal",
    "unseal",
]

ARTIFACT_KEY_FILE = "artifact.key"
#: the largest artifact kept (a worker exports at most this much in one reply)
MAX_ARTIFACT_BYTES = 32 << 20
_MAGIC = b"TWTA"
_VERSION = 1
_HEADER = struct.Struct("<4sH32s")
_NAME = re.compile(r"([0-9a-f]{64})\.([0-9a-f]{16,64})\.cwasm")


@dataclass(frozen=True)
class StoredArtifact:
    """One artifact found on disk, its MAC checked."""

    digest: str
    fingerprint: str
    data: bytes


def artifact_name(digest: str, fingerprint: str) -> str:
    """The file name of an artifact; ValueError for a digest or fingerprint that is not hex."""
    name = f"{digest}.{fingerprint}.cwasm"
    if _NAME.fullmatch(name) is None:
        raise ValueError(f"not an artifact name: {name!r}")
    return name


def parse_artifact_name(name: str) -> tuple[str, str] | None:
    """(digest, fingerprint) of an artifact file's name, None for any other name."""
    match = _NAME.fullmatch(name)
    return (match.group(1), match.group(2)) if match else None


def _mac(key: bytes, tenant_id: str, generation: int, digest: str, fingerprint: str, data: bytes) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in (tenant_id.encode(), str(int(generation)).encode(), digest.encode(), fingerprint.encode()):
        mac.update(struct.pack("<I", len(part)) + part)
    mac.update(data)
    return mac.digest()


def seal(key: bytes, tenant_id: str, generation: int, digest: str, fingerprint: str, data: bytes) -> bytes:
    """The file's bytes for ``data``: the header with the MAC over who it belongs to, then ``data``."""
    return _HEADER.pack(_MAGIC, _VERSION, _mac(key, tenant_id, generation, digest, fingerprint, data)) + data


def unseal(key: bytes, tenant_id: str, generation: int, digest: str, fingerprint: str, raw: bytes) -> bytes | None:
    """The artifact in ``raw`` when it was sealed for exactly this tenant, generation, module and
    fingerprint under ``key``; None otherwise (truncated, changed, another tenant's, another name)."""
    if len(raw) <= _HEADER.size:
        return None
    magic, version, tag = _HEADER.unpack_from(raw)
    if magic != _MAGIC or version != _VERSION:
        return None
    data = raw[_HEADER.size:]
    if not hmac.compare_digest(tag, _mac(key, tenant_id, generation, digest, fingerprint, data)):
        return None
    return data


def load_or_create_key(path: str) -> bytes:
    """The artifacts' MAC key at ``path`` (32 bytes, 0600), created on first use. A file that is
    not a 32-byte regular file of ours is replaced with a new key: artifacts sealed under the old
    one then fail their check and are compiled again, which is never wrong."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        pass
    except OSError:
        _unlink(path)
    else:
        try:
            st = os.fstat(fd)
            key = os.read(fd, 33)
        finally:
            os.close(fd)
        if len(key) == 32 and st.st_uid == os.getuid() and st.st_mode & 0o077 == 0:
            return key
        _unlink(path)
    key = secrets.token_bytes(32)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    return key


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
