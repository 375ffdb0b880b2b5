"""``python -m tests.helpers.idle_profile [--interval S] [--log PREFIX] -- CMD ...``: where a test
run's wall time goes that is not CPU.

On a machine with fewer cores than xdist workers, the run's wall time is its CPU plus the time the
cores sit idle because every worker waits at once (a timeout running out, a sleep, a poll interval,
Ray's start), plus the tail: the last modules running alone. ``time`` and the CPU log
(tests/helpers/cpu_profile.py) cannot tell those apart. This runs CMD with
``PYTEST_TWT_CPU_LOG=PREFIX`` (each test's start, end and CPU, per xdist worker) while it samples
``/proc/stat`` every ``--interval`` seconds (0.25) for the CPUs CMD may run on (its affinity:
``taskset -c 1`` is read from this process's own, so wrap this command, not CMD), then joins the
two and prints:

* the CPUs' idle and iowait over the run (others' processes on those CPUs count as busy: run it
  quiet);
* each sample's idle shared out among the tests running on the workers then, summed per module and
  per test: what waits on a duration while nothing else has work;
* the workers' timeline: when each started its first test and ended its last, and how long the run
  had fewer workers inside a test than it started (the tail, and the starts).

The samples go to ``PREFIX.stat`` (one line per sample: time, idle and iowait jiffies, summed over
the CPUs), so ``python -m tests.helpers.idle_profile --report PREFIX`` prints the same again.

    taskset -c 1 .venv/bin/python -m tests.helpers.idle_profile --log /tmp/run1 -- \\
        tests/run-suite.sh -n 3 --dist loadscope --no-loadscope-reorder -q
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

__all__ = ["Sample", "TestSpan", "main", "report"]

_TICK = float(os.sysconf("SC_CLK_TCK"))


@dataclass(frozen=True)
class Sample:
    """Jiffies at one instant, summed over the watched CPUs (``/proc/stat``)."""

    t: float
    idle: int
    iowait: int
    total: int


@dataclass(frozen=True)
class TestSpan:
    """One test as the CPU log recorded it (``cpu_profile.Recorder``)."""

    worker: str
    nodeid: str
    t0: float
    t1: float
    cpu: float

    @property
    def module(self) -> str:
        return self.nodeid.split("::", 1)[0]


def _read_stat(cpus: set[int]) -> Sample:
    idle = iowait = total = 0
    now = time.time()
    with open("/proc/stat", encoding="ascii") as f:
        for line in f:
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *fields = line.split()
            if int(name[3:]) not in cpus:
                continue
            values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
            idle += values[3]
            iowait += values[4]
            total += sum(values)
    return Sample(now, idle, iowait, total)


def _sampler(cpus: set[int], interval: float, out: list[Sample], stop: threading.Event) -> None:
    while True:
        out.append(_read_stat(cpus))
        if stop.wait(interval):
            out.append(_read_stat(cpus))
            return


def _load_spans(prefix: str) -> list[TestSpan]:
    # PREFIX.gwN per xdist worker; PREFIX.main is a run without xdist, or (beside workers) the
    # child pytest a test runs inside its own, already inside that test's time
    paths = sorted(glob.glob(prefix + ".gw*")) or glob.glob(prefix + ".main")
    spans = []
    for path in paths:
        worker = path.rsplit(".", 1)[1]
        with open(path, encoding="utf-8") as f:
            for raw in f:
                line = json.loads(raw)
                spans.append(TestSpan(worker, line["id"], line["t0"], line["t1"], line["cpu"]))
    return spans


def _load_samples(prefix: str) -> list[Sample]:
    with open(prefix + ".stat", encoding="ascii") as f:
        return [Sample(float(t), int(i), int(w), int(n)) for t, i, w, n in (line.split() for line in f)]


def _blame(samples: list[Sample], spans: list[TestSpan]) -> tuple[dict[str, float], dict[str, float], float]:
    """Each sample interval's idle (seconds, iowait included) shared among the tests that ran in it,
    in proportion to the part of the interval each ran: per test, per module, and what no test
    ran beside (the start, the gaps between tests, the end)."""
    by_test: dict[str, float] = defaultdict(float)
    by_module: dict[str, float] = defaultdict(float)
    outside = 0.0
    spans = sorted(spans, key=lambda s: s.t0)
    for a, b in zip(samples, samples[1:]):
        idle = (b.idle - a.idle + b.iowait - a.iowait) / _TICK
        if idle <= 0 or b.t <= a.t:
            continue
        overlaps = []
        for span in spans:
            if span.t0 >= b.t:
                break
            part = min(b.t, span.t1) - max(a.t, span.t0)
            if part > 0:
                overlaps.append((span, part))
        weight = sum(part for _, part in overlaps)
        if weight <= 0:
            outside += idle
            continue
        for span, part in overlaps:
            by_test[span.nodeid] += idle * part / weight
            by_module[span.module] += idle * part / weight
    return by_test, by_module, outside


def _busy_workers(spans: list[TestSpan], t0: float, t1: float, step: float = 0.1) -> list[int]:
    """How many workers are inside a test at each ``step`` from ``t0`` to ``t1``."""
    count = max(1, int((t1 - t0) / step) + 1)
    busy = [0] * count
    for span in spans:
        first = max(0, int((span.t0 - t0) / step))
        last = min(count - 1, int((span.t1 - t0) / step))
        for i in range(first, last + 1):
            busy[i] += 1
    return busy


def report(prefix: str, top: int = 25) -> str:
    """The summary printed after a run (see the module docstring)."""
    samples = _load_samples(prefix)
    spans = _load_spans(prefix)
    start, end = samples[0].t, samples[-1].t
    total = (samples[-1].total - samples[0].total) / _TICK
    idle = (samples[-1].idle - samples[0].idle) / _TICK
    iowait = (samples[-1].iowait - samples[0].iowait) / _TICK
    out = [f"wall {end - start:.1f} s; the watched CPUs: {total:.1f} s, idle {idle:.1f} s, iowait {iowait:.1f} s "
           f"({100 * (idle + iowait) / max(total, 1e-9):.1f} % not busy)"]
    if not spans:
        return "\n".join([*out, f"no CPU log at {prefix}.<worker>"])
    by_test, by_module, outside = _blame(samples, spans)
    cpu = sum(s.cpu for s in spans)
    out.append(f"{len(spans)} tests, {cpu:.1f} s of CPU in tests (the CPU log's); idle outside any test "
               f"{outside:.1f} s (start-up, collection, the gaps between tests, the end)")
    walls: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for s in spans:
        walls[s.module][0] += s.t1 - s.t0
        walls[s.module][1] += s.cpu
    out.append(f"{'idle s':>8} {'wall s':>8} {'cpu s':>8}  module (idle shared among the tests running then)")
    for name, secs in sorted(by_module.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"{secs:8.1f} {walls[name][0]:8.1f} {walls[name][1]:8.1f}  {name}")
    span_of = {s.nodeid: s for s in spans}
    out.append(f"{'idle s':>8} {'wall s':>8} {'cpu s':>8}  test")
    for nodeid, secs in sorted(by_test.items(), key=lambda kv: -kv[1])[:top]:
        s = span_of[nodeid]
        out.append(f"{secs:8.1f} {s.t1 - s.t0:8.1f} {s.cpu:8.1f}  {nodeid}")
    workers: dict[str, list[TestSpan]] = defaultdict(list)
    for s in spans:
        workers[s.worker].append(s)
    out.append("worker: first test starts, last test ends (s from the run's start), in tests s, last module")
    for name, mine in sorted(workers.items()):
        mine.sort(key=lambda s: s.t0)
        in_tests = sum(s.t1 - s.t0 for s in mine)
        out.append(f"  {name}: {mine[0].t0 - start:7.1f} {mine[-1].t1 - start:7.1f} {in_tests:7.1f}  {mine[-1].module}")
    step = 0.1
    busy = _busy_workers(spans, start, end, step)
    n = len(workers)
    first_full = next((i for i, b in enumerate(busy) if b >= n), len(busy))
    last_full = max((i for i, b in enumerate(busy) if b >= n), default=0)
    hist = [0.0] * (n + 1)
    for b in busy:
        hist[min(b, n)] += step
    out.append(f"all {n} workers inside a test from {first_full * step:.1f} s to {last_full * step:.1f} s; "
               f"the tail after it {end - start - last_full * step:.1f} s")
    out.append("time with k workers inside a test: " + ", ".join(f"{k}: {secs:.1f} s" for k, secs in enumerate(hist)))
    idle_tail = (samples[-1].idle + samples[-1].iowait
                 - _at(samples, start + last_full * step)) / _TICK
    out.append(f"idle in the tail: {idle_tail:.1f} s")
    return "\n".join(out)


def _at(samples: list[Sample], t: float) -> int:
    """Idle + iowait jiffies at the last sample before ``t``."""
    best = samples[0]
    for s in samples:
        if s.t > t:
            break
        best = s
    return best.idle + best.iowait


def main(argv: list[str]) -> int:
    interval, prefix = 0.25, ""
    while argv and argv[0] != "--":
        if argv[0] == "--interval":
            interval, argv = float(argv[1]), argv[2:]
        elif argv[0] == "--log":
            prefix, argv = argv[1], argv[2:]
        elif argv[0] == "--report":
            print(report(argv[1]))
            return 0
        else:
            print(__doc__, file=sys.stderr)
            return 2
    argv = argv[1:]
    if not argv or not prefix:
        print(__doc__, file=sys.stderr)
        return 2
    cpus = os.sched_getaffinity(0)
    samples: list[Sample] = []
    stop = threading.Event()
    thread = threading.Thread(target=_sampler, args=(cpus, interval, samples, stop), daemon=True)
    thread.start()
    code = subprocess.call(argv, env={**os.environ, "PYTEST_TWT_CPU_LOG": prefix})
    stop.set()
    thread.join()
    with open(prefix + ".stat", "w", encoding="ascii") as f:
        f.writelines(f"{s.t:.3f} {s.idle} {s.iowait} {s.total}\n" for s in samples)
    print(report(prefix), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
