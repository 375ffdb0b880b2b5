"""The command half of ``set_quota`` / ``twt set-quota``: change a tenant's limits live.

    twt set-quota acme --gpu-cap 1GiB            # --gpu-cap none removes the cap

The limits live in the tenant's shared-memory block, so its workers see a
change at their next allocation; GPU-time weight and cap change on the
device's lease board. The change is written to the state first: one that
cannot be written (``StateError``) is not applied.
"""

from __future__ import annotations

import argparse

from shared import protocol as proto
from shared.records import TenantRecord
from shared.sizes import format_size
from supervisor.cli.commands._base import Connect, OpCommand
from supervisor.cli.commands._cli import SPEC_FLAGS, limits_line, say_decimal_sizes, tenant_argument
from supervisor.client.cli_args import print_json

__all__ = ["SetQuotaCommand"]

#: set-quota's help for each limit it changes (the flags are register's, from SPEC_FLAGS)
_SET_QUOTA_HELP = {
    "memory_quota_bytes": "host memory quota, e.g. 2GiB (default: unchanged)",
    "gpu_memory_bytes_cap": "GPU byte cap; none removes it (default: unchanged)",
    "recorded_cuda_mem_pool_quota": "recorded CUDA pool quota (retention hint); none clears it (default: unchanged)",
    "gpu_time_weight": "GPU-time weight, > 0 (default: unchanged)",
    "gpu_time_cap": "GPU-time ceiling, a fraction in (0, 1]; none removes it (default: unchanged)",
    "idle_timeout_s": "seconds without a request before the tenant parks; none: never (default: unchanged)",
}


def _over_limit_notes(rec: TenantRecord) -> list[str]:
    """A limit set below what the tenant holds is accepted; say so, with the numbers."""
    tid = rec.tenant_id
    notes = []
    for what, used, limit in (("host", rec.bytes_in_use, rec.memory_quota_bytes),
                              ("GPU", rec.gpu_bytes_in_use, rec.gpu_memory_bytes_cap)):
        if limit is not None and used > limit:
            notes.append(f"{tid}: note: {format_size(used)} of {what} memory is in use, above the new limit of "
                         f"{format_size(limit)}; nothing is taken away, new {what} allocations are refused until "
                         "use falls below it")
    return notes


class SetQuotaCommand(OpCommand):
    name = "set_quota"
    command = "set-quota"
    help = "change a tenant's limits live"
    description = ("Change a tenant's limits while it runs (the limits live in its shared-memory block). "
                   "Lowering a limit below current use refuses new allocations until use falls under it; nothing "
                   "already allocated is taken away. Omitted limits stay as they are.")
    json_help = "print the tenant's status record as JSON"

    def arguments(self, p: argparse.ArgumentParser) -> None:
        tenant_argument(p)
        for flag, dest, kind, metavar, _ in SPEC_FLAGS:  # the register flags of the limits set_quota changes
            if dest in proto.QUOTA_KEYS:
                p.add_argument(flag, dest=dest, type=kind, metavar=metavar, default=argparse.SUPPRESS,
                               help=_SET_QUOTA_HELP[dest])

    def run(self, args: argparse.Namespace, connect: Connect) -> int:
        say_decimal_sizes(args)
        changes = {k: getattr(args, k) for k in proto.QUOTA_KEYS if hasattr(args, k)}
        if not changes:
            raise ValueError("set-quota needs at least one of --memory-quota, --gpu-cap, --pool-quota, "
                             "--gpu-time-weight, --gpu-time-cap, --idle-timeout")
        with connect() as client:
            rec = client.set_quota(None, args.tenant, **changes)
        if args.json:
            print_json(rec.to_wire())
        else:
            print(limits_line(rec))
            for note in _over_limit_notes(rec):
                print(note)
        return 0
