"""``register`` / ``twt register``: a new tenant, answered once every instance is ready.

A tenant capability is printed as hex on stdout (``CAP=$(twt register acme)``)
or written with ``--cap-out FILE`` (hex and a newline, mode 0600);
``shared.capability.read_capability_file(path)`` reads it back (so does
``twt run --capability FILE``).

The command and its examples: :mod:`supervisor.cli.commands.register`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.protocol import arg_map
from shared.spec import TenantSpec
from supervisor.control.ops._base import AdminOp, Args, Reply

if TYPE_CHECKING:
    from supervisor.control.admin import AdminOps

__all__ = ["Register"]


class Register(AdminOp):
    name = "register"
    args_doc = "`{spec}`: a map of the keys in [The tenant spec](#the-tenant-spec) (sizes as ints or size strings)"
    result_doc = "`{capability: bytes, tenant: {tenant_id, state, generation, device, pids}}`, sent once every instance is ready"
    error_notes = {
        "InvalidArgument": "spec, placement",
        "BackendUnavailable": 'e.g. `isolation="mps"` without a daemon',
        "KernelTimeout": "`register_timeout_s`",
        "WorkerLost": "died while starting",
        "CapacityExhausted": "`max_tenants` or `max_workers` reached; nothing registered",
    }

    def serve(self, part: AdminOps, reply: Reply, args: Args) -> None:
        reply.when(part.register(TenantSpec.from_dict(arg_map(args, "spec"))))
