"""The command half of ``version`` / ``twt version``: the running supervisor's build, beside this command's own.

    twt version
    twt 0.4.0 (this command); supervisor 0.4.0 (python 3.12.3, protocol 1)

After an upgrade the daemon may still run the old build until it is
restarted; ``twt --version`` names only the installed one.
"""

from __future__ import annotations

import argparse
import dataclasses

from shared import protocol as proto
from supervisor.cli.commands._base import Connect, OpCommand
from supervisor.client.cli_args import print_json
from supervisor.observe.metrics import build_version

__all__ = ["VersionCommand"]


class VersionCommand(OpCommand):
    name = "version"
    command = "version"
    help = "print the running supervisor's version beside this command's"
    description = ("Print the build version of the running supervisor (with its Python and protocol version) "
                   "beside this command's own: after an upgrade the daemon runs the old build until it restarts.")
    json_help = "print {client, supervisor: {version, python, protocol}} as JSON"

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        with connect() as client:
            running = client.invoke(client.reader, proto.Version.Args())
        if args.json:
            print_json({"client": build_version(), "supervisor": dataclasses.asdict(running)})
        else:
            print(f"twt {build_version()} (this command); supervisor {running.version} "
                  f"(python {running.python}, protocol {running.protocol})")
        return 0
