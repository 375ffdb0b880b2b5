"""``reload`` / ``twt reload``: re-read the config file and apply the difference (as SIGHUP does).

``twt reload`` exits 2 when the file cannot be applied (nothing was changed;
the problems are printed, logged and published as a ``reload_failed`` event).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from supervisor.control.ops._base import Args, Reply, ServiceOp

if TYPE_CHECKING:
    from supervisor.control.service import ServiceOps

__all__ = ["Reload"]


class Reload(ServiceOp):
    name = "reload"
    result_doc = ("`{registered, changed: [{tenant, fields, restart, scale}], evicted, unchanged, conflicts, "
                  "settings_not_applied, errors}`: the config file read again and its difference applied (as SIGHUP)")
    error_notes = {
        "ConfigError": "`path`, `detail`: the file cannot be applied; nothing changed",
    }

    def serve(self, part: ServiceOps, reply: Reply, args: Args) -> None:
        reply.ok(part.reload())
