"""CPU priority inside a worker (worker.priority): the guest's thread below the threads that drive
the device.

Each check runs in a child process: a thread's raised nice value cannot be lowered again without
privilege, and the module's spawner is per process. The child prints what it saw as JSON; the
nice values come from ``/proc/self/task/<tid>/stat`` (what the kernel schedules by), not from the
module's own bookkeeping.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values: Linux")]

ROOT = Path(__file__).resolve().parents[2]

#: the child's common part: the nice value and kernel name of a thread, by native id
PRELUDE = r"""
import json, os, threading
from worker import priority

def nice(tid):
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])

def comm(tid):
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()

def in_thread(fn):
    out = {}
    def body():
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = repr(exc)
    t = threading.Thread(target=body)
    t.start()
    t.join(60)
    if "error" in out:
        raise RuntimeError(out["error"])
    return out["value"]

base = nice(threading.get_native_id())
"""


def child(body: str) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", PRELUDE + body], cwd=ROOT, capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_a_lowered_thread_starts_device_threads_at_the_normal_priority() -> None:
    """The executor lowers itself; a thread it starts through start_thread runs at the priority it
    had (the spawner's), one it starts plainly at its own lowered one."""
    seen = child(r"""
def lowered_thread():
    me = threading.get_native_id()
    assert priority.lower_current_thread(5)
    seen = {"me": nice(me), "lowered": priority.lowered()}
    got = {}
    def record(key):
        got[key] = nice(threading.get_native_id())
    t = threading.Thread(target=record, args=("via_start_thread",))
    priority.start_thread(t)
    t.join(30)
    t = threading.Thread(target=record, args=("plain",))
    t.start()
    t.join(30)
    seen.update(got)
    return seen

seen = in_thread(lowered_thread)
seen["base"] = base
seen["main_after"] = nice(threading.get_native_id())
seen["main_lowered"] = priority.lowered()
print(json.dumps(seen))
""")
    base = int(seen["base"])  # type: ignore[call-overload]
    lowered = min(19, base + 5)
    assert seen["me"] == lowered and seen["lowered"] is True
    assert seen["via_start_thread"] == base  # the device thread: above the guest's
    assert seen["plain"] == lowered  # a thread the guest's thread starts plainly: the guest's priority
    assert seen["main_after"] == base and seen["main_lowered"] is False  # only the calling thread


def test_the_device_and_epoch_threads_keep_the_normal_priority_and_name_themselves() -> None:
    """What a bound worker's executor starts after it lowered itself - the device queue's thread (on
    the first queued op) and the WASM epoch thread (on the first run) - runs at the normal priority,
    under its own kernel name."""
    seen = child(r"""
import wasmtime
from worker.device_time import DeviceQueue
from worker.wasm.host import EpochTicker

def lowered_thread():
    assert priority.lower_current_thread(3)
    ran = threading.Event()
    queue = DeviceQueue(lambda items: (ran.set(), (len(items), None))[1], lambda: None)
    from worker.device_time import _Item
    queue.submit(_Item("fill", lambda: None, (), None, 0, 0, 0, None, -1, False))
    assert queue.sync(None)
    ticker = EpochTicker(wasmtime.Engine(wasmtime.Config()))
    ticker.prestart()
    import time
    end = time.monotonic() + 30
    while True:  # a started thread names itself first thing: wait for the name, not a duration
        threads = {comm(int(t)): nice(int(t)) for t in os.listdir("/proc/self/task")
                   if int(t) != threading.get_native_id()}
        if "twt-wasm-epoch" in threads or time.monotonic() > end:
            break
        time.sleep(0.001)
    queue.close()
    ticker.close()
    return {"me": nice(threading.get_native_id()), "threads": threads}

seen = in_thread(lowered_thread)
seen["base"] = base
print(json.dumps(seen))
""")
    base = int(seen["base"])  # type: ignore[call-overload]
    threads = seen["threads"]
    assert isinstance(threads, dict)
    assert seen["me"] == min(19, base + 3)
    assert threads.get("twt-device") == base, threads
    assert threads.get("twt-wasm-epoch") == base, threads


def test_no_steps_changes_nothing() -> None:
    """0 steps (``worker_guest_nice = 0``): no spawner, no lowered thread, start_thread is a plain
    start."""
    seen = child(r"""
def body():
    changed = priority.lower_current_thread(0)
    got = {}
    t = threading.Thread(target=lambda: got.update(n=nice(threading.get_native_id())))
    priority.start_thread(t)
    t.join(30)
    return {"changed": changed, "me": nice(threading.get_native_id()), "child": got["n"],
            "spawner": priority._spawner is not None}

seen = in_thread(body)
seen["base"] = base
print(json.dumps(seen))
""")
    assert seen["changed"] is False and seen["spawner"] is False
    assert seen["me"] == seen["base"] and seen["child"] == seen["base"]


def test_a_refused_setpriority_is_logged_and_lowers_nothing() -> None:
    """A kernel (or seccomp policy) that refuses ``setpriority``: the bind goes on at the normal
    priority, the thread is not counted as lowered (its threads start plainly), a warning says why."""
    seen = child(r"""
import errno, logging, io
from shared.log import get_logger
buf = io.StringIO()
get_logger("worker").addHandler(logging.StreamHandler(buf))
def refuse(*args):
    raise PermissionError(errno.EACCES, "refused")
os.setpriority = refuse

def body():
    return {"changed": priority.lower_current_thread(5), "lowered": priority.lowered(),
            "me": nice(threading.get_native_id())}

seen = in_thread(body)
seen["base"] = base
seen["log"] = buf.getvalue()
print(json.dumps(seen))
""")
    assert seen["changed"] is False and seen["lowered"] is False
    assert seen["me"] == seen["base"]
    assert "worker.guest_nice_failed" in str(seen["log"])


def test_a_pool_workers_start_runs_below_and_every_thread_comes_back() -> None:
    """``lower_start`` (a pool worker's start, first thing in its process): the calling thread and
    the threads it starts afterwards run below the normal priority; ``restore_start`` (warmed or
    bound) brings every one of them back, once; a second call changes nothing."""
    seen = child(r"""
import os
from shared.prctl import may_raise_priority
me = threading.get_native_id()
if not may_raise_priority(base):
    print(json.dumps({"skip": True}))
    raise SystemExit(0)
assert priority.lower_start(4)
assert not priority.lower_start(4)  # once a process
stop = threading.Event()
t = threading.Thread(target=stop.wait, daemon=True)
t.start()
while t.native_id is None:
    pass
seen = {"me_low": nice(me), "thread_low": nice(t.native_id)}
priority.restore_start()
seen.update(me_back=nice(me), thread_back=nice(t.native_id))
priority.restore_start()
seen.update(me_again=nice(me), base=base)
stop.set()
print(json.dumps(seen))
""")
    if seen.get("skip"):
        pytest.skip("a thread here may not raise its priority back (no CAP_SYS_NICE, RLIMIT_NICE)")
    low = min(19, int(seen["base"]) + 4)  # type: ignore[call-overload]
    assert seen["me_low"] == low and seen["thread_low"] == low
    assert seen["me_back"] == seen["base"] and seen["thread_back"] == seen["base"] and seen["me_again"] == seen["base"]


def test_no_start_steps_changes_nothing() -> None:
    seen = child(r"""
changed = priority.lower_start(0)
priority.restore_start()
print(json.dumps({"changed": changed, "me": nice(threading.get_native_id()), "base": base}))
""")
    assert seen["changed"] is False and seen["me"] == seen["base"]


def test_the_device_thread_asks_for_a_short_time_slice_and_keeps_its_nice_value() -> None:
    """The device queue's thread (the driver) runs with a short time slice (``se.slice`` in
    ``/proc/self/task/<tid>/sched``: 0.3 ms, against the default ~1-3 ms), so that its wake-ups
    preempt guest code on its core and a burst of launches is not preempted at its first 0.1 ms; a
    thread asking for the kernel's shortest (0.1 ms, the stub's executor) gets it, its nice value
    kept. Skipped where the kernel shows no slice (before Linux 6.12's EEVDF custom slices)."""
    seen = child(r"""
from shared.prctl import short_slice
from worker import device_time
from worker.device_time import DEVICE_SLICE_NS, DeviceQueue, _Item

def sched_slice(tid):
    with open(f"/proc/self/task/{tid}/sched") as f:
        for line in f:
            if line.startswith("se.slice"):
                return int(line.split(":")[1])
    return None

def lowered_thread():
    me = threading.get_native_id()
    assert priority.lower_current_thread(2)
    before = sched_slice(me)
    asked = short_slice(DEVICE_SLICE_NS)
    return {"before": before, "asked": asked, "after": sched_slice(me), "nice": nice(me)}

seen = in_thread(lowered_thread)
queue = DeviceQueue(lambda items: (len(items), None), lambda: None)
queue.submit(_Item("fill", lambda: None, (), None, 0, 0, 0, None, -1, False))
assert queue.sync(None)
tid = queue.thread_id
seen["device"] = sched_slice(tid)
seen["device_comm"] = comm(tid)
queue.close()
seen["want"] = DEVICE_SLICE_NS
seen["want_driver"] = getattr(device_time, "DRIVER_SLICE_NS", None)
seen["base"] = base
print(json.dumps(seen))
""")
    if seen["before"] is None:
        pytest.skip("this kernel shows no time slice per thread (no EEVDF custom slices)")
    assert seen["asked"] is True and seen["after"] == seen["want"] == 100_000
    assert seen["nice"] == min(19, int(seen["base"]) + 2)  # type: ignore[call-overload]
    assert seen["device_comm"] == "twt-device"
    # the driver's own slice: under the guests' ~1.4 ms, over a burst of launches (0.3 ms)
    assert seen["device"] == 300_000, seen
    assert seen["want_driver"] == 300_000
