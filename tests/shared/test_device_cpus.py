"""``stub_device_cpus``: the setting's validation, its resolution per host and the supervisor's side
(shared.device_cpus, supervisor.wiring). Affinity is changed only in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import SupervisorConfig, load_config
from shared.device_cpus import LAST, parse_device_cpus, resolve
from shared.errors import ConfigError
from tests.helpers import timeouts

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("value", "parsed"), [
    ((), ()), ([], ()), ("", ()), ("none", ()), ("last", LAST), (" LAST ", LAST), ([1], (1,)), ("1,3", (1, 3)),
    ([3, 1, 3], (3, 1)), (("2",), (2,)),
])
def test_the_setting_parses(value: object, parsed: object) -> None:
    assert parse_device_cpus(value) == parsed
    assert SupervisorConfig.checked({"stub_device_cpus": value}).stub_device_cpus == parsed


@pytest.mark.parametrize("value", ["first", "1,x", [-1], [True], [1.5], 3, {"0": 1}, [70_000]])
def test_a_bad_setting_is_a_config_error(value: object) -> None:
    with pytest.raises(ValueError, match="stub_device_cpus"):
        SupervisorConfig.checked({"stub_device_cpus": value})


def test_the_setting_comes_from_the_environment_and_the_file(tmp_path: Path) -> None:
    cfg = load_config(None, environ={"TWT_STUB_DEVICE_CPUS": "1,2", "TWT_RUN_DIR": str(tmp_path)})
    assert cfg.stub_device_cpus == (1, 2)
    assert cfg.to_dict()["stub_device_cpus"] == [1, 2]
    path = tmp_path / "t.toml"
    path.write_text('[supervisor]\nstub_device_cpus = "last"\n')
    assert load_config(path, environ={"TWT_RUN_DIR": str(tmp_path)}).stub_device_cpus == LAST
    with pytest.raises(ValueError, match="stub_device_cpus"):  # (a ConfigError where the file names it)
        load_config(None, environ={"TWT_STUB_DEVICE_CPUS": "one", "TWT_RUN_DIR": str(tmp_path)})
    path.write_text("[supervisor]\nstub_device_cpus = [1.5]\n")
    with pytest.raises(ConfigError, match="stub_device_cpus"):
        load_config(path, environ={"TWT_RUN_DIR": str(tmp_path)})


def test_resolve_gives_each_stub_device_a_cpu_and_leaves_one_for_the_rest() -> None:
    assert resolve((), [0], {0, 1}) == ({}, "")
    assert resolve(LAST, [0], {0, 1}) == ({0: 1}, "")
    assert resolve(LAST, [1, 0], {0, 1, 2, 3}) == ({0: 2, 1: 3}, "")
    assert resolve((1,), [0, 2], {0, 1}) == ({0: 1, 2: 1}, "")  # cycled: both devices on CPU 1
    assert resolve((2, 3), [0], {0, 1, 2, 3}) == ({0: 2}, "")


@pytest.mark.parametrize(("setting", "allowed", "why"), [
    (LAST, {0}, "needs more CPUs"),
    (LAST, {0, 1}, "needs more CPUs"),  # two devices on two CPUs: none left
    ((5,), {0, 1}, "not in this process's affinity set"),
    ((0, 1), {0, 1}, "would be left"),
])
def test_resolve_falls_back_where_the_setting_cannot_apply(setting: tuple[int, ...] | str, allowed: set[int],
                                                          why: str) -> None:
    devices = [0, 1] if allowed == {0, 1} and setting == LAST else [0]
    cpus, reason = resolve(setting, devices, allowed)
    assert cpus == {}
    assert why in reason


def _child(code: str, *args: str) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeouts.scaled(30), cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


_SUPERVISOR_SIDE = """
import json, os, sys
from shared.config import SupervisorConfig
from supervisor.lifecycle.backend_select import BackendChoice
from shared.records import ProbedDevice
from supervisor.wiring import _stub_device_cpus
cfg = SupervisorConfig(run_dir=sys.argv[1], stub_device_cpus=SETTING)
choice = BackendChoice('stub', '', {'capacity_bytes': 1 << 20}, (ProbedDevice(0, 1 << 20, 1 << 20, 'stub'),))
before = sorted(os.sched_getaffinity(0))
out = _stub_device_cpus(cfg, choice)
print(json.dumps({'before': before, 'after': sorted(os.sched_getaffinity(0)),
                  'device_cpus': out.options.get('device_cpus')}))
"""


def test_the_supervisor_names_the_device_cpu_and_keeps_to_the_rest(tmp_path: Path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    out = _child(_SUPERVISOR_SIDE.replace("SETTING", "'last'"), str(tmp_path))
    assert out["device_cpus"] == [[0, allowed[-1]]]
    assert out["after"] == allowed[:-1]


@pytest.mark.parametrize("setting", ["(65000,)", "()"])
def test_the_supervisor_ignores_a_setting_that_cannot_apply(setting: str, tmp_path: Path) -> None:
    out = _child(_SUPERVISOR_SIDE.replace("SETTING", setting), str(tmp_path))
    assert out["device_cpus"] is None
    assert out["after"] == out["before"]
