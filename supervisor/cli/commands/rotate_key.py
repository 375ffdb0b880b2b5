"""The command half of ``rotate_key`` / ``twt rotate-key``: a new registry key; every capability minted before is revoked.

    twt rotate-key --yes
"""

from __future__ import annotations

import argparse

from supervisor.cli.commands._base import Connect, OpCommand
from supervisor.client.cli_args import print_json

__all__ = ["RotateKeyCommand"]


class RotateKeyCommand(OpCommand):
    name = "rotate_key"
    command = "rotate-key"
    help = "replace the registry key: every capability is revoked"
    description = ("Draw a new registry key and id. Every tenant capability and the old admin capability are "
                   "refused from now on (as revoked); tenants keep running, and their new capabilities come from "
                   "'twt capability TENANT'. The new admin capability is written to admin.cap. Needs --yes.")
    json_help = "print the new registry id as JSON"

    def arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--yes", action="store_true", help="really revoke every capability")

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        if not args.yes:
            raise ValueError("rotate-key revokes every capability of every tenant; run it again with --yes")
        with connect() as client:
            client.rotate_key(None)
            registry_id = client.hello().registry_id
        if args.json:
            print_json({"registry_id": registry_id})
        else:
            print(f"new registry key {str(registry_id)[:8]}...: every capability minted before is revoked; "
                  "hand out new ones with 'twt capability TENANT'")
        return 0
