"""``twt chaos``: the schedule is a function of the seed, the checks catch violations, short campaigns pass."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from shared import protocol as proto
from shared.quota import QuotaSnapshot
from shared.records import InstanceRecord, TenantRecord
from supervisor.tools import chaos
from supervisor.tools.chaos import campaign
from supervisor.tools.chaos import checks as chaos_checks
from supervisor.tools.chaos import (
    Action,
    ChaosConfig,
    Fault,
    Record,
    build_schedule,
    reconcile,
    schedule_hash,
)
from supervisor.cli import main
from tests.helpers.cli import twt
from tests.helpers.cluster import supervisor, wait_for

pytestmark = pytest.mark.timeout(120)

TARGETS = [("faulty-0", 2), ("faulty-1", 2)]


def _twt(*args: str) -> subprocess.CompletedProcess[str]:
    return twt(*args, timeout=100)


# ------------------------------------------------------------------ the schedule


def test_same_seed_same_schedule_and_hash() -> None:
    a = build_schedule(7, chaos.DEFAULT_FAULTS, 2.0, 30.0, TARGETS)
    b = build_schedule(7, chaos.DEFAULT_FAULTS, 2.0, 30.0, TARGETS)
    assert a == b and schedule_hash(a) == schedule_hash(b)
    assert schedule_hash(build_schedule(8, chaos.DEFAULT_FAULTS, 2.0, 30.0, TARGETS)) != schedule_hash(a)
    assert 30 < sum(not f.heal for f in a) < 90  # Poisson at 2/s over 30 s
    assert all(0 <= f.at_s < 30 and f.tenant in ("faulty-0", "faulty-1") and 0 <= f.instance < 2 for f in a)
    assert [f.at_s for f in a] == sorted(f.at_s for f in a)
    # every kind appears, with parameters the worker accepts
    assert {f.kind for f in a} == set(chaos.DEFAULT_FAULTS)
    for f in a:
        params = dict(f.params)
        if f.kind == "slow":
            assert (params["ms"] == 0) == f.heal
        if f.kind == "exit":
            assert 0 <= params["code"] <= 255
    # a heal follows its slow fault on the same instance
    for heal in (f for f in a if f.heal):
        assert any(not f.heal and f.kind == "slow" and (f.tenant, f.instance) == (heal.tenant, heal.instance)
                   and f.at_s < heal.at_s for f in a)
    assert build_schedule(7, chaos.DEFAULT_FAULTS, 0.0, 30.0, TARGETS) == ()
    assert build_schedule(7, chaos.DEFAULT_FAULTS, 2.0, 30.0, []) == ()  # no faulty tenant, no fault


def test_cli_prints_the_schedule_without_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chaos", "--schedule", "--json", "--seed", "5", "--duration", "20", "--faults", "crash,sigkill"]) == 0
    doc = json.loads(capsys.readouterr().out)
    cfg = ChaosConfig(duration_s=20, seed=5, faults=("crash", "sigkill"))
    expected = build_schedule(5, ("crash", "sigkill"), 1.0, cfg.fault_phase, TARGETS)
    assert doc["hash"] == schedule_hash(expected)
    assert [Fault(**{**f, "params": tuple(f["params"].items())}) for f in doc["faults"]] == list(expected)


def test_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="unknown fault"):
        ChaosConfig(faults=("crash", "meteor"))
    with pytest.raises(ValueError, match="healthy"):
        ChaosConfig(tenants=2, faulty=2)
    with pytest.raises(ValueError, match="duration"):
        ChaosConfig(duration_s=0)
    cfg = ChaosConfig(tenants=5)
    assert [r[1] for r in cfg.roles()] == [False, False, True, True, True]
    assert cfg.baseline + cfg.fault_phase == cfg.duration_s
    with pytest.raises(SystemExit) as exc:
        main(["chaos", "--faults", "crash,meteor"])
    assert exc.value.code == 2


# ------------------------------------------------------------------ the checks


def _rec(outcome: str = "ok", latency: float = 0.001, *, healthy: bool = True, phase: str = "faults",
         deadline: float = 2.0, op: str = "read") -> Record:
    return Record("healthy-0" if healthy else "faulty-0", healthy, op, phase, 0.0, latency, outcome, deadline)


def test_checks_catch_each_kind_of_violation() -> None:
    good = [_rec(), _rec(phase="baseline"), _rec("worker_lost", healthy=False)]
    assert chaos_checks._check_answered(good, []).ok
    assert not chaos_checks._check_answered([*good, _rec("lost", healthy=False)], []).ok
    assert not chaos_checks._check_answered([*good, _rec("untyped", healthy=False)], []).ok
    lost_admin = Action(Fault(1.0, "faulty-0", "crash", 0), 0.0, "lost")
    assert not chaos_checks._check_answered(good, [lost_admin]).ok

    assert chaos_checks._check_deadlines([_rec(latency=2.9)], grace_s=1.0).ok
    late = chaos_checks._check_deadlines([_rec("kernel_timeout", latency=3.2, healthy=False)], grace_s=1.0)
    assert not late.ok and "3.200" in late.detail

    assert not chaos_checks._check_data([_rec("wrong_data")]).ok

    healthy = {"healthy-0"}
    assert chaos_checks._check_healthy(good, [], healthy, until=1e12).ok
    assert not chaos_checks._check_healthy([*good, _rec("overloaded")], [], healthy, until=1e12).ok
    death = {"event": "exit", "tenant": "healthy-0", "ts": 5.0, "reason": "killed by signal 9"}
    assert not chaos_checks._check_healthy(good, [death], healthy, until=10.0).ok
    assert chaos_checks._check_healthy(good, [death], healthy, until=4.0).ok  # cleanup (evict) is not a disturbance

    base = [_rec(phase="baseline", latency=0.001)] * 100
    assert chaos_checks._check_latency(chaos.latency_table(base + [_rec(latency=0.0029)] * 100, ["healthy-0"]),
                                ["healthy-0"], 3.0).ok
    slow = chaos.latency_table(base + [_rec(latency=0.0031)] * 100, ["healthy-0"])
    assert not chaos_checks._check_latency(slow, ["healthy-0"], 3.0).ok
    assert chaos_checks._check_latency(slow, ["healthy-0"], None).ok  # reported, not checked
    by_op = chaos_checks.latency_by_op([*base, _rec(latency=0.0031, op="run_wasm"), _rec("worker_lost", healthy=False)])
    assert by_op == {"read": {"baseline": {"n": 100, "p50_ms": 1.0, "p99_ms": 1.0},
                              "faults": {"n": 0, "p50_ms": None, "p99_ms": None}},
                     "run_wasm": {"baseline": {"n": 0, "p50_ms": None, "p99_ms": None},
                                  "faults": {"n": 1, "p50_ms": 3.1, "p99_ms": 3.1}}}


def test_deadline_check_allows_the_hosts_own_request_latency() -> None:
    """Past a deadline the supervisor still stops the worker and answers: a loaded host stretches that as it
    stretches every request, so the bound grows by the healthy tenants' baseline p99 - and no more."""
    late = [_rec("worker_lost", latency=3.4, healthy=False)]  # a 2 s deadline, answered 1.4 s past it
    assert not chaos_checks._check_deadlines(late, grace_s=1.0).ok  # a quiet host's bound: 3 s
    table = chaos.latency_table([_rec(phase="baseline", latency=0.6)] * 100 + [_rec(latency=0.6)] * 100,
                                ["healthy-0"])
    host_ms = chaos_checks.host_request_ms(table, ["healthy-0"])
    assert host_ms == 600.0
    busy = chaos_checks._check_deadlines(late, grace_s=1.0, host_ms=host_ms)
    assert busy.ok and "600 ms" in busy.detail, busy.detail
    assert not chaos_checks._check_deadlines([_rec("worker_lost", latency=3.7, healthy=False)], grace_s=1.0,
                                             host_ms=host_ms).ok  # 3.6 s: beyond even this host's latency
    assert chaos_checks.host_request_ms(chaos.latency_table([], ["healthy-0"]), ["healthy-0"]) is None


def test_death_check_counts_a_faulty_tenants_enforced_run_deadline_apart() -> None:
    """A worker that ends itself because its run's queued GPU work (or compile) outlived the run's deadline
    enforces that deadline: for a faulty tenant (1 s runs, a loaded host's stub device) it is counted, not a
    violation; for a healthy one, and for any other unplanned exit of an unfaulted worker, it is."""
    from shared.exitcodes import WORKER_GPU_QUEUE_OVERRUN

    tenants, healthy = {"faulty-0", "healthy-0"}, {"healthy-0"}

    def exit_(tenant: str, pid: int, code: int | None, ts: float = 1.0) -> dict[str, object]:
        return {"event": "exit", "tenant": tenant, "instance": 0, "pid": pid, "exit_code": code, "ts": ts,
                "expected": False, "reason": f"code {code}"}

    overrun = exit_("faulty-0", 11, WORKER_GPU_QUEUE_OVERRUN)
    check, unexplained, enforced = chaos_checks._check_deaths([overrun], tenants, healthy, set(), until=10.0)
    assert check.ok and (unexplained, enforced) == (0, 1) and "1 more" in check.detail, check.detail
    # the supervisor's kill at a request's deadline (the exit's cause): the same deadline, enforced from outside
    killed = {**exit_("faulty-0", 18, None), "signal": 15, "cause": "deadline"}
    check, unexplained, enforced = chaos_checks._check_deaths([overrun, killed], tenants, healthy, set(), until=10.0)
    assert check.ok and (unexplained, enforced) == (0, 2), check.detail
    for bad in (exit_("healthy-0", 12, WORKER_GPU_QUEUE_OVERRUN), exit_("faulty-0", 13, 1),
                exit_("faulty-0", 14, None), {**exit_("healthy-0", 19, None), "signal": 15, "cause": "deadline"},
                {**exit_("faulty-0", 20, None), "signal": 15, "cause": "heartbeat"}):
        check, unexplained, _ = chaos_checks._check_deaths([overrun, bad], tenants, healthy, set(), until=10.0)
        assert not check.ok and unexplained == 1 and f"pid {bad['pid']}" in check.detail, check.detail
    faulted = exit_("faulty-0", 15, 1)
    assert chaos_checks._check_deaths([faulted], tenants, healthy, {15}, until=10.0)[0].ok  # a fault's death
    later = exit_("faulty-0", 16, 1, ts=20.0)
    assert chaos_checks._check_deaths([later], tenants, healthy, set(), until=10.0)[0].ok  # after the faults
    other = {**exit_("faulty-0", 17, 1), "tenant": "someone-else"}
    assert chaos_checks._check_deaths([other], tenants, healthy, set(), until=10.0)[0].ok  # not ours


def test_latency_check_allows_what_the_host_itself_added() -> None:
    """A host whose own request path (a raw relay) grew slower in the fault phase (restarts beside
    CPU burners) excuses that much; a supervisor that holds a healthy tenant up does not."""
    base = [_rec(phase="baseline", latency=0.001)] * 100
    slow = chaos.latency_table(base + [_rec(latency=0.005)] * 100, ["healthy-0"])  # 5x
    assert not chaos_checks._check_latency(slow, ["healthy-0"], 3.0, (1.0, 1.0)).ok  # the host did not change
    busy = chaos_checks._check_latency(slow, ["healthy-0"], 3.0, (1.0, 3.5))  # 3 ms + 2.5 ms >= 5 ms
    assert busy.ok and "allowance +2.50 ms" in busy.detail, busy.detail
    assert not chaos_checks._check_latency(slow, ["healthy-0"], 3.0, (1.0, 1.5)).ok  # 3 + 0.5 ms, 3 x 1.5 < 5 ms
    assert not chaos_checks._check_latency(slow, ["healthy-0"], 3.0, (3.0, 1.0)).ok  # a quieter host adds nothing
    # the host's round trip twice as slow makes every request of it about twice as slow: 3 x 2 x 1 ms >= 5 ms,
    # where the relay's own growth (+0.2 ms) would not cover it
    twice = chaos_checks._check_latency(slow, ["healthy-0"], 3.0, (0.2, 0.4))
    assert twice.ok and "x2.00" in twice.detail, twice.detail
    assert not chaos_checks._check_latency(slow, ["healthy-0"], 3.0, (0.2, 0.3)).ok  # 3 x 1.5 ms < 5 ms


@pytest.mark.process
def test_relay_probe_reports_each_phase() -> None:
    from supervisor.tools.chaos.relayprobe import RelayProbe

    phase = ["baseline"]
    with RelayProbe(lambda: phase[0]) as probe:
        wait_for(lambda: probe.p99_ms("baseline") is not None, what="probe samples in the baseline")
        phase[0] = "faults"
        wait_for(lambda: probe.p99_ms("faults") is not None, what="probe samples in the fault phase")
    assert probe.p99_ms("cleanup") is None


def _record(instances: list[tuple[int, int, str]], shares: list[tuple[int, int]], gpu: int, cpu: int = 0
            ) -> TenantRecord:
    quota = QuotaSnapshot("faulty-0", "twt-faulty-0", 1, cpu, 1 << 30, 0, 0, 0, gpu, None, 0, 0, 0, None,
                          tuple((i, 0, g) for i, g in shares))
    return TenantRecord(
        "faulty-0", "running", 1,
        instances=tuple(InstanceRecord(i, 100 + i if state == "ready" else None, state, 0, inc, 0, None, False, None)
                        for i, inc, state in instances),
        gpu_bytes_in_use=gpu, bytes_in_use=cpu, quota=quota,
    )


def test_reconcile_counts_live_buffers_and_writes_off_dead_incarnations() -> None:
    h0 = proto.make_handle(0, 3, 1)  # instance 0, incarnation 3 (the running one)
    h1 = proto.make_handle(1, 2, 7)  # instance 1, incarnation 2: it restarted since (now 4)
    live = {h0: 4096, h1: 8192}
    rec = _record([(0, 3, "ready"), (1, 4, "ready")], [(0, 4096)], 4096)
    r = reconcile(rec, live)
    assert r.ok and (r.expected_gpu, r.lost_buffers, r.lost_bytes) == (4096, 1, 8192)
    leak = reconcile(_record([(0, 3, "ready"), (1, 4, "ready")], [(0, 4096), (1, 8192)], 12288), live)
    assert not leak.ok and "instance 1 share 8,192 B, expected 0 B" in "; ".join(leak.problems)
    under = reconcile(_record([(0, 3, "ready"), (1, 4, "ready")], [], 0), live)
    assert not under.ok and "gpu_bytes_in_use 0 B" in under.problems[0]
    cpu = reconcile(_record([(0, 3, "ready"), (1, 4, "ready")], [(0, 4096)], 4096, cpu=65536), live)
    assert not cpu.ok


def test_the_settle_waits_for_each_instance_not_only_the_tenant() -> None:
    """A worker killed for a missed deadline is "stopping" while its tenant runs with nothing in
    flight (the request was answered); its share still holds what that request made (an alloc its
    client was told timed out) until it is reaped. Reconciled then, the share read as drift: a
    four-burner suite run once failed "instance 1 share 73,728 B, expected 0 B" that way. The
    settle waits for every instance's worker to be ready."""
    stopping = _record([(0, 3, "ready"), (1, 2, "stopping")], [(1, 8192)], 8192)
    assert not campaign.is_settled(stopping)
    assert not reconcile(stopping, {}).ok  # the clients hold nothing: what reconciling it then reported
    back = _record([(0, 3, "ready"), (1, 3, "ready")], [], 0)  # reaped, reclaimed, restarted
    assert campaign.is_settled(back) and reconcile(back, {}).ok
    for state in ("restarting", "starting", "binding", "down", "draining"):
        assert not campaign.is_settled(_record([(0, 3, "ready"), (1, 3, state)], [], 0))


def test_cli_exits_4_when_an_invariant_fails(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    def fake(cfg: ChaosConfig, progress: Any = None, live: Any = None) -> dict[str, Any]:
        return {"config": {"seed": cfg.seed, "duration_s": 1, "baseline_s": 0.5, "fault_phase_s": 0.5,
                           "tenants": 2, "faulty": 1, "clients": 2, "rate": 1},
                "schedule": {"hash": "0" * 16, "faults": 0, "by_kind": {}},
                "checks": [{"name": "every request answered", "ok": False, "detail": "1 lost"}],
                "ok": False, "elapsed_s": 1.0}

    monkeypatch.setattr(chaos, "run_chaos", fake)
    assert main(["chaos", "--duration", "1"]) == 4
    assert "FAIL  every request answered: 1 lost" in capsys.readouterr().out


# ------------------------------------------------------------------ campaigns

#: a 6 s fault phase whose schedule holds every default fault kind: 14 faults, at 1.5/s (seed 3's
#: 7.5 s phase of 16 had no crash, segfault or leak). The schedule is a function of the fault phase,
#: not of the baseline; the baseline is only the healthy tenants' reference latency, which these
#: campaigns do not check (``--latency-factor 0``, and ``--grace 10`` leaves no deadline resting on
#: it), so a quarter of a second of it - after every client's warm-up - is workload CPU not spent
#: (each second of a campaign costs ~0.5 s of CPU). One client per tenant (``--clients``; the
#: default is two): the schedule does not depend on the clients, a fault still meets a request in
#: flight, and the three campaigns below take ~2 s less CPU (9.5-9.9 -> 7.3-7.7 s, two runs each);
#: tests/reliability/test_chaos_seeds.py measured one client per tenant catching its bug more often
BASELINE = ("--baseline", "0.25")
SHORT_CAMPAIGN = ("--duration", "6.25", *BASELINE, "--seed", "59", "--rate", "1.5", "--clients", "4")
#: the hash of SHORT_CAMPAIGN's schedule (that of its 6 s fault phase whatever the baseline)
SHORT_CAMPAIGN_HASH = "31216bcd2123e6e6"


@pytest.mark.slow
def test_short_campaign_passes_every_invariant(capsys: pytest.CaptureFixture[str]) -> None:
    """``twt chaos``: its own supervisor, every fault kind, all invariants."""
    # Latency ratios are figures of the campaign (``twt chaos`` checks them by default), not a test
    # assertion: on a loaded 2-core machine a healthy tenant's p99 can exceed 3x its baseline.
    # The deadline grace is generous for the same reason: "answered" is the invariant, "how soon
    # past the deadline" is a statistical bound that a loaded machine stretches.
    proc = _twt("chaos", *SHORT_CAMPAIGN, "--latency-factor", "0", "--grace", "10", "--json")
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(proc.stdout[-4000:] + proc.stderr[-2000:]) from None
    failed = [c for c in report["checks"] if not c["ok"]]
    assert not failed and report["ok"], failed
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {c["name"] for c in report["checks"]} >= {
        "every request answered", "answered within deadline + grace", "data intact", "healthy tenants undisturbed",
        "quota counters equal live allocations", "counters zero after cleanup", "no process or segment leaked",
        "healthy latency (not checked)"}
    assert all(t["healthy"] is False or "p99_ms" in t["latency"]["faults"] for t in report["tenants"])
    # the schedule ``--schedule`` prints for the same arguments is the one the campaign ran (asked in
    # process, as test_cli_prints_the_schedule_without_starting_anything does: the same code path)
    assert main(["chaos", "--schedule", "--json", *SHORT_CAMPAIGN]) == 0
    assert json.loads(capsys.readouterr().out)["hash"] == report["schedule"]["hash"] == SHORT_CAMPAIGN_HASH
    assert set(chaos.DEFAULT_FAULTS) <= set(report["schedule"]["by_kind"])  # every kind, its heals beside
    # the fault phase lasts its 6 s: a loaded machine may end it before the last scheduled fault or
    # two, and serve fewer requests in it (counts of a time window, not invariants)
    assert 1 <= len(report["actions"]) <= report["schedule"]["faults"]
    assert sum(s.get("deaths", 0) for s in report["faults"].values()) >= 1
    assert all(t["errors"] == {} for t in report["tenants"] if t["healthy"])
    assert report["requests"]["total"] > 0
    # the report times its steps (a slow run says which one waited)
    assert {"start", "warm-up", "faults", "heal", "settle", "free", "settle after free", "leak check"} <= set(
        report["phases_s"])


@pytest.mark.slow
def test_campaign_against_a_running_supervisor() -> None:
    """``--run-dir``: its tenants come and go, the supervisor and its other tenants stay."""
    with supervisor([{"name": "bystander"}], start_method="forkserver", pool_size=1, log_level="error") as sup:
        cap = sup.client.tenant_capability(None, "bystander")
        h = sup.client.alloc(cap, 12345)
        # a 3 s fault phase (10 faults) after a short baseline (see SHORT_CAMPAIGN)
        proc = _twt("chaos", "--run-dir", sup.run_dir, "--duration", "3.25", *BASELINE, "--seed", "11", "--rate", "3",
                    "--tenants", "3", "--clients", "3", "--faults", "crash,sigkill,corrupt,oom",
                    "--latency-factor", "0", "--grace", "10", "--json")
        try:
            report = json.loads(proc.stdout)
        except ValueError:
            raise AssertionError(proc.stdout[-4000:] + proc.stderr[-2000:]) from None
        assert report["ok"], [c for c in report["checks"] if not c["ok"]]
        assert proc.returncode == 0 and not report["supervisor"]["started_here"]
        assert report["supervisor"]["pid"] == sup.pid
        status = sup.client.status()
        assert [t.tenant_id for t in status.tenants] == ["bystander"]  # the campaign's tenants evicted
        assert status.tenants[0].gpu_bytes_in_use == 12345 and sup.client.buffers(cap) == {h: 12345}


@pytest.mark.slow
def test_park_and_activate_as_a_nemesis_keep_every_invariant() -> None:
    """``--faults park,sigkill``: tenants park and wake under load and kills; bytes and quota whole."""
    # a 4 s fault phase (5 parks, 3 SIGKILLs) after a short baseline (see SHORT_CAMPAIGN)
    proc = _twt("chaos", "--duration", "4.25", *BASELINE, "--seed", "7", "--rate", "2", "--tenants", "3",
                "--clients", "3", "--faults", "park,sigkill", "--latency-factor", "0", "--grace", "10", "--json")
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(proc.stdout[-4000:] + proc.stderr[-2000:]) from None
    assert report["ok"], [c for c in report["checks"] if not c["ok"]]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert report["faults"]["park"].get("parked", 0) >= 1
    # the faults did what they are for: a tenant parked and its workload woke it
    assert report["parking"]["park"] >= 1 and report["parking"]["activate"] >= 1, report["parking"]


def test_park_is_a_fault_kind_outside_the_defaults() -> None:
    schedule = build_schedule(7, ("park",), 2.0, 20.0, TARGETS)
    assert schedule and all(f.kind == "park" and f.params == () and not f.heal for f in schedule)
    assert "park" in chaos.ALL_FAULTS and "park" not in chaos.DEFAULT_FAULTS


# ------------------------------------------------------------------ seeds that once failed


def test_the_chaos_client_keeps_a_buffer_an_unrelated_invalid_argument_names() -> None:
    from supervisor.tools.chaos.workload import _Buf, _Client

    client = _Client.__new__(_Client)  # only the bookkeeping is exercised
    client.live, client.stale = {7: _Buf(4096, bytearray(4096))}, []
    client.last_detail = "invalid argument: fault 'cuda-fault' needs the cuda backend (this worker runs 'stub')"
    client._after_error(7, "invalid_argument", mutating=False)
    assert 7 in client.live and client.stale == []
    client.last_detail = "invalid argument: buffer handle 0x7 belongs to another worker instance or to one that restarted"
    client._after_error(7, "invalid_argument", mutating=False)
    assert 7 not in client.live and client.stale == [(7, 4096)]
    client.live[8] = _Buf(4096)
    client.last_detail = ""
    client._after_error(8, "buffer_lost", mutating=True)
    assert 8 not in client.live


def test_the_warm_up_skips_a_buffer_op_once_an_error_took_the_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client's warm-up runs each buffer op only while it still has a buffer: a fill whose instance died
    drops the buffer (its handle named a gone incarnation), and the read after it must not pick from an
    empty set (an IndexError that ended the client and failed the campaign's "harness ran to the end")."""
    import threading

    from shared.spec import TenantSpec
    from supervisor.tools.chaos import workload

    client = workload._Client(0, "faulty-0", False, TenantSpec(tenant_id="faulty-0"), None, "", 1,  # type: ignore[arg-type]
                              None, threading.Event(), None, None)  # type: ignore[arg-type]
    calls: list[str] = []

    def alloc() -> None:
        client.live[0x10] = workload._Buf(4096)
        calls.append("alloc")

    def fill() -> None:
        client.live.clear()  # the instance died under the run: the buffer went with it
        calls.append("fill")

    monkeypatch.setattr(client, "op_wasm_job", lambda: calls.append("job"))
    monkeypatch.setattr(client, "op_alloc", alloc)
    monkeypatch.setattr(client, "op_wasm_fill", fill)
    client.warm_up()  # the real op_read: with no buffer it would raise
    assert calls == ["job", "alloc", "fill"]
