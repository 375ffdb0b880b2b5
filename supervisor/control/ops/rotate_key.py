"""``rotate_key`` / ``twt rotate-key``: a new registry key; every capability minted before is revoked.

The command and its examples: :mod:`supervisor.cli.commands.rotate_key`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from supervisor.control.ops._base import Args, Reply, ServiceOp

if TYPE_CHECKING:
    from supervisor.control.service import ServiceOps

__all__ = ["RotateKey"]


class RotateKey(ServiceOp):
    name = "rotate_key"
    result_doc = ("`{admin_capability, registry_id}`: a new registry key; every capability minted before is "
                  "refused as revoked")
    error_notes = {
        "StateError": "the new key could not be stored; nothing rotated",
    }

    def serve(self, part: ServiceOps, reply: Reply, args: Args) -> None:
        reply.ok(part.rotate_key())
