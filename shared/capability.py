"""Capability tokens: opaque, immutable, minted by one registry, useless to any other.

Wire format (version 1), all integers big-endian::

    0      1     2                18          26     27            27+n
    | ver | kind | registry id (16) | generation (8) | n | tenant id (n) | HMAC-SHA256 (32) |

The MAC covers every byte before it and is keyed with the registry's secret,
which never leaves the registry's process. Parsing (:meth:`from_bytes`) only
checks the *shape*; whether a token is trusted is decided by the registry
that holds the secret (``TenantRegistry``), with ``hmac.compare_digest``.

Tokens have no public constructor (trio's ``NoPublicConstructor``): only a
registry mints them, through :func:`mint`.

Text form (files, stdout, environment): the token's bytes as lowercase hex on
one line. ``twt register`` / ``twt capability`` print it, ``--cap-out`` and the
supervisor's ``admin.cap`` hold it, and every reader (:func:`capability_from_text`,
:func:`read_capability_file`) also accepts the raw bytes older releases wrote.
The two cannot be confused: a raw token starts with its version byte (1), which
is never an ASCII hex digit.
"""

from __future__ import annotations

import hmac
import os
import string
import struct
from typing import ClassVar, TypeVar

from shared.errors import TenantIsolationViolation

__all__ = [
    "CAPABILITY_VERSION",
    "AnyCapability",
    "Capability",
    "MonitorCapability",
    "RegistryAdminCapability",
    "TenantCapability",
    "capability_bytes_from_text",
    "capability_from_bytes",
    "capability_from_text",
    "capability_to_text",
    "read_capability_file",
    "write_capability_file",
]

CAPABILITY_VERSION = 1
KIND_ADMIN = 1
KIND_TENANT = 2
KIND_MONITOR = 3
REGISTRY_ID_BYTES = 16
MAC_BYTES = 32
_FIXED = struct.Struct(">BB16sQB")  # version, kind, registry id, generation, tenant length
MAX_TOKEN_BYTES = _FIXED.size + 63 + MAC_BYTES

T = TypeVar("T", bound="Capability")


class _NoPublicConstructor(type):
    """Metaclass: ``Cls(...)`` raises; the module mints with ``_construct(Cls, ...)``."""

    def __call__(cls, *args: object, **kwargs: object) -> object:
        raise TypeError(
            f"{cls.__module__}.{cls.__qualname__} has no public constructor: "
            "capabilities are minted by a TenantRegistry (or parsed with from_bytes)"
        )



def _construct(cls: type[T], *args: object) -> T:
    """A new ``cls``: ``type.__call__`` skips the metaclass's refusing ``__call__``."""
    made: T = type.__call__(cls, *args)
    return made


def _refuse(detail: str, reason: str = "malformed") -> TenantIsolationViolation:
    return TenantIsolationViolation(None, f"capability: {detail}", reason)


class Capability(metaclass=_NoPublicConstructor):
    """Common shape of every token kind (immutable; compare and hash by bytes)."""

    __slots__ = ("_raw", "_registry_id", "_generation", "_tenant_id", "_body_len")
    KIND: ClassVar[int] = 0

    _raw: bytes
    _registry_id: bytes
    _generation: int
    _tenant_id: str
    _body_len: int

    def __init__(self, raw: bytes, registry_id: bytes, generation: int, tenant_id: str) -> None:
        object.__setattr__(self, "_raw", raw)
        object.__setattr__(self, "_registry_id", registry_id)
        object.__setattr__(self, "_generation", generation)
        object.__setattr__(self, "_tenant_id", tenant_id)
        object.__setattr__(self, "_body_len", len(raw) - MAC_BYTES)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    @property
    def registry_id(self) -> str:
        """Hex id of the registry that minted this token (public, not a secret)."""
        return self._registry_id.hex()

    @property
    def generation(self) -> int:
        return self._generation

    def to_bytes(self) -> bytes:
        return self._raw

    @classmethod
    def from_bytes(cls: type[T], data: bytes) -> T:
        """Parse a token of this kind. Shape only: trust comes from the registry's check.

        Raises :class:`TenantIsolationViolation` for anything malformed,
        truncated, of another version or of the other kind.
        """
        cap = capability_from_bytes(data)
        if not isinstance(cap, cls):
            raise _refuse(f"expected a {cls.__name__}, got a {type(cap).__name__}", "wrong_kind")
        return cap

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Capability) and hmac.compare_digest(self._raw, other._raw)

    def __hash__(self) -> int:
        return hash(self._raw)

    def __reduce__(self) -> tuple[object, ...]:
        return (capability_from_bytes, (self._raw,))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} registry={self.registry_id[:8]} gen={self._generation}>"


class RegistryAdminCapability(Capability):
    """Grants every admin operation on the one registry that minted it."""

    __slots__ = ()
    KIND = KIND_ADMIN


class TenantCapability(Capability):
    """Grants one tenant's quota and compute operations, until that tenant is evicted."""

    __slots__ = ()
    KIND = KIND_TENANT

    @property
    def tenant_id(self) -> str:
        return self._tenant_id

    def __repr__(self) -> str:
        return (
            f"<TenantCapability {self._tenant_id!r} registry={self.registry_id[:8]} "
            f"gen={self._generation}>"
        )


class MonitorCapability(Capability):
    """Grants the read-only ops of the one registry that minted it (status, events, quota views).

    The monitoring role: a Prometheus sidecar or a remote ``twt status`` holds it instead of the
    admin capability, which can also evict, rotate the key and inject faults. Minted from the
    registry key like the admin capability (the same bytes across restarts; a key rotation
    revokes it), and accepted over TCP without ``allow_remote_admin``: it changes nothing.
    """

    __slots__ = ()
    KIND = KIND_MONITOR


_KINDS: dict[int, type[Capability]] = {KIND_ADMIN: RegistryAdminCapability, KIND_TENANT: TenantCapability,
                                       KIND_MONITOR: MonitorCapability}

#: any kind of token, as parsed
AnyCapability = RegistryAdminCapability | TenantCapability | MonitorCapability


def capability_from_bytes(data: bytes) -> AnyCapability:
    """Parse either kind of token (shape only). Malformed -> :class:`TenantIsolationViolation`."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _refuse(f"expected bytes, got {type(data).__name__}")
    raw = bytes(data)
    if len(raw) < _FIXED.size + MAC_BYTES:
        raise _refuse(f"truncated ({len(raw)} bytes)", "truncated")
    version, kind, registry_id, generation, n = _FIXED.unpack_from(raw)
    if version != CAPABILITY_VERSION:
        raise _refuse(f"unsupported version {version}")
    cls = _KINDS.get(kind)
    if cls is None:
        raise _refuse(f"unknown kind {kind}")
    if len(raw) != _FIXED.size + n + MAC_BYTES:
        raise _refuse(f"length {len(raw)} does not match its tenant field ({n})", "truncated")
    if (kind == KIND_TENANT) == (n == 0):
        raise _refuse("tenant field does not match the kind")
    try:
        tenant = raw[_FIXED.size : _FIXED.size + n].decode("ascii")
    except UnicodeDecodeError:
        raise _refuse("tenant id is not ascii") from None
    if cls is RegistryAdminCapability:
        return _construct(RegistryAdminCapability, raw, registry_id, generation, tenant)
    if cls is MonitorCapability:
        return _construct(MonitorCapability, raw, registry_id, generation, tenant)
    return _construct(TenantCapability, raw, registry_id, generation, tenant)


def mint(
    cls: type[T], secret: bytes, registry_id: bytes, generation: int, tenant_id: str = ""
) -> T:
    """Internal (registries only): build and MAC a token."""
    tenant = tenant_id.encode("ascii")
    body = _FIXED.pack(CAPABILITY_VERSION, cls.KIND, registry_id, generation, len(tenant)) + tenant
    raw = body + hmac.digest(secret, body, "sha256")
    return _construct(cls, raw, registry_id, generation, tenant_id)


def mac_ok(cap: Capability, secret: bytes) -> bool:
    """Internal (registries only): constant-time check of the token's MAC."""
    raw = cap._raw
    body_len = cap._body_len
    return hmac.compare_digest(hmac.digest(secret, raw[:body_len], "sha256"), raw[body_len:])


_HEX = frozenset(string.hexdigits.encode())


def capability_to_text(cap: Capability) -> str:
    """The one text form of a token: lowercase hex, no newline."""
    return cap.to_bytes().hex()


def capability_bytes_from_text(data: bytes | str) -> bytes:
    """Token bytes from its text form (hex, surrounding whitespace ignored) or legacy raw bytes."""
    raw = data.encode("ascii", "replace") if isinstance(data, str) else bytes(data)
    text = raw.strip()
    if text and all(b in _HEX for b in text):
        if len(text) % 2:
            raise _refuse(f"odd number of hex digits ({len(text)})")
        return bytes.fromhex(text.decode("ascii"))
    return raw  # legacy: the raw token (its first byte, the version, is never a hex digit)


def capability_from_text(data: bytes | str) -> AnyCapability:
    """Parse either kind of token from its text form or legacy raw bytes (shape only)."""
    return capability_from_bytes(capability_bytes_from_text(data))


def read_capability_file(path: str | os.PathLike[str]) -> AnyCapability:
    """Read a capability file (hex text, or legacy raw bytes).

    Raises ``OSError`` when the file cannot be read and
    :class:`TenantIsolationViolation` naming the file when it holds no token.
    """
    with open(path, "rb") as f:
        data = f.read(4 * MAX_TOKEN_BYTES)
    try:
        return capability_from_text(data)
    except TenantIsolationViolation as exc:
        raise _refuse(f"{os.fspath(path)} does not hold one ({exc.resource.removeprefix('capability: ')})") from None


def write_capability_file(path: str | os.PathLike[str], cap: Capability) -> None:
    """Write the text form and a newline: a new file with mode 0600, replaced atomically, never via a symlink."""
    target = os.fspath(path)
    tmp = f"{target}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (capability_to_text(cap) + "\n").encode("ascii"))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, target)
