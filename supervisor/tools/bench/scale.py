"""``twt bench scale``: registration latency, worker memory, and routing with many tenants.

In one run (stub backend):

* registration latency, p50/p99: warm (a pool worker is bound: one message
  round trip), cold with ``--start-method forkserver`` (a preloaded fork
  server forks the worker), cold with ``spawn`` (a fresh interpreter).
  Targets: warm <= 2 ms p50, forkserver cold <= 25 ms p50.
* idle worker USS (memory unique to the process): a pool worker, and a bound
  one. Target <= 25 MB.
* ping round trip of one tenant of a supervisor serving 64 tenants, against
  one of a supervisor serving that tenant alone, both running, in alternating
  rounds. Target: within 1.2x (the median of the per-round ratios).
* supervisor RSS with 64 tenants; then 128 tenants registered and each served
  a ping on this machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import AbstractContextManager

import psutil
import zmq

from shared import protocol as proto
from shared.sizes import format_size
from shared.spec import TenantSpec
from supervisor.tools.bench._report import Report, Target, at_least, count, format_table, percentile, socket_rtts_us
from supervisor.client.api import SupervisorClient
from supervisor.client.launch import SupervisorHandle, launch

__all__ = ["main"]


def _wait_pool(client: SupervisorClient, n: int, timeout_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pool = client.status().supervisor.pool
        if pool.idle >= n:
            return list(pool.pids)
        time.sleep(0.01)
    raise RuntimeError(f"the warm pool did not reach {n} workers within {timeout_s:g} s")


def _launch(method: str, pool: int) -> AbstractContextManager[SupervisorHandle]:
    return launch({"supervisor": {"pool_size": pool, "log_level": "warning"}, "tenant": []},
                  backend="stub", start_method=method)


def _register_times(sup: SupervisorHandle, prefix: str, n: int, *, warm: bool) -> list[float]:
    client = sup.client
    out = []
    for i in range(n):
        if warm:
            _wait_pool(client, 1)
        t0 = time.perf_counter()
        client.register(None, TenantSpec(f"{prefix}{i}"))
        out.append((time.perf_counter() - t0) * 1000)
    return out


def _ping_rtts(sup: SupervisorHandle, cap_raw: bytes, n: int) -> list[float]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{sup.run_dir}/frontend.ipc")
    header = proto.encode_request(1, "ping", cap_raw, {})
    try:
        socket_rtts_us(sock, header, 100)  # warm up
        return socket_rtts_us(sock, header, n)
    finally:
        sock.close(0)


def _uss(pid: int) -> int:
    return int(psutil.Process(pid).memory_full_info().uss)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twt bench scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--samples", type=count, default=15, help="registrations per kind")
    parser.add_argument("--tenants", type=at_least(64), default=128, help="tenants for the many-tenants test")
    args = parser.parse_args(argv)
    report = Report("scale")

    # ---------------------------------------------------- registration latency
    with _launch("spawn", 2) as sup:
        warm = _register_times(sup, "w", args.samples, warm=True)
        pool_pids = _wait_pool(sup.client, 2)
        uss_pool = [_uss(p) for p in pool_pids]
        bound_pids = [p for rec in sup.client.status().tenants for p in rec.pids][:4]
        uss_bound = [_uss(p) for p in bound_pids]
    with _launch("spawn", 0) as sup:
        spawn_cold = _register_times(sup, "s", max(5, args.samples // 2), warm=False)
    with _launch("forkserver", 0) as sup:
        _register_times(sup, "warmup", 2, warm=False)  # the fork server's own start is not a registration
        fork_cold = _register_times(sup, "f", args.samples, warm=False)
        uss_fork = [_uss(p) for rec in sup.client.status().tenants for p in rec.pids][:4]

    # ------------------------------------------------------- many tenants
    # Two supervisors at once, one with a single tenant and one with 64, pinged in
    # alternating rounds: both see the same machine (the 64 idle workers included),
    # so the ratio is what 64 tenants cost the supervisor, not the drift of a loaded
    # machine between two phases measured one after the other.
    with _launch("forkserver", 0) as alone, _launch("forkserver", 0) as sup:
        client = sup.client
        cap_alone = alone.client.register(None, TenantSpec("probe"))
        cap = client.register(None, TenantSpec("probe"))
        t0 = time.perf_counter()
        caps = [client.register(None, TenantSpec(f"t{i:03d}")) for i in range(63)]
        rtt_1: list[float] = []
        rtt_64: list[float] = []
        round_ratios = []
        for _ in range(6):
            a = _ping_rtts(alone, cap_alone.to_bytes(), 300)
            b = _ping_rtts(sup, cap.to_bytes(), 300)
            rtt_1 += a
            rtt_64 += b
            round_ratios.append(statistics.median(b) / statistics.median(a))
        rss_64 = psutil.Process(sup.pid).memory_info().rss
        caps += [client.register(None, TenantSpec(f"t{i:03d}")) for i in range(63, args.tenants - 1)]
        register_all_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        served = sum(1 for c in [cap, *caps] if client.ping(c).tenant)
        serve_all_s = time.perf_counter() - t1
        status = client.status()
        rss_all = psutil.Process(sup.pid).memory_info().rss
        workers = [p for rec in status.tenants for p in rec.pids]
        total_worker_rss = sum(psutil.Process(p).memory_info().rss for p in workers)
        total_worker_uss = sum(_uss(p) for p in workers[:16]) / min(16, len(workers)) * len(workers)

    mb = 1 << 20
    report.sections.append(("registration latency (ms)", format_table(
        ["kind", "p50", "p99", "n"],
        [
            ["warm pool (bind an idle worker)", statistics.median(warm), percentile(warm, 0.99), len(warm)],
            ["cold, forkserver", statistics.median(fork_cold), percentile(fork_cold, 0.99), len(fork_cold)],
            ["cold, spawn", statistics.median(spawn_cold), percentile(spawn_cold, 0.99), len(spawn_cold)],
        ],
    )))
    report.sections.append(("idle worker memory (USS, MiB)", format_table(
        ["worker", "median", "max"],
        [
            ["pool worker (spawn)", statistics.median(uss_pool) / mb, max(uss_pool) / mb],
            ["bound, idle (spawn)", statistics.median(uss_bound) / mb, max(uss_bound) / mb],
            ["bound, idle (forkserver)", statistics.median(uss_fork) / mb, max(uss_fork) / mb],
        ],
    )))
    ratio = statistics.median(round_ratios)
    report.sections.append(("routing with many tenants", format_table(
        ["figure", "value"],
        [
            ["ping p50, 1 tenant (us)", statistics.median(rtt_1)],
            ["ping p50, 64 tenants (us)", statistics.median(rtt_64)],
            ["ping p99, 64 tenants (us)", percentile(rtt_64, 0.99)],
            ["supervisor RSS, 64 tenants", format_size(rss_64)],
            ["tenants registered and served", f"{served} of {args.tenants}"],
            [f"registering {args.tenants - 1} more (s)", register_all_s],
            [f"one ping to each of {args.tenants} (s)", serve_all_s],
            [f"supervisor RSS, {args.tenants} tenants", format_size(rss_all)],
            [f"workers' RSS sum / est. USS sum, {len(workers)} workers",
             f"{format_size(total_worker_rss)} / {format_size(int(total_worker_uss))}"],
        ],
    )))
    uss_idle = max(statistics.median(uss_pool), statistics.median(uss_bound))
    report.targets += [
        # Ratios against a baseline of the same run (the handbook's rule), not absolute times: the
        # warm registration's goal is `twt bench registry`'s (its floor: 8 pings + 2 fsyncs of the
        # state dir, since registrations are durable); forkserver's point is to skip a cold start's
        # interpreter and imports, so its cold registration is measured against spawn's.
        Target("forkserver cold registration p50 vs spawn cold registration p50",
               statistics.median(fork_cold) / statistics.median(spawn_cold), 0.33, higher_is_better=False),
        Target("idle worker USS (spawn, median)", uss_idle / mb, 25.0, higher_is_better=False, unit=" MiB"),
        Target("ping p50 with 64 tenants vs 1 (median of per-round ratios)", ratio, 1.2, higher_is_better=False),
        Target(f"tenants served of {args.tenants}", float(served), float(args.tenants), unit=""),
    ]
    report.data.update(
        register_ms={"warm": {"p50": statistics.median(warm), "p99": percentile(warm, 0.99)},
                     "forkserver": {"p50": statistics.median(fork_cold), "p99": percentile(fork_cold, 0.99)},
                     "spawn": {"p50": statistics.median(spawn_cold), "p99": percentile(spawn_cold, 0.99)}},
        uss_bytes={"pool": statistics.median(uss_pool), "bound": statistics.median(uss_bound),
                   "forkserver": statistics.median(uss_fork)},
        ping_us={"1": statistics.median(rtt_1), "64": statistics.median(rtt_64)},
        supervisor_rss={"64": rss_64, str(args.tenants): rss_all},
        served=served,
    )
    return report.emit(as_json=args.json)
