"""``twt bench density``: ten thousand registered tenants on one supervisor (stub backend).

In one run:

* **registration**: ``--clients`` concurrent clients register ``--tenants`` tenants with
  ``instances = 0`` (state ``stopped``: no worker) against a supervisor with durable state;
  registrations per second, each answered only once its row is committed (group commit);
  ``--active`` more tenants get one instance each (a worker), so /metrics has tenants of both kinds;
* **status**: one page (100 records) and the summary of every tenant, read by the client and by
  ``twt status`` (a new process: its start-up counted);
* **/metrics**: a scrape's time and size (median of 3, each after a fresh render);
* **supervisor RSS per registered tenant** (RSS with the tenants minus RSS before them), its open
  fds and the /dev/shm segments, against the workers alive;
* **restart**: the active tenants are scaled to 0, the supervisor is stopped and started on the
  same state; start to ready (every stored tenant back: the status summary counts them all; none
  has a worker to start, as parked tenants would not), and the same for an empty state;
* **parking** (supervisor.tools.bench.density_parking): the registered tenants stored parked with
  ``idle_timeout_s``, a restart with ``max_active = 64`` on them, and a Zipf(1.1) stream of pings
  and small ``run_wasm`` calls: activation overhead p50/p99 against the same op to an active
  tenant; fds and /dev/shm segments against the workers alive; a tenant parked with 64 MiB of
  buffers (restore rate against memcpy); the first ``run_wasm`` after activation against a warm one;
* what a user would pick instead: a Ray actor's creation plus its first call (p50; a local
  one-node Ray, as ``twt bench cluster`` starts it; skipped with a note when Ray is not installed,
  or with ``--no-ray``: starting Ray costs about ten seconds and a few hundred MiB).

``--quick`` is a small run (500 tenants, 300 requests, one round, no Ray) that checks the bench.
``--rss-only`` stops after the registration and the RSS, fds and segments rows (about a minute at
10,000 tenants): the registration and RSS targets alone.

Goals (the issue's): >= 200 registrations/s; restart-to-ready <= 5 s; status and ``twt status``
< 1 s; /metrics <= 5 MB and < 1 s; RSS <= 2 KiB per registered tenant (a tenant without a worker
holds no shared-memory segment and no descriptor: its fds and segments per tenant read 0); activation
overhead p99 <= 20 ms; a 64 MiB restore at >= 0.5x memcpy; the first run after activation <= 2x
a warm one.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import AbstractContextManager
from typing import Any

from shared._shm import SHM_DIR
from shared.rundir import temp_parent
from shared.spec import TenantSpec
from supervisor.client.launch import SupervisorHandle, launch
from supervisor.tools.bench import density_parking as parking
from supervisor.tools.bench._report import Report, Target, at_least, format_table

__all__ = ["main"]

KiB = 1 << 10
MiB = 1 << 20
#: the issue's goals
REGISTRATIONS_PER_S = 200.0
RESTART_READY_S = 5.0
STATUS_S = 1.0
METRICS_BYTES = 5_000_000
METRICS_S = 1.0
RSS_PER_TENANT = 2 * KiB
ACTIVATION_OVERHEAD_S = 0.020
RESTORE_VS_MEMCPY = 0.5
FIRST_RUN_VS_WARM = 2.0
#: the share of the stream's activations that should find a warm pool worker (%): the others
#: wait for a worker's start or warm-up, the activation tail
WARM_SHARE = 99.0
#: records in the status page read (the table twt status shows by default)
STATUS_PAGE = 100


def _start(state_dir: str, metrics: bool) -> AbstractContextManager[SupervisorHandle]:
    return launch(
        {"supervisor": {"pool_size": 1, "log_level": "warning", "max_tenants": 16_384}, "tenant": []},
        backend="stub",
        extra_args=["--state-dir", state_dir],
        metrics_addr="127.0.0.1:0" if metrics else None,
        ready_timeout_s=600.0,
    )


def warm_share(stream: dict[str, Any]) -> float:
    """The share of the stream's activation workers that came warm from the pool (%; 100 for none)."""
    got = stream["activation_workers"]
    total = sum(int(n) for n in got.values())
    return 100.0 * int(got.get("warm", 0)) / total if total else 100.0


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * KiB
    return 0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _segments() -> int:
    try:
        return sum(1 for name in os.listdir(SHM_DIR) if name.startswith("twt-"))
    except OSError:
        return 0


def _register(sup: SupervisorHandle, names: list[str], clients: int, instances: int) -> float:
    """Register ``names`` from ``clients`` threads (a client each); the wall time."""
    admin = sup.client.admin
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            with sup.connect(timeout_s=120.0) as client:
                for name in names[k::clients]:
                    client.register(admin, TenantSpec(name, instances=instances))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(min(clients, len(names)))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return elapsed


def _metrics_url(sup: SupervisorHandle) -> str | None:
    url = sup.info.get("metrics_url")
    return url if isinstance(url, str) else None


def _scrape(url: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as r:
        body = r.read()
    return time.perf_counter() - t0, len(body)


def _twt_status(run_dir: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "supervisor", "status", "--run-dir", run_dir],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, timeout=120)
    return time.perf_counter() - t0


def _ready(state: str, n: int) -> tuple[float, int]:
    """Start a supervisor on ``state``: seconds from launch until its status summary counts ``n``
    tenants (every stored one restored), and the count it reached."""
    t0 = time.perf_counter()
    with _start(state, metrics=False) as sup:
        with sup.connect(timeout_s=120.0) as client:
            while True:
                summary = client.status(limit=1).summary
                seen = summary.tenants if summary is not None else 0
                if seen >= n or time.perf_counter() - t0 > 120:
                    return time.perf_counter() - t0, seen
                time.sleep(0.01)


def _ray_actor_p50(rounds: int) -> float | None:
    """A Ray actor's creation plus its first call, p50 (seconds), on a local one-node Ray."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.pop("RAY_ADDRESS", None)
    temp_dir = tempfile.mkdtemp(prefix="twt-bench-ray-", dir=temp_parent())
    import ray

    from supervisor.tools.bench.cluster import _Echo

    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=80 * MiB,
                 _node_ip_address="127.0.0.1", _temp_dir=temp_dir, logging_level=logging.WARNING,
                 log_to_driver=False, namespace="twt")
        echo = ray.remote(_Echo)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            actor = echo.remote()
            ray.get(actor.ping.remote())
            times.append(time.perf_counter() - t0)
            ray.kill(actor)
        return float(statistics.median(times))
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _measure(args: argparse.Namespace) -> dict[str, Any]:  # a JSON report row, read back by key
    state = tempfile.mkdtemp(prefix="twt-bench-density-", dir=temp_parent())
    empty = tempfile.mkdtemp(prefix="twt-bench-density-empty-", dir=temp_parent())
    out: dict[str, Any] = {"tenants": args.tenants, "active": args.active, "clients": args.clients}
    try:
        with _start(state, metrics=True) as sup:
            time.sleep(0.5)  # the warm pool's worker up: not counted against the tenants
            rss0, fds0, seg0 = _rss(sup.pid), _fds(sup.pid), _segments()
            names = [f"d{i:05d}" for i in range(args.tenants)]
            out["register_s"] = _register(sup, names, args.clients, 0)
            out["registrations_per_s"] = args.tenants / out["register_s"]
            _register(sup, [f"a{i:03d}" for i in range(args.active)], min(args.clients, 4), 1)
            total = args.tenants + args.active
            out["rss_bytes"], out["rss0_bytes"] = _rss(sup.pid), rss0
            out["rss_per_tenant"] = (out["rss_bytes"] - rss0) / total
            out["fds"], out["fds_per_tenant"] = _fds(sup.pid), (_fds(sup.pid) - fds0) / total
            out["segments"], out["segments_per_tenant"] = _segments(), (_segments() - seg0) / total
            if args.rss_only:
                return out
            with sup.connect(timeout_s=120.0) as client:
                pages = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    page = client.status(limit=STATUS_PAGE)
                    pages.append(time.perf_counter() - t0)
                out["status_page_s"] = float(statistics.median(pages))
                out["status_summary"] = page.summary.to_wire() if page.summary is not None else None
                out["workers"] = page.supervisor.workers
                t0 = time.perf_counter()
                full = client.status()
                out["status_all_s"] = time.perf_counter() - t0
                out["status_all_tenants"] = len(full.tenants)
            out["twt_status_s"] = float(statistics.median(_twt_status(sup.run_dir) for _ in range(3)))
            url = _metrics_url(sup)
            if url is not None:
                scrapes = []
                for _ in range(3):
                    time.sleep(1.1)  # past the render interval: each scrape waits for a fresh render
                    scrapes.append(_scrape(url))
                out["metrics_s"] = float(statistics.median(s for s, _ in scrapes))
                out["metrics_bytes"] = max(n for _, n in scrapes)
            # the restart brings back tenants none of which is started (as parked ones would be): the
            # active ones are scaled to 0 first, so that workers' start-up is not what is timed
            for i in range(args.active):
                sup.client.scale(None, f"a{i:03d}", 0)
        out["restart_s"], out["restored"] = _ready(state, total)
        out["empty_start_s"], _ = _ready(empty, 0)
        # the parking workload: the same tenants, stored parked, on a max_active supervisor
        parking.park_all(state, names)
        t0 = time.perf_counter()
        with parking.start_dense(state, max_active=parking.MAX_ACTIVE) as sup:
            with sup.connect(timeout_s=120.0) as client:
                while True:
                    summary = client.status(limit=1).summary
                    if (summary.tenants if summary is not None else 0) >= total or time.perf_counter() - t0 > 120:
                        break
                    time.sleep(0.01)
            out["parked_restart_s"] = time.perf_counter() - t0
            out["stream"] = parking.measure_stream(sup, names, args.requests, args.seed)
            out["stream"]["fds"], out["stream"]["segments"] = _fds(sup.pid), _segments()
        out["park"] = parking.measure_buffers_and_first_run(args.rounds)
        if args.ray:
            try:
                import ray  # noqa: F401 - only whether it is installed
            except ImportError:
                out["ray_note"] = "not measured: ray is not installed (pip install 'ray[default]')"
            else:
                out["ray_actor_p50_s"] = _ray_actor_p50(args.ray_rounds)
        else:
            out["ray_note"] = "not measured (--no-ray or --quick)"
        return out
    finally:
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(empty, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twt bench density", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tenants", type=at_least(1), default=10_000,
                        help="tenants registered with instances = 0 (default 10000)")
    parser.add_argument("--active", type=at_least(0), default=8, help="tenants with one worker each (default 8)")
    parser.add_argument("--clients", type=at_least(1), default=16, help="concurrent registering clients (default 16)")
    parser.add_argument("--requests", type=at_least(1), default=parking.STREAM_REQUESTS,
                        help="requests of the Zipf(1.1) stream over the parked tenants (default "
                             f"{parking.STREAM_REQUESTS}: each op's p99 on >= 5 activating requests)")
    parser.add_argument("--rounds", type=at_least(1), default=3,
                        help="rounds of the 64 MiB restore and the first run after activation (default 3)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-ray", dest="ray", action="store_false",
                        help="skip the Ray actor's creation + first call (it starts a local Ray: ~10 s)")
    parser.add_argument("--ray-rounds", type=at_least(1), default=10)
    parser.add_argument("--quick", action="store_true",
                        help="a small run that checks the bench: 500 tenants, 300 requests, 1 round, no Ray")
    parser.add_argument("--first-run-only", action="store_true",
                        help="only the first run_wasm after activation against a warm one, --rounds activations "
                             "(a short run; the load average is printed with it)")
    parser.add_argument("--rss-only", action="store_true",
                        help="only the registration and the supervisor's RSS, fds and segments per tenant "
                             "(no status, /metrics, restart, parking or Ray)")
    args = parser.parse_args(argv)
    if args.first_run_only:
        return _first_run_report(args)
    if args.quick:
        args.tenants, args.requests, args.rounds, args.ray, args.active = 500, 300, 1, False, min(args.active, 2)
    r = _measure(args)
    if args.rss_only:
        return _rss_report(args, r)
    report = Report("density")
    total = args.tenants + args.active
    summary = r.get("status_summary") or {}
    rows: list[list[object]] = [
        [f"registrations/s ({args.tenants} tenants, instances=0, {args.clients} clients, durable)",
         r["registrations_per_s"]],
        [f"restart to ready, {total} stored tenants, none started (s)", r["restart_s"]],
        ["  the same, empty state (s)", r["empty_start_s"]],
        ["  tenants restored", r["restored"]],
        [f"status: a page of {STATUS_PAGE} + the summary, client (ms)", r["status_page_s"] * 1000],
        ["twt status (a new process, first page) (ms)", r["twt_status_s"] * 1000],
        [f"status: every tenant, {r['status_all_tenants']} records in pages (s)", r["status_all_s"]],
        ["summary: states", summary.get("states")],
        ["/metrics scrape (ms)", r["metrics_s"] * 1000 if "metrics_s" in r else "not measured"],
        ["/metrics size (bytes)", r.get("metrics_bytes", "not measured")],
        ["supervisor RSS (MiB), before the tenants", r["rss0_bytes"] / MiB],
        ["supervisor RSS (MiB), with them", r["rss_bytes"] / MiB],
        ["RSS per registered tenant (bytes)", r["rss_per_tenant"]],
        ["open fds (per registered tenant)", f"{r['fds']} ({r['fds_per_tenant']:.2f})"],
        ["/dev/shm segments (per registered tenant)", f"{r['segments']} ({r['segments_per_tenant']:.2f})"],
        ["workers alive", r["workers"]],
    ]
    report.sections.append((f"{total} registered tenants ({args.active} with a worker), stub backend",
                            format_table(["figure", "value"], rows)))
    st, pk = r["stream"], r["park"]
    ms = 1000.0

    def fig(value: float | None, scale: float = ms) -> object:
        return "none" if value is None else value * scale

    def pair(a: float | None, b: float | None) -> str:
        return " / ".join("none" if v is None else f"{v * ms:.2f}" for v in (a, b))

    def by_how(kind: str) -> str:
        """The activations of one kind's whole time, p50 / p99 (ms; the events count in ms)."""
        return " / ".join("none" if st[f"activate_{kind}_{q}_ms"] is None else f"{st[f'activate_{kind}_{q}_ms']:.2f}"
                          for q in ("p50", "p99"))

    ray = r.get("ray_actor_p50_s")
    park_rows: list[list[object]] = [
        [f"restart to ready, {total} tenants stored parked (s)", r["parked_restart_s"]],
        [f"Zipf({parking.ZIPF_S}) stream: requests, distinct tenants, s", f"{st['requests']}, {st['distinct_tenants']}, "
         f"{st['stream_s']:.1f}"],
        ["  ping: warm p50 / p99 (ms) [n]", f"{pair(st['ping_warm_p50_s'], st.get('ping_warm_p99_s'))} [{st['ping_warm_n']}]"],
        ["  ping: activating p50 / p99 (ms) [n]",
         f"{pair(st['ping_cold_p50_s'], st['ping_cold_p99_s'])} [{st['ping_cold_n']}]"],
        ["  ping: activation overhead p50 / p99 (ms)", pair(st["ping_overhead_p50_s"], st["ping_overhead_p99_s"])],
        ["  run_wasm: warm p50 / p99 (ms) [n]",
         f"{pair(st['run_wasm_warm_p50_s'], st.get('run_wasm_warm_p99_s'))} [{st['run_wasm_warm_n']}]"],
        ["  run_wasm: activating p50 / p99 (ms) [n]",
         f"{pair(st['run_wasm_cold_p50_s'], st['run_wasm_cold_p99_s'])} [{st['run_wasm_cold_n']}]"],
        ["  run_wasm: activation overhead p50 / p99 (ms)",
         pair(st["run_wasm_overhead_p50_s"], st["run_wasm_overhead_p99_s"])],
        ["  activations (supervisor's account): bind / restore / whole, p50 (ms)",
         " / ".join("none" if st[f"activate_{k}_p50_ms"] is None else f"{st[f'activate_{k}_p50_ms']:.2f}"
                    for k in ("bind", "restore", "total"))],
        ["  activations: bind / restore / whole, p99 (ms)",
         " / ".join("none" if st[f"activate_{k}_p99_ms"] is None else f"{st[f'activate_{k}_p99_ms']:.2f}"
                    for k in ("bind", "restore", "total"))],
        ["  the stream's CPU per activation: supervisor / fork server / workers / all (ms) [activations]",
         "none" if not st.get("cpu_per_activation_ms") else
         " / ".join(f"{v:.1f}" for v in (*st["cpu_per_activation_ms"].values(),
                                          sum(st["cpu_per_activation_ms"].values())))
         + f" [{st['activations']}]"],
        ["  activations' workers: warm from the pool / still warming up / a pool worker starting / spawned",
         " / ".join(str(st["activation_workers"].get(k, 0)) for k in ("warm", "warming", "starting", "spawned"))],
        ["  activations that found a warm pool worker (%)", f"{warm_share(st):.1f}"],
        ["  activating requests beyond their activation and the op's warm p50: p50 / p99 (ms)",
         " / ".join("none" if st.get(f"activate_outside_{q}_ms") is None else f"{st[f'activate_outside_{q}_ms']:.2f}"
                    for q in ("p50", "p99"))],
        ["    of them waiting before their activation began (room, their own park): n, p50 / p99 (ms); the worst (ms)",
         f"{st.get('activate_room_n', 0)}, "
         + " / ".join("none" if st.get(f"activate_room_{q}_ms") is None else f"{st[f'activate_room_{q}_ms']:.2f}"
                      for q in ("p50", "p99"))
         + "; " + ", ".join(st.get("activate_outside_worst", []))],
        ["  activations with a warm pool worker; with another: whole p50 / p99 (ms) [n]",
         "; ".join(f"{by_how(k)} [{st[f'activate_{k}_n']}]" for k in ("warm", "other"))],
        ["  activations without a warm worker: when, s into the stream",
         ", ".join(f"{t:g}" for t in st["activate_other_at_s"][:16]) or "none"],
        ["  run_wasm: a tenant's first run ever (compiles; not counted above): p50 (ms) [n]",
         f"{fig(st['first_compile_p50_s'])} [{st['first_compiles_n']}]"],
        ["  run_wasm: compiled again after an activation (artifact missed)", st["artifact_misses"]],
        ["  CapacityExhausted answers (retried)", st["capacity_refusals"]],
        ["  after it: workers alive (max_active 64 + pool), supervisor fds, /dev/shm segments",
         f"{st['workers_alive']}, {st['fds']}, {st['segments']}"],
        ["  after it: tenant states", st["tenant_states"]],
        ["64 MiB restore: activation, with / without the buffer (ms)",
         f"{statistics.median(pk['activate_ms_big']):.1f} / {statistics.median(pk['activate_ms_empty']):.1f}"],
        ["  restore rate / memcpy into fresh memory / into touched memory (GB/s)",
         f"{pk['restore_bytes_per_s'] / 1e9:.2f} / {pk['memcpy_bytes_per_s'] / 1e9:.2f} / "
         f"{pk['memcpy_hot_bytes_per_s'] / 1e9:.2f}"],
        ["  restore vs memcpy into touched memory (x)", pk["restore_bytes_per_s"] / pk["memcpy_hot_bytes_per_s"]],
        [f"first run_wasm after activation / warm (ms), load {pk['load_before']:.1f}-{pk['load_after']:.1f}",
         f"{pk['first_run_s'] * ms:.2f} / {pk['warm_run_s'] * ms:.2f}"],
        ["  its module came from the artifact (no compile)", pk["first_run_cached"]],
        ["  without an artifact (a module compiled at that run) (ms)", pk["first_run_compiling_s"] * ms],
        ["Ray actor creation + first call, p50 (ms)", ray * ms if ray is not None else r.get("ray_note")],
    ]
    report.sections.append((f"parking: {total} tenants, at most {parking.MAX_ACTIVE} active, stub backend",
                            format_table(["figure", "value"], park_rows)))
    overhead = [st["ping_overhead_p99_s"], st["run_wasm_overhead_p99_s"]]
    report.targets += [
        Target(f"activation overhead p99, {op} (over an active tenant)", value, ACTIVATION_OVERHEAD_S * ms,
               higher_is_better=False, unit=" ms")
        for op, value in (("ping", fig(overhead[0])), ("run_wasm", fig(overhead[1])))
        if isinstance(value, float)
    ]
    report.targets.append(Target("activations that found a warm pool worker", warm_share(st), WARM_SHARE,
                                 unit=" %"))
    report.targets += [
        Target("64 MiB restore vs memcpy into fresh memory", pk["restore_bytes_per_s"] / pk["memcpy_bytes_per_s"],
               RESTORE_VS_MEMCPY),
        Target("first run_wasm after activation vs a warm one", pk["first_run_s"] / pk["warm_run_s"],
               FIRST_RUN_VS_WARM, higher_is_better=False),
    ]
    if ray is not None:
        report.targets.append(Target("Ray actor creation + first call vs an activation (p50)",
                                     ray / max(1e-9, st["ping_cold_p50_s"] or 1e-9), 1.0))
    report.targets += [
        Target("registrations/s with durable state", r["registrations_per_s"], REGISTRATIONS_PER_S, unit="/s"),
        Target(f"restart to ready with {total} stored tenants", r["restart_s"], RESTART_READY_S,
               higher_is_better=False, unit=" s"),
        Target("status page + summary (client)", r["status_page_s"], STATUS_S, higher_is_better=False, unit=" s"),
        Target("twt status", r["twt_status_s"], STATUS_S, higher_is_better=False, unit=" s"),
        Target("RSS per registered tenant", r["rss_per_tenant"], RSS_PER_TENANT, higher_is_better=False, unit=" B"),
    ]
    if "metrics_s" in r:
        report.targets += [
            Target("/metrics scrape", r["metrics_s"], METRICS_S, higher_is_better=False, unit=" s"),
            Target("/metrics size", float(r["metrics_bytes"]), METRICS_BYTES, higher_is_better=False, unit=" B"),
        ]
    report.data.update(r)
    return report.emit(as_json=args.json)


def _rss_report(args: argparse.Namespace, r: dict[str, Any]) -> int:
    """``--rss-only``: the registration and the supervisor's footprint per registered tenant."""
    report = Report("density")
    rows: list[list[object]] = [
        [f"registrations/s ({args.tenants} tenants, instances=0, {args.clients} clients, durable)",
         r["registrations_per_s"]],
        ["supervisor RSS (MiB), before the tenants", r["rss0_bytes"] / MiB],
        ["supervisor RSS (MiB), with them", r["rss_bytes"] / MiB],
        ["RSS per registered tenant (bytes)", r["rss_per_tenant"]],
        ["open fds (per registered tenant)", f"{r['fds']} ({r['fds_per_tenant']:.2f})"],
        ["/dev/shm segments (per registered tenant)", f"{r['segments']} ({r['segments_per_tenant']:.2f})"],
        ["load average (1 min) after", os.getloadavg()[0]],
    ]
    report.sections.append((f"{args.tenants + args.active} registered tenants ({args.active} with a worker), "
                            "stub backend", format_table(["figure", "value"], rows)))
    report.targets += [
        Target("registrations/s with durable state", r["registrations_per_s"], REGISTRATIONS_PER_S, unit="/s"),
        Target("RSS per registered tenant", r["rss_per_tenant"], RSS_PER_TENANT, higher_is_better=False, unit=" B"),
    ]
    report.data.update(r)
    return report.emit(as_json=args.json)


def _first_run_report(args: argparse.Namespace) -> int:
    """``--first-run-only``: the first-run figures alone, on a supervisor of their own."""
    pk = parking.measure_first_run(args.rounds)
    ms = 1000.0
    report = Report("density")
    rows: list[list[object]] = [
        [f"first run_wasm after activation / warm, p50 over {pk['first_run_rounds']} activations (ms), "
         f"load {pk['load_before']:.1f}-{pk['load_after']:.1f}", f"{pk['first_run_s'] * ms:.2f} / {pk['warm_run_s'] * ms:.2f}"],
        ["  first / warm of each activation, p50 (x)", pk["first_run_ratio_p50"]],
        ["  its module came from the artifact (no compile)", pk["first_run_cached"]],
        ["  without an artifact (a module compiled at that run) (ms)", pk["first_run_compiling_s"] * ms],
        ["  the waking ping's activation: bind / restore / whole, p50 (ms)",
         " / ".join(f"{pk[f'first_run_{k}_ms_p50']:.2f}" for k in ("bind", "restore", "activate"))],
    ]
    report.sections.append(("first run after activation, stub backend", format_table(["figure", "value"], rows)))
    report.targets.append(Target("first run_wasm after activation vs a warm one", pk["first_run_s"] / pk["warm_run_s"],
                                 FIRST_RUN_VS_WARM, higher_is_better=False))
    report.data.update(pk)
    return report.emit(as_json=args.json)
