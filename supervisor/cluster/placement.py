"""Which Ray nodes get a supervisor, and which node a tenant goes to (pure functions, no Ray).

    ray.nodes() ──► gpu_nodes()   alive nodes with a GPU resource > 0: one supervisor each
    register ─────► choose_node() pinned node if named (must be alive), else the node with the
                                  most free GPU budget: capacity (its supervisor's device budgets)
                                  minus the caps of the tenants the cluster placed there;
                                  ties go to the node with fewer tenants, then by node id

Caps are what a tenant may use, not what it uses: placing by committed caps
keeps a node from being promised more than its devices hold, and needs no
call to any node.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from shared.errors import BackendUnavailable, InvalidArgument

__all__ = ["NodeBudget", "RayNode", "choose_node", "gpu_nodes", "require_gpu_nodes"]


@dataclass(frozen=True)
class RayNode:
    """A Ray node that can host a supervisor."""

    node_id: str
    address: str
    gpus: float


@dataclass(frozen=True)
class NodeBudget:
    """What the placement needs to know of one node with a running supervisor."""

    node_id: str
    alive: bool
    capacity_bytes: int
    committed_bytes: int
    tenants: int

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.committed_bytes


def gpu_nodes(ray_nodes: Iterable[Mapping[str, object]]) -> list[RayNode]:
    """The alive nodes of a ``ray.nodes()`` listing that offer GPUs, by node id."""
    out = []
    for n in ray_nodes:
        resources = n.get("Resources")
        gpus = float(resources.get("GPU", 0) or 0) if isinstance(resources, Mapping) else 0.0
        if n.get("Alive") and gpus > 0:
            out.append(RayNode(str(n["NodeID"]), str(n.get("NodeManagerAddress", "")), gpus))
    return sorted(out, key=lambda r: r.node_id)


def require_gpu_nodes(ray_nodes: Sequence[Mapping[str, object]], address: str) -> list[RayNode]:
    """:func:`gpu_nodes`, or the one clear error for a cluster without any."""
    found = gpu_nodes(ray_nodes)
    if not found:
        alive = sum(1 for n in ray_nodes if n.get("Alive"))
        raise BackendUnavailable(
            "ray",
            f"the Ray cluster at {address} has no node with GPUs ({alive} alive node(s), none offers a GPU "
            "resource); start nodes with GPUs (ray start --num-gpus N) before deploying",
        )
    return found


def choose_node(budgets: Iterable[NodeBudget], pinned: str | None = None) -> str:
    """The node id a new tenant goes to (see the module docstring)."""
    alive = [b for b in budgets if b.alive]
    if pinned is not None:
        for b in alive:
            if b.node_id == pinned or (len(pinned) >= 8 and b.node_id.startswith(pinned)):
                return b.node_id
        known = ", ".join(b.node_id[:12] for b in alive) or "none"
        raise InvalidArgument(f"node {pinned!r} runs no live supervisor of this cluster (live: {known})")
    if not alive:
        raise BackendUnavailable("ray", "no live node with a supervisor is left in the cluster")
    return max(alive, key=lambda b: (b.free_bytes, -b.tenants, b.node_id)).node_id
