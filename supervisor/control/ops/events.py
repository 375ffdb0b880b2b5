"""``events`` / ``twt events``: a page of the event log for either capability; follow it, one line each.

The op: ``events {after, max, kinds, log}`` -> ``{events, next, missed, more, log}``. The
admin capability sees every event, a tenant capability its own tenant's (the frontend
verifies which; :class:`Events` reads the log for it). The command, its output and how a
follower is told of missed events: :mod:`supervisor.cli.commands.events`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from supervisor.control.ops._base import Args, EitherCapabilityOp
from supervisor.observe.event_log import ADMIN_VIEW, EventView

if TYPE_CHECKING:
    from supervisor.admission.frontend import Frontend
    from supervisor.runtime.tenants import TenantRuntime

__all__ = ["Events"]


class Events(EitherCapabilityOp):
    name = "events"
    args_doc = "`{after?: int | nil, max?: int, kinds?: [str], log?: str}`"
    result_doc = "`{events: [{seq, event, ts, ...}...], next, missed, more, log}`"
    error_notes = {
        "InvalidArgument": "`after` < 0 or ahead of the newest event of this log, `max` < 1, more than 64 `kinds` or one not a name of 1..64 characters, a `log` over 64 characters, a wrong type",
    }

    def serve(self, frontend: Frontend, rt: TenantRuntime | None, args: Args) -> object:
        view = ADMIN_VIEW if rt is None else EventView(rt.tenant_id, rt.generation)
        return frontend.event_log.page(view, args)
