"""``status``: every tenant's record, the supervisor's and the devices' (``twt status``, ``twt top``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.errors import InvalidArgument
from shared.protocol import arg_opt_int, arg_opt_str
from shared.records import STATUS_PAGE_DEFAULT, STATUS_PAGE_MAX
from supervisor.control.ops._base import AdminOp, Args, Reply

if TYPE_CHECKING:
    from supervisor.control.admin import AdminOps

__all__ = ["Status"]


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
