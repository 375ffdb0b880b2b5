"""What every benchmark report says about the machine it ran on (supervisor.tools.bench._report)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from supervisor.tools.bench import _report
from supervisor.tools.bench._report import Report, Target

pytestmark = pytest.mark.timeout(30)


def _autogroups_on() -> bool:
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


def test_the_session_groups_nice_is_read_where_the_kernel_groups_sessions() -> None:
    got = _report.session_nice()
    if not _autogroups_on():
        assert got is None
        return
    # "/autogroup-N nice V": the value this process's session group has; where the file does not
    # read so (an empty file in some sandboxes), no value rather than an error
    text = Path("/proc/self/autogroup").read_text()
    fields = text.split()
    if len(fields) == 3 and fields[0].startswith("/autogroup-") and fields[1] == "nice":
        assert got == int(fields[2])
    else:
        assert got is None


@pytest.mark.parametrize(("text", "nice"), [
    ("/autogroup-4081 nice 0\n", 0),
    ("/autogroup-7 nice -20\n", -20),
    ("/autogroup-7 nice 19", 19),
    ("", None),
    ("\n", None),
    ("/autogroup-7 nice\n", None),
    ("nice 0\n", None),
    ("/autogroup-7 nice x\n", None),
])
def test_the_autogroup_file_is_parsed_or_gives_no_value(text: str, nice: int | None) -> None:
    assert _report.autogroup_nice(text) == nice


def test_the_report_says_the_load_the_nice_and_the_session_group_second() -> None:
    env = {"date": "2026-12-06 12:00 UTC", "python": "3.11", "cpus": 2, "cpu_model": "a CPU",
           "load_1m": 3.5, "nice": -20, "session_nice": 0}
    report = Report("unit", env=env)
    report.targets.append(Target("a ratio", 1.0, 0.5))
    out = io.StringIO()
    assert report.emit(file=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("twt bench unit - ")
    assert lines[1].startswith("load 3.5 at the start; nice -20; session group nice 0 (the kernel shares the CPUs")


def test_without_autogroups_the_line_names_only_the_load_and_the_nice() -> None:
    env = {"load_1m": 0.25, "nice": 0, "session_nice": None}
    assert _report._machine_line(env) == "load 0.25 at the start; nice 0"
    assert _report._machine_line({}) == ""


@pytest.mark.process  # platform's processor name may come from a `uname -p` child
def test_the_environment_has_this_processs_nice() -> None:
    env = _report.environment()
    assert env["nice"] == os.nice(0)
    assert env["load_1m"] is None or float(str(env["load_1m"])) >= 0
