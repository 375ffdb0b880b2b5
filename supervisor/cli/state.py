"""``twt state backup DEST``: a consistent copy of the supervisor's state database, live or stopped.

    $ twt state backup /var/backups/twt-state-$(date +%F).db
    backup      /var/backups/twt-state-2026-12-01.db (24,576 B, 3 tenants, registry key)
    source      /run/twt/state/state.db

Uses SQLite's online backup API (:func:`supervisor.store.state.backup`): safe while
the supervisor runs (it never takes ``state.lock``), the copy is one
self-contained file (no ``-wal``), 0600, checked and fsynced. Restoring is in
docs/OPERATIONS.md ("Backing up the state").
"""

from __future__ import annotations

import argparse
import os

from shared.config import ENV_PREFIX
from supervisor.cli._common import print_json, run_dir_of

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "state",
        help="back up the supervisor's state database (safe while it runs)",
        description="backup DEST: copy the state database (tenants, generations, registry and CURVE keys) to DEST "
        "with SQLite's online backup API - one consistent snapshot even while the supervisor writes; DEST must not "
        "exist and is written 0600. Keep it as secret as the state directory: it holds the registry key.",
    )
    p.add_argument("action", choices=["backup"], help="what to do (backup)")
    p.add_argument("dest", help="the file to write (must not exist)")
    p.add_argument("--run-dir", default=None, help=f"the supervisor's run directory (default ${ENV_PREFIX}RUN_DIR)")
    p.add_argument("--state-dir", help=f"the state directory (default <run-dir>/state or ${ENV_PREFIX}STATE_DIR)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from supervisor.store.state import backup

    state_dir = args.state_dir or os.environ.get(f"{ENV_PREFIX}STATE_DIR") or os.path.join(run_dir_of(args), "state")
    info = backup(state_dir, args.dest)
    if args.json:
        print_json(info)
    else:
        key = "registry key" if info["registry_key"] else "no registry key yet"
        print(f"backup      {info['backup']} ({info['bytes']:,} B, {info['tenants']} tenants, {key})")
        print(f"source      {info['source']}")
    return 0
