"""``twt cleanup``: remove the shared-memory segments that dead supervisors left behind.

A supervisor's own start already removes what a killed predecessor on the
same run dir left (``supervisor.stale_segments_removed``); this command is for
the operator. It removes only segments whose recorded owner process is dead,
so it never touches a running supervisor's quota blocks, device budgets or
regions:

* ``twt cleanup`` (or ``--run-dir DIR``): that run dir's namespace, plus names
  an older version made - what the next ``twt supervise`` there would remove.
* ``twt cleanup --all-run-dirs``: every dead owner's ``twt-*`` segment on the
  host, whichever run dir (or version, or in-process registry) made it.
"""

from __future__ import annotations

import argparse

from shared.quota import cleanup_stale_segments, namespace_of, segment_namespace, stale_segments
from supervisor.cli._common import print_json, run_dir_of

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "cleanup", help="remove shared-memory segments whose supervisor is dead",
        description="Remove the twt-* segments (quota blocks, device budgets, regions) whose recorded owner "
        "process is dead: of one run dir (default), or of every run dir on the host. Live owners' segments are "
        "never touched.")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--run-dir", default=None,
                       help="the run dir whose segments to clean (default: $TWT_RUN_DIR or the default run dir)")
    scope.add_argument("--all-run-dirs", action="store_true",
                       help="every dead owner's twt-* segment on this host, of any run dir or older version")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    namespace = None if args.all_run_dirs else segment_namespace(run_dir_of(args))
    if args.dry_run:
        names = [h.name for h in stale_segments(namespace=namespace)]
    else:
        names = cleanup_stale_segments(namespace=namespace)
    if args.json:
        print_json({"namespace": namespace, "dry_run": args.dry_run, "segments": names})
        return 0
    scope = "all run dirs" if namespace is None else f"run dir {run_dir_of(args)} (namespace {namespace})"
    verb = "would remove" if args.dry_run else "removed"
    print(f"{scope}: {verb} {len(names)} segment(s) of dead owners")
    for name in names:
        print(f"  {name}  ({namespace_of(name) or 'no namespace'})")
    return 0
