"""``twt bench share --device-cpus``: the supervisors' ``stub_device_cpus`` and the report's line, the
same for every arm of a run (the clients' own pin is not exercised here: it changes this process)."""

from __future__ import annotations

import argparse
import os

import pytest

from supervisor.tools.bench._report import Report, device_cpus
from supervisor.tools.bench.share import DEVICE_CPUS, _device_core

pytestmark = pytest.mark.timeout(30)


def test_the_option_parses_like_the_setting() -> None:
    assert device_cpus("last") == "last" == DEVICE_CPUS
    assert device_cpus("none") == ()
    assert device_cpus("1") == (1,)
    with pytest.raises(argparse.ArgumentTypeError):
        device_cpus("first")


def test_none_leaves_the_supervisors_as_they_are_and_says_so() -> None:
    report = Report("share", env={})  # (no environment probe: it starts a process)
    assert _device_core(argparse.Namespace(device_cpus=()), report) == {}
    assert report.data["device_cpus"] is None
    assert "shares the host's CPUs" in report.sections[0][1]


def test_last_names_the_last_cpu_for_every_supervisor() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    report = Report("share", env={})  # (no environment probe: it starts a process)
    config = _device_core(argparse.Namespace(device_cpus="last"), report)
    if len(allowed) < 2:  # one CPU: nothing would be left for the rest
        assert config == {} and "needs more CPUs" in report.sections[0][1]
        return
    assert config == {"stub_device_cpus": [allowed[-1]]}
    assert report.data["device_cpus"] == {"device": allowed[-1], "rest": allowed[:-1]}
    assert sorted(os.sched_getaffinity(0)) == allowed  # this process is pinned only once its supervisors run
