"""``twt state backup|restore|check``: the supervisor's state database, live or stopped.

    $ twt state backup /var/backups/twt-state-$(date +%F).db --config /etc/twt/tenants.toml
    backup      /var/backups/twt-state-2026-12-01.db (24,576 B, 3 tenants, registry key)
    source      /var/lib/twt/state/state.db

    $ twt state check --config /etc/twt/tenants.toml      # exit 0, or 4 and every problem
    $ systemctl stop twt && twt state restore /var/backups/twt-state-2026-12-01.db --config ... && systemctl start twt

``backup`` uses SQLite's online backup API (:func:`supervisor.store.backup.backup`):
safe while the supervisor runs (it never takes ``state.lock``), the copy is one
self-contained file (no ``-wal``), 0600, checked and fsynced. ``restore`` puts
such a copy in place while no supervisor runs (:func:`~supervisor.store.backup.restore`).
``check`` lists everything a start would refuse, without writing
(:func:`~supervisor.store.backup.check`). The state directory: ``--state-dir``,
else the one ``--config FILE`` names (its ``state_dir``, or its ``run_dir``'s
``state``), else ``$TWT_STATE_DIR``, else ``<run-dir>/state``.
"""

from __future__ import annotations

import argparse
import os

from shared.config import ENV_PREFIX, load_config
from shared.exitcodes import EXIT_CHECK, EXIT_OK
from supervisor.cli._common import print_json, run_dir_of

__all__ = ["add_parser", "run", "state_dir_of"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "state",
        help="back up, restore or check the supervisor's state database",
        description="backup DEST: copy the state database (tenants, generations, registry and CURVE keys) to DEST "
        "with SQLite's online backup API - one consistent snapshot even while the supervisor writes; DEST must not "
        "exist and is written 0600. Keep it as secret as the state directory: it holds the registry key. "
        "restore BACKUP: put such a copy in place of the state (the supervisor stopped; the state it replaces is "
        "kept beside it as state.db.replaced-TIME). check: list every problem a start would refuse (exit 4), "
        "without writing; exit 0 when it would start.",
    )
    p.add_argument("action", choices=["backup", "restore", "check"], help="what to do")
    p.add_argument("file", nargs="?", metavar="FILE",
                   help="backup: the file to write (must not exist); restore: the backup to restore")
    p.add_argument("--config", metavar="FILE", help="the supervisor's config file: its state_dir, or <run_dir>/state "
                   "(default: none)")
    p.add_argument("--run-dir", default=None, help=f"the supervisor's run directory (default ${ENV_PREFIX}RUN_DIR)")
    p.add_argument("--state-dir", help=f"the state directory (default: --config's, ${ENV_PREFIX}STATE_DIR, "
                                       "or <run-dir>/state)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def state_dir_of(args: argparse.Namespace) -> str:
    """The state directory the flags name (see the module docstring for the order)."""
    if args.state_dir:
        return str(args.state_dir)
    if args.config:
        # the supervisor's own resolution: file < TWT_* environment < --run-dir
        return load_config(args.config, overrides={"run_dir": args.run_dir}).state_path
    return os.environ.get(f"{ENV_PREFIX}STATE_DIR") or os.path.join(run_dir_of(args), "state")


def run(args: argparse.Namespace) -> int:
    from supervisor.store.backup import backup, check, restore

    if args.action in ("backup", "restore") and not args.file:
        raise ValueError(f"twt state {args.action} needs a FILE")
    if args.action == "check" and args.file:
        raise ValueError("twt state check takes no FILE (the state directory: --state-dir or --config)")
    state_dir = state_dir_of(args)
    if args.action == "check":
        report = check(state_dir)
        if args.json:
            print_json({"state": report.path, "ok": report.ok, "problems": list(report.problems),
                        "notes": list(report.notes)})
        else:
            print(f"state       {report.path}: {'ok' if report.ok else f'{len(report.problems)} problem(s)'}")
            for problem in report.problems:
                print(f"  problem   {problem}")
            for note in report.notes:
                print(f"  note      {note}")
        return EXIT_OK if report.ok else EXIT_CHECK
    if args.action == "restore":
        info = restore(state_dir, args.file)
        if args.json:
            print_json(info)
        else:
            print(f"restored    {info['state']} from {info['backup']} ({info['tenants']} tenants, "
                  f"{info['commits']} commits)")
            if info["replaced"]:
                print(f"kept        the state it replaced: {info['replaced']}")
        return EXIT_OK
    info = backup(state_dir, args.file)
    if args.json:
        print_json(info)
    else:
        key = "registry key" if info["registry_key"] else "no registry key yet"
        print(f"backup      {info['backup']} ({info['bytes']:,} B, {info['tenants']} tenants, {key})")
        print(f"source      {info['source']}")
    return EXIT_OK
