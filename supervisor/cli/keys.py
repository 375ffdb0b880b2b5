"""``twt keys``: the supervisor's CURVE public key (for remote clients), or a new client key pair.

    $ twt keys
    server_public_key  'rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7'
    listen             tcp://10.0.0.5:7700
    connect with       --connect tcp://10.0.0.5:7700 --server-key='rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7'

A Z85 key holds shell characters (``( $ & < > { } * ?``) and may start with
``-``: it is printed single-quoted (Z85 has no quote character, so the
quoting is always exact) and ready to paste. ``--json`` prints it bare.
    $ twt keys --new-client ./keys/api-1      # api-1.key (public, for client_keys_dir) + api-1.key_secret
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from shared.config import ENV_PREFIX
from supervisor.cli._common import add_run_dir, print_json, run_dir_of
from supervisor.admission.curve import CURVE_PUBLIC, CurveKeyPair, write_key_pair
from shared.rundir import read_ready

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "keys",
        help="print the supervisor's CURVE public key, or make a client key pair",
        description="Without options: the server public key (Z85) remote clients pass as --server-key, from the "
        "running supervisor's supervisor.json, else from its state database. --new-client PATH writes "
        "PATH.key (the public key, for a supervisor's client_keys_dir) and PATH.key_secret (0600, for "
        "SupervisorClient.remote(client_keys=...) or --client-key).",
    )
    add_run_dir(p)
    p.add_argument("--state-dir", help=f"the supervisor's state directory (default <run-dir>/state or ${ENV_PREFIX}STATE_DIR)")
    p.add_argument("--new-client", metavar="PATH",
                   help="write a new client key pair to PATH.key and PATH.key_secret (default: print the server key)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def _stored_public_key(state_dir: str, run_dir: str) -> str:
    """The public key kept in a stopped supervisor's state database (never creates one)."""
    from supervisor.store.state import STATE_FILE, StateStore

    public = None
    if os.path.exists(os.path.join(state_dir, STATE_FILE)):
        with StateStore.open(state_dir) as store:  # StateError while a supervisor holds it
            public = store.get_key(CURVE_PUBLIC)
    if public is None:
        raise ValueError(f"no server key yet: no running supervisor with listen at {run_dir} and none stored in "
                         f"{state_dir} (it is made on the first start with --listen)")
    return public.decode("ascii")


def _refuse_remote(args: argparse.Namespace) -> None:
    """``twt keys`` reads this host's supervisor (its run dir or state dir): the remote options do not apply."""
    given = [flag for flag, dest in (("--connect", "connect"), ("--server-key", "server_key"),
                                     ("--client-key", "client_key"), ("--admin-cap", "admin_cap"))
             if getattr(args, dest, None)]
    if given:
        raise ValueError(f"twt keys reads the key of the supervisor on this host; {', '.join(given)} do not apply "
                         "(run `twt keys` on the supervisor's host, or `twt keys --new-client PATH` for a client pair)")


def run(args: argparse.Namespace) -> int:
    _refuse_remote(args)
    if args.new_client:
        base = Path(args.new_client)
        if base.parent and not base.parent.is_dir():
            raise ValueError(f"directory {base.parent} does not exist")
        pair = CurveKeyPair.generate()
        write_key_pair(base.with_name(base.name + ".key_secret"), pair, comment=f"client {base.name}")
        public = base.with_name(base.name + ".key")
        public.write_text(
            "#   ZeroMQ CURVE Public Certificate (tensor-wasm-tenant client)\n"
            f'metadata\ncurve\n    public-key = "{pair.public_text}"\n', encoding="ascii"
        )
        if args.json:
            print_json({"public_key": pair.public_text, "public_file": str(public),
                        "secret_file": str(base) + ".key_secret"})
        else:
            print(f"client_public_key  {shlex.quote(pair.public_text)}\nfiles              {public} (public), {base}.key_secret (secret, 0600)")
        return 0
    run_dir = run_dir_of(args)
    info = read_ready(run_dir) or {}
    key = info.get("server_public_key")
    listen = info.get("listen") or []
    if key is None:
        key = _stored_public_key(args.state_dir or os.environ.get(f"{ENV_PREFIX}STATE_DIR")
                                 or os.path.join(run_dir, "state"), run_dir)
    if args.json:
        print_json({"server_public_key": key, "listen": listen})
    else:
        quoted = shlex.quote(key)
        print(f"server_public_key  {quoted}")
        for ep in listen:
            print(f"listen             {ep}")
        for ep in listen[:1]:
            print(f"connect with       --connect {ep} --server-key={quoted}")
    return 0
