"""The cluster on a local multi-node Ray cluster: placement, direct calls, node loss, shutdown.

One Ray cluster (a head without GPUs or CPUs and three nodes with ``num_gpus=1``,
one CPU each, no dashboard, small object stores) and one deployment serve
the whole module, in order: Ray's start-up is the expensive part. Every Ray
address is loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes Ray use
127.0.0.1 for its own traffic), and the supervisors listen on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from shared.errors import (
    BackendUnavailable,
    InvalidArgument,
    NodeLost,
    SegmentError,
    TenantIsolationViolation,
    WorkerLost,
)
from shared.quota import read_header
from shared.spec import TenantSpec
from supervisor.cluster import ClusterCapability, ClusterClient, RayCluster
from supervisor.client.api import SupervisorClient
from supervisor.cluster.ray_cluster import DEFAULT_NAME
from tests.helpers import hygiene
from tests.helpers.cluster import FAST as SUITE_FAST
from tests.helpers.cluster import wait_for
from tests.helpers.fault_signals import kept_fault_handlers
from tests.helpers.timeouts import scaled
from tests.helpers.tmp import short_temp_dir

pytestmark = [pytest.mark.longest, pytest.mark.slow, pytest.mark.timeout(300)]

MiB = 1 << 20
# Ray's token authentication on (Ray >= 2.52): every Ray RPC of the test cluster needs this token
_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
_NODE: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 80 * MiB, "node_ip_address": "127.0.0.1"}
#: the suite's FAST settings (a 2 s heartbeat window: with only 0.6 s, a loaded run once saw a node's
#: worker killed and restarted between a status and a ping) on a 1 GiB stub device per node
FAST = {**SUITE_FAST, "stub_device_capacity_bytes": "1GiB", "device_reserve_bytes": 0}


#: what Ray logs when it gives up on a node or an actor (gcs_server.out, raylet.out)
_RAY_DEATH = re.compile(r"\b(dead|died|health check|killing|sigkill|oom|out of memory)\b", re.IGNORECASE)


def _ray_death_lines(temp_dir: str, limit: int = 40) -> list[str]:
    """The last lines of Ray's own logs that speak of a death (for a failed test's report)."""
    found: list[str] = []
    for log in sorted(Path(temp_dir).glob("session_*/logs/*.out")):
        if log.name.startswith(("gcs_server", "raylet")):
            try:
                lines = log.read_text(errors="replace").splitlines()
            except OSError:
                continue
            found += [f"{log.name}: {line}" for line in lines
                      if _RAY_DEATH.search(line) and "[state-dump]" not in line and "Execution time" not in line]
    return found[-limit:]


@pytest.fixture(autouse=True)
def ray_deaths_in_the_report() -> Iterator[None]:
    """After each test, print what Ray logged about dead nodes and actors: pytest shows it only for
    a failed test (a node's actor died while registering in 2 of ~10 loaded runs, with no cause in
    the error - ``ActorDiedError`` - and the logs went with the run's temp root)."""
    yield
    temp_dir = _NODE.get("temp_dir")
    if isinstance(temp_dir, str):
        for line in _ray_death_lines(temp_dir):
            print(line)


@pytest.fixture(scope="module")
def ray_head() -> Iterator[Any]:
    """A Ray cluster of one head node without GPUs (nodes with GPUs join in ``ray_nodes``)."""
    # Everything Ray writes stays in one fresh directory of this run's temp root (short: Ray's unix
    # sockets live under it): its sessions and logs (``temp_dir``) and the address file that
    # ``Cluster`` writes to ``$RAY_TMPDIR/ray/ray_current_cluster`` without creating the directory
    # (on a machine where Ray never ran, no ``/tmp/ray`` exists: FileNotFoundError).
    root = tempfile.mkdtemp(prefix="rt-", dir=short_temp_dir())
    temp_dir = os.path.join(root, "ray")
    os.mkdir(temp_dir)
    # Ray waits 60 s for its dashboard process (started even without the dashboard: it serves
    # Ray's own API) and then drops it, still running: a host loaded far past its cores missed that
    # once (a hang guard, scaled like every other)
    env = {**_RAY_ENV, "RAY_TMPDIR": root, "RAY_DASHBOARD_STARTUP_TIMEOUT_S": str(int(scaled(60)))}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # before Ray is imported: its constants are read at import
    import ray
    from ray.cluster_utils import Cluster

    _NODE["temp_dir"] = temp_dir
    # The head runs no task: every actor of the cluster asks for no CPU, so with no CPU of its own
    # the head's raylet starts no idle Python worker for the driver (~0.9 s of CPU, unused). No log
    # monitor: the driver takes no worker output (log_to_driver=False), and it polled the session's
    # logs for the module's whole life; the death lines below are read from the files themselves.
    cluster = Cluster(initialize_head=True,
                      head_node_args={**_NODE, "num_cpus": 0, "num_gpus": 0, "include_dashboard": False,
                                      "include_log_monitor": False})
    try:
        # wasmtime's trap handlers first, as when a WASM test ran earlier in this xdist worker (the
        # order that crashed); then Ray's driver, which would take them over without kept_fault_handlers
        import wasmtime

        wasmtime.Engine()
        with kept_fault_handlers():
            ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
        yield cluster
    finally:
        with kept_fault_handlers():  # ray.shutdown() resets them to SIG_DFL: a later guest trap would kill us
            ray.shutdown()
            cluster.shutdown()
        _a_guest_trap_is_a_trap()  # in this process, after Ray: the next WASM test's condition
        shutil.rmtree(root, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_a_guest_trap_in_the_ray_driver_process_is_still_a_trap(ray_head: Any) -> None:
    """Ray's driver is up in this process and wasmtime's trap handlers still catch a guest's wild
    store and its ``unreachable`` (without the fixture's kept_fault_handlers, this process dies of
    SIGSEGV or SIGILL here; the fixture checks the same after ray.shutdown, which resets them)."""
    _a_guest_trap_is_a_trap()


def _a_guest_trap_is_a_trap() -> None:
    import wasmtime

    engine = wasmtime.Engine()
    store = wasmtime.Store(engine)
    wat = ('(module (memory 1) (func (export "wild") (i32.store (i32.const 0x7ffffff0) (i32.const 1)))'
           ' (func (export "unreachable") unreachable))')
    instance = wasmtime.Instance(store, wasmtime.Module(engine, wat), [])
    for export, trap in (("wild", "out of bounds"), ("unreachable", "unreachable")):
        f = instance.exports(store)[export]
        assert isinstance(f, wasmtime.Func)
        with pytest.raises(wasmtime.Trap, match=trap):
            f(store)


@pytest.fixture(scope="module")
def ray_nodes(ray_head: Any) -> tuple[Any, dict[str, Any]]:
    gpu_nodes = {}
    for _ in range(3):
        node = ray_head.add_node(num_gpus=1, **_NODE)
        gpu_nodes[node.node_id] = node
    ray_head.wait_for_nodes()
    return ray_head, gpu_nodes


@pytest.fixture(scope="module")
def deployed(ray_nodes: tuple[Any, dict[str, Any]]) -> Iterator[RayCluster]:
    # one config tenant (no GPU cap: it takes no budget, so the placement tests see three equal nodes)
    cluster = RayCluster.deploy({"supervisor": FAST, "tenant": [{"name": "fromfile"}]}, listen_host="127.0.0.1",
                                ping_interval_s=0.5, ping_timeout_s=5.0)
    try:
        yield cluster
    finally:
        try:
            cluster.shutdown()
        except Exception:  # noqa: BLE001 - shut down by the last test already
            pass


def _no_cluster(name: str) -> bool:
    try:
        RayCluster.connect(name=name)
    except InvalidArgument as exc:
        return "no cluster named" in str(exc)
    return False


def _spec(name: str, **kw: Any) -> TenantSpec:
    return TenantSpec.from_dict({"tenant_id": name, "gpu_memory_bytes_cap": 256 * MiB, **kw})


def _tenant(status: dict[str, Any], tid: str) -> dict[str, Any]:
    return next(t for t in status["tenants"] if t["tenant_id"] == tid)


def test_a_cluster_without_gpu_nodes_is_one_clear_error(ray_head: Any) -> None:
    with pytest.raises(BackendUnavailable, match="has no node with GPUs") as exc:
        RayCluster.deploy({"supervisor": FAST}, name="twt-no-gpu")
    assert "ray start --num-gpus" in str(exc.value)

    # the failed deployment's directory actor is killed (asynchronously)
    wait_for(lambda: _no_cluster("twt-no-gpu"), 20, what="the failed deployment's directory to be gone")


def test_deploy_starts_one_supervisor_per_gpu_node(deployed: RayCluster, ray_nodes: tuple[Any, dict[str, Any]]) -> None:
    status = deployed.status()
    nodes = status["nodes"]
    assert sorted(n["node_id"] for n in nodes) == sorted(ray_nodes[1])  # not on the GPU-less head
    assert all(n["alive"] and n["endpoint"].startswith("tcp://127.0.0.1:") for n in nodes)
    assert len({n["endpoint"] for n in nodes}) == 3 and len({n["server_public_key"] for n in nodes}) == 3
    for n in nodes:
        assert psutil.Process(n["supervisor_pid"]).name() == "twt-supervisor"
        # at the raylet's niceness (this process's: it started them), not at Ray's worker niceness (15):
        # with it, a supervisor beside busy processes took over 60 s to start
        assert n["niceness"] == psutil.Process(n["supervisor_pid"]).nice() == psutil.Process().nice()
        assert n["cuda_visible_devices"] != ""  # the GPU Ray gave the actor
        assert n["capacity_bytes"] == 1 << 30
    with pytest.raises(InvalidArgument, match="deployed already"):
        RayCluster.deploy({"supervisor": FAST})


def test_tenants_spread_over_nodes_and_calls_go_straight_to_them(deployed: RayCluster) -> None:
    caps = [deployed.register(_spec(f"spread{i}")) for i in range(3)]
    try:
        assert len({cc.node_id for cc in caps}) == 3  # most free budget: one per node
        text = caps[0].to_text()
        assert ClusterCapability.from_text(text) == caps[0]
        status = deployed.status()
        # a client without any Ray handle: the calls need none while nothing moved
        with ClusterClient(directory=None, timeout_s=20) as client:
            for cc in caps:
                pong = client.ping(cc.to_text())
                assert pong.tenant == cc.tenant_id
                assert pong.pid in _tenant(status, cc.tenant_id)["pids"]
            h = client.alloc(caps[0], 4096)
            client.write(caps[0], h, b"z" * 4096)
            assert client.read(caps[0], h, 4096) == b"z" * 4096
            assert client.quota(caps[0]).gpu_bytes_in_use == 4096
        # the named node wins over the budget
        pinned = deployed.register(_spec("pinned"), node=caps[1].node_id)
        caps.append(pinned)
        assert pinned.node_id == caps[1].node_id
        assert {t["tenant_id"]: t["node_id"] for t in deployed.status()["tenants"]}["pinned"] == caps[1].node_id
    finally:
        for cc in caps:
            deployed.evict(cc.tenant_id)


def _remove_segments_of_dead_owner(pid: int) -> None:
    """What the next supervisor's start does on a host (``cleanup_stale_segments``), for ``pid``'s only."""
    wait_for(lambda: not psutil.pid_exists(pid), 30, what=f"supervisor {pid} to be gone")
    for name in hygiene.twt_segments():
        try:
            header = read_header(name)
        except SegmentError:
            continue
        if header.owner_pid == pid and not header.owner_alive():
            try:
                os.unlink(os.path.join(hygiene.SHM_DIR, name))
            except FileNotFoundError:
                pass


def test_node_loss_replaces_tenants_and_old_capabilities_follow(
    deployed: RayCluster, ray_nodes: tuple[Any, dict[str, Any]]
) -> None:
    cluster, gpu_nodes = ray_nodes
    victim = sorted(gpu_nodes)[0]
    before = {n["node_id"]: n for n in deployed.status()["nodes"]}
    sup_pid = before[victim]["supervisor_pid"]
    removed = False
    try:  # from the first registration: a failure anywhere still cleans up after the victim (finally)
        mover = deployed.register(_spec("mover"), node=victim)
        stays = deployed.register(_spec("stays", restart="never"), node=victim)
        worker_pids = [p for t in deployed.status()["tenants"] for p in t["pids"] if t["node_id"] == victim]
        with deployed.client(timeout_s=20, connect_timeout_s=2.0) as client:
            assert client.ping(mover).tenant == "mover"
            cluster.remove_node(gpu_nodes.pop(victim))
            removed = True
            # Ray sees the actor die; the supervisor (SIGTERM from its parent's death) and workers go too
            wait_for(lambda: not psutil.pid_exists(sup_pid), 30, what="the lost node's supervisor to exit")
            wait_for(lambda: not any(psutil.pid_exists(p) for p in worker_pids), 30, what="its workers to exit")
            moved = wait_for(lambda: _tenant(deployed.status(), "mover")["placement"] == "running"
                             and _tenant(deployed.status(), "mover")["node_id"] != victim, 60,
                             what="mover to be re-placed")
            assert moved
            st = deployed.status()
            assert _tenant(st, "stays")["placement"] == "lost"
            assert not {n["node_id"]: n for n in st["nodes"]}[victim]["alive"]

            # the capability from before the loss reaches the tenant at its new place by itself
            def reached() -> dict[str, Any] | None:
                try:
                    return client.ping(mover)
                except NodeLost as exc:  # the one call that may have been served by the lost node
                    assert exc.is_retryable() and isinstance(exc, WorkerLost)
                    return None

            pong = wait_for(reached, 30, what="a ping at mover's new place")
            assert pong.tenant == "mover"
            assert client.current(mover).epoch == 1 and client.current(mover).node_id != victim
            with pytest.raises(NodeLost) as lost:
                client.ping(stays)
            assert lost.value.tenant_id == "stays" and lost.value.node_id == victim
    finally:
        for tid in ("mover", "stays"):
            try:
                deployed.evict(tid)
            except Exception:  # noqa: BLE001 - a tenant the test did not get to register
                pass
        # a killed node's supervisor cannot clean its run dir nor its segments: on a real host the next
        # supervisor started there does (a later deploy removes stale run dirs; every supervisor's start
        # removes the segments of dead owners). This test's nodes share one host, so it does it here -
        # also when the victim's supervisor died before the node was removed (once, under load: its
        # actor died while registering, and its segments outlived the run)
        if removed or not psutil.pid_exists(sup_pid):
            shutil.rmtree(before[victim]["run_dir"], ignore_errors=True)
            _remove_segments_of_dead_owner(sup_pid)


def test_cli_cluster_status(deployed: RayCluster, ray_nodes: tuple[Any, dict[str, Any]]) -> None:
    root = str(Path(__file__).resolve().parents[3])
    out = subprocess.run([sys.executable, "-m", "supervisor", "cluster", "status", "--address", ray_nodes[0].address,
                          "--json"], capture_output=True, text=True, timeout=120, cwd=root,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-2000:]
    status = json.loads(out.stdout)
    assert {n["node_id"] for n in status["nodes"]} == {n["node_id"] for n in deployed.status()["nodes"]}


def test_config_tenants_are_placed_through_the_directory(deployed: RayCluster) -> None:
    """`cluster up --config` with [[tenant]] tables: each is placed once, through the directory (in status
    and in placement), never registered by every node supervisor behind its back."""
    cc = deployed.registered["fromfile"]
    st = deployed.status()
    rec = _tenant(st, "fromfile")  # (it may have moved, if the node-loss test took its node)
    assert rec["placement"] == "running" and len(rec["pids"]) == 1
    assert [n["node_id"] for n in st["nodes"] if "fromfile" in n["tenants"]] == [rec["node_id"]]
    # no node supervisor registered it on its own: only the placed node's supervisor has it
    for n in st["nodes"]:
        if n["alive"] and n["node_id"] != rec["node_id"]:
            with SupervisorClient.remote(n["endpoint"], n["server_public_key"], timeout_s=20) as rc:
                with pytest.raises(TenantIsolationViolation):
                    rc.ping(cc.tenant_capability())  # no tenant of that name there: refused
    with deployed.client(timeout_s=20) as client:
        assert client.ping(cc).tenant == "fromfile"


def test_cli_cluster_register_scale_evict_and_the_gpus_column(
    deployed: RayCluster, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from supervisor.cli import main

    cap_file = tmp_path / "cli.twtc"
    assert main(["cluster", "register", "clitenant", "--gpu-cap", "64MiB", "--cap-out", str(cap_file)]) == 0
    out = capsys.readouterr().out
    assert "clitenant: placed on node" in out and oct(cap_file.stat().st_mode & 0o777) == "0o600"
    cc = ClusterCapability.from_text(cap_file.read_text().strip())
    try:
        assert main(["cluster", "scale", "clitenant", "2"]) == 0
        assert "clitenant: 2 instance(s)" in capsys.readouterr().out
        rec = _tenant(deployed.status(), "clitenant")
        assert rec["instances"] == 2 and rec["gpu_memory_bytes_cap"] == 64 * MiB
        with deployed.client(timeout_s=20) as client:
            assert client.ping(cc).tenant == "clitenant"
        assert main(["cluster", "status"]) == 0
        text = capsys.readouterr().out
        assert "ray auth token" in text and "1 (id " in text  # GPUS: a count (and the ids), never an id alone
        assert "clitenant" in text
    finally:
        assert main(["cluster", "evict", "clitenant"]) == 0
    assert "evicted clitenant" in capsys.readouterr().out
    assert "clitenant" not in {t["tenant_id"] for t in deployed.status()["tenants"]}
    # flags of another action are refused before Ray is asked
    assert main(["cluster", "scale", "fromfile"]) == 2
    assert "needs TENANT and N" in capsys.readouterr().err


def test_ray_runs_with_token_authentication(deployed: RayCluster) -> None:
    from supervisor.cluster.ray_cluster import ray_auth_mode

    assert ray_auth_mode() == "token"
    assert deployed.status()["ray_auth"] == "token"


def test_nothing_of_the_cluster_listens_beyond_loopback(
    deployed: RayCluster, ray_nodes: tuple[Any, dict[str, Any]]
) -> None:
    """Ray (bound to the node address the operator names: 127.0.0.1 here) and the node supervisors
    (--listen-host 127.0.0.1) open no port on another address: an unauthenticated GCS on a reachable
    address is how Ray clusters were taken over (ShadowRay)."""
    temp_dir = str(_NODE["temp_dir"])
    ours = {os.getpid()}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(temp_dir in (arg or "") for arg in proc.info["cmdline"] or ()):
                ours.add(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for n in deployed.status()["nodes"]:
        if n["alive"]:
            sup = psutil.Process(n["supervisor_pid"])
            ours |= {sup.pid} | {c.pid for c in sup.children(recursive=True)}
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in ours]
    assert len({c.pid for c in listening}) >= 4  # the GCS, raylets, supervisors: the check sees them
    loopback = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
    exposed = [(c.pid, psutil.Process(c.pid).name(), c.laddr) for c in listening if c.laddr.ip not in loopback]
    assert not exposed


def test_keyless_tcp_connections_to_a_node_are_shed_and_it_keeps_serving(deployed: RayCluster) -> None:
    """On a cluster node: raw TCP connections that never greet (no key, no
    ZMTP greeting) against a node supervisor's CURVE frontend are counted and shed at accept (here:
    past ``max_tcp_peers_per_source``, 64 by default), the node supervisor stays up, and a tenant
    placed there is still served through the cluster client. Before, such a flood aborted the
    node's supervisor and the directory marked the node dead."""
    import socket

    cc = deployed.register(_spec("attacked"))
    socks: list[socket.socket] = []
    try:
        node = next(n for n in deployed.status()["nodes"] if n["node_id"] == cc.node_id)
        host, port = node["endpoint"].removeprefix("tcp://").rsplit(":", 1)
        assert host == "127.0.0.1"
        with SupervisorClient(node["run_dir"], timeout_s=30) as local:
            for _ in range(200):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                s.bind(("127.0.0.2", 0))  # another loopback source: the per-source cap is the attacker's
                try:
                    s.connect((host, int(port)))
                except OSError:
                    s.close()  # refused (the backlog full): the flood goes on
                    continue
                socks.append(s)
            wait_for(lambda: local.status().supervisor.connections_shed_by.get("per_source", 0) > 0,
                     60, what="keyless connections shed at the node")
            with ClusterClient(directory=None, timeout_s=30) as client:
                assert client.ping(cc.to_text()).tenant == cc.tenant_id
            assert psutil.pid_exists(node["supervisor_pid"])
            assert local.status().supervisor.internal_errors == 0
        # the directory still counts the node alive (an earlier test of this module killed another one)
        assert next(n for n in deployed.status()["nodes"] if n["node_id"] == cc.node_id)["alive"]
    finally:
        for s in socks:
            s.close()
        deployed.evict(cc.tenant_id)


def test_shutdown_leaves_no_process_and_no_segment(deployed: RayCluster) -> None:
    pids = [n["supervisor_pid"] for n in deployed.status()["nodes"] if n["alive"]]
    assert pids
    deployed.shutdown()
    wait_for(lambda: not any(psutil.pid_exists(p) for p in pids), 30, what="every supervisor to exit")
    mine = {pid for pid, _ in hygiene.twt_processes() if hygiene._process_is_ours(pid)}
    assert not mine
    assert not {s for s in hygiene.twt_segments() if hygiene._segment_is_ours(s)}
    wait_for(lambda: _no_cluster(DEFAULT_NAME), 20, what="the directory actor to be gone")
