"""``inject_fault`` / ``twt fault``: break one of a tenant's workers on purpose (testing).

The order goes to the worker's control thread; the answer waits for its
acknowledgement, or, for the kinds that end the process (crash, segfault,
exit), for the process to be gone.

The command and its examples: :mod:`supervisor.cli.commands.inject_fault`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared import protocol as proto
from supervisor.control.ops._base import AdminOp, Args, Reply

if TYPE_CHECKING:
    from supervisor.control.admin import AdminOps

__all__ = ["InjectFault"]


class InjectFault(AdminOp):
    name = "inject_fault"
    args_doc = "`{tenant, kind, instance?, params}`"
    result_doc = ("`{tenant, instance, pid, kind, ...armed}` once armed; for `crash`, `segfault` and `exit`, "
                  "`{..., exited, exit_code, signal}` once the process is gone")
    error_notes = {
        "WorkerLost": "no live instance",
        "FaultInjectionDisabled": "the supervisor runs with `fault_injection = false`",
    }

    def serve(self, part: AdminOps, reply: Reply, args: Args) -> None:
        done = part.inject_fault(proto.arg_str(args, "tenant"), proto.arg_str(args, "kind"),
                                 proto.arg_opt_int(args, "instance"), proto.arg_opt_map(args, "params") or {})
        # a worker's refusal is its own error, answered as the worker worded it
        done.then(lambda answer: reply.ok(answer.result) if answer.ok else reply.error_dict(answer.result),
                  reply.refuse)
