"""RayCluster: a supervisor per GPU node of a Ray cluster, placed tenants, direct clients.

    cluster = RayCluster.deploy(config, address="ray://head:10001" or "auto")
    cc = cluster.register(TenantSpec("acme").with_gpu_memory_bytes_cap("2GiB"))   # ClusterCapability
    text = cc.to_text()                       # hand this to the tenant's API server
    with cluster.client() as c:               # calls go to the node's CURVE TCP frontend
        c.ping(text)
    cluster.status()                          # {"nodes": [...], "tenants": [...]}
    cluster.shutdown()

Ray does membership, placement of the node actors and failure detection;
the cluster's record is the detached :class:`~supervisor.cluster.directory.Directory`
actor named ``name`` in namespace ``"twt"``, so ``RayCluster.connect`` (and
``twt cluster status|down``) find a deployment from any driver. Ray is
imported only here and in the actors, never by the rest of the package;
without it the calls raise :class:`BackendUnavailable` naming the extra.

Typing: Ray is untyped here (mypy follows no ray import, pyproject.toml), so the ``ray``
module, actor handles, object refs and ``ray.get()`` results are ``Any``; a result is given
its type where it lands (:class:`~supervisor.cluster.directory.ClusterStatus`,
:class:`~supervisor.cluster.directory.ScaleResult`, ``dict[str, object]``). The other
``Any`` here are the node config: TOML-shaped tables as ``tomllib`` or the caller gives
them, handed on to the node supervisors, which check them (``SupervisorConfig``, ``TenantSpec``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from shared.config import SupervisorConfig, read_config_file, tenants_of
from shared.errors import BackendUnavailable, InvalidArgument
from shared.spec import TenantSpec
from supervisor.cluster.capability import ClusterCapability
from supervisor.cluster.client import ClusterClient
from supervisor.cluster.directory import NAMESPACE, ClusterStatus, Directory, ScaleResult, unwrap_ray_error
from supervisor.cluster.node import ACTOR_RUNTIME_ENV

__all__ = ["DEFAULT_NAME", "RayCluster", "ray_auth_mode", "split_tenants"]

DEFAULT_NAME = "twt"
DEPLOY_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 120.0


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise BackendUnavailable("ray", "Ray is not installed; pip install 'tensor-wasm-tenant[ray]'") from None
    return ray


def _init(address: str | None) -> Any:
    ray = _ray()
    if not ray.is_initialized():
        # "auto": Ray's own discovery ($RAY_ADDRESS, then the local node's cluster)
        ray.init(address=address or "auto", namespace=NAMESPACE,
                 logging_level=logging.WARNING, log_to_driver=False)
    return ray


def ray_auth_mode() -> str:
    """``"token"`` when the Ray cluster this driver joined authenticates every RPC with Ray's token
    (``RAY_AUTH_MODE=token``, Ray >= 2.52), ``"disabled"`` when it does not, ``"unsupported"`` for a Ray
    without token authentication. Without it anyone who reaches a Ray port runs code as the cluster's
    user (docs/CLUSTER.md, "Securing a real cluster")."""
    import importlib

    try:
        raylet = importlib.import_module("ray._raylet")
    except ImportError:
        return "unsupported"
    get_mode = getattr(raylet, "get_authentication_mode", None)
    modes = getattr(raylet, "AuthenticationMode", None)
    if get_mode is None or modes is None:
        return "unsupported"
    return "token" if get_mode() == modes.TOKEN else "disabled"


def split_tenants(doc: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The node supervisors' config without ``[[tenant]]`` tables, and the tables.

    A tenant in the node config would be registered by *every* node supervisor, behind the
    directory's back (not placed, not in status, not re-placed). The tables are registered
    through the directory instead, once each, after the nodes are up."""
    tenants = [dict(t) for t in doc.get("tenant") or []]
    for t in tenants:
        if "tenant_id" not in t and "name" in t:
            t["tenant_id"] = t.pop("name")
    return {"supervisor": dict(doc.get("supervisor") or {}), "tenant": []}, tenants


def _config_doc(config: SupervisorConfig | Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    """The node supervisors' config as a TOML-shaped dict (run_dir, state_dir and listen are per node)."""
    if config is None:
        return {"supervisor": {}, "tenant": []}
    if isinstance(config, (str, os.PathLike)):
        fields = read_config_file(config)
        tenants = [t.to_dict() for t in tenants_of(fields)]
        del fields["tenants"]
        return {"supervisor": fields, "tenant": tenants}
    if isinstance(config, SupervisorConfig):
        d = config.to_dict()
        del d["tenants"]
        return {"supervisor": {k: v for k, v in d.items() if k not in ("run_dir", "state_dir", "listen")},
                "tenant": [t.to_dict() for t in config.tenants]}
    doc = dict(config)
    return {"supervisor": dict(doc.get("supervisor") or {}), "tenant": list(doc.get("tenant") or [])}


class RayCluster:
    """A deployed cluster (see the module docstring). Build with :meth:`deploy` or :meth:`connect`."""

    def __init__(self, directory: Any, name: str, address: str | None) -> None:
        self._directory = directory
        self.name = name
        self.address = address
        #: the cluster capabilities of the config file's tenants, registered by :meth:`deploy`
        self.registered: dict[str, ClusterCapability] = {}

    def _get(self, ref: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        ray = _ray()
        try:
            return ray.get(ref, timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - our typed errors come back as themselves
            raise unwrap_ray_error(exc) from None

    @classmethod
    def deploy(cls, config: SupervisorConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
               address: str | None = None, *, name: str = DEFAULT_NAME, listen_host: str | None = None,
               ping_interval_s: float = 1.0, ping_timeout_s: float = 10.0) -> RayCluster:
        """Start one supervisor per GPU node (CURVE TCP on the node's address, or ``listen_host``).

        ``config`` is the node supervisors' config (a TOML path, a TOML-shaped
        dict or a SupervisorConfig; run_dir, state_dir and listen are chosen per
        node). Its ``[[tenant]]`` tables are placed and registered through the
        directory once the nodes are up; their cluster capabilities are in
        :attr:`registered` (a table that cannot be registered undoes the deploy). Raises :class:`BackendUnavailable` when no node has GPUs, and
        :class:`InvalidArgument` when a cluster of that name is deployed already.
        """
        ray = _init(address)
        doc, tenant_tables = split_tenants(_config_doc(config))
        specs = [TenantSpec.from_dict(t) for t in tenant_tables]  # a bad table stops the deploy before any node
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            pass
        else:
            raise InvalidArgument(f"a cluster named {name!r} is deployed already (twt cluster down, or another name)")
        actor_cls = ray.remote(Directory)
        head = {"node:__internal_head__": 0.001} if any(
            "node:__internal_head__" in (n.get("Resources") or {}) for n in ray.nodes() if n.get("Alive")) else {}
        directory = actor_cls.options(
            name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_concurrency=16,
            max_restarts=0, resources=head, runtime_env=ACTOR_RUNTIME_ENV,
        ).remote(name, doc, address or "auto", listen_host, ping_interval_s, ping_timeout_s)
        cluster = cls(directory, name, address)
        try:
            cluster._get(directory.deploy.remote(), DEPLOY_TIMEOUT_S)
        except BaseException:
            ray.kill(directory)
            raise
        try:  # the config's tenants: placed and registered through the directory, each once
            for spec in specs:
                cluster.registered[str(spec.tenant_id)] = cluster.register(spec)
        except BaseException:
            cluster.shutdown()
            raise
        return cluster

    @classmethod
    def connect(cls, address: str | None = None, *, name: str = DEFAULT_NAME) -> RayCluster:
        """The cluster deployed under ``name`` (InvalidArgument when there is none)."""
        ray = _init(address)
        try:
            directory = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            raise InvalidArgument(f"no cluster named {name!r} is deployed on this Ray cluster (twt cluster up)") from None
        return cls(directory, name, address)

    def register(self, spec: TenantSpec | Mapping[str, Any], node: str | None = None) -> ClusterCapability:
        """Place a tenant (most free GPU budget, or ``node``) and register it there."""
        spec_dict = spec.to_dict() if isinstance(spec, TenantSpec) else dict(spec)
        rec = self._get(self._directory.register.remote(spec_dict, node))
        return ClusterCapability(
            cluster=str(rec["cluster"]), tenant_id=str(rec["tenant_id"]), node_id=str(rec["node_id"]),
            endpoint=str(rec["endpoint"]), server_public_key=str(rec["server_public_key"]),
            capability=bytes(rec["capability"]), ticket=bytes(rec["ticket"]), epoch=int(rec["epoch"]),
        )

    def evict(self, tenant_id: str) -> dict[str, object]:
        result: dict[str, object] = self._get(self._directory.evict.remote(tenant_id))
        return result

    def scale(self, tenant_id: str, instances: int) -> ScaleResult:
        """Run ``instances`` worker processes for a placed tenant (kept if it is re-placed)."""
        result: ScaleResult = self._get(self._directory.scale.remote(tenant_id, instances))
        return result

    def status(self) -> ClusterStatus:
        """``{"cluster", "address", "ray_auth", "nodes": [...], "tenants": [{"tenant_id", "node_id", ...}]}``."""
        result: ClusterStatus = self._get(self._directory.status.remote())
        result["ray_auth"] = ray_auth_mode()
        return result

    def client(self, timeout_s: float = 30.0, *, connect_timeout_s: float = 3.0) -> ClusterClient:
        """A client for tenant calls (straight to the nodes; Ray only to find a moved tenant)."""
        return ClusterClient(self._directory, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)

    def check_node(self, node_id: str) -> bool:
        """Check a node now (instead of at the next ping); True when it is lost."""
        return bool(self._get(self._directory.suspect.remote(node_id)))

    def shutdown(self) -> dict[str, dict[str, object]]:
        """Stop every node's supervisor gracefully, then the node actors and the directory."""
        ray = _ray()
        try:
            result: dict[str, dict[str, object]] = self._get(self._directory.shutdown.remote(), DEPLOY_TIMEOUT_S)
        finally:
            ray.kill(self._directory)
        return result
