"""``version`` / ``twt version``: the running supervisor's build, beside this command's own.

After an upgrade the daemon may still run the old build until it is
restarted; ``twt --version`` names only the installed one.

The command and its examples: :mod:`supervisor.cli.commands.version`.
"""

from __future__ import annotations

import platform
from typing import TYPE_CHECKING

from shared.protocol import PROTOCOL_VERSION
from supervisor.control.ops._base import AdminOp, Args, Reply
from supervisor.observe.metrics import build_version

if TYPE_CHECKING:
    from supervisor.control.admin import AdminOps

__all__ = ["Version"]


class Version(AdminOp):
    name = "version"
    result_doc = "`{version, python, protocol}`: the running supervisor's build, its Python, its protocol version"

    def serve(self, part: AdminOps, reply: Reply, args: Args) -> None:
        reply.ok({"version": build_version(), "python": platform.python_version(),
                                        "protocol": PROTOCOL_VERSION})
