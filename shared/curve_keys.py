"""CURVE key pairs as client and supervisor both read them: Z85 text, ZPL certificate files.

A remote client (``SupervisorClient.remote``) needs its own key pair - fresh, or from a
certificate file - and the supervisor's public key as Z85 text; the supervisor reads the same
formats for its own keys and the allow-list (:mod:`supervisor.admission.curve`). All
cryptography is libzmq's (CurveZMQ through pyzmq): this module only parses and checks keys.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

__all__ = ["CurveKeyPair", "load_client_keys", "load_key_pair", "parse_public_key"]

_Z85_LEN = 40


@dataclass(frozen=True)
class CurveKeyPair:
    """A CURVE key pair as Z85 bytes (40 characters each)."""

    public: bytes
    secret: bytes

    @classmethod
    def generate(cls) -> CurveKeyPair:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @property
    def public_text(self) -> str:
        return self.public.decode("ascii")

    def __repr__(self) -> str:  # never print the secret
        return f"CurveKeyPair(public={self.public_text!r})"


def parse_public_key(key: str | bytes, what: str = "server public key") -> bytes:
    """Z85 text of a 32-byte key, checked; ValueError with the reason otherwise."""
    raw = key.encode("ascii", "replace") if isinstance(key, str) else bytes(key)
    raw = raw.strip()
    if len(raw) != _Z85_LEN:
        raise ValueError(f"{what} must be 40 characters of Z85 text (twt keys prints it); got {len(raw)} characters")
    try:
        if len(z85.decode(raw)) != 32:
            raise ValueError
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{what} is not valid Z85 text") from None
    return raw


def load_key_pair(path: Path, what: str) -> CurveKeyPair:
    """A certificate file with both keys, checked (public belongs to secret)."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError, UnicodeDecodeError, IndexError) as exc:
        raise ValueError(f"{what} {path} is malformed ({exc}); restore it, or remove it to make a new key pair") from None
    if secret is None:
        raise ValueError(f"{what} {path} holds no secret-key; it must be a *.key_secret certificate")
    try:
        public = parse_public_key(public, f"public-key in {path}")
        secret = parse_public_key(secret, f"secret-key in {path}")
    except ValueError as exc:
        raise ValueError(f"{what} {path} is malformed: {exc}") from None
    if zmq.curve_public(secret) != public:
        raise ValueError(f"{what} {path} is malformed: its public-key does not belong to its secret-key")
    return CurveKeyPair(public, secret)


def load_client_keys(spec: str | os.PathLike[str] | CurveKeyPair | tuple[bytes | str, bytes | str] | None) -> CurveKeyPair:
    """The remote client's key pair: fresh when ``None``, else a certificate file or a (public, secret) pair."""
    if spec is None:
        return CurveKeyPair.generate()
    if isinstance(spec, CurveKeyPair):
        return spec
    if isinstance(spec, tuple):
        public = parse_public_key(spec[0], "client public key")
        secret = parse_public_key(spec[1], "client secret key")
        if zmq.curve_public(secret) != public:
            raise ValueError("client public key does not belong to the client secret key")
        return CurveKeyPair(public, secret)
    return load_key_pair(Path(spec), "client key file")
