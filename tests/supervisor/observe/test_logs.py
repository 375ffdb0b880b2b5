"""Structured lifecycle logs: ``--log-format json`` gives one JSON object per line on the supervisor's
stderr (its workers' lines included), with worker spawn/ready/exit and context create/destroy events."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.log import configure_logging
from shared.quota import QuotaBlock
from shared.spec import TenantSpec
from supervisor.client.launch import launch
from tests.helpers.cluster import FAST, instance_pid, wait_for

pytestmark = pytest.mark.timeout(60)


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        assert line.strip(), f"blank line {n}"
        obj = json.loads(line)  # every line is one JSON object
        assert isinstance(obj, dict), line
        assert {"ts", "level", "logger", "event", "pid"} <= set(obj), line
        out.append(obj)
    return out


def _find(records: list[dict[str, Any]], event: str, **fields: Any) -> list[dict[str, Any]]:
    return [r for r in records if r["event"] == event and all(r.get(k) == v for k, v in fields.items())]


def test_json_logs_of_the_supervisor_and_its_workers(tmp_path: Path) -> None:
    log = tmp_path / "supervisor.log"
    with open(log, "ab") as err:
        settings = {**FAST, "log_format": "json"}
        with launch({"supervisor": settings, "tenant": [{"name": "acme"}]}, stderr=err, log_level="info",
                    start_method="spawn") as sup:
            sup_pid = sup.pid
            c = sup.client
            c.register(None, TenantSpec.from_dict({"name": "beta"}))
            beta_pid = instance_pid(sup, "beta")
            acme_pid = instance_pid(sup, "acme")
            assert beta_pid is not None and acme_pid is not None
            os.kill(beta_pid, signal.SIGKILL)
            wait_for(lambda: (p := instance_pid(sup, "beta")) is not None and p != beta_pid, what="beta restarted")
            c.evict(None, "acme")
    records = _records(log)
    # the supervisor's own lifecycle
    assert _find(records, "supervisor.ready", pid=sup_pid)
    assert _find(records, "supervisor.stopped", pid=sup_pid)
    # worker spawn / ready / exit, as the supervisor saw them (the worker pid is field_pid:
    # "pid" is the process that wrote the line)
    for worker_pid, tid in ((acme_pid, "acme"), (beta_pid, "beta")):
        spawn = _find(records, "event.spawn", field_pid=worker_pid)
        assert spawn and spawn[0]["pid"] == sup_pid and spawn[0]["logger"] == "twt.supervisor.observe.events"
        assert spawn[0]["method"] == "spawn" and spawn[0]["worker"]
        ready = _find(records, "event.ready", field_pid=worker_pid, tenant=tid, instance=0)
        assert ready and ready[0]["startup_ms"] > 0 and ready[0]["level"] == "info"
    killed = _find(records, "event.exit", field_pid=beta_pid)
    assert len(killed) == 1
    assert killed[0]["signal"] == 9 and killed[0]["exit_code"] is None and killed[0]["expected"] is False
    assert killed[0]["cause"] == "signal"  # the twt_worker_exits_total label, in the event too
    assert killed[0]["level"] == "warning" and killed[0]["tenant"] == "beta" and killed[0]["instance"] == 0
    assert _find(records, "event.restart", tenant="beta", instance=0, restarts=1)
    evicted = _find(records, "event.exit", field_pid=acme_pid)
    assert len(evicted) == 1 and evicted[0]["exit_code"] == 0 and evicted[0]["expected"] is True
    assert evicted[0]["level"] == "info" and evicted[0]["reason"] == "evicted"
    assert evicted[0]["cause"] == "stop"
    # context create / destroy, logged by the worker processes themselves (the crate's spans)
    created = _find(records, "context.create", tenant="acme", instance=0, backend="stub")
    assert len(created) == 1 and created[0]["pid"] == acme_pid and created[0]["logger"] == "twt.worker.context"
    assert isinstance(created[0]["duration_ms"], (int, float)) and created[0]["duration_ms"] >= 0
    destroyed = _find(records, "context.destroy", tenant="acme", instance=0, backend="stub")
    assert len(destroyed) == 1 and destroyed[0]["pid"] == acme_pid and destroyed[0]["duration_ms"] >= 0
    assert "released_bytes" in destroyed[0]
    # beta: one context per incarnation; the SIGKILLed one never got to destroy its context
    assert len(_find(records, "context.create", tenant="beta")) == 2
    assert not _find(records, "context.destroy", tenant="beta", pid=beta_pid)
    assert len(_find(records, "context.destroy", tenant="beta")) == 1  # the restarted one, at shutdown
    assert all(isinstance(r["ts"], float) and r["level"] in ("debug", "info", "warning", "error") for r in records)


def test_text_logs_are_one_line_per_event(tmp_path: Path) -> None:
    log = tmp_path / "supervisor.log"
    with open(log, "ab") as err:
        with launch({"supervisor": {**FAST, "log_format": "text"}, "tenant": [{"name": "acme"}]}, stderr=err,
                    log_level="info") as sup:
            pid = instance_pid(sup, "acme")
    lines = log.read_text().splitlines()
    assert any(" INFO twt.supervisor.observe.events event.spawn " in s and f"pid={pid}" in s for s in lines)
    assert any(" INFO twt.worker.context context.create tenant=acme instance=0 backend=stub duration_ms=" in s
               for s in lines)
    assert not any(s.lstrip().startswith("{") for s in lines)


@pytest.fixture
def twt_logger() -> Iterator[None]:
    root = logging.getLogger("twt")
    saved = (list(root.handlers), root.level, root.propagate)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    root.propagate = saved[2]


def test_quota_underflow_is_a_structured_warning(twt_logger: None) -> None:
    stream = io.StringIO()
    configure_logging("json", logging.INFO, stream)
    with QuotaBlock.create("acme", gpu_memory_bytes_cap=1 << 20) as block:
        block.consume_gpu_bytes(100)
        block.release_gpu_bytes(300)  # more than held: saturates at 0, counted, logged
        snap = block.snapshot()
        name = block.name
    assert snap.gpu_bytes_in_use == 0 and snap.gpu_underflows == 1
    (record,) = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert record["event"] == "quota.underflow" and record["level"] == "warning"
    assert record["tenant"] == "acme" and record["resource"] == "gpu" and record["released"] == 300
    assert record["in_use"] == 100 and record["segment"] == name and record["pid"] == os.getpid()
