"""Operator-facing states and signals: a tenant whose work is done is ``completed`` (not an alert),
event follows stay out of the request metrics, a failed reload is never announced as reloaded, and
the status table names host memory as the metrics do."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import tempfile
import threading
import urllib.request
from pathlib import Path

import pytest

from shared import protocol as proto
from shared.errors import WorkerLost
from supervisor.cli.status import HEADERS, exit_status, render
from supervisor.client.launch import launch
from tests.helpers.cli import twt
from tests.helpers.cluster import FAST, supervisor, tenant, wait_for
from tests.helpers.tmp import short_temp_dir

pytestmark = pytest.mark.timeout(120)


def test_an_on_failure_tenant_whose_worker_exits_0_is_completed_and_healthy() -> None:
    with supervisor([{"name": "batch", "restart": "on-failure"}, {"name": "crashy", "restart": "on-failure"}]) as sup:
        c = sup.client
        c.inject_fault(None, "batch", "exit", code=0)
        rec = wait_for(lambda: (t := tenant(c.status(), "batch")).state == "completed" and t, what="completed")
        assert rec.restarts == 0 and not rec.pids
        assert exit_status([rec]) == 0  # twt status: nothing to alert on
        out = twt("status", "batch", "--run-dir", sup.run_dir)
        assert out.returncode == 0 and "completed" in out.stdout, out
        # a failure is still one: exit 3 is restarted (on-failure) and the tenant runs again
        first = tenant(c.status(), "crashy").pids
        c.inject_fault(None, "crashy", "exit", code=3)
        again = wait_for(lambda: (t := tenant(c.status(), "crashy")).state == "running" and t.pids != first and t,
                         what="crashy restarted")
        assert again.restarts == 1
        # a request says how to run it again; restarted, the completed tenant serves once more
        batch = c.tenant_capability(None, "batch")
        with pytest.raises(WorkerLost, match="twt restart batch"):
            c.ping(batch)
        c.restart_tenant(None, "batch")
        wait_for(lambda: tenant(c.status(), "batch").state == "running", what="batch running again")
        assert c.ping(batch).tenant == "batch"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_event_follows_stay_out_of_the_request_metrics() -> None:
    assert "events" not in proto.METERED_OPS and "ping" in proto.METERED_OPS
    port = _free_port()
    with supervisor([{"name": "acme"}], metrics_addr=f"127.0.0.1:{port}") as sup:
        c = sup.client
        acme = c.tenant_capability(None, "acme")
        for _ in range(20):  # what a follower does every 0.2 s
            c.events_page(acme, 0)
            c.events_page(None, 0)
        c.ping(acme)

        def request_lines() -> list[str]:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
            return [ln for ln in text.splitlines() if ln.startswith(("twt_requests_total{", "twt_request_duration"))]

        # the page is a render at most 1/metrics_renders_per_s old: wait for one made after the ping
        requests = wait_for(lambda: (lines := request_lines()) and any('op="ping"' in ln for ln in lines) and lines,
                            what="a render that counts the ping")
        assert not [ln for ln in requests if 'op="events"' in ln], requests


def test_a_failed_reload_is_not_announced_as_reloaded(tmp_path: Path) -> None:
    where = tempfile.mkdtemp(prefix="twt-n", dir=short_temp_dir())  # AF_UNIX paths are short
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    received: queue.Queue[dict[str, str]] = queue.Queue()
    done = threading.Event()

    def listen() -> None:
        while not done.is_set():
            try:
                data = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            received.put(dict(line.split("=", 1) for line in data.decode().splitlines()))

    def next_with(key: str) -> dict[str, str]:
        while True:
            fields = received.get(timeout=60)
            if key in fields:
                return fields

    config = tmp_path / "tenants.toml"
    settings = "".join(f"{k} = {v!r}\n".replace("'", '"').replace("True", "true").replace("False", "false")
                       for k, v in FAST.items())
    config.write_text(f"[supervisor]\n{settings}\n[[tenant]]\nname = \"acme\"\n")
    try:
        address = os.path.join(where, "notify")
        sock.bind(address)
        sock.settimeout(0.2)
        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        env = {**os.environ, "NOTIFY_SOCKET": address}
        with launch(str(config), env=env, run_dir=os.path.join(where, "run")) as sup:
            assert next_with("READY")["READY"] == "1"
            good = config.read_text()
            config.write_text(good + "[[tenant]\n")  # not TOML: refused, nothing changes
            sup.process.send_signal(signal.SIGHUP)
            assert next_with("RELOADING")["RELOADING"] == "1"
            after = next_with("READY")  # systemd ends the reload at READY=1, failed or not
            assert "reloaded" not in after["STATUS"] and "reload failed" in after["STATUS"], after
            assert "TOML" in after["STATUS"]
            config.write_text(good + "[[tenant]]\nname = \"beta\"\n")
            sup.process.send_signal(signal.SIGHUP)
            assert next_with("RELOADING")["RELOADING"] == "1"
            assert next_with("READY")["STATUS"].endswith("; reloaded")
            wait_for(lambda: {t.tenant_id for t in sup.client.status().tenants} == {"acme", "beta"},
                     what="beta registered by the good reload")
    finally:
        done.set()
        sock.close()
        shutil.rmtree(where, ignore_errors=True)


def test_the_status_table_says_host_where_the_metrics_say_host() -> None:
    assert not [h for h in HEADERS if "CPU" in h]
    assert "HOST USED/LIMIT" in HEADERS and "HIGH HOST/GPU" in HEADERS and "REFUSED HOST/GPU" in HEADERS
    with supervisor([{"name": "acme"}]) as sup:
        text = render(sup.client.status())
        header = next(line for line in text.splitlines() if line.startswith("TENANT "))
        assert "HOST USED/LIMIT" in header
