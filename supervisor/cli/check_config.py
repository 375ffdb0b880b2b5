"""``twt check-config FILE``: the preflight of a config file - exit 0, or every problem and exit 4.

    $ twt check-config /etc/twt/tenants.toml
    config      /etc/twt/tenants.toml: ok (3 tenants, backend cuda)
    run dir     /run/twt
    state dir   /var/lib/twt/state

    $ twt check-config bad.toml
    twt: config bad.toml has 2 mistakes:
      - unknown [supervisor] key 'max_tenant'; did you mean 'max_tenants'?
      - tenant 'acme' listed twice in the config ([[tenant]] #1, #3)

What ``twt supervise --config FILE`` would refuse about the file, with the
same environment (``TWT_*``), found in one pass (:func:`shared.config.load_config`);
``--state`` also checks the state directory the file names
(:func:`supervisor.store.backup.check`, as ``twt state check``). Nothing is
started and nothing is written.
"""

from __future__ import annotations

import argparse
import sys

from shared.config import load_config
from shared.errors import ConfigError
from shared.exitcodes import EXIT_CHECK, EXIT_OK
from supervisor.cli._common import print_json

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "check-config",
        help="check a config file (and its state directory) before a start: exit 0 or every problem",
        description="Load FILE as `twt supervise --config FILE` would (with the TWT_* environment) and list every "
        "mistake at once (exit 4), or print what it configures (exit 0). --state: also check the state directory "
        "it names, as `twt state check` does. Starts nothing, writes nothing.",
    )
    p.add_argument("file", metavar="FILE", help="the config file (TOML)")
    p.add_argument("--state", action="store_true", help="also check the state directory the file names")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from supervisor.store.backup import check

    problems: list[str] = []
    notes: list[str] = []
    try:
        cfg = load_config(args.file)
    except ConfigError as exc:
        text = str(exc)
        if args.json:
            listed = [line.strip().removeprefix("- ") for line in text.splitlines()[1:]]
            print_json({"config": args.file, "ok": False, "problems": listed or [text], "notes": []})
        else:
            print(f"twt: {text}", file=sys.stderr)
        return EXIT_CHECK
    except ValueError as exc:  # the fields together (each one alone was fine)
        problems.append(f"config {args.file}: {exc}")
        cfg = None
    state_path = None
    if cfg is not None:
        state_path = cfg.state_path
        if args.state:
            report = check(state_path)
            problems += list(report.problems)
            notes += list(report.notes)
    if args.json:
        print_json({"config": args.file, "ok": not problems, "problems": problems, "notes": notes,
                    "tenants": [] if cfg is None else [t.tenant_id for t in cfg.tenants],
                    "run_dir": None if cfg is None else cfg.run_dir, "state_dir": state_path})
        return EXIT_CHECK if problems else EXIT_OK
    if cfg is not None:
        print(f"config      {args.file}: {'ok' if not problems else f'{len(problems)} problem(s)'} "
              f"({len(cfg.tenants)} tenants, backend {cfg.backend})")
        print(f"run dir     {cfg.run_dir}")
        print(f"state dir   {state_path}")
    for problem in problems:
        print(f"  problem   {problem}", file=sys.stderr if cfg is None else sys.stdout)
    for note in notes:
        print(f"  note      {note}")
    return EXIT_CHECK if problems else EXIT_OK
