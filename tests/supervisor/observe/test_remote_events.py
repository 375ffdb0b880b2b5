"""Events for remote clients: the ``events`` op over the CURVE TCP frontend, scoped by capability."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.capability import TenantCapability, write_capability_file
from shared.errors import InvalidArgument, TenantIsolationViolation
from shared.spec import TenantSpec
from supervisor.client.api import SupervisorClient
from supervisor.client.event_follow import MISSED
from tests.helpers import zygote
from tests.helpers.cluster import supervisor

LOOPBACK = "tcp://127.0.0.1:0"
ROOT = str(Path(__file__).resolve().parents[3])


def _remote(info: dict[str, Any], **kw: Any) -> SupervisorClient:
    return SupervisorClient.remote(info["listen"][0], str(info["server_public_key"]), timeout_s=20, **kw)


def _until(stream: Iterator[dict[str, Any]], want: Any, what: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Read ``stream`` until ``want(event)``; every event read on the way (the stream ends itself
    after its own timeout, a deadline bounds the rest)."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    for event in stream:
        seen.append(event)
        if want(event):
            return seen
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s: {seen}"
    raise AssertionError(f"the stream ended without {what}: {seen}")


def test_remote_admin_follows_a_crash_and_the_restart() -> None:
    with supervisor([{"name": "acme"}], listen=[LOOPBACK], allow_remote_admin=True) as sup:
        with _remote(sup.info, admin=sup.admin_capability) as rc:
            stream = rc.events(["exit", "restart", "ready"], timeout_s=30)
            first = rc.events_page(None)  # the cursor of now; the stream took its own
            sup.client.inject_fault(None, "acme", "crash")
            seen = _until(stream, lambda e: e["event"] == "ready", "ready after the restart")
            stream.close()
            kinds = [e["event"] for e in seen]
            assert kinds == ["exit", "restart", "ready"], seen
            assert seen[0]["tenant"] == "acme" and seen[0]["expected"] is False
            assert seen[1]["restarts"] == 1 and seen[2]["incarnation"] == 2
            assert [e["seq"] for e in seen] == sorted(e["seq"] for e in seen) and seen[0]["seq"] > first["next"]
        assert sup.client.status().supervisor.internal_errors == 0


def test_a_remote_tenant_sees_its_own_events_and_never_another_tenants() -> None:
    with supervisor([{"name": "acme"}, {"name": "beta"}], listen=[LOOPBACK]) as sup:
        c = sup.client
        acme = c.tenant_capability(None, "acme")
        with _remote(sup.info) as rc:
            with pytest.raises(TenantIsolationViolation, match="allow_remote_admin"):
                rc.events_page(sup.admin_capability)
            stream = rc.events(timeout_s=30, replay=True, cap=acme)
            c.inject_fault(None, "beta", "crash")
            c.set_quota(None, "beta", memory_quota_bytes=1 << 30)
            c.set_quota(None, "acme", memory_quota_bytes=1 << 29)
            c.inject_fault(None, "acme", "crash")
            seen = _until(stream, lambda e: e["event"] == "ready" and e.get("incarnation") == 2, "acme's restart")
            stream.close()
            assert "beta" not in json.dumps(seen), seen
            assert {e["tenant"] for e in seen} == {"acme"}
            kinds = [e["event"] for e in seen]
            assert kinds[:2] == ["register", "ready"] and "set_quota" in kinds and "fault" in kinds
            assert {"exit", "restart"} <= set(kinds) and "spawn" not in kinds
            # the admin's view has beta's crash; acme's page of everything has none of it
            admin_kinds = [(e["event"], e.get("tenant")) for e in c.events_page(None, 0)["events"]]
            assert ("exit", "beta") in admin_kinds and ("spawn", None) in admin_kinds
            assert "beta" not in json.dumps(rc.events_page(acme, 0))
            # evicted, then the name registered again: the new holder sees none of the old events
            c.evict(None, "acme")
            with pytest.raises(TenantIsolationViolation):
                rc.events_page(acme, 0)
            again = c.register(None, TenantSpec("acme"))
            page = rc.events_page(again, 0)
            assert [e["event"] for e in page["events"]] == ["register", "ready"], page
            assert page["events"][0]["generation"] == again.generation
        assert c.status().supervisor.internal_errors == 0


def test_a_failed_tenant_still_reads_why() -> None:
    with supervisor([{"name": "loopy", "max_restarts": 0}], listen=[LOOPBACK]) as sup:
        loopy = sup.client.tenant_capability(None, "loopy")
        with _remote(sup.info) as rc:
            stream = rc.events(["exit", "failed"], timeout_s=30, cap=loopy)
            sup.client.inject_fault(None, "loopy", "crash")
            seen = _until(stream, lambda e: e["event"] == "failed", "failed")
            stream.close()
            assert [e["event"] for e in seen] == ["exit", "failed"] and seen[1]["tenant"] == "loopy"
            assert rc.events_page(loopy, 0, kinds=["failed"])["events"][0]["reason"] == seen[1]["reason"]


def test_a_follower_behind_the_ring_is_told_what_it_missed() -> None:
    with supervisor([{"name": "acme"}], listen=[LOOPBACK], event_log_size=16) as sup:
        c = sup.client
        acme = c.tenant_capability(None, "acme")
        with _remote(sup.info) as rc:
            stream = rc.events(["set_quota"], timeout_s=30, cap=acme)
            first = rc.events_page(acme)
            c.set_quota(None, "acme", memory_quota_bytes=1 << 20)
            assert _until(stream, lambda e: e["event"] == "set_quota", "the first set_quota")[-1]["seq"] > first["next"]
            for i in range(40):  # while the follower reads nothing: a flood of events, a ring of 16
                c.set_quota(None, "acme", memory_quota_bytes=(2 + i) << 20)
            seen = _until(stream, lambda e: e.get("memory_quota_bytes") == 41 << 20, "the last set_quota")
            stream.close()
            gap = [e for e in seen if e["event"] == MISSED]
            assert len(gap) == 1 and gap[0]["missed"] >= 40 - 16 and "event_log_size" in gap[0]["reason"]
            assert seen[0] is gap[0]  # reported before the events after it
            page = rc.events_page(acme, first["next"])
            assert page["missed"] > 0 and len(page["events"]) <= 16
            # the admin's view after the flood: the ring held its size
            everything = c.events_page(None, 0)
            assert len(everything["events"]) == 16 and everything["missed"] == everything["next"] - 16


BAD_ARGS = [
    {"after": -1}, {"after": "x"}, {"after": True}, {"after": 10**12}, {"max": 0}, {"max": -5}, {"max": 1.5},
    {"kinds": "exit"}, {"kinds": [1, 2]}, {"kinds": ["exit"] * 100}, {"kinds": ["x" * 1000]}, {"log": 7},
    {"log": "x" * 100},
]


def test_bad_arguments_get_typed_errors_and_never_hurt_the_supervisor() -> None:
    with supervisor([{"name": "acme"}], listen=[LOOPBACK]) as sup:
        acme = sup.client.tenant_capability(None, "acme")
        with _remote(sup.info) as rc:
            for args in BAD_ARGS:
                with pytest.raises(InvalidArgument, match="events"):
                    rc.call("events", acme, args)
                with pytest.raises(InvalidArgument, match="events"):
                    sup.client.call("events", sup.admin_capability, args)
            assert rc.ping(acme).tenant == "acme"
            assert rc.events_page(acme, 0)["events"][0]["event"] == "register"
        assert sup.client.status().supervisor.internal_errors == 0


def test_no_or_forged_capability_is_refused() -> None:
    with supervisor([{"name": "acme"}], listen=[LOOPBACK], allow_remote_admin=True) as sup:
        acme = sup.client.tenant_capability(None, "acme").to_bytes()
        forged = acme[:-1] + bytes([acme[-1] ^ 1])
        with _remote(sup.info) as rc:
            for cap in (None, forged, b"\x01\x02"):
                with pytest.raises(TenantIsolationViolation):
                    rc.call("events", cap, {"after": 0})
            assert rc.events_page(acme, 0)["events"]
        denied = [e for e in sup.client.events_page(None, 0, kinds=["denied"])["events"]]
        assert {e["reason"] for e in denied} >= {"missing", "forged"}, denied


def test_twt_events_follows_a_remote_supervisor(tmp_path: Path) -> None:
    with supervisor([{"name": "acme"}], listen=[LOOPBACK], allow_remote_admin=True) as sup:
        admin_file, acme_file = tmp_path / "admin.cap", tmp_path / "acme.cap"
        write_capability_file(admin_file, sup.admin_capability)
        acme = sup.client.tenant_capability(None, "acme")
        assert isinstance(acme, TenantCapability)
        write_capability_file(acme_file, acme)
        sup.client.register(None, TenantSpec("beta"))
        remote = ["--connect", sup.info["listen"][0], f"--server-key={sup.info['server_public_key']}"]
        base = [sys.executable, "-m", "supervisor", "events", "--replay", "--timeout", "1", "--json", *remote]
        admin = zygote.run([*base, "--admin-cap", str(admin_file)], timeout=120, cwd=ROOT)
        assert admin.returncode == 0, admin.stderr
        kinds = {(json.loads(line)["event"], json.loads(line).get("tenant")) for line in admin.stdout.splitlines()}
        assert {("register", "acme"), ("register", "beta"), ("ready", "beta")} <= kinds
        tenant = zygote.run([*base, "--capability", str(acme_file)], timeout=120, cwd=ROOT)
        assert tenant.returncode == 0, tenant.stderr
        lines = [json.loads(line) for line in tenant.stdout.splitlines()]
        assert lines and {e["tenant"] for e in lines} == {"acme"} and "beta" not in tenant.stdout
        # without the admin capability a remote follower of every event is told what to do
        refused = zygote.run(base, timeout=120, cwd=ROOT)
        assert refused.returncode != 0 and "admin" in refused.stderr and "Traceback" not in refused.stderr


def test_twt_events_prints_a_gap_line(tmp_path: Path) -> None:
    with supervisor([{"name": "acme"}], event_log_size=16) as sup:
        for i in range(30):
            sup.client.set_quota(None, "acme", memory_quota_bytes=(1 + i) << 20)
        out = zygote.run([sys.executable, "-m", "supervisor", "events", "--replay", "--timeout", "0.5",
                          "--filter", "set_quota", "--run-dir", sup.run_dir], timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert " missed " in lines[0] and "event(s) not shown" in lines[0], lines
        assert sum(" set_quota " in line for line in lines) <= 16
