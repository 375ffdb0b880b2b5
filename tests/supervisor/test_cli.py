"""The operator CLI (status, top, events, register, capability, evict, set-quota, scale, fault)
against real supervisors: as subprocesses where the process boundary matters (exit codes, no
traceback, the event stream), in process (``main()``) elsewhere to spare the two CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from shared.capability import TenantCapability
from shared.errors import GpuMemoryExhausted
from shared.records import PoolRecord, StatusRecord, SupervisorRecord, TenantRecord
from shared.sizes import format_size
from shared.spec import TenantSpec
from supervisor.cli import EXIT_UNAVAILABLE, build_parser, main
from supervisor.cli.admin import parse_param
from supervisor.cli.events import format_event
from supervisor.cli.status import format_duration, render
from tests.helpers.cluster import instance_pid, supervisor, tenant, wait_for

pytestmark = pytest.mark.timeout(90)

MY_COMMANDS = ("status", "top", "events", "register", "capability", "evict", "set-quota", "scale", "fault")


def _twt(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------- no supervisor


def test_help_on_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    names = set(sub.choices)
    assert set(MY_COMMANDS) <= names
    for name in sorted(names):
        with pytest.raises(SystemExit) as exc:
            main([name, "--help"])
        assert exc.value.code == 0, name
        out = capsys.readouterr().out
        assert out.startswith(f"usage: twt {name}"), out
        if name in MY_COMMANDS:
            assert "--run-dir" in out, name
    proc = _twt("--help")
    assert proc.returncode == 0 and all(n in proc.stdout for n in MY_COMMANDS)


def test_commands_without_a_supervisor_exit_3(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = str(tmp_path / "nothing-here")
    stale = tmp_path / "stale"
    stale.mkdir(mode=0o700)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(10)
    (stale / "supervisor.json").write_text(json.dumps({"pid": dead.pid}))
    invocations = [
        ["status"], ["status", "--json"], ["top", "--iterations", "1"], ["events", "--timeout", "0.2"],
        ["register", "acme"], ["capability", "acme"], ["evict", "acme"], ["set-quota", "acme", "--gpu-cap", "1GiB"],
        ["scale", "acme", "2"], ["fault", "acme", "crash"],
    ]
    for run_dir, why in ((missing, "not running"), (str(stale), "not running")):
        for argv in invocations:
            code, out, err = _run(capsys, *argv, "--run-dir", run_dir)
            assert code == EXIT_UNAVAILABLE, (argv, code, err)
            assert err.startswith(f"twt: no supervisor at {run_dir}") and why in err, err
            assert "Traceback" not in err and out == ""
    # the real process boundary: no traceback, exit 3, one clear line
    proc = _twt("status", "--run-dir", missing)
    assert proc.returncode == 3 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"twt: no supervisor at {missing}: no supervisor.json "
                                                "(not running, or not ready yet)"]
    env_proc = subprocess.run([sys.executable, "-m", "supervisor", "top", "--iterations", "1"], capture_output=True,
                              text=True, timeout=30, env={**os.environ, "TWT_RUN_DIR": missing})
    assert env_proc.returncode == 3 and missing in env_proc.stderr and "Traceback" not in env_proc.stderr


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rd = str(tmp_path / "none")
    for argv, needle in [
        (["set-quota", "acme", "--gpu-cap", "lots"], "invalid size 'lots'"),
        (["register", "acme", "--memory-quota", "-5"], "--memory-quota"),
        (["scale", "acme", "-1"], "must not be negative"),
        (["fault", "acme", "explode"], "invalid choice"),
        (["fault", "acme", "slow", "--param", "nokey"], "KEY=VALUE"),
        (["events", "--filter", "bogus"], "unknown event kind"),
        (["top", "--interval", "0"], "positive"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--run-dir", rd])
        assert exc.value.code == 2, argv
        assert needle in capsys.readouterr().err, argv
    # semantic usage errors found before any supervisor is contacted
    for argv, needle in [
        (["set-quota", "acme"], "needs at least one of"),
        (["register"], "needs a TENANT"),
        (["fault", "acme", "slow", "--param", "ms=1", "--param", "ms=2"], "twice"),
    ]:
        code, _, err = _run(capsys, *argv, "--run-dir", rd)
        assert code == 2 and needle in err and "Traceback" not in err, (argv, err)


def test_rendering_helpers() -> None:
    assert [format_duration(s) for s in (None, 5, 65, 3725, 90000)] == ["-", "5s", "1m05s", "1h02m", "1d01h"]
    assert parse_param("ms=500") == ("ms", 500)
    assert parse_param("bytes=64MiB") == ("bytes", 64 << 20)
    assert parse_param("ratio=0.5") == ("ratio", 0.5)
    assert parse_param("loud=true") == ("loud", True)
    assert parse_param("name=x y") == ("name", "x y")
    line = format_event({"event": "exit", "ts": 1_700_000_000.25, "tenant": "acme", "instance": 0, "pid": 42,
                         "exit_code": None, "signal": 9, "reason": "killed by signal 9", "expected": False,
                         "reclaimed_cpu": 0, "reclaimed_gpu": 1 << 20})
    assert "exit" in line and "acme/0" in line and "pid=42 signal=9(SIGKILL)" in line
    assert 'reason="killed by signal 9"' in line and "reclaimed_gpu=1MiB" in line
    assert "exit_code" not in line and "reclaimed_cpu" not in line and ".250" in line
    assert "pool" in format_event({"event": "spawn", "ts": 0.0, "worker": "w1", "pid": 7})
    sup = SupervisorRecord(1, "r", "stub", "", "spawn", 1, 1.0, "/run", PoolRecord(0, 0, 2), 0, 0)
    assert render(StatusRecord(sup)).splitlines()[-1] == "no tenants registered"


# ------------------------------------------------------------- with a supervisor


def test_status_json_and_table_reflect_real_counters(capsys: pytest.CaptureFixture[str]) -> None:
    with supervisor([{"name": "acme", "gpu_memory_bytes_cap": "1MiB", "memory_quota_bytes": "64MiB"}]) as sup:
        c = sup.client
        cap = c.tenant_capability(None, "acme")
        h1 = c.alloc(cap, 512 << 10)
        c.alloc(cap, 256 << 10)
        with pytest.raises(GpuMemoryExhausted):
            c.alloc(cap, 512 << 10)
        c.free(cap, h1)
        pid = instance_pid(sup, "acme")
        proc = _twt("status", "--json", "--run-dir", sup.run_dir)
        assert proc.returncode == 0, proc.stderr
        status = StatusRecord.from_wire(json.loads(proc.stdout))  # the JSON is the wire record
        rec = tenant(status, "acme")
        assert status.supervisor.pid == sup.pid
        assert rec.state == "running" and rec.pids == (pid,)
        assert rec.gpu_bytes_in_use == 256 << 10 and rec.gpu_memory_bytes_cap == 1 << 20
        assert rec.quota.gpu_high_water == 768 << 10
        assert rec.quota.gpu_refusals == 1 and rec.quota.cpu_refusals == 0
        assert rec.memory_quota_bytes == 64 << 20
        now = tenant(c.status(), "acme")
        assert all(getattr(rec, f) == getattr(now, f) for f in TenantRecord.__dataclass_fields__ if f.endswith("bytes"))
        # the human table says the same, in human sizes
        code, out, err = _run(capsys, "status", "--run-dir", sup.run_dir)
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0].startswith(f"supervisor pid {sup.pid}  backend stub  start spawn")
        row = next(line for line in lines if line.startswith("acme "))
        cells = row.split()
        assert cells[:4] == ["acme", "running", "1/1", str(pid)]
        assert cells[4:8] == [f"{format_size(rec.bytes_in_use)}/64MiB", "256KiB/1MiB",
                              f"{format_size(rec.quota.cpu_high_water)}/768KiB", "0/1"]
        assert cells[8] == "0"
        code, out, _ = _run(capsys, "status", "acme", "--json", "--run-dir", sup.run_dir)
        assert code == 0 and json.loads(out)["tenant_id"] == "acme"
        code, _, err = _run(capsys, "status", "nobody", "--run-dir", sup.run_dir)
        assert code == 1 and "UnknownTenant" in err
        # twt top: N frames, no ANSI codes when not on a terminal
        code, out, _ = _run(capsys, "top", "--iterations", "2", "--interval", "0.05", "--run-dir", sup.run_dir)
        assert code == 0 and out.count("twt top - ") == 2 and out.count("\nacme ") == 2 and "\x1b" not in out


def _reader(stream: object, into: queue.Queue[str]) -> threading.Thread:
    def pump() -> None:
        for line in stream:  # type: ignore[attr-defined]
            into.put(line.rstrip("\n"))

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    return t


def _wait_line(lines: queue.Queue[str], seen: list[str], pred: object, timeout_s: float, what: str) -> str:
    deadline = time.monotonic() + timeout_s
    for line in seen:
        if pred(line):  # type: ignore[operator]
            return line
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.1)
        except queue.Empty:
            continue
        seen.append(line)
        if pred(line):  # type: ignore[operator]
            return line
    raise AssertionError(f"no {what} line within {timeout_s} s; got {seen!r}")


def test_events_show_a_sigkilled_worker_exit_and_its_restart() -> None:
    with supervisor([{"name": "acme"}]) as sup:
        c = sup.client
        base = [sys.executable, "-m", "supervisor", "events", "--timeout", "3", "--run-dir", sup.run_dir]
        text = subprocess.Popen(base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        as_json = subprocess.Popen([*base, "--json", "--filter", "exit,restart", "--filter", "set_quota",
                                    "--tenant", "acme"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        qt: queue.Queue[str] = queue.Queue()
        qj: queue.Queue[str] = queue.Queue()
        readers = [_reader(text.stdout, qt), _reader(as_json.stdout, qj)]
        try:
            seen_t: list[str] = []
            seen_j: list[str] = []

            # both followers are subscribed once they print an event we cause
            def both_subscribed() -> bool:
                c.set_quota(None, "acme", memory_quota_bytes=1 << 30)
                try:
                    _wait_line(qt, seen_t, lambda s: "set_quota" in s, 0.3, "set_quota")
                    _wait_line(qj, seen_j, lambda s: "set_quota" in s, 0.3, "set_quota")
                except AssertionError:
                    return False
                return True

            wait_for(both_subscribed, timeout_s=30, interval_s=0, what="event followers subscribed")
            pid = instance_pid(sup, "acme")
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            exit_line = _wait_line(qt, seen_t, lambda s: " exit " in s and f"pid={pid}" in s, 15, "exit")
            assert "acme/0" in exit_line and "signal=9(SIGKILL)" in exit_line and "expected=False" in exit_line
            restart = _wait_line(qt, seen_t, lambda s: " restart " in s, 15, "restart")
            assert "acme/0" in restart and "restarts=1" in restart
            _wait_line(qt, seen_t, lambda s: " ready " in s and "acme/0" in s, 15, "ready after restart")
            ev = json.loads(_wait_line(qj, seen_j, lambda s: '"exit"' in s, 15, "json exit"))
            assert ev["event"] == "exit" and ev["signal"] == 9 and ev["exit_code"] is None
            assert ev["pid"] == pid and ev["tenant"] == "acme" and ev["expected"] is False
            ev = json.loads(_wait_line(qj, seen_j, lambda s: '"restart"' in s, 15, "json restart"))
            assert ev["event"] == "restart" and ev["tenant"] == "acme" and ev["instance"] == 0
            # --timeout: both end by themselves after 3 s without a matching event
            assert text.wait(30) == 0 and as_json.wait(30) == 0
            for proc in (text, as_json):
                assert proc.stderr is not None and proc.stderr.read() == ""
            for reader in readers:
                reader.join(10)
            kinds = [json.loads(s)["event"] for s in seen_j + _drain(qj)]
            assert set(kinds) <= {"exit", "restart", "set_quota"}
        finally:
            for proc in (text, as_json):
                if proc.poll() is None:
                    proc.kill()
                proc.wait(10)
            for reader in readers:
                reader.join(10)  # EOF once the process is gone; then the pipes can be closed
            for proc in (text, as_json):
                for pipe in (proc.stdout, proc.stderr):
                    if pipe is not None:
                        pipe.close()


def _drain(q: queue.Queue[str]) -> list[str]:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def test_events_count_not_reached_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with supervisor() as sup:
        code, out, err = _run(capsys, "events", "--count", "1", "--timeout", "0.3", "--run-dir", sup.run_dir)
        assert code == 1 and out == "" and "only 0 of 1 event(s)" in err


def test_admin_commands_end_to_end(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    toml = tmp_path / "tenants.toml"
    toml.write_text('[supervisor]\nbackend = "stub"\n\n'
                    '[[tenant]]\nname = "gamma"\nmemory_quota_bytes = "256MiB"\ngpu_memory_bytes_cap = "2MiB"\n\n'
                    '[[tenant]]\nname = "delta"\n')
    cap_file = tmp_path / "gamma.cap"
    with supervisor() as sup:
        rd = ["--run-dir", sup.run_dir]
        c = sup.client
        # register with flags: the capability is printed as hex and works
        code, out, err = _run(capsys, "register", "acme", "--gpu-cap", "1MiB", "--memory-quota", "64MiB",
                              "--instances", "2", "--restart", "on-failure", *rd)
        assert code == 0, err
        acme = TenantCapability.from_bytes(bytes.fromhex(out.strip()))
        assert c.ping(acme).tenant == "acme"
        rec = tenant(c.status(), "acme")
        assert len(rec.pids) == 2 and rec.gpu_memory_bytes_cap == 1 << 20
        assert rec.spec.restart == "on-failure" and rec.memory_quota_bytes == 64 << 20
        code, _, err = _run(capsys, "register", "acme", *rd)
        assert code == 1 and "AlreadyRegistered" in err
        # register from a TOML file (the supervisor's own config works), flags override, --cap-out 0600
        code, _, err = _run(capsys, "register", "--file", str(toml), *rd)
        assert code == 2 and "holds 2 tenants (gamma, delta)" in err
        code, out, err = _run(capsys, "register", "gamma", "--file", str(toml), "--instances", "2",
                              "--cap-out", str(cap_file), *rd)
        assert code == 0, err
        assert out.strip() == f"gamma: capability written to {cap_file}"
        assert stat.S_IMODE(os.stat(cap_file).st_mode) == 0o600
        gamma = TenantCapability.from_bytes(bytes.fromhex(cap_file.read_text().strip()))
        assert c.ping(gamma).tenant == "gamma"
        # the file --cap-out wrote is what `twt run --capability` reads (hex text; legacy raw bytes too)
        wat = tmp_path / "one.wat"
        wat.write_text('(module (func (export "one") (result i32) i32.const 1))')
        code, out, err = _run(capsys, "run", "gamma", str(wat), "--invoke", "one", "--capability", str(cap_file), *rd)
        assert code == 0 and "results: [1]" in out, err
        raw_file = tmp_path / "gamma.raw"
        raw_file.write_bytes(gamma.to_bytes())
        code, out, err = _run(capsys, "run", "gamma", str(wat), "--invoke", "one", "--capability", str(raw_file), *rd)
        assert code == 0 and "results: [1]" in out, err
        # a capability naming another tenant is refused before anything runs, naming both
        code, out, err = _run(capsys, "run", "acme", str(wat), "--invoke", "one", "--capability", str(cap_file), *rd)
        assert code == 2 and out == ""
        assert f"--capability {cap_file} is the capability of tenant 'gamma', not of 'acme'" in err
        code, _, err = _run(capsys, "run", "acme", str(tmp_path / "missing.wat"), "--invoke", "one", *rd)
        assert code == 1 and err.strip() == f"twt: error: {tmp_path / 'missing.wat'} does not exist"
        rec = tenant(c.status(), "gamma")
        assert rec.memory_quota_bytes == 256 << 20 and rec.gpu_memory_bytes_cap == 2 << 20
        assert len(rec.instances) == 2
        code, out, _ = _run(capsys, "capability", "gamma", "--json", *rd)
        assert code == 0 and json.loads(out)["capability"] == cap_file.read_text().strip()
        # set-quota: live, human sizes in and out, "none" removes the cap
        code, out, err = _run(capsys, "set-quota", "acme", "--gpu-cap", "512KiB", *rd)
        assert code == 0 and "GPU cap 512KiB" in out and "memory quota 64MiB" in out, err
        with pytest.raises(GpuMemoryExhausted):
            c.alloc(acme, 600 << 10)
        # below current use: accepted, and the command says what is in use
        c.alloc(acme, 256 << 10)
        code, out, err = _run(capsys, "set-quota", "acme", "--gpu-cap", "128KiB", *rd)
        assert code == 0, err
        assert "acme: note: 256KiB of GPU memory is in use, above the new limit of 128KiB" in out
        code, out, _ = _run(capsys, "set-quota", "acme", "--gpu-cap", "none", "--pool-quota", "1GiB", *rd)
        assert code == 0 and "GPU cap none" in out and "pool quota 1GiB" in out
        c.alloc(acme, 600 << 10)
        code, out, err = _run(capsys, "set-quota", "ghost", "--gpu-cap", "1MiB", *rd)
        assert code == 1 and "UnknownTenant" in err
        # scale down and wait until exactly one process is left
        pids = tenant(c.status(), "gamma").pids
        code, out, err = _run(capsys, "scale", "gamma", "1", "--wait", "--timeout", "30", *rd)
        assert code == 0 and "gamma: 1 instance(s), 1 ready" in out, err
        wait_for(lambda: not psutil.pid_exists(pids[1]) or psutil.Process(pids[1]).status() == psutil.STATUS_ZOMBIE,
                 what="scaled-away worker gone")
        # fault: a crash is answered once the process is gone; the on-failure policy restarts it
        old = instance_pid(sup, "acme", 1)
        code, out, err = _run(capsys, "fault", "acme", "crash", "--instance", "1", *rd)
        assert code == 0 and f"fault crash -> acme/1 (pid {old})" in out and "signal=9" in out, err
        wait_for(lambda: (p := instance_pid(sup, "acme", 1)) is not None and p != old, what="acme/1 restarted")
        code, out, _ = _run(capsys, "fault", "acme", "slow", "--param", "ms=1", "--json", *rd)
        assert code == 0 and json.loads(out)["armed"] == {"kind": "slow", "ms": 1}
        code, _, err = _run(capsys, "fault", "acme", "slow", "--instance", "9", *rd)
        assert code == 1 and "InvalidArgument" in err
        # evict: workers stopped, capability revoked; a second evict is a clear failure
        code, out, err = _run(capsys, "evict", "gamma", *rd)
        assert code == 0 and out.startswith("evicted gamma (workers stopped: "), err
        code, _, err = _run(capsys, "evict", "gamma", *rd)
        assert code == 1 and err.strip() == "twt: UnknownTenant: unknown tenant 'gamma'"
        assert [t.tenant_id for t in c.status().tenants] == ["acme"]


def test_register_cap_out_checked_before_registering(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with supervisor() as sup:
        code, _, err = _run(capsys, "register", "acme", "--cap-out", str(tmp_path / "no" / "such" / "dir" / "x.cap"),
                            "--run-dir", sup.run_dir)
        assert code == 2 and "does not exist" in err
        assert sup.client.status().tenants == ()  # nothing was registered
        spec = TenantSpec.from_dict({"name": "beta"})
        sup.client.register(None, spec)
        code, out, _ = _run(capsys, "capability", "beta", "--run-dir", sup.run_dir)
        assert code == 0 and sup.client.ping(TenantCapability.from_bytes(bytes.fromhex(out.strip())))


def test_operations_doc_covers_every_command_setting_and_event() -> None:
    from shared.config import ENV_PREFIX, SupervisorConfig
    from supervisor.cli.events import KINDS

    doc = (Path(__file__).resolve().parents[2] / "docs" / "OPERATIONS.md").read_text()
    for name in SupervisorConfig.field_names():
        if name == "config_file":
            continue  # not a setting: where the settings came from (--config)
        assert f"| `{name}` |" in doc, name
        if name != "tenants":
            assert f"`{ENV_PREFIX}{name.upper()}`" in doc, name
    for name in TenantSpec.field_names():
        assert f"`{name}`" in doc, name
    for kind in KINDS:
        assert f"| `{kind}` |" in doc, kind
    for command in (*MY_COMMANDS, "supervise", "mps"):
        assert f"### `twt {command}`" in doc, command
    for command in ("alloc", "free", "buffers", "write", "read"):
        assert f"`twt {command}`" in doc.split("## Exit codes", 1)[0], command
    sizing = doc.split("## Sizing", 1)[1]
    assert "PLACEHOLDER" not in sizing and "TBD" not in sizing  # measured figures are in


def test_a_bug_is_an_internal_error_never_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import supervisor.cli.status as status_cmd
    from shared.exitcodes import EXIT_INTERNAL

    def broken(args: Any) -> int:
        return len(None)  # type: ignore[arg-type] - the bug: a TypeError deep inside a command

    monkeypatch.setattr(status_cmd, "run", broken)
    assert main(["status"]) == EXIT_INTERNAL == 70
    err = capsys.readouterr().err
    assert "twt: internal error: TypeError" in err and "Traceback" in err
