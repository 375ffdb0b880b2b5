"""The stub's device on a core of its own (``stub_device_cpus``): at bind the worker's threads keep to
the CPUs left and its device thread runs only on its device's CPU (worker.device_time.pin_device), read
back with ``os.sched_getaffinity(native_id)``; where the setting cannot apply nothing changes. Each case
runs in a child process: affinity is per thread and inherited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import timeouts
from worker.backends import stub_executor
from worker.server import _device_cpus

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import json, os, sys, threading
from shared.quota import QuotaBlock
from worker.backends.stub import StubBackend
from worker.device_time import DeviceGate, pin_device
owner = QuotaBlock.create('cpus')
blk = QuotaBlock.attach(owner.name, instance=0)
be = StubBackend()
gate = DeviceGate(blk, be)
buf = be.alloc(256)
before = sorted(os.sched_getaffinity(0))
other = threading.Thread(target=threading.Event().wait, args=(30,), daemon=True)
other.start()
def op():
    gate.submit('scale_f32', be.scale_f32, (buf, 2.0, 64))
    gate.sync()
if START_FIRST:
    op()  # the device thread exists before the pin
applied = pin_device(gate, CPUS)
op()
driver = gate.queue.thread_id
executor = gate._executor
dev = executor.thread_id if executor is not None else driver
print(json.dumps({'applied': applied, 'before': before, 'main': sorted(os.sched_getaffinity(0)),
                  'other': sorted(os.sched_getaffinity(other.native_id)),
                  'device': sorted(os.sched_getaffinity(dev)), 'executor': executor is not None,
                  'driver': sorted(os.sched_getaffinity(driver))}))
gate.release(); gate.close(); blk.close(); owner.unlink(); owner.close()
"""


def _run(cpus: object, start_first: bool, executor: bool = True) -> dict[str, object]:
    code = _CHILD.replace("START_FIRST", repr(start_first)).replace("CPUS", repr(cpus))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TWT_STUB_EXECUTOR": "1" if executor else "0"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeouts.scaled(60), cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("executor", [True, False], ids=["executor", "python-device-thread"])
@pytest.mark.parametrize("start_first", [False, True], ids=["device-thread-later", "device-thread-running"])
def test_the_device_thread_runs_on_its_cpus_and_the_rest_of_the_worker_elsewhere(start_first: bool,
                                                                                  executor: bool) -> None:
    """The device - the stub's executor thread where it is built (its driver, the Python device thread,
    then stays with the worker's other threads), else the Python device thread - on its CPU."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    out = _run([allowed[-1]], start_first, executor)
    assert out["applied"] is True
    assert out["device"] == [allowed[-1]]
    assert out["main"] == out["other"] == allowed[:-1]
    if out["executor"]:
        assert out["driver"] == allowed[:-1]
    else:
        assert not executor or not stub_executor.available()
        assert out["driver"] == [allowed[-1]]


def test_every_cpu_for_the_device_leaves_the_worker_as_it_was() -> None:
    out = _run(sorted(os.sched_getaffinity(0)), True)
    assert out["applied"] is False
    assert out["main"] == out["other"] == out["device"] == out["before"]


def test_a_cpu_the_process_may_not_use_leaves_the_worker_as_it_was() -> None:
    out = _run([65_000], False)
    assert out["applied"] is False
    assert out["main"] == out["other"] == out["device"] == out["before"]


def test_a_bind_reads_its_devices_cpu_from_the_options() -> None:
    assert _device_cpus([[0, 1], [1, 3]], 1) == (3,)
    assert _device_cpus([[0, 1]], 2) == ()
    assert _device_cpus(None, 0) == ()
    assert _device_cpus([[0, "x"], "bad", [0]], 0) == ()
