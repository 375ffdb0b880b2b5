"""Service commands (the admin capability): reload, reset, restart, rotate-key.

    twt reload                 # re-read the config file and apply the difference (as SIGHUP does)
    twt reset acme             # a failed tenant: clear it and start its instances (same capability)
    twt restart acme           # new worker processes, one instance at a time
    twt rotate-key --yes       # a new registry key: every capability is revoked

``twt reload`` exits 2 when the file cannot be applied (nothing was changed;
the problems are printed, logged and published as a ``reload`` event).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shared.errors import ConfigError
from shared.exitcodes import EXIT_USAGE
from shared.records import TenantRecord
from supervisor.cli._common import add_run_dir, print_json
from supervisor.cli.status import connect

__all__ = ["add_parser"]

#: reload, reset and restart wait for worker processes
SERVICE_TIMEOUT_S = 120.0


#: command -> (help, description, takes TENANT, what --json prints)
_COMMANDS: dict[str, tuple[str, str, bool, str]] = {
    "reload": (
        "re-read the config file and apply the difference (as SIGHUP)",
        "Re-read the supervisor's --config file and apply the difference: new [[tenant]] tables are "
        "registered, changed ones applied live (quotas at once, instances by scaling, changes that need new "
        "workers by restarting the tenant's instances one at a time), tenants removed from the file are evicted. "
        "Tenants registered at runtime are left alone. A file that cannot be applied changes nothing (exit 2).",
        False, "the supervisor's answer",
    ),
    "reset": (
        "clear a failed tenant and start its instances again (same capability)",
        "A tenant that exceeded its restart intensity is marked failed and stays down. reset clears "
        "that, forgets its restart history and starts its instances; its capability stays valid. Returns once "
        "every instance is ready.",
        True, "the tenant's status record",
    ),
    "restart": (
        "restart a tenant's worker processes, one instance at a time",
        "Replace every instance of a tenant with a new worker process, one at a time: each is "
        "drained (its in-flight requests finish), stopped and started again before the next. Buffers held by "
        "the old processes are freed. The capability stays valid; no restart is counted against the budget.",
        True, "the tenant's status record",
    ),
    "rotate-key": (
        "replace the registry key: every capability is revoked",
        "Draw a new registry key and id. Every tenant capability and the old admin capability are "
        "refused from now on (as revoked); tenants keep running, and their new capabilities come from "
        "'twt capability TENANT'. The new admin capability is written to admin.cap. Needs --yes.",
        False, "the new registry id",
    ),
}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    runs = {"reload": run_reload, "reset": run_reset, "restart": run_restart, "rotate-key": run_rotate_key}
    for name, (help_text, description, takes_tenant, prints) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=description)
        if takes_tenant:
            p.add_argument("tenant", metavar="TENANT")
        if name == "rotate-key":
            p.add_argument("--yes", action="store_true", help="really revoke every capability")
        p.add_argument("--json", action="store_true", help=f"print {prints} as JSON")
        add_run_dir(p)
        p.set_defaults(func=runs[name])


def _names(items: Sequence[str]) -> str:
    return ", ".join(str(i) for i in items) or "none"


def run_reload(args: argparse.Namespace) -> int:
    try:
        with connect(args, timeout_s=SERVICE_TIMEOUT_S) as client:
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


def _tenant_line(rec: TenantRecord) -> str:
    pids = ",".join(str(p) for p in rec.pids) or "-"
    return f"{rec.tenant_id}: state {rec.state}, pids {pids}, generation {rec.generation}"


def run_reset(args: argparse.Namespace) -> int:
    return _tenant_op(args, "reset")


def run_restart(args: argparse.Namespace) -> int:
    return _tenant_op(args, "restart")


def _tenant_op(args: argparse.Namespace, op: str) -> int:
    with connect(args, timeout_s=SERVICE_TIMEOUT_S) as client:
        rec = client.reset(None, args.tenant) if op == "reset" else client.restart_tenant(None, args.tenant)
    if args.json:
        print_json(rec.to_wire())
    else:
        print(_tenant_line(rec))
    return 0


def run_rotate_key(args: argparse.Namespace) -> int:
    if not args.yes:
        raise ValueError("rotate-key revokes every capability of every tenant; run it again with --yes")
    with connect(args) as client:
        client.rotate_key(None)
        registry_id = client.hello().registry_id
    if args.json:
        print_json({"registry_id": registry_id})
    else:
        print(f"new registry key {str(registry_id)[:8]}...: every capability minted before is revoked; "
              "hand out new ones with 'twt capability TENANT'")
    return 0
