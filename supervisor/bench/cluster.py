"""``twt bench cluster``: a cluster ping, straight to the node's CURVE TCP frontend, against a Ray actor call.

Both in the same run, round by round: a trivial Ray actor method
(``ray.get(echo.ping.remote())``: what a cluster that routed each request
through Ray would pay at the least) and ``ClusterClient.ping`` (encrypted
TCP to the node supervisor, which forwards to the tenant's worker process
and back). Target: the cluster ping at least 2x faster, which is why Ray
stays off the data path.

Without ``--address`` a one-node local Ray (one fake GPU, no dashboard,
loopback only) is started for the run and stopped after it.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from collections.abc import Callable

from shared.spec import TenantSpec
from supervisor.bench._report import Report, Target, format_table, percentile

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
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-round", type=int, default=300, help="calls per round and side")
    args = parser.parse_args(argv)

    local = args.address is None
    if local:
        # loopback only, and no usage report: set before Ray is imported (read at import)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from supervisor.cluster import RayCluster

    if local:
        ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, object_store_memory=80 * MiB,
                 logging_level=logging.WARNING, log_to_driver=False, namespace="twt")
    else:
        ray.init(address=args.address, logging_level=logging.WARNING, log_to_driver=False, namespace="twt")
    report = Report("cluster")
    try:
        cluster = RayCluster.deploy({"supervisor": {"backend": "stub", "pool_size": 0, "log_level": "warning"}},
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
    finally:
        ray.shutdown()

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
