"""The command half of ``scale`` / ``twt scale``: run N worker instances for a tenant, live.

    twt scale acme 3 --wait
"""

from __future__ import annotations

import argparse
import sys
import time

from shared.errors import RequestTimeout
from shared.records import TenantRecord
from supervisor.cli.commands._base import Connect, OpCommand
from supervisor.cli.commands._cli import fetch_tenant, instances_line, tenant_argument
from supervisor.client.cli_args import non_negative_int, positive_seconds, print_json

__all__ = ["ScaleCommand"]


def _scaled(rec: TenantRecord, n: int) -> bool:
    wanted = [i for i in rec.instances if not i.draining]
    # drained instances must be gone too, so "scale 1 --wait" means one process left
    return (len(wanted) == n and all(i.state == "ready" for i in wanted)
            and not any(i.draining and i.pid is not None for i in rec.instances))


class ScaleCommand(OpCommand):
    name = "scale"
    command = "scale"
    help = "run N worker instances for a tenant (live)"
    description = ("Change how many worker processes serve a tenant. New instances share the tenant's quota; "
                   "scaling down drains instances (their in-flight requests finish) before stopping them.")
    json_help = "print the tenant's status record as JSON"

    def arguments(self, p: argparse.ArgumentParser) -> None:
        tenant_argument(p)
        p.add_argument("instances", type=non_negative_int, metavar="N")
        p.add_argument("--wait", action="store_true", help="return once exactly N instances are ready")
        p.add_argument("--timeout", type=positive_seconds, default=60.0, metavar="S",
                       help="with --wait: give up (exit 1) after S seconds (default 60)")

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        with connect() as client:
            rec = client.scale(None, args.tenant, args.instances)
            if args.wait:
                deadline = time.monotonic() + args.timeout
                while not _scaled(rec, args.instances):
                    if time.monotonic() >= deadline:
                        print(instances_line(rec), file=sys.stderr)
                        raise RequestTimeout("scale", args.timeout, message=(
                            f"{args.tenant} did not reach {args.instances} ready instance(s) within "
                            f"{args.timeout:g} s"))
                    time.sleep(0.05)
                    rec = fetch_tenant(client, args.tenant)
        if args.json:
            print_json(rec.to_wire())
        else:
            print(instances_line(rec))
        return 0
