"""``ping``: one of the tenant's workers answers (``SupervisorClient.ping``)."""

from __future__ import annotations

from supervisor.control.ops._base import WorkerOp

__all__ = ["Ping"]


class Ping(WorkerOp):
    name = "ping"
    result_doc = "`{pid, tenant, instance, requests, uptime_s}`"
