"""Helpers shared by the sub-commands: the run-dir option, the tenant capability option, JSON output, tables."""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

import zmq.auth
from zmq.utils import z85

from shared.capability import MonitorCapability, RegistryAdminCapability, read_capability_file
from shared.config import ENV_PREFIX, default_run_dir, parse_host_port
from shared.errors import SupervisorUnavailable
from supervisor.client.api import SupervisorClient
from supervisor.cli._text import DefaultsHelpFormatter, describe_os_error
from supervisor.client.cli_args import (
    at_least_one,
    comma_list,
    non_negative_int,
    positive_seconds,
    print_json,
    print_table,
    run_dir_of,
)

__all__ = [
    "DefaultsHelpFormatter",
    "add_run_dir",
    "at_least_one",
    "client_of",
    "comma_list",
    "describe_os_error",
    "non_negative_int",
    "positive_seconds",
    "print_json",
    "print_table",
    "probe_tcp",
    "run_dir_of",
    "server_key_of",
]


def add_run_dir(parser: argparse.ArgumentParser) -> None:
    """``--run-dir`` for a local supervisor, and ``--connect`` & co. for a remote one (CurveZMQ TCP)."""
    parser.add_argument(
        "--run-dir",
        default=None,
        help=f"the supervisor's run directory (default: ${ENV_PREFIX}RUN_DIR or {default_run_dir()})",
    )
    remote = parser.add_argument_group("remote supervisor (its CURVE TCP frontend; docs/CLUSTER.md)")
    remote.add_argument("--connect", metavar="tcp://HOST:PORT",
                        help="call the supervisor listening there (default: the local one at --run-dir)")
    remote.add_argument("--server-key", metavar="KEY|@FILE",
                        help="its public key: the Z85 text `twt keys` prints on its host (write --server-key='KEY': "
                        "a key may start with '-' and hold shell characters), or @FILE: a file with that text or a "
                        "zmq.auth public certificate (*.key) (default: none; required with --connect)")
    remote.add_argument("--client-key", metavar="FILE",
                        help="our key pair (NAME.key_secret), when it has an allow-list (default: a fresh pair)")
    remote.add_argument("--admin-cap", metavar="FILE",
                        help="the admin capability file, for admin ops (the supervisor needs allow_remote_admin), "
                        "or the monitor one (`twt capability --role monitor`), for the read-only ops: status, "
                        "events, version (default: none)")


def client_of(args: argparse.Namespace, timeout_s: float) -> SupervisorClient:
    """A client of the local supervisor at ``--run-dir``, or of the remote one at ``--connect``."""
    connect = getattr(args, "connect", None)
    if connect is None:
        if getattr(args, "server_key", None) or getattr(args, "admin_cap", None):
            raise ValueError("--server-key and --admin-cap go with --connect tcp://HOST:PORT")
        return SupervisorClient(run_dir_of(args), timeout_s=timeout_s)
    if not args.server_key:
        raise ValueError("--connect needs --server-key KEY (twt keys prints it on the supervisor's host)")
    server_key = server_key_of(args.server_key)
    admin: RegistryAdminCapability | MonitorCapability | None = None
    if args.admin_cap:
        cap = read_capability_file(args.admin_cap)
        if not isinstance(cap, (RegistryAdminCapability, MonitorCapability)):
            raise ValueError(f"{args.admin_cap} holds a tenant capability, not the admin or monitor capability")
        admin = cap
    if not isinstance(connect, str) or not connect.startswith("tcp://"):
        raise ValueError(f"--connect must be tcp://HOST:PORT; got {connect!r}")
    probe_tcp(connect)
    return SupervisorClient.remote(connect, server_key, args.client_key, timeout_s, admin=admin)


#: seconds the TCP pre-check waits for a connection before leaving the wait to the client's own timeout
PROBE_TIMEOUT_S = 2.0


def probe_tcp(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Fail at once when nothing can answer at ``tcp://HOST:PORT``: refused, no route, unknown host.

    libzmq retries a refused connection silently, so without this check the client would wait its
    whole connect timeout to say what the kernel knew at once. A silent (filtered) host is left to the
    client's timeout. The probe connection is closed before a byte is sent: the supervisor's libzmq
    sees a peer come and go, nothing else.
    """
    host, port = parse_host_port(endpoint.removeprefix("tcp://"), "--connect")
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except TimeoutError:
        return
    except ConnectionRefusedError:
        why = f"connection refused: nothing listens on {host}:{port}"
    except socket.gaierror as exc:
        why = f"cannot resolve {host!r}: {exc.strerror or exc}"
    except OSError as exc:
        why = f"cannot connect to {host}:{port}: {(exc.strerror or str(exc)).lower()}"
    raise SupervisorUnavailable(endpoint, why)


#: the characters of Z85 text (a CURVE public key is 40 of them)
_Z85 = frozenset(z85.Z85CHARS)


def server_key_of(text: str) -> str:
    """``--server-key``: Z85 text, ``@FILE`` (that text, or a zmq.auth certificate), or a certificate's path.

    A value of 40 Z85 characters is a key even when it starts with ``@`` (``@`` is a Z85
    character: one key in 85 begins with it); ``@FILE`` is a file otherwise.
    ValueError names what was wrong; the key itself is checked by ``SupervisorClient.remote``.
    """
    value = text.strip()
    path: str | None = None
    if len(value) == 40 and set(value.encode("ascii", "replace")) <= _Z85:
        return value
    if value.startswith("@"):
        path = value[1:]
    elif len(value) != 40 and os.path.isfile(value):
        path = value
    if path is None:
        return value
    try:
        content = Path(path).read_text(encoding="ascii").strip()
    except FileNotFoundError:
        raise ValueError(f"--server-key @{path}: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--server-key @{path}: cannot be read ({exc})") from None
    if "public-key" in content:  # a ZPL certificate (twt keys --new-client, zmq.auth.create_certificates)
        try:
            public, _ = zmq.auth.load_certificate(path)
        except (OSError, ValueError, IndexError) as exc:
            raise ValueError(f"--server-key @{path} is not a readable certificate ({exc})") from None
        return public.decode("ascii")
    return content
