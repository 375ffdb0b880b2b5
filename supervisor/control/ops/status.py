"""``status``: every tenant's record, the supervisor's and the devices' (``twt status``, ``twt top``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.errors import InvalidArgument
from shared.protocol import arg_opt_int, arg_opt_str
from shared.records import STATUS_PAGE_DEFAULT, STATUS_PAGE_MAX, StatusRecord
from supervisor.client.api import SupervisorClient
from supervisor.control.ops._base import AdminOp, Args, Reply
from supervisor.control.ops._cli import unreachable_on_timeout

if TYPE_CHECKING:
    from supervisor.control.admin import AdminOps

__all__ = ["Status", "fetch_status"]


class Status(AdminOp):
    name = "status"
    args_doc = (f"`{{after?, limit?, state?, view?}}`: the page after tenant id `after` (the previous reply's "
                f"`next`), at most `limit` tenants (1..{STATUS_PAGE_MAX}, default {STATUS_PAGE_DEFAULT}), only those "
                "in `state` (e.g. `running`, `stopped`); `view`: `records` (the default: `tenants`) or `rows` (the "
                "table's columns only, in `rows`: what `twt top` reads)")
    result_doc = ("`{supervisor: {...pool, workers, rss_bytes}, devices: [...], tenants: [record...], "
                  "summary: {tenants, states: {state: count}, instances, ready}, next}`: one page of tenant "
                  "records by id (with `view = rows`: `rows` instead, `tenants` empty); `summary` counts every "
                  "tenant; `next` is the `after` of the next page (nil: the last)")
    error_notes = {"InvalidArgument": "a limit out of range, an unknown state or view"}

    def serve(self, part: AdminOps, reply: Reply, args: Args) -> None:
        limit = arg_opt_int(args, "limit")
        view = arg_opt_str(args, "view")
        if view not in (None, "records", "rows"):
            raise InvalidArgument(f"status: view must be records or rows, got {view!r}")
        record = part.records.status(after=arg_opt_str(args, "after"), state=arg_opt_str(args, "state"),
                                     limit=STATUS_PAGE_DEFAULT if limit is None else limit, rows=view == "rows")
        reply.ok(record.to_wire())


def fetch_status(client: SupervisorClient, *, limit: int | None = None, after: str | None = None,
                 state: str | None = None) -> StatusRecord:
    """The status record (every tenant, or the page ``limit``/``after`` names; see
    :meth:`SupervisorClient.status`); a supervisor that does not answer in time counts as
    unreachable (exit 3)."""
    return unreachable_on_timeout(client, lambda: client.status(limit=limit, after=after, state=state))
