"""``twt bench scrape``: does scraping the metrics port slow a tenant down?

A real supervisor (stub backend, ``metrics_addr`` on loopback) serves one
tenant, beside ``--tenants`` idle ones (``instances = 0``: a quota block and
their series each, no worker) so that a render weighs what it does on a busy
node. The tenant pings one request at a time (the same raw DEALER and
header bytes as ``twt bench route``), in rounds: quiet, then while a second
process scrapes ``/metrics`` at ``--scrape-rate`` a second (a new connection
each, as Prometheus does), alternating so both see the same machine state.

The metrics page is rendered at most ``metrics_renders_per_s`` times a second
(``--renders-per-s``, default the setting's default); scrapes in between get
the latest render. ``--renders-per-s 1000`` renders nearly every scrape, as
the exporter did before the bound (93-167 scrapes a second then raised a
tenant's ping p99 from 1-7 ms to 35-139 ms).

Target: the tenant's ping p99 while scraped <= 1.5x its quiet p99, each
pooled over all rounds (the phases interleave, so both see the same machine;
a round's own p99 - its 10th-largest of 1,000 - swings too much on a shared
host to be the figure). The p50 ratio and the median of per-round p99 ratios
are shown. Also shown: scrapes answered, refused, and renders counted
by the supervisor (``twt_metrics_renders_total``).
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import TypedDict

import zmq

from shared import protocol as proto
from shared.spec import TenantSpec
from supervisor.client.launch import launch
from supervisor.tools.bench._report import (Report, Target, at_least, count, format_table, per_second, percentile,
                                             socket_rtts_us)
from supervisor.tools.bench._children import forked_context

__all__ = ["main"]

#: the helpers are forks of a preloaded fork server (supervisor.tools.bench._children)
_CTX = forked_context(__name__)
#: the target: ping p99 while scraped over the quiet p99
P99_LIMIT = 1.5


class ScrapeResult(TypedDict):
    """What the scraping process reports: scrapes answered 200, other answers or failures, seconds scraping."""

    ok: int
    failed: int
    seconds: float


def _scrape_loop(port: int, rate: float, go: Event, stop: Event, out: Queue[ScrapeResult]) -> None:
    """The scraping process: ``rate`` GET /metrics a second while ``go`` is set, until ``stop``."""
    ok = failed = 0
    scraping_s = 0.0
    while not stop.is_set():
        if not go.wait(0.05):
            continue
        t0 = time.monotonic()
        i = 0
        while go.is_set() and not stop.is_set():
            due = t0 + i / rate
            now = time.monotonic()
            if due > now:
                time.sleep(due - now)
            i += 1
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                conn.request("GET", "/metrics")
                resp = conn.getresponse()
                resp.read()
                conn.close()
                if resp.status == 200:
                    ok += 1
                else:
                    failed += 1
            except OSError:
                failed += 1
        scraping_s += time.monotonic() - t0
    out.put(ScrapeResult(ok=ok, failed=failed, seconds=scraping_s))


def _renders(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    for line in text.splitlines():
        if line.startswith("twt_metrics_renders_total "):
            return int(float(line.split()[1]))
    return -1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twt bench scrape", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--scrape-rate", type=per_second, default=200.0, help="scrapes a second (default 200)")
    parser.add_argument("--renders-per-s", type=per_second, default=None,
                        help="the supervisor's metrics_renders_per_s (default: the setting's default)")
    parser.add_argument("--tenants", type=at_least(0), default=100,
                        help="idle tenants beside the pinged one (instances = 0: their quota blocks and series, "
                             "no workers), so a render weighs what it does on a busy node (default 100)")
    parser.add_argument("--rounds", type=count, default=10)
    parser.add_argument("--per-round", type=count, default=1000, help="pings per round and side")
    args = parser.parse_args(argv)

    settings: dict[str, object] = {"pool_size": 0, "log_level": "warning", "metrics_addr": "127.0.0.1:0"}
    if args.renders_per_s is not None:
        settings["metrics_renders_per_s"] = args.renders_per_s
    report = Report("scrape")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    with launch({"supervisor": settings, "tenant": []}, backend="stub") as sup:
        cap = sup.client.register(sup.admin_capability, TenantSpec("bench", requests_per_s=1e9))
        for i in range(args.tenants):
            sup.client.register(sup.admin_capability, TenantSpec.from_dict({"name": f"idle{i}", "instances": 0}))
        port = int(str(sup.info["metrics_url"]).rsplit(":", 1)[1].split("/")[0])
        header = proto.encode_request(1, "ping", cap.to_bytes(), {})
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"ipc://{sup.run_dir}/frontend.ipc")
        go, stop = _CTX.Event(), _CTX.Event()
        results: Queue[ScrapeResult] = _CTX.Queue()
        scraper = _CTX.Process(target=_scrape_loop, args=(port, args.scrape_rate, go, stop, results),
                                 name="twt-bench-scraper", daemon=True)
        scraper.start()
        quiet: list[float] = []
        scraped: list[float] = []
        p99_ratios: list[float] = []
        try:
            socket_rtts_us(sock, header, 300)  # warm up
            renders0 = _renders(port)
            t_run = time.monotonic()
            for _ in range(args.rounds):
                q = socket_rtts_us(sock, header, args.per_round)
                go.set()
                time.sleep(0.2)  # the scrape loop at its pace before the pings are timed
                sc = socket_rtts_us(sock, header, args.per_round)
                go.clear()
                time.sleep(0.1)
                quiet += q
                scraped += sc
                p99_ratios.append(percentile(sc, 0.99) / percentile(q, 0.99))
            run_s = time.monotonic() - t_run
            stop.set()
            result = results.get(timeout=60)
            renders = _renders(port) - renders0 - 1  # the last one is this read's own
        finally:
            stop.set()
            scraper.join(30)
            if scraper.is_alive():
                scraper.kill()
            sock.close(0)

    q50, q99 = percentile(quiet, 0.5), percentile(quiet, 0.99)
    s50, s99 = percentile(scraped, 0.5), percentile(scraped, 0.99)
    rate = result["ok"] / result["seconds"] if result["seconds"] > 0 else 0.0
    report.sections.append(("tenant ping round trip (us), one at a time", format_table(
        ["while", "p50", "p99", "n"],
        [["quiet", q50, q99, len(quiet)], [f"scraped at {args.scrape_rate:g}/s", s50, s99, len(scraped)]])))
    report.sections.append(("the scrape loop", format_table(
        ["what", "value"],
        [["scrapes answered 200", result["ok"]], ["scrapes refused or failed", result["failed"]],
         ["scrapes a second (achieved)", rate], ["renders (twt_metrics_renders_total)", renders],
         ["renders a second, over the run (the bound: metrics_renders_per_s)", renders / run_s]])))
    p99_ratio = s99 / q99
    report.sections.append(("ratios, scraped / quiet", format_table(
        ["what", "ratio"],
        [["p50 (pooled)", s50 / q50], ["p99 (pooled: the target)", p99_ratio],
         ["p99 (median of per-round ratios)", statistics.median(p99_ratios)]])))
    report.targets += [
        Target("ping p99 while scraped vs quiet (pooled over interleaved rounds)", p99_ratio, P99_LIMIT,
               higher_is_better=False),
    ]
    report.data.update(
        rtt_us={"quiet": {"p50": q50, "p99": q99}, "scraped": {"p50": s50, "p99": s99}},
        p50_ratio=s50 / q50, p99_ratio=p99_ratio, p99_round_ratios=p99_ratios,
        scrape={"rate": args.scrape_rate, "achieved": rate, "ok": result["ok"], "failed": result["failed"],
                "renders": renders},
    )
    return report.emit(as_json=args.json)
