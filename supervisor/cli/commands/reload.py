"""The command half of ``reload`` / ``twt reload``: re-read the config file and apply the difference (as SIGHUP does).

``twt reload`` exits 2 when the file cannot be applied (nothing was changed;
the problems are printed, logged and published as a ``reload_failed`` event).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shared.errors import ConfigError
from shared.exitcodes import EXIT_USAGE
from supervisor.cli.commands._base import Connect, OpCommand
from supervisor.cli.commands._cli import SERVICE_TIMEOUT_S
from supervisor.client.cli_args import print_json

__all__ = ["ReloadCommand"]


def _names(items: Sequence[str]) -> str:
    return ", ".join(str(i) for i in items) or "none"


class ReloadCommand(OpCommand):
    name = "reload"
    command = "reload"
    help = "re-read the config file and apply the difference (as SIGHUP)"
    description = ("Re-read the supervisor's --config file and apply the difference: new [[tenant]] tables are "
                   "registered, changed ones applied live (quotas at once, instances by scaling, changes that need "
                   "new workers by restarting the tenant's instances one at a time), tenants removed from the file "
                   "are evicted. Tenants registered at runtime are left alone. A file that cannot be applied "
                   "changes nothing (exit 2).")
    json_help = "print the supervisor's answer as JSON"

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        try:
            with connect(SERVICE_TIMEOUT_S) as client:
                result = client.reload(None)
        except ConfigError as exc:
            print(f"twt: reload refused, nothing changed: {exc.detail} (in {exc.path})", file=sys.stderr)
            return EXIT_USAGE  # the file is the user's input: nothing was changed
        if args.json:
            print_json(result.to_wire())
            return 0
        changed = [f"{c.tenant} ({', '.join(c.fields)}{'; restarted' if c.restart else ''})" for c in result.changed]
        print(f"registered: {_names(result.registered)}")
        print(f"changed:    {_names(changed)}")
        print(f"evicted:    {_names(result.evicted)}")
        print(f"unchanged:  {_names(result.unchanged)}")
        if result.conflicts:
            print(f"left alone (registered at runtime, also in the file): {_names(result.conflicts)}")
        if result.settings_not_applied:
            print(f"[supervisor] settings changed, applied at the next start: {_names(result.settings_not_applied)}")
        return 0
