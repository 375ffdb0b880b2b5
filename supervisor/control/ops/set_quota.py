"""``set_quota`` / ``twt set-quota``: change a tenant's limits live.

The limits live in the tenant's shared-memory block, so its workers see a
change at their next allocation; GPU-time weight and cap change on the
device's lease board. The change is written to the state first: one that
cannot be written (``StateError``) is not applied.

The command and its examples: :mod:`supervisor.cli.commands.set_quota`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared import protocol as proto
from supervisor.control.ops._base import AdminOp, Args, Reply

if TYPE_CHECKING:
    from supervisor.control.admin import AdminOps

__all__ = ["SetQuota"]


class SetQuota(AdminOp):
    name = "set_quota"
    args_doc = ("`{tenant, memory_quota_bytes?, gpu_memory_bytes_cap? (nil: no cap), recorded_cuda_mem_pool_quota?}` "
                "(ints or size strings), `gpu_time_weight?` (a number > 0), `gpu_time_cap?` (a number in (0, 1]; "
                "nil: no cap), `idle_timeout_s?` (seconds; nil: never parks)")
    result_doc = "the tenant's status record"
    error_notes = {
        "InvalidArgument": "naming the key: a weight <= 0, NaN or infinite, a cap outside (0, 1], a bool or a string for either; nothing is applied then",
    }

    def serve(self, part: AdminOps, reply: Reply, args: Args) -> None:
        changes = {k: args[k] for k in proto.QUOTA_KEYS if k in args}
        reply.ok(part.set_quota(proto.arg_str(args, "tenant"), changes).to_wire())
