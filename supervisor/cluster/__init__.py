"""A supervisor per GPU node of a Ray cluster (optional extra: ``pip install tensor-wasm-tenant[ray]``).

Public face:

- :class:`RayCluster` - deploy (one supervisor per GPU node, a Ray actor each),
  register tenants where the GPU budget is, status, shutdown;
- :class:`ClusterCapability` - a tenant's placement and tokens, as text;
- :class:`ClusterClient` - tenant calls straight to the node's CURVE TCP
  frontend, finding a re-placed tenant by itself after a node loss.

Nothing here imports Ray at import time; docs/CLUSTER.md tells the story.
"""

from __future__ import annotations

from supervisor.cluster.capability import ClusterCapability
from supervisor.cluster.client import ClusterClient
from supervisor.cluster.ray_cluster import RayCluster

__all__ = ["ClusterCapability", "ClusterClient", "RayCluster"]
