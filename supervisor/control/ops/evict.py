"""``evict`` / ``twt evict``: stop a tenant's workers, revoke its capabilities, free its quota block.

The command and its examples: :mod:`supervisor.cli.commands.evict`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.protocol import arg_str
from supervisor.control.ops._base import AdminOp, Args, Reply

if TYPE_CHECKING:
    from supervisor.control.admin import AdminOps

__all__ = ["Evict"]


class Evict(AdminOp):
    name = "evict"
    args_doc = "`{tenant}`"
    result_doc = ("`{evicted, pids}`, sent once its workers have exited; capabilities are revoked and the block "
                  "unlinked at once")

    def serve(self, part: AdminOps, reply: Reply, args: Args) -> None:
        reply.when(part.evict(arg_str(args, "tenant")))
