"""ClusterClient: SupervisorClient's tenant methods for tenants of a cluster, called on their node directly.

    client.ping(cc) ──CURVE TCP──► the node supervisor at cc.endpoint      (no Ray on this path)
        link lost / no connection / handshake refused ──► directory.suspect(node)  (Ray: check that node now)
                                  └─► directory.lookup(tenant, ticket) ──► the current placement
            the request never left us ──► sent again at the new place, once
            it may have been served   ──► NodeLost (retryable); the next call goes to the new place
        TenantIsolationViolation / UnknownTenant ──► lookup: moved meanwhile? then once more there

The newest placement seen per tenant is kept, so a caller holding the cluster
capability it got at registration keeps using it: after a node loss the
client finds the tenant where the cluster re-placed it. Buffer handles from
the lost node are void there (its buffers are gone).

One client is not thread-safe (like SupervisorClient): use one per thread.

Typing: Ray is untyped here (mypy follows no ray import), so the ``ray`` module, actor handles,
object refs and ``ray.get()`` results are dynamically typed (this module's only ``Any``); a
result is given its type where it lands.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from shared.capability import TenantCapability
from shared.errors import (
    HandshakeFailed,
    NodeLost,
    SupervisorUnavailable,
    TenantIsolationViolation,
    UnknownTenant,
)
from shared.quota import QuotaSnapshot
from shared.records import PingInfo, RunResult
from supervisor.client.api import SupervisorClient
from supervisor.cluster.capability import ClusterCapability
from supervisor.admission.curve import CurveKeyPair

__all__ = ["ClusterClient"]

T = TypeVar("T")
LOOKUP_TIMEOUT_S = 30.0


def _as_cap(cc: ClusterCapability | str) -> ClusterCapability:
    return cc if isinstance(cc, ClusterCapability) else ClusterCapability.from_text(cc)


class ClusterClient:
    """Tenant calls on a cluster's node supervisors (see the module docstring)."""

    def __init__(self, directory: Any, *, timeout_s: float = 30.0, connect_timeout_s: float = 3.0,
                 client_keys: CurveKeyPair | None = None) -> None:
        self._directory = directory
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._keys = client_keys or CurveKeyPair.generate()
        self._clients: dict[tuple[str, str], SupervisorClient] = {}
        self._places: dict[tuple[str, str], ClusterCapability] = {}

    # ---------------------------------------------------------- plumbing

    def current(self, cc: ClusterCapability | str) -> ClusterCapability:
        """The newest placement this client knows for the tenant of ``cc``."""
        cc = _as_cap(cc)
        known = self._places.get((cc.cluster, cc.tenant_id))
        return known if known is not None and known.epoch >= cc.epoch else cc

    def _client(self, cc: ClusterCapability) -> SupervisorClient:
        key = (cc.endpoint, cc.server_public_key)
        client = self._clients.get(key)
        if client is None:
            client = SupervisorClient.remote(cc.endpoint, cc.server_public_key, self._keys, self.timeout_s,
                                             connect_timeout_s=self.connect_timeout_s)
            self._clients[key] = client
        return client

    def _forget(self, cc: ClusterCapability) -> None:
        client = self._clients.pop((cc.endpoint, cc.server_public_key), None)
        if client is not None:
            client.close()

    def _ray_get(self, ref: Any) -> Any:
        import ray

        from supervisor.cluster.directory import unwrap_ray_error

        try:
            return ray.get(ref, timeout=LOOKUP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - typed errors come back as themselves
            raise unwrap_ray_error(exc) from None

    def _lookup(self, cc: ClusterCapability, *, settle: bool) -> ClusterCapability:
        """The directory's placement; with ``settle``, wait while the tenant is being moved."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            rec = self._ray_get(self._directory.lookup.remote(cc.tenant_id, cc.ticket))
            if not settle or rec["state"] != "relocating" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if rec["state"] == "lost":
            raise NodeLost(cc.tenant_id, node_id=cc.node_id, reason=str(rec.get("reason") or "not re-placed"))
        return cc.moved(rec)

    def _call(self, cc_in: ClusterCapability | str, fn: Callable[[SupervisorClient, TenantCapability], T]) -> T:
        cc = self.current(cc_in)
        key = (cc.cluster, cc.tenant_id)
        for attempt in (0, 1):
            client = self._client(cc)
            try:
                return fn(client, cc.tenant_capability())
            except (SupervisorUnavailable, HandshakeFailed) as exc:
                # HandshakeFailed too: another supervisor may hold a lost node's port by now
                if self._directory is None:
                    raise  # no directory to ask where the tenant went
                unsent = isinstance(exc, HandshakeFailed) or client.last_request_unsent
                self._ray_get(self._directory.suspect.remote(cc.node_id))
                new = self._lookup(cc, settle=True)
                if new.epoch == cc.epoch:
                    raise  # the node is alive as far as Ray knows: a network problem, not a node loss
                self._places[key] = new
                self._forget(cc)
                if unsent and attempt == 0:
                    cc = new
                    continue  # no supervisor took the request: send it where the tenant is now
                raise NodeLost(cc.tenant_id, node_id=cc.node_id, reason=exc.reason) from exc
            except (TenantIsolationViolation, UnknownTenant):
                if self._directory is None:
                    raise
                new = self._lookup(cc, settle=True)
                if new.epoch == cc.epoch or attempt:
                    raise
                self._places[key] = new
                cc = new
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ tenant

    def ping(self, cc: ClusterCapability | str) -> PingInfo:
        return self._call(cc, lambda c, cap: c.ping(cap))

    def quota(self, cc: ClusterCapability | str) -> QuotaSnapshot:
        return self._call(cc, lambda c, cap: c.quota(cap))

    def alloc(self, cc: ClusterCapability | str, nbytes: int) -> int:
        return self._call(cc, lambda c, cap: c.alloc(cap, nbytes))

    def free(self, cc: ClusterCapability | str, handle: int) -> int:
        return self._call(cc, lambda c, cap: c.free(cap, handle))

    def write(self, cc: ClusterCapability | str, handle: int, data: bytes | bytearray | memoryview, offset: int = 0) -> int:
        return self._call(cc, lambda c, cap: c.write(cap, handle, data, offset))

    def read(self, cc: ClusterCapability | str, handle: int, nbytes: int, offset: int = 0) -> bytes:
        return self._call(cc, lambda c, cap: c.read(cap, handle, nbytes, offset))

    def buffers(self, cc: ClusterCapability | str) -> dict[int, int]:
        return self._call(cc, lambda c, cap: c.buffers(cap))

    def put_module(self, cc: ClusterCapability | str, module: bytes) -> str:
        return self._call(cc, lambda c, cap: c.put_module(cap, module))

    def run_wasm(self, cc: ClusterCapability | str, module: bytes | str, export: str,
                 args: Sequence[int | float | dict[str, int]] = (), *, fuel: int | None = None,
                 timeout_s: float | None = None, request_timeout_s: float | None = None) -> RunResult:
        return self._call(cc, lambda c, cap: c.run_wasm(cap, module, export, args, fuel=fuel, timeout_s=timeout_s,
                                                        request_timeout_s=request_timeout_s))
