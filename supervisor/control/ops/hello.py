"""``hello``: who the supervisor is (``twt status`` shows it in its header line).

Without a capability the frontend answers it itself, with the protocol
version and readiness only (the liveness probe); this is the full answer,
for the admin capability.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from supervisor.control.ops._base import AdminOp, Args, Reply

if TYPE_CHECKING:
    from supervisor.control.admin import AdminOps

__all__ = ["Hello"]


class Hello(AdminOp):
    name = "hello"
    result_doc = ("`{pid, registry_id, backend, backend_reason, start_method, protocol, uptime_s}`; without a "
                  "capability only `{protocol, ready}` ([liveness](#hello-without-a-capability-liveness))")

    def serve(self, part: AdminOps, reply: Reply, args: Args) -> None:
        reply.ok(part.records.hello_info().to_wire())
