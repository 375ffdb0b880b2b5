"""Supervisors on different run dirs of one host never clean up each other's segments.

A supervisor's start removes the dead segments of *its own* run dir (what a
killed predecessor there left) and names an older version made; another run
dir's dead segments wait for that run dir's own restart, which reclaims and
reports them. ``twt cleanup`` does either on demand, ``--all-run-dirs`` the
whole host.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shared import quota
from shared.quota import namespace_of, read_header, segment_namespace
from supervisor.cli import main
from supervisor.store.rundir import RunDir, read_ready
from tests.helpers import segments as fab
from tests.helpers import zygote
from tests.helpers.cluster import wait_for

pytestmark = pytest.mark.timeout(120)


def _supervise(run_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as err:
        return zygote.popen(
            [sys.executable, "-m", "supervisor", "supervise", "--run-dir", str(run_dir), "--backend", "stub",
             "--pool-size", "0", "--log-format", "json", "--log-level", "info"],
            stderr=err, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)


def _removed_by(log: Path) -> set[str]:
    """The segments a supervisor's log says its start removed."""
    out = set()
    for line in log.read_text().splitlines():
        record: dict[str, Any] = json.loads(line)
        if record.get("event") == "quota.stale_segment_removed":
            out.add(str(record["segment"]))
    return out


def _stop(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_two_supervisors_starting_at_once_each_remove_only_their_own(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    ns_a, ns_b, ns_c = (segment_namespace(str(d)) for d in (a, b, c))
    dead = fab.dead_owner()
    # what a SIGKILLed supervisor on run dir a left (its quota block, device budget, a region's
    # header), and on run dir c, where nobody starts in this test
    a_stale = [fab.write_stale(fab.namespaced_name(ns_a, "0"), dead),
               fab.write_stale(fab.namespaced_name(ns_a, "dev0"), dead, kind=quota.KIND_DEVICE, label=b"device 0"),
               fab.write_stale(fab.namespaced_name(ns_a, "r" + "0" * 32), dead, kind=quota.KIND_REGION)]
    c_stale = fab.write_stale(fab.namespaced_name(ns_c, "0"), dead)
    legacy = fab.write_stale(f"twt-{os.urandom(4).hex()}-0", dead)  # an older version's
    procs = []
    try:
        procs = [_supervise(a, tmp_path / "a.log"), _supervise(b, tmp_path / "b.log")]  # at once
        for proc, run_dir in zip(procs, (a, b)):
            wait_for(lambda: (read_ready(str(run_dir)) or {}).get("pid") == proc.pid or proc.poll() is not None,
                     60, what=f"the supervisor on {run_dir} to be ready")
            assert proc.poll() is None, (tmp_path / f"{run_dir.name}.log").read_text()
        by_a, by_b = _removed_by(tmp_path / "a.log"), _removed_by(tmp_path / "b.log")
        # b's start never touched another run dir's segments, a's never c's; a's are gone (a removed
        # them - unless a parallel test run of an older build, which removes every dead owner's, did)
        assert not by_b & {*a_stale, c_stale}, by_b
        assert {namespace_of(n) for n in by_a} <= {ns_a, None} and {namespace_of(n) for n in by_b} <= {ns_b, None}
        assert by_a <= {*a_stale, legacy} and by_b <= {legacy}
        assert not any(map(fab.exists, a_stale))
        assert fab.exists(c_stale) or c_stale not in by_a | by_b
        assert not fab.exists(legacy)  # a name of an older version: either start removes it
        # each supervisor's own segments carry its run dir's namespace
        for proc, ns in zip(procs, (ns_a, ns_b)):
            mine = [n for n in os.listdir(fab.SHM_DIR) if namespace_of(n) == ns and fab.exists(n)]
            assert mine and all(read_header(n).owner_pid == proc.pid for n in mine)
            assert RunDir(str(a if ns == ns_a else b)).segment_namespace == ns
    finally:
        _stop(*procs)
        fab.remove(*a_stale, c_stale, legacy)


def test_twt_cleanup_of_a_run_dir_and_of_the_whole_host(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In process (the command is thin): a parallel test run of an older build removes every dead
    owner's segment at each supervisor start, so the windows between steps are kept short."""
    mine, other = segment_namespace(str(tmp_path / "rd")), segment_namespace(str(tmp_path / "other"))
    dead = fab.dead_owner()

    def twt(*args: str) -> Any:
        assert main(["cleanup", *args, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    own = foreign = ""
    try:
        own = fab.write_stale(fab.namespaced_name(mine), dead)
        foreign = fab.write_stale(fab.namespaced_name(other), dead)
        # host-wide, as a dry run (a real one here would clean other test runs' segments on this host)
        every = twt("--all-run-dirs", "--dry-run")
        assert every["namespace"] is None and {own, foreign} <= set(every["segments"])
        listed = twt("--run-dir", str(tmp_path / "rd"), "--dry-run")
        assert listed["namespace"] == mine and own in listed["segments"] and foreign not in listed["segments"]
        done = twt("--run-dir", str(tmp_path / "rd"))
        assert own in done["segments"] and foreign not in done["segments"]
        assert not fab.exists(own) and fab.exists(foreign)
        assert main(["cleanup", "--run-dir", str(tmp_path / "other")]) == 0
        text = capsys.readouterr().out
        assert f"namespace {other}" in text and foreign in text and not fab.exists(foreign)
        with pytest.raises(SystemExit) as usage:
            main(["cleanup", "--all-run-dirs", "--run-dir", "x"])
        assert usage.value.code == 2 and "not allowed with" in capsys.readouterr().err
    finally:
        fab.remove(*(n for n in (own, foreign) if n))
