"""What an operator meets first: --version, help with defaults, one-sentence errors, config mistakes listed,
unknown TWT_* variables, a quiet embedded supervisor, and no raw warning text in the log stream."""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import ConfigError, load_config, unknown_env_vars
from shared.errors import SegmentError
from shared.quota import read_header
from supervisor.cli import COMMANDS, build_parser, version
from supervisor.cli._common import describe_os_error
from supervisor.client.launch import launch
from supervisor.store.rundir import RunDir
from tests.helpers import zygote
from tests.helpers.cluster import FAST, tenant, wait_for
from tests.helpers.tmp import short_temp_dir

pytestmark = pytest.mark.timeout(90)


def _twt(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m supervisor ARGS`` as a process of its own, forked from the suite's preloaded zygote
    (tests/helpers/zygote.py; a plain process where the zygote cannot reproduce ``env``)."""
    return zygote.run([sys.executable, "-m", "supervisor", *args], timeout=60, env=env)


def _twt_cold(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m supervisor ARGS`` in a fresh interpreter: the real entry point, no zygote."""
    return subprocess.run([sys.executable, "-m", "supervisor", *args], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def test_version() -> None:
    proc = _twt_cold("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"twt {version()}"
    assert version() != "unknown"  # the editable install is a distribution


def test_every_option_help_shows_its_default() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, command in sorted(sub.choices.items()):
        formatter = command._get_formatter()
        for action in command._actions:
            if (not action.option_strings or action.nargs == 0 or action.required
                    or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
                continue
            text = formatter._get_help_string(action) or ""
            if "default" not in text:
                missing.append(f"{name} {action.option_strings[0]}")
        help_text = command.format_help()
        assert "(default: None)" not in help_text and "==SUPPRESS==" not in help_text, name
    assert not missing, f"options whose help does not show a default: {missing}"
    # positionals are named like the other commands' (TENANT, then what it takes)
    run_usage = sub.choices["run"].format_usage()
    assert "TENANT MODULE" in run_usage and "tenant module" not in run_usage


@pytest.mark.parametrize(("exc", "sentence"), [
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/nonexistent.wat"), "/nonexistent.wat does not exist"),
    (PermissionError(errno.EACCES, "Permission denied", "/etc/shadow"),
     "permission denied for /etc/shadow; check its owner and mode (and those of its directory)"),
    (IsADirectoryError(errno.EISDIR, "Is a directory", "/tmp"), "/tmp is a directory; a file is needed here"),
    (OSError(errno.EADDRINUSE, "cannot serve metrics on h:1: the port is in use"),
     "cannot serve metrics on h:1: the port is in use"),
])
def test_os_errors_become_one_sentence(exc: OSError, sentence: str) -> None:
    text = describe_os_error(exc)
    assert text == sentence and "[Errno" not in text


def test_run_dir_problems_are_one_sentence_each(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    proc = _twt("supervise", "--run-dir", str(a_file), "--backend", "stub")
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"twt: error: run dir {a_file} exists and is not a directory; "
                                   "remove it or use another --run-dir")
    with pytest.raises(NotADirectoryError, match="a part of the path is a file"):
        RunDir(str(a_file / "sub")).acquire()
    if os.getuid() != 0:  # root may write anywhere
        locked = tmp_path / "ro"
        locked.mkdir(mode=0o500)
        proc = _twt("supervise", "--run-dir", str(locked / "twt"), "--backend", "stub")
        assert proc.returncode == 1 and "[Errno" not in proc.stderr
        assert f"cannot create run dir {locked / 'twt'}: permission denied" in proc.stderr
    rd = RunDir(str(tmp_path / "ok"))
    rd.acquire()
    rd.acquire()  # idempotent: `twt supervise` locks first, the loop's own call is a no-op
    assert rd.locked
    rd.release()
    assert not rd.locked


def test_config_file_reports_every_mistake_with_its_name(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text('[supervisor]\nbackend = "gpu"\npoolsize = 3\nstop_timeout_s = -1\n\n'
                    '[[tenant]]\nname = "acme"\ninstances = 500\ngpu_memory_bytes_cap = "lots"\n\n'
                    '[[tenant]]\nname = "Bad Name"\ncolour = "red"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    err = info.value
    text = str(err)
    assert err.path == f"config {path}" and text.count("\n  - ") == 7, text
    assert text.startswith(f"config {path} has 7 mistakes:")
    for needle in ("unknown [supervisor] key 'poolsize'; did you mean 'pool_size'?", "backend must be one of",
                   "stop_timeout_s must be a positive number", "[[tenant]] #1 ('acme'): instances must be in 0..64",
                   "[[tenant]] #1 ('acme'): invalid gpu_memory_bytes_cap 'lots'",
                   "[[tenant]] #2 ('Bad Name'): invalid tenant id", "[[tenant]] #2 ('Bad Name'): unknown key(s)"):
        assert needle in text, needle
    proc = _twt("supervise", "--config", str(path), "--run-dir", str(tmp_path / "rd"))
    assert proc.returncode == 2 and f"config {path} has 7 mistakes" in proc.stderr
    assert not (tmp_path / "rd").exists()  # nothing created for a config that cannot start
    missing = _twt("supervise", "--config", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"twt: error: config {tmp_path / 'nope.toml'}: the file does not exist"
    with pytest.raises(ConfigError, match="environment has 2 mistakes"):
        load_config(environ={"TWT_POOL_SIZE": "many", "TWT_STOP_TIMEOUT_S": "soon"})


def test_unknown_twt_variables() -> None:
    env = {"TWT_POOL_SZIE": "3", "TWT_RUN_DIR": "/x", "TWT_BACKEND": "stub", "TWT_NONSENSE_THING": "1",
           "OTHER": "1"}
    assert unknown_env_vars(env) == ["TWT_NONSENSE_THING", "TWT_POOL_SZIE (did you mean TWT_POOL_SIZE?)"]
    assert unknown_env_vars({}) == []


def _json_lines(path: Path) -> list[dict[str, object]]:
    records = []
    for line in path.read_text().splitlines():
        obj = json.loads(line)  # raw text anywhere fails here
        assert isinstance(obj, dict)
        records.append(obj)
    return records


def test_embedded_supervisor_is_quiet_and_warns_about_unknown_variables(tmp_path: Path) -> None:
    log = tmp_path / "stderr"
    env = {**os.environ, "TWT_POOL_SZIE": "3"}
    with open(log, "wb") as err:
        with launch({"supervisor": {**FAST, "log_format": "json"}, "tenant": [{"name": "acme"}]},
                    stderr=err, env=env) as sup:
            sup.client.ping(sup.client.tenant_capability(None, "acme"))
    records = _json_lines(log)
    assert records, "the unknown variable is worth a warning even when quiet"
    assert all(r["level"] in ("warning", "error") for r in records), records
    (warning,) = [r for r in records if r["event"] == "config.unknown_env"]
    assert warning["variable"] == "TWT_POOL_SZIE (did you mean TWT_POOL_SIZE?)"


def _segments_owned_by(pid: int) -> list[str]:
    """The ``twt-*`` segments whose header names ``pid`` as their owner (the prefix is per start)."""
    owned = []
    for name in os.listdir("/dev/shm"):
        if name.startswith("twt-"):
            try:
                if read_header(name).owner_pid == pid:
                    owned.append(name)
            except SegmentError:
                continue  # not our layout, or gone meanwhile
    return owned


def test_resource_tracker_warning_never_lands_as_raw_text(tmp_path: Path) -> None:
    """SIGKILL the supervisor while it owns segments: its resource tracker cleans them up silently."""
    log = tmp_path / "stderr"
    with open(log, "wb") as err:
        with launch({"supervisor": {**FAST, "log_format": "json"}, "tenant": [{"name": "acme"}]},
                    stderr=err, log_level="info") as sup:
            segments = _segments_owned_by(sup.pid)  # this supervisor's segments only
            assert segments
            # the ready file comes before the "supervisor.ready" line: a kill in between lost the line
            wait_for(lambda: b'"supervisor.ready"' in log.read_bytes(), timeout_s=30, what="the ready line")
            os.kill(sup.pid, signal.SIGKILL)
            sup.process.wait(30)
            # the tracker unlinks what the dead supervisor held (that is when it would have warned)
            wait_for(lambda: not any(os.path.exists(f"/dev/shm/{n}") for n in segments), timeout_s=30,
                     what="the resource tracker cleaned up")
    records = _json_lines(log)  # every line is JSON: no "UserWarning: resource_tracker" text
    assert any(r["event"] == "supervisor.ready" for r in records)
    assert not any("resource_tracker" in json.dumps(r) for r in records)


# ---------------------------------------------------------------- systemd Type=notify


def test_systemd_notify_ready_watchdog_stopping() -> None:
    """Under a fake systemd (a datagram socket as NOTIFY_SOCKET, WATCHDOG_USEC set): READY=1 only once
    supervisor.json exists, WATCHDOG=1 from the running loop, STOPPING=1 on SIGTERM; workers do not
    inherit the variables."""
    import queue
    import shutil
    import socket
    import tempfile
    import threading

    import psutil

    where = tempfile.mkdtemp(prefix="twt-n", dir=short_temp_dir())  # AF_UNIX paths are short
    run_dir = os.path.join(where, "run")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    received: queue.Queue[tuple[dict[str, str], bool]] = queue.Queue()

    done = threading.Event()

    def listen() -> None:  # what systemd would see, and whether supervisor.json existed at that moment
        while not done.is_set():
            try:
                data = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines())
            received.put((fields, os.path.exists(os.path.join(run_dir, "supervisor.json"))))

    def next_with(key: str) -> tuple[dict[str, str], bool]:
        while True:
            fields, ready_file = received.get(timeout=60)
            if key in fields:
                return fields, ready_file
            assert set(fields) == {"WATCHDOG"}, fields  # nothing else comes in between

    try:
        address = os.path.join(where, "notify")
        sock.bind(address)
        sock.settimeout(0.2)  # so the listener notices `done`
        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        env = {**os.environ, "NOTIFY_SOCKET": address, "WATCHDOG_USEC": "400000"}
        with launch({"supervisor": FAST, "tenant": [{"name": "acme"}]}, env=env, run_dir=run_dir) as sup:
            ready, file_was_there = next_with("READY")
            assert ready["READY"] == "1" and int(ready["MAINPID"]) == sup.pid and file_was_there
            assert "serving 1 tenant(s)" in ready["STATUS"]
            for _ in range(2):
                assert next_with("WATCHDOG")[0]["WATCHDOG"] == "1"  # the loop keeps turning
            worker = tenant(sup.client.status(), "acme").pids[0]
            assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC"} & set(psutil.Process(worker).environ())
            sup.process.send_signal(signal.SIGTERM)
            stopping, _ = next_with("STOPPING")
            assert stopping["STOPPING"] == "1"
        done.set()
        listener.join(10)
    finally:
        done.set()
        sock.close()
        shutil.rmtree(where, ignore_errors=True)


def test_sd_notify_outside_systemd_and_bad_values() -> None:
    from supervisor.observe.sd_notify import SystemdNotifier

    off = SystemdNotifier.from_environ({})
    assert not off.enabled and not off.ready() and not off.watchdog(1e9) and not off.stopping()
    env = {"NOTIFY_SOCKET": "/nonexistent/notify", "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid()),
           "OTHER": "x"}
    n = SystemdNotifier.from_environ(env)
    assert env == {"OTHER": "x"}  # removed: children never see them
    assert n.enabled and n.watchdog_interval_s == 0.5
    assert n.ready() is False  # nobody listens: ignored, never raised
    assert n.watchdog(10.0) is False and n.watchdog(10.1) is False  # rate-limited before it even sends
    other = SystemdNotifier.from_environ({"NOTIFY_SOCKET": "@abstract", "WATCHDOG_USEC": "1000000",
                                          "WATCHDOG_PID": "1"})
    assert other.enabled and other.watchdog_interval_s is None  # the watchdog is another process's
    assert not SystemdNotifier.from_environ({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled
    for notifier in (n, other):
        notifier.close()


def test_ready_event_of_a_pool_bound_worker_counts_from_its_bind() -> None:
    """A warm pool worker bound to a tenant reports the bind's time as startup_ms, not its age."""
    from shared.spec import TenantSpec

    with launch({"supervisor": {**FAST, "pool_size": 1}}) as sup:
        c = sup.client

        def pool_ready() -> dict[str, object] | None:
            page = c.events_page(None, 0, kinds=["ready"])
            return next((e for e in page["events"] if e.get("pool")), None)

        idle = wait_for(pool_ready, what="a warm pool worker")
        c.register(None, TenantSpec("acme"))
        page = c.events_page(None, 0, kinds=["ready"])
        (bound,) = [e for e in page["events"] if e.get("tenant") == "acme"]
        assert bound["pooled"] is True and bound["worker"] == idle["worker"]
        # it was bound after the pool worker became idle: startup counts from then, not from its spawn
        assert bound["startup_ms"] / 1000 <= float(bound["ts"]) - float(idle["ts"]) + 0.05  # type: ignore[arg-type]


def test_the_parser_for_one_command_is_that_command_of_the_whole_parser() -> None:
    """``main`` builds only the command it was given (a launched supervisor imports no chaos or bench
    code): each command's parser, so built, is exactly the whole parser's."""
    def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return dict(sub.choices)

    whole = commands(build_parser())
    for name in COMMANDS:
        alone = commands(build_parser(name))
        assert name in alone and set(alone) <= set(whole), name
        assert alone[name].format_help() == whole[name].format_help(), name
    assert set(commands(build_parser("no-such-command"))) == set(whole)  # argparse names the choices
