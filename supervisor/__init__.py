"""The supervisor: tenants, their capabilities and quota blocks, worker processes, routing.

Public face:

- :class:`TenantRegistry` - the in-process registry with the Rust crate's API names;
- :class:`SupervisorClient` - typed calls to a running supervisor (``twt supervise``);
- :func:`launch` - start a supervisor as a child process and get a connected client;
- :class:`Supervisor` - the supervisor loop itself (what ``twt supervise`` runs);
- :class:`StateStore` - the durable state (tenants, registry key, named key material).

Remote supervisors: ``SupervisorClient.remote(endpoint, server_public_key=...)``
over the CurveZMQ TCP frontend. A supervisor per GPU node of a Ray cluster:
:mod:`supervisor.cluster` (the optional ``[ray]`` extra; docs/CLUSTER.md).
"""

from __future__ import annotations

from supervisor.client.api import SupervisorClient
from supervisor.client.launch import SupervisorHandle, launch
from supervisor.store.registry import TenantInfo, TenantRegistry
from supervisor.store.state import RegistryKey, StateStore, StoredTenant
from supervisor.supervisor import Supervisor

__all__ = [
    "RegistryKey",
    "StateStore",
    "StoredTenant",
    "Supervisor",
    "SupervisorClient",
    "SupervisorHandle",
    "TenantInfo",
    "TenantRegistry",
    "launch",
]
