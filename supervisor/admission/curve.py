"""CURVE keys for the TCP frontend: the server's key pair, client key pairs, the allow-list.

    <state dir>/state.db              the supervisor's state database (supervisor.store.state.StateStore):
        key material "curve.secret"   Z85 (40 chars); "curve.public" beside it, checked against it
    server_key_file = PATH            or an operator's ZPL certificate (zmq.auth format; e.g. a
                                      Kubernetes Secret): public-key and secret-key, 0600 or stricter
                                      (0440 in our own group: a Secret with fsGroup)

    supervisor start ── load_or_create_server_keys(store) ── made on first start, kept after
                    └─ published: supervisor.json "server_public_key", printed by `twt keys`
    remote client ──── client_keys=None: a fresh pair per client (no allow-list)
                    └─ client_keys=PATH: a certificate file with our secret key
    allow-list ─────── client_keys_dir: *.key public certificates, checked by ZAP (zmq.auth)

All cryptography is libzmq's (CurveZMQ through pyzmq): this module only
makes, stores, reads and checks keys. A key file or stored key that is not
Z85 of 32 bytes, or whose public key does not belong to its secret key,
stops the start with one message naming the file; it is never replaced
behind the operator's back.
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq
import zmq.auth

from shared.curve_keys import CurveKeyPair, load_client_keys, load_key_pair, parse_public_key
from shared.errors import StateError
from supervisor.host.secret_files import key_file_mode_problem
from supervisor.store.state import StateStore

__all__ = [
    "CURVE_PUBLIC",
    "CURVE_SECRET",
    "CurveKeyPair",
    "check_client_keys_dir",
    "load_client_keys",
    "load_or_create_server_keys",
    "load_server_key_file",
    "parse_public_key",
    "write_key_pair",
]

#: names of the pair in the state database's key material
CURVE_SECRET = "curve.secret"
CURVE_PUBLIC = "curve.public"


def write_key_pair(path: str | os.PathLike[str], pair: CurveKeyPair, *, comment: str = "") -> None:
    """Write ``pair`` as a ZPL certificate, mode 0600, atomically (temp file + rename)."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    text = (
        f"#   ****  CURVE key pair{(' of ' + comment) if comment else ''} (tensor-wasm-tenant)  ****\n"
        "#   ZeroMQ CURVE **Secret** Certificate - keep it private (mode 0600)\n"
        "metadata\n"
        "curve\n"
        f'    public-key = "{pair.public_text}"\n'
        f'    secret-key = "{pair.secret.decode("ascii")}"\n'
    )
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, p)


def load_or_create_server_keys(store: StateStore) -> CurveKeyPair:
    """The supervisor's key pair from its state database, made and stored there on first use.

    Named key material ``curve.secret`` (and ``curve.public``, which must
    belong to it). A stored value that is not a Z85 key, or a public key of
    another secret, stops the start with :class:`StateError` naming the
    database; nothing is replaced (delete both keys on purpose - or restore a
    backup - to change the pair).
    """
    secret = store.get_key(CURVE_SECRET)
    public = store.get_key(CURVE_PUBLIC)
    if secret is None:
        if public is not None:
            raise StateError(store.path, f"it holds {CURVE_PUBLIC} without {CURVE_SECRET}; restore a backup, "
                             "or delete both for a new key pair")
        pair = CurveKeyPair.generate()
        store.put_key(CURVE_SECRET, pair.secret)  # the secret first: alone it still makes the pair
        store.put_key(CURVE_PUBLIC, pair.public)
        return pair
    try:
        secret = parse_public_key(secret, CURVE_SECRET)
    except ValueError as exc:
        raise StateError(store.path, f"its {CURVE_SECRET} is malformed ({exc})") from None
    derived = zmq.curve_public(secret)
    if public is None:
        store.put_key(CURVE_PUBLIC, derived)
    elif public != derived:
        raise StateError(store.path, f"its {CURVE_PUBLIC} does not belong to its {CURVE_SECRET}")
    return CurveKeyPair(derived, secret)


def load_server_key_file(path: str) -> CurveKeyPair:
    """The key pair from an operator's certificate file (``server_key_file``: e.g. a Kubernetes Secret).

    Never created: a missing file is an error, as is one others can read (:func:`key_file_mode_problem`).
    """
    p = Path(path)
    try:
        st = p.stat()
    except OSError as exc:
        raise ValueError(f"server_key_file {path}: {exc.strerror}; make one with `twt keys --new-client NAME` "
                         "and use NAME.key_secret") from None
    problem = key_file_mode_problem(st.st_mode, st.st_uid, st.st_gid, uid=os.geteuid(), gid=os.getegid())
    if problem is not None:
        raise PermissionError(f"{path} {problem}")
    return load_key_pair(p, "server key file")


def check_client_keys_dir(path: str) -> int:
    """Validate the allow-list directory at start: how many public keys it holds.

    Every ``*.key`` file must be a certificate with a valid public key, so a
    typo is one clear error at start, not a client refused later.
    """
    d = Path(path)
    if not d.is_dir():
        raise ValueError(f"client_keys_dir {path} is not a directory")
    count = 0
    for cert in sorted(d.glob("*.key")):
        try:
            public, _ = zmq.auth.load_certificate(cert)
            parse_public_key(public, f"public-key in {cert}")
        except (OSError, ValueError, UnicodeDecodeError, IndexError) as exc:
            raise ValueError(f"client key file {cert} is malformed ({exc})") from None
        count += 1
    return count
