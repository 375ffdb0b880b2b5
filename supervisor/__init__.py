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

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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

#: where each public name lives. Imported on first use (PEP 562), not with the package: a
#: ``twt`` command or a client imports ``supervisor.client...`` and must not pay for the whole
#: supervisor loop (its frontends, zmq.auth's thread and asyncio, the state store): ~100 ms of
#: CPU per process, and the test suite starts hundreds of them
_HOMES: dict[str, str] = {
    "SupervisorClient": "supervisor.client.api",
    "SupervisorHandle": "supervisor.client.launch",
    "launch": "supervisor.client.launch",
    "TenantInfo": "supervisor.store.registry",
    "TenantRegistry": "supervisor.store.registry",
    "RegistryKey": "supervisor.store.state",
    "StateStore": "supervisor.store.state",
    "StoredTenant": "supervisor.store.state",
    "Supervisor": "supervisor.supervisor",
}


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'supervisor' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value
