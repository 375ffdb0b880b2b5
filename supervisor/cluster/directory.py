"""Directory: the cluster's own record, a detached named Ray actor on the head node.

    RayCluster (driver) ──ray──► Directory "twt" (namespace "twt", detached, num_cpus=0)
                                   nodes:   node id -> NodeSupervisor actor, endpoint, key, budget, alive
                                   tenants: tenant id -> spec, node, capability, sha256(ticket), epoch, state
                                   monitor thread: ping every node actor each ping_interval_s
                                     actor died (RayActorError) ──► node lost
                                     no answer ping_misses times ──► ray.kill (fencing), node lost
                                     a new GPU node joined ──► start a supervisor there
    node lost ──► every tenant on it: restart policy "always"/"on-failure" ─► registered again on the
                                      surviving node with the most free budget (epoch + 1);
                                      "never" (or no node left) ─► state "lost"
    ClusterClient ──lookup(tenant, ticket)──► the current placement (how an old cluster
                                              capability finds its tenant again)
                  ──suspect(node)──► check that node now (a client saw its link drop)

Ray is the membership and failure detector; this actor only keeps the
directory and reacts. It holds no tenant data: buffers on a lost node are
gone, and re-placed tenants start empty.

Threads: Ray runs this actor's methods on a small thread pool
(``max_concurrency``) and the monitor is one more thread. ``_lock`` guards
``nodes`` and ``tenants`` and is never held across a Ray call;
``_placing`` serialises placements (register, re-placement) so two of them
never count the same free budget twice.

Typing: Ray is untyped here (mypy follows no ray import), so an actor handle is dynamically
typed (this module's only ``Any``); what ``ray.get()`` returns is given its type where it lands (a node's
:class:`~supervisor.cluster.node.NodeInfo`, the records). Its status and scale results are
TypedDicts (:class:`ClusterStatus`, :class:`ScaleResult`); the placement, evict and shutdown
maps are ``dict[str, object]``, handed to operators as they are (twt cluster, --json).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from shared.errors import (
    AlreadyRegistered,
    BackendUnavailable,
    InvalidArgument,
    NodeLost,
    TenantIsolationViolation,
    UnknownTenant,
)
from shared.checks import is_int
from shared.log import get_logger, log_event
from shared.records import EvictResult, StatusRecord, TenantRecord
from shared.spec import TenantSpec
from supervisor.cluster.placement import NodeBudget, choose_node, gpu_nodes, require_gpu_nodes

if TYPE_CHECKING:
    from supervisor.cluster.node import NodeInfo

__all__ = ["NAMESPACE", "ClusterStatus", "Directory", "NodeRow", "ScaleResult", "TenantRow", "unwrap_ray_error"]


class NodeRow(TypedDict):
    """A node in the cluster's status."""

    node_id: str
    alive: bool
    lost_reason: str
    endpoint: str
    server_public_key: str
    supervisor_pid: int
    gpu_ids: list[str]
    cuda_visible_devices: str
    backend: str | None
    niceness: int | None  # the supervisor's: above the raylet's (Ray's worker_niceness), it starves under load
    capacity_bytes: int
    committed_bytes: int
    run_dir: str
    free_bytes: int
    tenants: list[str]


class TenantRow(TypedDict):
    """A placed tenant in the cluster's status."""

    tenant_id: str
    node_id: str
    endpoint: str
    state: str  # its node's record of it (running, failed, ...), or its placement when none is at hand
    placement: str  # running | relocating | lost
    epoch: int
    reason: str
    # these three as TenantSpec.to_dict wrote them in the registered spec (the directory keeps that dict)
    restart: object
    gpu_memory_bytes_cap: object
    instances: object
    moves: list[str]
    pids: list[int]


class ScaleResult(TypedDict):
    """``Directory.scale``: the tenant's instances as its node reports them."""

    tenant_id: str
    node_id: str
    instances: int
    state: str
    pids: list[int]


class ClusterStatus(TypedDict):
    """``Directory.status``; ``RayCluster.status`` adds ``ray_auth``."""

    cluster: str
    address: str
    nodes: list[NodeRow]
    tenants: list[TenantRow]
    ray_auth: NotRequired[str]

_log = get_logger("supervisor.cluster")

NAMESPACE = "twt"
NODE_START_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 90.0
NEW_NODE_SCAN_S = 5.0
NODE_RETRY_S = 60.0


def unwrap_ray_error(exc: BaseException) -> BaseException:
    """The original exception inside Ray's task-error wrappers (our typed errors pickle as themselves)."""
    seen = 0
    while hasattr(exc, "cause") and getattr(exc, "cause", None) is not None and seen < 8:
        exc = exc.cause
        seen += 1
    return exc


@dataclass
class _Node:
    actor: Any  # a Ray actor handle (ray is untyped here)
    info: NodeInfo
    alive: bool = True
    misses: int = 0
    lost_reason: str = ""


@dataclass
class _Tenant:
    spec: dict[str, object]
    node_id: str
    capability: bytes
    ticket_hash: bytes
    epoch: int = 0
    state: str = "running"  # running | relocating | lost
    reason: str = ""
    history: list[str] = field(default_factory=list)

    @property
    def gpu_cap(self) -> int:
        cap = self.spec.get("gpu_memory_bytes_cap")  # the spec as TenantSpec.to_dict wrote it: an int or None
        return cap if is_int(cap) else 0


class Directory:
    """The cluster's record and failure reactions (see the module docstring)."""

    def __init__(self, name: str, config_doc: dict[str, object], address: str, listen_host: str | None = None,
                 ping_interval_s: float = 1.0, ping_timeout_s: float = 10.0, ping_misses: int = 3) -> None:
        self.name = name
        self.config_doc = config_doc
        self.address = address
        self.listen_host = listen_host
        self.ping_interval_s = ping_interval_s
        self.ping_timeout_s = ping_timeout_s
        self.ping_misses = ping_misses
        self.nodes: dict[str, _Node] = {}
        self.tenants: dict[str, _Tenant] = {}
        self._lock = threading.RLock()
        self._placing = threading.Lock()
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self._last_scan = 0.0
        #: node id -> when a supervisor last failed to start there (retried after NODE_RETRY_S)
        self._failed: dict[str, float] = {}

    # ------------------------------------------------------------ nodes

    def deploy(self) -> ClusterStatus:
        """Start a supervisor on every GPU node; the cluster's status. BackendUnavailable without any."""
        import ray

        found = require_gpu_nodes(ray.nodes(), self.address)
        errors = self._start_nodes([n.node_id for n in found], {n.node_id: n.gpus for n in found})
        with self._lock:
            if not self.nodes:
                raise BackendUnavailable("ray", f"no supervisor could start on the GPU nodes: {'; '.join(errors)}")
        self._monitor = threading.Thread(target=self._monitor_loop, name="twt-cluster-monitor", daemon=True)
        self._monitor.start()
        return self.status(live=False)

    def _start_nodes(self, node_ids: list[str], gpus: dict[str, float]) -> list[str]:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from supervisor.cluster.node import ACTOR_RUNTIME_ENV, NodeSupervisor

        # pings on a thread of their own (a "health" concurrency group): with one thread for every
        # method, a ping waited behind a registration, and on a loaded host a registration that took
        # 3 x ping_timeout_s got its node fenced - killed mid-call - and reported lost
        ray.method(concurrency_group="health")(NodeSupervisor.ping)
        actor_cls = ray.remote(concurrency_groups={"health": 1})(NodeSupervisor)
        started = {}
        for nid in node_ids:
            started[nid] = actor_cls.options(
                num_gpus=gpus[nid],
                num_cpus=0,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False),
                runtime_env=ACTOR_RUNTIME_ENV,
            ).remote(self.config_doc, self.listen_host)
        errors = []
        for nid, actor in started.items():
            try:
                info = ray.get(actor.describe.remote(), timeout=NODE_START_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - one node failing to start must not stop the others
                err = unwrap_ray_error(exc)
                errors.append(f"node {nid[:12]}: {err}")
                log_event(_log, logging.ERROR, "cluster.node_start_failed", node=nid, error=str(err))
                ray.kill(actor)
                with self._lock:
                    self._failed[nid] = time.monotonic()
                continue
            with self._lock:
                self.nodes[nid] = _Node(actor, info)
            log_event(_log, logging.INFO, "cluster.node_up", node=nid, endpoint=info["endpoint"],
                      gpus=info["gpu_ids"], capacity_bytes=info["capacity_bytes"])
        return errors

    def _monitor_loop(self) -> None:
        import ray

        while not self._stop.wait(self.ping_interval_s):
            try:
                with self._lock:
                    alive = {nid: n.actor for nid, n in self.nodes.items() if n.alive}
                refs = {nid: actor.ping.remote() for nid, actor in alive.items()}
                ready = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.ping_timeout_s)[0] if refs else []
                done = set(ready)
                for nid, ref in refs.items():
                    if ref in done:
                        try:
                            ray.get(ref)
                            with self._lock:
                                self.nodes[nid].misses = 0
                        except ray.exceptions.RayActorError as exc:
                            self._node_lost(nid, f"its supervisor actor died ({type(exc).__name__})")
                    else:
                        self._missed(nid)
                now = time.monotonic()
                if now - self._last_scan >= NEW_NODE_SCAN_S:
                    self._last_scan = now
                    self._scan_new_nodes()
            except Exception:  # noqa: BLE001 - the monitor must outlive any one bad round
                _log.error("cluster.monitor_error", exc_info=True)

    def _missed(self, nid: str) -> None:
        import ray

        with self._lock:
            node = self.nodes[nid]
            node.misses += 1
            fence = node.misses >= self.ping_misses
        if fence:
            ray.kill(node.actor)  # fencing: a hung node must not keep serving a tenant we move
            self._node_lost(nid, f"no answer to {self.ping_misses} pings of {self.ping_timeout_s:g} s")

    def _scan_new_nodes(self) -> None:
        import ray

        now = time.monotonic()
        with self._lock:
            known = set(self.nodes) | {nid for nid, at in self._failed.items() if now - at < NODE_RETRY_S}
        new = [n for n in gpu_nodes(ray.nodes()) if n.node_id not in known]
        if new:
            self._start_nodes([n.node_id for n in new], {n.node_id: n.gpus for n in new})

    def suspect(self, node_id: str) -> bool:
        """A client lost its link to ``node_id``: check it now. True when the node is (now) lost."""
        import ray

        with self._lock:
            node = self.nodes.get(node_id)
        if node is None:
            return True
        if not node.alive:
            return True
        try:
            ray.get(node.actor.ping.remote(), timeout=min(self.ping_timeout_s, 5.0))
            return False
        except ray.exceptions.RayActorError as exc:
            self._node_lost(node_id, f"its supervisor actor died ({type(exc).__name__})")
            return True
        except ray.exceptions.GetTimeoutError:
            return False  # slow, not known dead: the monitor decides after ping_misses

    def _node_lost(self, nid: str, reason: str) -> None:
        with self._lock:
            node = self.nodes[nid]
            if not node.alive:
                return
            node.alive = False
            node.lost_reason = reason
            affected = sorted(tid for tid, t in self.tenants.items() if t.node_id == nid)
            for tid in affected:
                t = self.tenants[tid]
                t.state = "relocating" if t.spec.get("restart", "always") != "never" else "lost"
                t.reason = f"node {nid[:12]} lost: {reason}"
        log_event(_log, logging.WARNING, "cluster.node_lost", node=nid, reason=reason, tenants=affected)
        for tid in affected:
            self._replace(tid)

    def _replace(self, tid: str) -> None:
        """Register a tenant of a lost node again elsewhere (its restart policy allowed it)."""
        import ray

        with self._placing:
            with self._lock:
                t = self.tenants.get(tid)
                if t is None or t.state != "relocating":
                    return
                spec = dict(t.spec)
            try:
                nid = choose_node(self._budgets())
                cap = ray.get(self.nodes[nid].actor.register.remote(spec), timeout=CALL_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - recorded on the tenant; others still move
                err = unwrap_ray_error(exc)
                with self._lock:
                    t.state = "lost"
                    t.reason += f"; re-placement failed: {err}"
                log_event(_log, logging.ERROR, "cluster.replace_failed", tenant=tid, error=str(err))
                return
            with self._lock:
                old = t.node_id
                t.node_id, t.capability, t.epoch, t.state = nid, bytes(cap), t.epoch + 1, "running"
                t.history.append(f"{old[:12]} -> {nid[:12]}")
        log_event(_log, logging.WARNING, "cluster.tenant_replaced", tenant=tid, old_node=old, node=nid, epoch=t.epoch)

    def _budgets(self) -> list[NodeBudget]:
        with self._lock:
            out = []
            for nid, n in self.nodes.items():
                mine = [t for t in self.tenants.values() if t.node_id == nid and t.state == "running"]
                out.append(NodeBudget(nid, n.alive, int(n.info.get("capacity_bytes") or 0),
                                      sum(t.gpu_cap for t in mine), len(mine)))
            return out

    # ---------------------------------------------------------- tenants

    def register(self, spec: dict[str, object], node: str | None = None) -> dict[str, object]:
        """Place and register a tenant; its placement and the ticket (shown once)."""
        import ray

        spec = TenantSpec.from_dict(spec).to_dict()  # InvalidArgument/ValueError before any node is asked
        tid = str(spec["tenant_id"])
        with self._placing:
            with self._lock:
                if tid in self.tenants:
                    raise AlreadyRegistered(tid)
            nid = choose_node(self._budgets(), node)
            try:
                cap = ray.get(self.nodes[nid].actor.register.remote(spec), timeout=CALL_TIMEOUT_S)
            except ray.exceptions.RayActorError as exc:  # the node died under us: retryable elsewhere
                raise NodeLost(tid, node_id=nid, reason=f"lost while registering ({type(exc).__name__})") from None
            except Exception as exc:  # noqa: BLE001 - hand the typed error back to the caller
                raise unwrap_ray_error(exc) from None
            ticket = os.urandom(16)
            with self._lock:
                self.tenants[tid] = _Tenant(spec, nid, bytes(cap), hashlib.sha256(ticket).digest())
                record = self._placement(tid)
        log_event(_log, logging.INFO, "cluster.tenant_registered", tenant=tid, node=nid)
        return {**record, "ticket": ticket, "cluster": self.name}

    def _placement(self, tid: str) -> dict[str, object]:
        t = self.tenants[tid]
        info = self.nodes[t.node_id].info
        return {"tenant_id": tid, "node_id": t.node_id, "endpoint": info["endpoint"],
                "server_public_key": info["server_public_key"], "capability": t.capability,
                "epoch": t.epoch, "state": t.state, "reason": t.reason}

    def lookup(self, tenant_id: str, ticket: bytes) -> dict[str, object]:
        """The tenant's current placement for the holder of its ticket."""
        with self._lock:
            t = self.tenants.get(tenant_id)
            if t is None:
                raise UnknownTenant(tenant_id)
            if not isinstance(ticket, bytes) or not hmac.compare_digest(hashlib.sha256(ticket).digest(), t.ticket_hash):
                raise TenantIsolationViolation(tenant_id, "the cluster directory (wrong ticket)")
            return self._placement(tenant_id)

    def evict(self, tenant_id: str) -> dict[str, object]:
        import ray

        with self._placing:
            with self._lock:
                t = self.tenants.get(tenant_id)
                if t is None:
                    raise UnknownTenant(tenant_id)
                node = self.nodes[t.node_id]
            result: dict[str, object] = {"evicted": tenant_id, "node_id": t.node_id}
            if node.alive and t.state == "running":
                try:
                    evicted: EvictResult = ray.get(node.actor.evict.remote(tenant_id), timeout=CALL_TIMEOUT_S)
                    result["pids"] = list(evicted.pids)
                except Exception as exc:  # noqa: BLE001 - the record goes either way
                    err = unwrap_ray_error(exc)
                    if not isinstance(err, (UnknownTenant, ray.exceptions.RayActorError)):
                        raise err from None
            with self._lock:
                self.tenants.pop(tenant_id, None)
        return result

    def scale(self, tenant_id: str, instances: int) -> ScaleResult:
        """Run ``instances`` worker processes for a placed tenant; a later re-placement keeps the count."""
        import ray

        if isinstance(instances, bool) or not isinstance(instances, int) or instances < 0:
            raise InvalidArgument(f"instances must be an int >= 0; got {instances!r}")
        with self._placing:
            with self._lock:
                t = self.tenants.get(tenant_id)
                if t is None:
                    raise UnknownTenant(tenant_id)
                node = self.nodes[t.node_id]
                if not node.alive or t.state != "running":
                    raise NodeLost(tenant_id, node_id=t.node_id, reason=t.reason or "its node is lost")
            try:
                result: TenantRecord = ray.get(node.actor.scale.remote(tenant_id, instances), timeout=CALL_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - hand the typed error back to the caller
                raise unwrap_ray_error(exc) from None
            with self._lock:
                t.spec["instances"] = instances
        log_event(_log, logging.INFO, "cluster.tenant_scaled", tenant=tenant_id, instances=instances)
        return {"tenant_id": tenant_id, "node_id": t.node_id, "instances": instances,
                "state": result.state, "pids": list(result.pids)}

    # ----------------------------------------------------------- status

    def status(self, live: bool = True) -> ClusterStatus:
        """``{"cluster", "nodes": [...], "tenants": [...]}``; ``live`` adds each node supervisor's own view."""
        import ray

        node_status: dict[str, StatusRecord] = {}
        if live:
            with self._lock:
                refs = {nid: n.actor.status.remote() for nid, n in self.nodes.items() if n.alive}
            ready = ray.wait(list(refs.values()), num_returns=len(refs), timeout=10.0)[0] if refs else []
            for nid, ref in refs.items():
                if ref in ready:
                    try:
                        node_status[nid] = ray.get(ref)
                    except Exception:  # noqa: BLE001 - a node dying right now: the monitor will see it
                        pass
        with self._lock:
            nodes: list[NodeRow] = []
            for nid, n in sorted(self.nodes.items()):
                mine = sorted(tid for tid, t in self.tenants.items() if t.node_id == nid and t.state == "running")
                committed = sum(self.tenants[tid].gpu_cap for tid in mine)
                nodes.append({
                    "node_id": nid, "alive": n.alive, "lost_reason": n.lost_reason,
                    "endpoint": n.info["endpoint"], "server_public_key": n.info["server_public_key"],
                    "supervisor_pid": n.info["pid"], "gpu_ids": n.info["gpu_ids"],
                    "cuda_visible_devices": n.info["cuda_visible_devices"], "backend": n.info["backend"],
                    "niceness": n.info.get("niceness"),
                    "capacity_bytes": n.info["capacity_bytes"], "committed_bytes": committed,
                    "run_dir": n.info.get("run_dir"),
                    "free_bytes": n.info["capacity_bytes"] - committed, "tenants": mine,
                })
            tenants: list[TenantRow] = []
            for tid, t in sorted(self.tenants.items()):
                node_rec = node_status.get(t.node_id)
                live_rec = node_rec.tenant(tid) if node_rec is not None and t.state == "running" else None
                tenants.append({
                    "tenant_id": tid, "node_id": t.node_id, "endpoint": self.nodes[t.node_id].info["endpoint"],
                    "state": live_rec.state if live_rec else t.state, "placement": t.state,
                    "epoch": t.epoch, "reason": t.reason, "restart": t.spec.get("restart", "always"),
                    "gpu_memory_bytes_cap": t.spec.get("gpu_memory_bytes_cap"), "moves": list(t.history),
                    "instances": t.spec.get("instances", 1),
                    "pids": list(live_rec.pids) if live_rec else [],
                })
        return {"cluster": self.name, "address": self.address, "nodes": nodes, "tenants": tenants}

    def shutdown(self) -> dict[str, dict[str, object]]:
        """Stop the monitor and every node's supervisor (gracefully), then end the node actors."""
        import ray

        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(self.ping_timeout_s + 5.0)
        with self._lock:
            nodes = dict(self.nodes)
        refs = {nid: n.actor.stop.remote() for nid, n in nodes.items() if n.alive}
        codes: dict[str, object] = {}
        for nid, ref in refs.items():
            try:
                codes[nid] = ray.get(ref, timeout=60.0)
            except Exception as exc:  # noqa: BLE001 - stop the others anyway
                codes[nid] = f"error: {unwrap_ray_error(exc)}"
        for n in nodes.values():
            ray.kill(n.actor)
        with self._lock:
            self.tenants.clear()
        return {"stopped": codes}

    def ping(self) -> str:
        return self.name
