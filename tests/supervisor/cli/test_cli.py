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
from typing import Any, TextIO

import psutil
import pytest

from shared.capability import TenantCapability
from shared.errors import GpuMemoryExhausted
from shared.records import PoolRecord, StatusRecord, SupervisorRecord, TenantRecord
from shared.sizes import format_size
from shared.spec import TenantSpec
from supervisor.cli import EXIT_UNAVAILABLE, build_parser, main
from supervisor.cli.commands.inject_fault import parse_param
from supervisor.cli.commands.events import format_event
from supervisor.cli.status import format_duration, render
from tests.helpers.cluster import FAST as FAST_SETTINGS
from tests.helpers import zygote
from tests.helpers.cluster import instance_pid, supervisor, tenant, wait_for
from tests.helpers.tmp import short_temp_dir

pytestmark = pytest.mark.timeout(90)

MY_COMMANDS = ("status", "top", "events", "register", "capability", "evict", "set-quota", "scale", "fault")


def _twt(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """``python -m supervisor ARGS`` as a process of its own (exit code, stdout, stderr), forked from
    the suite's preloaded zygote (tests/helpers/zygote.py): what a fresh interpreter would do."""
    return zygote.run([sys.executable, "-m", "supervisor", *args], timeout=timeout)


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
    from supervisor.tools.demo import DEMO_TENANTS

    assert f"{['no', 'one', 'two', 'three', 'four', 'five', 'six'][len(DEMO_TENANTS)]} tenants" in proc.stdout


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
    env_proc = zygote.run([sys.executable, "-m", "supervisor", "top", "--iterations", "1"], timeout=30,
                          env={**os.environ, "TWT_RUN_DIR": missing})
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
    # the product's default start method, which the table's first line names
    with supervisor([{"name": "acme", "gpu_memory_bytes_cap": "1MiB", "memory_quota_bytes": "64MiB"}],
                    start_method="spawn") as sup:
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


def _forked_follower(argv: list[str], err: Path) -> tuple[subprocess.Popen[bytes], TextIO]:
    """``python -m supervisor ARGV`` forked from the suite's zygote where it can be (the followers'
    output is what is checked, not an interpreter's start): its stdout a pipe read here as text, its
    stderr the file ``err``."""
    r, w = os.pipe()
    try:
        with open(err, "wb") as sink:
            proc = zygote.popen([sys.executable, "-m", "supervisor", *argv], stdin=subprocess.DEVNULL, stdout=w,
                                stderr=sink)
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return proc, os.fdopen(r, "r")


def test_events_show_a_sigkilled_worker_exit_and_its_restart(tmp_path: Path) -> None:
    with supervisor([{"name": "acme"}]) as sup:
        c = sup.client
        base = ["events", "--timeout", "3", "--run-dir", sup.run_dir]
        errs = (tmp_path / "text.err", tmp_path / "json.err")
        text, text_out = _forked_follower(base, errs[0])
        as_json, json_out = _forked_follower([*base, "--json", "--filter", "exit,restart", "--filter", "set_quota",
                                       "--tenant", "acme"], errs[1])
        qt: queue.Queue[str] = queue.Queue()
        qj: queue.Queue[str] = queue.Queue()
        readers = [_reader(text_out, qt), _reader(json_out, qj)]
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
            exit_line = _wait_line(qt, seen_t, lambda s: " exit " in s and f"pid={pid}" in s, 60, "exit")
            assert "acme/0" in exit_line and "signal=9(SIGKILL)" in exit_line and "expected=False" in exit_line
            restart = _wait_line(qt, seen_t, lambda s: " restart " in s, 60, "restart")
            assert "acme/0" in restart and "restarts=1" in restart
            _wait_line(qt, seen_t, lambda s: " ready " in s and "acme/0" in s, 60, "ready after restart")
            ev = json.loads(_wait_line(qj, seen_j, lambda s: '"exit"' in s, 60, "json exit"))
            assert ev["event"] == "exit" and ev["signal"] == 9 and ev["exit_code"] is None
            assert ev["pid"] == pid and ev["tenant"] == "acme" and ev["expected"] is False
            ev = json.loads(_wait_line(qj, seen_j, lambda s: '"restart"' in s, 60, "json restart"))
            assert ev["event"] == "restart" and ev["tenant"] == "acme" and ev["instance"] == 0
            # --timeout: both end by themselves after 3 s without a matching event
            assert text.wait(30) == 0 and as_json.wait(30) == 0
            assert [err.read_text() for err in errs] == ["", ""]
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
            text_out.close()
            json_out.close()


def _drain(q: queue.Queue[str]) -> list[str]:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def test_events_count_not_reached_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with supervisor() as sup:
        # a kind nothing in this test causes: a loaded host's loop stalls are events too (``stall``)
        code, out, err = _run(capsys, "events", "--count", "1", "--timeout", "0.3", "--filter", "evict",
                              "--run-dir", sup.run_dir)
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
        # the limits applied: on stderr, so CAP=$(twt register ...) captures the capability alone
        assert err.startswith("twt: note:") is False and "acme: memory quota 64MiB, GPU cap 1MiB, pool quota none" in err
        assert "2 instance(s), 2 ready" in err
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
        first, limits = out.strip().splitlines()
        assert first == f"gamma: capability written to {cap_file}"
        assert limits.startswith("gamma: memory quota 256MiB, GPU cap 2MiB") and "2 instance(s)" in limits
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
    from supervisor.cli.commands.events import KINDS

    doc = (Path(__file__).resolve().parents[3] / "docs" / "OPERATIONS.md").read_text()
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


# ------------------------------------------------ --connect: honoured or refused, by every command


def _dead_endpoint() -> str:
    """A loopback port nothing listens on (bound for its number, then closed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _admin_cap_file(tmp_path: Path) -> Path:
    from shared.capability import RegistryAdminCapability, mint, write_capability_file

    path = tmp_path / "admin.cap"
    write_capability_file(path, mint(RegistryAdminCapability, os.urandom(32), os.urandom(16), 1))
    return path


#: commands that call a supervisor -> the smallest valid arguments (all take --connect)
_REMOTE_ARGV = {
    "status": [], "top": ["--iterations", "1"], "events": ["--timeout", "0.2"],
    "register": ["acme"], "capability": ["acme"], "evict": ["acme"], "set-quota": ["acme", "--gpu-cap", "1MiB"],
    "scale": ["acme", "2"], "fault": ["acme", "crash"],
    "reload": [], "reset": ["acme"], "restart": ["acme"], "rotate-key": ["--yes"], "version": [],
    "run": ["acme", "MODULE", "--invoke", "one"],
    "alloc": ["acme", "1MiB"], "free": ["acme", "1:1"], "buffers": ["acme"], "write": ["acme", "1:1", "--fill", "1"],
    "read": ["acme", "1:1"],
}
#: commands that act on this host only -> the smallest valid arguments; --connect is refused (exit 2)
_LOCAL_ARGV = {
    "keys": [], "supervise": [], "demo": [], "chaos": [], "mps": [], "cluster": ["status"], "cleanup": ["--dry-run"],
    "state": ["backup", "x.db"],  # reads the state database of this host (SQLite's backup API)
    "build": ["x.c", "-o", "x.wasm"],  # a compiler run on this host; no supervisor at all
    "check-config": ["x.toml"],  # reads a file on this host; no supervisor at all
}


def test_every_command_honours_or_refuses_connect(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Against a port nothing listens on, each command that calls a supervisor fails with exit 3 and
    one line saying the connection was refused (the kernel's answer, not a timeout's); every other
    command refuses --connect (exit 2) rather than silently acting on the local supervisor."""
    import zmq

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(_REMOTE_ARGV) | set(_LOCAL_ARGV) | {"bench"}  # a new command is listed here
    dead = _dead_endpoint()
    key = zmq.curve_keypair()[0].decode()
    module = tmp_path / "one.wat"
    module.write_text('(module (func (export "one") (result i32) i32.const 1))')
    admin = str(_admin_cap_file(tmp_path))
    for name, argv in _REMOTE_ARGV.items():
        argv = [str(module) if a == "MODULE" else a for a in argv]
        assert "--connect" in sub.choices[name].format_help(), name
        code, out, err = _run(capsys, name, *argv, "--connect", dead, f"--server-key={key}", "--admin-cap", admin)
        assert code == EXIT_UNAVAILABLE, (name, code, err)
        assert err.splitlines() == [f"twt: no supervisor at {dead}: connection refused: nothing listens on "
                                    f"{dead.removeprefix('tcp://')}"], (name, err)
        assert out == "", name
    for name, argv in _LOCAL_ARGV.items():
        if name == "keys":  # it has the option group (--run-dir) but reads this host's supervisor only
            code, _, err = _run(capsys, name, "--connect", dead, f"--server-key={key}")
            assert code == 2 and "--connect, --server-key do not apply" in err, err
            continue
        with pytest.raises(SystemExit) as exc:
            main([name, *argv, "--connect", dead])
        assert exc.value.code == 2, name
        assert "unrecognized arguments: --connect" in capsys.readouterr().err, name


def test_server_key_from_a_file_or_a_certificate(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from supervisor.cli._common import server_key_of

    code, out, err = _run(capsys, "keys", "--new-client", str(tmp_path / "srv"))
    assert code == 0, err
    public = (tmp_path / "srv.key").read_text().split('public-key = "')[1].split('"')[0]
    raw = tmp_path / "key.txt"
    raw.write_text(public + "\n")
    assert server_key_of(f"@{raw}") == public
    assert server_key_of(f"@{tmp_path / 'srv.key'}") == public  # a zmq.auth public certificate
    assert server_key_of(f"@{tmp_path / 'srv.key_secret'}") == public  # its pair: the public half
    assert server_key_of(str(tmp_path / "srv.key")) == public  # a certificate's path as it is
    assert server_key_of(f" {public} ") == public
    with pytest.raises(ValueError, match="does not exist"):
        server_key_of(f"@{tmp_path / 'nope'}")
    # '@' is a Z85 character: a key that starts with it is a key, not a file (one key in 85 did)
    at_key = "@" + public[1:]
    assert server_key_of(at_key) == at_key
    # and through a command: a dead port is then the only problem
    code, _, err = _run(capsys, "status", "--connect", _dead_endpoint(), f"--server-key=@{tmp_path / 'srv.key'}")
    assert code == EXIT_UNAVAILABLE and "connection refused" in err, err


def test_keys_are_printed_shell_safe(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A Z85 key holds $ & ( ) < > ...: what twt keys prints pastes into a shell unchanged."""
    import shlex

    import zmq

    from supervisor.admission.curve import CURVE_PUBLIC, CURVE_SECRET
    from supervisor.store.state import StateStore

    while True:  # a key with characters a shell would act on (nearly every key has some)
        public, secret = zmq.curve_keypair()
        if any(c in public.decode() for c in "$&()<>{}*?"):
            break
    state = tmp_path / "state"
    with StateStore.open(str(state)) as store:
        store.put_key(CURVE_SECRET, secret)
        store.put_key(CURVE_PUBLIC, public)
    code, out, err = _run(capsys, "keys", "--state-dir", str(state), "--run-dir", str(tmp_path / "none"))
    assert code == 0, err
    (line,) = [ln for ln in out.splitlines() if ln.startswith("server_public_key")]
    assert shlex.split(line) == ["server_public_key", public.decode()]
    proc = subprocess.run(["sh", "-c", f"printf %s {line.split(None, 1)[1]}"], capture_output=True, text=True,
                          timeout=30)
    assert proc.stdout == public.decode()
    code, out, _ = _run(capsys, "keys", "--json", "--state-dir", str(state), "--run-dir", str(tmp_path / "none"))
    assert json.loads(out)["server_public_key"] == public.decode()  # bare in JSON


def test_status_exit_codes_for_scripts() -> None:
    from shared.records import TenantRecord
    from supervisor.cli.status import exit_status

    def rec(state: str) -> TenantRecord:
        return TenantRecord(tenant_id="t", state=state, generation=1)

    assert exit_status([]) == 0
    assert exit_status([rec("running"), rec("stopped")]) == 0
    for bad in ("failed", "degraded", "starting", "evicting"):
        assert exit_status([rec("running"), rec(bad)]) == 1, bad


def test_status_of_a_failed_tenant_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with supervisor([{"name": "ok"}, {"name": "flaky", "max_restarts": 0, "restart": "on-failure"}]) as sup:
        rd = ["--run-dir", sup.run_dir]
        assert _run(capsys, "status", *rd)[0] == 0
        assert _run(capsys, "status", "ok", "--json", *rd)[0] == 0
        pid = instance_pid(sup, "flaky")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: tenant(sup.client.status(), "flaky").state == "failed", what="flaky failed")
        code, out, _ = _run(capsys, "status", *rd)
        assert code == 1 and "flaky: failed:" in out
        assert _run(capsys, "status", "flaky", "--json", *rd)[0] == 1
        assert _run(capsys, "status", "ok", *rd)[0] == 0  # only the tenants shown count
        with pytest.raises(Exception, match=r"twt reset flaky"):  # TenantFailed names the fix
            sup.client.ping(sup.client.tenant_capability(None, "flaky"))


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """`twt ... | head`: the reader left before the output was written: no message, exit 141."""
    proc = subprocess.Popen([sys.executable, "-m", "supervisor", "cleanup", "--dry-run", "--run-dir",
                             str(tmp_path / "none")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the interpreter has even started: the write finds no reader
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait(30) == 141 and err == ""


def test_sizes_say_what_was_understood(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rd = ["--run-dir", str(tmp_path / "none")]
    with pytest.raises(SystemExit) as exc:
        main(["register", "acme", "--gpu-cap", "2Gb", *rd])
    assert exc.value.code == 2 and "'b' means bits" in capsys.readouterr().err
    code, _, err = _run(capsys, "register", "acme", "--gpu-cap", "2GB", *rd)
    assert code == EXIT_UNAVAILABLE  # parsed, noted, then no supervisor
    assert "twt: note: --gpu-cap size 2GB is decimal: 2,000,000,000 bytes (1.9GiB); write 2GiB for " \
           "2,147,483,648 bytes" in err


def test_remote_admin_without_a_capability_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """A CLI user is told about --admin-cap, not about a Python keyword."""
    import zmq

    public, secret = zmq.curve_keypair()
    with supervisor(listen=["tcp://127.0.0.1:0"]) as sup:
        code, _, err = _run(capsys, "evict", "acme", "--connect", sup.info["listen"][0],
                            f"--server-key={sup.info['server_public_key']}")
        assert code == 1 and "--admin-cap FILE" in err, err


# ------------------------------------------------ top and events ride out an outage


class _Lines:
    """A child's stdout and stderr, line by line, read by threads (so the child never blocks on a pipe)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.out: queue.Queue[str] = queue.Queue()
        self.err: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        for stream, q in ((proc.stdout, self.out), (proc.stderr, self.err)):
            threading.Thread(target=self._pump, args=(stream, q), daemon=True).start()

    @staticmethod
    def _pump(stream: Any, q: queue.Queue[str]) -> None:
        for line in stream:
            q.put(line.rstrip("\n"))

    def wait(self, q: queue.Queue[str], needle: str, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                rest = [f"{name}: {q.get_nowait()}" for name, q in (("out", self.out), ("err", self.err))
                        for _ in range(q.qsize())]
                raise AssertionError(f"no line with {needle!r} within {timeout_s} s (exit {self.proc.poll()}); "
                                     f"seen: {self.seen[-20:]}; unread: {rest}") from None
            self.seen.append(line)
            if needle in line:
                return line


#: ``python -m supervisor ARGS`` with Ctrl-C's default meaning whatever the dispositions inherited:
#: in loaded full runs a follower was once in a while started with SIGINT and SIGQUIT ignored (its
#: /proc status said so: what a C ``system()`` in another thread of this process does for the time
#: it runs, and exec keeps an ignored signal ignored), and then never ended on the test's SIGINT
_DEFAULT_CTRL_C = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                   "signal.signal(signal.SIGQUIT, signal.SIG_DFL); sys.argv[0] = 'twt'; "
                   "runpy.run_module('supervisor', run_name='__main__', alter_sys=True)")


def _follower(*argv: str) -> _Lines:
    proc = subprocess.Popen([sys.executable, "-c", _DEFAULT_CTRL_C, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    return _Lines(proc)


def _end(lines: _Lines) -> int:
    lines.proc.send_signal(signal.SIGINT)
    try:
        try:
            return lines.proc.wait(30)
        except subprocess.TimeoutExpired:
            # seen under load in full runs only (never alone): say how the follower stood, for the
            # next look - its signal masks (an inherited ignored or blocked SIGINT?) and its state
            try:
                with open(f"/proc/{lines.proc.pid}/status") as f:
                    status = [ln.strip() for ln in f if ln.startswith(("State", "Sig", "Shd", "Threads"))]
            except OSError as exc:
                status = [f"no /proc status: {exc}"]
            raise AssertionError(f"{lines.proc.args[3:5]} did not end within 30 s of SIGINT; {status}; "
                                 f"last lines: {lines.seen[-5:]}") from None
    finally:
        if lines.proc.poll() is None:  # pragma: no cover - a hung follower
            lines.proc.kill()
            lines.proc.wait(10)
        for stream in (lines.proc.stdout, lines.proc.stderr):
            if stream is not None:
                stream.close()


def test_top_and_events_survive_a_restart(tmp_path: Path) -> None:
    """A supervisor stopped and started again on the same run dir (state kept): `twt top` and `twt
    events` say when it became unreachable, that it stopped (supervisor.json gone), and resume."""
    from supervisor.client.launch import launch

    import tempfile

    run_dir = tempfile.mkdtemp(prefix="twt-", dir=short_temp_dir())  # short: ipc paths are limited
    config = {"supervisor": {**FAST_SETTINGS}, "tenant": [{"name": "acme"}]}
    top = events = None
    try:
        with launch(config, run_dir=run_dir):
            top = _follower("top", "--interval", "0.3", "--run-dir", run_dir)
            events = _follower("events", "--replay", "--run-dir", run_dir)
            top.wait(top.out, "acme")  # a first frame
            events.wait(events.out, "acme")  # following: the log's past events were printed
        for follower in (top, events):
            line = follower.wait(follower.err, "unreachable since")
            assert line.startswith("twt: supervisor unreachable since ") and "retrying" in line
            if "supervisor.json is gone" not in line:  # noticed before the stop finished: said next
                follower.wait(follower.err, "supervisor.json is gone")
        with launch(config, run_dir=run_dir) as sup:
            for follower in (top, events):
                follower.wait(follower.err, "twt: supervisor back at ")
            top.wait(top.out, "twt top - ")  # frames again
            top.wait(top.out, "acme")
            sup.client.register(None, TenantSpec("bravo"))
            events.wait(events.out, "register")
            assert any("missed" in line and "restarted" in line for line in events.seen)
        assert _end(top) == 0 and _end(events) == 0
        top = events = None
    finally:
        for follower in (top, events):
            if follower is not None:
                _end(follower)
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)


def test_reconnecting_gives_up_after_its_deadline_and_resumes_when_back(tmp_path: Path) -> None:
    """The outage logic alone (no supervisor): lines said, give-up after --timeout, resume on a new client."""
    from shared.errors import SupervisorUnavailable
    from supervisor.client.outage import Reconnecting

    class _Client:
        timeout_s = 10.0
        closed = False

        def close(self) -> None:
            self.closed = True

    args = argparse.Namespace(connect="tcp://127.0.0.1:1", run_dir=None)
    lines: list[str] = []
    clients: list[_Client] = []
    up = {"now": False}

    def connect() -> Any:
        if clients and not up["now"]:
            raise SupervisorUnavailable("tcp://127.0.0.1:1", "connection refused: nothing listens on 127.0.0.1:1")
        clients.append(_Client())
        return clients[-1]

    def call(client: Any) -> str:
        if client is clients[0]:
            raise SupervisorUnavailable("tcp://127.0.0.1:1", "connection lost while waiting for the reply")
        return "pong"

    source = Reconnecting(args, connect, deadline_s=0.05, retry_s=0.01, err=lines.append)
    assert source.call(call) is None  # gave up
    assert lines[0].startswith("twt: supervisor unreachable since ") and "connection lost" in lines[0]
    assert lines[-1].startswith("twt: gave up at ")
    lines.clear()
    up["now"] = True
    source.deadline_s = None
    assert source.call(call) == "pong" and source.client is clients[1] and clients[0].closed
    assert lines[-1].startswith("twt: supervisor back at ")
