"""The metrics port cannot be used against the supervisor: bounded connections, deadlines, fds in the
budget, renders at a bounded rate, an optional bearer token.

Before: a thread and a descriptor per connection with a 10 s idle timeout; ~1,000 slow connections under
a 1,024-fd limit and the next local ZeroMQ connection aborted the supervisor (libzmq on EMFILE), each
unfinished 64 KiB head pinned ~6 MB, and every scrape rendered (and asked the loop for a snapshot).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import socket
import stat
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.config import SupervisorConfig, load_config
from shared.errors import ConfigError
from supervisor.host.fdlimit import fd_budget, max_reservation, reserve_fds, reserved_fds
from supervisor.observe.http_auth import BearerToken
from supervisor.observe.http_server import MAX_HEAD_BYTES, OVERHEAD_FDS
from supervisor.observe.metrics import MetricsSnapshot
from supervisor.observe.prometheus import (DEFAULT_MAX_CONNECTIONS, DEFAULT_RENDERS_PER_S, DEFAULT_REQUEST_TIMEOUT_S,
                                           PrometheusMetrics)
from tests.helpers.cluster import supervisor, wait_for
from tests.helpers.slow_http import SlowClients

pytestmark = pytest.mark.timeout(120)

#: a head that never ends: the request line and one header, no blank line
SLOW_HEAD = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
#: far past MAX_HEAD_BYTES, never ended either (under the old server's 64 KiB line limit: it waited for the rest)
BIG_HEAD = b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * (60 << 10)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(url: str, token: str | None = None, timeout: float = 10.0) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as err:
        return int(err.code), err.read().decode()


def _scrape_ok(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
    """The page's samples if a scrape is answered 200 now; None if it is refused (busy) or fails."""
    try:
        code, text = _get(url, timeout=5)
    except OSError:
        return None
    return _samples(text) if code == 200 else None


def _refused(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], reason: str) -> float:
    return samples[("twt_metrics_http_refused_total", (("reason", reason),))]


@contextmanager
def _nofile_at_least(n: int) -> Iterator[None]:
    """This test process may hold ``n`` descriptors (its soft limit raised as far as needed), or skip."""
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    if old[0] != resource.RLIM_INFINITY and old[0] < n:
        if old[1] != resource.RLIM_INFINITY and old[1] < n:
            pytest.skip(f"this test holds {n} sockets; the hard RLIMIT_NOFILE is {old[1]}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


# ------------------------------------------------------------------ the supervisor under attack


def test_1000_slow_connections_under_a_256_fd_limit_never_abort_the_supervisor() -> None:
    """The finding at a small scale: the supervisor's fd limit lowered to 256, 1,000 connections to the
    metrics port that never finish their head, and new local ZeroMQ clients all the while. Before, the
    port's threads took every descriptor and libzmq aborted on the next ipc accept (``Too many open
    files (src/ipc_listener.cpp:297)``, exit -6, seen here within 5 s)."""
    with supervisor([{"name": "bystander"}], log_level="error", metrics_addr="127.0.0.1:0",
                    metrics_request_timeout_s=30.0) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "bystander")
        url = c.info["metrics_url"]
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        resource.prlimit(sup.pid, resource.RLIMIT_NOFILE, (256, 256))
        wait_for(lambda: c.status().supervisor.fd_limit == 256, timeout_s=15, what="the lowered limit seen")
        # the port's bound follows the limit within a second (an eighth of it, less its own fds)
        limit = max_reservation(256) - OVERHEAD_FDS
        wait_for(lambda: (s := _scrape_ok(url)) is not None and s[("twt_metrics_http_connection_limit", ())] == limit,
                 what="the metrics port's bound follows the fd limit")
        peak_fds = 0

        def new_client_served() -> None:
            nonlocal peak_fds
            peak_fds = max(peak_fds, psutil.Process(sup.pid).num_fds())
            with sup.connect(timeout_s=30) as late:  # a new ipc connection: the abort of the finding
                assert late.ping(cap).tenant == "bystander"

        n = 1000
        with _nofile_at_least(n + 200), SlowClients(("127.0.0.1", port), n, SLOW_HEAD) as slow:
            # the request deadline is long here: the connections the port holds stay held
            slow.pump_until(lambda: (new_client_served(), slow.ended() >= n - limit)[1], 60,
                            "the connections past the bound closed at accept")
            slow.pump(0.5)
            assert 0 < n - slow.ended() <= limit  # the rest are held, to their deadline
            codes = slow.codes()
            assert set(codes) <= {503, None}  # busy, or closed before the answer was read
            for _ in range(3):
                new_client_served()
            assert c.ping(cap).tenant == "bystander"
            assert peak_fds < 256
            assert c.status().supervisor.internal_errors == 0
        assert sup.process.poll() is None, "the supervisor died"
        # a page rendered after the flood (the one before may be served for up to a second) counts
        # every connection answered busy
        wait_for(lambda: (s := _scrape_ok(url)) is not None and _refused(s, "max_connections") >= codes.get(503, 0) > 0,
                 what="a scrape served once the slow clients left, counting them")
        assert c.ping(cap).tenant == "bystander"


def test_2000_slow_connections_and_200_oversized_heads_leave_the_supervisor_serving() -> None:
    """2,000 connections that never finish their head, then 200 unfinished heads of 60 KiB: the port holds at most
    its bound (the rest are closed at accept), cuts the slow ones at the request deadline, answers the big
    ones 431 after 8 KiB; the supervisor's descriptors and RSS stay bounded and a tenant is served
    throughout. Before: a thread and an fd per connection, ~6 MB per unfinished 64 KiB head."""
    with supervisor([{"name": "bystander"}], log_level="error", metrics_addr="127.0.0.1:0",
                    metrics_request_timeout_s=1.0) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "bystander")
        url = c.info["metrics_url"]
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        proc = psutil.Process(sup.pid)
        assert _scrape_ok(url) is not None  # warm: the render path has run once
        fds0, rss0 = proc.num_fds(), proc.memory_info().rss
        peak_fds = peak_rss = 0
        pings = 0

        def watch() -> None:
            nonlocal peak_fds, peak_rss, pings
            peak_fds = max(peak_fds, proc.num_fds())
            peak_rss = max(peak_rss, proc.memory_info().rss)
            assert c.ping(cap).tenant == "bystander"
            pings += 1

        with _nofile_at_least(2600):
            with SlowClients(("127.0.0.1", port), 2000, SLOW_HEAD) as slow:
                watch()
                # every one ends: closed at accept (past the bound) or cut at the 1 s deadline
                slow.pump_until(lambda: (watch(), slow.all_ended())[1], 90, "every slow connection closed")
                assert set(slow.codes()) <= {503, None}
            with SlowClients(("127.0.0.1", port), 200, BIG_HEAD) as big:
                big.pump_until(lambda: (watch(), big.all_ended())[1], 90, "every oversized head answered")
                codes = big.codes()
                assert set(codes) <= {431, 503, None} and codes.get(431, 0) >= 1, codes
        assert sup.process.poll() is None, "the supervisor died"
        assert pings >= 2
        # descriptors: the port's bound and its own few, never one per connection
        assert peak_fds - fds0 <= DEFAULT_MAX_CONNECTIONS + OVERHEAD_FDS + 16, (peak_fds, fds0)
        assert peak_rss - rss0 < 64 << 20, (peak_rss, rss0)  # 200 x 64 KiB heads held would be far more
        after = wait_for(lambda: (s := _scrape_ok(url)) is not None and _refused(s, "head_too_large") >= 1 and s,
                         what="a normal scrape served afterwards, from a page rendered after the attack")
        assert _refused(after, "max_connections") >= 1
        assert _refused(after, "deadline") >= 1
        assert after[("twt_metrics_http_connections", ())] <= 2
        assert c.status().supervisor.internal_errors == 0


def test_a_client_sending_a_byte_at_a_time_is_cut_at_the_request_deadline() -> None:
    """Slowloris: each byte arrives well within any idle timeout, the head never ends. The deadline is
    for the whole request, so the connection is closed at it (the per-read timeout of 10 s never was)."""
    metrics = PrometheusMetrics("127.0.0.1:0", process_metrics=False, request_timeout_s=1.0)
    try:
        with socket.create_connection(("127.0.0.1", metrics.port), timeout=5) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
            t0 = time.monotonic()
            closed = False
            while time.monotonic() - t0 < 30:  # a hang guard: the deadline is 1 s
                try:
                    s.sendall(b"X")
                except OSError:
                    closed = True
                    break
                s.settimeout(0.2)
                try:
                    if s.recv(100) == b"":
                        closed = True
                        break
                except TimeoutError:
                    continue
                except OSError:
                    closed = True
                    break
            assert closed, "a trickling client kept its connection past the deadline"
            assert time.monotonic() - t0 >= 0.9  # not before it either
        stats = metrics.http.stats
        wait_for(lambda: stats.refused["deadline"] == 1, what="counted as a deadline")
        assert stats.connections == 0
    finally:
        metrics.close()


_EMFILE_CHILD = r"""
import os, resource, sys, time
from supervisor.observe.prometheus import PrometheusMetrics
m = PrometheusMetrics("127.0.0.1:0", process_metrics=False, max_connections=4)
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
print(m.port, flush=True)
sys.stdin.readline()
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")), hard))  # not one fd more
print("low", flush=True)
deadline = time.monotonic() + 60
while m.http.stats.refused["accept_failed"] == 0 and time.monotonic() < deadline:
    time.sleep(0.01)
print(m.http.stats.refused["accept_failed"], flush=True)
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))
sys.stdin.readline()
m.close()
"""


def test_an_accept_the_system_refuses_rests_the_listener_and_serving_resumes() -> None:
    """EMFILE at accept (the process out of descriptors for a moment): counted, the listener rests
    instead of spinning, and the connections waiting in the backlog are served once fds are back."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _EMFILE_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    socks: list[socket.socket] = []
    try:
        assert proc.stdin is not None and proc.stdout is not None
        port = int(proc.stdout.readline())
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "low"
        for _ in range(3):  # in the kernel's backlog: connected before the server accepts them
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            socks.append(s)
            s.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
        assert int(proc.stdout.readline()) >= 1  # counted (and the child raised its limit again)
        for s in socks:  # every one answered by its route: the listener came back
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 503 ") and answer.endswith(b"\r\n\r\nstarting: the supervisor "
                                                                          b"loop has not published a snapshot yet\n"), answer
        code, body = _get(f"http://127.0.0.1:{port}/healthz")
        assert code == 503 and body.startswith("starting")
        proc.stdin.write("\n")
        proc.stdin.close()
        assert proc.wait(30) == 0
    finally:
        for s in socks:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


# ------------------------------------------------------------------ the render rate


def test_renders_are_bounded_in_rate_and_shared_by_concurrent_scrapes() -> None:
    """Counted, not timed: with one render per 100 s, 40 scrapes in a row and 16 at once are all
    served from the first render, and the loop's snapshot is read once."""
    reads = []

    def source() -> MetricsSnapshot:
        reads.append(1)
        return MetricsSnapshot()

    metrics = PrometheusMetrics("127.0.0.1:0", process_metrics=False, renders_per_s=0.01)
    metrics.bind_source(source)
    try:
        pages = {_get(metrics.url)[1] for _ in range(40)}
        with ThreadPoolExecutor(16) as pool:
            pages |= {text for _code, text in pool.map(lambda _: _get(metrics.url), range(16))}
        assert len(pages) == 1  # one page: every scrape got the same render
        assert _samples(pages.pop())[("twt_metrics_renders_total", ())] == 1
        assert metrics.renders == 1 and len(reads) == 1
        # the probes read the same render
        assert _get(f"http://127.0.0.1:{metrics.port}/healthz") == (200, "ok\n")
        assert metrics.renders == 1 and len(reads) == 1
        assert metrics.http.stats.responses[200] == 57
    finally:
        metrics.close()


def test_a_scraper_faster_than_the_rate_gets_at_most_the_rate_of_renders() -> None:
    """At 20 renders a second, a loop of back-to-back scrapes (and parallel ones) gets at most
    1 + 20 per second elapsed renders, each the loop's snapshot read once; and new ones do come."""
    reads = []
    metrics = PrometheusMetrics("127.0.0.1:0", process_metrics=False, renders_per_s=20)
    metrics.bind_source(lambda: (reads.append(1), MetricsSnapshot())[1])
    try:
        t0 = time.monotonic()
        stop = threading.Event()

        def scrape_loop() -> int:
            n = 0
            while not stop.is_set():
                assert _get(metrics.url)[0] == 200
                n += 1
            return n

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(scrape_loop) for _ in range(4)]
            wait_for(lambda: metrics.renders >= 5, what="five renders")
            stop.set()
            scrapes = sum(f.result() for f in futures)
        elapsed = time.monotonic() - t0
        renders = metrics.renders
        assert renders <= 1 + elapsed * 20 + 1, (renders, elapsed)  # the bound (+1 for a render under way)
        assert len(reads) == renders  # the loop is asked once per render, never per scrape
        assert scrapes >= renders  # (on any machine: every render was asked for by a scrape)
    finally:
        metrics.close()


def test_a_render_runs_with_quick_gil_switches_and_a_failed_one_is_an_answer() -> None:
    """During a render the switch interval is low (the loop waits less for the GIL), and put back
    after - also when two caches render at once and when a render raises (published with its error)."""
    import sys

    from supervisor.observe.scrape_cache import RENDER_SWITCH_INTERVAL_S, ScrapeCache

    before = sys.getswitchinterval()
    seen: list[float] = []
    gate = threading.Barrier(2, timeout=30)

    def render() -> bytes:
        seen.append(sys.getswitchinterval())
        gate.wait()  # both caches inside a render at once
        if threading.current_thread().name == "test-render-1":
            raise RuntimeError("a collector failed")
        return b"page"

    published = threading.Semaphore(0)
    caches = [ScrapeCache(render, 1.0, published.release, name=f"test-render-{i}") for i in range(2)]
    try:
        for cache in caches:
            cache.want()
        for _ in caches:
            assert published.acquire(timeout=30)
        assert seen == [min(before, RENDER_SWITCH_INTERVAL_S)] * 2
        assert sys.getswitchinterval() == before
        results = sorted((c.latest for c in caches if c.latest is not None), key=lambda r: r.error or "")
        assert [(r.body, r.error) for r in results] == [(b"page", None), (b"", "RuntimeError('a collector failed')")]
        assert all(c.fresh() is not None for c in caches)
    finally:
        for cache in caches:
            cache.close()


# ------------------------------------------------------------------ the bearer token


def _token_file(tmp_path: Path, token: str, mode: int = 0o600, name: str = "metrics.token") -> str:
    path = tmp_path / name
    path.write_text(token + "\n")
    path.chmod(mode)
    return str(path)


def test_a_bearer_token_guards_metrics_and_never_the_probes(tmp_path: Path) -> None:
    token = "s3cr3t-" + "x" * 32
    metrics = PrometheusMetrics("127.0.0.1:0", process_metrics=False, token_file=_token_file(tmp_path, token))
    metrics.bind_source(MetricsSnapshot)
    base = f"http://127.0.0.1:{metrics.port}"
    try:
        code, body = _get(metrics.url)
        assert code == 401 and "Bearer" in body and "twt_" not in body
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(metrics.url, timeout=10)
        assert info.value.headers["WWW-Authenticate"] == 'Bearer realm="twt-metrics"'
        info.value.close()
        assert _get(metrics.url, token="wrong-" + "x" * 32)[0] == 401
        assert _get(base + "/", token=None)[0] == 401  # "/" is the page too
        code, body = _get(metrics.url, token=token)
        assert code == 200 and "twt_build_info" in body
        req = urllib.request.Request(metrics.url, headers={"Authorization": f"bearer {token}"})  # any case
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
        assert _get(base + "/healthz") == (200, "ok\n")  # probes: no token, ever
        assert _get(base + "/readyz")[0] == 503
        assert metrics.http.stats.refused["unauthorized"] == 4
    finally:
        metrics.close()


def test_the_token_file_is_checked_at_start_and_reread_when_it_changes(tmp_path: Path) -> None:
    for bad, mode, why in (("short", 0o600, "16..4096 visible ASCII"), ("has spaces inside it", 0o600, "visible"),
                           ("y" * 32, 0o644, "readable by others")):
        with pytest.raises(ConfigError, match=why):
            BearerToken(_token_file(tmp_path, bad, mode))
    with pytest.raises(ConfigError, match="cannot be read"):
        BearerToken(str(tmp_path / "missing"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ConfigError, match="not a regular file"):  # never blocks on open
        BearerToken(str(fifo))
    with pytest.raises(ConfigError, match="readable by others"):  # before anything binds
        PrometheusMetrics("127.0.0.1:0", process_metrics=False, token_file=_token_file(tmp_path, "z" * 32, 0o604))
    now = [0.0]
    path = _token_file(tmp_path, "a" * 20)
    token = BearerToken(path, clock=lambda: now[0])
    assert token.accepts("Bearer " + "a" * 20) and not token.accepts(None) and not token.accepts("Basic " + "a" * 20)
    os.replace(_token_file(tmp_path, "b" * 20, name="next"), path)  # a rotated Secret: a new file
    assert token.accepts("Bearer " + "a" * 20)  # read again at most once a second
    now[0] += 1.5
    assert token.accepts("Bearer " + "b" * 20) and not token.accepts("Bearer " + "a" * 20)
    os.replace(_token_file(tmp_path, "c", name="bad"), path)  # unusable: the old one stays
    now[0] += 1.5
    assert token.accepts("Bearer " + "b" * 20)
    os.unlink(path)  # gone for a while (a Secret being swapped): the old one stays
    now[0] += 1.5
    assert token.accepts("Bearer " + "b" * 20)
    _token_file(tmp_path, "d" * 20)  # back, with a new token
    now[0] += 1.5
    assert token.accepts("Bearer " + "d" * 20) and not token.accepts("Bearer " + "b" * 20)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_supervisor_with_a_token_file_from_its_config(tmp_path: Path) -> None:
    token = "t" * 40
    with supervisor([], log_level="error", metrics_addr="127.0.0.1:0",
                    metrics_token_file=_token_file(tmp_path, token)) as sup:
        url = sup.client.info["metrics_url"]
        assert _get(url)[0] == 401
        code, body = _get(url, token=token)
        assert code == 200 and "twt_metrics_renders_total" in body
        base = url.removesuffix("/metrics")
        wait_for(lambda: _get(base + "/readyz") == (200, "ready\n"), what="/readyz without a token")


# ------------------------------------------------------------------ settings and the fd budget


def test_settings_from_the_config_file_with_typed_errors(tmp_path: Path) -> None:
    toml = tmp_path / "tenants.toml"
    toml.write_text('[supervisor]\nmetrics_addr = "127.0.0.1:0"\nmetrics_max_connections = 8\n'
                    'metrics_request_timeout_s = 2.5\nmetrics_renders_per_s = 4\n'
                    'metrics_token_file = "~/token"\n')
    cfg = load_config(toml, environ={})
    assert (cfg.metrics_max_connections, cfg.metrics_request_timeout_s, cfg.metrics_renders_per_s) == (8, 2.5, 4.0)
    assert cfg.metrics_token_file == os.path.expanduser("~/token")
    env = load_config(environ={"TWT_METRICS_MAX_CONNECTIONS": "9", "TWT_METRICS_RENDERS_PER_S": "0.5"})
    assert env.metrics_max_connections == 9 and env.metrics_renders_per_s == 0.5
    toml.write_text('[supervisor]\nmetrics_max_connections = 0\nmetrics_request_timeout_s = -1\n'
                    'metrics_renders_per_s = 5000\nmetrics_token_file = ""\n')
    with pytest.raises(ConfigError) as info:
        load_config(toml, environ={})
    text = str(info.value)
    for name in ("metrics_max_connections", "metrics_request_timeout_s", "metrics_renders_per_s",
                 "metrics_token_file"):
        assert name in text, name
    # the exporter's own defaults are the settings' defaults
    defaults = {f.name: f.default for f in dataclasses.fields(SupervisorConfig)}
    assert (defaults["metrics_max_connections"], defaults["metrics_request_timeout_s"],
            defaults["metrics_renders_per_s"], defaults["metrics_token_file"]) == (
        DEFAULT_MAX_CONNECTIONS, DEFAULT_REQUEST_TIMEOUT_S, DEFAULT_RENDERS_PER_S, None)


def test_the_metrics_port_is_reserved_in_the_fd_budget() -> None:
    """The frontend's budget leaves the port's worst case out, from its construction to its close."""
    before, budget = reserved_fds(), fd_budget(4096)
    metrics = PrometheusMetrics("127.0.0.1:0", process_metrics=False, max_connections=40)
    try:
        assert reserved_fds() - before == 40 + OVERHEAD_FDS
        assert fd_budget(4096) == (4096 - 256 - before - 40 - OVERHEAD_FDS) // 2 < budget
        assert metrics.http.stats.limit == min(40, max_reservation(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
                                               - OVERHEAD_FDS)
    finally:
        metrics.close()
    assert reserved_fds() == before and fd_budget(4096) == budget
    other = reserve_fds("test", 100)
    assert fd_budget(4096) == (4096 - 256 - before - 100) // 2
    other.release()
    other.release()  # idempotent
    assert fd_budget(4096) == budget
    assert MAX_HEAD_BYTES <= 16 << 10
