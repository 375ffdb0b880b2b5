"""NodeSupervisor: the Ray actor that runs one supervisor on one GPU node.

    Directory ──ray──► NodeSupervisor actor (num_gpus = the node's GPUs, pinned by node affinity)
                         │ CUDA_VISIBLE_DEVICES as Ray set it
                         └─► python -m supervisor supervise --listen tcp://<node address>:0
                               (started through _die_with_parent: SIGTERM when the actor dies,
                                so its workers stop and its segments are unlinked)
                             admin ops: over the supervisor's local ipc socket, with admin.cap
    clients ──CURVE TCP──► that supervisor directly (Ray is not on the data path)

The class is plain Python; the directory wraps it with ``ray.remote`` when it
deploys, so importing this module never needs Ray. Ray runs the methods of
this (non-threaded) actor one at a time on one thread, which is also the
thread that started the supervisor: a parent-death signal is tied to the
thread that forked, so the supervisor must not be started from a thread that
ends.

An actor whose supervisor exited ends itself (:meth:`ping`), so for the
cluster "the actor died" is the one signal that a node's supervisor is gone.

Typing: Ray is untyped here (mypy follows no ray import); what the directory records of a node
is a :class:`NodeInfo`. The one ``Any`` left is the run dir's ready record (JSON as the
supervisor wrote it, :func:`supervisor.store.rundir.read_ready`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TypedDict

from shared.capability import RegistryAdminCapability
from shared.errors import SupervisorUnavailable
from shared.log import get_logger, log_event
from shared.records import EvictResult, StatusRecord, TenantRecord
from shared.spec import TenantSpec
from supervisor.client.api import SupervisorClient
from shared.rundir import LOCK_FILE, read_admin_capability, read_ready, temp_parent

__all__ = ["NodeInfo", "NodeSupervisor"]


class NodeInfo(TypedDict):
    """What the directory records of a node (:meth:`NodeSupervisor.describe`)."""

    node_id: str
    endpoint: str  # the supervisor's TCP frontend as bound
    server_public_key: str  # its CURVE public key (Z85)
    pid: int
    gpu_ids: list[str]
    cuda_visible_devices: str
    capacity_bytes: int
    niceness: int | None  # the supervisor's (None: unreadable); higher than the raylet's: starved on a busy node
    backend: str | None
    run_dir: str


_log = get_logger("supervisor.cluster.node")

#: what the directory and node actors are started with: Ray's raylet runs a worker at niceness 15
#: (``worker_niceness``) unless its runtime env says otherwise (as Ray's own job supervisor
#: actors do). These actors are no batch work: they answer registrations, status and the
#: directory's health pings, and at niceness 15 a busy node starved them (pings late: the node
#: fenced as lost) and the supervisor and tenants' workers they start, which inherit it
ACTOR_RUNTIME_ENV: dict[str, Any] = {"env_vars": {"RAY_worker_niceness": "0"}}

READY_TIMEOUT_S = 60.0
RUN_DIR_PREFIX = "twt-ray-"
STALE_AFTER_S = 60.0
STOP_TIMEOUT_S = 20.0
#: environment variables of the actor that the node supervisor (and so its tenants' workers) must not inherit
_RAY_SECRETS = frozenset({"RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_REDIS_PASSWORD"})


def _remove_stale_run_dirs() -> None:
    """Remove run dirs of node supervisors that died without cleaning up (killed with their node).

    A run dir is stale when no process holds its ``supervisor.lock`` (an
    ``flock`` ends with its process, even on SIGKILL) - the same test the
    supervisor itself uses for a second start on one run dir.
    """
    for path in Path(temp_parent()).glob(RUN_DIR_PREFIX + "*"):
        lock = path / LOCK_FILE
        try:
            st = path.stat()
            if st.st_uid != os.getuid() or time.time() - st.st_mtime < STALE_AFTER_S:
                continue  # not ours, or young: a supervisor may be starting there right now
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue  # no lock file: starting right now, or not ours
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: a live supervisor
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)


def _niceness_of(pid: int) -> int | None:
    try:
        return os.getpriority(os.PRIO_PROCESS, pid)
    except OSError:
        return None


class NodeSupervisor:
    """One supervisor on this node (see the module docstring)."""

    def __init__(self, config_doc: dict[str, object], listen_host: str | None = None) -> None:
        import ray

        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        self.cuda_visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        host = listen_host or ray.util.get_node_ip_address()
        _remove_stale_run_dirs()
        self.run_dir = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX, dir=temp_parent())
        table, tenants = config_doc.get("supervisor"), config_doc.get("tenant")
        sup: dict[str, object] = dict(table) if isinstance(table, dict) else {}
        doc = {"supervisor": sup, "tenant": list(tenants) if isinstance(tenants, list) else []}
        for key in ("run_dir", "state_dir", "listen"):
            sup.pop(key, None)
        # the devices Ray gave this actor are 0..n-1 under its CUDA_VISIBLE_DEVICES
        sup.setdefault("devices", list(range(max(1, len(self.gpu_ids)))))
        config_path = os.path.join(self.run_dir, "cluster-node.json")
        with open(os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as f:
            json.dump(doc, f)
        root = str(Path(__file__).resolve().parents[2])
        # Ray's credentials stay with Ray: the supervisor and the tenants' workers never see them
        env = {k: v for k, v in os.environ.items() if k not in _RAY_SECRETS}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        cmd = [
            sys.executable, "-m", "supervisor.cluster._die_with_parent", str(os.getpid()),
            sys.executable, "-m", "supervisor", "supervise", "--run-dir", self.run_dir,
            "--config", config_path, "--listen", f"tcp://{host}:0",
        ]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        try:
            self.info = self._wait_ready()
            self.client = SupervisorClient(self.run_dir)
            self.admin = RegistryAdminCapability.from_bytes(read_admin_capability(self.run_dir))
            status = self.client.status(self.admin)
        except BaseException:
            self._stop_process()
            raise
        self.capacity_bytes = sum(d.budget_limit_bytes for d in status.devices)
        # the supervisor inherits this actor's niceness (ACTOR_RUNTIME_ENV): above the raylet's, a Ray
        # that ignored the runtime env's RAY_worker_niceness - say so where an operator looks
        self.niceness = _niceness_of(self.proc.pid)
        raylet = _niceness_of(os.getppid())
        if self.niceness is not None and raylet is not None and self.niceness > raylet:
            log_event(_log, logging.WARNING, "cluster.node_niceness", node=self.node_id, niceness=self.niceness,
                      raylet=raylet, fix="start Ray with RAY_worker_niceness=0 (docs/CLUSTER.md)")

    def _wait_ready(self) -> dict[str, Any]:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            info = read_ready(self.run_dir)
            if info is not None and info.get("pid") == self.proc.pid:
                return info
            if self.proc.poll() is not None:
                raise SupervisorUnavailable(self.run_dir, f"supervisor exited with code {self.proc.returncode} at start")
            if time.monotonic() > deadline:
                raise SupervisorUnavailable(self.run_dir, f"supervisor not ready within {READY_TIMEOUT_S:g} s")
            time.sleep(0.02)

    def describe(self) -> NodeInfo:
        """What the directory records of this node."""
        return {
            "node_id": self.node_id,
            "endpoint": self.info["listen"][0],
            "server_public_key": self.info["server_public_key"],
            "pid": self.proc.pid,
            "gpu_ids": self.gpu_ids,
            "cuda_visible_devices": self.cuda_visible_devices,
            "capacity_bytes": self.capacity_bytes,
            "niceness": self.niceness,
            "backend": self.info.get("backend"),
            "run_dir": self.run_dir,
        }

    def ping(self) -> int:
        """The supervisor's pid; an actor whose supervisor exited ends itself (seen as node loss)."""
        if self.proc.poll() is not None:
            import ray

            ray.actor.exit_actor()
        return self.proc.pid

    def register(self, spec: dict[str, object]) -> bytes:
        """Register on this node's supervisor; the tenant capability bytes."""
        return self.client.register(self.admin, TenantSpec.from_dict(spec)).to_bytes()

    def evict(self, tenant_id: str) -> EvictResult:
        return self.client.evict(self.admin, tenant_id)

    def scale(self, tenant_id: str, instances: int) -> TenantRecord:
        """Run ``instances`` worker processes for the tenant on this node (its status record)."""
        return self.client.scale(self.admin, tenant_id, instances)

    def status(self) -> StatusRecord:
        return self.client.status(self.admin)

    def stop(self) -> int | None:
        """Stop the supervisor gracefully (its workers stop, its segments are unlinked)."""
        self.client.close()
        code = self._stop_process()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return code

    def _stop_process(self) -> int | None:
        """SIGTERM (the supervisor drains its in-flight requests), a second SIGTERM after
        STOP_TIMEOUT_S (the drain ends: workers stopped, segments unlinked), SIGKILL after as long again."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
        return self.proc.returncode
