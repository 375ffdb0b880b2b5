"""The suite's zygote (tests/helpers/zygote.py): a forked ``python -m supervisor`` is what a fresh
one would be - exit codes, stdio, environment, directory, process group, signals - and a start it
cannot reproduce is a plain process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.helpers import hygiene, zygote
from supervisor.client.launch import launch
from tests.helpers.cluster import FAST, instance_pid, supervisor, tenant, wait_for

pytestmark = [pytest.mark.process,
              pytest.mark.skipif(not zygote.enabled(), reason="the zygote is turned off (PYTEST_TWT_ZYGOTE=0)")]

TWT = [sys.executable, "-m", "supervisor"]
ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, *args: str, **kwargs: object) -> tuple[subprocess.Popen[bytes], int, str, str]:
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = zygote.popen([*TWT, *args], stdout=o, stderr=e, stdin=subprocess.DEVNULL, **kwargs)
        code = proc.wait(60)
    return proc, code, out.read_text(), err.read_text()


def test_a_forked_command_exits_and_writes_as_python_m_would(tmp_path: Path) -> None:
    proc, code, out, _ = _run(tmp_path, "--help")
    assert isinstance(proc, zygote.ZygoteProcess)
    assert code == 0 and proc.returncode == 0 and proc.poll() == 0
    assert out.startswith("usage: twt")
    proc, code, _, err = _run(tmp_path, "no-such-command")
    assert isinstance(proc, zygote.ZygoteProcess)
    assert code == 2 and "invalid choice: 'no-such-command'" in err


def test_the_child_takes_the_callers_environment_and_directory(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "c.toml").write_text("[supervisor]\n")
    monkeypatch.chdir(tmp_path)  # a relative config path resolves against the caller's directory
    for backend in ("stub", "cuda"):
        env = {**os.environ, "TWT_BACKEND": backend}
        proc, code, out, err = _run(tmp_path, "check-config", "c.toml", env=env)
        assert isinstance(proc, zygote.ZygoteProcess)
        assert code == 0, err
        assert f"backend {backend}" in out


def test_a_start_it_cannot_reproduce_is_a_plain_process(tmp_path: Path) -> None:
    proc, code, out, _ = _run(tmp_path, "--help", start_new_session=True)  # an argument it does not pass on
    assert type(proc) is subprocess.Popen and code == 0 and out.startswith("usage: twt")
    proc = zygote.popen([*TWT, "--help"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)  # a pipe it cannot share
    out_bytes, _ = proc.communicate(timeout=60)
    assert type(proc) is subprocess.Popen and proc.returncode == 0 and out_bytes.startswith(b"usage: twt")


def test_another_interpreter_environment_gets_a_zygote_of_its_own() -> None:
    """``PYTHON*`` variables act before any code runs: a child needs a zygote that started with them."""
    parents = set()
    for warnings in ("default", "ignore::DeprecationWarning"):
        env = {**os.environ, "PYTHONWARNINGS": warnings}
        with launch({"supervisor": FAST}, env=env) as handle:
            assert isinstance(handle.process, zygote.ZygoteProcess)
            parents.add(psutil.Process(handle.pid).ppid())
    assert len(parents) == 2 and parents <= zygote.server_pids()


def test_a_zygote_starts_with_this_processs_environment_not_its_first_callers() -> None:
    """A fork's ``/proc/PID/environ`` is its zygote's: a variable of the start that happened to
    start the zygote (a test's ``NOTIFY_SOCKET``) must not show in every later fork's."""
    warnings = "ignore::ResourceWarning,ignore::ImportWarning"  # a zygote of this test's own
    env = {**os.environ, "PYTHONWARNINGS": warnings, "TWT_TEST_FIRST_CALLER": "1"}
    with launch({"supervisor": FAST}, env=env) as handle:
        assert isinstance(handle.process, zygote.ZygoteProcess)
        started = psutil.Process(psutil.Process(handle.pid).ppid()).environ()
    assert started.get("PYTHONWARNINGS") == warnings  # what an interpreter reads at its start: the caller's
    assert "TWT_TEST_FIRST_CALLER" not in started


def test_a_launched_supervisor_is_a_forked_process_of_the_callers_group() -> None:
    with supervisor() as handle:
        assert isinstance(handle.process, zygote.ZygoteProcess)
        child = psutil.Process(handle.pid)
        assert child.ppid() in zygote.server_pids()  # forked by the zygote, never by this process
        assert os.getpgid(handle.pid) == os.getpgid(0)  # the caller's process group, as a Popen child's
        # this run's marker, which the leak checks read from /proc/PID/environ
        assert child.environ().get(hygiene.SESSION_ENV) == os.environ[hygiene.SESSION_ENV]
        assert handle.client.status() is not None
        assert handle.process.poll() is None
        handle.process.send_signal(signal.SIGKILL)
        assert handle.process.wait(60) == -signal.SIGKILL
        assert handle.process.poll() == -signal.SIGKILL


def test_run_captures_a_forked_commands_output_as_subprocess_run_does(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text("[supervisor]\nno_such_key = 1\n")
    done = zygote.run([*TWT, "check-config", "c.toml"], timeout=60, cwd=str(tmp_path),
                      env={**os.environ, "TWT_BACKEND": "stub"})
    plain = subprocess.run([*TWT, "check-config", "c.toml"], capture_output=True, text=True, timeout=60,
                           cwd=str(tmp_path), env={**os.environ, "TWT_BACKEND": "stub"}, check=False)
    assert (done.returncode, done.stdout, done.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert done.returncode == 4 and "no_such_key" in done.stdout + done.stderr


def test_a_child_that_outlives_its_zygote_is_still_stopped_and_waited_for() -> None:
    with supervisor() as handle:
        parent = psutil.Process(handle.pid).ppid()
        assert parent in zygote.server_pids()
        os.kill(parent, signal.SIGKILL)
        wait_for(lambda: parent not in zygote.server_pids(), what="the zygote's end")
        assert handle.process.poll() is None  # its status is lost with the zygote; that it runs is not
        assert handle.client.status() is not None
    assert handle.process.returncode is not None  # stopped by launch() and seen gone
    with supervisor() as handle:  # the next start gets a new zygote
        assert isinstance(handle.process, zygote.ZygoteProcess)
        assert psutil.Process(handle.pid).ppid() in zygote.server_pids() - {parent}


def _forked(pid: int) -> bool:
    """Whether ``pid`` was forked from a zygote's child (its command line is the zygote's), not exec'd."""
    return psutil.Process(pid).cmdline()[1:3] == ["-m", zygote.__name__]


def test_a_forkserver_supervisors_workers_come_from_a_fork_server_forked_off_its_start() -> None:
    """cluster.supervisor()'s default under the zygote: the fork server is the supervisor's child, a
    fork of the (preloaded) zygote child rather than a fresh interpreter, it forks every worker, and
    it goes when the supervisor does."""
    with supervisor([{"name": "a"}, {"name": "b"}]) as handle:
        assert handle.client.hello().start_method == "forkserver"
        pids = [wait_for(lambda t=t: instance_pid(handle, t), what=f"{t}'s worker") for t in ("a", "b")]
        servers = {psutil.Process(pid).ppid() for pid in pids}
        assert len(servers) == 1, "one fork server forks every worker"
        server = servers.pop()
        assert psutil.Process(server).ppid() == handle.pid and _forked(server)
        assert handle.client.status() is not None
    wait_for(lambda: not psutil.pid_exists(server) or psutil.Process(server).status() == psutil.STATUS_ZOMBIE,
             what="the fork server's end after its supervisor's")


def test_a_supervisors_resource_tracker_is_forked_and_unlinks_a_killed_supervisors_segments() -> None:
    """The tracker every supervisor starts is a fork of its start (with the supervisor's -W filter),
    and does the tracker's job: a SIGKILLed supervisor's tracked segments are unlinked."""
    with supervisor([{"name": "t0"}], start_method="spawn") as handle:
        wait_for(lambda: instance_pid(handle, "t0"), what="t0's worker")
        segment = tenant(handle.client.status(), "t0").quota.name
        assert segment and os.path.exists(f"/dev/shm/{segment}")
        trackers = [c.pid for c in psutil.Process(handle.pid).children() if _forked(c.pid)]
        assert len(trackers) == 1, "the supervisor's only forked child (spawn: its workers are exec'd)"
        handle.process.send_signal(signal.SIGKILL)
        assert handle.process.wait(60) == -signal.SIGKILL
        wait_for(lambda: not os.path.exists(f"/dev/shm/{segment}"), what="the killed supervisor's segment unlinked")
        wait_for(lambda: not psutil.pid_exists(trackers[0]) or psutil.Process(trackers[0]).status() == psutil.STATUS_ZOMBIE,
                 what="the tracker's end")


def test_a_supervise_that_names_no_start_method_gets_the_forked_fork_server(tmp_path: Path) -> None:
    """``zygote.with_start_method``: a method is added only where the arguments, the environment
    and the config file name none; a file it cannot read is left to the supervisor."""
    add = ["--start-method", "forkserver"]
    base = ["supervise", "--run-dir", str(tmp_path / "rd")]
    cwd = str(tmp_path)
    assert zygote.with_start_method(base, {}, cwd) == [*base, *add]
    for named in (["--start-method", "spawn"], ["--start-method=spawn"]):
        assert zygote.with_start_method([*base, *named], {}, cwd) == [*base, *named]
    assert zygote.with_start_method(base, {"TWT_START_METHOD": "spawn"}, cwd) == base
    assert zygote.with_start_method(["status", "--json"], {}, cwd) == ["status", "--json"]
    (tmp_path / "plain.json").write_text(json.dumps({"supervisor": {"pool_size": 0}, "tenant": []}))
    (tmp_path / "named.json").write_text(json.dumps({"supervisor": {"start_method": "spawn"}, "tenant": []}))
    (tmp_path / "named.toml").write_text('[supervisor]\nstart_method = "spawn"\n')
    plain = [*base, "--config", str(tmp_path / "plain.json")]
    assert zygote.with_start_method(plain, {}, cwd) == [*plain, *add]
    for config in ("--config=named.json", "--config=named.toml", "--config=missing.toml"):
        assert zygote.with_start_method([*base, config], {}, cwd) == [*base, config]


def test_a_forked_chaos_campaign_launches_its_supervisor_through_a_zygote_of_its_own(tmp_path: Path) -> None:
    """``twt chaos`` (and ``twt demo``) launch() their own supervisor: forked to run one, the command
    first forks a zygote for itself, and its supervisor is a fork of that one, not a fresh interpreter.
    The command's zygote goes when the command does."""
    # PYTHONPATH as tests.helpers.cli.twt() sets it: launch() puts the checkout first again, which the
    # zygote's match takes for the same path (a start with another path is a plain one)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "wb") as o, open(err, "wb") as e:
        chaos = zygote.popen([*TWT, "chaos", "--duration", "1", "--baseline", "0.5", "--seed", "2", "--rate", "2",
                              "--tenants", "2", "--latency-factor", "0", "--json"],
                             stdout=o, stderr=e, stdin=subprocess.DEVNULL, env=env)
        try:
            assert isinstance(chaos, zygote.ZygoteProcess)

            def campaign_supervisor() -> psutil.Process | None:
                try:
                    kids = psutil.Process(chaos.pid).children(recursive=True)
                    return next((p for p in kids if p.name() == "twt-supervisor"), None)
                except psutil.Error:
                    return None

            sup = wait_for(campaign_supervisor, what="the campaign's supervisor")
            assert sup is not None
            own = sup.ppid()
            assert _forked(sup.pid) and _forked(own)  # both forks of a preloaded process, neither exec'd
            assert psutil.Process(own).ppid() == chaos.pid and own not in zygote.server_pids()
            assert chaos.wait(120) in (0, 4), (out.read_text() + err.read_text())[-2000:]  # the verdict is a latency check's
        finally:
            if chaos.poll() is None:
                chaos.kill()
                chaos.wait(60)
    started = json.loads(out.read_text())["supervisor"]
    assert started["pid"] == sup.pid and started["started_here"] and started["start_method"] == "forkserver"
    wait_for(lambda: not psutil.pid_exists(own) or psutil.Process(own).status() == psutil.STATUS_ZOMBIE,
             what="the command's zygote's end")
