"""The one factory of the supervisor's parts: built bottom-up, each handed what it calls.

:func:`build_parts` is a sequence of constructors in dependency order; no
part is attached to another or handed a callback after it is built. What
flows back up - a worker ready, a tenant failed or evicted, the registry key
rotated - goes through the :class:`~supervisor.lifecycle.signals.TenantSignals`
built first, to which the parts above subscribe in their own constructors::

    signals ─ placement ─ sockets ─ replies ─ pending ─ workers (WorkerSet) ─ parking
       ─ dispatcher (routing) ─ records ─ admin (AdminOps) ─ service (ServiceOps) ─ frontend

    Frontend ─► AdminOps/ServiceOps (the op handlers) ─► Dispatcher ─► WorkerSet ─► PendingTable ─► Replies
    WorkerSet ─► TenantSignals ─► Parking · AdminOps · ServiceOps · Frontend · the Supervisor

The :class:`~supervisor.supervisor.Supervisor` opens the state and the
registry (it closes them), calls this, then restores the tenants and turns
the loop; the in-process tests reach it through the supervisor, with a fake
clock and workers that live on the loop.

Owns: nothing after it returns; on a failure half-way it destroys the ZMQ
context and unlinks the device budgets it made, newest first (the
supervisor's teardown has no :class:`Parts` to undo then).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass

import zmq

from shared import protocol as proto
from shared.capability import RegistryAdminCapability, capability_from_bytes
from shared.config import SupervisorConfig
from shared.device_cpus import resolve, set_threads_affinity
from shared.errors import TenantIsolationViolation
from shared.gpu_time import LIMIT_TENANT_SLOTS, LIMIT_WORKER_SLOTS
from shared.log import get_logger, log_event
from shared.quota import QuotaSnapshot, cleanup_stale_segments
from supervisor.admission.connections import FrontendConnections
from supervisor.admission.fd_guard import IPC_BACKLOG
from supervisor.admission.curve import CurveKeyPair, load_or_create_server_keys, load_server_key_file
from supervisor.host.fdlimit import raise_fd_limit
from supervisor.admission.frontend import Frontend, Handlers, Holdings, Routes, Sockets, small_frame_bytes
from supervisor.admission.guard import FrontendGuard
from supervisor.admission.tcp_frontend import IPC_INDEX, LOCAL_IO_AFFINITY, SMALL_INDEX, TCP_INDEX, TcpFrontend
from supervisor.control import ops as admin_ops
from supervisor.control.admin import AdminOps
from supervisor.control.records import Records
from supervisor.control.service import ServiceOps
from supervisor.lifecycle.backend_select import BackendChoice, select_backend
from supervisor.lifecycle.module_artifacts import ARTIFACT_MESSAGE_BYTES, ModuleArtifacts
from supervisor.lifecycle.parking import Parking
from supervisor.lifecycle.signals import TenantSignals
from supervisor.lifecycle.workerset import WorkerSet
from supervisor.observe.event_log import EventLog
from supervisor.observe.events import EventBus
from supervisor.observe.metrics import Metrics, TenantLabels, tenant_label_key
from supervisor.routing.dispatcher import Dispatcher
from supervisor.routing.pending import PendingTable
from supervisor.routing.placement import Placement
from supervisor.routing.regions import RegionTable
from supervisor.routing.replies import Replies
from supervisor.runtime.loop import Loop
from supervisor.runtime.tenants import TenantRuntime
from supervisor.runtime.workers import SpawnerFactory
from supervisor.store.audit import DeniedAudit
from supervisor.store.modules import ModuleStore
from supervisor.store.registry import TenantRegistry
from supervisor.store.parked_bytes import remove_stale as remove_stale_parked
from supervisor.store.rundir import RunDir
from supervisor.store.state import StateStore, StoredTenant

__all__ = ["FRONTEND_RCVHWM", "Parts", "Surroundings", "build_parts"]

_log = get_logger("supervisor")

#: messages libzmq may queue from one client before the loop reads them
FRONTEND_RCVHWM = 1000
#: the same on ``frontend.ipc``, which takes frames of any size (bulk bodies): while it is not read
#: (a hold, or its tenant past its rate: supervisor.admission.frontend), at most this many wait here -
#: in the supervisor's memory (16 of 16 MiB bodies grew it 224 MiB: tests/reliability/test_held_bytes.py)
BULK_RCVHWM = 4
#: messages a ROUTER socket queues per peer, each way
SOCKET_HWM = 10_000


@dataclass(frozen=True)
class Surroundings:
    """What the supervisor hands the factory: the things it owns and keeps across the parts'
    life (loop, run dir, state, registry, tenants table, event log, stores) and the few things
    only it knows (whether it is stopping, its internal-error count, when it becomes ready)."""

    config: SupervisorConfig
    loop: Loop
    rundir: RunDir
    state: StateStore
    registry: TenantRegistry
    admin_cap: RegistryAdminCapability
    tenants: dict[str, TenantRuntime]
    metrics: Metrics
    event_log: EventLog
    modules: ModuleStore
    spawner: SpawnerFactory
    #: the tenants in the state at start (read once: the placement is sized for them, then restored)
    stored: list[StoredTenant]
    #: the supervisor is stopping (no worker is restarted, nothing activated)
    stopping: Callable[[], bool]
    #: bugs the loop's safety net caught (shown in status)
    internal_errors: Callable[[], int]
    #: every registration waiting for its instances was answered (the supervisor may be ready)
    on_settled: Callable[[], None]
    #: the registry key was rotated (the supervisor rewrites the admin capability and ready files)
    on_key_rotated: Callable[[RegistryAdminCapability], None]
    #: the backend chosen before the state was opened (None: chosen here). The probe forks the
    #: supervisor only while it has one thread, and the state store starts its sync thread
    backend: BackendChoice | None = None


@dataclass
class Parts:
    """Everything :func:`build_parts` builds."""

    zctx: zmq.Context[zmq.Socket[bytes]]
    events: EventBus
    signals: TenantSignals
    placement: Placement
    regions: RegionTable
    replies: Replies
    pending: PendingTable
    workers: WorkerSet
    parking: Parking
    dispatcher: Dispatcher
    records: Records
    admin: AdminOps
    service: ServiceOps
    frontend: Frontend
    audit: DeniedAudit
    tcp: TcpFrontend | None = None


def build_parts(s: Surroundings) -> Parts:
    """Build every part, bottom-up (see the module docstring). Binds the sockets and writes the
    admin capability file; restores nothing (the supervisor does, once it holds the parts)."""
    cfg = s.config
    raise_fd_limit()  # fds are a resource like any other: never an abort (supervisor.host.fdlimit)
    labels = TenantLabels(cfg.metrics_tenant_names, tenant_label_key(s.state))  # stable across restarts
    s.metrics.use_tenant_labels(labels)
    # never another run dir's; with the run dir locked (Supervisor.start) and nothing created yet, a
    # segment of this namespace that was never finished is a killed predecessor's too
    removed = cleanup_stale_segments(namespace=s.rundir.segment_namespace, run_dir_locked=s.rundir.locked)
    if removed:
        log_event(_log, logging.INFO, "supervisor.stale_segments_removed", count=len(removed))
    stale_parked = remove_stale_parked(s.rundir.path)  # a killed supervisor's host copies: never restored
    if stale_parked:
        log_event(_log, logging.INFO, "supervisor.stale_parked_files_removed", count=stale_parked)
    choice = _stub_device_cpus(cfg, s.backend or select_backend(cfg))
    with ExitStack() as undo:  # a failure half-way undoes what was made, newest first
        placement = _placement(s, choice)
        undo.callback(placement.close)  # unlink the device budget segments
        log_event(_log, logging.INFO, "supervisor.backend", backend=choice.name, reason=choice.reason,
                  devices=placement.indexes)
        keys = _server_keys(cfg, s.state) if cfg.listen else None  # a malformed key stops the start here
        # With a TCP frontend, two I/O threads: CURVE's crypto for TCP clients runs on its own
        # (TCP_IO_AFFINITY), so that a flood over TCP does not queue the local clients' and the
        # workers' messages behind it in one I/O thread (a tcp-ping flood's local victim)
        z: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=2 if keys is not None else 1)
        undo.callback(z.destroy, linger=0)
        parts = _build(s, z, keys, placement, labels, choice)
        undo.pop_all()  # built: the supervisor's teardown owns them now
        return parts


def _build(s: Surroundings, z: zmq.Context[zmq.Socket[bytes]], keys: CurveKeyPair | None, placement: Placement,
           labels: TenantLabels, choice: BackendChoice) -> Parts:
    cfg, loop, tenants = s.config, s.loop, s.tenants
    signals = TenantSignals(stopping=s.stopping, key_rotated=(s.on_key_rotated,))

    # sockets. libzmq queues a client's *incoming* messages up to RCVHWM before the loop reads
    # them: keep that small, so a flood waits in its sender, not in our memory (set before bind:
    # a listener copies the options its connections get).
    frontend_sock = _router(z, s.rundir, keys, "frontend", cfg.max_message_bytes, BULK_RCVHWM,
                            watch=lambda sock: sock.setsockopt(zmq.BACKLOG, IPC_BACKLOG))  # before bind
    # one fd budget for every frontend connection, ipc and TCP (supervisor.admission.connections)
    connections = FrontendConnections(frontend_sock, s.rundir.file("frontend.ipc"),
                                      max_tcp_peers=cfg.max_tcp_peers,
                                      max_tcp_peers_per_source=cfg.max_tcp_peers_per_source,
                                      memory_bytes=cfg.frontend_memory_bytes or 0)
    loop.register(connections.monitor, connections.on_readable)
    # the small-frame socket: libzmq drops a peer whose frame exceeds it before copying the frame
    small_sock = _router(z, s.rundir, keys, "small", small_frame_bytes(cfg), FRONTEND_RCVHWM,
                         watch=lambda sock: connections.watch_small(sock, s.rundir.file("small.ipc")))
    assert connections.small_monitor is not None
    loop.register(connections.small_monitor, connections.on_small_readable)
    tcp = None
    if keys is not None:
        tcp = TcpFrontend(z, cfg, keys, SOCKET_HWM, connections, rcvhwm=FRONTEND_RCVHWM)  # OSError: not bound
        assert connections.tcp_monitor is not None
        loop.register(connections.tcp_monitor, connections.on_tcp_readable)
    backend_sock = _router(z, s.rundir, keys, "backend", cfg.max_message_bytes)
    control_sock = _router(z, s.rundir, keys, "control", 1 << 20)
    events = EventBus(_publisher(z, s.rundir, keys), s.event_log)
    s.rundir.secure_sockets()
    s.rundir.write_admin_capability(s.admin_cap.to_bytes())
    # Tracked frames (big reply bodies, see Replies.ok) need pyzmq's garbage-collector
    # thread and context; start it now so the process's fds are stable from the start.
    zmq.Frame(bytes(1 << 17), track=True)  # large enough for pyzmq's zero-copy (tracked) path

    # the parts, bottom-up
    spawner = s.spawner(cfg, {"backend": s.rundir.endpoint("backend"), "control": s.rundir.endpoint("control")})
    spawner.warm_up()
    guard = FrontendGuard(cfg, connections)
    regions = RegionTable(s.registry.segment_prefix)
    replies = Replies({IPC_INDEX: frontend_sock, SMALL_INDEX: small_sock}
                      | ({TCP_INDEX: tcp.socket} if tcp is not None else {}), guard.held)
    pending = PendingTable(replies, s.metrics, tenants, loop.clock)
    s.metrics.backend_info(choice.name, choice.device_labels(), choice.driver_version, choice.cuda_version)
    workers = WorkerSet(
        cfg, loop=loop, pending=pending, tenants=tenants, spawner=spawner, backend=backend_sock,
        control=control_sock, placement=placement, backend_name=choice.name,
        backend_options=choice.options, events=events, metrics=s.metrics, hooks=signals,
    )
    parking = Parking(tenants=tenants, workers=workers, events=events, signals=signals, clock=loop.clock,
                      persist=_parked_flag_writer(s.state), stopping=s.stopping, max_active=cfg.max_active,
                      device_bounds=placement.context_bounds(),
                      artifacts=ModuleArtifacts(s.modules, min(ARTIFACT_MESSAGE_BYTES, cfg.max_message_bytes // 2)),
                      run_dir=s.rundir.path, park_ahead=cfg.park_ahead)
    dispatcher = Dispatcher(cfg, clock=loop.clock, pending=pending, sender=workers, held=guard.held,
                            regions=regions, tenants=tenants, wake=parking.wake)
    records = Records(cfg, loop=loop, tenants=tenants, registry=s.registry, placement=placement, workers=workers,
                      regions=regions, guard=guard, rundir=s.rundir, backend_name=choice.name,
                      backend_reason=choice.reason, counters=s.internal_errors, tenant_label=labels,
                      backend_versions=(choice.driver_version, choice.cuda_version))
    admin = AdminOps(cfg, loop=loop, tenants=tenants, registry=s.registry, admin_cap=s.admin_cap, state=s.state,
                     placement=placement, workers=workers, dispatcher=dispatcher, regions=regions, signals=signals,
                     events=events, records=records, on_settled=s.on_settled)
    service = ServiceOps(cfg, admin=admin, workers=workers, registry=s.registry, state=s.state,
                         placement=placement, signals=signals, events=events)
    audit = DeniedAudit(events.emit)
    registry = s.registry

    def on_denied(cap_raw: bytes | None, op: str) -> None:
        audit.record(registry.explain_refusal(cap_raw, admin=_admin_refusal(op, cap_raw)), op)

    frontend = Frontend(
        cfg, loop=loop, sockets=Sockets(frontend_sock, tcp.socket if tcp is not None else None, small_sock), guard=guard,
        routes=Routes(pending, replies, dispatcher, regions),
        holdings=Holdings(registry, tenants, workers.workers, s.admin_cap.to_bytes(), s.event_log, s.modules),
        # one handler per op the supervisor serves itself (each op's class, supervisor.control.ops)
        handlers=Handlers(admin_ops.handlers(admin, service, pending), admin_ops.local_handlers(),
                          admin_ops.either_handlers()),
        signals=signals, on_denied=on_denied,
    )
    return Parts(z, events, signals, placement, regions, replies, pending, workers, parking, dispatcher, records,
                 admin, service, frontend, audit, tcp)


def _stub_device_cpus(cfg: SupervisorConfig, choice: BackendChoice) -> BackendChoice:
    """The stub's device as a core of its own (``stub_device_cpus``, shared.device_cpus): the bind
    options name each device's CPU, and this process keeps to the rest (it, its forkserver and the
    workers it starts inherit that; a worker's device thread moves onto its device's CPU). A setting
    that cannot apply here is logged and dropped: every thread then keeps every CPU."""
    if choice.name != "stub" or not cfg.stub_device_cpus:
        return choice
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux
        allowed = set()
    cpus, why = resolve(cfg.stub_device_cpus, [d.index for d in choice.devices], allowed)
    if not cpus:
        log_event(_log, logging.WARNING, "supervisor.stub_device_cpus_ignored", setting=str(cfg.stub_device_cpus),
                  reason=why or "this host gives no affinity set")
        return choice
    rest = allowed - set(cpus.values())
    for tid, exc in set_threads_affinity(rest):
        log_event(_log, logging.WARNING, "supervisor.affinity_refused", thread=tid, error=repr(exc))
    log_event(_log, logging.INFO, "supervisor.stub_device_cpus", devices={str(d): c for d, c in cpus.items()},
              rest=sorted(rest))
    return dataclasses.replace(choice, options={**choice.options,
                                                "device_cpus": [[d, c] for d, c in sorted(cpus.items())]})


def _placement(s: Surroundings, choice: BackendChoice) -> Placement:
    """The devices' placement. Each device's GPU-time board holds every tenant the config allows,
    with room for the slots of evicted tenants whose workers are still stopping (and every stored
    tenant, should a restart have lowered the limits: restoring is never refused)."""
    cfg, stored = s.config, s.stored
    tenant_slots = 2 * max(cfg.max_tenants, len(stored) + len(cfg.tenants))
    worker_slots = 2 * max(cfg.max_workers, sum(r.spec.instances for r in stored)
                           + sum(t.instances for t in cfg.tenants))
    return Placement.create(
        choice.name,
        choice.devices,
        reserve_bytes=cfg.device_reserve_bytes,
        policy=cfg.placement,
        segment_prefix=s.registry.segment_prefix,
        no_mps_dir=os.path.join(s.rundir.path, "no-mps"),
        gpu_time_quantum_s=cfg.gpu_time_quantum_s,
        gpu_time_scheduler=cfg.gpu_time_scheduler,
        gpu_time_tenants=min(tenant_slots, LIMIT_TENANT_SLOTS),
        gpu_time_workers=min(worker_slots, LIMIT_WORKER_SLOTS),
        guest_nice=cfg.worker_guest_nice,
    )


def _router(z: zmq.Context[zmq.Socket[bytes]], rundir: RunDir, keys: CurveKeyPair | None, name: str, max_msg: int,
            rcvhwm: int = SOCKET_HWM, watch: Callable[[zmq.Socket[bytes]], object] | None = None) -> zmq.Socket[bytes]:
    """A ROUTER bound in the run dir: never blocks, never silently drops a send to a gone peer.
    ``watch``: called with it before it binds (its connections' monitor)."""
    sock: zmq.Socket[bytes] = z.socket(zmq.ROUTER)
    if keys is not None:
        sock.setsockopt(zmq.AFFINITY, LOCAL_IO_AFFINITY)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg)
    sock.setsockopt(zmq.SNDHWM, SOCKET_HWM)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    if watch is not None:
        watch(sock)
    sock.bind(rundir.endpoint(name))
    return sock


def _publisher(z: zmq.Context[zmq.Socket[bytes]], rundir: RunDir, keys: CurveKeyPair | None) -> zmq.Socket[bytes]:
    """The events PUB socket."""
    pub: zmq.Socket[bytes] = z.socket(zmq.PUB)
    if keys is not None:
        pub.setsockopt(zmq.AFFINITY, LOCAL_IO_AFFINITY)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, SOCKET_HWM)
    pub.bind(rundir.endpoint("events"))
    return pub


def _admin_refusal(op: str, cap_raw: bytes | None) -> bool:
    """Whether a refused capability was offered as the admin one: the op's, or for an op either
    capability grants (``events``) the kind the token claims (the audit's ``wrong_kind`` check)."""
    spec = proto.OPS[op]
    if not spec.any_capability or cap_raw is None:
        return spec.admin
    try:
        return isinstance(capability_from_bytes(cap_raw), RegistryAdminCapability)
    except TenantIsolationViolation:
        return False


def _server_keys(cfg: SupervisorConfig, state: StateStore) -> CurveKeyPair:
    """The TCP frontend's key pair: the operator's file, or made once and kept in the state database."""
    if cfg.server_key_file:
        return load_server_key_file(cfg.server_key_file)
    return load_or_create_server_keys(state)


def _parked_flag_writer(state: StateStore) -> Callable[[str, bool, QuotaSnapshot | None], None]:
    """Parking's ``persist``: the parked flag (and a parked tenant's quota counters, in the same
    transaction) written on the state's writer thread (never on the loop: an activation does not
    wait for an fsync); a failed write is logged - a restart then brings the tenant back in the
    state written last."""
    def persist(tenant: str, parked: bool, quota: QuotaSnapshot | None) -> None:
        def done(future: Future[None]) -> None:
            exc = future.exception()
            if exc is not None:
                log_event(_log, logging.ERROR, "state.write_failed", tenant=tenant, error=str(exc))

        state.submit(state.set_parked, tenant, parked, quota).add_done_callback(done)

    return persist
