"""``twt bench cluster``: a cluster ping, straight to the node's CURVE TCP frontend, against a Ray actor call.

Both in the same run, round by round: a trivial Ray actor method
(``ray.get(echo.ping.remote())``: what a cluster that routed each request
through Ray would pay at the least) and ``ClusterClient.ping`` (encrypted
TCP to the node supervisor, which forwards to the tenant's worker process
and back). Target: the cluster ping at least 2x faster, which is why Ray
stays off the data path.

Without ``--address`` a one-node local Ray of its own (one fake GPU, no
dashboard, bound to 127.0.0.1, its own temporary directory) is started for
the run and stopped after it, whatever other Ray runs on the machine: an
existing cluster (``$RAY_ADDRESS``, a running ``ray start``) is left alone
and named in one line. With ``--address`` that cluster is used, and a
failure to join it says what was found there.

Typing: Ray is untyped here (mypy follows no ray import), so the ``ray`` module, actor handles,
object refs and ``ray.get()`` results are dynamically typed (this module's only ``Any``); a
result is given its type where it lands.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shared.errors import BackendUnavailable
from shared.spec import TenantSpec
from supervisor.tools.bench._report import Report, Target, count, format_table, percentile
from shared.rundir import temp_parent
from supervisor.cluster.ray_bind import init_loopback_ray, private_ray_temp_dir

if TYPE_CHECKING:
    from supervisor.cluster import RayCluster

__all__ = ["main"]

MiB = 1 << 20


class _Echo:
    def ping(self) -> int:
        return 1


def _rtts(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        fn()
        out.append((clock() - t0) / 1000)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twt bench cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--address", help="an existing Ray cluster (default: start a local one-node Ray)")
    parser.add_argument("--rounds", type=count, default=6)
    parser.add_argument("--per-round", type=count, default=300, help="calls per round and side")
    args = parser.parse_args(argv)

    local = args.address is None
    temp_dir = None
    if local:
        # no usage report: set before Ray is imported (read at import); loopback: init_loopback_ray
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        other = os.environ.pop("RAY_ADDRESS", None)
        if other:
            print(f"twt bench cluster: RAY_ADDRESS={other} is left alone: starting an isolated local Ray "
                  "(give --address to use that cluster)", file=sys.stderr)
        temp_dir = private_ray_temp_dir(temp_parent())  # short: Ray's socket paths; 0700, unlike Ray's own
    import ray

    from supervisor.cluster import RayCluster
    from supervisor.cluster.ray_cluster import ray_auth_mode

    try:
        if temp_dir is not None:
            # address="local": always a new cluster of our own, never one found on the machine;
            # every Ray process on 127.0.0.1 only (supervisor.cluster.ray_bind)
            init_loopback_ray(temp_dir, num_cpus=2, num_gpus=1, object_store_memory=80 * MiB,
                              logging_level=logging.WARNING, log_to_driver=False, namespace="twt")
        else:
            _check_reachable(args.address)
            try:
                ray.init(address=args.address, logging_level=logging.WARNING, log_to_driver=False, namespace="twt")
            except Exception as exc:  # noqa: BLE001 - Ray's many start-up errors: one line saying what was found
                raise BackendUnavailable("ray", f"cannot join the Ray cluster at --address {args.address}: "
                                         f"{type(exc).__name__}: {exc}".rstrip()) from None
        return _measure(args, ray, RayCluster, local, ray_auth_mode())
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if temp_dir is not None:
            shutil.rmtree(os.path.dirname(temp_dir), ignore_errors=True)


def _check_reachable(address: str) -> None:
    """``HOST:PORT`` (or ``ray://HOST:PORT``) that refuses a TCP connection: say so at once, instead of
    Ray's minutes of retries. ``auto`` and unreachable-but-silent hosts are left to Ray."""
    import socket

    from shared.config import parse_host_port

    target = address.removeprefix("ray://")
    if target in ("auto", "local") or ":" not in target:
        return
    try:
        host, port = parse_host_port(target, "--address")
    except ValueError:
        return
    try:
        with socket.create_connection((host, port), timeout=3.0):
            return
    except TimeoutError:
        return
    except OSError as exc:
        raise BackendUnavailable("ray", f"no Ray cluster at --address {address}: {(exc.strerror or str(exc)).lower()} "
                                 "(start one with `ray start --head`, or leave out --address for an isolated local "
                                 "one)") from None


def _measure(args: argparse.Namespace, ray: Any, cluster_cls: type[RayCluster], local: bool, auth: str) -> int:
    """The measurement, on the Ray this process joined."""
    report = Report("cluster")
    report.data["ray_auth"] = auth
    report.data["ray"] = "isolated local" if local else args.address
    cluster = cluster_cls.deploy({"supervisor": {"backend": "stub", "pool_size": 0, "log_level": "warning"}},
                                name="twt-bench", listen_host="127.0.0.1" if local else None)
    try:
        cc = cluster.register(TenantSpec("bench"))
        echo = ray.remote(_Echo).options(num_cpus=0).remote()
        with cluster.client() as client:
            ping_actor = lambda: ray.get(echo.ping.remote())  # noqa: E731
            ping_cluster = lambda: client.ping(cc)  # noqa: E731
            _rtts(ping_actor, 100)  # warm both paths up
            _rtts(ping_cluster, 100)
            r_actor: list[float] = []
            r_cluster: list[float] = []
            ratios = []
            for _ in range(args.rounds):
                a = _rtts(ping_actor, args.per_round)
                b = _rtts(ping_cluster, args.per_round)
                r_actor += a
                r_cluster += b
                ratios.append(statistics.median(a) / statistics.median(b))
        ray.kill(echo)
        cluster.evict("bench")
    finally:
        cluster.shutdown()

    ratio = statistics.median(ratios)
    report.sections.append((
        "round trip, one at a time (us)",
        format_table(["path", "p50", "p99"], [
            ["trivial Ray actor call", percentile(r_actor, 0.5), percentile(r_actor, 0.99)],
            ["cluster ping (CURVE TCP -> supervisor -> worker)", percentile(r_cluster, 0.5), percentile(r_cluster, 0.99)],
        ]),
    ))
    report.targets.append(Target("cluster ping faster than a Ray actor call (median of per-round ratios)", ratio, 2.0))
    report.data.update(rtt_us={"ray_actor": {"p50": percentile(r_actor, 0.5), "p99": percentile(r_actor, 0.99)},
                               "cluster_ping": {"p50": percentile(r_cluster, 0.5), "p99": percentile(r_cluster, 0.99)}})
    return report.emit(as_json=args.json)
