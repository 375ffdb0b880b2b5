"""``status``: every tenant's record, the supervisor's and the devices' (``twt status``, ``twt top``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.records import StatusRecord
from supervisor.client.api import SupervisorClient
from supervisor.control.ops._base import AdminOp, Args
from supervisor.control.ops._cli import unreachable_on_timeout

if TYPE_CHECKING:
    from supervisor.control.admin import AdminOps

__all__ = ["Status", "fetch_status"]


class Status(AdminOp):
    name = "status"
    result_doc = "`{supervisor: {...pool, workers, rss_bytes}, devices: [...], tenants: [record...]}`"

    def serve(self, part: AdminOps, client: bytes, rid: int, args: Args) -> None:
        self.answer(part, client, rid, part.status().to_wire())


def fetch_status(client: SupervisorClient) -> StatusRecord:
    """The status record; a supervisor that does not answer in time counts as unreachable (exit 3)."""
    return unreachable_on_timeout(client, client.status)
